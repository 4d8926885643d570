"""Import and export checkpoints of the reference implementation (built on karpathy/nanochat): the
state-dict conversion both ways, the reading of a nanochat checkpoint folder, and the run folder an
imported model is written to (`flt-diag import-reference`, read back by `flt-diag eval-loops`).

The reference names its parameters transformer.wte, transformer.h.{i}.attn.c_q|c_k|c_v|c_proj,
transformer.h.{i}.mlp.c_fc|c_proj and lm_head (DESIGN.md §2); flt-diag's names: `_TOP_NAMES`, `_BLOCK_NAMES`.
The reference pads its vocabulary to a multiple of 64 (Vp >= V) and slices the logits back to V;
here the padded rows are dropped instead, which gives the same logits. Keys may carry the prefixes
`_orig_mod.` (torch.compile) or `module.` (DDP). Its variants are named LT, LT_i, LT_ia, FLT_res, FLT.

The one deliberate difference from a model trained by flt-diag: an imported model is built with
`rotary_dtype="bfloat16"`, because the reference keeps its rotary cos/sin tables in bfloat16
(flt-diag's default tables are float32). Everything else is the same formulation.

A nanochat checkpoint folder holds model_<step>.pt (a plain state dict) and meta_<step>.json, whose
"model_config" has sequence_len, vocab_size, n_layer, n_head, n_kv_head, n_embd; the looped
reference adds the loop count ("K"; also read: "n_loops", "loops", "num_loops") and the variant
("model_type": LT, LT_i, ...; also read: "variant", "loop_type"). Explicit arguments of
`import_reference` override the meta file.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import cast

import torch

from flt_diag.model.transformer import VARIANTS, LoopedTransformer, ModelConfig
from flt_diag.storage.errors import first_line
from flt_diag.training.checkpoint import load, save_weights
from flt_diag.config.run_config import RunConfig, TrainConfig, padded_vocab
from flt_diag.storage.files import META_LOOP_KEYS as LOOP_KEYS, META_VARIANT_KEYS as VARIANT_KEYS, check_reference_meta
from flt_diag.storage.reference_meta import MetaModelConfig, ReferenceMeta
from flt_diag.storage.folders import CHECKPOINT, CONFIG, StorageError, read_json, refuse_not_a_folder, write_json

REFERENCE_VARIANTS: dict[str, str] = {"LT": "lt", "LT_i": "lt-ii", "LT_ia": "lt-ai", "FLT_res": "fla", "FLT": "flt"}
PREFIXES = ("_orig_mod.", "module.")
_PREFIXES = re.compile(f"^(?:{'|'.join(map(re.escape, PREFIXES))})+")
DEFAULT_SEQUENCE_LEN = 1024  # nanochat's GPTConfig default, used when neither meta nor caller says

# per-block names: reference suffix -> flt-diag suffix
_BLOCK_NAMES = {"attn.c_q": "attn.q", "attn.c_k": "attn.k", "attn.c_v": "attn.v", "attn.c_proj": "attn.o",
                "mlp.c_fc": "mlp.up", "mlp.c_proj": "mlp.down"}
_TOP_NAMES = {"transformer.wte.weight": "embed.weight", "lm_head.weight": "head.weight"}
_BLOCK_KEY = re.compile(r"^transformer\.h\.(\d+)\.(attn\.c_q|attn\.c_k|attn\.c_v|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")


class ReferenceImportError(ValueError):
    """A reference checkpoint that cannot be imported as asked (one line in the CLI)."""


# --------------------------------------------------------------------------- names and shapes

def variant_name(name: str) -> str:
    """flt-diag's name for a variant given by its flt-diag name (flt) or its reference name, in any case (FLT). Only
    the paper's five: the reference trains no stabiliser, so its checkpoints hold none of a stabiliser's parameters."""
    ours = list(REFERENCE_VARIANTS.values())
    if name in ours:
        return name
    folded = {k.lower(): v for k, v in REFERENCE_VARIANTS.items()}
    if str(name).lower() in folded:
        return folded[str(name).lower()]
    if name in VARIANTS:
        raise ReferenceImportError(f"variant {name!r} is not one the reference trains (a stabiliser's parameters are "
                                   f"not in its checkpoints); choose from {', '.join(REFERENCE_VARIANTS)} (reference) "
                                   f"or {', '.join(ours)}")
    raise ReferenceImportError(f"unknown variant {name!r}; choose from {', '.join(REFERENCE_VARIANTS)} "
                               f"(reference) or {', '.join(ours)}")


def _few(keys, n: int = 3) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:n]) + (f" (+{len(keys) - n} more)" if len(keys) > n else "")


def _flatten(sd: dict) -> dict:
    """The state dict with its keys' prefixes stripped; refuses an empty one and an flt-diag one."""
    if not isinstance(sd, dict) or not sd:
        raise ReferenceImportError("reference checkpoint: expected a non-empty state dict")
    flat: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        k = _PREFIXES.sub("", str(key))  # (stacked: _orig_mod.module.lm_head.weight -> lm_head.weight)
        if k in flat:
            raise ReferenceImportError(f"reference checkpoint: key {k!r} appears twice once prefixes are stripped")
        flat[k] = value
    if "embed.weight" in flat or any(k.startswith("blocks.") for k in flat):
        raise ReferenceImportError("reference checkpoint: this looks like an flt-diag state dict "
                                   "(embed.weight, blocks.*), not a reference one")
    return flat


def _check_keys(flat: dict) -> int:
    """The number of blocks, once the keys are exactly the reference's for it and every value a matrix."""
    layers = sorted({int(m.group(1)) for k in flat if (m := _BLOCK_KEY.match(k))})
    n_layer = layers[-1] + 1 if layers else 0
    expected = set(_TOP_NAMES) | {f"transformer.h.{i}.{s}.weight" for i in range(n_layer) for s in _BLOCK_NAMES}
    missing, unexpected = expected - set(flat), set(flat) - expected
    if missing or unexpected or n_layer == 0:
        parts = ([f"missing {_few(missing)}"] if missing else []) + \
                ([f"unexpected {_few(unexpected)}"] if unexpected else []) + \
                (["no transformer.h.{i} blocks"] if n_layer == 0 else [])
        raise ReferenceImportError("reference checkpoint: " + "; ".join(parts))
    for k, v in flat.items():
        if not isinstance(v, torch.Tensor) or v.dim() != 2:
            raise ReferenceImportError(f"reference checkpoint: {k} is not a matrix")
    return n_layer


def _check_shapes(flat: dict, n_layer: int) -> tuple[int, int]:
    """(padded vocabulary, n_embd) once every matrix has the shape they imply (no grouped-query attention)."""
    wte, head = flat["transformer.wte.weight"], flat["lm_head.weight"]
    padded, d = wte.shape
    if head.shape != wte.shape:
        raise ReferenceImportError(f"reference checkpoint: lm_head.weight is {tuple(head.shape)} but "
                                   f"transformer.wte.weight is {tuple(wte.shape)}")
    for i in range(n_layer):
        c_q, c_k = flat[f"transformer.h.{i}.attn.c_q.weight"], flat[f"transformer.h.{i}.attn.c_k.weight"]
        if c_k.shape[0] != c_q.shape[0] or flat[f"transformer.h.{i}.attn.c_v.weight"].shape[0] != c_q.shape[0]:
            raise ReferenceImportError(
                f"reference checkpoint: grouped-query attention (c_k/c_v have {c_k.shape[0]} rows, c_q "
                f"{c_q.shape[0]}, i.e. n_kv_head != n_head) is not supported by flt-diag")
        want = {"attn.c_q": (d, d), "attn.c_k": (d, d), "attn.c_v": (d, d), "attn.c_proj": (d, d),
                "mlp.c_fc": (4 * d, d), "mlp.c_proj": (d, 4 * d)}
        for s, shp in want.items():
            got = tuple(flat[f"transformer.h.{i}.{s}.weight"].shape)
            if got != shp:
                raise ReferenceImportError(f"reference checkpoint: transformer.h.{i}.{s}.weight is {got}, "
                                           f"expected {shp} for n_embd={d}")
    return padded, d


def convert_state_dict(sd: dict, vocab_size: int | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """A reference state dict in flt-diag's layout, and the dims it implies.

    Padded vocabulary rows of the embedding and head are dropped down to `vocab_size`; without it
    they are kept (a state dict alone does not say how many rows are padding). Tensors come back as
    float32 on the CPU. Returns (state_dict, dims) with dims = n_layer, n_embd, vocab_size (rows
    kept), padded_vocab_size. Raises ReferenceImportError on missing, unexpected or misshapen keys,
    and on grouped-query attention (n_kv_head != n_head), which flt-diag does not implement."""
    flat = _flatten(sd)
    n_layer = _check_keys(flat)
    padded, d = _check_shapes(flat, n_layer)
    if vocab_size is None:
        vocab_size = padded
    elif not 1 <= vocab_size <= padded:
        raise ReferenceImportError(f"reference checkpoint: vocab_size {vocab_size} does not fit the "
                                   f"{padded} rows of the embedding")

    out: dict[str, torch.Tensor] = {}
    for k, v in flat.items():
        v = v.detach().to("cpu", torch.float32)
        if k in _TOP_NAMES:
            out[_TOP_NAMES[k]] = v[:vocab_size].clone()
        else:
            m = cast(re.Match, _BLOCK_KEY.match(k))  # (every other key is a block's: _check_keys)
            out[f"blocks.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.weight"] = v.clone()
    return out, dict(n_layer=n_layer, n_embd=d, vocab_size=vocab_size, padded_vocab_size=padded)


def export_reference(model: LoopedTransformer) -> dict[str, torch.Tensor]:
    """The model's weights in the reference layout (vocab padded with zero rows to a multiple of 64)."""
    sd = model.state_dict()
    V, d = sd["embed.weight"].shape
    padded = padded_vocab(V)

    def pad(w):
        return torch.cat([w, w.new_zeros(padded - V, d)]) if padded > V else w

    out = {"transformer.wte.weight": pad(sd["embed.weight"]).detach().cpu().clone()}
    for i in range(len(model.blocks)):
        for theirs, ours in _BLOCK_NAMES.items():
            out[f"transformer.h.{i}.{theirs}.weight"] = sd[f"blocks.{i}.{ours}.weight"].detach().cpu().clone()
    out["lm_head.weight"] = pad(sd["head.weight"]).detach().cpu().clone()
    return out


# --------------------------------------------------------------------------- files

def _checkpoint_file(path: Path) -> Path:
    """A model_<step>.pt file, or the newest one in a folder."""
    if path.is_dir():
        found = sorted(path.glob("model_*.pt"), key=lambda p: (len(p.stem), p.stem))
        if not found:
            raise ReferenceImportError(f"{path} has no model_*.pt checkpoint")
        path = found[-1]
    if not path.exists():
        raise ReferenceImportError(f"no such checkpoint: {path}")
    return path


def _load_checkpoint(path: Path) -> dict:
    """The state dict of a checkpoint file."""
    try:
        obj = load(path)  # (weights only; a FIFO in its place, a corrupt file: one line)
    except StorageError as e:
        raise ReferenceImportError(str(e)) from None
    wrapped = [w for w in ("model", "state_dict", "model_state_dict") if isinstance(obj, dict)
               and isinstance(obj.get(w), dict)]  # some scripts wrap the state dict
    return obj[wrapped[0]] if wrapped else obj


def _load_meta(meta, checkpoint_path: Path | None) -> tuple[ReferenceMeta, str]:
    """(the meta json's model, empty without one; what it is called in messages): given, read from a path, or
    meta_<step>.json beside model_<step>.pt; checked (flt_diag.storage.files: sizes within the command line's bounds) before
    anything is allocated."""
    if meta is None and checkpoint_path is not None:
        m = re.fullmatch(r"model_(.+)\.pt", checkpoint_path.name)
        guess = checkpoint_path.with_name(f"meta_{m.group(1)}.json") if m else None
        meta = guess if guess is not None and guess.exists() else None
    if meta is None:
        return ReferenceMeta(), "meta"
    if isinstance(meta, dict):
        return check_reference_meta(meta, "the meta dict"), "the meta dict"
    return check_reference_meta(read_json(meta), meta), str(meta)  # unreadable: one StorageError line


def _pick(sources: list[MetaModelConfig], keys: tuple[str, ...]):
    return next((getattr(src, k) for src in sources for k in keys if getattr(src, k) is not None), None)


def import_reference(checkpoint, variant: str | None = None, loops: int | None = None,
                     n_head: int | None = None, vocab_size: int | None = None, meta=None,
                     sequence_len: int | None = None) -> LoopedTransformer:
    """An flt-diag model with the weights of a reference checkpoint; it gives the reference's logits.

    checkpoint: a model_<step>.pt path, a folder of them (the newest is used), or a state dict.
    variant: reference (FLT, LT_i, ...) or flt-diag (flt, lt-ii, ...) name; loops: K the model runs by
    default (forward(loops=k) still chooses any k). Each of variant, loops, n_head, vocab_size and
    sequence_len falls back to the meta json (`meta`: dict or path; by default meta_<step>.json beside
    the checkpoint). n_head is required one way or the other: the weights alone do not fix it.
    Without a vocab size the padded rows are kept; rotary_dtype="bfloat16" (module docstring)."""
    path = _checkpoint_file(Path(checkpoint)) if isinstance(checkpoint, (str, Path)) else None
    info, meta_name = _load_meta(meta, path)  # checked before the weights are read
    sd = _load_checkpoint(path) if path is not None else checkpoint
    sources = [s for s in (info.sizes, info) if s is not None]  # model_config's sizes first

    vocab_size = vocab_size if vocab_size is not None else _pick(sources, ("vocab_size",))
    state, dims = convert_state_dict(sd, vocab_size=vocab_size)
    for name in ("n_layer", "n_embd"):
        stated = _pick(sources, (name,))
        if stated is not None and int(stated) != dims[name]:
            raise ReferenceImportError(f"{meta_name} says {name}={stated} but the weights have {name}={dims[name]}")

    n_head = n_head if n_head is not None else _pick(sources, ("n_head",))
    if n_head is None:
        raise ReferenceImportError("the number of heads is unknown: pass n_head= or a meta json with model_config.n_head")
    n_kv_head = _pick(sources, ("n_kv_head",))
    if n_kv_head is not None and int(n_kv_head) != int(n_head):
        raise ReferenceImportError(f"grouped-query attention (n_kv_head={n_kv_head}, n_head={n_head}) "
                                   "is not supported by flt-diag")
    given = variant is not None
    variant = variant if given else _pick(sources, VARIANT_KEYS)
    if variant is None:
        raise ReferenceImportError("the variant is unknown: pass variant= (LT, LT_i, LT_ia, FLT_res, FLT) "
                                   "or a meta json with it")
    loops = loops if loops is not None else _pick(sources, LOOP_KEYS)
    if loops is None:
        raise ReferenceImportError("the loop count is unknown: pass loops= or a meta json with n_loops")
    sequence_len = sequence_len or _pick(sources, ("sequence_len",)) or DEFAULT_SEQUENCE_LEN

    try:
        variant = variant_name(variant)
    except ReferenceImportError as e:
        if given:
            raise
        raise ReferenceImportError(f"{meta_name}: {e}") from None
    try:
        cfg = ModelConfig(vocab_size=dims["vocab_size"], depth=dims["n_layer"], width=dims["n_embd"],
                          heads=int(n_head), seq_len=int(sequence_len), variant=variant,
                          loops=int(loops), rotary_dtype="bfloat16")
        model = LoopedTransformer(cfg)
    except (ValueError, TypeError, RuntimeError, MemoryError) as e:  # (sizes are bounded; memory may still lack)
        raise ReferenceImportError(f"reference checkpoint: {first_line(e)}") from None
    try:
        model.load_state_dict(state)
    except RuntimeError as e:  # (names and shapes were checked above; whatever still disagrees is one line)
        raise ReferenceImportError(f"reference checkpoint: {first_line(e)}") from None
    return model


def write_imported_run(model: LoopedTransformer, out_dir, source: str, step: int = 0,
                       tokenizer: str | None = None, data: str = "stdlib") -> Path:
    """A run folder (config.json + checkpoint.pt) for an imported model, usable by `flt-diag eval-loops`.

    config.json is a full RunConfig dict plus "imported_from": source. The tokenizer is "bytes" for
    a 256-token vocabulary; otherwise pass the one the reference used (a tokenizer.json path), or the
    folder gets tokenizer null and a "note" saying to set it. No summary.json is written: an imported
    model has no training history here."""
    out = Path(out_dir)
    refuse_not_a_folder(out, "a run folder", "choose another folder")
    if out.exists() and any(out.iterdir()):
        raise StorageError(f"{out} exists and is not empty; choose another folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StorageError(f"cannot create run folder {out}: {e.strerror}") from None
    V = model.cfg.vocab_size
    note = None
    if tokenizer is None and V == 256:
        tokenizer = "bytes"
    elif tokenizer is None:
        note = (f"vocab_size {V}: set train.tokenizer to the tokenizer the reference was trained with "
                "(a tokenizer.json path or hub name) before running eval-loops")
    cfg = RunConfig(model=model.cfg, train=TrainConfig(data=data, tokenizer=tokenizer), preset="custom")
    doc = {**cfg.to_dict(), "imported_from": str(source)}
    if note:
        doc["note"] = note
    write_json(out / CONFIG, doc)
    save_weights(out / CHECKPOINT, model.cpu(), model.cfg.to_dict(), int(step))
    return out
