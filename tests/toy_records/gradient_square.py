"""A toy record in one file, outside the package, registered by tests/test_record_files.py (flt_diag.register_record):
the sum of the squared gradient entries of every parameter after the backward, every N steps (`--toy-every N`;
0 = never)."""
from pydantic import Field

from flt_diag.records import Record, RecordOptions

SQUARE = "toy_grad_square"


class ToyOptions(RecordOptions):
    toy_every: int = Field(0, description="Toy: the squared gradient norm every N steps; 0 = never.", ge=0)


def compute(model) -> dict:
    return {SQUARE: sum(float(p.grad.double().square().sum()) for p in model.parameters() if p.grad is not None)}


RECORD = Record(options=ToyOptions, metrics={SQUARE: "sum of the squared gradient entries of every parameter, before "
                                                     "clipping"},
                moment="after_backward", compute=compute)
