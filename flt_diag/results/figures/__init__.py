"""Figures of a run or a sweep, drawn from its folder alone (numpy/pandas/matplotlib; never torch).

Every figure is one module of this package ending with `register(Figure(...))` (docs/guide.md): `data(study)`
is the exact table it draws, a pure function of the folder, and `draw(df)` draws that table and nothing else
(`Figure.figure` draws it inside style.style(): a draw function sets no style of its own).
Figures work on a sweep still in progress (unfinished runs are "running" in the collapse grid).
"""
from __future__ import annotations

import importlib
import logging
import pkgutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import pandas as pd

from flt_diag.results.figure_names import FIGURE_NAMES
from flt_diag.results.tables import Study, collect
from flt_diag.storage.folders import StorageError, atomic_path, make_folder
from flt_diag.results.figures.style import DPI, NoData, style

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Figure:
    """One registered figure. `needs`: the metric names `data` reads (None: every metric; empty: none,
    it reads summaries only); `applies`: whether "all" includes it for a study (asked for by name on a
    study it does not apply to, it raises StorageError `empty`). A figure of the package takes its help
    and its place in FIGURES from flt_diag.results.figure_names (`register` fills them in); any other
    gives its `help`, and its `order` (the package's figures stand at 10, 20, ...; default: after them)."""
    name: str
    needs: tuple[str, ...] | None
    data: Callable[[Study], pd.DataFrame]
    draw: Callable[[pd.DataFrame], object]
    empty: str = "no data"  # why there is nothing to draw, when `data` returns an empty table
    applies: Callable[[Study], bool] = lambda study: True
    empty_watched: str | None = None  # the same for runs of flt_diag.watch, where `empty` names flags they lack
    help: str = ""
    order: int = 10 * (len(FIGURE_NAMES) + 1)

    def why_empty(self, study: Study) -> str:
        watched = bool(study.runs) and all(r.config.probe is not None for r in study.runs)
        return self.empty_watched if watched and self.empty_watched else self.empty

    def table(self, study: Study) -> pd.DataFrame:
        if not self.applies(study):
            raise NoData(f"{self.name}: {self.why_empty(study)}")
        df = self.data(study)
        if df.empty:
            raise NoData(f"{self.name}: nothing to draw ({self.why_empty(study)})")
        return df

    def figure(self, study: Study):
        """The figure of `study`, drawn in the look every figure shares (style.style)."""
        with style():
            return self.draw(self.table(study))


FIGURES: dict[str, Figure] = {}  # name -> Figure, in display order


def register(figure: Figure) -> Figure:
    """Add (or replace) a figure; FIGURES stays in display order (by `order`, then name). A figure that
    flt_diag.results.figure_names lists gets its help and order from there, and must be drawn by the
    module it names, without a help of its own."""
    if listed := FIGURE_NAMES.get(figure.name):
        if (figure.draw.__module__, figure.help) != (f"{__name__}.{listed[0]}", ""):
            raise ValueError(f"figure {figure.name!r}: flt_diag.results.figure_names lists it as {listed}")
        figure = replace(figure, help=listed[1], order=10 * (list(FIGURE_NAMES).index(figure.name) + 1))
    elif not figure.help:
        raise ValueError(f"figure {figure.name!r} needs a help")
    entries = {**FIGURES, figure.name: figure}
    FIGURES.clear()
    FIGURES.update(sorted(entries.items(), key=lambda item: (item[1].order, item[0])))
    return figure


def unregister(name: str) -> None:
    FIGURES.pop(name, None)


def get(name: str) -> Figure:
    if name not in FIGURES:
        raise ValueError(f"unknown figure {name!r}; choose from {', '.join(FIGURES)}, all")
    return FIGURES[name]


def study_of(src, names) -> Study:
    """The study figures `names` draw: `src` itself, or its folder(s) read with the metrics they need (all of
    them when one needs every metric)."""
    if isinstance(src, Study):
        return src
    needs = [FIGURES[n].needs for n in names]
    return collect(src, None if None in needs else  # (mypy keeps None in `needs` past this test)
                   sorted({m for n in needs for m in n}))  # type: ignore[union-attr]


def figure_data(name: str, src) -> pd.DataFrame:
    """The exact table figure `name` draws (a pure function of the folder); empty when it has no data."""
    figure = get(name)
    study = study_of(src, [name])
    return figure.data(study) if figure.applies(study) else pd.DataFrame()


def render(study: Study, names=None) -> tuple[dict, dict[str, str]]:
    """Every figure of `names` (default: all that apply to the study) that has data, and the reason
    for each one left out."""
    names = list(names) if names is not None else [n for n, f in FIGURES.items() if f.applies(study)]
    figures, skipped = {}, {}
    for name in names:
        try:
            figures[name] = get(name).figure(study)
        except NoData as e:
            skipped[name] = str(e)
            log.info("skipped %s", e)
    return figures, skipped


def save(fig, path, dpi: int = DPI, root=None) -> Path:
    """Write a figure atomically (format from the suffix; PDFs without a creation date), inside
    `style()` so that tick labels are laid out as intended."""
    path = Path(path)
    meta = {"CreationDate": None} if path.suffix == ".pdf" else None
    with style(), atomic_path(path, root) as tmp:
        fig.savefig(tmp, format=path.suffix[1:] or None, dpi=dpi, bbox_inches="tight", metadata=meta)
    return path


class Written(list):
    """The files `plot` wrote; `skipped` maps each figure left out to the reason."""

    def __init__(self):
        super().__init__()
        self.skipped: dict[str, str] = {}


def plot(name: str, path, out_dir=None, formats=("png", "pdf")) -> Written:
    """Write figure `name` (or, for "all", every figure with data) as <out_dir>/<name>.<format>.

    Default out_dir: <path>/figures. For "all", figures without data are skipped and listed in the
    result's `skipped`; a single figure without data raises StorageError (one line)."""
    names = None if name == "all" else [get(name).name]
    study = study_of(path, names or list(FIGURES))
    figures, skipped = render(study, names)
    if names and skipped:
        raise StorageError(skipped[name])
    first = path[0] if isinstance(path, (list, tuple)) else path  # several sweeps: pooled (results.collect)
    out = Path(out_dir) if out_dir is not None else Path(first) / "figures"
    root = Path(first) if out_dir is None else out  # no write through a link below the folder given
    make_folder(out, root)
    written = Written()
    written.skipped.update(skipped)
    for n, fig in figures.items():
        written.extend(save(fig, out / f"{n}.{fmt}", root=root) for fmt in formats)
    return written


for _module in pkgutil.iter_modules(__path__):  # every figure module registers itself
    if _module.name != "style" and not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")
