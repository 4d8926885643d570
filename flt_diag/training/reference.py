"""Writing an imported reference model as a run folder (`flt-diag import-reference`): the conversion
itself is flt_diag/model/reference.py; this module adds the folder (config.json + checkpoint.pt) that
`flt-diag eval-loops` reads, and so sits with the checkpoint code."""
from __future__ import annotations

from pathlib import Path

from flt_diag.analysis.storage import CHECKPOINT, CONFIG, StorageError, write_json
from flt_diag.config import RunConfig, TrainConfig
from flt_diag.model.transformer import LoopedTransformer
from flt_diag.training.checkpoint import save_weights


def write_imported_run(model: LoopedTransformer, out_dir, source: str, step: int = 0,
                       tokenizer: str | None = None, data: str = "stdlib") -> Path:
    """A run folder (config.json + checkpoint.pt) for an imported model, usable by `flt-diag eval-loops`.

    config.json is a full RunConfig dict plus "imported_from": source. The tokenizer is "bytes" for
    a 256-token vocabulary; otherwise pass the one the reference used (a tokenizer.json path), or the
    folder gets tokenizer null and a "note" saying to set it. No summary.json is written: an imported
    model has no training history here."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise StorageError(f"{out} exists and is not empty; choose another folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StorageError(f"cannot create run folder {out}: {e.strerror}") from None
    V = model.cfg.vocab_size
    note = None
    if tokenizer is None:
        if V == 256:
            tokenizer = "bytes"
        else:
            note = (f"vocab_size {V}: set train.tokenizer to the tokenizer the reference was trained with "
                    "(a tokenizer.json path or hub name) before running eval-loops")
    cfg = RunConfig(model=model.cfg, train=TrainConfig(data=data, tokenizer=tokenizer), preset="custom")
    doc = {**cfg.to_dict(), "imported_from": str(source)}
    if note:
        doc["note"] = note
    write_json(out / CONFIG, doc)
    save_weights(out / CHECKPOINT, model.cpu(), model.cfg.to_dict(), int(step))
    return out
