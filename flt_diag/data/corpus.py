"""Corpora, tokenizers, an on-disk token cache, and deterministic batches.

Corpora (`--data`): stdlib (the running interpreter's standard-library sources, split by file; the offline
default), fineweb-edu, wikitext2, a local file or folder (docs/guide.md); phop and addition are
flt_diag.data.tasks. Every corpus except stdlib goes through `iter_documents` (`datasets.load_dataset`: hub
names and local files take the same code path). Tokenizers (`--tokenizer`): "bytes" or any Hugging Face one.
Tokens are cached as memory-mapped arrays under $FLT_DIAG_CACHE (default ~/.cache/flt-diag). This module
imports no torch (batches are flt_diag.data.batches), so settling a config can check corpora without it.
"""
from __future__ import annotations

import hashlib
import socket
import json
import os
import sys
import sysconfig
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, cast
from urllib.parse import urlparse

import numpy as np
from huggingface_hub import hf_hub_download

from flt_diag.storage.errors import first_line
from flt_diag.storage.folders import atomic_path, atomic_write_text
from flt_diag.storage.safe_files import open_regular, read_bounded, regular_file

VAL_EVERY = 20  # documents (or files) whose stable hash % VAL_EVERY == 0 form the validation split
LOCAL_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# The largest tokenizer.json read: the biggest of the common ones is ~33 MB (Gemma 3's, 262k tokens; Qwen3's
# ~11 MB, GPT-2's 1.4 MB); a bigger file is not a tokenizer, and reading it (or a device) is refused, bounded.
MAX_TOKENIZER_BYTES = 64 << 20


class DataError(ValueError):
    """A corpus or tokenizer that cannot be used (reported as one line by the CLI)."""


# --------------------------------------------------------------------------- tokenizers

class ByteTokenizer:
    name = "bytes"
    vocab_size = 256
    bos_id = None  # all 256 ids are bytes: documents are concatenated without a separator

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """Any Hugging Face `tokenizers` tokenizer: a hub name or a local tokenizer.json."""

    def __init__(self, name_or_path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise DataError("Hugging Face tokenizers need `pip install tokenizers`") from e
        self.name = name_or_path
        try:
            local = os.path.lexists(name_or_path)  # (a dangling link is a missing file, not a hub name)
            text = _tokenizer_json(name_or_path if local else _hub_file(name_or_path, "tokenizer.json"))
            self.tok = Tokenizer.from_str(text)
        except Exception as e:
            raise DataError(f"cannot load tokenizer {name_or_path!r}: {first_line(e)}") from e
        self.vocab_size = self.tok.get_vocab_size()
        self.bos_id = next((i for t in BOS_TOKENS if (i := self.tok.token_to_id(t)) is not None), None)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text).ids, dtype=np.int64)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])


def _tokenizer_json(path) -> str:
    """A tokenizer.json's text, read as every file a user names is read (safe_files.read_bounded): a device,
    FIFO or folder is refused before it is opened, and at most MAX_TOKENIZER_BYTES are read."""
    try:
        return read_bounded(path, MAX_TOKENIZER_BYTES, "a tokenizer.json").decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{path} is not a tokenizer.json (not UTF-8 text)") from None


# The document delimiter put before every document, the first of these the tokenizer knows: nanochat's
# "<|bos|>", Qwen3's "<|im_start|>" (the reference's get_bos_token_id), GPT-2's "<|endoftext|>", "<s>".
BOS_TOKENS = ("<|bos|>", "<|im_start|>", "<|endoftext|>", "<s>")


def _hub_file(repo: str, filename: str) -> str:
    """A file of a hub repository: from the local cache, else downloaded. Without a route to the
    hub, one DataError at once (the hub client would retry for half a minute, printing each try)."""
    try:
        return hf_hub_download(repo, filename, local_files_only=True)
    except Exception:
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false") or not _hub_reachable():
        raise DataError("it is not in the local Hugging Face cache and the hub "
                        "cannot be reached (no network)")
    return hf_hub_download(repo, filename)


def _hub_reachable(timeout: float = 3.0) -> bool:
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def get_tokenizer(name: str | None):
    """"bytes", or a Hugging Face tokenizer by hub name or tokenizer.json path; None (an imported model's config
    whose tokenizer was not given) is one line saying what to set."""
    if name is None:
        raise DataError("no tokenizer: the run's config.json has train.tokenizer null (a model imported without "
                        "--tokenizer); set it to the tokenizer the model was trained with (a tokenizer.json path "
                        "or hub name), or import again with --tokenizer")
    return ByteTokenizer() if name == "bytes" else HFTokenizer(name)


# --------------------------------------------------------------------------- corpora

@dataclass
class CorpusSpec:
    """Arguments for `datasets.load_dataset`, and how train/val are separated."""

    path: str  # builder or hub dataset name ("text", "json", "parquet", "HuggingFaceFW/fineweb-edu")
    name: str | None = None  # dataset config ("sample-10BT", "wikitext-2-raw-v1")
    data_files: list[str] | dict[str, str] = field(default_factory=list)  # local files (or split -> file)
    text_field: str = "text"
    streaming: bool = False
    splits: dict[str, str] | None = None  # {"train": ..., "val": ...}; None = split by document hash


HUB_CORPORA = {
    "fineweb-edu": CorpusSpec("HuggingFaceFW/fineweb-edu", name="sample-10BT", streaming=True),
    # The reference's corpus (nanochat/dataset.py): FineWeb-Edu reshuffled into parquet shards, read in order.
    "fineweb-edu-100b": CorpusSpec("karpathy/fineweb-edu-100b-shuffle", streaming=True),
    "wikitext2": CorpusSpec("wikitext", name="wikitext-2-raw-v1",
                            splits={"train": "train", "val": "validation", "test": "test"}),
}


def stdlib_files(split: str) -> list[Path]:
    """The interpreter's standard-library .py files (site-packages excluded), split by file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)
    return [p for p in files if _in_split(str(p.relative_to(root)), split)]


def _in_split(key: str, split: str) -> bool:
    is_val = zlib.crc32(key.encode()) % VAL_EVERY == 0
    return is_val if split == "val" else not is_val


def resolve_corpus(data: str) -> CorpusSpec | None:
    """None for the stdlib corpus; otherwise the `load_dataset` arguments."""
    if data == "stdlib":
        return None
    if data in HUB_CORPORA:
        return HUB_CORPORA[data]
    p = Path(data)
    if not p.exists():
        raise DataError(f"data {data!r} is neither a known corpus ({', '.join(['stdlib', *HUB_CORPORA])}) "
                        "nor an existing file or folder")
    files = sorted(f for f in p.rglob("*") if f.suffix in LOCAL_BUILDERS) if p.is_dir() else [p]
    if not files:
        raise DataError(f"no .txt/.jsonl/.parquet files under {data}")
    builders = {LOCAL_BUILDERS.get(f.suffix) for f in files}
    if None in builders or len(builders) != 1:
        raise DataError(f"{data}: need files of one kind among {', '.join(LOCAL_BUILDERS)}")
    for f in files:
        _regular(f)  # a folder named x.txt, a FIFO, a device, a socket: one line, before anything reads it
        if not os.access(f, os.R_OK):
            raise DataError(f"cannot read data file {f}")
    return CorpusSpec(cast(str, builders.pop()), data_files=[str(f.resolve()) for f in files])


def _regular(path: Path) -> None:
    """A local corpus file must be a regular file (or a link to one): safe_files.regular_file, as DataError."""
    try:
        regular_file(path)
    except ValueError as e:
        raise DataError(f"data file: {e}") from None


def _check_local_file(path: Path) -> None:
    """A local corpus file that is not a regular file, empty, or binary where text is expected, said plainly
    (the datasets library would only say that an error occurred while generating the dataset)."""
    _regular(path)
    if path.stat().st_size == 0:
        raise DataError(f"data file {path} is empty")
    if path.suffix in (".txt", ".jsonl", ".json"):
        with open_regular(path) as f:
            head = f.read(4096)
        try:
            head.decode("utf-8")
        except UnicodeDecodeError as e:
            if e.start < len(head) - 4:  # not just a character cut at the end of the sample
                raise DataError(f"data file {path} is not UTF-8 text") from None
        if b"\x00" in head:
            raise DataError(f"data file {path} is binary, not text")
    if path.suffix == ".parquet":  # checked here: the datasets library logs a line of its own before failing
        import pyarrow as pa
        import pyarrow.parquet as pq
        try:
            pq.read_schema(path)
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"data file {path} is not a readable Parquet file ({' '.join(str(e).split())[:120]})") \
                from None


def iter_documents(spec: CorpusSpec, split: str) -> Iterator[str]:
    """Documents of one split, through `datasets.load_dataset` (hub or local alike)."""
    import datasets  # a slow import (benchmarks/README.md): only when a corpus is tokenized

    datasets.disable_progress_bars()  # one error line, not progress bars and library log lines around it
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # (a failure is our one DataError line; its own
    # error log lines, e.g. "Failed to read file", would come before it)
    for f in spec.data_files if isinstance(spec.data_files, list) else []:
        _check_local_file(Path(f))
    kwargs: dict[str, Any] = dict(name=spec.name, streaming=spec.streaming)
    if spec.data_files:
        kwargs["data_files"] = spec.data_files
    try:
        ds = datasets.load_dataset(spec.path, split="train" if spec.splits is None else spec.splits[split], **kwargs)
    except Exception as e:
        raise DataError(f"cannot load {spec.path}: {first_line(e)}") from e
    for i, row in enumerate(ds):
        if spec.splits is None and not _in_split(str(i), split):
            continue
        text = row.get(spec.text_field)
        if text is None:
            raise DataError(f"{spec.path}: rows have no {spec.text_field!r} field (fields: {', '.join(row)})")
        if not isinstance(text, str):
            raise DataError(f"{spec.path}: row {i} has a {spec.text_field!r} that is {type(text).__name__}, not text")
        if text:
            yield text


# --------------------------------------------------------------------------- token cache

@dataclass
class TokenData:
    """Token ids of one split as a flat (memory-mapped) array, plus what we know of them."""

    tokens: np.ndarray
    vocab_size: int
    unigram_entropy: float  # nats per token of the training split's unigram distribution
    path: Path | None = None

    def __len__(self) -> int:
        return len(self.tokens)


def _cache_key(data: str, tokenizer: str, max_tokens: int | None) -> str:
    ident: dict[str, Any] = {"data": data, "tokenizer": tokenizer, "max_tokens": max_tokens, "v": 2}  # v2: BOS before documents
    if data == "stdlib":
        ident["python"] = sys.version
    elif Path(data).exists():
        p = Path(data).resolve()
        ident["data"] = str(p)
        files = sorted(p.rglob("*")) if p.is_dir() else [p]
        ident["stat"] = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def _documents(data: str, split: str) -> Iterator[str]:
    spec = resolve_corpus(data)
    if spec is None:
        for f in stdlib_files(split):
            yield f.read_text(encoding="utf-8", errors="replace")
    else:
        yield from iter_documents(spec, split)


def _tokenize_to_file(data: str, tok, split: str, out: Path, max_tokens: int | None, dtype) -> int:
    n = 0
    with atomic_path(out) as tmp, open(tmp, "wb") as f:
        for doc in _documents(data, split):
            ids = tok.encode(doc).astype(dtype)
            if tok.bos_id is not None:  # documents are delimited as the reference delimits them
                ids = np.concatenate([np.asarray([tok.bos_id], dtype=dtype), ids])
            if max_tokens is not None:
                ids = ids[: max_tokens - n]
            f.write(ids.tobytes())
            n += len(ids)
            if max_tokens is not None and n >= max_tokens:
                break
    return n


def load_tokens(data: str = "stdlib", tokenizer: str = "bytes", split: str = "train",
                max_tokens: int | None = None) -> TokenData:
    """Tokenize (once, cached on disk) and memory-map one split of a corpus."""
    if split not in ("train", "val"):
        raise DataError(f"split must be train or val, got {split!r}")
    tok = get_tokenizer(tokenizer)
    cache = Path(os.environ.get("FLT_DIAG_CACHE", Path.home() / ".cache" / "flt-diag"))
    folder = cache / "tokens" / _cache_key(data, tokenizer, max_tokens)
    meta_path = folder / "meta.json"
    if not meta_path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        dtype = np.uint8 if tok.vocab_size <= 256 else np.uint16 if tok.vocab_size <= 65536 else np.uint32
        meta = {"data": data, "tokenizer": tokenizer, "vocab_size": tok.vocab_size}
        for s in ("train", "val"):
            meta[f"{s}_tokens"] = _tokenize_to_file(data, tok, s, folder / f"{s}.bin",
                                                    max_tokens if s == "train" else None, dtype)
            if meta[f"{s}_tokens"] < 2:
                raise DataError(f"{data}: the {s} split has no text")
        meta["dtype"] = np.dtype(dtype).name
        train = np.memmap(folder / "train.bin", dtype=dtype, mode="r")
        meta["unigram_entropy"] = unigram_entropy(train, tok.vocab_size)
        atomic_write_text(meta_path, json.dumps(meta, indent=1))  # the cache entry exists only once complete
    meta = json.loads(meta_path.read_text())
    tokens = np.memmap(folder / f"{split}.bin", dtype=meta["dtype"], mode="r")
    return TokenData(tokens, meta["vocab_size"], meta["unigram_entropy"], folder)


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy (nats) of the empirical unigram distribution: the loss of the best
    context-free predictor. A model that never gets below it has learned nothing."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, len(tokens), 1 << 24):
        counts += np.bincount(np.asarray(tokens[start:start + (1 << 24)]), minlength=vocab_size)[:vocab_size]
    return entropy(counts / counts.sum())


def entropy(p: np.ndarray) -> float:
    """Entropy (nats) of a distribution `p`."""
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())
