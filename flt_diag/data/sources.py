"""A run's data through one door: a text corpus (flt_diag.data.corpus) or a synthetic task with
answers (flt_diag.data.tasks). The Trainer and the evaluation load data here (settling a config checks
it: flt_diag.training.settle.check_data); batches of either kind come from flt_diag.data.batches.get_batch."""
from __future__ import annotations

from flt_diag.config.run_config import TASKS, replaced
from flt_diag.data.corpus import TokenData, load_tokens
from flt_diag.data.tasks import TaskData, load_task


def load_split(train, seq_len: int, split: str, data: str | None = None) -> TokenData | TaskData:
    """Split "train" or "val" of the data a TrainConfig names (or of `data`, e.g. another corpus
    to evaluate on, read with the run's tokenizer and task dials)."""
    data = data or train.data
    if data in TASKS:
        return load_task(replaced(train, data=data, sampling="random"), seq_len, split)
    return load_tokens(data, train.tokenizer, split, train.max_tokens)


def describe(train_data: TokenData | TaskData, val_data: TokenData | TaskData) -> dict:
    """config.json's "corpus": token counts of a corpus, or a task's layout and example."""
    if isinstance(train_data, TaskData):
        return train_data.facts()
    return {"train_tokens": len(train_data), "val_tokens": len(val_data),  # type: ignore[arg-type]  # (one kind)
            "unigram_entropy": train_data.unigram_entropy}
