"""Every metric name flt-diag stores, defined once (used by training, diagnostics, plots): the core ones below,
and RECORDED, the metrics of the records in one file each (flt_diag.records), assembled from them.

Rows of a run's metrics table are (step, metric, loop, layer, value). `loop` counts 1..K and
`layer` counts blocks 1..L; NONE (-1) marks "not applicable". Per-parameter-group metrics use
the suffixes below: "<metric>/embedding" and "<metric>/head" with layer NONE, and
"<metric>/attn", "<metric>/mlp" with the block in `layer`.
"""
from flt_diag.records import all_records, exit_loss, fixed_point_residual, loop_map, loop_map_agreement, sharpness, \
    token_similarity

NONE = -1

LOSS = "loss"  # training loss of the step (mean over micro-batches)
VAL_LOSS = "val_loss"  # held-out loss at evaluation steps (answer tokens only on a synthetic task)
VAL_ACCURACY = "val_accuracy"  # share of held-out answers right, exact match (synthetic tasks only)
LR = "lr"  # learning rate of the block matrices (Muon) or of everything (plain AdamW)
MOMENTUM = "momentum"  # Muon momentum of the step (absent with plain AdamW)
RESID_NORM = "resid_norm"  # mean per-token L2 norm of the stream after block `layer` of loop `loop`
RESID_NORM_LOOP_END = "resid_norm_loop_end"  # same, at the end of loop `loop` (before the final norm)
GRAD_NORM = "grad_norm"  # global L2 gradient norm before clipping (and per group with a suffix)
ACT_GRAD_NORM = "act_grad_norm"  # L2 norm of d(loss)/d(output of block `layer` at loop `loop`)
ACT_GRAD_NORM_ATTN = "act_grad_norm/attn"  # same, w.r.t. the attention output (after W_O, before the residual add)
ACT_GRAD_NORM_MLP = "act_grad_norm/mlp"  # same, w.r.t. the MLP output (before the residual add)
GRAD_NORM_CLIPPED = "grad_norm_clipped"  # per-group gradient norm after clipping (the reference's grad_norm/...)
GRAD_COSINE = "grad_cosine"  # cosine between this step's and the previous step's gradient
SIGN_FLIP = "sign_flip"  # share of coordinates whose gradient sign flipped since the previous step
UPDATE_RATIO = "update_ratio"  # ||W_after - W_before|| / ||W_before||, per group
LOOPS_RUN = "loops_run"  # loops the recorded forward ran (runs of flt_diag.watch, and stabilisers that sample their count; per sequence: the batch mean)
STABILISER_PENALTY = "stabiliser_penalty"  # a loss-term stabiliser's penalty on the step's first micro-batch (stars, jacobian-fro)
INJECTION_RHO = "injection_rho"  # Parcae: rho(Abar) = max over channels of the loop start's decay, every step
PARAM_NORM = "param_norm"  # ||W|| per group, before the optimizer step (the weights the step's gradient was taken at)


# Derived (summary.json and the sweep table, not rows of the metrics table): the reference's
# milestone statistics, population std of the loss and of the pre-clipping global gradient norm
# over the steps since the previous milestone (flt_diag.judge.verdict.milestone_stds).
LOSS_STD, GRAD_NORM_STD = "loss_std", "grad_norm_std"


def group_key(metric: str, group: str) -> tuple[str, int]:
    """("grad_norm", "block0.attn") -> ("grad_norm/attn", 1); ("grad_norm", "head") -> ("grad_norm/head", -1)."""
    if group.startswith("block"):
        block, kind = group[len("block"):].split(".")
        return f"{metric}/{kind}", int(block) + 1
    return f"{metric}/{group}", NONE


# The records' metrics, name -> one-line definition (each defined in its record's file: flt_diag.records).
RECORDED = {name: definition for record in all_records() for name, definition in record.metrics.items()}
if clash := sorted(set(RECORDED) & {v for k, v in dict(globals()).items() if k.isupper() and isinstance(v, str)}):
    raise ValueError(f"a record names a core metric: {', '.join(clash)}")
FIXED_POINT_RESIDUAL = fixed_point_residual.RESIDUAL  # (a record's, its definition there: flt_diag.records)
TOKEN_COSINE, EFFECTIVE_RANK = token_similarity.TOKEN_COSINE, token_similarity.EFFECTIVE_RANK  # (a record's, too)
EXIT_LOSS = exit_loss.EXIT_LOSS  # (a record's: the head applied to h(t), loop t, against the step's targets)
# The loop map's, the per-loop gradient agreement's and the sharpness's (records of moment loop_map, every N steps;
# DESIGN.md §3, "Loop dynamics"; h(t) the loop-end state of loop t):
LOOP_GAIN, LOOP_SPECTRAL_RADIUS = loop_map.LOOP_GAIN, loop_map.LOOP_SPECTRAL_RADIUS
LOOP_SPECTRAL_RESIDUAL, LOOP_MEAN_GAIN = loop_map.LOOP_SPECTRAL_RESIDUAL, loop_map.LOOP_MEAN_GAIN
LOOP_PERTURBATION_GROWTH = loop_map.LOOP_PERTURBATION_GROWTH
LOOP_GRAD_COSINE = loop_map_agreement.LOOP_GRAD_COSINE
SHARPNESS = sharpness.SHARPNESS
