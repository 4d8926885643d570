"""What every benchmark shares: the benchmark sizes (BenchSpec, presets), the settled config of one
benchmarked configuration, the UNROLLED reference (L*K distinct blocks), analytic FLOPs, the timed jobs
(a Trainer step, forward+backward only, a square matmul) and the interleaved round-robin timer."""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python benchmarks/bench.py` from a checkout

from flt_diag.config.run_config import RunConfig, build_config  # noqa: E402
# (VARIANTS is imported from here by bench.py)
from flt_diag.model.transformer import VARIANTS, Block, LoopedTransformer, ModelConfig, norm  # noqa: E402,F401
from flt_diag.training.settle import settle  # noqa: E402
from flt_diag.training.trainer import Trainer  # noqa: E402

def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (a bad value is one argparse line and exit 2)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


# --------------------------------------------------------------------------- presets

@dataclass
class BenchSpec:
    """One benchmark size: a flt_diag preset plus overrides, and how long to time it."""

    base: str  # flt_diag.config.run_config preset
    model: dict = field(default_factory=dict)  # ModelConfig overrides
    train: dict = field(default_factory=dict)  # TrainConfig overrides
    step_loops: int = 12  # K of the timed training steps (parts a-c)
    mem_loops: tuple = (3, 6, 9, 12)  # K of the memory sweep (part d)
    repeats: int = 7  # rounds of the round-robin
    steps_per_sample: int = 3  # training steps per timed sample
    warmup: int = 2  # untimed steps per configuration first
    peak_size: int = 2048  # square matmul timed for the peak rate
    compile: bool | None = None  # compiled blocks: None = as the Trainer decides (on CUDA, not on CPU)
    description: str = ""


BENCH_PRESETS: dict[str, BenchSpec] = {
    # flt_diag's tiny preset: d=64, L=2, 2 heads, seq 64, 16 sequences/step, bytes.
    "tiny": BenchSpec("tiny", step_loops=12, repeats=11, steps_per_sample=3,
                      description="flt_diag tiny: d=64, L=2, 2 heads (head dim 32), seq 64, batch 16"),
    # A CPU size between tiny and small: 4x tiny's width*depth, twice its context.
    "mid": BenchSpec("tiny", model=dict(depth=4, width=128, heads=4, seq_len=128),
                     train=dict(batch_size=16), step_loops=6, repeats=5, steps_per_sample=2, warmup=1,
                     description="mid (CPU): d=128, L=4, 4 heads (head dim 32), seq 128, batch 16"),
    # One H100/H200-class GPU: flt_diag's small preset, bf16 autocast, compiled blocks.
    "gpu": BenchSpec("small", step_loops=6, repeats=7, steps_per_sample=5, warmup=3, peak_size=8192, compile=True,
                     description="flt_diag small: d=384, L=6, 3 heads (head dim 128), seq 512, batch 64"),
}

QUICK = dict(repeats=5, steps_per_sample=2, warmup=1, step_loops=3, mem_loops=(3, 12), peak_size=1024)
QUICK_VARIANTS = ["lt", "flt"]
# --toy: the preset's code path (its compile setting, diagnostics, eager comparison, memory sweep) at
# tiny's shape and a smaller batch, so that e.g. `--preset gpu --toy` runs on a CPU in seconds.
TOY = dict(model=dict(depth=2, width=64, heads=2, seq_len=64), train=dict(batch_size=4),
           repeats=3, steps_per_sample=1, warmup=1, step_loops=3, mem_loops=(2, 3), peak_size=512)


def toy(spec: BenchSpec) -> BenchSpec:
    """`spec` at toy size (TOY): same preset, compile setting and recipe, tiny model and timing."""
    return replace(spec, **{k: v for k, v in TOY.items() if k not in ("model", "train")},
                   model={**spec.model, **TOY["model"]}, train={**spec.train, **TOY["train"]},
                   description=f"{spec.description} -- toy size: d=64, L=2, 2 heads, seq 64, batch 4")

TARGETS = dict(step_vs_unrolled=1.05, diagnostics_overhead=1.05, checkpoint_memory_ratio=1.5)


def bench_config(spec: BenchSpec, variant: str, loops: int, device: str,
                 checkpoint_loops: bool = False, compile: bool | None = None) -> RunConfig:
    """The settled RunConfig of one benchmarked configuration (no evaluation, no resume checkpoints,
    lr held at its base value: the warm-down never starts). `compile` None: the preset's setting, else
    compiled blocks on CUDA and eager on a CPU (`--flops` and `--breakdown` time both on a CPU)."""
    if compile is None:
        compile = spec.compile if spec.compile is not None else device == "cuda"
    train = dict(spec.train, device=device, steps=10**6, eval_every=0, checkpoint_every=0,
                 checkpoint_loops=checkpoint_loops, compile=compile)
    return settle(build_config(spec.base, device == "cuda", model=dict(spec.model, variant=variant, loops=loops),
                               train=train))


# --------------------------------------------------------------------------- the unrolled reference

class UnrolledTransformer(nn.Module):
    """A plain transformer with L*K distinct blocks: the looped model's FLOPs, no weight sharing.

    Same Block, embedding, head, softcap, rotary tables and initialisation as LoopedTransformer;
    the forward is one plain pass norm(E) -> blocks -> norm -> head (the lt variant without its
    K-1 extra norms at loop boundaries). It has `embed`, `blocks`, `head` and `cfg`, so
    flt_diag.model.transformer.parameter_groups, build_optimizers and compile_blocks apply unchanged."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth * cfg.loops))
        self.head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        self.checkpoint_loops = False
        self.table_dtype = torch.float32
        self.rule = VARIANTS["lt"].rule  # no stabiliser: no parameters of its own, no loss term, K loops every step
        self.stabiliser = self.penalty_inputs = None
        self.grad_loops = 0
        LoopedTransformer._rotary(self, cfg.seq_len)  # the same tables, registered as buffers
        LoopedTransformer.reset_parameters(self)  # the same init, applied to all L*K blocks

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, loss_on: str = "end",
                loops: int | None = None):
        if loops not in (None, self.cfg.loops):
            raise ValueError("the unrolled reference runs its L*K blocks: loops must be its own K")
        if loss_on != "end":
            raise ValueError("the unrolled reference has one exit: loss_on must be 'end'")
        T = idx.shape[1]
        if T > self.cos.shape[1]:
            LoopedTransformer._rotary(self, T)
        cos, sin = self.cos[:, :T], self.sin[:, :T]
        x = norm(self.embed(idx))
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.cfg.softcap * torch.tanh(self.head(norm(x)).float() / self.cfg.softcap)
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# --------------------------------------------------------------------------- FLOPs

def matmul_params_per_block(d: int) -> int:
    """Weights of one block that take part in matmuls: q, k, v, o (4 d^2) + up, down (8 d^2)."""
    return 12 * d * d


def train_flops(cfg: ModelConfig, batch_size: int, loops: int | None = None, grad_accum: int = 1) -> dict:
    """Matmul FLOPs of one training step (forward + backward), counted analytically.

    Dense matmuls: 6 * params * tokens (2 forward, 4 backward: input and weight gradients),
      block passes:   6 * tokens * (L*K) * 12 d^2
      head:           6 * tokens * d * V         (the embedding is a lookup: 0 FLOPs)
    Attention (scores Q K^T and the weighted sum A V, 2 T^2 d each per sequence and block pass
      forward, x3 for forward + backward, halved for the causal mask):
      attention:      6 * B * T^2 * d * (L*K)    (= 12 * B * T^2 * d * L*K / 2)
    tokens = B * T * grad_accum. Not counted: norms, rotary, softmax, softcap, the optimizer
    (Muon's Newton-Schulz iterations), recomputation under activation checkpointing."""
    K = cfg.loops if loops is None else loops
    L, d, V, T = cfg.depth, cfg.width, cfg.vocab_size, cfg.seq_len
    B = batch_size * grad_accum
    tokens = B * T
    blocks = 6 * tokens * L * K * matmul_params_per_block(d)
    head = 6 * tokens * d * V
    attention = 6 * B * T * T * d * L * K
    return dict(blocks=blocks, head=head, attention=attention, total=blocks + head + attention, tokens=tokens)


# --------------------------------------------------------------------------- timing

def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class StepJob:
    """One configuration of the timed training step: a started Trainer (`Trainer.start`, whose
    `run_step` is the step `fit` runs: train_step + the per-step host transfer) and its step counter.
    `unrolled`: the Trainer trains UnrolledTransformer instead (same placement, compile, optimizers)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, diagnostics: bool, unrolled: bool = False):
        self.trainer = Trainer(cfg, run_dir, diagnostics=diagnostics, model=UnrolledTransformer if unrolled else None)
        self.trainer.start()
        self.step = 0

    def __call__(self) -> None:
        self.trainer.run_step(self.step)
        self.step += 1

    def close(self) -> None:
        self.trainer.end()


class FwdBwdJob:
    """Forward + backward only (same batch draw and autocast as train_step), on the model of a
    diagnostics-off StepJob; gradients are dropped. Isolates the model from the optimizer.
    `backward = False` (ForwardJob): the forward alone, with autograd recording as in training."""

    backward = True

    def __init__(self, job: StepJob):
        self.trainer = job.trainer
        self.step = 0

    def __call__(self) -> None:
        t = self.trainer
        x, y = t.batch(self.step)
        with t.autocast():
            _, loss = t.ddp_model(x, y, loss_on=t.cfg.train.loss_on)
        if self.backward:
            loss.backward()
            for p in t.model.parameters():
                p.grad = None
        loss.item()  # a sync, as collect() is in the full step
        self.step += 1


class MatmulJob:
    """The machine's own matmul rate: C = A @ B, n x n, fp32 on CPU, bf16 on CUDA."""

    def __init__(self, n: int, device: str):
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        g = torch.Generator().manual_seed(0)
        self.a = torch.randn(n, n, generator=g).to(device, dtype)
        self.b = torch.randn(n, n, generator=g).to(device, dtype)
        self.flops = 2 * n ** 3
        self.inner = 20 if device == "cuda" else 1  # matmuls per call (a GPU matmul is ~1 ms)
        self.device = device

    def __call__(self) -> None:
        for _ in range(self.inner):
            torch.mm(self.a, self.b)
        _sync(self.device)


def time_interleaved(jobs: dict[str, Callable[[], None]], repeats: int, steps_per_sample: int,
                     warmup: int, device: str, seed: int = 0,
                     progress: Callable[[str], None] | None = None) -> tuple[dict, dict]:
    """Seconds per call of every job, `repeats` rounds; each round times `steps_per_sample`
    consecutive calls of every job, in a shuffled order. Sample r of every job is from round r.

    Returns (wall, cpu): wall-clock seconds and this process's CPU seconds per call. With one
    CPU thread the CPU time leaves out the time other processes take the core, so its ratios
    are far less noisy on a shared machine (on CUDA it means nothing and is not reported)."""
    for name, job in jobs.items():
        for _ in range(warmup):
            job()
        _sync(device)
    rng = random.Random(seed)
    wall: dict[str, list[float]] = {name: [] for name in jobs}
    cpu: dict[str, list[float]] = {name: [] for name in jobs}
    names = list(jobs)
    for r in range(repeats):
        rng.shuffle(names)
        for name in names:
            _sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps_per_sample):
                jobs[name]()
            _sync(device)
            wall[name].append((time.perf_counter() - t0) / steps_per_sample)
            cpu[name].append((time.process_time() - c0) / steps_per_sample)
        if progress:
            progress(f"round {r + 1}/{repeats}")
    return wall, cpu


def stats(xs: list[float]) -> dict:
    """Median and interquartile range (q25, q75; the 'inclusive' quartile method)."""
    xs = sorted(xs)
    if len(xs) == 1:
        q25 = q75 = xs[0]
    else:
        q25, _, q75 = statistics.quantiles(xs, n=4, method="inclusive")
    return dict(median=statistics.median(xs), q25=q25, q75=q75, iqr=q75 - q25, min=xs[0], n=len(xs))


def paired(a: list[float], b: list[float], op=lambda x, y: x / y) -> dict:
    """Statistics of op(a_r, b_r) over rounds r (both samples from the same round)."""
    return stats([op(x, y) for x, y in zip(a, b)])


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def environment(device: str) -> dict:
    env = dict(date=_dt.datetime.now().isoformat(timespec="seconds"), python=platform.python_version(),
               torch=torch.__version__, platform=platform.platform(), processor=platform.processor(),
               cpu_count=os.cpu_count(), threads=torch.get_num_threads())
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    return env


@contextlib.contextmanager
def _quiet_stderr():
    """Silence C-level stderr (the profiler prints start/stop lines); Python errors still raise."""
    try:
        fd = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            sys.stderr.flush()
            os.dup2(null.fileno(), 2)
            yield
    finally:
        sys.stderr.flush()
        os.dup2(fd, 2)
        os.close(fd)

