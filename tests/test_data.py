import json
import math
import zlib

import numpy as np
import pandas as pd
import pytest
import torch

from flt_diag.data import batches as B
from flt_diag.data import corpus as D


def test_stdlib_split_by_file_is_disjoint_and_nonempty():
    train, val = D.stdlib_files("train"), D.stdlib_files("val")
    assert len(train) > 500 and len(val) > 20
    assert not set(train) & set(val)
    assert all(p.suffix == ".py" and "site-packages" not in p.parts for p in train + val)


def test_stdlib_tokens_are_the_file_bytes(token_cache):
    val = D.load_tokens("stdlib", "bytes", "val")
    expected = b"".join(p.read_text(encoding="utf-8", errors="replace").encode() for p in D.stdlib_files("val"))
    assert len(val) == len(expected)
    assert bytes(np.asarray(val.tokens[:5000])) == expected[:5000]
    assert val.vocab_size == 256
    assert 2.5 < val.unigram_entropy < 5.5  # bytes of Python source


def test_cache_is_reused(tmp_path, monkeypatch):
    f = tmp_path / "a.txt"
    f.write_text("hello world\n" * 500)
    first = D.load_tokens(str(f), "bytes", "train")
    monkeypatch.setattr(D, "_tokenize_to_file", lambda *a, **k: pytest.fail("re-tokenized a cached corpus"))
    again = D.load_tokens(str(f), "bytes", "train")
    assert np.array_equal(first.tokens, again.tokens)


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet"])
def test_local_files_through_datasets(tmp_path, kind):
    docs = [f"document number {i} " * 20 for i in range(60)]
    if kind == "txt":
        (tmp_path / "c.txt").write_text("\n".join(docs))
    elif kind == "jsonl":
        (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs))
    else:
        pd.DataFrame({"text": docs}).to_parquet(tmp_path / "c.parquet")
    path = str(tmp_path / f"c.{kind}")
    spec = D.resolve_corpus(path)
    got = list(D.iter_documents(spec, "train")) + list(D.iter_documents(spec, "val"))
    assert sorted(d.strip() for d in got) == sorted(d.strip() for d in docs)
    assert list(D.iter_documents(spec, "val"))  # every VAL_EVERY-th document by hash


def test_streaming_hub_style_spec_on_local_parquet(tmp_path):
    """The FineWeb-Edu path (streaming=True, text field) on a local file: the train split is every row whose
    index is not held out (crc32 of the index % 20 != 0), in order."""
    pd.DataFrame({"text": [f"edu text {i}" for i in range(100)], "score": range(100)}).to_parquet(tmp_path / "f.parquet")
    hub = D.HUB_CORPORA["fineweb-edu"]
    spec = D.CorpusSpec("parquet", data_files=[str(tmp_path / "f.parquet")], streaming=hub.streaming,
                        text_field=hub.text_field)
    want = [f"edu text {i}" for i in range(100) if zlib.crc32(str(i).encode()) % 20]
    assert list(D.iter_documents(spec, "train")) == want and 80 < len(want) < 100


def test_named_splits_like_wikitext(tmp_path):
    """The WikiText-2 path (named train/validation splits) on local files."""
    (tmp_path / "train.txt").write_text("train line\n" * 5)
    (tmp_path / "valid.txt").write_text("valid line\n" * 3)
    spec = D.CorpusSpec("text", data_files={"train": str(tmp_path / "train.txt"),
                                            "validation": str(tmp_path / "valid.txt")},
                        splits=D.HUB_CORPORA["wikitext2"].splits)
    assert set(D.iter_documents(spec, "val")) == {"valid line"}
    assert len(list(D.iter_documents(spec, "train"))) == 5


def test_missing_text_field(tmp_path):
    (tmp_path / "c.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(D.DataError, match="no 'text' field"):
        list(D.iter_documents(D.resolve_corpus(str(tmp_path / "c.jsonl")), "train"))


def test_bad_data_paths(tmp_path):
    with pytest.raises(D.DataError, match="neither a known corpus"):
        D.resolve_corpus(str(tmp_path / "missing"))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(D.DataError, match="no .txt"):
        D.resolve_corpus(str(tmp_path))


def test_hf_tokenizer_from_local_file(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = [f"def function_{i}(x): return x + {i}" for i in range(300)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["[UNK]"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "c.txt").write_text("\n".join(corpus))
    data = D.load_tokens(str(tmp_path / "corpus"), str(path), "train")
    assert data.vocab_size == tok.get_vocab_size() > 256
    assert data.tokens.dtype == np.uint16
    first = D.get_tokenizer(str(path)).decode(np.asarray(data.tokens[:6]))
    assert "function" in first


def test_unusable_hub_tokenizer_fails_cleanly():
    pytest.importorskip("tokenizers")
    with pytest.raises(D.DataError, match="cannot load tokenizer"):
        D.get_tokenizer("no-such//tokenizer")  # rejected before any network access


def test_batches_shift_by_one_and_are_deterministic(tmp_path):
    data = D.TokenData(np.arange(1000, dtype=np.uint16) % 256, 256, 0.0)
    x, y = B.get_batch(data, 4, 16, B.batch_generator(0, 5))
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(y[:, :-1], x[:, 1:])
    x2, _ = B.get_batch(data, 4, 16, B.batch_generator(0, 5))
    x3, _ = B.get_batch(data, 4, 16, B.batch_generator(0, 6))
    assert torch.equal(x, x2) and not torch.equal(x, x3)


def test_unigram_entropy_known_distribution():
    tokens = np.array([0, 0, 1, 1, 2, 2, 3, 3] * 10, dtype=np.uint8)
    assert D.unigram_entropy(tokens, 256) == pytest.approx(math.log(4))
