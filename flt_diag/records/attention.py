"""The attention statistics (`--attention-stats`): per (loop, layer), the largest pre-softmax attention logit and
the mean softmax entropy, recomputed after each block's forward from its inputs (x, cos, sin[, query]) in fp32.
They need flt-diag's own block (its `attn.query_key` and `attention_sources`): on other blocks they are not
recorded (said once). Drawn by the `attention` figure (flt_diag.results.figures.weights)."""
from __future__ import annotations

import math

from pydantic import AliasChoices, Field

from flt_diag.records import Record, RecordOptions

MAX_LOGIT, ENTROPY = "attn_max_logit", "attn_entropy"


def compute(block, args, output) -> dict:
    """Block i's causal attention scores q.k / sqrt(D) at this loop (B, H, T, T), from its queries and keys."""
    x, cos, sin, *rest = args
    q, k = block.attn.query_key(*block.attention_sources(x, rest[0] if rest else None), cos, sin)  # (B, T, H, D)
    scores = q.float().transpose(1, 2) @ k.float().permute(0, 2, 3, 1) / math.sqrt(q.shape[-1])
    n = scores.shape[-1]
    scores = scores.masked_fill(~scores.new_ones(n, n, dtype=bool).tril(), -math.inf)
    p = scores.softmax(-1)
    return {MAX_LOGIT: scores.amax(), ENTROPY: -(p * p.clamp_min(1e-30).log()).sum(-1).mean()}


class AttentionOptions(RecordOptions):
    attention_stats: bool = Field(False, description="Also record max attention logit and entropy per (loop, layer).",
                                  validation_alias=AliasChoices("attention_stats", "attention"))


RECORD = Record(
    options=AttentionOptions,
    metrics={MAX_LOGIT: "largest pre-softmax attention logit q.k / sqrt(D) at (loop, layer)",
             ENTROPY: "mean attention entropy (nats) over batch, heads and query positions at (loop, layer)"},
    moment="after_block", compute=compute)
