"""Held-out loss during training (`Evaluation`, a Trainer callback), and test-time loop
evaluation of trained checkpoints."""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

from flt_diag.analysis import metric_names as M
from flt_diag.training.callbacks import Callback
from flt_diag.data.batches import batch_generator, get_batch
from flt_diag.data.corpus import TokenData

VAL_SEED = 1234567  # validation batches are the same for every run and every evaluation


@torch.no_grad()
def evaluate(model, data: TokenData, batch_size: int, seq_len: int, batches: int,
             device: str | torch.device = "cpu", loops: int | None = None) -> float:
    """Mean cross-entropy (nats/token) of the final loop over `batches` fixed validation batches."""
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(batches):
        x, y = get_batch(data, batch_size, seq_len, batch_generator(VAL_SEED, i), device)
        logits = model(x, loops=loops)
        total += F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()).item()
    model.train(was_training)
    return total / batches


class Evaluation(Callback):
    """val_loss every `eval_every` steps (not after the last) and once when training ends - unless it
    ended on a non-finite loss - under the run's autocast. Every rank computes it (no collective
    operations); the row goes to the callbacks' `on_rows` (the metrics table, the mirrors)."""

    def on_step_end(self, trainer, step: int) -> None:
        t, done = trainer.cfg.train, step + 1
        if t.eval_every and done % t.eval_every == 0 and done < t.steps:
            self.run(trainer, step)

    def on_finish(self, trainer, step: int) -> None:
        if trainer.stop_reason is None or trainer.prediction is not None:
            self.run(trainer, step)

    @staticmethod
    def run(trainer, step: int) -> None:
        t = trainer.cfg.train
        with trainer.autocast():
            val = evaluate(trainer.model, trainer.val_data, t.batch_size, trainer.cfg.model.sequence_len,
                           t.eval_batches, trainer.device)
        trainer.emit(step, [(step, M.VAL_LOSS, M.NONE, M.NONE, val)])


def eval_loops(run_dir: Path, loops: list[int], batches: int | None = None, data: str | None = None,
               device: str = "cpu") -> pd.DataFrame:
    """Validation loss and perplexity of a run's final checkpoint at each inference loop count.

    Writes <run>/eval_loops.csv (columns: loops, trained_loops, val_loss, perplexity, data, batches)."""
    from flt_diag.analysis.storage import CHECKPOINT, EVAL_LOOPS, StorageError, atomic_path, load_config
    from flt_diag.data.corpus import load_tokens
    from flt_diag.model.transformer import LoopedTransformer, ModelConfig

    run_dir = Path(run_dir)
    ckpt_path = run_dir / CHECKPOINT
    if not ckpt_path.exists():
        raise StorageError(f"{run_dir} has no {CHECKPOINT} (has the run finished?)")
    cfg = load_config(run_dir)
    from flt_diag.training.checkpoint import load
    ckpt = load(ckpt_path, map_location=device)
    try:
        model = LoopedTransformer(ModelConfig(**ckpt["model_config"])).to(device)
        model.load_state_dict(ckpt["model"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise StorageError(f"{ckpt_path} is not a checkpoint of this model: {str(e).splitlines()[0]}") from None
    t = cfg["train"]
    data = data or t["data"]
    val = load_tokens(data, t["tokenizer"], "val", t.get("max_tokens"))
    batches = batches or t["eval_batches"]
    rows = []
    for k in loops:
        loss = evaluate(model, val, t["batch_size"], model.cfg.sequence_len, batches, device, loops=k)
        rows.append(dict(loops=k, trained_loops=model.cfg.loops, val_loss=loss,
                         perplexity=math.exp(min(loss, 700)), data=data, batches=batches))
    df = pd.DataFrame(rows)
    with atomic_path(run_dir / EVAL_LOOPS) as tmp:
        df.to_csv(tmp, index=False)
    return df
