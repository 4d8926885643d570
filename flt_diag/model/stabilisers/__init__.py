"""The field's loop stabilisers (issue 56), one file each: every module of this package whose name does not start
with "_" holds one `STABILISER`, a `Stabiliser` with everything about it - its name, description and source, the
paper variant it builds on, whether it composes with the others of the paper's five, the values flt-diag chose
where the source leaves one open (`ours`), its parameters (an nn.Module factory) and the hooks it needs at the
loop's seams (HOOKS). The model (flt_diag.model.transformer) calls the hooks where they belong; the variant tables
and `flt-diag variants` are assembled from `all_stabilisers()` (flt_diag.config.variants), a training step's loop
count and loss term from the hooks (flt_diag.training.stabiliser_step). docs/DESIGN.md §2b, docs/extending.md.

Torch-free at import (config/ and the command line read the declarations): a stabiliser imports torch inside its
hooks and factory. A researcher's own joins from outside the package by `flt_diag.register_stabiliser(obj)` or an
entry point of the group `flt_diag.stabilisers` (ENTRY_POINTS) naming such an object.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import pkgutil
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

ENTRY_POINTS = "flt_diag.stabilisers"
PAPER_BASES = ("lt", "lt-ii", "lt-ai", "fla", "flt")
HOOKS = {  # a hook's name -> when the model or the Trainer calls it, with what; every one is optional
    "start": "loop t >= 2's start, in place of the base's rule: start(part, x, e) -> stream (x: the raw stream at "
             "loop t-1's end, e = norm(E))",
    "enter": "every loop's start, after the start: enter(part, x, t) -> stream (t: the loop's index from 0)",
    "update": "every loop's end: update(part, x_in, x_out, t) -> stream (x_in: the stream the blocks took, x_out: "
              "what they returned)",
    "block": "the residual add of every block, once at build: block(cfg) -> {scale, post_norm, alpha} (Block's)",
    "init": "after the model's own initialisation: init(model) (the stabiliser's part resets itself)",
    "penalty": "after a training forward: penalty(model, generator) -> the loss term's penalty at the final state",
    "objective": "objective(ce, penalty, step, steps[, strength]) -> what to backpropagate (with `penalty`; "
                 "strength: --strength, given where the stabiliser declares what it scales)",
    "penalty_on": "before a training step's penalty: penalty_on(step, steps, generator) -> whether the step takes "
                  "it (one draw a step, every micro-batch alike; without it every step does)",
    "loop_count": "before a training step: loop_count(K, generator) -> the step's loops",
    "depths": "before a training forward: depths(K, s, batch, generator) -> (n, k), (batch,) long tensors: "
              "sequence i runs n_i loops without the gradient, then k_i with it (s: the model's grad_loops, 0: all; "
              "flt_diag.model.per_sequence); no `enter` or `update` with it",
    "grad_loops": "once at build: grad_loops(K) -> the loops the gradient flows through by default (0: all)",
    "metrics": "after a training step's backward: metrics(part) -> {metric: 0-d tensor} recorded every step",
}


@dataclass(frozen=True, eq=False)
class Stabiliser:
    """One stabiliser (the module docstring). `part` names the model attribute its parameters sit under (their
    state-dict prefix) and `parameters(cfg)` builds them (an nn.Module, its `reset_parameters` its init)."""

    name: str
    description: str
    source: str
    base: str = "lt"  # the paper variant it builds on under its own name
    composes: bool = False  # also on the others of the paper's five, as `flt+<name>`
    ours: dict[str, str] = field(default_factory=dict)  # value -> why: flt-diag's choice, not the source's
    strength: str = ""  # what --strength multiplies (its source value); "": strength != 1 is refused
    strength_max: float = 100.0  # the largest --strength with a meaning (STARS: lambda = 0.1 S stays a weight <= 1)
    part: Optional[str] = None
    parameters: Optional[Callable[[Any], Any]] = None
    start: Optional[Callable] = None
    enter: Optional[Callable] = None
    update: Optional[Callable] = None
    block: Optional[Callable] = None
    init: Optional[Callable] = None
    penalty: Optional[Callable] = None
    objective: Optional[Callable] = None
    penalty_on: Optional[Callable] = None
    loop_count: Optional[Callable] = None
    depths: Optional[Callable] = None
    grad_loops: Optional[Callable] = None
    metrics: Optional[Callable] = None
    module: str = ""  # the module that defines it: filled where it joins (its file, entry point or register call)

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").isalnum() or not self.name[0].isalpha():
            raise ValueError(f"stabiliser name {self.name!r}: letters, digits and '-', starting with a letter")
        for name, kind in (("description", str), ("source", str), ("strength", str), ("composes", bool)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"stabiliser {self.name}: `{name}` must be a {kind.__name__}, got "
                                 f"{type(getattr(self, name)).__name__}")
        if isinstance(self.strength_max, bool) or not isinstance(self.strength_max, (int, float)) \
                or not self.strength_max > 0:
            raise ValueError(f"stabiliser {self.name}: `strength_max` must be a number above 0, got "
                             f"{self.strength_max!r}")
        if not isinstance(self.ours, dict):
            raise ValueError(f"stabiliser {self.name}: `ours` must be a dict (value -> why)")
        bad = [h for h in ("parameters", *HOOKS) if getattr(self, h) is not None and not callable(getattr(self, h))]
        if bad:
            raise ValueError(f"stabiliser {self.name}: {', '.join(bad)} must be callable")
        if self.base not in PAPER_BASES:
            raise ValueError(f"stabiliser {self.name}: base {self.base!r} is not one of {', '.join(PAPER_BASES)}")
        if (self.part is None) != (self.parameters is None):
            raise ValueError(f"stabiliser {self.name}: `part` and `parameters` go together")
        if (self.penalty is None) != (self.objective is None):
            raise ValueError(f"stabiliser {self.name}: a loss term is `penalty` and `objective` together")
        if self.penalty_on is not None and self.penalty is None:
            raise ValueError(f"stabiliser {self.name}: `penalty_on` gates a `penalty`; it has none")
        if self.depths is not None and (self.enter or self.update or self.loop_count or self.penalty):
            raise ValueError(f"stabiliser {self.name}: `depths` (a loop count per sequence) takes no `enter`, "
                             "`update`, `loop_count` or `penalty`")
        if not self.module:  # (its hooks' module: where it is written)
            hooks = [h for h in (getattr(self, n) for n in ("parameters", *HOOKS)) if h is not None]
            object.__setattr__(self, "module", getattr(hooks[0], "__module__", "") if hooks else "")


def shaped(out: Any, like: Any, model: Any, hook: str) -> Any:
    """A stream-valued hook's result (`start`, `enter`, `update`), checked to be a tensor of the stream's shape: a
    stabiliser of one's own that returns another is one ValueError line naming it and the hook, not a matmul's
    shape error three calls later."""
    if getattr(out, "shape", None) != like.shape:
        stab = getattr(model, "stabiliser", None)
        got = tuple(out.shape) if hasattr(out, "shape") else type(out).__name__
        raise ValueError(f"stabiliser {getattr(stab, 'name', '?')} ({getattr(stab, 'module', '?')}): its `{hook}` "
                         f"hook returned {got}; the stream is {tuple(like.shape)}")
    return out


def provenance(stab: Stabiliser) -> dict[str, str]:
    """What says which stabiliser ran: its name, module, file and the version of the distribution holding it."""
    module = sys.modules.get(stab.module)
    top = stab.module.split(".")[0]
    dists = importlib.metadata.packages_distributions().get(top, [])
    try:
        version = importlib.metadata.version(dists[0] if dists else top)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown (not an installed distribution)"
    return {"name": stab.name, "module": stab.module, "file": str(getattr(module, "__file__", None) or "?"),
            "version": version}


def _own(stab: Any, module: str, where: str, force: bool = False) -> Stabiliser:
    """`stab`, checked to be a Stabiliser, its module `module` where it names none (or `force`)."""
    if not isinstance(stab, Stabiliser):
        raise ValueError(f"{where}: a stabiliser is a flt_diag Stabiliser, got {type(stab).__name__}")
    if force or not stab.module:
        object.__setattr__(stab, "module", module)
    return stab


@functools.cache
def builtin() -> tuple[Stabiliser, ...]:
    """The STABILISER of every module of this package (not `_`-named), by module name."""
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    return tuple(_own(importlib.import_module(f"{__name__}.{n}").STABILISER, f"{__name__}.{n}", f"{__name__}.{n}", True)
                 for n in names)


@functools.cache
def entry_points() -> tuple[Stabiliser, ...]:
    """The stabilisers named by installed distributions' entry points of the group ENTRY_POINTS, loaded once. One
    that fails to load, or names no Stabiliser, is said in one warning line on stderr and left out (a broken plugin
    does not stop flt-diag; its name is then an unknown variant)."""
    found = []
    for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINTS), key=lambda ep: ep.name):
        try:
            found.append(_own(ep.load(), ep.module, f"entry point {ep.name} = {ep.value}"))
        except (Exception, SystemExit) as e:  # (a plugin's own error, whatever it is, or its exit: said in one line)
            print(f"warning: stabiliser entry point {ep.name} = {ep.value} left out: {type(e).__name__}: "
                  f"{str(e).splitlines()[0] if str(e) else '(no code)' if isinstance(e, SystemExit) else ''}",
                  file=sys.stderr)
    return tuple(found)
