"""What each kind of file flt-diag reads may hold, as pydantic models (flt_diag.storage.files loads with
them). A field that is an option of the typed config is the config's own field (`like`), so a size read
from a file obeys the same bounds as the command line; the config sections themselves are models too
(flt_diag.vocab.config). Strict types, finite floats (unless a figure a run computed: a diverged run's
loss is NaN) and no unknown key, unless the model says `extra="allow"` (free-form metadata).

Files whose content depends on the run that reads them (resume.pt, checkpoint.pt: the weights' shapes,
the number of steps and optimizers) take it as validation context. Torch-free: a tensor is anything
with `.shape` and `.dtype`.
"""
from __future__ import annotations

import functools
from typing import Annotated, Any, Optional

from pydantic import ConfigDict, Field, create_model, field_validator, model_validator
from pydantic_core import PydanticUndefined

from flt_diag.storage.predictor_names import CLASS_WEIGHTS, FEATURES, TARGETS
from flt_diag.vocab.config import DiagnosticsConfig, ModelConfig, TrainConfig, VerdictConfig
from flt_diag.vocab.grid_options import MAX_GRID, MapAxes, SweepAxes
from flt_diag.vocab.option_fields import MAX_ITEMS, Options, field_like
from flt_diag.vocab.variants import MAX_LOOPS

VERDICTS = ("stable", "unstable", "stalled", "collapsed", "diverged")  # verdict v3 (flt_diag.judge.verdict)
FREE = ConfigDict(extra="allow")


class FileModel(Options):
    """A part of a file: strict, finite, no unknown key (Options' rules), validated with model_validate."""

    model_config = ConfigDict(protected_namespaces=())


class FreeFileModel(FileModel, **FREE):
    """A part of a file that may hold other keys too (free-form metadata, kept as they are)."""


def like(cls, name: str, *, required: bool = True) -> Any:
    """Field `name` of config model `cls` (its help, bounds and choices), required or defaulting to None."""
    return field_like(cls.model_fields[name], required)


def one_of(choices, required: bool = True) -> Any:
    return Field(PydanticUndefined if required else None, json_schema_extra=dict(choices=list(choices)))


def many(required: bool = True, min_length: int = 1, **extra) -> Any:
    return Field(PydanticUndefined if required else None, min_length=min_length, max_length=MAX_ITEMS,
                 json_schema_extra=extra or None)


def figure(required: bool = True) -> Any:
    """A figure a run computed (NaN and infinities are values)."""
    return Field(PydanticUndefined if required else None, allow_inf_nan=True)


# --------------------------------------------------------------------------- run config

# Fields every config.json has held since the first version (the readers index them); every other field
# may be missing in an older file and takes its default.
REQUIRED = {"model": ("vocab_size", "n_layer", "n_embd", "n_head", "sequence_len", "variant", "loops"),
            "train": ("steps", "batch_size", "seed", "lr_scale", "data", "tokenizer", "eval_batches")}


def _in_file(cls, section: str):
    """A config section as a file holds it: the REQUIRED fields required, the others defaulted."""
    return create_model(f"{cls.__name__}InFile", __base__=cls,
                        **{n: (cls.model_fields[n].annotation, like(cls, n)) for n in REQUIRED.get(section, ())})


ModelInFile, TrainInFile = _in_file(ModelConfig, "model"), _in_file(TrainConfig, "train")


class VerdictInFile(VerdictConfig):
    """config.json's verdict section: its options, and the fields of earlier verdicts older files hold
    (v2's osc_cv_threshold; dropped when the config is read: RunConfig.from_dict)."""

    osc_cv_threshold: Optional[float] = Field(None, ge=0)


class Corpus(FileModel, **FREE):
    train_tokens: int = Field(None, ge=0)
    val_tokens: int = Field(None, ge=0)
    unigram_entropy: Optional[float] = Field(None, ge=0)


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
    preset: str = one_of(("tiny", "small", "paper-small", "paper-base", "custom"), required=False)
    n_params: int = Field(None, ge=0)
    corpus: Corpus = None
    env: dict = None
    imported_from: str = None
    note: str = None
    probe: dict = None


# --------------------------------------------------------------------------- summary

class Evidence(FileModel, **FREE):
    reason: str = None
    min_step: Optional[int] = Field(None, ge=0)
    transient_rebound: bool = None


class Prediction(FileModel, **FREE):
    step: int = Field(ge=0)
    p_collapse: float = Field(None, ge=0, le=1)


class SummaryFile(FileModel, **FREE):
    """summary.json: the fields its readers use (verdict line, tables, criteria, early warning)."""

    verdict: str = one_of(VERDICTS)
    evidence: Evidence
    residual_explosion: bool
    residual_explosion_any: bool = None
    peak_resid_norm: Optional[float] = figure()
    variant: Optional[str] = like(ModelConfig, "variant")  # None: a flt_diag.watch run of a model of its own
    loops: int = like(ModelConfig, "loops")
    seed: int = like(TrainConfig, "seed")
    lr_scale: float = like(TrainConfig, "lr_scale")
    final_loss: Optional[float] = figure()
    best_loss: Optional[float] = figure()
    val_loss: Optional[float] = figure()
    osc_cv: Optional[float] = figure()
    steps_done: int = Field(ge=0)
    steps: int = like(TrainConfig, "steps")
    prediction: Optional[Prediction] = None
    oscillation_windows: list[dict] = many(False, 0)
    milestones: list[dict] = many(False, 0)


# --------------------------------------------------------------------------- sweep and map specs

class BaseInSpec(FileModel, **FREE):
    model: ModelInFile
    train: TrainInFile
    diagnostics: DiagnosticsConfig = None


class SweepSpecFile(FileModel, **FREE):
    variants: list[str] = like(SweepAxes, "variants")
    loops: list[int] = like(SweepAxes, "loops")
    seeds: list[int] = like(SweepAxes, "seeds")
    lr_scales: list[float] = like(SweepAxes, "lr_scales")
    base: BaseInSpec
    cell_names: list[str] = many(distinct=True)


def _grid_values(axis: str) -> Any:
    """A map's grid: lr scales (bounded like --lr-scale) or depths (like --depth), distinct, ascending."""
    info = ModelConfig.model_fields["n_layer"] if axis == "depth" else TrainConfig.model_fields["lr_scale"]
    kinds = {"Ge": "ge", "Le": "le", "Gt": "gt", "Lt": "lt"}
    bounds = {kinds[type(m).__name__]: getattr(m, kinds[type(m).__name__]) for m in info.metadata
              if type(m).__name__ in kinds}
    return Field(min_length=1, max_length=MAX_GRID, json_schema_extra=dict(items=bounds, distinct=True,
                                                                            ascending=True))


@functools.cache
def map_spec_model(axis: str = "lr"):
    """A map's sweep.json; its grid holds lr scales or depths (`axis`)."""
    return create_model(f"MapSpecFile_{axis}", __base__=FreeFileModel,
                        kind=(str, one_of(("map",))), variants=(list[str], like(MapAxes, "variants")),
                        loops=(list[int], like(MapAxes, "loops")), seeds=(list[int], like(MapAxes, "seeds")),
                        axis=(str, like(MapAxes, "axis")),
                        grid=(list[int] if axis == "depth" else list[float], _grid_values(axis)),
                        criteria=(list[str], like(MapAxes, "criteria")), base=(BaseInSpec, ...))


# --------------------------------------------------------------------------- predictor and fit examples

class LogisticModel(FileModel, **FREE):
    mean: list[float] = many(length_of="features")  # (as many as the predictor's features: PredictorFile checks)
    std: list[Annotated[float, Field(gt=0)]] = many(length_of="features")
    coef: list[float] = many(length_of="features")
    intercept: float
    runs: int = Field(None, ge=0)
    positives: int = Field(None, ge=0)
    train_accuracy: float = Field(None, ge=0, le=1)


class PredictorFile(FileModel, **FREE):
    """fit-predictor's JSON: features, one logistic model per step (a mean, std and coefficient per
    feature), the threshold in (0, 1), the target."""

    features: list[str] = Field(min_length=1, max_length=MAX_ITEMS, json_schema_extra=dict(choices=FEATURES,
                                                                                            distinct=True))
    models: dict[Annotated[int, Field(ge=1)], LogisticModel] = Field(min_length=1, max_length=MAX_ITEMS)
    threshold: float = Field(None, gt=0, lt=1)
    target: str = one_of(TARGETS, required=False)
    class_weight: str = one_of(CLASS_WEIGHTS, required=False)
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


EXAMPLE_IDENTITY = ("run", "variant", "loops", "n_layer", "n_embd", "seed", "lr_scale")
STALL_EVIDENCE = ("final_smoothed_loss", "stall_reference", "stall_margin")  # the stall rule's evidence
ExampleRow = create_model(
    "ExampleRow", __base__=FileModel, run=(str, ...),
    **{n: (ModelConfig.model_fields[n].annotation, like(ModelConfig, n)) for n in ("variant", "loops", "n_layer",
                                                                                   "n_embd")},
    **{n: (TrainConfig.model_fields[n].annotation, like(TrainConfig, n)) for n in ("seed", "lr_scale")},
    steps_done=(int, Field(ge=0)), verdict=(str, one_of(VERDICTS)), climb=(Optional[float], figure()),
    rebound_threshold=(Optional[float], figure()), transient_rebound=(bool, ...),
    # (since verdict v3; a table written before has none of these four: relabelled as far as it can be)
    verdict_version=(Optional[int], Field(None, ge=1)),
    **{n: (Optional[float], figure(False)) for n in STALL_EVIDENCE},
    step=(int, Field(ge=1)),
    **{f: (Optional[float], figure()) for f in FEATURES})
ExamplesTable = Annotated[list[ExampleRow], Field(min_length=1, max_length=MAX_ITEMS)]


# --------------------------------------------------------------------------- reference meta json

META_LOOP_KEYS = ("K", "n_loops", "loops", "num_loops")  # "K": the reference's GPTConfig
META_VARIANT_KEYS = ("model_type", "variant", "loop_type")  # "model_type": the reference's GPTConfig


def _meta_fields() -> dict:
    """nanochat's sizes (bounded like the command line's), K and the variant under the reference's names."""
    size = {n: (Optional[int], like(ModelConfig, n, required=False))
            for n in ("sequence_len", "vocab_size", "n_layer", "n_head", "n_embd")}
    size["n_kv_head"] = (Optional[int], like(ModelConfig, "n_head", required=False))
    loops = {k: (Optional[int], Field(None, ge=1, le=MAX_LOOPS)) for k in META_LOOP_KEYS}
    return size | loops | {k: (Optional[str], None) for k in META_VARIANT_KEYS}


MetaModelConfig = create_model("MetaModelConfig", __base__=FreeFileModel, **_meta_fields())
ReferenceMeta = create_model("ReferenceMeta", __base__=MetaModelConfig,
                             sizes=(Optional[MetaModelConfig], Field(None, alias="model_config")))
