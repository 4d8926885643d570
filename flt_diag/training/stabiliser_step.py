"""What a stabiliser changes in a training step, through its hooks (flt_diag.model.stabilisers; DESIGN.md §2b): the
step's loop count (its `loop_count`: Huginn's and STARS's sampled counts; every other variant runs K) or each
sequence's (its `depths`: parcae-source's), its objective (its `penalty` and `objective`: STARS's and the Jacobian
penalty's loss terms, on the steps its `penalty_on` takes; the recorded `loss` stays the cross-entropy, what the
verdict judges) and what it records every step (its `metrics`: Parcae's rho). The counts and penalties draw
from generators seeded by (seed, step), so a resumed run draws exactly what an uninterrupted one does. A model without a stabiliser (`model.stabiliser` None or absent: a model of the Trainer's `model=`) has none.
"""
from __future__ import annotations

from typing import Any

import torch

from flt_diag.model.stabilisers import provenance
from flt_diag.model.transformer import hook, stabiliser_part

_STREAM = {"loops": 0x4C4F4F50, "penalty": 0x50454E41, "gate": 0x47415445}  # separate streams: a loop draw never shifts a probe


def generator(seed: int, step: int, micro: int, stream: str) -> torch.Generator:
    return torch.Generator().manual_seed(hash((seed, step, micro, _STREAM[stream])) & (2 ** 63 - 1))


def sampled_loops(model: torch.nn.Module) -> bool:
    """Whether the model's stabiliser samples each step's loop count, or each sequence's (a count of 1 leaves a loop
    start unused)."""
    return hook(model, "loop_count") is not None or hook(model, "depths") is not None


def step_loops(model: Any, seed: int, step: int) -> int | None:
    """The loop count of training step `step` (one draw a step, every micro-batch alike); None: the model's K."""
    sampler = hook(model, "loop_count")
    return None if sampler is None else sampler(model.cfg.loops, generator(seed, step, 0, "loops"))


def micro_depths(model: Any, seed: int, step: int, micro: int, batch: int) -> tuple | None:
    """(n, k), each (batch,): the loops without and with the gradient of each sequence of micro-batch `micro` (a
    stabiliser's `depths`, given the model's grad_loops as s); None: every sequence runs the step's count."""
    sampler = hook(model, "depths")
    return None if sampler is None else sampler(model.cfg.loops, model.grad_loops, batch,
                                                 generator(seed, step, micro, "loops"))


def objective(model: torch.nn.Module, ce: torch.Tensor, seed: int, step: int, micro: int,
              steps: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(what to backpropagate, the penalty or None): the variant's loss term at the forward just run."""
    penalty, objective, on = hook(model, "penalty"), hook(model, "objective"), hook(model, "penalty_on")
    if penalty is None:
        return ce, None
    if on is not None and not on(step, steps, generator(seed, step, 0, "gate")):  # (one draw a step)
        setattr(model, "penalty_inputs", None)  # (not taken: nothing kept alive past the step)
        return ce, None
    pen = penalty(model, generator(seed, step, micro, "penalty"))
    stab = getattr(model, "stabiliser", None)  # one that declares what --strength scales is given it
    extra = (float(getattr(model, "cfg").strength),) if stab is not None and stab.strength else ()
    return objective(ce, pen, step, steps, *extra), pen.detach()


def step_metrics(model: torch.nn.Module) -> dict:
    """{metric: value} the model's stabiliser records every step (its `metrics` hook on its part). A name that is
    flt-diag's own (a core metric or a record's) is one ValueError line naming the stabiliser, before anything of
    the step is written: written beside the real one it would pass for it (a second `loss` row every step)."""
    metrics = hook(model, "metrics")
    if metrics is None:
        return {}
    out = metrics(stabiliser_part(model))
    if clash := sorted(set(out) & _own_metric_names()):
        stab = getattr(model, "stabiliser", None)
        raise ValueError(f"stabiliser {getattr(stab, 'name', '?')} ({getattr(stab, 'module', '?')}): its metrics hook "
                         f"names flt-diag's own metric {', '.join(clash)}; give it a name of its own")
    return out


def _own_metric_names() -> set[str]:
    from flt_diag.storage import metric_names as M
    own = {v for k, v in vars(M).items() if k.isupper() and isinstance(v, str)} | set(M.RECORDED)
    return own - {M.INJECTION_RHO}  # (declared in metric_names for a stabiliser's hook to write: Parcae's)


def stabiliser_env(model: torch.nn.Module) -> dict:
    """config.json's env record of the stabiliser that ran: {"stabiliser": {name, module, file, version}}, so an
    archive says which code it was (one from outside the package included); {} for none."""
    stab = getattr(model, "stabiliser", None)
    return {} if stab is None else {"stabiliser": provenance(stab)}
