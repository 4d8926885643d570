"""Deterministic batches of a tokenized corpus (flt_diag.data.corpus.TokenData) as torch tensors:
random windows (`get_batch`, drawn by `batch_generator`) or the corpus in order (`stream_batch`); and of a
synthetic task (flt_diag.data.tasks.TaskData), rows drawn by id (`get_batch`)."""
from __future__ import annotations

import hashlib

import numpy as np
import torch

from flt_diag.data.corpus import DataError, TokenData
from flt_diag.data.tasks import TaskData


def batch_generator(seed: int, step: int, micro: int = 0, rank: int = 0) -> torch.Generator:
    """Each (seed, step, micro-batch, rank) draws its own batch: resuming at any step is exact."""
    key = hashlib.sha256(f"{seed}/{step}/{micro}/{rank}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & ((1 << 63) - 1))


def get_batch(data: TokenData | TaskData, batch_size: int, seq_len: int, generator: torch.Generator,
              device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: x (B, T) and its next-token targets y (B, T). Of a synthetic task
    (flt_diag.data.tasks.TaskData): B rows named by the generator, answer tokens the only targets."""
    if isinstance(data, TaskData):
        if seq_len != data.seq_len:
            raise DataError(f"{data.task.name} rows hold {data.seq_len} tokens, asked for {seq_len}")
        x, y = data.arrays(torch.randint(0, 1 << 62, (batch_size,), generator=generator).tolist())
        return _to_device(torch.from_numpy(x), device), _to_device(torch.from_numpy(y), device)
    n = len(data.tokens) - seq_len - 1
    if n <= 0:
        raise DataError(f"corpus has {len(data.tokens)} tokens, fewer than a sequence of {seq_len + 1}")
    starts = torch.randint(0, n, (batch_size,), generator=generator).tolist()
    buf = np.stack([np.asarray(data.tokens[s:s + seq_len + 1], dtype=np.int64) for s in starts])
    xy = _to_device(torch.from_numpy(buf), device)
    return xy[:, :-1], xy[:, 1:]


def stream_batch(data: TokenData, batch_size: int, seq_len: int, index: int,
                 device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch number `index` of the corpus read in order, as the reference's loader reads it:
    B*T + 1 consecutive tokens from position index * B*T (wrapping round at the end), x the first
    B*T as (B, T), y the same shifted by one. A function of the index alone, so resuming is exact."""
    span = batch_size * seq_len
    n = len(data.tokens) - span - 1
    if n <= 0:
        raise DataError(f"corpus has {len(data.tokens)} tokens, fewer than a micro-batch of {span + 1}")
    start = (index * span) % n
    buf = _to_device(torch.from_numpy(np.asarray(data.tokens[start:start + span + 1], dtype=np.int64)), device)
    return buf[:-1].view(batch_size, seq_len), buf[1:].view(batch_size, seq_len)


def _to_device(tokens: torch.Tensor, device) -> torch.Tensor:
    if torch.device(device).type == "cuda":
        tokens = tokens.pin_memory().to(device, non_blocking=True)
    return tokens
