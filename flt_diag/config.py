"""Small per-component configs, the presets, and the resolved config of a run.

Size dial: `depth` (= L). Width is d = aspect * depth and heads are d // head_dim, as in the
paper (aspect 64, head dim 128); presets fix the aspect and head dim, and any field can be
overridden.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

from .variants import MAX_LOOPS, VARIANTS


@dataclass
class ModelConfig:
    vocab_size: int = 256  # tokens; 256 = raw bytes
    n_layer: int = 2  # L, distinct blocks reused every loop
    n_embd: int = 64  # d, width of the residual stream
    n_head: int = 2  # heads; head dim = n_embd // n_head
    sequence_len: int = 64  # longest context the rotary tables are built for (grown on demand)
    variant: str = "flt"  # one of VARIANTS
    loops: int = 12  # K, loops per forward unless forward(loops=k) says otherwise
    rotary_base: float = 10000.0
    rotary_dtype: str = "float32"  # the nanochat reference keeps its tables in "bfloat16"
    softcap: float = 15.0  # logits = softcap * tanh(head(h) / softcap)

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown variant {self.variant!r}; choose from {', '.join(VARIANTS)}")
        if not 1 <= self.loops <= MAX_LOOPS:
            raise ValueError(f"loops must be in 1..{MAX_LOOPS}, got {self.loops}")
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(f"n_embd={self.n_embd} must split into {self.n_head} heads of even size")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TrainConfig:
    steps: int = 2000  # optimizer steps
    batch_size: int = 16  # sequences per micro-batch (per process)
    grad_accum: int = 1  # micro-batches per optimizer step
    optimizer: str = "muon"  # "muon": the reference recipe; "adamw": AdamW on everything
    matrix_lr: float = 0.02  # Muon lr on block matrices
    embedding_lr: float = 0.2  # AdamW lr on the embedding (scaled by (d/768)^-0.5)
    head_lr: float = 0.004  # AdamW lr on the head (scaled by (d/768)^-0.5)
    adamw_lr: float = 0.003  # lr of everything when optimizer="adamw"
    momentum: float = 0.95  # Muon momentum once warmed up
    momentum_start: float = 0.85  # Muon momentum at step 0, raised linearly to `momentum` ...
    momentum_warmup: int = 300  # ... over this many steps (the reference's recipe); 0 = `momentum` throughout
    lr_scale: float = 1.0  # multiplies every learning rate (for lr x loops maps)
    warmdown_frac: float = 0.2  # constant lr, then linear decay to 0 over this final share of steps
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    loss_on: str = "end"  # "end" (final loop), "all" (mean over loops), "last-third"
    precision: str = "fp32"  # "fp32": fp32 weights and stream (bf16 autocast on GPU); "reference": as the
    #                          reference trains on GPU (bf16 embedding, rotary tables and residual stream)
    sampling: str = "random"  # "random": random windows of the corpus; "stream": consecutive windows in
    #                           corpus order (documents BOS-separated by the tokenizer), as the reference reads
    seed: int = 0
    device: str = "auto"  # "auto" (cuda if available), "cpu", "cuda", "cuda:1", ...
    compile: bool | None = None  # torch.compile the blocks; None = on for CUDA
    checkpoint_loops: bool = False  # activation checkpointing, one segment per loop
    threads: int | None = None  # CPU threads; None = 1 on CPU (parallelise with sweep workers instead)
    flush_denormal: bool = True  # CPU: flush subnormal floats to zero (collapsed LT runs make many)
    eval_every: int = 250  # steps between validation losses (and at the end); 0 = only at the end
    eval_batches: int = 8  # validation micro-batches per evaluation
    checkpoint_every: int = 500  # steps between resume checkpoints; 0 = none
    data: str = "stdlib"  # see flt_diag.data
    tokenizer: str = "bytes"
    max_tokens: int | None = None  # cap on training tokens read from the corpus


@dataclass
class DiagnosticsConfig:
    enabled: bool = True
    dense_steps: int = 2000  # record every step up to here ...
    every: int = 10  # ... then every `every` steps
    attention: bool = False  # also max attention logit and entropy per (loop, layer)
    flush_every: int = 100  # steps between metric parts written to disk
    tensorboard: bool = False  # also log scalars to <run>/tensorboard
    wandb: str | None = None  # also log to this Weights & Biases project
    warn: bool = False  # print a warning when the early-warning predictor expects a collapse
    stop_on_collapse: bool = False  # ... and end the run there (verdict collapsed, predicted at step s)
    predictor: str | None = None  # predictor JSON (flt-diag fit-predictor); None = the packaged one


@dataclass
class VerdictConfig:
    smooth_window: int = 50  # steps in the trailing mean that smooths the loss
    rebound_abs: float = 0.25  # collapsed if the smoothed loss climbs > max(rebound_abs, ...
    rebound_rel: float = 0.1  # ... rebound_rel * min) above its running minimum ...
    recovery_abs: float = 0.1  # ... and ends > max(recovery_abs, ...
    recovery_rel: float = 0.05  # ... recovery_rel * min) above its best
    explosion_ratio: float = 100.0  # residual explosion if peak final-loop norm > ratio * sqrt(d)
    osc_window: int = 200  # steps per window of the oscillation indices
    osc_cv_threshold: float = 3.0  # unstable if the grad-norm CV over the dense steps exceeds this (calibration:
    #                                docs/DESIGN.md §3; stable runs measured 0.3-1.6)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    verdict: VerdictConfig = field(default_factory=VerdictConfig)
    preset: str = "custom"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        """A config read back from config.json; a file that is not one raises ValueError (one line)."""
        try:
            train = {**LEGACY_TRAIN_DEFAULTS, **d["train"]}
            return cls(model=ModelConfig(**d["model"]), train=TrainConfig(**train),
                       diagnostics=DiagnosticsConfig(**d["diagnostics"]),
                       verdict=VerdictConfig(**d.get("verdict", {})), preset=d.get("preset", "custom"))
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not an flt-diag config (missing or unknown field: {e})") from None


# Train fields that run folders written before the field existed were trained without: an old
# config.json read back must describe what was run (Muon momentum was constant before the warm-up).
LEGACY_TRAIN_DEFAULTS = {"momentum_warmup": 0}

QWEN3_TOKENIZER = "Qwen/Qwen3-4B"  # the reference's tokenizer (nanochat/tokenizer.py: get_tokenizer)
QWEN3_VOCAB = 151_680  # its 151,669 tokens padded to a multiple of 64, as the reference pads
VOCAB_MULTIPLE = 64


def padded_vocab(n: int) -> int:
    """The model's vocabulary for a tokenizer of n tokens: n rounded up to a multiple of 64."""
    return -(-n // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def shape(depth: int, aspect: int, head_dim: int) -> dict:
    """The size dial: L = depth, d = aspect * depth, heads = ceil(d / head_dim) (as the reference:
    max(1, (d + 127) // 128) for head_dim 128)."""
    d = aspect * depth
    return dict(n_layer=depth, n_embd=d, n_head=max(1, -(-d // head_dim)))


# Each preset: model fields, train fields. Measured figures are in the README.
PRESETS: dict[str, dict] = {
    # 2 CPU cores, minutes: d=64, L=2, 2 heads, seq 64, 16 sequences/step, bytes.
    "tiny": dict(model=dict(**shape(2, 32, 32), sequence_len=64),
                 train=dict(batch_size=16, eval_batches=8)),
    # One GPU, a few minutes per run: d=384, L=6, 3 heads, seq 512, 64 sequences/step, bytes.
    "small": dict(model=dict(**shape(6, 64, 128), sequence_len=512),
                  train=dict(batch_size=64, eval_batches=8)),
    # The paper's shapes: seq 1024, 524,288 tokens per step (512 sequences), FineWeb-Edu, the Qwen3
    # tokenizer (vocab padded to 151,680), untied embedding and head: 127.1M and 317.9M parameters.
    "paper-small": dict(model=dict(**shape(6, 64, 128), sequence_len=1024, vocab_size=QWEN3_VOCAB),
                        train=dict(batch_size=32, grad_accum=16, data="fineweb-edu", tokenizer=QWEN3_TOKENIZER,
                                   max_tokens=1_100_000_000, eval_batches=16)),
    "paper-base": dict(model=dict(**shape(12, 64, 128), sequence_len=1024, vocab_size=QWEN3_VOCAB),
                       train=dict(batch_size=32, grad_accum=16, data="fineweb-edu", tokenizer=QWEN3_TOKENIZER,
                                  max_tokens=1_100_000_000, eval_batches=16)),
}
PRESET_NAMES = [*PRESETS, "auto"]


def resolve_preset(name: str, cuda_available: bool) -> str:
    if name == "auto":
        return "small" if cuda_available else "tiny"
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESET_NAMES)}")
    return name


def build_config(preset: str = "auto", cuda_available: bool = False, model: dict | None = None,
                 train: dict | None = None, diagnostics: dict | None = None,
                 verdict: dict | None = None) -> RunConfig:
    """A preset with overrides (None values are ignored). Raises ValueError on bad input."""
    name = resolve_preset(preset, cuda_available)
    p = PRESETS[name]

    def merged(base: dict, over: dict | None) -> dict:
        return {**base, **{k: v for k, v in (over or {}).items() if v is not None}}

    cfg = RunConfig(
        model=ModelConfig(**merged(p["model"], model)),
        train=TrainConfig(**merged(p["train"], train)),
        diagnostics=DiagnosticsConfig(**merged({}, diagnostics)),
        verdict=VerdictConfig(**merged({}, verdict)),
        preset=name,
    )
    validate(cfg)
    return cfg


def validate(cfg: RunConfig) -> None:
    t = cfg.train
    checks = [
        (t.steps >= 1, f"steps must be >= 1, got {t.steps}"),
        (t.batch_size >= 1, f"batch size must be >= 1, got {t.batch_size}"),
        (t.grad_accum >= 1, f"grad accumulation must be >= 1, got {t.grad_accum}"),
        (t.optimizer in ("muon", "adamw"), f"optimizer must be muon or adamw, got {t.optimizer!r}"),
        (t.lr_scale > 0 and math.isfinite(t.lr_scale), f"lr scale must be > 0 and finite, got {t.lr_scale}"),
        (0 <= t.momentum < 1 and 0 <= t.momentum_start < 1,
         f"Muon momentum must be in [0, 1), got {t.momentum_start} -> {t.momentum}"),
        (t.momentum_warmup >= 0, f"momentum warm-up must be >= 0 steps, got {t.momentum_warmup}"),
        (t.precision in ("fp32", "reference"), f"precision must be fp32 or reference, got {t.precision!r}"),
        (t.sampling in ("random", "stream"), f"sampling must be random or stream, got {t.sampling!r}"),
        (0 <= t.warmdown_frac <= 1, f"warmdown fraction must be in [0, 1], got {t.warmdown_frac}"),
        (t.loss_on in ("end", "all", "last-third"), f"loss must be end, all or last-third, got {t.loss_on!r}"),
        (t.eval_every >= 0 and t.checkpoint_every >= 0, "eval/checkpoint intervals must be >= 0"),
        (cfg.model.sequence_len >= 2, "sequence length must be >= 2"),
        (cfg.diagnostics.every >= 1, "diagnostics interval must be >= 1"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ValueError(msg)


def with_overrides(cfg: RunConfig, **sections) -> RunConfig:
    """A copy with some fields of some sections replaced: with_overrides(cfg, model={"loops": 6})."""
    out = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
    for section, changes in sections.items():
        out[section] = replace(out[section], **changes)
    return RunConfig(**out)
