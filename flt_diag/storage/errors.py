"""The errors of the storage layer (one line each in the CLI), below every module that raises them."""


class StorageError(ValueError):
    """A run or sweep folder that cannot be read or written as asked (one line in the CLI)."""


class BadFile(StorageError):
    """A file that does not hold what flt-diag writes there: one line naming the file and the field."""
