"""The variants as data (DESIGN.md §2 and §2b), importable without torch (the CLI, plots and reports use it).

The paper's five (PAPER) are one rule each: where loop t >= 2 starts (`start`), whether h(t-1) is added before
every block (`add_prev_before_block`) and which blocks take their attention query from h(t-1) (`query_from_prev`).
The field's stabilisers are one file each (flt_diag.model.stabilisers, each file's STABILISER: its name,
description, source, base, whether it composes, its parameters and hooks); this module assembles the tables from
them. A stabiliser that composes goes with any of the five: `flt+residual-scale` is FLT with its residual branches
scaled (COMPOSED; `flt-diag variants` lists them all); on its own base a stabiliser goes by its own name
(`residual-scale` is LT + the residual scale). A researcher's own joins by `register_stabiliser` (flt_diag's
`register_stabiliser`) or an entry point: the tables below grow in place, so every reader sees it.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Annotated, Literal, Optional, get_args, get_type_hints

from pydantic import AfterValidator

from flt_diag.config.option_fields import Choices
from flt_diag.model.stabilisers import Stabiliser, builtin, entry_points


@dataclass(frozen=True)
class VariantRule:
    """How a paper variant differs from plain LT (loop 1 is always a plain pass from norm(E))."""

    start: Literal["prev", "embed", "embed+prev"]  # stream at loop t >= 2's start: h(t-1), norm(E), norm(E + h(t-1))
    add_prev_before_block: bool = False  # FLA: x = norm(x + h(t-1)) before every block
    query_from_prev: Literal["none", "first", "all"] = "none"  # AI: blocks whose Q comes from norm(h(t-1))

    def __post_init__(self):
        """A rule is checked where it is written: a value outside its field's choices (a misspelt `start`
        would otherwise reach the model's last `else`) or of the wrong kind is one ValueError naming the field."""
        hints = get_type_hints(VariantRule)
        for f in fields(self):
            value, kind = getattr(self, f.name), hints[f.name]
            allowed = get_args(kind) if getattr(kind, "__origin__", None) is Literal else None
            if allowed is not None and value not in allowed:
                raise ValueError(f"variant rule: {f.name}={value!r} is not one of {', '.join(map(repr, allowed))}")
            if kind is bool and not isinstance(value, bool):
                raise ValueError(f"variant rule: {f.name}={value!r} must be True or False")


@dataclass(frozen=True)
class VariantSpec:
    """A variant: a paper variant's rule (`base`) and at most one stabiliser on it."""

    base: str
    stabiliser: Optional[Stabiliser] = None

    @property
    def rule(self) -> VariantRule:
        return PAPER[self.base]


PAPER: dict[str, VariantRule] = {
    "lt": VariantRule(start="prev"),
    "lt-ii": VariantRule(start="embed+prev"),
    "lt-ai": VariantRule(start="embed", query_from_prev="first"),
    "fla": VariantRule(start="embed", add_prev_before_block=True),
    "flt": VariantRule(start="embed", query_from_prev="all"),
}
PAPER_VARIANTS = list(PAPER)  # the paper's five: the default of every sweep and map
PAPER_DESCRIPTIONS = {
    "lt": "original looped transformer: loop t starts from h(t-1)",
    "lt-ii": "LT + additive input injection: loop t starts from norm(E + h(t-1))",
    "lt-ai": "LT + attention injection in the first block only",
    "fla": "fully looped architecture only: norm(x + h(t-1)) before every block",
    "flt": "full FLT: every block takes its attention query from h(t-1)",
}
PAPER_SOURCES = {
    "lt": "Fully Looped Transformer paper, LT baseline (FuRuF-11/FullyLoopedTransformer)",
    "lt-ii": "the same paper, LT_i", "lt-ai": "the same paper, LT_ia", "fla": "the same paper, FLT_res",
    "flt": "the same paper, FLT",
}
# issue 56's seven in the order they joined (the tables' and figures' order); any other after them, by name
FIRST = ("parcae", "huginn", "stars", "jacobian-fro", "residual-scale", "deeploop", "loop-embed")

# the tables, assembled from the stabilisers by `_assemble` (in place: a module that imported one sees it grow)
STABILISERS: dict[str, Stabiliser] = {}  # name -> its stabiliser (on its own base)
COMPOSABLE: list[str] = []  # the stabilisers that compose with the others of the paper's five
COMPOSED: dict[str, VariantSpec] = {}  # "flt+residual-scale" -> FLT with the residual scale
VARIANTS: dict[str, VariantSpec] = {}  # every variant: the five, the stabilisers, the compositions
VARIANT_DESCRIPTIONS: dict[str, str] = {}
SOURCES: dict[str, str] = {}
_REGISTERED: dict[str, Stabiliser] = {}  # joined by register_stabiliser
_SAID: set[str] = set()  # entry points whose name clash was said


def _assemble() -> None:
    """Fill the tables from the package's stabilisers, the entry points' and the registered ones."""
    own = builtin()
    taken = {*PAPER, *(s.name for s in own)}
    plugins: list[Stabiliser] = []  # (one that takes a name: said once, left out; the first of two plugins kept)
    for s in entry_points():
        if s.name in taken or any(p.name == s.name for p in plugins):
            if s.name not in _SAID:
                _SAID.add(s.name)
                whose = "flt-diag's own" if s.name in taken else "another entry point"
                print(f"warning: stabiliser entry point {s.name} ({s.module}) left out: {whose} has that name",
                      file=sys.stderr)
            continue
        plugins.append(s)
    registered = [s for s in _REGISTERED.values() if not any(s is p for p in plugins)]  # (installed and registered)
    found = [*own, *plugins, *registered]
    order = {n: i for i, n in enumerate(FIRST)}
    found.sort(key=lambda s: (order.get(s.name, len(FIRST)), s.name))
    names = [s.name for s in found]
    if twice := sorted({n for n in names if names.count(n) > 1 or n in PAPER or "+" in n}):
        raise ValueError(f"two stabilisers, or a stabiliser and a paper variant, are named {', '.join(twice)}")
    for table in (STABILISERS, COMPOSED, VARIANTS, VARIANT_DESCRIPTIONS, SOURCES):
        table.clear()
    STABILISERS.update({s.name: s for s in found})
    COMPOSABLE[:] = [s.name for s in found if s.composes]
    comp = [(b, s) for b in PAPER for s in found if s.composes and b != s.base]
    COMPOSED.update({f"{b}+{s.name}": VariantSpec(b, s) for b, s in comp})
    VARIANTS.update({**{n: VariantSpec(n) for n in PAPER}, **{s.name: VariantSpec(s.base, s) for s in found},
                     **COMPOSED})
    VARIANT_DESCRIPTIONS.update({**PAPER_DESCRIPTIONS, **{s.name: s.description for s in found},
                                 **{f"{b}+{s.name}": f"{b} + {s.name}" for b, s in comp}})
    SOURCES.update({**PAPER_SOURCES, **{s.name: s.source for s in found}})


def register_stabiliser(stabiliser: Stabiliser) -> Stabiliser:
    """A researcher's own stabiliser joins every variant table (and with them `flt-diag variants`, the options'
    validation, the model and the Trainer) under its name, and, if it composes, as `<base>+<name>`. A name taken
    by a paper variant or another stabiliser is refused (one ValueError line); registering a name again replaces
    the one registered before (a notebook's cell run twice). Returns the stabiliser."""
    if not isinstance(stabiliser, Stabiliser):
        raise ValueError(f"register_stabiliser takes a flt_diag Stabiliser, got {type(stabiliser).__name__}")
    before = _REGISTERED.get(stabiliser.name)
    _REGISTERED[stabiliser.name] = stabiliser
    try:
        _assemble()
    except ValueError:
        _REGISTERED.pop(stabiliser.name)
        if before is not None:
            _REGISTERED[stabiliser.name] = before
        _assemble()
        raise
    return stabiliser


def unregister_stabiliser(name: str) -> None:
    """Undo register_stabiliser(name) (tests; a notebook's experiment done with)."""
    _REGISTERED.pop(name, None)
    _assemble()


_assemble()


def _known(name: str) -> str:
    if name not in VARIANTS:
        raise ValueError(f"must be one of {', '.join(VARIANTS)}, got {name!r}")
    return name


if TYPE_CHECKING:  # (to mypy, a variant's name is a str)
    Variant = str
else:  # a variant's name, as a type: one of VARIANTS when it is validated (a registered one included)
    Variant = Annotated[str, Choices(lambda: tuple(VARIANTS)), AfterValidator(_known)]


def base_of(name: str) -> str:
    """The paper variant a variant builds on: its own name for the five, the part before '+' for a composition,
    the stabiliser's base for a stabiliser on its own."""
    return VARIANTS[name].base if name in VARIANTS else name.split("+")[0] if "+" in name else "lt"


def stabiliser_of(name: str) -> Optional[Stabiliser]:
    """The stabiliser of a variant (None: one of the paper's five)."""
    return VARIANTS[name].stabiliser


MAX_LOOPS = 1024  # far beyond any study; a mistyped 1e20 is refused instead of never finishing a step

# Okabe-Ito (colour-blind safe), five clearly distinct hues; FLT, the method under study, in black. The stabilisers
# take seaborn's "dark" palette (flt_diag.results.figures.style gives any other label a colour of its own).
VARIANT_COLORS: dict[str, str] = {"lt": "#0072b2", "lt-ii": "#e69f00", "lt-ai": "#009e73", "fla": "#cc79a7",
                                  "flt": "#000000", "parcae": "#8c0800", "huginn": "#591e71", "stars": "#b8850a",
                                  "jacobian-fro": "#006374", "residual-scale": "#12711c", "deeploop": "#a23582",
                                  "loop-embed": "#592f0d"}
