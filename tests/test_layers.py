"""The package's layers, read from its source: imports only go down, never round, and the analysis
folder never imports torch.

The layers, bottom to top (a module may import its own layer and any layer below, never one above):

    0 config    flt_diag.config (the typed config: every option once), flt_diag.grid_config (the options
                of sweeps and maps) and flt_diag.model.variants (the torch-free rule table of the five
                variants); below everything that reads them
    1 analysis  flt_diag.analysis.* - torch-free study of saved run folders: storage, metrics and the
                verdict, results tables, figures, report, early-warning features and fit
    2 data      flt_diag.data.* - corpora, tokenizers, token cache, synthetic tasks, batches
    3 settle    flt_diag.settle - options -> one settled, validated RunConfig (torch-free; reads the
                data and the predictor file to check them); the Trainer, grids and CLI take it as given
    4 model     flt_diag.model.* (but variants) - the looped transformer and the reference checkpoints'
                state-dict conversion
    5 training  flt_diag.training.* - Trainer, callbacks, optimizer, checkpoints, diagnostics hooks,
                evaluation, the online early warning
    6 grids     flt_diag.grids.* - cells, sweeps, stability maps: many runs of the Trainer
    7 cli       flt_diag.cli.*, flt_diag.__main__ - the `flt-diag` command line on top

The import graph is built from the AST: every `import` / `from ... import` of a flt_diag module, at
module level, inside functions and under `if TYPE_CHECKING` alike (a type-only import is a dependency
too). Package `__init__` files are empty or belong to their folder's layer.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "flt_diag"
LAYERS = {  # module-name prefix -> layer (the longest matching prefix decides)
    "flt_diag": 0, "flt_diag.config": 0, "flt_diag.grid_config": 0, "flt_diag.model.variants": 0,
    "flt_diag.analysis": 1,
    "flt_diag.data": 2,
    "flt_diag.settle": 3,
    "flt_diag.model": 4,
    "flt_diag.training": 5,
    "flt_diag.grids": 6,
    "flt_diag.cli": 7, "flt_diag.__main__": 7,
}
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = modules()


def resolve(name: str) -> str:
    """The flt_diag module an imported name lives in (`flt_diag.analysis.storage.load_config` ->
    `flt_diag.analysis.storage`; `from flt_diag.analysis import storage` -> the submodule)."""
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


def layer(module: str) -> int:
    return LAYERS[max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)]


def test_the_layer_table_knows_every_module():
    assert all(layer(m) in range(8) for m in MODULES)
    assert layer("flt_diag.model.variants") == 0 and layer("flt_diag.model.transformer") == 4
    assert layer("flt_diag.analysis.figures.map") == 1 and layer("flt_diag.cli.app") == 7


def test_no_module_imports_a_layer_above_its_own():
    climbs = [f"{m}:{line} ({layer(m)}) imports {t} ({layer(t)})"
              for m, edges in GRAPH.items() for t, line in sorted(edges)
              if layer(t) > layer(m)]
    assert not climbs, "\n".join(climbs)


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
    monkeypatch.setitem(GRAPH, "flt_diag.config", GRAPH["flt_diag.config"] | {("flt_diag.cli.app", 1)})
    cycle = find_cycle()
    assert cycle and cycle[0] == cycle[-1] and "flt_diag.config" in cycle


def test_no_import_cycle_between_modules_type_only_imports_included():
    assert find_cycle() is None, " -> ".join(find_cycle())


def test_every_analysis_module_imports_without_torch():
    names = sorted(m for m in MODULES if layer(m) == 1 and m.startswith("flt_diag.analysis"))
    assert len(names) > 10
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
