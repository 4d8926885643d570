"""Every kind of file flt-diag reads, and its one validating loader (the table of kinds, loaders and
what each checks: docs/DESIGN.md §9). Models: flt_diag.storage.file_models. A bad file is one `BadFile`
line naming the file and the field; nothing is written. Torch-free.
"""
from __future__ import annotations

import io
import re
import sys
from pathlib import Path
from typing import Annotated, Collection

import pandas as pd
from pydantic import Field, field_validator, model_validator

from flt_diag.storage import file_models as F
from flt_diag.storage.reference_meta import META_LOOP_KEYS, META_VARIANT_KEYS, ReferenceMeta  # noqa: F401 (re-exported)
from flt_diag.storage.predictor_names import PACKAGED
from flt_diag.storage.schema import MAX_ITEMS, BadFile, bad, checked, read_json, read_text
from flt_diag.config.variants import Variant
from flt_diag.storage.safe_files import regular_file

# --------------------------------------------------------------------------- run config


def load_run_config(path: Path) -> F.RunConfigFile:
    """config.json, checked. A run made where a record or stabiliser of one's own was installed, read where it is
    not (its config's env names them): the options of records that were off there are set aside (they did nothing);
    one that was on, or the stabiliser the run trained with, is one line naming what to install."""
    raw = read_json(path)
    if isinstance(raw, dict) and isinstance(raw.get("env"), dict):
        raw = _without_absent_records(raw, raw["env"], path)
        _absent_stabiliser(raw, raw["env"], path)
    return checked(path, F.RunConfigFile, raw)


def _without_absent_records(raw: dict, env: dict, path: Path) -> dict:
    records, diag = env.get("records"), raw.get("diagnostics")
    if not isinstance(records, dict) or not isinstance(diag, dict):
        return raw
    known = set(F.DiagnosticsConfig.model_fields)
    absent = {switch: module for switch, module in records.items() if switch not in known}
    if not absent or not set(diag) - known:
        return raw
    if on := sorted(s for s in absent if diag.get(s) not in (None, False, 0)):
        raise BadFile(f"{path}: it ran with the record {on[0]} ({absent[on[0]]}), which is not installed here: install "
                      "it to read this run (docs/extending.md)")
    return {**raw, "diagnostics": {k: v for k, v in diag.items() if k in known}}


def _absent_stabiliser(raw: dict, env: dict, path: Path) -> None:
    model = raw.get("model")
    _name_absent(model.get("variant") if isinstance(model, dict) else None, env, path)


def _name_absent(variant: object, env: object, path: Path) -> None:
    """One line where `variant` is unknown here and the run's env names it as the stabiliser it trained with."""
    from flt_diag.config.variants import VARIANTS
    stab = env.get("stabiliser") if isinstance(env, dict) else None
    if isinstance(stab, dict) and isinstance(variant, str) and variant not in VARIANTS \
            and stab.get("name") in variant.split("+"):
        raise BadFile(f"{path}: it trained with the stabiliser {stab.get('name')} (module {stab.get('module')}, file "
                      f"{stab.get('file')}), which is not installed here: install or register it to read this run "
                      "(docs/extending.md)")


# --------------------------------------------------------------------------- summary

def load_summary(path: Path) -> F.Summary:
    """summary.json, checked; its variant, where unknown here, named as the stabiliser of one's own it is (from the
    run's config.json beside it) instead of a list of the variants known."""
    raw = read_json(path)
    from flt_diag.config.variants import VARIANTS
    if isinstance(raw, dict) and isinstance(raw.get("variant"), str) and raw["variant"] not in VARIANTS \
            and (Path(path).parent / "config.json").is_file():  # (read only for an unknown variant: not per load)
        try:
            env = read_json(Path(path).parent / "config.json").get("env")
        except (BadFile, AttributeError):
            env = None
        _name_absent(raw.get("variant"), env, path)
    return checked(path, F.Summary, raw)


# --------------------------------------------------------------------------- sweep and map specs

CELL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,199}")  # a folder under cells/, never a path
MAP_KEYS = {"axis", "grid", "criteria"}  # what only a map's spec holds


def load_spec(path: Path) -> F.SweepSpecFile | F.MapSpecFile:
    """sweep.json of a sweep, or of a map (`kind: map`): the grid, the cells, the shared base config, and its
    campaign where it records one (flt_diag.storage.campaign: a damaged one is one line for every reader, never
    copied into an archive)."""
    raw = read_json(path)
    if isinstance(raw, dict) and raw.get("campaign") is not None:
        from flt_diag.storage.campaign import read_campaign  # (it imports the code's version: not at import time)
        read_campaign(raw, path)
    if isinstance(raw, dict) and ("kind" in raw or MAP_KEYS & set(raw) and "cell_names" not in raw):
        return checked(path, F.map_spec_model(raw.get("axis")), raw)  # (raw JSON)
    spec = checked(path, F.SweepSpecFile, raw)
    n = len(spec.variants) * len(spec.loops) * len(spec.seeds) * len(spec.lr_scale)
    if len(spec.cell_names) != n:
        raise bad(path, f"cell_names has {len(spec.cell_names)} names for a grid of {n} cells")
    wrong = next((c for c in spec.cell_names if not CELL_NAME.fullmatch(c)), None)
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


def part_order(path: Path) -> tuple[int, int, int]:
    """(first step, last step, part number) of a part's name: the order parts are read in (by number, not by name:
    names pad steps to 9 digits, and a step of 10**9 or more is longer)."""
    first, last = part_steps(path)
    return first, last, int(PART_NAME.fullmatch(Path(path).name).group(3))  # type: ignore[union-attr]


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


# --------------------------------------------------------------------------- tables (CSV) a script is named

MAX_TABLE_BYTES = 256 << 20  # the tables flt-diag and analysis/ write are kilobytes to a few megabytes


def read_table(path: Path, limit: int = MAX_TABLE_BYTES, what: str = "a table (CSV)") -> pd.DataFrame:
    """A CSV file as a DataFrame, read through the bounded, regular-file-only reader (read_text: a FIFO, a
    device, a folder, a huge file or text that is not UTF-8 is one BadFile line naming the file); a table
    pandas cannot parse is one line naming it too."""
    text = read_text(path, limit, what)
    try:
        return pd.read_csv(io.StringIO(text))
    except (ValueError, pd.errors.ParserError) as e:  # (EmptyDataError is a ValueError)
        raise BadFile(f"{path}: not {what} ({' '.join(str(e).split())[:100]})") from None


# --------------------------------------------------------------------------- eval_loops.csv

EVAL_LOOPS_NEEDED = ("loops", "val_loss")  # every eval_loops table has these (older ones lack the others)
EVAL_LOOPS_INTEGERS = ("loops", "trained_loops", "batches")
EVAL_LOOPS_NUMBERS = ("val_loss", "perplexity", "accuracy")


def check_eval_loops(df: pd.DataFrame, where) -> pd.DataFrame:
    """An eval_loops table (a run's eval_loops.csv, a record's copy) as its readers take it: the columns `loops`
    and `val_loss`, whole numbers >= 1 in the integer columns, numbers (or empty) in the number columns, the data's
    name as text. A hand-edited or foreign table is one BadFile line naming it, never a figure's TypeError."""
    missing = [c for c in EVAL_LOOPS_NEEDED if c not in df.columns]
    if missing:
        raise BadFile(f"{where}: no {' and '.join(missing)} column; not an eval_loops table")
    df = df.copy()
    for column in (c for c in (*EVAL_LOOPS_INTEGERS, *EVAL_LOOPS_NUMBERS) if c in df.columns):
        values = pd.to_numeric(df[column], errors="coerce")
        if (wrong := values.isna() & df[column].notna()).any():
            raise BadFile(f"{where}: column {column} holds {df[column][wrong].iloc[0]!r}, not a number")
        given = values.dropna()
        if column in EVAL_LOOPS_INTEGERS and ((given % 1 != 0) | (given < 1)).any():
            raise BadFile(f"{where}: column {column} must hold whole numbers >= 1")
        df[column] = values
    if df["loops"].isna().any():
        raise BadFile(f"{where}: a row without its loop count (column loops)")
    if "data" in df.columns:
        df["data"] = df["data"].astype(object).where(df["data"].isna(), df["data"].astype(str))
    return df


# --------------------------------------------------------------------------- predictor and fit examples

INTEGER_COLUMNS = ("verdict_version",)  # the integer columns of a fit-examples table that may have empty cells


def load_examples(path: Path) -> list[F.ExampleRow]:
    """A fit-examples CSV, checked row by row (a run's identity, verdict evidence, step and features)."""
    text = read_text(path)
    try:
        df = pd.read_csv(io.StringIO(text)).astype(object)
        rows = df.where(df.notna(), None).to_dict("records")  # Python values; an empty cell is None
        for r in rows:  # (a column with empty cells, e.g. verdict_version of rows judged before v3, reads 3 as 3.0)
            for key, v in r.items():
                if isinstance(v, float) and v.is_integer() and key in INTEGER_COLUMNS:
                    r[key] = int(v)
    except (ValueError, pd.errors.ParserError) as e:
        raise BadFile(f"unreadable {path}: {str(e)[:100]}") from None
    return checked(path, F.ExamplesTable, rows)


def load_predictor(path=None) -> F.PredictorFile:
    """A predictor JSON (None: the packaged one), checked field by field: a predictor without means,
    with a text coefficient or a threshold outside (0, 1) is one line. An empty name is an error, not
    the packaged predictor."""
    if path is None:
        path = PACKAGED
    if str(path) in ("", "."):
        raise BadFile("the predictor file name is empty (leave --predictor out for the packaged predictor)")
    return checked(path, F.PredictorFile, read_json(path))


def predictor_of(predictor: dict | F.PredictorFile) -> F.PredictorFile:
    """A predictor as its model: a loaded one as it is, a fitted one (fit-predictor's JSON object) checked."""
    return predictor if isinstance(predictor, F.PredictorFile) else checked("the predictor", F.PredictorFile, predictor)


# --------------------------------------------------------------------------- study files

MAX_STUDY_BYTES = 256 << 10  # studies are a kilobyte or two (experiments/); TOML parses ~1 MB/s in Python


def load_study(path: Path, tables: dict[str, Collection[str]], limit: int = MAX_STUDY_BYTES) -> tuple[str, dict]:
    """A study file -> (its table's name, its values by key, "-" read as "_"): exactly one of `tables` (each
    with the keys it takes: flt_diag.cli.specs.load_study checks the values like the command line); other keys
    (description, gpu) are free. At most `limit` bytes are read (MAX_STUDY_BYTES: a study is a kilobyte or two)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10
        import tomli as tomllib
    text = read_text(path, limit, "a study file (TOML)")  # (its own one line: outside the parse's handlers)
    try:
        spec = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise BadFile(f"{path}: not valid TOML ({e})") from None
    except (ValueError, RecursionError) as e:  # nesting 5,000 deep, an integer of 5,000 digits: as read_json says
        raise BadFile(f"{path}: not a study file ({type(e).__name__}: {str(e)[:100]})") from None
    found = [t for t in tables if t in spec]
    if len(found) != 1 or not isinstance(spec[found[0]], dict):
        raise BadFile(f"{path}: needs exactly one {' or '.join(f'[{t}]' for t in tables)} table")
    table = found[0]
    unknown = next((key for key in spec[table] if key.replace("-", "_") not in tables[table]), None)
    if unknown is not None:
        raise BadFile(f"{path}: unknown option {unknown!r} in [{table}]")
    return table, {key.replace("-", "_"): x for key, x in spec[table].items()}


# --------------------------------------------------------------------------- reference meta json

def check_reference_meta(meta, path) -> ReferenceMeta:
    return checked(path, ReferenceMeta, meta)


# --------------------------------------------------------------------------- torch files

class Tensors(F.FileModel, extra="allow"):
    """Weights by name: with `shapes` in the context, exactly those names, each a tensor of that shape."""

    @model_validator(mode="before")
    @classmethod
    def _shapes(cls, x, info):
        shapes = (info.context or {}).get("shapes")
        if not isinstance(x, dict) or shapes is None:
            return x
        for name, shape in shapes.items():
            if name not in x:
                raise ValueError(f"{name} is missing")
            got = getattr(x[name], "shape", None)
            if got is None or not hasattr(x[name], "dtype"):
                raise ValueError(f"{name} must be a tensor, got {type(x[name]).__name__}")
            if tuple(got) != tuple(shape):
                raise ValueError(f"{name} has shape {tuple(got)}; this run's is {tuple(shape)}")
        unknown = next((k for k in x if k not in shapes), None)
        if unknown is not None:
            raise ValueError(f"{unknown} is not a weight of this run's model")
        return x


def _as_given(cls, x, handler):
    """Checked by the field's model, kept as the dicts torch loads (weights, optimizer states)."""
    handler(x)
    return x


class ParamGroup(F.FreeFileModel):
    params: list[Annotated[int, Field(ge=0, le=MAX_ITEMS)]] = Field(min_length=1, max_length=MAX_ITEMS)


class OptimizerState(F.FreeFileModel):
    state: dict[Annotated[int, Field(ge=0)], dict] = Field(max_length=MAX_ITEMS)  # parameter index -> its state
    param_groups: list[ParamGroup] = Field(min_length=1, max_length=MAX_ITEMS)


class ResumeState(F.FileModel):
    """resume.pt of a run (context: `shapes` of its weights, its `steps`, its number of `optimizers`): its
    next step (at most the run's steps), wall time, weights, one state per optimizer, the callbacks' states
    (by name; a list in older files)."""

    step: int = Field(ge=0, json_schema_extra=dict(at_most="steps"))
    wall_time: float = Field(ge=0)
    model: Tensors
    optimizers: list[OptimizerState] = Field(max_length=MAX_ITEMS, json_schema_extra=dict(count="optimizers"))
    callbacks: dict | list[dict]

    _as_torch_loads_them = field_validator("model", "optimizers", mode="wrap")(_as_given)

    @field_validator("step")
    @classmethod
    def _at_most_the_steps(cls, x, info):
        steps = (info.context or {}).get("steps")
        if steps is not None and x > steps:
            raise ValueError(f"must be <= {steps} (the run's steps), got {x}")
        return x

    @field_validator("optimizers")
    @classmethod
    def _one_per_optimizer(cls, x, info):
        n = (info.context or {}).get("optimizers")
        if n is not None and len(x) != n:
            raise ValueError(f"has {len(x)} items; this run has {n} optimizers")
        return x


def check_resume_state(state, path, model_shapes: dict, steps: int, optimizer_shapes: list[list[tuple]]) -> ResumeState:
    """resume.pt checked against the run that resumes it, before any of it is loaded."""
    state = checked(path, ResumeState, state, context=dict(shapes=model_shapes, steps=steps,
                                                           optimizers=len(optimizer_shapes)))
    for i, (saved, shapes) in enumerate(zip(state.optimizers, optimizer_shapes)):
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


class ModelInCheckpoint(F.ModelInFile):
    variant: Variant  # flt-diag's own model: never null (a watch run's is)


class Checkpoint(F.FileModel):
    """checkpoint.pt: the final weights (context `shapes`: exactly those, of those shapes: the model its
    model_config builds), the model config, the steps trained."""

    model_config_: ModelInCheckpoint = Field(alias="model_config")  # (first: it sizes the model)
    model: Tensors
    step: int = Field(None, ge=0)  # type: ignore[assignment]  # (absent: None; a null written is refused)

    _as_torch_loads_them = field_validator("model", mode="wrap")(_as_given)


def check_checkpoint(obj, path, model_shapes: dict | None = None) -> Checkpoint:
    return checked(path, Checkpoint, obj, context=dict(shapes=model_shapes))


FILE_KINDS = ("run config", "sweep spec", "map spec", "summary", "metrics part", "resume state", "checkpoint",
              "predictor", "study", "reference meta")  # DESIGN.md §9 (the generated tests cover each)
