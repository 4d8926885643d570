"""A toy record in one file, added by tests/test_record_files.py to flt_diag.records' path: the sum of the squared
gradient entries of every parameter after the backward, every N steps (`--toy-every N`; 0 = never)."""
from flt_diag.config.option_fields import opt
from flt_diag.records import Record

SQUARE = "toy_grad_square"


def compute(model) -> dict:
    return {SQUARE: sum(float(p.grad.double().square().sum()) for p in model.parameters() if p.grad is not None)}


RECORD = Record(options={"toy_every": (int, opt(0, "Toy: the squared gradient norm every N steps; 0 = never.", ge=0))},
                metrics={SQUARE: "sum of the squared gradient entries of every parameter, before clipping"},
                moment="after_backward", compute=compute)
