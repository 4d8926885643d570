"""The package's layers, read from its source: imports only go down, never round, and the layers below
training never import torch. Each layer is one folder of flt_diag/ (bottom to top; a module may import its
own layer and any layer below, never one above):

    0 config    flt_diag/config/ - the configuration: every option typed once (run_config.py, option_fields.py),
                the variants as data (variants.py), the options of sweeps and maps (grid_options.py)
    0 records   flt_diag/records/ - a diagnostic record in one file each: its options, metric names, schedule,
                moment, state and computation (torch-free: it computes through the tensors it is handed); config/
                and storage/ assemble DiagnosticsConfig and the metric names from them (records/ imports nothing of
                config/: no two folders import each other)
    0 stabilisers flt_diag/model/stabilisers/ - a stabiliser in one file each: its declaration torch-free (torch
                only inside its hooks and factory); config/variants.py assembles the variant tables from them
    1 storage   flt_diag/storage/ - I/O: run, sweep and map folders (folders.py), the file kinds and their
                validating loaders (files.py, schema.py), metric names, cell names, what may be pooled
    2 judge     flt_diag/judge/ - judgments on stored records, torch-free: the verdict, peer comparison,
                the early warning's features and probability, the other detectors, map boundaries
    3 model     flt_diag/model/ - the looped transformer, reference checkpoints <-> state dicts
    4 data      flt_diag/data/ - corpora, tokenizers, token cache, synthetic tasks, batches
    5 instruments flt_diag/instruments/ - model-agnostic, what every run records: the looped model's protocol
                (looped; flt-diag's model implements it, no instrument imports model/), the hooks (loop_hooks) and
                their callback (diagnostics), the loop dynamics, the callback moments, the step record, the online
                early warning
    6 integrations flt_diag/integrations/ - the public `watch` in one folder: the probe (a run's instruments,
                which flt-diag's Trainer runs too), on a researcher's own looped model (watch, LoopProbe, its
                moments, checks and run folder), and as Hugging Face Trainer and Lightning callbacks
    7 training  flt_diag/training/ - flt-diag's own Trainer: settle (options -> one run config), the Trainer,
                optimizer, checkpoints, evaluation, metrics table, progress, external mirrors, the process,
                compilation, reference checkpoints
    8 grids     flt_diag/grids/ - many runs of the Trainer: sweeps, the worker pool, stability maps
    9 results   flt_diag/results/ - torch-free study of saved folders: tables, figures, report, the
                predictor's fit and evaluation
   10 cli       flt_diag/cli/, flt_diag/__main__ - the `flt-diag` command line on top
   10 api       flt_diag/__init__ (the package itself): the public names, imported lazily

The import graph is built from the AST: every `import` / `from ... import` of a flt_diag module, at
module level, inside functions and under `if TYPE_CHECKING` alike (a type-only import is a dependency
too). There is no catch-all: a module outside every folder above fails the first test.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "flt_diag"
LAYERS = {  # folder (module-name prefix) -> layer; "flt_diag" itself matches only the package's __init__
    "flt_diag.config": 0, "flt_diag.records": 0, "flt_diag.model.stabilisers": 0, "flt_diag.storage": 1, "flt_diag.judge": 2, "flt_diag.model": 3, "flt_diag.data": 4,
    "flt_diag.instruments": 5, "flt_diag.integrations": 6, "flt_diag.training": 7, "flt_diag.grids": 8,
    "flt_diag.results": 9, "flt_diag.cli": 10, "flt_diag.__main__": 10,
}
ROOT, ROOT_LAYER = "flt_diag", 10
APART = {"flt_diag.instruments": "flt_diag.model",  # layers that import nothing of each other, though one is below:
         "flt_diag.integrations": "flt_diag.model"}  # the instruments and the probe read a model through its protocol
TORCH_FREE = ("flt_diag.config", "flt_diag.records", "flt_diag.model.stabilisers", "flt_diag.storage", "flt_diag.judge", "flt_diag.results")
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = modules()


def resolve(name: str) -> str:
    """The flt_diag module an imported name lives in (`flt_diag.storage.folders.load_config` ->
    `flt_diag.storage.folders`; `from flt_diag.storage import folders` -> the submodule)."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def imports(module: str) -> set[tuple[str, int]]:
    """(imported flt_diag module, line) for every import anywhere in the module's source."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {(resolve(n), node.lineno) for n in names if n.split(".")[0] == "flt_diag"}
    return {(m, line) for m, line in found if m != module}


GRAPH = {m: imports(m) for m in MODULES}


def layer(module: str) -> int | None:
    """The layer of a module: its folder's (the package's own __init__ is the API layer); None if none."""
    if module == ROOT:
        return ROOT_LAYER
    owners = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    return LAYERS[max(owners, key=len)] if owners else None


def test_the_layer_table_knows_every_module():
    unknown = [m for m in MODULES if layer(m) is None]
    assert not unknown, f"modules in no layer (add their folder to LAYERS): {unknown}"


def test_a_module_outside_every_layer_folder_is_in_no_layer():
    assert layer("flt_diag.somewhere_new") is None and layer("flt_diag.settle") is None
    assert layer("flt_diag.config.variants") == 0 and layer("flt_diag.model.transformer") == 3
    assert layer("flt_diag.results.figures.map") == 9 and layer("flt_diag.cli.app") == 10 and layer("flt_diag") == 10
    assert layer("flt_diag.integrations.hf") == 6 and layer("flt_diag.training.trainer") == 7


def test_no_module_imports_a_layer_above_its_own():
    climbs = [f"{m}:{line} ({layer(m)}) imports {t} ({layer(t)})"
              for m, edges in GRAPH.items() for t, line in sorted(edges)
              if layer(t) > layer(m)]
    assert not climbs, "\n".join(climbs)


def leans() -> list[str]:
    """Imports between layers that stand apart (APART), e.g. an instrument importing the model."""
    def under(m: str, prefix: str) -> bool:
        return (m == prefix or m.startswith(prefix + ".")) and layer(m) == LAYERS[prefix]
    return [f"{m}:{line} imports {t}" for m, edges in GRAPH.items() for t, line in sorted(edges)
            for a, b in APART.items() if under(m, a) and under(t, b)]


def test_the_instruments_and_the_probe_import_nothing_of_the_model():
    assert not leans(), "\n".join(leans())


def test_an_import_of_the_model_from_the_probe_is_found(monkeypatch):
    monkeypatch.setitem(GRAPH, "flt_diag.integrations.folder",
                        GRAPH["flt_diag.integrations.folder"] | {("flt_diag.model.transformer", 9)})
    assert leans() == ["flt_diag.integrations.folder:9 imports flt_diag.model.transformer"]


def find_cycle() -> list[str] | None:
    """A cycle of the import graph as a list of modules (first == last), or None (depth-first search)."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted({t for t, _ in GRAPH[m]}):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (cycle := visit(t)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in MODULES:
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle_it_is_given(monkeypatch):
    monkeypatch.setitem(GRAPH, "flt_diag.config.run_config", GRAPH["flt_diag.config.run_config"] | {("flt_diag.cli.app", 1)})
    cycle = find_cycle()
    assert cycle and cycle[0] == cycle[-1] and "flt_diag.config.run_config" in cycle


def test_no_import_cycle_between_modules_type_only_imports_included():
    assert find_cycle() is None, " -> ".join(find_cycle())


def folder_back_arrows() -> list[str]:
    """Two folders of the package that import each other (each may be of one layer: records/ and config/ are)."""
    def folder(m: str) -> str:  # its layer's folder (model/stabilisers/ is one of its own, below model/)
        owners = [p for p in LAYERS if m == p or m.startswith(p + ".")]
        return max(owners, key=len) if owners else m
    edges = {(folder(m), folder(t)): f"{m}:{line} imports {t}" for m, es in GRAPH.items() for t, line in sorted(es)
             if folder(m) != folder(t)}
    return sorted(f"{why} and back" for (a, b), why in edges.items() if (b, a) in edges)


def test_no_two_folders_import_each_other():
    assert not folder_back_arrows(), "\n".join(folder_back_arrows())


def test_a_folder_back_arrow_is_found(monkeypatch):
    monkeypatch.setitem(GRAPH, "flt_diag.records.attention",
                        GRAPH["flt_diag.records.attention"] | {("flt_diag.config.option_fields", 12)})
    assert folder_back_arrows() == ["flt_diag.config.run_config:15 imports flt_diag.records and back",
                                    "flt_diag.records.attention:12 imports flt_diag.config.option_fields and back"]


def test_every_torch_free_module_imports_without_torch():
    names = sorted(m for m in MODULES if m.startswith(TORCH_FREE))
    assert len(names) > 25
    code = (f"import importlib, sys\nfor name in {names!r}:\n    importlib.import_module(name)\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.split('.')[0] == 'torch')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_no_file_in_the_package_is_over_400_lines():
    long = {str(p.relative_to(REPO)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, long


def function_lengths(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


@pytest.mark.parametrize("lines, too_long", [(60, False), (61, True)])
def test_function_length_counts_the_def_line_to_the_last_line(tmp_path, lines, too_long):
    source = tmp_path / "f.py"
    source.write_text("def f():\n" + "    x = 1\n" * (lines - 2) + "    return x\n")
    assert [(name, n > MAX_FUNCTION_LINES) for name, _, n in function_lengths(source)] == [("f", too_long)]


def test_no_function_in_the_package_is_over_60_lines():
    long = [f"{p.relative_to(REPO)}:{line} {name} ({n} lines)"
            for p in MODULES.values() for name, line, n in function_lengths(p) if n > MAX_FUNCTION_LINES]
    assert not long, "\n".join(long)
