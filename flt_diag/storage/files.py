"""Every kind of file flt-diag reads, and its one validating loader. A file may come from anywhere (a
colleague's run folder, a downloaded checkpoint), so each is checked before anything is allocated or
trained from it: its types, ranges and required fields, against a schema (flt_diag.storage.schema)
whose fields that are options of the typed config (flt_diag.vocab.config) carry the config's own bounds.
A bad file is one `BadFile` line naming the file and the field; nothing is written.

    kind               file                          loader (its readers call it)
    run config         <run>/config.json             load_run_config   (storage.load_config)
    sweep / map spec   <sweep>/sweep.json            load_spec         (storage.load_spec)
    summary            <run>/summary.json            load_summary      (storage.load_summary)
    metrics part       <run>/metrics/part-*.parquet  check_metrics_part (storage.load_metrics)
    resume state       <run>/resume.pt               check_resume_state (training.checkpoint.restore)
    final checkpoint   <run>/checkpoint.pt           check_checkpoint  (training.evaluation)
    predictor          fit-predictor's JSON          load_predictor    (settle, the predict command)
    fit examples       fit-predictor's --examples-out load_examples     (predictor_fit.training_examples)
    study              experiments/*.toml            load_study        (the `study` command)
    reference meta     meta_<step>.json              check_reference_meta (model.reference)

The generated tests (tests/test_file_loaders.py) mutate every field of each schema. Torch-free.
"""
from __future__ import annotations

import functools
import io
import re
from dataclasses import replace
from pathlib import Path

import pandas as pd

from flt_diag.storage.safe_files import regular_file
from flt_diag.storage.predictor_names import CLASS_WEIGHTS, FEATURES, PACKAGED, TARGETS
from flt_diag.storage.schema import (MAX_ITEMS, BadFile, Items, Record, Scalar, Shape, Table, bad, checked, read_json,
                                      read_text, scalar_of, value)
from flt_diag.vocab.config import SECTIONS, ModelConfig, RunConfig, TrainConfig, options_of
from flt_diag.vocab.grid_options import MAX_GRID, MapLinesGrid, SweepGrid
from flt_diag.vocab.variants import MAX_LOOPS

# --------------------------------------------------------------------------- run config

# Fields every config.json has held since the first version (the readers index them); every other field
# may be missing in an older file and takes its default.
REQUIRED = {"model": ("vocab_size", "n_layer", "n_embd", "n_head", "sequence_len", "variant", "loops"),
            "train": ("steps", "batch_size", "seed", "lr_scale", "data", "tokenizer", "eval_batches")}


@functools.cache  # each schema is built once (from the option tables) and never changed
def section_schema(name: str, required: bool = True) -> Record:
    return Record({o.name: Scalar(o, o.name in REQUIRED.get(name, ())) for o in options_of(SECTIONS[name], name)},
                  required)


@functools.cache
def run_config_schema() -> Record:
    """config.json: the config sections (fields checked by their own Options), the preset, and what the
    Trainer adds (parameter count, corpus figures, environment; free-form except the corpus figures)."""
    count, number = Scalar(value(int, low=0), False), Scalar(value(float, low=0, optional=True), False)
    return Record({"model": section_schema("model"), "train": section_schema("train"),
                   "diagnostics": section_schema("diagnostics"), "verdict": section_schema("verdict", False),
                   "preset": Scalar(value(str), False), "n_params": count,
                   "corpus": Record({"train_tokens": count, "val_tokens": count, "unigram_entropy": number},
                                    required=False, other_keys=True),
                   "env": Record(required=False, other_keys=True), "imported_from": Scalar(value(str), False),
                   "note": Scalar(value(str), False)}, other_keys=True)


def load_run_config(path: Path) -> dict:
    """config.json checked field by field, then by the typed config's rules across fields (the width
    splits into heads)."""
    cfg = checked(path, run_config_schema(), read_json(path))
    try:
        RunConfig.from_dict(cfg)
    except ValueError as e:
        raise bad(path, str(e).splitlines()[0]) from None
    return cfg


def check_model_config(model: dict, path, where: str = "model_config") -> dict:
    """A model section found in another file (checkpoint.pt's model_config)."""
    model = checked(path, section_schema("model"), model, where)
    try:
        ModelConfig(**model)
    except ValueError as e:
        raise bad(path, f"{where}: {e}") from None
    return model


# --------------------------------------------------------------------------- summary

@functools.cache
def summary_schema() -> Record:
    """summary.json: the fields its readers use (verdict line, tables, criteria, early warning)."""
    model, train = {o.name: o for o in options_of(ModelConfig, "")}, {o.name: o for o in options_of(TrainConfig, "")}
    figure = Scalar(value(float, optional=True), nan=True)
    step = Scalar(value(int, low=0, optional=True), False)
    evidence = Record({"reason": Scalar(value(str), False), "min_step": step, "transient_rebound":
                       Scalar(value(bool), False)}, other_keys=True)
    prediction = Record({"step": Scalar(value(int, low=0)), "p_collapse": Scalar(value(float, low=0, high=1), False)},
                        required=False, other_keys=True, nullable=True)
    return Record({"verdict": Scalar(value(str, choices=("stable", "unstable", "collapsed", "diverged"))),
                   "evidence": evidence, "residual_explosion": Scalar(value(bool)),
                   "residual_explosion_any": Scalar(value(bool), False), "peak_resid_norm": figure,
                   "variant": Scalar(model["variant"]), "loops": Scalar(model["loops"]), "seed": Scalar(train["seed"]),
                   "lr_scale": Scalar(train["lr_scale"]), "final_loss": figure, "best_loss": figure,
                   "val_loss": figure, "osc_cv": figure, "steps_done": Scalar(value(int, low=0)),
                   "steps": Scalar(train["steps"]), "prediction": prediction,
                   "oscillation_windows": Items(Record(other_keys=True), False, min_items=0),
                   "milestones": Items(Record(other_keys=True), False, min_items=0)}, other_keys=True)


def load_summary(path: Path) -> dict:
    return checked(path, summary_schema(), read_json(path))


# --------------------------------------------------------------------------- sweep and map specs

CELL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,199}")  # a folder under cells/, never a path


@functools.cache
def _grid_options() -> dict:
    """The grid fields of a sweep or map spec, bounded like the command line's --loops, --axis etc."""
    return {o.name: o for cls in (SweepGrid, MapLinesGrid) for o in options_of(cls, "")}


@functools.cache
def sweep_spec_schema() -> Record:
    o = _grid_options()
    base = Record({name: section_schema(name) for name in ("model", "train")}
                  | {"diagnostics": section_schema("diagnostics", False)}, other_keys=True)
    return Record({"variants": scalar_of(o["variants"]), "loops": scalar_of(o["loops"]),
                   "seeds": scalar_of(o["seeds"]), "lr_scales": scalar_of(o["lr_scales"]), "base": base,
                   "cell_names": Items(Scalar(value(str)), distinct=True)}, other_keys=True)


@functools.cache
def map_spec_schema(axis: str = "lr") -> Record:
    """A map's sweep.json; its grid holds lr scales or depths (`axis`), bounded like --lr-scale / --depth."""
    o = _grid_options()
    grid_value = {x.name: x for x in options_of(TrainConfig, "") + options_of(ModelConfig, "")}[
        "n_layer" if axis == "depth" else "lr_scale"]
    sweep = sweep_spec_schema().entries
    return Record({"kind": Scalar(value(str, choices=("map",))), "variants": sweep["variants"],
                   "loops": sweep["loops"], "seeds": sweep["seeds"], "axis": Scalar(o["axis"]),
                   "grid": Items(Scalar(grid_value), distinct=True, ascending=True, max_items=MAX_GRID),
                   "criteria": scalar_of(o["criteria"]), "base": sweep["base"]}, other_keys=True)


MAP_KEYS = {"axis", "grid", "criteria"}  # what only a map's spec holds


def load_spec(path: Path) -> dict:
    """sweep.json of a sweep, or of a map (`kind: map`): the grid, the cells, the shared base config."""
    spec = read_json(path)
    if isinstance(spec, dict) and ("kind" in spec or MAP_KEYS & set(spec) and "cell_names" not in spec):
        return checked(path, map_spec_schema(spec.get("axis") if spec.get("axis") == "depth" else "lr"), spec)
    spec = checked(path, sweep_spec_schema(), spec)
    n = len(spec["variants"]) * len(spec["loops"]) * len(spec["seeds"]) * len(spec["lr_scales"])
    if len(spec["cell_names"]) != n:
        raise bad(path, f"cell_names has {len(spec['cell_names'])} names for a grid of {n} cells")
    wrong = next((c for c in spec["cell_names"] if not CELL_NAME.fullmatch(c)), None)
    if wrong is not None:
        raise bad(path, f"cell_names: {wrong[:60]!r} is not a cell name (a folder under cells/)")
    return spec


# --------------------------------------------------------------------------- metrics parts

METRICS_COLUMNS = {"step": "integer", "metric": "string", "loop": "integer", "layer": "integer",
                   "value": "floating"}
PART_NAME = re.compile(r"part-(\d{1,18})-(\d{1,18})-(\d{1,9})\.parquet")


def part_steps(path: Path) -> tuple[int, int]:
    """The first and last step in a part's name (part-<first>-<last>-<n>.parquet)."""
    m = PART_NAME.fullmatch(Path(path).name)
    if m is None or int(m.group(1)) > int(m.group(2)):
        raise BadFile(f"{path}: not a metrics part name (part-<first step>-<last step>-<n>.parquet)")
    return int(m.group(1)), int(m.group(2))


def check_metrics_part(path: Path) -> None:
    """A metrics part's name, and its columns and their types (read from the Parquet footer only)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    part_steps(path)
    regular_file(path)  # a FIFO in its place would block the Parquet reader
    try:
        schema = pq.read_schema(path)
    except (OSError, pa.ArrowException) as e:
        raise BadFile(f"{path}: not a readable Parquet file ({' '.join(str(e).split())[:120]})") from None
    kinds = {"integer": pa.types.is_integer, "string": lambda t: pa.types.is_string(t) or pa.types.is_large_string(t),
             "floating": pa.types.is_floating}
    names = [n for n in schema.names if n != "__index_level_0__"]
    for name, kind in METRICS_COLUMNS.items():
        if name not in names:
            raise BadFile(f"{path}: column {name} is missing (a metrics part has {', '.join(METRICS_COLUMNS)})")
        if not kinds[kind](schema.field(name).type):
            raise BadFile(f"{path}: column {name} holds {schema.field(name).type}, not {kind} values")
    extra = [n for n in names if n not in METRICS_COLUMNS]
    if extra:
        raise BadFile(f"{path}: column {extra[0]} is not a metrics column")


# --------------------------------------------------------------------------- predictor

@functools.cache
def predictor_schema() -> Record:
    """fit-predictor's JSON: features, one logistic model per step (a mean, std and coefficient per
    feature), the threshold in (0, 1), the target."""
    numbers = Items(Scalar(value(float)), length_of="features")
    model = Record({"mean": numbers, "std": Items(Scalar(value(float, above=0)), length_of="features"),
                    "coef": numbers, "intercept": Scalar(value(float)), "runs": Scalar(value(int, low=0), False),
                    "positives": Scalar(value(int, low=0), False),
                    "train_accuracy": Scalar(value(float, low=0, high=1), False)}, other_keys=True)
    return Record({"features": Items(Scalar(value(str, choices=FEATURES)), distinct=True),
                   "models": Table(value(int, low=1), model), "threshold": Scalar(value(float, above=0, below=1), False),
                   "target": Scalar(value(str, choices=TARGETS), False),
                   "class_weight": Scalar(value(str, choices=CLASS_WEIGHTS), False),
                   "l2": Scalar(value(float, above=0), False)}, other_keys=True)


EXAMPLE_IDENTITY = ("run", "variant", "loops", "n_layer", "n_embd", "seed", "lr_scale")


@functools.cache
def examples_schema() -> Items:
    """A fit-examples table (fit-predictor --examples-out): one row per run and fitted step."""
    model, train = {o.name: o for o in options_of(ModelConfig, "")}, {o.name: o for o in options_of(TrainConfig, "")}
    number = Scalar(value(float, optional=True), nan=True)
    return Items(Record({"run": Scalar(value(str)), "variant": Scalar(model["variant"]),
                         "loops": Scalar(model["loops"]), "n_layer": Scalar(model["n_layer"]),
                         "n_embd": Scalar(model["n_embd"]), "seed": Scalar(train["seed"]),
                         "lr_scale": Scalar(train["lr_scale"]), "steps_done": Scalar(value(int, low=0)),
                         "verdict": Scalar(value(str, choices=("stable", "unstable", "collapsed", "diverged"))),
                         "climb": number, "rebound_threshold": number,
                         "transient_rebound": Scalar(value(bool)), "step": Scalar(value(int, low=1)),
                         **{f: number for f in FEATURES}}))


def load_examples(path: Path) -> list[dict]:
    """A fit-examples CSV, checked row by row (a run's identity, verdict evidence, step and features)."""
    text = read_text(path)
    try:
        df = pd.read_csv(io.StringIO(text)).astype(object)
        rows = df.where(df.notna(), None).to_dict("records")  # Python values; an empty cell is None
    except (ValueError, pd.errors.ParserError) as e:
        raise BadFile(f"unreadable {path}: {str(e)[:100]}") from None
    return checked(path, examples_schema(), rows)


def load_predictor(path=None) -> dict:
    """A predictor JSON (None: the packaged one), checked field by field: a predictor without means,
    with a text coefficient or a threshold outside (0, 1) is one line. An empty name is an error, not
    the packaged predictor."""
    if path is None:
        path = PACKAGED
    if str(path) in ("", "."):
        raise BadFile("the predictor file name is empty (leave --predictor out for the packaged predictor)")
    return checked(path, predictor_schema(), read_json(path))


# --------------------------------------------------------------------------- study files

def study_entry(o):
    """A study file's value of option `o` (a list for a list option; a path is text)."""
    return scalar_of(replace(o, kind=str) if o.kind is Path else o, required=False)


def study_schema(tables: dict[str, list], table: str) -> Record:
    """A study file whose one table is `table` (of `tables`: the options of each by name; one value for a
    list option is a list of one), with free keys (description, gpu) around it."""
    return Record({table: Record({o.dest: study_entry(o) for o in tables[table]})}, other_keys=True)


def load_study(path: Path, tables: dict[str, list]) -> tuple[str, dict]:
    """A study file -> (its table's name, option values keyed by Option.dest): exactly one of `tables`
    ({"ablation": [Option, ...], ...}), whose keys are those options' names, checked like the command line."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    try:
        spec = tomllib.loads(read_text(path))
    except tomllib.TOMLDecodeError as e:
        raise BadFile(f"{path}: not valid TOML ({e})") from None
    found = [t for t in tables if t in spec]
    if len(found) != 1 or not isinstance(spec[found[0]], dict):
        raise BadFile(f"{path}: needs exactly one {' or '.join(f'[{t}]' for t in tables)} table")
    table, known = found[0], {o.dest: o for o in tables[found[0]]}
    values = {}
    for key, x in spec[table].items():
        o = known.get(key.replace("-", "_"))
        if o is None:
            raise BadFile(f"{path}: unknown option {key!r} in [{table}]")
        if o.many and not isinstance(x, list):
            x = [x]
        values[o.dest] = _as_kind(o, checked(path, study_entry(o), x, f"[{table}] {key}"))  # (study_schema's entry)
    return table, values


def _as_kind(o, x):
    def one(v):
        return Path(v) if o.kind is Path else float(v) if o.kind is float else v
    return [one(v) for v in x] if o.many else one(x)


# --------------------------------------------------------------------------- reference meta json

@functools.cache
def reference_meta_schema() -> Record:
    """nanochat's meta_<step>.json: the model sizes (top level or under model_config), K and the variant
    under the names the reference uses; the sizes obey the command line's bounds."""
    o = {x.name: replace(x, optional=True) for x in options_of(ModelConfig, "")}
    sizes = {name: Scalar(o[name], False) for name in ("sequence_len", "vocab_size", "n_layer", "n_head", "n_embd")}
    sizes["n_kv_head"] = Scalar(o["n_head"], False)
    loops = {k: Scalar(value(int, optional=True, low=1, high=MAX_LOOPS), False) for k in META_LOOP_KEYS}
    variant = {k: Scalar(value(str, optional=True), False) for k in META_VARIANT_KEYS}
    return Record({"model_config": Record(sizes | loops | variant, required=False, other_keys=True, nullable=True),
                   **sizes, **loops, **variant}, other_keys=True)


META_LOOP_KEYS = ("K", "n_loops", "loops", "num_loops")  # "K": the reference's GPTConfig
META_VARIANT_KEYS = ("model_type", "variant", "loop_type")  # "model_type": the reference's GPTConfig


def check_reference_meta(meta, path) -> dict:
    return checked(path, reference_meta_schema(), meta)


# --------------------------------------------------------------------------- torch files

def resume_schema(model_shapes: dict, steps: int, optimizers: int, callbacks_as_list: bool) -> Record:
    """resume.pt of a run: its next step (at most the run's steps), wall time, weights of this model's
    shapes, one state per optimizer, the callbacks' states (by name; a list in older files)."""
    callback = Record(other_keys=True)
    param_group = Record({"params": Items(Scalar(value(int, low=0, high=MAX_ITEMS)))}, other_keys=True)
    per_param = Table(value(int, low=0), Record(other_keys=True), min_items=0)  # parameter index -> its state
    optimizer = Record({"state": per_param, "param_groups": Items(param_group)}, other_keys=True)
    return Record({"step": Scalar(value(int, low=0, high=steps)), "wall_time": Scalar(value(float, low=0)),
                   "model": Record({k: Shape(tuple(s)) for k, s in model_shapes.items()}),
                   "optimizers": Items(optimizer, min_items=optimizers, max_items=optimizers),
                   "callbacks": Items(callback, min_items=0) if callbacks_as_list else Record(other_keys=True)})


def check_resume_state(state, path, model_shapes: dict, steps: int, optimizer_shapes: list[list[tuple]]) -> dict:
    """resume.pt checked against the run that resumes it (shapes of its weights and of its optimizers'
    parameters) before any of it is loaded."""
    schema = resume_schema(model_shapes, steps, len(optimizer_shapes),
                           isinstance(state, dict) and isinstance(state.get("callbacks"), list))
    state = checked(path, schema, state)
    for i, (saved, shapes) in enumerate(zip(state["optimizers"], optimizer_shapes)):
        where = f"optimizers[{i}]"
        params = [p for g in saved["param_groups"] for p in g["params"]]
        if len(params) != len(shapes):
            raise bad(path, f"{where} holds {len(params)} parameters; this run's has {len(shapes)}")
        for index, per_param in saved["state"].items():
            if not isinstance(per_param, dict) or index not in params:
                raise bad(path, f"{where}.state.{index} is not the state of one of its parameters")
            shape = shapes[params.index(index)]
            for name, x in per_param.items():
                got = tuple(getattr(x, "shape", ()))
                if got and got != tuple(shape):
                    raise bad(path, f"{where}.state.{index}.{name} has shape {got}; its parameter's is {tuple(shape)}")
    return state


def checkpoint_schema(model_shapes: dict | None = None) -> Record:
    """checkpoint.pt: the final weights (with `model_shapes`: exactly those, of those shapes: the model
    its model_config builds), the model config, the steps trained."""
    weights = Record({k: Shape(tuple(s)) for k, s in model_shapes.items()}) if model_shapes else Record(other_keys=True)
    return Record({"model": weights, "model_config": section_schema("model"), "step": Scalar(value(int, low=0), False)})


def check_checkpoint(obj, path, model_shapes: dict | None = None) -> dict:
    """checkpoint.pt checked: its model config first (it sizes the model), then, given the shapes of the
    model built from it, its weights."""
    obj = checked(path, checkpoint_schema(model_shapes), obj)
    check_model_config(obj["model_config"], path)
    return obj


FILE_KINDS = ("run config", "sweep spec", "map spec", "summary", "metrics part", "resume state", "checkpoint",
              "predictor", "study", "reference meta")  # the table above (the generated tests cover each)
