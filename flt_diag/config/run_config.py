"""Every option of flt-diag, once: typed config sections (pydantic models) whose fields, declared with `opt`
(flt_diag.config.option_fields), carry their help, bounds, flag, choices and the facts other layers read. The
CLI and the study files read these fields directly (flt_diag.cli.options); the grids' own options are in
flt_diag.config.grid_options. A bad value is one ConfigError line naming the flag.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from pydantic import AliasChoices, Field, ValidationError, create_model, model_validator

from flt_diag.config.option_fields import MAX_NUMBER, ConfigError, Items, Options, dotted, named, one_line, opt
from flt_diag.config.variants import MAX_LOOPS, Variant, stabiliser_of
from flt_diag.records import all_records, refuse_options_named


# The synthetic tasks `--data` accepts beside corpora (flt_diag.data.tasks), each with the difficulty
# dials (TrainConfig fields) it reads; a run of one task ignores the other task's dials.
TASKS: dict[str, tuple[str, ...]] = {"phop": ("hops", "alphabet"), "addition": ("operands", "digits")}
TASK_DIALS = tuple(dial for dials in TASKS.values() for dial in dials)


# Upper bounds of the sizes (far above any run this tool is for): a size read from a file (config.json,
# checkpoint.pt, a reference meta json) obeys the same limits as the command line, so no file can ask for
# a terabyte model or rotary table before anything checks it.
MAX_DEPTH, MAX_WIDTH, MAX_SEQUENCE, MAX_VOCAB, MAX_BATCH = 1024, 32_768, 131_072, 2_097_152, 65_536
MAX_THREADS = 4096  # torch takes a C int; more threads than cores only slow a run down
MAX_SEED = 2**63 - 1  # torch.manual_seed and numpy's generators take a seed of 64 bits; larger ones fail every cell


QWEN3_TOKENIZER = "Qwen/Qwen3-4B"  # the reference's tokenizer (nanochat/tokenizer.py: get_tokenizer)
QWEN3_VOCAB = 151_680  # its 151,669 tokens padded to a multiple of 64, as the reference pads
VOCAB_MULTIPLE = 64


def loss_loops(loss_on: str, loops: int) -> int:
    """How many of the final loops the training loss averages (`--loss-on`): 1 (end), all K (all) or ceil(K / 3)
    (last-third). The model's forward and the instruments that recompute its loss both read it here."""
    counts = {"end": 1, "all": loops, "last-third": math.ceil(loops / 3)}
    if loss_on not in counts:
        raise ValueError(f"loss_on must be end, all or last-third, got {loss_on!r}")
    return counts[loss_on]


def padded_vocab(n: int) -> int:
    """The model's vocabulary for a tokenizer of n tokens: n rounded up to a multiple of 64."""
    return -(-n // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def shape(depth: int, aspect: int, head_dim: int) -> dict:
    """The paper's size dial: L = depth, d = aspect * depth, heads = ceil(d / head_dim) (as the reference:
    max(1, (d + 127) // 128) for head_dim 128); presets fix the aspect and head dim."""
    d = aspect * depth
    return dict(depth=depth, width=d, heads=max(1, -(-d // head_dim)))


# Each preset: model fields, train fields. Measured figures are in the README.
PRESETS: dict[str, dict] = {
    # 2 CPU cores, minutes: d=64, L=2, 2 heads, seq 64, 16 sequences/step, bytes.
    "tiny": dict(model=dict(**shape(2, 32, 32), seq_len=64),
                 train=dict(batch_size=16, eval_batches=8)),
    # One GPU, a few minutes per run: d=384, L=6, 3 heads, seq 512, 64 sequences/step, bytes.
    "small": dict(model=dict(**shape(6, 64, 128), seq_len=512),
                  train=dict(batch_size=64, eval_batches=8)),
    # The paper's shapes: seq 1024, 524,288 tokens per step (512 sequences), FineWeb-Edu, the Qwen3
    # tokenizer (vocab padded to 151,680), untied embedding and head: 127.1M and 317.9M parameters.
    "paper-small": dict(model=dict(**shape(6, 64, 128), seq_len=1024, vocab_size=QWEN3_VOCAB),
                        train=dict(batch_size=32, grad_accum=16, data="fineweb-edu", tokenizer=QWEN3_TOKENIZER,
                                   max_tokens=1_100_000_000, eval_batches=16)),
    "paper-base": dict(model=dict(**shape(12, 64, 128), seq_len=1024, vocab_size=QWEN3_VOCAB),
                       train=dict(batch_size=32, grad_accum=16, data="fineweb-edu", tokenizer=QWEN3_TOKENIZER,
                                  max_tokens=1_100_000_000, eval_batches=16)),
}
if TYPE_CHECKING:  # (as Variant: to mypy, a preset's name is a str)
    Preset = str
else:
    Preset = Literal[tuple(PRESETS)]  # the preset names, as a type (a preset is one entry of PRESETS)


class ModelConfig(Options):
    vocab_size: int = opt(256, "Tokens (set from the tokenizer, padded to a multiple of 64).", ge=1, le=MAX_VOCAB,
                          settled=True)
    # (each field named as users type it; AliasChoices: the name config.json files of earlier versions hold)
    depth: int = opt(2, "Size dial: L distinct blocks reused every loop; width follows the preset's aspect ratio "
                     "unless --width is given.", validation_alias=AliasChoices("depth", "n_layer"), ge=1,
                     le=MAX_DEPTH)
    width: int = opt(64, "Model width d (the residual stream).", validation_alias=AliasChoices("width", "n_embd"),
                     ge=2, le=MAX_WIDTH)
    heads: int = opt(2, "Attention heads (head dim = width / heads, even).",
                     validation_alias=AliasChoices("heads", "n_head"), ge=1, le=MAX_WIDTH // 2)
    seq_len: int = opt(64, "Tokens per training sequence.", validation_alias=AliasChoices("seq_len", "sequence_len"),
                       ge=2, le=MAX_SEQUENCE)
    variant: Variant | None = opt("flt", "lt, lt-ii, lt-ai, fla, flt, a stabiliser or base+stabiliser (flt-diag variants; DESIGN.md §2).",  # None: a flt_diag.watch
                                  grid=("sweep", "map"))                                   # run of a model of its own
    loops: int = opt(12, "Loops K: how often the L blocks are reused per forward.", ge=1, le=MAX_LOOPS,
                     grid=("sweep", "map"))
    strength: float = opt(1.0, "Multiplies the stabiliser's source value (flt-diag variants: what each scales); 0 = "
                          "its base for a loss term. At most 100 (a benchmark's grid spans x 1/2 .. x 4; STARS's weight "
                          "0.1 x strength stays a weight up to 10).", ge=0, le=100, allow_inf_nan=False)
    rotary_base: float = opt(10000.0, "Rotary embedding base.", gt=0)
    rotary_dtype: Literal["float32", "bfloat16"] = opt("float32", "Rotary tables: float32, or bfloat16 as the reference keeps them.")
    softcap: float = opt(15.0, "Logit soft cap: logits = c * tanh(head(h) / c).", gt=0)

    @model_validator(mode="after")
    def _heads_split_the_width(self):
        if self.width % self.heads or (self.width // self.heads) % 2:
            raise ValueError(f"width {self.width} must split into {self.heads} heads of even size")
        return self

    @model_validator(mode="after")
    def _strength_has_a_meaning(self):
        stab = stabiliser_of(self.variant) if self.variant else None
        if self.strength != 1 and (stab is None or not stab.strength):
            raise ValueError(f"variant {self.variant}: --strength {self.strength} has no meaning (it scales no "
                             "source value); flt-diag variants lists what each stabiliser's strength scales")
        if stab is not None and self.strength > stab.strength_max:
            raise ValueError(f"variant {self.variant}: --strength {self.strength} is above {stab.strength_max:g}, the "
                             f"largest with a meaning ({stab.strength})")
        return self

    @property
    def head_dim(self) -> int:
        return self.width // self.heads


class TrainConfig(Options):
    steps: int = opt(2000, "Optimizer steps.", ge=1)
    batch_size: int = opt(16, "Sequences per micro-batch (per process).", ge=1, le=MAX_BATCH)
    grad_accum: int = opt(1, "Micro-batches per optimizer step.", ge=1)
    optimizer: Literal["muon", "adamw"] = opt("muon", "muon (the reference recipe: Muon on block matrices, AdamW on embedding and head) "
                         "or adamw (AdamW on everything).")
    matrix_lr: float = opt(0.02, "Muon lr on block matrices.", gt=0)
    embedding_lr: float = opt(0.2, "AdamW lr on the embedding (scaled by (d/768)^-0.5).", gt=0)
    head_lr: float = opt(0.004, "AdamW lr on the head (scaled by (d/768)^-0.5).", gt=0)
    adamw_lr: float = opt(0.003, "lr of everything with --optimizer adamw.", gt=0)
    momentum: float = opt(0.95, "Muon momentum once warmed up.", ge=0, lt=1)
    momentum_start: float = opt(0.85, "Muon momentum at step 0, raised linearly to --momentum ...", ge=0, lt=1)
    momentum_warmup: int = opt(300, "... over this many steps, as the reference; 0 = --momentum throughout.", ge=0)
    lr_scale: float = opt(1.0, "Multiplies every learning rate.", gt=0, grid=("sweep",))
    warmdown_frac: float = opt(0.2, "Constant lr, then linear decay to 0 over this final share of the steps.",
                               ge=0, le=1)
    grad_clip: float = opt(1.0, "Max global gradient norm; 0 disables clipping.", ge=0)
    loss_on: Literal["end", "all", "last-third"] = opt("end", "Loss on the final loop (end), the mean over all loops (all) or over the last third.")
    precision: Literal["fp32", "reference"] = opt("fp32", "fp32 (fp32 weights and residual stream; bf16 autocast on GPU) or reference (bf16 "
                         "embedding, rotary tables and stream, as the reference trains on GPU; CPU autocast on CPU).")
    sampling: Literal["random", "stream"] = opt("random", "random (random windows of the corpus) or stream (the corpus in order, documents "
                        "BOS-separated, as the reference reads it).")
    seed: int = opt(0, "Seed of initialisation and batches.", ge=0, le=MAX_SEED, grid=("sweep", "map"))
    device: str = opt("auto", "auto (cuda if available), cpu, cuda or cuda:N.", volatile=True)
    compile: bool | None = opt(None, "torch.compile the blocks [default: on CUDA; on a CPU for runs of 1,000 steps or more].",
                               volatile=True)
    checkpoint_loops: bool = opt(False, "Activation checkpointing, one segment per loop (memory flat in K).")
    grad_loops: int = opt(0, "Truncated backpropagation: the gradient flows through the last k loops only (the "
                          "stream is detached before them; the forward is unchanged; the embedding still gets "
                          "the gradient of its injections in those loops). 0, or k >= K: through every loop.", ge=0)
    freeze_embedding: bool = opt(False, "Keep the token embedding at its initial values (no gradient, no update): "
                                 "holds the embedding equal between runs whose gradient paths differ (--grad-loops).")
    threads: int | None = opt(None, "CPU threads [default: 1 per process on CPU; parallelise with sweep workers].",
                              ge=1, le=MAX_THREADS, volatile=True)
    flush_denormal: bool = opt(True, "CPU: flush subnormal floats to zero (collapsed LT runs make many).")
    eval_every: int = opt(250, "Steps between validation losses (and at the end); 0 = only at the end.", ge=0,
                         volatile=True)
    eval_batches: int = opt(8, "Validation micro-batches per evaluation.", ge=1)
    checkpoint_every: int = opt(500, "Steps between resume checkpoints; 0 = none.", ge=0, volatile=True)
    data: str = opt("stdlib", "stdlib (offline default), fineweb-edu, fineweb-edu-100b, wikitext2, a "
                    ".txt/.jsonl/.parquet file or folder, or a synthetic task with answers: phop or addition "
                    "(docs/DESIGN.md, Synthetic tasks).")
    tokenizer: str | None = opt("bytes", "bytes, a Hugging Face tokenizer name, or a tokenizer.json path (unset "
                                "only in imported runs whose tokenizer is unknown).")
    max_tokens: int | None = opt(None, "Cap on training tokens read from the corpus.", ge=2, le=MAX_NUMBER)
    hops: int = opt(3, "phop: pointers followed back through the context (its difficulty dial).", ge=1, le=16)
    alphabet: int = opt(4, "phop: symbols the context is drawn from.", ge=3, le=26)
    operands: int = opt(4, "addition: numbers added (its difficulty dial).", ge=2, le=10)
    digits: int = opt(2, "addition: digits per number.", ge=1, le=5)

    @model_validator(mode="after")
    def _tasks_are_sampled_at_random(self):
        if self.data in TASKS and self.sampling == "stream":
            raise ValueError(f"--sampling stream reads a corpus in order; --data {self.data} draws its examples "
                             "at random: use --sampling random")
        return self


Criterion = Literal["training", "collapse", "explosion"]  # how a run counts as broken (judge.map_boundaries)


class CoreDiagnostics(Options):
    """The diagnostics' own options; DiagnosticsConfig adds each record's (flt_diag.records: one file each)."""

    diagnostics: bool = opt(True, "Record the diagnostics (--no-diagnostics: only loss, lr, grad norm).",
                            validation_alias=AliasChoices("diagnostics", "enabled"))
    dense_steps: int = opt(2000, "Record every step up to here ...", ge=0)
    record_every: int = opt(10, "... then every N steps.", validation_alias=AliasChoices("record_every", "every"),
                            ge=1)
    loop_dynamics: bool = opt(True, "Also the fixed-point residual and exit loss per loop (DESIGN.md §3).",
                             volatile=True)
    exit_loss_every: int = opt(50, "The exit loss of every loop on the recorded steps that are multiples of N (one "
                               "head matmul per loop); 0 = never.", ge=0, volatile=True)
    dynamics_every: int = opt(500, "Every N steps, the loop-map gain and spectral radius and the per-loop gradient "
                              "agreement; 0 = never.", ge=0, volatile=True)
    sharpness_every: int = opt(0, "Every N steps, the sharpness (top Hessian eigenvalue); 0 = never.", ge=0,
                               volatile=True)
    dynamics_batch: int = opt(4, "Sequences of the micro-batch the every-N records are computed on.", ge=1,
                              volatile=True)
    dynamics_iters: int = opt(8, "Power iterations of the loop-map gain and the sharpness.", ge=1,
                              volatile=True)
    krylov_dim: int = opt(16, "Arnoldi steps (Jacobian-vector products) of the loop map's spectral radius.", ge=1,
                          le=512)
    perturbation_dirs: int = opt(4, "Random directions of the mean gain and of the perturbation carried through the "
                                 "loops (a local Lyapunov exponent).", ge=1, le=64)
    flush_every: int = opt(100, "Steps between metric parts written to disk.", ge=1, volatile=True)
    tensorboard: bool = opt(False, "Also log scalars to <run>/tensorboard.", volatile=True)
    wandb: str | None = opt(None, "Also log to this Weights & Biases project.", volatile=True)
    warn: bool = opt(False, "Print a warning, with its evidence, the first time the early-warning predictor puts "
                     "P(collapse) at or above its threshold.", volatile=True)
    stop_on_collapse: bool = opt(False, "End the run there (verdict collapsed, predicted at step s); the run "
                                 "folder stays complete. Implies --warn.")
    predictor: str | None = opt(None, "Predictor JSON from `flt-diag fit-predictor` [default: the packaged one].")
    stop_when_decided: Items[Criterion] | None = opt(
        None, "End the run once each of these criteria (training, collapse, explosion: as a map's) is certainly "
        "broken by the verdict's own rules, whatever the rest of the run would do (decided at step s; no "
        "prediction). A map sets it to its criteria.", volatile=True, grid=("map",))


class VerdictConfig(Options):
    smooth_window: int = opt(50, "Verdict: steps in the trailing mean that smooths the loss.", ge=1)
    rebound_abs: float = opt(0.25, "Verdict: collapsed if the smoothed loss climbs more than max(this, "
                             "rebound-rel * min) nats above its running minimum ...", ge=0)
    rebound_rel: float = opt(0.1, "Verdict: ... (relative part of the climb threshold) ...", ge=0)
    recovery_abs: float = opt(0.1, "Verdict: ... and ends more than max(this, recovery-rel * min) above its best; "
                              "stalled if it ends above H1 - max(this, recovery-rel * H1), H1 the unigram entropy.",
                              ge=0)
    recovery_rel: float = opt(0.05, "Verdict: relative part of the recovery tolerance.", ge=0)
    explosion_ratio: float = opt(100.0, "Residual explosion if a peak residual norm exceeds ratio * sqrt(d).",
                                 gt=0)
    osc_window: int = opt(200, "Steps per window of the oscillation indices.", ge=2)
    osc_dlog_threshold: float = opt(math.log(1.5), "Verdict: unstable if, in any window before the warm-down, "
                                    "the median |log g(t+1) - log g(t)| (net of the loop count's change where loops_run "
                                    "changes: verdict v4) exceeds this (log 1.5; docs/DESIGN.md §3).",
                                    gt=0)


class PresetOption(Options):
    """The --preset option: the preset a run starts from (auto: decided by the device)."""

    preset: Literal[Preset, "auto"] = opt(  # type: ignore[valid-type]  # (Preset: a Literal at run time)
        "auto", "tiny (CPU, minutes), small (one GPU), paper-small, paper-base, or auto (tiny on CPU, small on GPU).")


if TYPE_CHECKING:  # a record's options are keywords (typed where read: record.options_of(cfg), its RecordOptions)
    class DiagnosticsConfig(CoreDiagnostics):
        def __init__(self, **options: Any) -> None: ...
else:
    refuse_options_named({*CoreDiagnostics.model_fields, *ModelConfig.model_fields, *TrainConfig.model_fields,
                          *VerdictConfig.model_fields, *PresetOption.model_fields})  # (one would replace a core one)
    DiagnosticsConfig = create_model("DiagnosticsConfig", __base__=CoreDiagnostics, __module__=__name__, **{
        name: (info.annotation, info) for record in all_records() for name, info in record.options.model_fields.items()})
    if unswitched := sorted({r.switch for r in all_records()} - set(DiagnosticsConfig.model_fields)):
        raise ValueError(f"a record is switched by {', '.join(unswitched)}, which is no diagnostics option")


class RunConfig(Options):
    """A run's config. `preset` records where its sizes came from: a preset that build_config resolved
    (never auto), or custom (sizes of its own: an imported checkpoint's, or a config built by hand)."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    diagnostics: DiagnosticsConfig = Field(default_factory=DiagnosticsConfig)
    verdict: VerdictConfig = Field(default_factory=VerdictConfig)
    preset: Literal[Preset, "custom"] = "custom"  # type: ignore[valid-type]  # (as above)

    @model_validator(mode="after")
    def _per_sequence_counts_take_the_end_loss(self):
        stab = stabiliser_of(self.model.variant) if self.model.variant else None
        if stab is not None and stab.depths is not None and self.train.loss_on != "end":
            raise ValueError(f"variant {self.model.variant} runs a loop count per sequence: --loss-on end only "
                             f"(got {self.train.loss_on})")
        return self

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        """A config read back from config.json (its extra keys left out), or one ConfigError line."""
        missing = [k for k in ("model", "train", "diagnostics") if not isinstance(d, dict) or not isinstance(d.get(k), dict)]
        if missing:
            raise ConfigError(f"not an flt-diag config (no {missing[0]} section)")
        d = {k: v for k, v in d.items() if k in cls.model_fields} | {"train": {**LEGACY_TRAIN_DEFAULTS, **d["train"]}}
        try:
            if isinstance(d.get("verdict"), dict):  # fields of earlier verdicts (v2's osc_cv_threshold) are dropped
                d["verdict"] = {k: v for k, v in d["verdict"].items() if k not in LEGACY_VERDICT_FIELDS}
            return cls.model_validate(d)
        except ValidationError as e:
            raise ConfigError(f"not an flt-diag config: {one_line(e, dotted)}") from None


SECTIONS: dict[str, type[Options]] = {"model": ModelConfig, "train": TrainConfig, "diagnostics": DiagnosticsConfig, "verdict": VerdictConfig}


def given_sections(values: dict) -> dict[str, dict]:
    """Flat option values (by the names users type, or an old name: depth or n_layer; None: not given), by section
    and field name: build_config's keyword arguments. A name no section has is one ConfigError line."""
    out: dict = {section: {} for section in SECTIONS}
    for key, value in values.items():
        where = next(((s, found[0]) for s, cls in SECTIONS.items() if (found := named(cls, key))), None)
        if where is None:
            raise ConfigError(f"{key} is not a config option")
        if value is not None:
            out[where[0]][where[1]] = value
    return out


# Train fields that run folders written before the field existed were trained without: an old
# config.json read back must describe what was run (Muon momentum was constant before the warm-up).
LEGACY_TRAIN_DEFAULTS = {"momentum_warmup": 0}
# Verdict fields of older config.json files that the verdict no longer reads (v2's grad-norm CV threshold,
# replaced by osc_dlog_threshold in verdict v3): accepted and dropped on reading.
LEGACY_VERDICT_FIELDS = ("osc_cv_threshold",)


def build_config(preset: str = "auto", cuda_available: bool = False, model: dict | None = None,
                 train: dict | None = None, diagnostics: dict | None = None,
                 verdict: dict | None = None) -> RunConfig:
    """A preset with overrides (None values are ignored; named by field or old name) or one ValueError line.
    `depth` without `width` scales the width and heads with the preset's (`shape`)."""
    name = ("small" if cuda_available else "tiny") if preset == "auto" else preset
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join([*PRESETS, 'auto'])}")
    p = PRESETS[name]

    def given(cls, over: dict | None) -> dict:  # (keyed by field name: an old name, n_layer, read as its field's)
        return {(named(cls, k) or (k,))[0]: v for k, v in (over or {}).items() if v is not None}

    m = given(ModelConfig, model)
    if "depth" in m and "width" not in m:
        aspect = p["model"]["width"] // p["model"]["depth"]
        head_dim = p["model"]["width"] // p["model"]["heads"]
        m = {**shape(m["depth"], aspect, head_dim), **m}
    return RunConfig(model=ModelConfig.of(**{**p["model"], **m}), train=TrainConfig.of(**{**p["train"],
                                                                                         **given(TrainConfig, train)}),
                     diagnostics=DiagnosticsConfig.of(**given(DiagnosticsConfig, diagnostics)),
                     verdict=VerdictConfig.of(**given(VerdictConfig, verdict)), preset=name)


O = TypeVar("O", bound=Options)


def replaced(section: O, **changes) -> O:
    """A copy of a section (or config) with some fields changed, validated like a new one."""
    return type(section).of(**{**{name: getattr(section, name) for name in type(section).model_fields}, **changes})


def with_overrides(cfg: RunConfig, **sections) -> RunConfig:
    """A copy with some fields of some sections replaced: with_overrides(cfg, model={"loops": 6})."""
    return replaced(cfg, **{name: replaced(getattr(cfg, name), **changes) for name, changes in sections.items()})
