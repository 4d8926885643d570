"""Performance benchmarks of the looped transformer, in one process, interleaved.

    python benchmarks/bench.py [--preset tiny|mid|gpu] [--variants lt flt ...] [--loops 3 6 9 12]
                               [--step-loops K] [--repeats N] [--out results.json] [--toy]
                               [--device cpu|cuda] [--threads N] [--quick] [--profile]
                               [--eager-variants V ...]
    python benchmarks/bench.py --flops [--loops 3 6 9 12] [--variants flt] [--preset tiny]
    python benchmarks/bench.py --flops --sweep runs/ablation-tiny

What is measured (README.md in this folder has the formulas and the measured numbers):

  a. training-step time of each variant (flt_diag.training.trainer.Trainer.run_step, the step `fit` runs:
     forward, backward, clipping, the Muon/AdamW recipe of flt_diag.training.optim.build_optimizers, + the
     per-step host transfer) against an UNROLLED reference: L*K distinct flt_diag.model.transformer.Block
     modules run as one plain pass, same embedding / head / softcap, same optimizer recipe, trained
     by the same Trainer (`Trainer(..., model=UnrolledTransformer)`); with --eager-variants, also
     the step with compilation off (compiled vs eager on CUDA);
  b. the same step with full diagnostics (DiagnosticsCallback, default DiagnosticsConfig, recording
     every step, exactly as the Trainer runs it) against the step without;
  c. achieved FLOP/s of the step (analytic matmul FLOPs, `train_flops`) against this machine's own
     measured matmul rate (`--peak-size`, fp32 on CPU, bf16 on CUDA) -> MFU;
  d. peak activation memory of one forward+backward against K, with and without per-loop
     activation checkpointing (`model.checkpoint_loops`).
  --flops: only the achieved FLOP rate per K against the measured matmul peak (a table K -> step
     time, GFLOP/s, % of peak): of the Trainer's step with diagnostics, timed here at each K of
     --loops, or with --sweep of the runs of a finished sweep (wall time / steps, from summary.json).

Timing is round-robin: every round runs one sample (`steps_per_sample` steps) of every
configuration, in a freshly shuffled order, and ratios are taken within a round (paired), so
drifts of a shared machine cancel. Reported: median and interquartile range over the rounds.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python benchmarks/bench.py` from a checkout

from flt_diag.config import RunConfig, build_config  # noqa: E402
from flt_diag.model.transformer import VARIANTS, Block, LoopedTransformer, ModelConfig, norm  # noqa: E402
from flt_diag.settle import settle  # noqa: E402
from flt_diag.training.trainer import Trainer  # noqa: E402


# --------------------------------------------------------------------------- presets

@dataclass
class BenchSpec:
    """One benchmark size: a flt_diag preset plus overrides, and how long to time it."""

    base: str  # flt_diag.config preset
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
    "mid": BenchSpec("tiny", model=dict(n_layer=4, n_embd=128, n_head=4, sequence_len=128),
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
TOY = dict(model=dict(n_layer=2, n_embd=64, n_head=2, sequence_len=64), train=dict(batch_size=4),
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
    lr held at its base value: the warm-down never starts). `compile` None: as the Trainer decides
    (compiled blocks on CUDA, eager on CPU)."""
    train = dict(spec.train, device=device, steps=10**6, eval_every=0, checkpoint_every=0,
                 checkpoint_loops=checkpoint_loops, compile=spec.compile if compile is None else compile)
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
        self.embed = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer * cfg.loops))
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.checkpoint_loops = False
        self.table_dtype = torch.float32
        LoopedTransformer._rotary(self, cfg.sequence_len)  # the same tables, registered as buffers
        LoopedTransformer.reset_parameters(self)  # the same init, applied to all L*K blocks

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, loss_on: str = "end"):
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
    L, d, V, T = cfg.n_layer, cfg.n_embd, cfg.vocab_size, cfg.sequence_len
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
    diagnostics-off StepJob; gradients are dropped. Isolates the model from the optimizer."""

    def __init__(self, job: StepJob):
        self.trainer = job.trainer
        self.step = 0

    def __call__(self) -> None:
        t = self.trainer
        x, y = t.batch(self.step)
        with t.autocast():
            _, loss = t.ddp_model(x, y, loss_on=t.cfg.train.loss_on)
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


# --------------------------------------------------------------------------- achieved FLOP rate per K

def matmul_peak(n: int, device: str, repeats: int = 5) -> dict:
    """This machine's measured matmul rate: an n x n torch.mm (fp32 on CPU at the current thread
    count, bf16 on CUDA), timed `repeats` times after a warm-up. `peak` is the best rate (sharing
    the machine only slows a matmul down), `median` the median."""
    job = MatmulJob(n, device)
    job()
    rates = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        job()
        rates.append(job.flops * job.inner / (time.perf_counter() - t0))
    return dict(peak=max(rates), median=statistics.median(rates), size=n, repeats=repeats,
                dtype="bfloat16" if device == "cuda" else "float32")


def flops_rows(runs: list[tuple[RunConfig, float]], peak: float) -> list[dict]:
    """One row per K from (config, seconds per step) pairs: median step time, analytic GFLOP per
    step (`train_flops`, per process), achieved GFLOP/s and its share of `peak` (medians over the
    runs at that K)."""
    by_k: dict[int, list[tuple[float, float]]] = {}
    for cfg, step_s in runs:
        t = cfg.train
        by_k.setdefault(cfg.model.loops, []).append(
            (step_s, train_flops(cfg.model, t.batch_size, grad_accum=t.grad_accum)["total"]))
    rows = []
    for K, xs in sorted(by_k.items()):
        rate = statistics.median(f / s for s, f in xs)
        rows.append(dict(loops=K, runs=len(xs), step_s=statistics.median(s for s, _ in xs),
                         gflop_per_step=statistics.median(f for _, f in xs) / 1e9,
                         gflops=rate / 1e9, pct_of_peak=100 * rate / peak))
    return rows


def sweep_step_times(sweep: Path) -> list[tuple[RunConfig, float]]:
    """(config, seconds per step) of every finished run of a sweep (or one run) folder: its training
    wall time over its steps - evaluation, diagnostics and checkpoints included, as the sweep ran."""
    from flt_diag.analysis.storage import load_config, load_summary, run_dirs
    out = []
    for d in run_dirs(sweep):
        s = load_summary(d)
        if s and s.get("wall_time") and s.get("steps_done"):
            out.append((RunConfig.from_dict(load_config(d)), s["wall_time"] / s["steps_done"]))
    return out


def timed_step_times(spec: BenchSpec, variant: str, loops: list[int], device: str, seed: int = 0,
                     log: Callable[[str], None] = lambda m: None) -> list[tuple[RunConfig, float]]:
    """(config, median seconds per step) at each K: the Trainer's step with its default diagnostics,
    as a sweep runs it, timed round-robin over the K."""
    with tempfile.TemporaryDirectory(prefix="flt-bench-") as tmp:
        jobs = {K: StepJob(bench_config(spec, variant, K, device), Path(tmp) / f"K{K}", diagnostics=True)
                for K in loops}
        wall, _ = time_interleaved(jobs, spec.repeats, spec.steps_per_sample, spec.warmup, device, seed, progress=log)
        for job in jobs.values():
            job.close()
    return [(jobs[K].trainer.cfg, statistics.median(wall[K])) for K in loops]


def format_flops(res: dict) -> str:
    pk = res["peak"]
    lines = [f"achieved FLOP rate per K ({res['source']}); analytic matmul FLOPs (train_flops: 6 N tokens "
             f"+ attention) against the measured matmul peak {pk['peak'] / 1e9:.1f} GFLOP/s "
             f"({pk['size']}^2 {pk['dtype']} torch.mm, best of {pk['repeats']}; median {pk['median'] / 1e9:.1f}), "
             f"{res['threads']} thread(s)",
             f"{'K':>4s} {'runs':>5s} {'step ms':>10s} {'GFLOP/step':>11s} {'GFLOP/s':>9s} {'% of peak':>10s}"]
    lines += [f"{r['loops']:4d} {r['runs']:5d} {1e3 * r['step_s']:10.1f} {r['gflop_per_step']:11.3f} "
              f"{r['gflops']:9.2f} {r['pct_of_peak']:9.1f}%" for r in res["rows"]]
    return "\n".join(lines)


def flops_main(args: argparse.Namespace, spec: BenchSpec) -> int:
    """`--flops`: time the step at each K of --loops (first of --variants, default flt); `--sweep DIR`:
    the step times a finished sweep achieved. Either way a table K -> step time, GFLOP/s, % of peak."""
    if args.sweep is not None:
        runs = sweep_step_times(args.sweep)
        if not runs:
            print(f"error: {args.sweep} has no finished runs with a wall time", file=sys.stderr)
            return 2
        source = f"sweep {args.sweep}"
    else:
        loops = args.loops or [3, 6, 9, 12]
        variant = (args.variants or ["flt"])[0]
        source = (f"{variant}, preset {args.preset}, {args.device}, diagnostics on, {spec.repeats} rounds x "
                  f"{spec.steps_per_sample} steps")
        runs = timed_step_times(spec, variant, loops, args.device, args.seed, _log)
    peak = matmul_peak(spec.peak_size, args.device)
    res = dict(source=source, peak=peak, threads=torch.get_num_threads(), rows=flops_rows(runs, peak["peak"]),
               env=environment(args.device))
    print(format_flops(res))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1, default=str))
        print(f"results: {args.out}")
    return 0


# --------------------------------------------------------------------------- memory

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
    B, T = cfg.train.batch_size, cfg.model.sequence_len
    xy = torch.randint(0, cfg.model.vocab_size, (B, T + 1), generator=g).to(device)
    x, y = xy[:, :-1], xy[:, 1:]
    rows = []
    for ckpt in (False, True):
        for K in loops:
            rows.append(activation_memory(model, x, y, ckpt, K, device))
    return rows


# --------------------------------------------------------------------------- the benchmark

def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_benchmarks(spec: BenchSpec, variants: list[str], device: str = "cpu", diag_variants: list[str] | None = None,
                   memory_variant: str = "flt", seed: int = 0, profile: bool = False,
                   verbose: bool = True, fwd_bwd: bool = True, eager_variants: list[str] = ()) -> dict:
    """Parts a-d. Returns the results as a JSON-ready dict. `eager_variants`: also time their step
    with compilation off (on CUDA: compiled vs eager; on CPU both are eager)."""
    log = _log if verbose else (lambda msg: None)
    diag_variants = variants if diag_variants is None else [v for v in diag_variants if v in variants]
    K = spec.step_loops
    results: dict = dict(spec=asdict(spec), variants=variants, diag_variants=diag_variants, device=device,
                         threads=torch.get_num_threads())
    with tempfile.TemporaryDirectory(prefix="flt-bench-") as tmp:
        tmp = Path(tmp)
        jobs: dict[str, Callable[[], None]] = {}
        step_jobs: list[StepJob] = []
        log(f"building {len(variants) + len(diag_variants) + 1} trainers (K={K}, {device})")
        for v in variants:
            step_jobs.append(StepJob(bench_config(spec, v, K, device), tmp / f"step-{v}", diagnostics=False))
            jobs[f"step:{v}"] = step_jobs[-1]
            if fwd_bwd:
                jobs[f"fb:{v}"] = FwdBwdJob(step_jobs[-1])
        for v in diag_variants:
            step_jobs.append(StepJob(bench_config(spec, v, K, device), tmp / f"diag-{v}", diagnostics=True))
            jobs[f"diag:{v}"] = step_jobs[-1]
        for v in eager_variants:
            step_jobs.append(StepJob(bench_config(spec, v, K, device, compile=False), tmp / f"eager-{v}",
                                     diagnostics=False))
            jobs[f"eager:{v}"] = step_jobs[-1]
        unrolled = StepJob(bench_config(spec, "lt", K, device), tmp / "unrolled", diagnostics=False, unrolled=True)
        step_jobs.append(unrolled)
        jobs["unrolled"] = unrolled
        if fwd_bwd:
            jobs["fb:unrolled"] = FwdBwdJob(unrolled)
        peak_job = MatmulJob(spec.peak_size, device)
        jobs["matmul"] = peak_job
        model_cfg = step_jobs[0].trainer.cfg.model
        n_blocks = len(unrolled.trainer.model.blocks)
        log(f"timing: {spec.repeats} rounds x {spec.steps_per_sample} steps x {len(jobs)} configurations")
        samples, cpu = time_interleaved(jobs, spec.repeats, spec.steps_per_sample, spec.warmup, device, seed,
                                        progress=log)
        if profile:
            results["profile"] = {name: _profile_step(jobs[name]) for name in
                                  [f"step:{variants[-1]}", "unrolled"] + ([f"diag:{diag_variants[-1]}"]
                                                                           if diag_variants else [])}
        for j in step_jobs:
            j.close()

    t = step_jobs[0].trainer.cfg.train
    flops = train_flops(model_cfg, t.batch_size, K, t.grad_accum)
    peak = [peak_job.flops * peak_job.inner / s for s in samples["matmul"]]
    results["model"] = model_cfg.to_dict()
    results["batch_size"], results["grad_accum"] = t.batch_size, t.grad_accum
    results["unrolled_blocks"] = n_blocks
    results["flops_per_step"] = flops
    results["peak_flops"] = dict(stats(peak), size=spec.peak_size,
                                 dtype="bfloat16" if device == "cuda" else "float32")
    results["samples_s"] = samples
    use_cpu = device == "cpu"
    if use_cpu:
        results["cpu_samples_s"] = cpu

    un = samples["unrolled"]
    rows = []
    for v in variants + ["unrolled"]:
        s = samples["unrolled" if v == "unrolled" else f"step:{v}"]
        row = dict(variant=v, step_s=stats(s), vs_unrolled=paired(s, un),
                   flops_per_s=stats([flops["total"] / x for x in s]),
                   mfu=paired(s, samples["matmul"], lambda x, m: flops["total"] / x / (peak_job.flops * peak_job.inner / m)))
        name = "unrolled" if v == "unrolled" else f"step:{v}"
        if use_cpu:
            row["cpu_step_s"] = stats(cpu[name])
            row["cpu_vs_unrolled"] = paired(cpu[name], cpu["unrolled"])
        if f"fb:{v}" in samples:
            row["fwd_bwd_s"] = stats(samples[f"fb:{v}"])
            if v != "unrolled":
                row["fwd_bwd_vs_unrolled"] = paired(samples[f"fb:{v}"], samples["fb:unrolled"])
                if use_cpu:
                    row["cpu_fwd_bwd_vs_unrolled"] = paired(cpu[f"fb:{v}"], cpu["fb:unrolled"])
        if f"eager:{v}" in samples:
            row["eager_step_s"] = stats(samples[f"eager:{v}"])
            row["compiled_vs_eager"] = paired(s, samples[f"eager:{v}"])
        if f"diag:{v}" in samples:
            d = samples[f"diag:{v}"]
            row["diag_step_s"] = stats(d)
            row["diag_overhead"] = paired(d, s)
            if use_cpu:
                row["cpu_diag_overhead"] = paired(cpu[f"diag:{v}"], cpu[name])
        rows.append(row)
    results["steps"] = rows

    mem_loops = sorted(set(spec.mem_loops))
    log(f"memory: variant {memory_variant}, K in {mem_loops}, with and without checkpointing")
    mem = memory_sweep(spec, memory_variant, mem_loops, device)
    results["memory"] = dict(variant=memory_variant, rows=mem,
                             method="torch.cuda.max_memory_allocated" if device == "cuda" else
                             "torch.profiler allocation records (peak of live bytes)")
    lo, hi = mem_loops[0], mem_loops[-1]
    for ckpt in (False, True):
        by_k = {r["loops"]: r for r in mem if r["checkpoint"] == ckpt}
        key = "checkpoint" if ckpt else "plain"
        results["memory"][f"ratio_{key}"] = dict(
            loops=[lo, hi],
            peak=by_k[hi]["peak_bytes"] / by_k[lo]["peak_bytes"] if by_k[lo]["peak_bytes"] else None,
            saved=by_k[hi]["saved_bytes"] / by_k[lo]["saved_bytes"] if by_k[lo]["saved_bytes"] else None)
    results["targets"] = check_targets(results)
    return results


def _profile_step(job: StepJob, top: int = 15) -> list[dict]:
    """Self time by operator over 3 training steps (torch.profiler), the `top` largest."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with _quiet_stderr(), profile(activities=acts) as prof:
        for _ in range(3):
            job()
    rows = []
    for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]:
        rows.append(dict(op=e.key, calls=e.count // 3, self_cpu_ms=e.self_cpu_time_total / 3e3))
    total = sum(e.self_cpu_time_total for e in prof.key_averages()) / 3e3
    return [dict(op="(total self cpu ms per step)", calls=0, self_cpu_ms=total)] + rows


def check_targets(results: dict) -> dict:
    """The issue's targets. Step: the worst variant's median paired ratio. Diagnostics: the median
    paired ratio pooled over every variant and round (per-variant medians are in the table; the
    worst of five noisy medians is biased upwards). Memory: the checkpointed peak, K max / K min."""
    out = {}
    looped = [r for r in results["steps"] if r["variant"] != "unrolled"]
    worst = max(looped, key=lambda r: r["vs_unrolled"]["median"])
    out["step_vs_unrolled"] = dict(target=TARGETS["step_vs_unrolled"], worst=worst["vs_unrolled"]["median"],
                                   worst_variant=worst["variant"],
                                   met=worst["vs_unrolled"]["median"] <= TARGETS["step_vs_unrolled"])
    if "cpu_vs_unrolled" in worst:
        out["step_vs_unrolled"]["worst_cpu"] = max(r["cpu_vs_unrolled"]["median"] for r in looped)
    diag = [r for r in looped if "diag_overhead" in r]
    if diag:
        wall, cpu = results["samples_s"], results.get("cpu_samples_s")
        pooled = lambda xs: stats([a / b for r in diag for a, b in  # noqa: E731
                                   zip(xs[f"diag:{r['variant']}"], xs[f"step:{r['variant']}"])])
        w = max(diag, key=lambda r: r["diag_overhead"]["median"])
        out["diagnostics_overhead"] = dict(target=TARGETS["diagnostics_overhead"], pooled=pooled(wall),
                                           worst=w["diag_overhead"]["median"], worst_variant=w["variant"],
                                           met=pooled(wall)["median"] <= TARGETS["diagnostics_overhead"])
        if cpu:
            out["diagnostics_overhead"]["pooled_cpu"] = pooled(cpu)
    r = results["memory"]["ratio_checkpoint"]["peak"]
    out["checkpoint_memory_ratio"] = dict(target=TARGETS["checkpoint_memory_ratio"], value=r,
                                          loops=results["memory"]["ratio_checkpoint"]["loops"],
                                          met=r is not None and r <= TARGETS["checkpoint_memory_ratio"])
    return out


# --------------------------------------------------------------------------- output

def _ms(s: dict) -> str:
    return f"{1e3 * s['median']:.1f} [{1e3 * s['q25']:.1f}-{1e3 * s['q75']:.1f}]"


def _x(s: dict) -> str:
    return f"{s['median']:.3f} [{s['q25']:.3f}-{s['q75']:.3f}]"


def format_table(res: dict) -> str:
    spec = res["spec"]
    m = res["model"]
    f = res["flops_per_step"]
    pk = res["peak_flops"]
    lines = [
        f"preset {res['preset']}: {spec['description']}; device {res['device']}, {res['threads']} thread(s)",
        f"timed step: K={spec['step_loops']} loops (L*K = {m['n_layer'] * spec['step_loops']} block passes), "
        f"{spec['repeats']} rounds x {spec['steps_per_sample']} steps, median [q25-q75]",
        f"FLOPs/step (analytic): {f['total'] / 1e9:.2f} GFLOP (blocks {f['blocks'] / 1e9:.2f}, "
        f"attention {f['attention'] / 1e9:.2f}, head {f['head'] / 1e9:.2f}); "
        f"measured peak {pk['median'] / 1e9:.1f} GFLOP/s ({pk['size']}^2 {pk['dtype']} matmul)",
        "",
        f"{'variant':9s} {'step ms':>21s} {'looped/unrolled':>20s} {'(cpu)':>6s} {'fwd+bwd ms':>21s} "
        f"{'looped/unrolled':>20s} {'(cpu)':>6s} {'GFLOP/s':>8s} {'MFU':>6s}",
    ]
    cpu = lambda r, k: f"{r[k]['median']:.3f}" if k in r else ""  # noqa: E731
    for r in res["steps"]:
        unr = "" if r["variant"] == "unrolled" else _x(r["vs_unrolled"])
        fb = _ms(r["fwd_bwd_s"]) if "fwd_bwd_s" in r else ""
        fbr = _x(r["fwd_bwd_vs_unrolled"]) if "fwd_bwd_vs_unrolled" in r else ""
        lines.append(f"{r['variant']:9s} {_ms(r['step_s']):>21s} {unr:>20s} "
                     f"{cpu(r, 'cpu_vs_unrolled') if r['variant'] != 'unrolled' else '':>6s} {fb:>21s} {fbr:>20s} "
                     f"{cpu(r, 'cpu_fwd_bwd_vs_unrolled'):>6s} "
                     f"{r['flops_per_s']['median'] / 1e9:8.1f} {100 * r['mfu']['median']:5.1f}%")
    diag = [r for r in res["steps"] if "diag_overhead" in r]
    if diag:
        lines += ["", "diagnostics (DiagnosticsCallback, default config, recording every step):",
                  f"{'variant':9s} {'off ms':>21s} {'on ms':>21s} {'on/off (paired)':>20s} {'(cpu)':>6s}"]
        for r in diag:
            lines.append(f"{r['variant']:9s} {_ms(r['step_s']):>21s} {_ms(r['diag_step_s']):>21s} "
                         f"{_x(r['diag_overhead']):>20s} {cpu(r, 'cpu_diag_overhead'):>6s}")
        t = res["targets"]["diagnostics_overhead"]
        lines.append(f"{'pooled':9s} {'':>21s} {'':>21s} {_x(t['pooled']):>20s} "
                     f"{cpu(t, 'pooled_cpu'):>6s}")
    eager = [r for r in res["steps"] if "compiled_vs_eager" in r]
    if eager:
        lines += ["", "compiled vs eager (the step as the Trainer runs it, compile on / off):",
                  f"{'variant':9s} {'compiled ms':>21s} {'eager ms':>21s} {'compiled/eager':>20s}"]
        lines += [f"{r['variant']:9s} {_ms(r['step_s']):>21s} {_ms(r['eager_step_s']):>21s} "
                  f"{_x(r['compiled_vs_eager']):>20s}" for r in eager]
    lines.append("(cpu): the same paired ratio from this process's CPU time (leaves out time other processes "
                 "hold the core, not slowdowns from sharing it)" if res["device"] == "cpu" else "")
    mem = res["memory"]
    lines += ["", f"activation memory, variant {mem['variant']}, one forward+backward ({mem['method']}):",
              f"{'K':>4s} {'peak MiB':>10s} {'peak MiB ckpt':>14s} {'saved MiB':>10s} {'saved MiB ckpt':>15s}"]
    by = {(r["loops"], r["checkpoint"]): r for r in mem["rows"]}
    mib = lambda b: "n/a" if b is None else f"{b / 2**20:.2f}"  # noqa: E731
    for K in sorted({r["loops"] for r in mem["rows"]}):
        a, c = by[(K, False)], by[(K, True)]
        lines.append(f"{K:4d} {mib(a['peak_bytes']):>10s} {mib(c['peak_bytes']):>14s} "
                     f"{mib(a['saved_bytes']):>10s} {mib(c['saved_bytes']):>15s}")
    for key in ("plain", "checkpoint"):
        r = mem[f"ratio_{key}"]
        lines.append(f"ratio K={r['loops'][1]}/K={r['loops'][0]} {key:10s}: peak {r['peak']:.2f}x, "
                     f"saved {r['saved']:.2f}x")
    lines += ["", "targets:"]
    t = res["targets"]
    a = t["step_vs_unrolled"]
    lines.append(f"  looped step <= {a['target']}x unrolled: worst {a['worst']:.3f}x ({a['worst_variant']}) "
                 f"-> {'MET' if a['met'] else 'MISSED'}")
    if "worst_cpu" in a:
        lines[-1] += f" (cpu time: worst {a['worst_cpu']:.3f}x)"
    if "diagnostics_overhead" in t:
        b = t["diagnostics_overhead"]
        cpu_txt = f", cpu time {100 * (b['pooled_cpu']['median'] - 1):+.1f}%" if "pooled_cpu" in b else ""
        lines.append(f"  diagnostics overhead <= {100 * (b['target'] - 1):.0f}%: pooled median "
                     f"{100 * (b['pooled']['median'] - 1):+.1f}%{cpu_txt}; worst variant "
                     f"{100 * (b['worst'] - 1):+.1f}% ({b['worst_variant']}) -> {'MET' if b['met'] else 'MISSED'}")
    c = t["checkpoint_memory_ratio"]
    val = "n/a" if c["value"] is None else f"{c['value']:.2f}x"
    lines.append(f"  checkpointed peak memory K={c['loops'][1]} <= {c['target']}x K={c['loops'][0]}: {val} "
                 f"-> {'MET' if c['met'] else 'MISSED'}")
    if "profile" in res:
        for name, rows in res["profile"].items():
            lines += ["", f"profile of {name} (self CPU ms per step, top ops):"]
            lines += [f"  {r['self_cpu_ms']:9.2f}  {r['calls']:5d}  {r['op']}" for r in rows]
    return "\n".join(lines)


def environment(device: str) -> dict:
    env = dict(date=_dt.datetime.now().isoformat(timespec="seconds"), python=platform.python_version(),
               torch=torch.__version__, platform=platform.platform(), processor=platform.processor(),
               cpu_count=os.cpu_count(), threads=torch.get_num_threads())
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    return env


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=list(BENCH_PRESETS))
    p.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS),
                   help="variants to time [default: all five; --quick: lt flt]")
    p.add_argument("--diag-variants", nargs="*", default=None,
                   help="variants (among --variants) whose step is also timed with diagnostics "
                        "[default: --variants]")
    p.add_argument("--loops", nargs="+", type=int, default=None,
                   help="K of the memory sweep [default: 3 6 9 12; --quick: 3 12]")
    p.add_argument("--step-loops", type=int, default=None, help="K of the timed steps [default: per preset]")
    p.add_argument("--eager-variants", nargs="*", default=[], choices=list(VARIANTS),
                   help="variants (among --variants) whose step is also timed with compilation off "
                        "(on CUDA: compiled vs eager)")
    p.add_argument("--memory-variant", default="flt", choices=list(VARIANTS))
    p.add_argument("--repeats", type=int, default=None, help="rounds of the round-robin [default: per preset]")
    p.add_argument("--steps-per-sample", type=int, default=None)
    p.add_argument("--out", type=Path, default=None, help="JSON results file")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads [default: 1 on cpu (see README: 2 threads on a shared 2-core box "
                        "are 2-40x slower under contention), torch's default on cuda]")
    p.add_argument("--quick", action="store_true", help="a smoke-test size: < 2 minutes on 2 cores")
    p.add_argument("--toy", action="store_true",
                   help="the preset's code path at toy size (d=64, L=2, batch 4): e.g. --preset gpu --toy "
                        "runs the GPU preset's compiled blocks, diagnostics and eager comparison on a CPU")
    p.add_argument("--profile", action="store_true", help="also profile one looped and the unrolled step")
    p.add_argument("--no-fwd-bwd", action="store_true", help="skip the forward+backward-only timings")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--flops", action="store_true",
                   help="only the achieved FLOP rate per K (--loops) against the measured matmul peak")
    p.add_argument("--sweep", type=Path, default=None,
                   help="with --flops: the rate a finished sweep (or run) folder achieved, from its summaries")
    args = p.parse_args(argv)
    if args.sweep is not None:
        args.flops = True
    for k in args.loops or []:
        if k < 1:
            p.error(f"loops must be >= 1, got {k}")
    if args.diag_variants:
        bad = [v for v in args.diag_variants if v not in VARIANTS]
        if bad:
            p.error(f"unknown variant {bad[0]!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda requested but CUDA is not available on this machine", file=sys.stderr)
        return 2
    spec = replace(BENCH_PRESETS[args.preset])
    if args.quick:
        spec = replace(spec, **QUICK)
    if args.toy:
        spec = toy(spec)
    overrides = dict(step_loops=args.step_loops, repeats=args.repeats, steps_per_sample=args.steps_per_sample,
                     mem_loops=tuple(args.loops) if args.loops else None)
    spec = replace(spec, **{k: v for k, v in overrides.items() if v is not None})
    threads = args.threads or (1 if args.device == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    if args.flops:
        return flops_main(args, spec)
    variants = args.variants or (QUICK_VARIANTS if args.quick else list(VARIANTS))
    diag_variants = args.diag_variants if args.diag_variants is not None else variants
    if len(spec.mem_loops) < 2:
        print("error: --loops needs at least two loop counts for the memory ratio", file=sys.stderr)
        return 2
    if args.device == "cuda" or spec.compile:
        import importlib
        dynamo = importlib.import_module("torch._dynamo")
        for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                     "accumulated_recompile_limit"):
            if hasattr(dynamo.config, name):  # L*K compiled blocks must not fall back to eager
                setattr(dynamo.config, name, max(getattr(dynamo.config, name), 1024))
    t0 = time.perf_counter()
    res = run_benchmarks(spec, variants, args.device, diag_variants, args.memory_variant, args.seed, args.profile,
                         fwd_bwd=not args.no_fwd_bwd, eager_variants=[v for v in args.eager_variants if v in variants])
    res["preset"] = args.preset
    res["quick"] = args.quick
    res["toy"] = args.toy
    res["command"] = "python benchmarks/bench.py " + " ".join(shlex.quote(a) for a in
                                                            (sys.argv[1:] if argv is None else argv))
    res["env"] = environment(args.device)
    res["wall_s"] = time.perf_counter() - t0
    print(format_table(res))
    print(f"\nwall time {res['wall_s']:.0f} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))
        print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
