"""Every option of flt-diag, once: typed config sections whose fields carry their help text,
their command-line flag, their bounds and their choices.

The grids' own options (what a sweep or map runs over) are beside it in flt_diag.vocab.grid_options.
The command line (flt_diag.cli, which also decides which command takes which option), the sweep and
map specs and the study files are generated from these fields (`OPTIONS`); validation is `check()` on
the same metadata and runs whenever a section is constructed, so a bad value raises one ValueError
naming the flag, wherever it came from. flt_diag.training.settle turns options into the one settled config a
run takes.

Size dial: `depth` (= L). Width is d = aspect * depth and heads are ceil(d / head_dim), as in the
paper (aspect 64, head dim 128); presets fix the aspect and head dim, and any field can be
overridden.
"""
from __future__ import annotations

import functools
import math
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields, replace

from flt_diag.vocab.variants import MAX_LOOPS, VARIANTS


# The synthetic tasks `--data` accepts beside corpora (flt_diag.data.tasks), each with the difficulty
# dials (TrainConfig fields) it reads; a run of one task ignores the other task's dials.
TASKS: dict[str, tuple[str, ...]] = {"phop": ("hops", "alphabet"), "addition": ("operands", "digits")}
TASK_DIALS = tuple(dial for dials in TASKS.values() for dial in dials)


def opt(default, help: str, *, flag: str | None = None, choices=None, low=None, high=None, above=None, below=None):
    """A config field that is also an option. `low`/`high` bound it inclusively, `above`/`below`
    exclusively; floats must be finite. Which commands take it is the CLI's business (flt_diag.cli.options)."""
    kind = dict(default_factory=lambda: list(default)) if isinstance(default, list) else dict(default=default)
    return field(**kind, metadata=dict(help=help, flag=flag, choices=tuple(choices) if choices else None,
                                       low=low, high=high, above=above, below=below))


@dataclass(frozen=True)
class Option:
    """One config field as the command line sees it."""

    section: str  # "model", "train", "diagnostics", "verdict" or "run"
    name: str  # the field name
    flag: str  # "--batch-size"
    kind: type  # int, float, str or bool
    optional: bool  # None is a value (= "decided elsewhere", e.g. by the device)
    many: bool  # a list of values (`--loops 3 6 9`)
    default: object
    help: str
    choices: tuple | None
    low: float | None
    high: float | None
    above: float | None
    below: float | None

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")

    def check(self, value) -> str | None:
        """Why `value` is not acceptable (one line), or None."""
        if value is None:
            return None if self.optional else f"{self.flag} needs a value"
        if self.many:
            if not isinstance(value, (list, tuple)) or not value:
                return f"{self.flag} needs at least one value, got {value!r}"
            problem = next((p for p in map(self._check_one, value) if p), None)
            if problem is None and len(set(value)) != len(value):  # items checked first: a list is unhashable
                problem = f"{self.flag} has duplicates: {' '.join(map(str, value))}"
            return problem
        return self._check_one(value)

    def _check_one(self, value) -> str | None:
        if self.kind is bool:
            return None if isinstance(value, bool) else f"{self.flag} must be true or false, got {value!r}"
        if self.kind in (int, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    (self.kind is int and isinstance(value, float) and not value.is_integer()):
                return f"{self.flag} must be {'an integer' if self.kind is int else 'a number'}, got {value!r}"
            if isinstance(value, float) and not math.isfinite(value):  # (an int of any size is finite)
                return f"{self.flag} must be finite, got {value}"
            if self.low is not None and self.high is not None and not self.low <= value <= self.high:
                return f"{self.flag} must be in {self.low}..{self.high}, got {value}"
            if self.low is not None and value < self.low:
                return f"{self.flag} must be >= {self.low}, got {value}"
            if self.high is not None and value > self.high:
                return f"{self.flag} must be <= {self.high}, got {value}"
            if self.above is not None and not value > self.above:
                return f"{self.flag} must be > {self.above}, got {value}"
            if self.below is not None and not value < self.below:
                return f"{self.flag} must be < {self.below}, got {value}"
            return None
        if not isinstance(value, str) and not (self.kind is not str and isinstance(value, self.kind)):
            return f"{self.flag} must be text, got {value!r}"
        if self.choices and value not in self.choices:
            return f"{self.flag} must be one of {', '.join(self.choices)}, got {value!r}"
        return None


def options_of(cls, section: str) -> list[Option]:
    """The Options of a config dataclass (fields with `opt` metadata)."""
    return list(_options_of(cls, section))


@functools.cache  # every section checks its fields whenever it is built: read the type hints once
def _options_of(cls, section: str) -> tuple[Option, ...]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        if "help" not in f.metadata:
            continue
        hint = hints[f.name]
        many = typing.get_origin(hint) is list
        args = typing.get_args(hint)
        kind = next((a for a in args if a is not type(None)), None) if args else hint
        m = f.metadata
        default = f.default_factory() if f.default is MISSING and f.default_factory is not MISSING else f.default
        out.append(Option(section, f.name, m["flag"] or "--" + f.name.replace("_", "-"), kind,
                          type(None) in args, many, None if default is MISSING else default, m["help"], m["choices"],
                          m["low"], m["high"], m["above"], m["below"]))
    return tuple(out)


def check(section) -> None:
    """Validate a config section against its options; raises ValueError with one line."""
    for o in options_of(type(section), ""):
        problem = o.check(getattr(section, o.name))
        if problem:
            raise ValueError(problem)


# Upper bounds of the sizes (far above any run this tool is for): a size read from a file (config.json,
# checkpoint.pt, a reference meta json) obeys the same limits as the command line, so no file can ask for
# a terabyte model or rotary table before anything checks it.
MAX_DEPTH, MAX_WIDTH, MAX_SEQUENCE, MAX_VOCAB, MAX_BATCH = 1024, 32_768, 131_072, 2_097_152, 65_536
MAX_SEED = 2**63 - 1  # torch.manual_seed and numpy's generators take a seed of 64 bits; larger ones fail every cell


@dataclass
class ModelConfig:
    vocab_size: int = opt(256, "Tokens (set from the tokenizer, padded to a multiple of 64).", low=1, high=MAX_VOCAB)
    n_layer: int = opt(2, "Size dial: L distinct blocks reused every loop; width follows the preset's aspect ratio "
                       "unless --width is given.", flag="--depth", low=1, high=MAX_DEPTH)
    n_embd: int = opt(64, "Model width d (the residual stream).", flag="--width", low=2, high=MAX_WIDTH)
    n_head: int = opt(2, "Attention heads (head dim = width / heads, even).", flag="--heads", low=1,
                      high=MAX_WIDTH // 2)
    sequence_len: int = opt(64, "Tokens per training sequence.", flag="--seq-len", low=2, high=MAX_SEQUENCE)
    variant: str = opt("flt", "lt, lt-ii, lt-ai, fla or flt (DESIGN.md §2).", choices=VARIANTS)
    loops: int = opt(12, "Loops K: how often the L blocks are reused per forward.", low=1, high=MAX_LOOPS)
    rotary_base: float = opt(10000.0, "Rotary embedding base.", above=0)
    rotary_dtype: str = opt("float32", "Rotary tables: float32, or bfloat16 as the reference keeps them.",
                            choices=("float32", "bfloat16"))
    softcap: float = opt(15.0, "Logit soft cap: logits = c * tanh(head(h) / c).", above=0)

    def __post_init__(self) -> None:
        check(self)
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(f"width {self.n_embd} must split into {self.n_head} heads of even size")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TrainConfig:
    steps: int = opt(2000, "Optimizer steps.", low=1)
    batch_size: int = opt(16, "Sequences per micro-batch (per process).", low=1, high=MAX_BATCH)
    grad_accum: int = opt(1, "Micro-batches per optimizer step.", low=1)
    optimizer: str = opt("muon", "muon (the reference recipe: Muon on block matrices, AdamW on embedding and head) "
                         "or adamw (AdamW on everything).", choices=("muon", "adamw"))
    matrix_lr: float = opt(0.02, "Muon lr on block matrices.", above=0)
    embedding_lr: float = opt(0.2, "AdamW lr on the embedding (scaled by (d/768)^-0.5).", above=0)
    head_lr: float = opt(0.004, "AdamW lr on the head (scaled by (d/768)^-0.5).", above=0)
    adamw_lr: float = opt(0.003, "lr of everything with --optimizer adamw.", above=0)
    momentum: float = opt(0.95, "Muon momentum once warmed up.", low=0, below=1)
    momentum_start: float = opt(0.85, "Muon momentum at step 0, raised linearly to --momentum ...", low=0, below=1)
    momentum_warmup: int = opt(300, "... over this many steps, as the reference; 0 = --momentum throughout.", low=0)
    lr_scale: float = opt(1.0, "Multiplies every learning rate.", above=0)
    warmdown_frac: float = opt(0.2, "Constant lr, then linear decay to 0 over this final share of the steps.",
                               low=0, high=1)
    grad_clip: float = opt(1.0, "Max global gradient norm; 0 disables clipping.", low=0)
    loss_on: str = opt("end", "Loss on the final loop (end), the mean over all loops (all) or over the last third.",
                       choices=("end", "all", "last-third"))
    precision: str = opt("fp32", "fp32 (fp32 weights and residual stream; bf16 autocast on GPU) or reference (bf16 "
                         "embedding, rotary tables and stream, as the reference trains on GPU; CPU autocast on CPU).",
                         choices=("fp32", "reference"))
    sampling: str = opt("random", "random (random windows of the corpus) or stream (the corpus in order, documents "
                        "BOS-separated, as the reference reads it).", choices=("random", "stream"))
    seed: int = opt(0, "Seed of initialisation and batches.", low=0, high=MAX_SEED)
    device: str = opt("auto", "auto (cuda if available), cpu, cuda or cuda:N.")
    compile: bool | None = opt(None, "torch.compile the blocks [default: on CUDA; on a CPU for runs of 1,000 steps or more].")
    checkpoint_loops: bool = opt(False, "Activation checkpointing, one segment per loop (memory flat in K).")
    threads: int | None = opt(None, "CPU threads [default: 1 per process on CPU; parallelise with sweep workers].",
                              low=1)
    flush_denormal: bool = opt(True, "CPU: flush subnormal floats to zero (collapsed LT runs make many).")
    eval_every: int = opt(250, "Steps between validation losses (and at the end); 0 = only at the end.", low=0)
    eval_batches: int = opt(8, "Validation micro-batches per evaluation.", low=1)
    checkpoint_every: int = opt(500, "Steps between resume checkpoints; 0 = none.", low=0)
    data: str = opt("stdlib", "stdlib (offline default), fineweb-edu, fineweb-edu-100b, wikitext2, a "
                    ".txt/.jsonl/.parquet file or folder, or a synthetic task with answers: phop or addition "
                    "(docs/DESIGN.md, Synthetic tasks).")
    tokenizer: str | None = opt("bytes", "bytes, a Hugging Face tokenizer name, or a tokenizer.json path (unset "
                                "only in imported runs whose tokenizer is unknown).")
    max_tokens: int | None = opt(None, "Cap on training tokens read from the corpus.", low=2)
    hops: int = opt(3, "phop: pointers followed back through the context (its difficulty dial).", low=1, high=16)
    alphabet: int = opt(4, "phop: symbols the context is drawn from.", low=3, high=26)
    operands: int = opt(4, "addition: numbers added (its difficulty dial).", low=2, high=10)
    digits: int = opt(2, "addition: digits per number.", low=1, high=5)

    def __post_init__(self) -> None:
        check(self)  # every section validates itself when built (also by `replace`)
        if self.data in TASKS and self.sampling == "stream":
            raise ValueError(f"--sampling stream reads a corpus in order; --data {self.data} draws its examples "
                             "at random: use --sampling random")


@dataclass
class DiagnosticsConfig:
    enabled: bool = opt(True, "Record the diagnostics (--no-diagnostics: only loss, lr, grad norm).",
                        flag="--diagnostics")
    dense_steps: int = opt(2000, "Record every step up to here ...", low=0)
    every: int = opt(10, "... then every N steps.", flag="--record-every", low=1)
    attention: bool = opt(False, "Also record max attention logit and entropy per (loop, layer).",
                          flag="--attention-stats")
    flush_every: int = opt(100, "Steps between metric parts written to disk.", low=1)
    tensorboard: bool = opt(False, "Also log scalars to <run>/tensorboard.")
    wandb: str | None = opt(None, "Also log to this Weights & Biases project.")
    warn: bool = opt(False, "Print a warning, with its evidence, the first time the early-warning predictor puts "
                     "P(collapse) at or above its threshold.")
    stop_on_collapse: bool = opt(False, "End the run there (verdict collapsed, predicted at step s); the run "
                                 "folder stays complete. Implies --warn.")
    predictor: str | None = opt(None, "Predictor JSON from `flt-diag fit-predictor` [default: the packaged one].")

    def __post_init__(self) -> None:
        check(self)  # every section validates itself when built (also by `replace`)


@dataclass
class VerdictConfig:
    smooth_window: int = opt(50, "Verdict: steps in the trailing mean that smooths the loss.", low=1)
    rebound_abs: float = opt(0.25, "Verdict: collapsed if the smoothed loss climbs more than max(this, "
                             "rebound-rel * min) nats above its running minimum ...", low=0)
    rebound_rel: float = opt(0.1, "Verdict: ... (relative part of the climb threshold) ...", low=0)
    recovery_abs: float = opt(0.1, "Verdict: ... and ends more than max(this, recovery-rel * min) above its best.",
                              low=0)
    recovery_rel: float = opt(0.05, "Verdict: relative part of the recovery tolerance.", low=0)
    explosion_ratio: float = opt(100.0, "Residual explosion if a peak residual norm exceeds ratio * sqrt(d).",
                                 above=0)
    osc_window: int = opt(200, "Steps per window of the oscillation indices.", low=2)
    osc_cv_threshold: float = opt(3.0, "Verdict: unstable if the grad-norm CV over the dense steps exceeds this "
                                  "(calibration: docs/DESIGN.md §3; stable runs measured 0.3-1.6).", low=0)

    def __post_init__(self) -> None:
        check(self)  # every section validates itself when built (also by `replace`)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    verdict: VerdictConfig = field(default_factory=VerdictConfig)
    preset: str = opt("custom", "tiny (CPU, minutes), small (one GPU), paper-small, paper-base, or auto (tiny on "
                      "CPU, small on GPU) [default: auto].", choices=("tiny", "small", "paper-small", "paper-base",
                                                                       "auto"))

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


SECTIONS = {"model": ModelConfig, "train": TrainConfig, "diagnostics": DiagnosticsConfig, "verdict": VerdictConfig}

# Every config option, in help order; the CLI and the study files are generated from this list.
OPTIONS: list[Option] = options_of(RunConfig, "run") + \
    [o for section, cls in SECTIONS.items() for o in options_of(cls, section)]


def sections_from(values: dict) -> dict[str, dict]:
    """Flat option values keyed by `Option.dest` (None = not given) -> build_config's keyword
    arguments: {"preset": ..., "model": {...}, "train": {...}, ...}. Unknown keys are ignored."""
    out: dict = {section: {} for section in SECTIONS}
    for o in OPTIONS:
        value = values.get(o.dest)
        if value is None:
            continue
        if o.section == "run":
            out[o.name] = value
        else:
            out[o.section][o.name] = value
    return out


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
    """A preset with overrides (None values are ignored). Raises ValueError (one line) on bad input.

    `model["n_layer"]` without `n_embd` scales the width with the preset's aspect ratio (and the
    heads with its head dimension, unless given): the paper's size dial."""
    name = resolve_preset(preset, cuda_available)
    p = PRESETS[name]

    def given(over: dict | None) -> dict:
        return {k: v for k, v in (over or {}).items() if v is not None}

    m = given(model)
    if "n_layer" in m and "n_embd" not in m:
        aspect = p["model"]["n_embd"] // p["model"]["n_layer"]
        head_dim = p["model"]["n_embd"] // p["model"]["n_head"]
        m = {**shape(m["n_layer"], aspect, head_dim), **m}
    try:
        return RunConfig(model=ModelConfig(**{**p["model"], **m}), train=TrainConfig(**{**p["train"], **given(train)}),
                         diagnostics=DiagnosticsConfig(**given(diagnostics)), verdict=VerdictConfig(**given(verdict)),
                         preset=name)
    except TypeError as e:  # an unknown field name
        raise ValueError(f"unknown option: {e}") from None


def validate(cfg: RunConfig) -> None:
    """Check a config whose sections were changed in place (construction already checks)."""
    for section in (cfg.model, cfg.train, cfg.diagnostics, cfg.verdict):
        type(section).__post_init__(section)


def with_overrides(cfg: RunConfig, **sections) -> RunConfig:
    """A copy with some fields of some sections replaced: with_overrides(cfg, model={"loops": 6})."""
    out = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
    for section, changes in sections.items():
        out[section] = replace(out[section], **changes)
    return RunConfig(**out)
