"""What each kind of file flt-diag reads may hold, as pydantic models (flt_diag.storage.files loads with
them; docs/DESIGN.md §9). Strict types, finite floats (unless a figure a run computed: a diverged run's loss
is NaN) and no unknown key, unless the model says `extra="allow"` (free-form metadata). Torch-free: a tensor
is anything with `.shape` and `.dtype`.
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Annotated, Any, Callable, Literal, Optional, TypeVar

from pydantic import Field, create_model, field_validator, model_validator
from pydantic_core import PydanticUndefined

from flt_diag.storage.predictor_names import CLASS_WEIGHTS, FEATURES, TARGETS
from flt_diag.config.run_config import DiagnosticsConfig, ModelConfig, Preset, RunConfig, TrainConfig, VerdictConfig
from flt_diag.config.grid_options import MAX_GRID, MapAxes, SweepAxes
from flt_diag.config.option_fields import MAX_ITEMS, Ascending, Distinct, Items, Options

Verdict = Literal["stable", "unstable", "stalled", "collapsed", "diverged"]  # verdicts v3 and v4 (flt_diag.judge.verdict)
M = TypeVar("M", bound="type[Options]")
G = TypeVar("G")


class FileModel(Options, protected_namespaces=()):
    """A part of a file: strict, finite, no unknown key (Options' rules), validated with model_validate."""

    def as_written(self) -> dict:
        """The JSON object of the file: the fields it was given (or held), in the model's order."""
        return self.model_dump(exclude_unset=True, by_alias=False)  # (field names: an option's alias is the CLI's)


class FreeFileModel(FileModel, extra="allow"):
    """A part of a file that may hold other keys too (free-form metadata, kept as they are)."""


def config_type(cls, name: str) -> Any:
    """The type of field `name` of config model `cls`, its bounds with it (a file holds what the option takes)."""
    return cls.model_fields[name].rebuild_annotation()


def required(*names: str) -> Callable[[M], M]:
    """A class decorator: the fields `names` that a file model inherits from a config model, which defaults them,
    required (every file holds them), each otherwise the config's own field (type, bounds, help)."""
    def require(cls: M) -> M:
        for name in names:
            cls.__pydantic_fields__[name] = field = copy.copy(cls.__pydantic_fields__[name])
            field.default, field.default_factory = PydanticUndefined, None
        cls.model_rebuild(force=True)
        return cls
    return require


def many(required: bool = True, min_length: int = 1, **extra) -> Any:
    return Field(PydanticUndefined if required else None, min_length=min_length, max_length=MAX_ITEMS,
                 json_schema_extra=extra or None)


def figure(required: bool = True) -> Any:
    """A figure a run computed (NaN and infinities are values)."""
    return Field(PydanticUndefined if required else None, allow_inf_nan=True)


# --------------------------------------------------------------------------- run config

# Fields every config.json has held since the first version (the readers index them); every other field
# may be missing in an older file and takes its default.
REQUIRED = {"model": ("vocab_size", "depth", "width", "heads", "seq_len", "variant", "loops"),
            "train": ("steps", "batch_size", "seed", "lr_scale", "data", "tokenizer", "eval_batches")}


@required(*REQUIRED["model"])
class ModelInFile(ModelConfig):
    """config.json's model section: ModelConfig, the fields every file holds (REQUIRED) required."""


@required(*REQUIRED["train"])
class TrainInFile(TrainConfig):
    """config.json's train section: TrainConfig, the fields every file holds (REQUIRED) required."""


class VerdictInFile(VerdictConfig):
    """config.json's verdict section: its options, and the fields of earlier verdicts older files hold
    (v2's osc_cv_threshold; dropped when the config is read: RunConfig.from_dict)."""

    osc_cv_threshold: Optional[float] = Field(None, ge=0)


class Corpus(FreeFileModel):
    train_tokens: int = Field(None, ge=0)
    val_tokens: int = Field(None, ge=0)
    unigram_entropy: Optional[float] = Field(None, ge=0)
    task: str = None  # a synthetic task's name (flt_diag.data.tasks); its other figures are free-form


class RunConfigFile(FileModel):
    """config.json: the config sections, the preset, what the Trainer adds (parameter count, corpus
    figures, environment; free-form except the corpus figures), what an imported reference run adds
    (imported_from, note) and a run of flt_diag.watch (probe: the watched model and its blocks). These
    are every top-level key any version has written; another one is refused (a misspelt "corpus" would
    judge runs without H1)."""

    model: ModelInFile
    train: TrainInFile
    diagnostics: DiagnosticsConfig
    verdict: VerdictInFile = None
    preset: Literal[Preset, "custom"] = None  # type: ignore[valid-type]  # (Preset is a Literal at run time; a str to mypy)
    n_params: int = Field(None, ge=0)
    corpus: Corpus = None
    env: dict = None
    imported_from: str = None
    note: str = None
    probe: dict = None

    @model_validator(mode="before")
    @classmethod
    def _watched(cls, data: Any) -> Any:
        """A flt_diag.watch run's config.json holds only what was given or observed (integrations/folder.py): read
        with the fields it was not given that readers index - its data external, no tokenizer, no variant, no
        warm-down (none given: judged over every step), no evaluation or checkpoint, the rest at their defaults (an
        older watch run's file holds them all)."""
        probe = data.get("probe") if isinstance(data, dict) else None
        if isinstance(probe, dict) and "recipe" in probe and isinstance(data.get("model"), dict) \
                and isinstance(data.get("train"), dict):  # (a watch run: its probe section holds the recipe it read)
            train = {n: TrainConfig.model_fields[n].default for n in REQUIRED["train"]} | dict(
                data="external", tokenizer=None, warmdown_frac=0.0, eval_every=0, checkpoint_every=0)
            data = {**data, "model": {"variant": None, **data["model"]}, "train": {**train, **data["train"]}}
        return data

    @model_validator(mode="after")
    def _reads_as_a_run_config(self):
        """What the readers take from it (run_config) holds too: a config RunConfig refuses is refused here."""
        self.run_config()
        return self

    def run_config(self) -> RunConfig:
        """The typed config (a field an older file lacks as RunConfig.from_dict fills it in)."""
        return RunConfig.from_dict(self.as_written())

    @property
    def unigram_entropy(self) -> float | None:
        """H1 of the run's training tokens (None for an imported run, or a run of flt_diag.watch)."""
        return self.corpus.unigram_entropy if self.corpus is not None else None


# --------------------------------------------------------------------------- summary
# summary.json, the one definition of a run's summary (flt_diag.judge.verdict.summarize builds it; DESIGN.md §9).
# A field missing from a file is None (those marked "since ..." are absent from older summaries).


class Evidence(FileModel):
    """Why the verdict is what it is (flt_diag.judge.verdict.verdict and judged); which fields a summary holds
    depends on the rule that decided (a diverged run has none of the loss figures)."""

    min_smoothed_loss: float = figure(False)  # min over t of the smoothed loss s
    min_step: int = Field(None, ge=0)  # where s is lowest
    final_smoothed_loss: float = figure(False)  # s at the last step
    climb: float = figure(False)  # the largest rise of s above its running minimum
    climb_step: int = Field(None, ge=0)  # where that rise peaks
    climb_start_step: int = Field(None, ge=0)  # the running minimum it rose from
    recovered: float = figure(False)  # how far s fell back from the climb's peak by the end
    rebound: float = figure(False)  # gap: final s - min s
    rebound_threshold: float = figure(False)  # max(rebound_abs, rebound_rel * min s)
    recovery_tolerance: float = figure(False)  # tol(min s)
    transient_rebound: bool = None  # the climb exceeded the threshold and the run recovered (a loss spike)
    unigram_entropy: Optional[float] = figure(False)  # H1 of the training tokens (None: an imported run)
    smooth_window: int = Field(None, ge=1)  # steps of the trailing mean
    stall_reference: Optional[float] = figure(False)  # since v3: H1 as the stall rule read it
    stall_margin: Optional[float] = figure(False)  # since v3: tol(H1)
    stalled: bool = None  # since v3: rule 3 fired
    stall_judged: str = None  # since v3: whether rule 3 could be judged, and against what
    nonfinite_step: int = Field(None, ge=0)  # a diverged run: the first step with a non-finite loss
    reason: str = None  # the verdict in words
    osc_dlog_median: float = figure(False)  # since v3: the worst judged window's median |dlog g| (NaN: none judged)
    osc_alternation: float = figure(False)  # since v3: that window's share of sign changes
    osc_dlog_window: Optional[list[int]] = many(False, 2)  # since v3: [first, last] step
    osc_dlog_threshold: float = figure(False)  # since v3: the threshold of rule 4b
    osc_windows_judged: int = Field(None, ge=0)  # since v3: windows with enough differences to judge
    osc_span_end: int = Field(None)  # since v3: the warm-down start (the first step rule 4b leaves out)
    osc_loop_count: Literal["fixed", "sampled"] = None  # since v4: whether loops_run changed before the warm-down
    osc_loop_slope: float = figure(False)  # since v4: the worst window's slope of dlog g on dlog r (NaN: none fitted)
    predicted_at: int = Field(None, ge=0)  # a run ended by the collapse predictor: the step it fired
    oscillation: str = None  # a run of flt_diag.watch: why 4b was not judged (clipped gradients, or no window)
    warmdown: str = None  # a run of flt_diag.watch: the warm-down rule 4b leaves out (the user's), or none
    not_recorded: dict[str, str] = None  # a run of flt_diag.watch: records the hooks could not take (name -> why)


class Prediction(FileModel):
    """The collapse predictor's alarm that ended the run (--stop-on-collapse)."""

    step: int = Field(ge=0)
    p_collapse: float = Field(None, ge=0, le=1)
    evidence: str = None  # its features in words (early_warning.evidence_text)
    features: dict = None  # the features' values at that step, by name


class Milestone(FileModel):
    """The reference's milestone statistics: population stds over the steps since the previous milestone."""

    step: int = Field(ge=0)
    loss_std: float = figure()
    grad_norm_std: float = figure()


class OscillationWindow(FileModel):
    """The v2 oscillation indices (flt_diag.judge.verdict's module doc) over steps [start, end]."""

    start: int = Field(ge=0)
    end: int = Field(ge=0)
    cv: float = figure()
    mean_abs_dlog: float = figure()
    sign_alternation: float = figure()
    neg_cosine_share: float = figure()


class DlogWindow(FileModel):
    """One window rule 4b judged: its steps, differences, median |dlog g| and alternation share."""

    start: int = Field(ge=0)
    end: int = Field(ge=0)
    differences: int = Field(ge=0)
    median_abs_dlog: float = figure()
    alternation: float = figure()
    loop_slope: float = figure(False)  # since v4: its slope of dlog g on dlog r (NaN: none fitted)
    count_changes: int = Field(None, ge=0)  # since v4: its pairs whose loop count changed


class Summary(FileModel, frozen=True):
    """A run's summary.json: the verdict, its evidence and the run's key figures (in the order written)."""

    verdict: Verdict
    verdict_version: Optional[int] = Field(None, ge=1)  # since v3 (a summary without one was judged by v1/v2)
    verdict_v3: Optional[Verdict] = None  # since v4: the verdict by v3's rules (rule 4b without the loop count)
    evidence: Evidence
    residual_explosion: bool  # the final loop's peak loop-end residual norm > explosion_ratio * sqrt(d)
    peak_resid_norm: Optional[float] = figure()  # that peak (NaN: none recorded)
    peak_resid_norm_any: Optional[float] = figure(False)  # the peak over every loop, layer and loop end
    peak_resid_loop: Optional[int] = Field(None, ge=0)  # the loop of that peak
    residual_explosion_any: bool = None  # the same test on peak_resid_norm_any (FLA explodes its first loop)
    peak_resid_step: Optional[int] = Field(None, ge=0)  # the step of the final loop's peak
    final_resid_norm: Optional[float] = figure(False)  # the final loop's loop-end norm at the last step
    resid_ratio: Optional[float] = figure(False)  # peak_resid_norm / sqrt(d)
    explosion_threshold: Optional[float] = figure(False)  # explosion_ratio * sqrt(d)
    variant: config_type(ModelConfig, "variant")  # type: ignore[valid-type]  # (a config field's type)
    loops: config_type(ModelConfig, "loops")  # type: ignore[valid-type]  # (a config field's type)
    seed: config_type(TrainConfig, "seed")  # type: ignore[valid-type]  # (a config field's type)
    lr_scale: config_type(TrainConfig, "lr_scale")  # type: ignore[valid-type]  # (a config field's type)
    final_loss: Optional[float] = figure()  # the smoothed training loss at the last finite step
    best_loss: Optional[float] = figure()  # its minimum (the evidence's min_smoothed_loss)
    val_loss: Optional[float] = figure()  # the last held-out loss (NaN: never evaluated)
    val_ppl: Optional[float] = figure(False)  # exp(val_loss)
    val_accuracy: Optional[float] = figure(False)  # since the tasks: the last held-out accuracy
    osc_cv: Optional[float] = figure()  # the v2 indices over the dense steps (no rule reads them)
    osc_mean_abs_dlog: Optional[float] = figure(False)
    osc_sign_alternation: Optional[float] = figure(False)
    osc_neg_cosine_share: Optional[float] = figure(False)
    osc_dlog_median: Optional[float] = figure(False)  # since v3: rule 4b's index (the evidence's)
    osc_alternation: Optional[float] = figure(False)  # since v3
    osc_dlog_median_v3: Optional[float] = figure(False)  # since v4: v3's index (v4's own at a fixed loop count)
    stall_reference: Optional[float] = figure(False)  # since v3: as in the evidence
    stall_margin: Optional[float] = figure(False)  # since v3
    loss_std: Optional[float] = figure(False)  # the warm-down milestone's stds (the constant-lr phase)
    grad_norm_std: Optional[float] = figure(False)
    loss_std_warmdown: Optional[float] = figure(False)  # the last step's (the warm-down itself)
    grad_norm_std_warmdown: Optional[float] = figure(False)
    milestones: list[Milestone] = many(False, 0)
    oscillation_windows: list[OscillationWindow] = many(False, 0)  # the v2 indices per osc_window steps
    osc_dlog_windows: list[DlogWindow] = many(False, 0)  # since v3: the windows rule 4b judged
    steps_done: int = Field(ge=0)
    steps: config_type(TrainConfig, "steps")  # type: ignore[valid-type]  # (a config field's type)
    wall_time: Optional[float] = Field(None, ge=0)  # seconds (None: not timed)
    stop_reason: Optional[str] = None  # why the run ended before its steps (None: it did not)
    prediction: Optional[Prediction] = None  # the alarm that ended it (--stop-on-collapse)
    decided_at: Optional[int] = Field(None, ge=0)  # the step its criteria were certain (--stop-when-decided)
    tokens_per_s: Optional[float] = Field(None, ge=0, allow_inf_nan=True)  # training throughput

# --------------------------------------------------------------------------- sweep and map specs

class BaseInSpec(FreeFileModel):
    model: ModelInFile
    train: TrainInFile
    diagnostics: DiagnosticsConfig = None


@required(*SweepAxes.model_fields)
class SweepSpecFile(SweepAxes, FreeFileModel):
    """A sweep's sweep.json: its grid (SweepAxes'), the cells' names, the base config."""

    base: BaseInSpec
    cell_names: Items[str]


@required(*MapAxes.model_fields)
class MapSpecFile(MapAxes, FreeFileModel):
    """A map's sweep.json (`kind: map`): its lines, axis and criteria (MapAxes'), the base config and the grid,
    whose values follow the axis (map_spec_model)."""

    kind: Literal["map"]
    grid: list[int | float]  # (of the values LrMapSpecFile or DepthMapSpecFile holds)
    base: BaseInSpec


Grid = Annotated[list[G], Field(min_length=1, max_length=MAX_GRID), Distinct, Ascending]  # a map's grid of Gs


class LrMapSpecFile(MapSpecFile):
    grid: Grid[config_type(TrainConfig, "lr_scale")]  # type: ignore[valid-type]  # (bounded like --lr-scale)


class DepthMapSpecFile(MapSpecFile):
    grid: Grid[config_type(ModelConfig, "depth")]  # type: ignore[valid-type]  # (bounded like --depth)


def map_spec_model(axis: str | None = "lr") -> type[MapSpecFile]:
    """A map's sweep.json; its grid holds depths on the depth axis, else lr scales."""
    return DepthMapSpecFile if axis == "depth" else LrMapSpecFile


# --------------------------------------------------------------------------- predictor and fit examples

class LogisticModel(FreeFileModel):
    mean: list[float] = many(length_of="features")  # (as many as the predictor's features: PredictorFile checks)
    std: list[Annotated[float, Field(gt=0)]] = many(length_of="features")
    coef: list[float] = many(length_of="features")
    intercept: float
    runs: int = Field(None, ge=0)
    positives: int = Field(None, ge=0)
    train_accuracy: float = Field(None, ge=0, le=1)


class PredictorFile(FreeFileModel):
    """fit-predictor's JSON: features, one logistic model per step (a mean, std and coefficient per
    feature), the threshold in (0, 1), the target."""

    features: Items[Literal[tuple(FEATURES)]]  # type: ignore[valid-type]  # (Literal of the names: valid at run time)
    models: dict[Annotated[int, Field(ge=1)], LogisticModel] = Field(min_length=1, max_length=MAX_ITEMS)
    threshold: float = Field(0.5, gt=0, lt=1)
    target: Literal[tuple(TARGETS)] = "collapse"  # type: ignore[valid-type]  # (a predictor of before the targets)
    class_weight: Literal[CLASS_WEIGHTS] = None  # type: ignore[valid-type]
    l2: float = Field(None, gt=0)

    @field_validator("models", mode="before")
    @classmethod
    def _steps_read_as_numbers(cls, x):
        """JSON tables have text keys: "100" is step 100 (any other text stays, and is refused)."""
        return {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in x.items()} \
            if isinstance(x, dict) else x

    @model_validator(mode="after")
    def _one_value_per_feature(self):
        for step, m in self.models.items():
            for name in ("mean", "std", "coef"):
                if len(getattr(m, name)) != len(self.features):
                    raise ValueError(f"models.{step}.{name} has {len(getattr(m, name))} items but features has "
                                     f"{len(self.features)}")
        return self


STALL_EVIDENCE = ("final_smoothed_loss", "stall_reference", "stall_margin")  # the stall rule's evidence
if TYPE_CHECKING:  # (mypy cannot see create_model's fields: a row's values are Any to it)
    ExampleRow = Any
else:
    ExampleRow = create_model(
        "ExampleRow", __base__=FileModel, run=(str, ...),
        **{n: (config_type(ModelConfig, n), Field(validation_alias=ModelConfig.model_fields[n].validation_alias))
           for n in ("variant", "loops", "depth", "width")},  # (a table written before names them n_layer, n_embd)
        **{n: (config_type(TrainConfig, n), ...) for n in ("seed", "lr_scale")},
        steps_done=(int, Field(ge=0)), verdict=(Verdict, ...), climb=(Optional[float], figure()),
        rebound_threshold=(Optional[float], figure()), transient_rebound=(bool, ...),
        # (since verdict v3; a table written before has none of these four: relabelled as far as it can be)
        verdict_version=(Optional[int], Field(None, ge=1)),
        **{n: (Optional[float], figure(False)) for n in STALL_EVIDENCE},
        step=(int, Field(ge=1)),
        **{f: (Optional[float], figure()) for f in FEATURES})
ExamplesTable = Annotated[list[ExampleRow], Field(min_length=1, max_length=MAX_ITEMS)]

