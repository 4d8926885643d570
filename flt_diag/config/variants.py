"""The variants as data (DESIGN.md §2 and §2b), importable without torch (the CLI, plots and reports use it).

A variant is one rule: where loop t >= 2 starts (`start`), what each block does (`add_prev_before_block`,
`query_from_prev`, `post_norm`, `deepnorm`, `residual_scale`), what is added at a loop's start
(`loop_embedding`), what the training loss adds (`loss_term`) and how many loops a training step runs
(`loop_count`). The paper's five (PAPER_VARIANTS) change only the first three; the field's stabilisers (issue 56)
change the rest, each implemented in one file of flt_diag/model/stabilisers/ with its equation and source.
A stabiliser that is a loss term, a residual scale or a loop embedding composes with any of the five:
`flt+residual-scale` is FLT with its residual branches scaled (COMPOSABLE; `flt-diag variants` lists them all); on
LT a stabiliser goes by its own name (`residual-scale` is LT + the residual scale).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Literal, get_args, get_type_hints


@dataclass(frozen=True)
class VariantRule:
    """How a variant differs from plain LT (loop 1 is always a plain pass from norm(E))."""

    start: Literal["prev", "embed", "embed+prev", "parcae", "adapter"]  # stream at loop t >= 2's start:
    # h(t-1), norm(E), norm(E + h(t-1)); Parcae's A*x(t-1) + dt*B*norm(E); Huginn's W [x(t-1); norm(E)]
    add_prev_before_block: bool = False  # FLA: x = norm(x + h(t-1)) before every block
    query_from_prev: Literal["none", "first", "all"] = "none"  # AI: blocks whose Q comes from norm(h(t-1))
    post_norm: bool = False  # x = norm(alpha x + F(norm(x))) after each residual add (Huginn's sandwich; DeepLoop)
    deepnorm: bool = False  # DeepLoop: alpha = (2N)^(1/2) and the init scale beta = (8N)^(-1/2), N = K L
    residual_scale: bool = False  # every residual branch scaled by 1 / (K sqrt(L))
    loop_embedding: bool = False  # a learned, zero-initialised vector per loop index added at the loop's start
    loss_term: Literal["none", "stars", "jacobian-fro"] = "none"  # added to the training loss
    loop_count: Literal["fixed", "poisson-lognormal", "lognormal"] = "fixed"  # loops of a training step
    grad_loops: Literal["all", "quarter"] = "all"  # Huginn: the gradient through the last ceil(K/4) loops only

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


PAPER: dict[str, VariantRule] = {
    "lt": VariantRule(start="prev"),
    "lt-ii": VariantRule(start="embed+prev"),
    "lt-ai": VariantRule(start="embed", query_from_prev="first"),
    "fla": VariantRule(start="embed", add_prev_before_block=True),
    "flt": VariantRule(start="embed", query_from_prev="all"),
}
PAPER_VARIANTS = list(PAPER)  # the paper's five: the default of every sweep and map

LT = PAPER["lt"]
STABILISERS: dict[str, VariantRule] = {
    "parcae": replace(LT, start="parcae"),
    "huginn": replace(LT, start="adapter", post_norm=True, loop_count="poisson-lognormal", grad_loops="quarter"),
    "stars": replace(LT, loss_term="stars", loop_count="lognormal"),
    "jacobian-fro": replace(LT, loss_term="jacobian-fro"),
    "residual-scale": replace(LT, residual_scale=True),
    "deeploop": replace(LT, post_norm=True, deepnorm=True),
    "loop-embed": replace(LT, loop_embedding=True),
}
# What a composable stabiliser sets on any base (the rest replace LT's loop start or its block: not composable).
COMPOSABLE: dict[str, dict] = {"residual-scale": dict(residual_scale=True), "loop-embed": dict(loop_embedding=True),
                               "jacobian-fro": dict(loss_term="jacobian-fro"),
                               "stars": dict(loss_term="stars", loop_count="lognormal")}
COMPOSED: dict[str, VariantRule] = {f"{base}+{name}": replace(rule, **COMPOSABLE[name])  # (on LT: the stabiliser's
                                    for base, rule in PAPER.items() if base != "lt" for name in COMPOSABLE}  # own name)

VARIANTS: dict[str, VariantRule] = {**PAPER, **STABILISERS, **COMPOSED}
if TYPE_CHECKING:  # (a Literal of names built at import: to mypy, a variant's name is a str)
    Variant = str
else:
    Variant = Literal[tuple(VARIANTS)]  # a variant's name, as a type (in the order of VARIANTS: the figures' and tables')

VARIANT_DESCRIPTIONS: dict[str, str] = {
    "lt": "original looped transformer: loop t starts from h(t-1)",
    "lt-ii": "LT + additive input injection: loop t starts from norm(E + h(t-1))",
    "lt-ai": "LT + attention injection in the first block only",
    "fla": "fully looped architecture only: norm(x + h(t-1)) before every block",
    "flt": "full FLT: every block takes its attention query from h(t-1)",
    "parcae": "loop t starts from A*x(t-1) + dt*B*norm(E), A = exp(-dt exp(A_log)) < 1 per channel (on LT)",
    "huginn": "adapter W[x(t-1); norm(E)], sandwich norm, r ~ Poisson(LogNormal)+1 loops, gradient through the last K/4",
    "stars": "loss (1-l) CE + l |v^T J|^2 of one loop at the detached final state, log-normal loop count (on LT)",
    "jacobian-fro": "loss + g |J|_F^2 / n of one loop at the final state, Hutchinson with 2 probes (on LT)",
    "residual-scale": "every residual branch scaled by 1 / (K sqrt(L)) (on LT)",
    "deeploop": "post-norm DeepNorm residual norm(a x + F(x)), a = (2KL)^(1/2), init beta = (8KL)^(-1/2) (on LT)",
    "loop-embed": "a learned loop-index vector, zero-initialised, added at each loop's start (on LT)",
}
VARIANT_DESCRIPTIONS.update({name: f"{base} + {name.split('+')[1]}" for name in COMPOSED for base in [name.split("+")[0]]})

SOURCES: dict[str, str] = {
    "lt": "Fully Looped Transformer paper, LT baseline (FuRuF-11/FullyLoopedTransformer)",
    "lt-ii": "the same paper, LT_i", "lt-ai": "the same paper, LT_ia", "fla": "the same paper, FLT_res",
    "flt": "the same paper, FLT",
    "parcae": "Parcae, arXiv 2604.12946 (sandyresearch/parcae, parcae_lm/modules/injection.py)",
    "huginn": "Huginn, arXiv 2502.05171 (seal-rg/recurrent-pretraining, raven_modeling_minimal.py)",
    "stars": "STARS, arXiv 2605.26733 (njuyxw/STARS)",
    "jacobian-fro": "DEQ Jacobian regularisation, arXiv 2106.14342 (locuslab/deq, lib/jacobian.py)",
    "residual-scale": "arXiv 2606.18524",
    "deeploop": "DeepLoop, arXiv 2607.13491 (DeepNorm: arXiv 2203.00555)",
    "loop-embed": "parameter-golf PR 319; TMLT, arXiv 2410.01405",
}


def base_of(name: str) -> str:
    """The paper variant a variant builds on: its own name for the five, the part before '+' for a composition,
    LT for a stabiliser on its own."""
    return name if name in PAPER else name.split("+")[0] if "+" in name else "lt"


MAX_LOOPS = 1024  # far beyond any study; a mistyped 1e20 is refused instead of never finishing a step

# Okabe-Ito (colour-blind safe), five clearly distinct hues; FLT, the method under study, in black. The stabilisers
# take seaborn's "dark" palette (flt_diag.results.figures.style gives any other label a colour of its own).
VARIANT_COLORS: dict[str, str] = {"lt": "#0072b2", "lt-ii": "#e69f00", "lt-ai": "#009e73", "fla": "#cc79a7",
                                  "flt": "#000000", "parcae": "#8c0800", "huginn": "#591e71", "stars": "#b8850a",
                                  "jacobian-fro": "#006374", "residual-scale": "#12711c", "deeploop": "#a23582",
                                  "loop-embed": "#592f0d"}
