"""An error line that quotes what a library raised never fails itself: a message that is empty, or starts with
blank lines, gives the exception's first non-blank line, else its type's name (storage.errors.first_line)."""
import pytest
import tokenizers

from flt_diag.data.corpus import DataError, HFTokenizer
from flt_diag.storage.errors import first_line


@pytest.mark.parametrize("error, expected", [
    (RuntimeError(), "RuntimeError"),
    (ValueError("   \n\t\n"), "ValueError"),
    (OSError("\n\n  the disk is full  \nsecond line"), "the disk is full"),
    (KeyError("model"), "'model'"),
])
def test_first_line_of_a_message(error, expected):
    assert first_line(error) == expected


def test_first_line_keeps_at_most_limit_characters():
    assert first_line(ValueError("x" * 500), 100) == "x" * 100


def test_a_tokenizer_that_raises_with_no_message_is_one_data_error(tmp_path, monkeypatch):
    def silent(text):
        raise RuntimeError()  # (a library error with an empty message: str(e) is "")
    monkeypatch.setattr(tokenizers.Tokenizer, "from_str", staticmethod(silent))
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    with pytest.raises(DataError, match=r"cannot load tokenizer .*: RuntimeError$"):
        HFTokenizer(str(path))
