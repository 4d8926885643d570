"""The errors of the storage layer (one line each in the CLI), below every module that raises them."""


class StorageError(ValueError):
    """A run or sweep folder that cannot be read or written as asked (one line in the CLI)."""


class BadFile(StorageError):
    """A file that does not hold what flt-diag writes there: one line naming the file and the field."""


def first_line(e: BaseException, limit: int | None = None) -> str:
    """The first non-blank line of an exception's message (at most `limit` characters), or its type's name where
    the message is empty: an error line that quotes what a library raised never fails on an empty message."""
    text = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    return text[:limit] if limit else text
