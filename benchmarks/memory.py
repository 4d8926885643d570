"""Peak activation memory of one forward+backward against K, with and without per-loop activation
checkpointing (`model.checkpoint_loops`)."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn as nn

from common import BenchSpec, _quiet_stderr, bench_config
from flt_diag.model.transformer import LoopedTransformer

class SavedBytes:
    """torch.autograd.graph.saved_tensors_hooks that sums the bytes saved for backward: distinct
    storages, parameters excluded (weights saved by the matmuls are not activations). Inside a
    non-reentrant checkpoint the checkpoint's own hooks take over, so what is counted there is
    what the checkpoint keeps: its segment inputs."""

    def __init__(self, model: nn.Module):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: dict[int, int] = {}

    def pack(self, t: torch.Tensor):
        s = t.untyped_storage()
        if s.data_ptr() not in self.params:
            self.seen[s.data_ptr()] = s.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def _cpu_peak_bytes(fn: Callable[[], None]) -> int | None:
    """Peak of live CPU allocator bytes above the level at entry while fn runs: the cumulative sum
    of the profiler's allocation (+) and free (-) records in time order. None if unavailable."""
    from torch.profiler import ProfilerActivity, profile
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    try:
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    except AttributeError:  # pragma: no cover - profiler internals moved
        return None
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def activation_memory(model: LoopedTransformer, x: torch.Tensor, y: torch.Tensor, checkpoint: bool,
                      loops: int, device: str) -> dict:
    """Peak memory of one forward + backward above the level before it (model, optimizer-free),
    and the bytes saved for backward during the forward."""
    model.checkpoint_loops = checkpoint
    model.zero_grad(set_to_none=True)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else contextlib.nullcontext()

    def fwd_bwd(saved: SavedBytes | None = None):
        with autocast, (saved.hooks() if saved else contextlib.nullcontext()):
            _, loss = model(x, y, loops=loops)
        loss.backward()
        model.zero_grad(set_to_none=True)

    fwd_bwd()  # warm-up: lazily allocated buffers do not count
    saved = SavedBytes(model)
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fwd_bwd(saved)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _cpu_peak_bytes(lambda: fwd_bwd(saved))
    return dict(loops=loops, checkpoint=checkpoint, peak_bytes=peak, saved_bytes=saved.total)


def memory_sweep(spec: BenchSpec, variant: str, loops: list[int], device: str) -> list[dict]:
    cfg = bench_config(spec, variant, max(loops), device)
    torch.manual_seed(0)
    model = LoopedTransformer(cfg.model).to(device)  # eager: the memory of the plain model
    model.train()
    g = torch.Generator().manual_seed(0)
    B, T = cfg.train.batch_size, cfg.model.seq_len
    xy = torch.randint(0, cfg.model.vocab_size, (B, T + 1), generator=g).to(device)
    x, y = xy[:, :-1], xy[:, 1:]
    rows = []
    for ckpt in (False, True):
        for K in loops:
            rows.append(activation_memory(model, x, y, ckpt, K, device))
    return rows

