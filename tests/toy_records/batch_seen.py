"""A toy record with a context (flt_diag.records.RecordContext), in one file outside the package, registered by
tests/test_record_context.py: after the backward, the step it is taken at, the sum of the token ids of the step's
recorded forward (`ctx.idx`), and how many of its targets (`ctx.targets`, where the model gives them) are the next
token of idx, at a step that is a multiple of N (`--toy-batch N`; 0 = never). Its state counts its calls."""
from dataclasses import dataclass

from pydantic import Field

from flt_diag.records import Record, RecordContext, RecordOptions

STEP, IDS, SHIFTED, CALLS = "toy_ctx_step", "toy_ctx_ids", "toy_ctx_shifted", "toy_ctx_calls"


class BatchOptions(RecordOptions):
    toy_batch: int = Field(0, description="Toy: the step's batch as the record's context sees it, every N steps.",
                           ge=0)


@dataclass
class Calls:
    n: int = 0


def compute(model, ctx: RecordContext[Calls]) -> dict:
    assert ctx.state is not None
    ctx.state.n += 1
    out = {STEP: ctx.step, IDS: int(ctx.idx.sum()), CALLS: ctx.state.n}
    if ctx.targets is not None:
        out[SHIFTED] = int((ctx.targets[:, :-1] == ctx.idx[:, 1:]).sum())
    return out


RECORD = Record(options=BatchOptions, moment="after_backward", compute=compute, state=Calls, context=True,
                metrics={STEP: "the step, as the context gives it", IDS: "sum of the recorded forward's token ids",
                         SHIFTED: "targets that are the next token of idx", CALLS: "the record's calls so far"})
