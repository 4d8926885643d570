"""Every kind of file flt-diag reads has one validating loader. The cases are generated from each
loader's pydantic model (flt_diag.storage.file_models, flt_diag.storage.files), walked field by field
here (`describe`): every field of a real file is mutated (wrong type, missing, out of range, nested,
huge) and the reader that uses the file must refuse exactly the mutations the model forbids, with one
line naming the file and the field, writing nothing; a mutation the model allows (an optional field
left out, free-form metadata) is read without a file error."""
import json
import math
import shutil
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pytest
import torch

from annotated_types import Le
from pydantic import AfterValidator, BaseModel

from flt_diag.storage import file_models as F, files
from flt_diag.storage.reference_meta import ReferenceMeta
from flt_diag.storage.folders import StorageError
from flt_diag.config.option_fields import MAX_ITEMS, ascending, distinct, form
from flt_diag.cli import main

REPO = Path(__file__).resolve().parent.parent
TRAIN = ["train", "--steps", "4", "--device", "cpu", "--preset", "tiny", "--variant", "lt", "--loops", "2",
         "--depth", "1", "--checkpoint-every", "2", "--eval-every", "0", "--eval-batches", "1"]
DELETE = object()


# ------------------------------------------------------------------ real files of every kind

def _interrupted_copy(run: Path, out: Path) -> None:
    """`out`: the run of `run`'s config stopped after step 3 (resume.pt at step 2), as a Ctrl-C leaves it."""
    from flt_diag.storage.folders import load_config
    from flt_diag.instruments.callbacks import Callback
    from flt_diag.training.trainer import Trainer

    class Interrupt(Callback):
        def on_step_end(self, trainer, step):
            if step == 2:
                raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        Trainer(load_config(run).run_config(), out, callbacks=[Interrupt()]).fit()


def _every_option(table: str) -> dict:
    """A study table that sets every option it takes (its default, or a valid value where it has none)."""
    from flt_diag.cli.specs import STUDY_TABLES, study_options
    from flt_diag.config.option_fields import default
    out = {}
    for _, name, info in study_options(STUDY_TABLES[table]):
        o, x = form(info), default(info)
        if x is None:
            x = True if o.kind is bool else (o.low or 1) if o.kind in (int, float) else (o.choices or ["x"])[0]
            x = [x] if o.many else x
        out[info.alias or name] = str(x) if o.kind is Path else x
    return out


def _reference_export(run: Path, folder: Path) -> Path:
    from flt_diag.training.reference import export_reference
    from flt_diag.model.transformer import LoopedTransformer, ModelConfig
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    model = LoopedTransformer(ModelConfig(**ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    folder.mkdir()
    torch.save(export_reference(model), folder / "model_000004.pt")
    m = ckpt["model_config"]
    sizes = {"sequence_len": m["seq_len"], "vocab_size": m["vocab_size"], "n_layer": m["depth"],  # (nanochat's names)
             "n_head": m["heads"], "n_kv_head": m["heads"], "n_embd": m["width"]}
    said = {**sizes, **{k: m["loops"] for k in files.META_LOOP_KEYS}, **{k: "LT" for k in files.META_VARIANT_KEYS}}
    (folder / "meta_000004.json").write_text(json.dumps({"step": 4, "model_config": said, **said}))  # every key it reads
    return folder / "model_000004.pt"


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    """One real file of each kind (and the folders around them), made by flt-diag itself."""
    from flt_diag.storage.folders import load_config
    from flt_diag.config.grid_options import geometric_grid
    from flt_diag.grids.stability_map import MapSpec, prepare_map_folder
    from flt_diag.grids.sweep import SweepSpec, prepare_folder
    from flt_diag.training.trainer import Trainer
    root = tmp_path_factory.mktemp("samples")
    run = root / "run"
    assert main([*TRAIN, "--out", str(run)]) == 0
    _interrupted_copy(run, root / "interrupted")
    cfg = load_config(run).run_config()
    prepare_folder(SweepSpec(cfg, ["lt", "flt"], [2, 3], [0], [1.0]), root / "sweep")
    prepare_map_folder(MapSpec(cfg, ["lt"], [2], [0], "lr", geometric_grid(0.5, 4, 2), ["training"]), root / "map")
    shutil.copy(REPO / "flt_diag" / "judge" / "early_warning.json", root / "predictor.json")
    (root / "predicted").mkdir()  # a run of every optional field: an imported, predicted, diverged one's
    config = json.loads((run / "config.json").read_text())
    config |= {"verdict": config["verdict"] | {"osc_cv_threshold": 0.5}, "corpus": config["corpus"] | {"task": "phop"},
               "imported_from": "model_000004.pt", "note": "a note", "probe": {"model": "MyModel"}}
    (root / "predicted" / "config.json").write_text(json.dumps(config))
    for table in ("ablation", "map"):
        _write(root / f"study-{table}.toml", {"description": "every option", table: _every_option(table)})
    summary = json.loads((run / "summary.json").read_text())
    prediction = {"step": 2, "p_collapse": 0.9, "evidence": "loss_climb 0.6 (+1.2)", "features": {}}
    evidence = summary["evidence"] | {"nonfinite_step": 3, "osc_dlog_window": [0, 3], "predicted_at": 2,
                                      "oscillation": "gradients clipped", "warmdown": "none",
                                      "not_recorded": {"attention": "no hook"}}
    windows = [{"start": 0, "end": 3, "differences": 3, "median_abs_dlog": 0.1, "alternation": 0.5}]
    (root / "predicted" / "summary.json").write_text(json.dumps(summary | {"prediction": prediction, "evidence": evidence,
                                                                           "osc_dlog_windows": windows}))
    reference = _reference_export(run, root / "reference")
    trainer = Trainer(cfg, root / "interrupted")  # resume.pt is restored into it
    return dict(root=root, run=run, reference=reference, trainer=trainer)


# ------------------------------------------------------------------ the kinds: schema, file, reader

def _model_shapes() -> dict:
    """The weight shapes of the samples' model (tiny preset, depth 1, lt, K=2)."""
    from flt_diag.config.run_config import build_config
    from flt_diag.model.transformer import LoopedTransformer
    model = build_config("tiny", model=dict(depth=1, variant="lt", loops=2)).model
    return {k: tuple(v.shape) for k, v in LoopedTransformer(model).state_dict().items()}


def _read_config(s, p):
    from flt_diag.storage.folders import load_config
    load_config(p.parent)


def _read_summary(s, p):
    from flt_diag.storage.folders import load_summary
    load_summary(p.parent)


def _read_sweep(s, p):
    from flt_diag.storage.folders import cell_names
    cell_names(p.parent)


def _read_map(s, p):
    from flt_diag.grids.stability_map import boundaries
    boundaries(p.parent)


def _read_resume(s, p):
    from flt_diag.training.checkpoint import restore
    restore(s["trainer"])


def _read_checkpoint(s, p):
    from flt_diag.training.evaluation import eval_loops
    eval_loops(p.parent, [1], batches=1)


def _read_predictor(s, p):
    from flt_diag.storage.files import load_predictor
    load_predictor(p)


def _read_study(s, p):
    from flt_diag.cli.specs import load_study
    load_study(p)


def _read_meta(s, p):
    from flt_diag.training.reference import import_reference
    import_reference(s["reference"])


# ------------------------------------------------------------------ the models, walked into entries

@dataclass(frozen=True)
class Scalar:
    option: object  # an Option (flt_diag.config.option_fields): kind, optional, choices and bounds
    required: bool = True
    nan: bool = False  # NaN and infinities are values too (figures a run computed)


@dataclass(frozen=True)
class Items:
    item: object
    required: bool = True
    min_items: int = 0
    max_items: int = MAX_ITEMS
    distinct: bool = False
    ascending: bool = False
    length_of: str | None = None


@dataclass(frozen=True)
class Record:
    entries: dict = field(default_factory=dict)
    required: bool = True
    other_keys: bool = False
    nullable: bool = False


@dataclass(frozen=True)
class Table:
    key: object  # an Option
    entry: object
    required: bool = True
    min_items: int = 0
    max_items: int = MAX_ITEMS


@dataclass(frozen=True)
class Shape:
    shape: tuple
    required: bool = True


def _lengths(metadata) -> tuple[int, int]:
    got = {type(m).__name__: m for m in metadata}
    return (got["MinLen"].min_length if "MinLen" in got else 0,
            got["MaxLen"].max_length if "MaxLen" in got else MAX_ITEMS)


def _extra(info) -> dict:
    return info.json_schema_extra if info is not None and isinstance(info.json_schema_extra, dict) else {}


def _annotated(hint):
    """(type, its metadata: constraints, validators) of `Annotated[type, Field(...), ...]` or a plain type."""
    if typing.get_origin(hint) is typing.Annotated:
        args = typing.get_args(hint)
        return args[0], [m for a in args[1:] for m in (a.metadata if hasattr(a, "metadata") and
                                                       not isinstance(a, AfterValidator) else [a])]
    return hint, []


def _checks(metadata, check) -> bool:
    return any(isinstance(m, AfterValidator) and m.func is check for m in metadata)


def _option(hint, metadata: list, nullable: bool = False):
    """A field of type `hint` with constraints `metadata`, as the command line's view reads it."""
    typed = typing.Annotated[(hint, *metadata)] if metadata else hint
    return form(typing.Optional[typed] if nullable else typed)


def describe(hint, info=None, required: bool = True, context: dict | None = None):
    """The entry of a field of type `hint` (pydantic field `info`), read from the model alone."""
    context = context or {}
    bare, metadata, nullable = hint, list(info.metadata) if info is not None else [], False
    while typing.get_origin(bare) is typing.Annotated or type(None) in typing.get_args(bare):  # Optional, Annotated
        if typing.get_origin(bare) is typing.Annotated:
            bare, more = _annotated(bare)
            metadata += more
        else:
            nullable, bare = True, next(a for a in typing.get_args(bare) if a is not type(None))
    origin, extra = typing.get_origin(bare), _extra(info)
    if isinstance(bare, type) and issubclass(bare, BaseModel):
        if bare is files.Tensors:
            shapes = context.get("shapes")
            return Record({k: Shape(tuple(v)) for k, v in shapes.items()}, required) if shapes else \
                Record(required=required, other_keys=True)
        # a file holds a field under its alias, but an option's alias is its command-line name (list for
        # list_cells): files hold the option's field name
        entries = {(name if f.description else f.alias or name): describe(f.annotation, f, f.is_required(), context)
                   for name, f in bare.model_fields.items()}
        return Record(entries, required, bare.model_config.get("extra") == "allow", nullable)
    if bare is dict or origin in (typing.Union, types.UnionType):  # free-form (dict | list: the samples hold a dict)
        return Record(required=required, other_keys=True, nullable=nullable)
    if origin is dict:
        key, value = typing.get_args(bare)
        key, key_metadata = _annotated(key)
        least, most = _lengths(metadata)
        return Table(_option(key, key_metadata), describe(value, None, True, context), required, least, most)
    if origin is list:
        least, most = _lengths(metadata)
        if extra.get("count"):
            least = most = context[extra["count"]]
        item_hint, item_metadata = _annotated(typing.get_args(bare)[0])
        item = describe(item_hint, None, True, context) if isinstance(item_hint, type) and \
            (issubclass(item_hint, BaseModel) or item_hint is dict) else \
            Scalar(_option(item_hint, item_metadata))
        return Items(item, required, least, most, _checks(metadata, distinct), _checks(metadata, ascending),
                     extra.get("length_of"))
    o = _option(bare, [*metadata, *([Le(context[extra["at_most"]])] if extra.get("at_most") else [])], nullable)
    nan = any(getattr(m, "allow_inf_nan", False) for m in metadata)
    return Scalar(o, required, nan)


def walk(entry, where: tuple = ()) -> list[tuple[tuple, object]]:
    """Every entry below `entry` with its path: keys of records, 0 for a list's first item, None for
    a table's first key (a sample file decides which)."""
    out = []
    if isinstance(entry, Record):
        for name, sub in entry.entries.items():
            out += [((*where, name), sub), *walk(sub, (*where, name))]
    elif isinstance(entry, Items):
        out += [((*where, 0), entry.item), *walk(entry.item, (*where, 0))]
    elif isinstance(entry, Table):
        out += [((*where, None), entry.entry), *walk(entry.entry, (*where, None))]
    return out


def _model(model, **context):
    return describe(model, context=context)


def _study_entry(table: str):
    """A study table: every option of its command by the name users type, each optional (a path is text)."""
    from flt_diag.cli.specs import STUDY_TABLES, study_options
    entries = {}
    for _, name, info in study_options(STUDY_TABLES[table]):
        o = form(info)
        entries[info.alias or name] = describe(typing.Optional[list[str] if o.many else str], None, False) \
            if o.kind is Path else describe(info.annotation, info, False)
    return Record({table: Record(entries)}, other_keys=True)


def _resume_entry():
    return _model(files.ResumeState, shapes=_model_shapes(), steps=4, optimizers=2)


# kind -> (its entry, the sample file, the reader that uses it)
KINDS = {
    "run config": (lambda: _model(F.RunConfigFile), "predicted/config.json", _read_config),
    "summary": (lambda: _model(F.Summary), "predicted/summary.json", _read_summary),
    "sweep spec": (lambda: _model(F.SweepSpecFile), "sweep/sweep.json", _read_sweep),
    "map spec": (lambda: _model(F.map_spec_model("lr")), "map/sweep.json", _read_map),
    "resume state": (_resume_entry, "interrupted/resume.pt", _read_resume),
    "checkpoint": (lambda: _model(files.Checkpoint, shapes=_model_shapes()), "run/checkpoint.pt", _read_checkpoint),
    "predictor": (lambda: _model(F.PredictorFile), "predictor.json", _read_predictor),
    "study": (lambda: _study_entry("ablation"), "study-ablation.toml", _read_study),
    "study (map)": (lambda: _study_entry("map"), "study-map.toml", _read_study),
    "reference meta": (lambda: _model(ReferenceMeta), "reference/meta_000004.json", _read_meta),
}


def _read(path: Path):
    if path.suffix == ".pt":
        return torch.load(path, weights_only=True)
    if path.suffix == ".toml":
        import tomllib
        return tomllib.loads(path.read_text())
    return json.loads(path.read_text())


def _toml(x) -> str:
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if x != x else ("inf" if x > 0 else "-inf")
    if isinstance(x, (int, float)):
        return repr(x)
    if isinstance(x, str):
        return json.dumps(x)
    if isinstance(x, list):
        return "[" + ", ".join(map(_toml, x)) + "]"
    return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml(v)}" for k, v in x.items()) + "}"


def _expressible_in_toml(obj, root: bool = True) -> bool:
    """TOML has no null, and a TOML file is always a table."""
    if obj is None or root and not isinstance(obj, dict):
        return False
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else []
    return all(_expressible_in_toml(x, False) for x in items)


def _write(path: Path, obj) -> None:
    if path.suffix == ".pt":
        torch.save(obj, path)
    elif path.suffix == ".toml":
        tables = {k: v for k, v in obj.items() if isinstance(v, dict)}
        lines = [f"{json.dumps(k)} = {_toml(v)}" for k, v in obj.items() if k not in tables]
        for name, table in tables.items():
            lines += [f"[{name}]"] + [f"{json.dumps(k)} = {_toml(v)}" for k, v in table.items()]
        path.write_text("\n".join(lines) + "\n")
    else:
        path.write_text(json.dumps(obj, allow_nan=True))


# ------------------------------------------------------------------ mutations, from the entry

def _scalar_mutations(entry: Scalar, original) -> list[tuple[str, object, bool]]:
    o = entry.option
    out = [("wrong type", 12345 if o.kind is str else "text", True), ("nested", {"x": [original]}, True),
           ("in a list", [original], True), ("null", None, not o.optional)]
    if o.kind is int:
        out.append(("a fraction", 2.5, True))
    if o.choices:
        out.append(("not a choice", "no-such-choice", True))
    for bound, shift, label in ((o.low, -1, "below its low"), (o.high, 1, "above its high")):
        if bound is not None:
            step = 1 if o.kind is int else max(0.5, abs(bound) * 1e-6)  # (2**53 + 0.5 rounds back to 2**53)
            out.append((label, bound + shift * step, True))
    for bound, label in ((o.above, "at its exclusive low"), (o.below, "at its exclusive high")):
        if bound is not None:
            out.append((label, bound, True))
    if o.kind in (int, float):
        huge = 10 ** 13  # beyond every size bound; a seed's bound (2**63 - 1) lies above it
        refused = (o.high is not None and huge > o.high) or (o.below is not None and huge >= o.below) or bool(o.choices)
        out.append(("huge", huge, refused))
        if o.kind is float:
            out.append(("infinite", math.inf, not entry.nan))
    if o.kind is str:
        out.append(("huge", "x" * 5000, True))
    return out


def _mutations(entry, original, in_record: bool) -> list[tuple[str, object, bool]]:
    """(label, mutated value, whether the schema forbids it) for one field of a sample file."""
    out = [("missing", DELETE, entry.required)] if in_record else []
    if isinstance(entry, Scalar):
        return out + _scalar_mutations(entry, original)
    if isinstance(entry, Shape):
        return out + [("wrong type", "text", True), ("wrong shape", torch.zeros(3), True),
                      ("nested", {"x": [original]}, True)]
    if isinstance(entry, Items):
        first = original[0] if original else None
        out += [("wrong type", {"x": 1}, True), ("huge", [first] * (entry.max_items + 1), True)]
        out += [("nested", [[first]], True)] if original else []
        out += [("empty", [], entry.min_items > 0)]
        if original and (entry.distinct or entry.length_of):
            out.append(("one item more (a duplicate)", list(original) + [first], True))
        return out
    if isinstance(entry, Table):
        key = next(iter(original))
        out += [("wrong type", ["text"], True), ("empty", {}, entry.min_items > 0),
                ("a key that is not a number", {"abc": original[key]}, entry.key.kind is not str)]
        if entry.key.low is not None and entry.key.low > 0:
            out.append(("a key below its low", {type(key)(entry.key.low - 1): original[key]}, True))
        return out
    # Record
    out += [("wrong type", ["a", "list"], True), ("null", None, not entry.nullable)]
    if original is not None:
        out.append(("an unknown key", {**original, "no_such_field": {"x": [1]}}, not entry.other_keys))
    return out


def _at(obj, path: tuple):
    for key in path:
        if isinstance(obj, dict) and key is None:
            key = next(iter(obj))
        if isinstance(obj, dict) and key in obj or isinstance(obj, list) and isinstance(key, int) and key < len(obj):
            obj = obj[key]
        else:
            raise LookupError(key)
    return obj


def _resolved(obj, path: tuple) -> tuple:
    """The path with each table's first key filled in."""
    out = []
    for key in path:
        if key is None:
            key = next(iter(_at(obj, tuple(out))))
        out.append(key)
    return tuple(out)


def _mutated(obj, path: tuple, new):
    import copy
    if not path:
        return new
    obj = copy.deepcopy(obj)
    parent = _at(obj, path[:-1])
    if new is DELETE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = new
    return obj


SCHEMAS = {kind: schema() for kind, (schema, _, _) in KINDS.items()}
FIELDS = {kind: dict(walk(schema)) for kind, schema in SCHEMAS.items()}
CASES = [(kind, path) for kind in KINDS for path in [(), *FIELDS[kind]]]


def _snapshot(folder: Path) -> dict:
    """Every file under `folder` with its size and modification time (a write changes one or the other)."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("kind, path", CASES, ids=[f"{k}:{'.'.join(map(str, p)) or '<file>'}" for k, p in CASES])
def test_every_field_of_every_file_kind_is_checked_by_its_loader(samples, kind, path):
    _, name, reader = KINDS[kind]
    file = samples["root"] / name
    original_bytes = file.read_bytes()
    sample = _read(file)
    entry = FIELDS[kind].get(path, SCHEMAS[kind])
    parent = (FIELDS[kind].get(path[:-1]) if len(path) > 1 else SCHEMAS[kind]) if path else None
    if isinstance(parent, Items) and parent.ascending:
        path = (*path[:-1], -1)  # an ascending list: change its last item (a larger one keeps the order)
    try:
        path = _resolved(sample, path)
        original = _at(sample, path)
    except LookupError:
        if not (kind.endswith("spec") and path[:1] == ("base",)):
            pytest.skip("the sample file has no such field (an optional one it leaves out)")
        # a run-config field a sweep or map spec's base leaves out (it does not change the trajectory):
        # the spec is given it with the value a real run's config.json holds, then changed as any other
        try:
            original = _at(_read(samples["run"] / "config.json"), path[1:])
        except LookupError:  # (an optional list a run's config leaves empty too: stop_when_decided)
            pytest.skip("neither the spec nor a run's config.json has this item")
        sample = _mutated(sample, path, original)
    in_record = isinstance(parent, Record)  # a named field, which can be missing
    named = next((str(k) for k in reversed(path) if isinstance(k, str)), None)
    if path and path[0] in ("ablation", "map") and kind.startswith("study"):
        named = str(path[1]) if len(path) > 1 else named
    try:
        _write(file, sample)
        reader(samples, file)  # the sample as it stands (with any field given above) is accepted
        for label, new, refused in _mutations(entry, original, in_record):
            mutated = _mutated(sample, path, new)
            if file.suffix == ".toml" and not _expressible_in_toml(mutated):
                continue
            _write(file, mutated)
            before = _snapshot(samples["root"])
            if refused:
                with pytest.raises(StorageError) as e:
                    reader(samples, file)
                message = str(e.value)
                assert "\n" not in message and str(file) in message, (label, message)
                assert named is None or named in message, (label, message)
                assert _snapshot(samples["root"]) == before, f"{label}: something was written"
            else:
                try:
                    reader(samples, file)
                except StorageError as e:
                    pytest.fail(f"{label}: the schema allows it, but the reader refused the file: {e}")
                except ValueError as e:  # e.g. a reference import that needs the field: still one line
                    assert "\n" not in str(e), (label, str(e))
    finally:
        file.write_bytes(original_bytes)


def test_the_generated_cases_cover_every_file_kind():
    covered = {k.split(" (")[0] for k in KINDS} | {"metrics part"}  # metrics parts: the column test below
    assert covered == set(files.FILE_KINDS)
    assert len(CASES) > 300


# Every top-level key a config.json has held, written out here from its writers: the config sections
# and preset (RunConfig.to_dict), n_params, env and corpus (Trainer.start), imported_from and note
# (training.reference.write_imported_run).
CONFIG_KEYS = {"model", "train", "diagnostics", "verdict", "preset", "n_params", "env", "corpus", "imported_from", "note",
               "probe"}


def test_a_run_config_holds_what_its_writers_write_and_nothing_else(samples, tmp_path):
    """A trainer's config.json and an imported run's are read; a key no writer writes (e.g. "data"
    where the Trainer writes "corpus", which would judge the run without the corpus's entropy) is
    one line naming the file and the key."""
    from flt_diag.storage.folders import load_config
    run = tmp_path / "run"
    shutil.copytree(samples["run"], run)
    written = json.loads((run / "config.json").read_text())
    assert set(written) == CONFIG_KEYS - {"imported_from", "note", "probe"}
    assert load_config(run).as_written() == written
    for extra in ({"imported_from": "meta_000004.json", "note": "set the tokenizer"}, {}):
        _write(run / "config.json", {**written, **extra})
        assert set(load_config(run).as_written()) == set(written) | set(extra)
    written["data"] = written.pop("corpus")
    _write(run / "config.json", written)
    with pytest.raises(StorageError) as e:
        load_config(run)
    assert str(run / "config.json") in str(e.value) and "data" in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------ metrics parts: columns and dtypes

def _part_mutations(df: pd.DataFrame) -> list[tuple[str, pd.DataFrame, str]]:
    out = []
    for column, kind in files.METRICS_COLUMNS.items():
        out.append((f"{column} missing", df.drop(columns=[column]), column))
        wrong = df[column].astype(str) if kind != "string" else df[column].map(len)
        out.append((f"{column} of the wrong type", df.assign(**{column: wrong}), column))
        out.append((f"{column} nested", df.assign(**{column: [[x] for x in df[column]]}), column))
    out.append(("an extra column", df.assign(extra=1.0), "extra"))
    return out


def test_every_column_of_a_metrics_part_is_checked(samples):
    from flt_diag.storage.folders import load_metrics
    run = samples["run"]
    part = sorted((run / "metrics").glob("part-*.parquet"))[0]
    original = part.read_bytes()
    df = pd.read_parquet(part)
    cases = _part_mutations(df) + [("not Parquet", None, "Parquet"), ("half a file", original[: len(original) // 2],
                                                                       "Parquet")]
    try:
        for label, mutated, named in cases:
            if isinstance(mutated, pd.DataFrame):
                mutated.to_parquet(part, index=False)
            else:
                part.write_bytes(mutated if mutated is not None else b"step,metric\n1,loss\n")
            before = _snapshot(run)
            with pytest.raises(StorageError) as e:
                load_metrics(run)
            assert str(part) in str(e.value) and named in str(e.value) and "\n" not in str(e.value), (label, e.value)
            assert _snapshot(run) == before
    finally:
        part.write_bytes(original)
    load_metrics(run)


def test_a_metrics_part_with_a_name_that_is_not_a_part_name_is_one_line(samples, tmp_path):
    from flt_diag.storage.folders import MetricsWriter
    run = tmp_path / "run"
    shutil.copytree(samples["run"], run)
    part = sorted((run / "metrics").glob("part-*.parquet"))[-1]
    part.rename(part.with_name("part-abc.parquet"))
    with pytest.raises(StorageError, match="part-abc.parquet: not a metrics part name"):
        MetricsWriter(run).truncate_after(0)


# ------------------------------------------------------------------ the same contract through the CLI

def _cli(samples, kind: str, file: Path) -> list[str]:
    run, root = samples["run"], samples["root"]
    return {"run config": ["summary", str(file.parent), "--recompute"], "summary": ["summary", str(file.parent)],
            "sweep spec": ["summary", str(root / "sweep")], "map spec": ["summary", str(root / "map")],
            "resume state": [*TRAIN, "--out", str(root / "interrupted")],
            "predictor": ["predict", str(run), "--at", "2", "--predictor", str(file)],
            "study": ["study", str(file), "--list"], "study (map)": ["study", str(file), "--list"],
            "reference meta": ["import-reference", str(samples["reference"]), "--out", str(root / "imported")],
            "checkpoint": ["eval-loops", str(run), "--loops", "1", "--batches", "1"]}[kind]


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_bad_file_of_every_kind_is_one_error_line_from_its_command(samples, capsys, kind):
    """One refused mutation per kind (the first field's wrong type) through the command that reads it."""
    file = samples["root"] / KINDS[kind][1]
    original = file.read_bytes()
    sample = _read(file)
    path, entry = next((p, e) for p, e in FIELDS[kind].items() if isinstance(e, Scalar) and e.option.kind is not str
                       and (lambda p: _at(sample, _resolved(sample, p)) is not None)(p))
    try:
        _write(file, _mutated(sample, _resolved(sample, path), "text"))
        before = _snapshot(samples["root"])
        code = main(_cli(samples, kind, file))
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert code == (1 if kind == "checkpoint" else 2), err  # eval-loops goes on to the next run: exit 1
        assert len(err) == 1 and "error: " in err[0] and str(file) in err[0] and str(path[-1]) in err[0], err
        assert _snapshot(samples["root"]) == before
    finally:
        file.write_bytes(original)
