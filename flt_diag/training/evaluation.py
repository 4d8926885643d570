"""Held-out loss (and, on a task with answers, exact-match accuracy) during training
(`Evaluation`, a Trainer callback), and test-time loop evaluation of trained checkpoints.

Accuracy (flt_diag.data.tasks): an answer is `answer_len` consecutive targets of a row (one letter
of phop, the w digits of a sum); it is right when the model's most likely token is the target at
every one of its positions, given the true tokens before it (teacher forcing; greedy decoding gets
the same answers right, since a decoder that has been right so far sees exactly those tokens).
`val_accuracy` is the share of held-out answers that are right."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

from flt_diag.storage import metric_names as M
from flt_diag.storage.errors import first_line
from flt_diag.storage.folders import (CHECKPOINT, EVAL_LOOPS, StorageError, atomic_path, folder_lock, load_config,
                                      load_eval_loops, refuse_links)
from flt_diag.data.sources import load_split
from flt_diag.model.transformer import LoopedTransformer, ModelConfig
from flt_diag.training.checkpoint import load
from flt_diag.instruments.callbacks import Callback
from flt_diag.data.batches import batch_generator, get_batch
from flt_diag.data.corpus import TokenData
from flt_diag.data.tasks import IGNORE_INDEX, TaskData

VAL_SEED = 1234567  # validation batches are the same for every run and every evaluation


@dataclass(frozen=True)
class Scores:
    loss: float  # mean cross-entropy (nats per target token: answer tokens only on a task)
    accuracy: float | None  # share of answers right (exact match); None for text, which has no answers


def exact_match(logits: torch.Tensor, targets: torch.Tensor, answer_len: int) -> tuple[int, int]:
    """(answers right, answers) of a batch: logits (B, T, V), targets (B, T) with IGNORE_INDEX
    outside the answers; an answer is `answer_len` consecutive targets of a row, in row order."""
    is_answer = targets != IGNORE_INDEX
    right = (logits.argmax(-1) == targets)[is_answer]  # (number of answer tokens,) row by row
    if right.numel() % answer_len:
        raise ValueError(f"{right.numel()} answer tokens are not answers of {answer_len}")
    answers = right.view(-1, answer_len).all(dim=1)
    return int(answers.sum()), answers.numel()


@torch.no_grad()
def evaluate(model, data: TokenData | TaskData, batch_size: int, seq_len: int, batches: int,
             device: str | torch.device = "cpu", loops: int | None = None) -> Scores:
    """Cross-entropy of the final loop over `batches` fixed validation batches (the mean of their
    means), and on a task the exact-match accuracy of its answers."""
    was_training = model.training
    model.eval()
    total, right, answers = 0.0, 0, 0
    for i in range(batches):
        x, y = get_batch(data, batch_size, seq_len, batch_generator(VAL_SEED, i), device)
        logits = model(x, loops=loops)
        total += F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE_INDEX).item()
        if isinstance(data, TaskData):
            r, n = exact_match(logits, y, data.task.answer_len)
            right, answers = right + r, answers + n
    model.train(was_training)
    return Scores(total / batches, right / answers if answers else None)


class Evaluation(Callback):
    """val_loss (and val_accuracy on a task) every `eval_every` steps (not after the last) and once
    when training ends - unless it ended on a non-finite loss - under the run's autocast. Every rank
    computes it (no collective operations); the rows go to the callbacks' `on_rows` (the metrics
    table, the mirrors)."""

    def on_step_end(self, trainer, step: int) -> None:
        t, done = trainer.cfg.train, step + 1
        if t.eval_every and done % t.eval_every == 0 and done < t.steps:
            self.run(trainer, step)

    def on_finish(self, trainer, step: int) -> None:
        if math.isfinite(trainer.last_loss):  # (every end but a non-finite loss: a stop once decided too)
            self.run(trainer, step)

    @staticmethod
    def run(trainer, step: int) -> None:
        t = trainer.cfg.train
        with trainer.autocast():
            val = evaluate(trainer.model, trainer.val_data, t.batch_size, trainer.cfg.model.seq_len,
                           t.eval_batches, trainer.device)
        rows = [(step, M.VAL_LOSS, M.NONE, M.NONE, val.loss)]
        if val.accuracy is not None:
            rows.append((step, M.VAL_ACCURACY, M.NONE, M.NONE, val.accuracy))
        trainer.call("on_rows", step, rows)


def eval_loops(run_dir: Path, loops: list[int] | None = None, batches: int | None = None, data: str | None = None,
               device: str = "cpu", root: Path | None = None) -> pd.DataFrame:
    """Validation loss, perplexity and (on a task) exact-match accuracy of a run's final checkpoint
    at each inference loop count (default 1 .. 2K, K the loops it was trained with).

    Adds the rows to <run>/eval_loops.csv (columns: loops, trained_loops, val_loss, perplexity, accuracy, data,
    batches; accuracy is empty for text), keyed by data: rows of other data (or batches, or loop counts) already
    there are kept (with_earlier_rows); never written through a link below `root` (the folder the command was
    given: a sweep whose cell is a link to another run is refused before anything is evaluated). Returns this
    evaluation's rows."""
    run_dir = Path(run_dir)
    refuse_links(run_dir / EVAL_LOOPS, root)
    load_eval_loops(run_dir)  # (one that cannot be read: one line before the minutes of evaluation, never replaced)
    model = _final_model(run_dir, device)
    t = load_config(run_dir).run_config().train
    data = data or t.data
    val = load_split(t, model.cfg.seq_len, "val", data)
    if val.vocab_size > model.cfg.vocab_size:  # its tokens would index past the embedding (an IndexError)
        raise StorageError(f"{run_dir / CHECKPOINT}: its model has a vocabulary of {model.cfg.vocab_size} tokens, but "
                           f"{data} (tokenizer {t.tokenizer}) uses {val.vocab_size}: evaluate it on data of its own")
    batches = batches or t.eval_batches
    rows = []
    for k in loops or range(1, 2 * model.cfg.loops + 1):
        scores = evaluate(model, val, t.batch_size, model.cfg.seq_len, batches, device, loops=k)
        rows.append(dict(loops=k, trained_loops=model.cfg.loops, val_loss=scores.loss,
                         perplexity=math.exp(min(scores.loss, 700)),
                         accuracy=math.nan if scores.accuracy is None else scores.accuracy, data=data, batches=batches))
    df = pd.DataFrame(rows)
    with folder_lock(run_dir, root=root):  # (two evaluations of one run at once: each keeps the other's rows)
        table = with_earlier_rows(load_eval_loops(run_dir), df)
        with atomic_path(run_dir / EVAL_LOOPS, root) as tmp:
            table.to_csv(tmp, index=False)
    return df


KEY = ["data", "batches", "loops"]  # what one row of eval_loops.csv measured


def with_earlier_rows(earlier: pd.DataFrame | None, new: pd.DataFrame) -> pd.DataFrame:
    """eval_loops.csv after an evaluation: the rows it held first, then `new`'s. An earlier row is replaced only by
    a measurement of the same thing (KEY: the same data, batches and loop count of the same final checkpoint);
    every other is kept - the run's own corpus beside a task (`--data phop`), and the rows of a file written
    before `data` and `batches` were columns (its key unknown: kept, never matched)."""
    if earlier is None or earlier.empty:
        return new
    old = earlier.reindex(columns=list(dict.fromkeys([*new.columns, *earlier.columns])))
    measured = set(new[KEY].itertuples(index=False, name=None))
    again = [key in measured for key in old[KEY].astype(object).itertuples(index=False, name=None)]
    return pd.concat([old[[not a for a in again]], new], ignore_index=True)


def _final_model(run_dir: Path, device: str):
    """The model of a run's checkpoint.pt (StorageError, one line, when there is none or it does not fit)."""
    ckpt_path = run_dir / CHECKPOINT
    if not ckpt_path.exists():
        raise StorageError(f"{run_dir} has no {CHECKPOINT} (has the run finished?)")
    from flt_diag.storage.files import check_checkpoint
    raw = load(ckpt_path, map_location=device)
    ckpt = check_checkpoint(raw, ckpt_path)  # sizes bounded before the model is built
    try:
        model = LoopedTransformer(ModelConfig(**ckpt.model_config_.model_dump())).to(device)
    except (TypeError, ValueError, RuntimeError, MemoryError) as e:
        raise StorageError(f"{ckpt_path}: cannot build its model: {first_line(e)}") from None
    check_checkpoint(raw, ckpt_path, {k: tuple(v.shape) for k, v in model.state_dict().items()})  # every weight
    try:
        model.load_state_dict(ckpt.model)  # type: ignore[arg-type]  # (the checked state dict: Checkpoint)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise StorageError(f"{ckpt_path} is not a checkpoint of this model: {first_line(e)}") from None
    return model
