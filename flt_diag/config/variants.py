"""The five variants as data (DESIGN.md §2), importable without torch (the CLI, plots and reports use it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class VariantRule:
    """How loop t >= 2 differs between variants (loop 1 is always a plain pass)."""

    start: Literal["prev", "embed", "embed+prev"]  # stream at loop start: h(t-1), norm(E), norm(E + h(t-1))
    add_prev_before_block: bool  # FLA: x = norm(x + h(t-1)) before every block
    query_from_prev: Literal["none", "first", "all"]  # AI: blocks whose Q comes from norm(h(t-1))


VARIANTS: dict[str, VariantRule] = {
    "lt": VariantRule(start="prev", add_prev_before_block=False, query_from_prev="none"),
    "lt-ii": VariantRule(start="embed+prev", add_prev_before_block=False, query_from_prev="none"),
    "lt-ai": VariantRule(start="embed", add_prev_before_block=False, query_from_prev="first"),
    "fla": VariantRule(start="embed", add_prev_before_block=True, query_from_prev="none"),
    "flt": VariantRule(start="embed", add_prev_before_block=False, query_from_prev="all"),
}
Variant = Literal[tuple(VARIANTS)]  # a variant's name, as a type (in the order of VARIANTS: the figures' and tables')

VARIANT_DESCRIPTIONS: dict[str, str] = {
    "lt": "original looped transformer: loop t starts from h(t-1)",
    "lt-ii": "LT + additive input injection: loop t starts from norm(E + h(t-1))",
    "lt-ai": "LT + attention injection in the first block only",
    "fla": "fully looped architecture only: norm(x + h(t-1)) before every block",
    "flt": "full FLT: every block takes its attention query from h(t-1)",
}

MAX_LOOPS = 1024  # far beyond any study; a mistyped 1e20 is refused instead of never finishing a step

# Okabe-Ito (colour-blind safe), five clearly distinct hues; FLT, the method under study, in black.
VARIANT_COLORS: dict[str, str] = {"lt": "#0072b2", "lt-ii": "#e69f00", "lt-ai": "#009e73", "fla": "#cc79a7",
                                  "flt": "#000000"}
