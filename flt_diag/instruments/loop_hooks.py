"""The loop hooks, attached from outside any looped model: module forward hooks and tensor (backward)
hooks (definitions: DESIGN.md §3 and flt_diag.storage.metric_names). `LoopHooks` always removes its hooks; a
forward it was armed for (`arm()`) records every block output under (loop, layer), so a block reused K times
yields K records, and unarmed forwards (further micro-batches, evaluation, an activation checkpoint's
recomputation) record nothing. Supported: eager CPU/GPU, non-reentrant activation checkpointing (under a
reentrant one the activation gradients are not recorded: said once, listed in `not_recorded`), torch.compile of
the blocks (compile_blocks keeps the hooks outside compiled code), and DDP (hooks see each rank's micro-batch).
The errors a model the hooks cannot diagnose raises are here too (ProbeError and its kinds). Every hook runs
through the run's record guard (flt_diag.instruments.guard): a record that fails is said once and skipped, never
raised into the forward or the backward.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from flt_diag.records import Record, RecordContext
from flt_diag.records._streams import per_token_norms  # (shared with the records)
from flt_diag.storage import metric_names as M
from flt_diag.instruments.guard import ProbeError, Records, names_of
from flt_diag.instruments.record_checks import take_record


def token_norm(x: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of the L2 norm of x's last dim (the residual-stream norm of DESIGN.md §3)."""
    with torch.no_grad():
        return per_token_norms(x).mean()


def gradient_norm(g: torch.Tensor, scale: float) -> torch.Tensor:
    """||g|| * scale, an activation gradient's record (read in the backward)."""
    norm = torch.linalg.vector_norm(g.detach() if g.requires_grad else g)  # (a double backward's)
    return norm if scale == 1 else norm * scale  # (x 1 would be a kernel launch)


def token_norm_means(norms: list[torch.Tensor]) -> list[torch.Tensor]:
    """token_norm of each tensor whose per-token norms are `norms`, as 0-d tensors: one mean for each run of norms
    of one shape (one operation a forward where the stream keeps its shape, not one a loop: inside a training
    step each small reduction costs several times what it costs alone; benchmarks/README.md, seventh round)."""
    out: list[torch.Tensor] = []
    kind = [(x.shape, x.device, x.dtype) for x in norms]  # (a run: one shape, device and dtype)
    with torch.no_grad():
        while len(out) < len(norms):
            first, n = norms[len(out)], 1
            while len(out) + n < len(norms) and kind[len(out) + n] == kind[len(out)]:
                n += 1
            run = norms[len(out):len(out) + n]
            out += (torch.stack(run).reshape(n, -1).mean(1) if n > 1 else first.mean()[None]).unbind()
    return out


class BlocksNotFound(ProbeError):
    """The block list is empty, or names modules that are not in the model."""


class NotLooped(ProbeError):
    """No block was called more than once in a forward: nothing is looped."""


class BlockCalledTwice(ProbeError):
    """A block ran twice within one loop (called from two places), or out of the blocks' order."""


NOT_LOOPED_AFTER = 10  # flt_diag.watch: refused as not looped when none of its first 10 recorded forwards reuses a block
BUILTIN = "loop_end"  # the boundary of flt-diag's own model: `model.loop_end`
MANUAL = "manual"  # the loop ends where the user calls `LoopHooks.end_loop(stream)`


def first_tensor(output):
    """The residual stream in a block's output: the tensor itself, or the first tensor of a tuple
    (a Hugging Face layer may return (hidden_states, attention weights, ...))."""
    if torch.is_tensor(output):
        return output
    if isinstance(output, (tuple, list)) and output and torch.is_tensor(output[0]):
        return output[0]
    raise ProbeError(f"a block returned {type(output).__name__}; a block must return the residual stream "
                     "(a tensor, or a tuple whose first item is one)")


class LoopHooks:
    """Per-(loop, layer) residual norms, gradients w.r.t. block outputs, the records taken after each block.

    `root` is the module whose forward is one pass of the model; `blocks` (default `root.blocks`) are the blocks
    it reuses, layer i + 1 being blocks[i]. The loop counter is one of four strategies (`boundary`):
      * BUILTIN (default): `root.loop_end` ends each loop (flt-diag's own model);
      * a module: its forward ends each loop, its output is the loop-end stream;
      * MANUAL: the loop ends where `end_loop(stream)` is called;
      * None: counted from the blocks' own calls: the k-th call of block i in one forward is loop k
        (the blocks must run in their list's order, once per loop); the loop-end stream is the output
        of the last block.
    A block called twice within one loop raises BlockCalledTwice; with `require_repeat` n, NotLooped is raised
    when none of the first n recorded forwards ran a block twice (said on stderr at the first that did not: a
    model that samples its loop count may draw one loop; True counts as 1).

    Every hook and every function below is called through `records` (the run's guard, shared with the other
    instruments): a record that raises is skipped and named in `records.not_recorded`, the forward goes on.

    `log(metric, value_tensor, loop, layer)` receives every record (values stay on the device); `grad_scale`
    multiplies the recorded activation gradients (the trainer's grad_accum: the micro-batch's mean loss).
    Hook points for further records (e.g. the loop dynamics): `listeners` fn(loop, layer, stream) at every
    recorded block output, `on_loop_end` fn(loop, stream) at every recorded loop's end, `on_forward_end`
    fn(loops) at the end of each recorded forward; `block_records` (flt_diag.records: moment after_block), those
    in `due`, after every recorded block output."""

    def __init__(self, model, log, act_grads: bool = True, block_records: Sequence[Record] = (), *, blocks=None,
                 boundary=BUILTIN, names: list[str] | None = None, require_repeat: int = 0,
                 records: Records | None = None):
        self.model, self.log = model, log
        self.records = records if records is not None else Records()
        self.blocks = list(model.blocks if blocks is None else blocks)
        if not self.blocks:
            raise BlocksNotFound("the block list is empty; give the blocks the model's forward reuses")
        self.boundary = model.loop_end if isinstance(boundary, str) and boundary == BUILTIN else boundary
        self.names = names or [f"block {i + 1}" for i in range(len(self.blocks))]
        self.act_grads, self.require_repeat = act_grads, require_repeat
        self.block_records = list(block_records)  # (flt_diag.records, moment after_block)
        self.states: dict[Record, Any] = {}  # the records' states (those that keep one), made at their first call
        self.due = list(block_records)  # those of them the recorded forwards take (the diagnostics' schedule)
        self.context: RecordContext | None = None  # the step's, for those of context=True (the diagnostics set it)
        self.grad_scale = 1.0
        self.detached = 0  # loops 1..detached send no gradient (truncated backpropagation): recorded as 0
        self.listeners: list = []
        self.on_forward_end: list = []
        self.refuse = lambda error: error  # each refusal raised inside the forward goes through (the probe lets go)
        self.on_loop_end: list = []  # fn(loop, stream) with each loop's loop-end stream (the probe's loop dynamics)
        self.handles: list = []
        self._armed = self._active = self._checked = False
        self._unlooped = 0  # recorded forwards so far in which no block ran twice (before the first that did)
        self.loop = 0
        self.calls = [0] * len(self.blocks)
        self.pending: list[tuple[list[tuple[str, int, int]], torch.Tensor]] = []  # (_log_norms)

    def arm(self, on: bool = True) -> None:
        """Record during the next forward of the model only."""
        self._armed = on

    def __enter__(self) -> "LoopHooks":
        m, guard, counted = self.model, self.records.hook, (M.LOOPS_RUN,)
        self.handles += [m.register_forward_pre_hook(guard(counted, self._start)),
                         m.register_forward_hook(guard((M.RESID_NORM, M.RESID_NORM_LOOP_END), self._stop))]
        if isinstance(self.boundary, torch.nn.Module):
            self.handles.append(self.boundary.register_forward_hook(
                guard((M.RESID_NORM_LOOP_END,), lambda module, args, out: self.end_loop(out))))
        for i, block in enumerate(self.blocks):
            self.handles.append(block.register_forward_pre_hook(guard(counted, self._count_hook(i))))
            self.handles.append(block.register_forward_hook(guard((M.RESID_NORM,), self._block_hook(i + 1))))
            if self.act_grads and isinstance(getattr(block, "after_attn", None), torch.nn.Module):
                # the reference's per-loop attention output gradient, read where it is added
                self.handles.append(block.after_attn.register_forward_hook(guard(
                    (M.ACT_GRAD_NORM_ATTN,), self._output_grad_hook((M.ACT_GRAD_NORM_ATTN,), i + 1))))
            for record in self.block_records:
                self.handles.append(block.register_forward_hook(guard(tuple(record.metrics),
                                                                      self._record_hook(record, i + 1))))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self._active = self._armed = False
        self.pending = []

    def _start(self, module, args):
        self._active, self._armed = self._armed, False
        self._grad = torch.is_grad_enabled()
        self.loop = 1
        self.calls = [0] * len(self.blocks)
        self.seen: set[tuple[int, int]] = set()
        self.pending = []  # (keys, per-token norms) of this forward's block outputs and loop ends

    def _stop(self, module, args, output):
        if not self._active:
            return
        self._active = False
        loops = self.calls[-1] if self.boundary is None else self.loop - 1
        if self.require_repeat and not self._checked and max(self.calls) < 2:
            self._not_looped(type(module).__name__)
        self._checked = self._checked or max(self.calls) >= 2 or not self.require_repeat
        self.records.take((M.RESID_NORM, M.RESID_NORM_LOOP_END), self._log_norms)
        for fn in self.on_forward_end:
            self.records.take(names_of(fn), fn, loops)

    def _not_looped(self, model: str) -> None:
        """A recorded forward in which no block ran twice, before any that did: refused at the require_repeat-th."""
        self._unlooped += 1
        n, blocks = int(self.require_repeat), f"{', '.join(self.names[:3])}{', ...' if len(self.names) > 3 else ''}"
        if self._unlooped >= n:
            self.pending = []
            raise self.refuse(NotLooped(f"no block of {model} was called more than once in "
                                        f"{'a forward' if n == 1 else f'any of the first {n} recorded forwards'} "
                                        f"({blocks}): a looped model calls the same blocks several times; check "
                                        "blocks=, or give loop_boundary="))
        if self._unlooped == 1:
            print(f"flt_diag: no block of {model} ({blocks}) was called more than once in the first recorded forward "
                  f"(a sampled loop count of 1?): refused if none of the first {n} reuses one", file=sys.stderr,
                  flush=True)

    def _log_norms(self) -> None:
        """The forward's residual-stream norms (resid_norm, resid_norm_loop_end), from the per-token norms its block
        outputs and loop ends left, their means taken together (token_norm_means)."""
        pending, self.pending = self.pending, []
        for (keys, _), mean in zip(pending, token_norm_means([norms for _, norms in pending])):
            for metric, loop, layer in keys:
                self.log(metric, mean, loop, layer)

    def end_loop(self, stream: torch.Tensor) -> None:
        """The end of a loop (MANUAL boundary): records the loop-end stream, then counts the next loop."""
        if self._active:
            stream = first_tensor(stream)
            self.records.take((M.RESID_NORM_LOOP_END,), self._pend, [(M.RESID_NORM_LOOP_END, self.loop, M.NONE)],
                              stream)
            for fn in self.on_loop_end:
                self.records.take(names_of(fn), fn, self.loop, stream)
            self.loop += 1

    def _pend(self, keys: list[tuple[str, int, int]], stream: torch.Tensor) -> None:
        """A stream's per-token norms, kept for the forward's end (_log_norms) under `keys`."""
        self.pending.append((keys, per_token_norms(stream)))

    def _count_hook(self, i: int):
        """Forward pre-hook of block i: its loop (counted from calls, or the boundary's), checked."""
        def hook(module, args):
            if not self._active:
                return
            if self.boundary is None:
                expected = self.calls[i - 1] if i else self.calls[-1] + 1  # (before this call is counted)
                self.calls[i] += 1
                if self.calls[i] != expected:
                    raise self.refuse(BlockCalledTwice(
                        f"{self.names[i]} ran {self.calls[i]} times while {self.names[i - 1]} ran {self.calls[i - 1]} "
                        "times: counted from calls, the blocks must run in their list's order, once per loop (a "
                        "block called from two places? give loop_boundary=; two separate loops? give blocks= the "
                        "blocks of one)"))
                self.loop = self.calls[i]
                return
            self.calls[i] += 1
            if (self.loop, i) in self.seen:
                raise self.refuse(BlockCalledTwice(f"{self.names[i]} was called twice in loop {self.loop} (from two "
                                                    "places?); each block may run once per loop"))
            self.seen.add((self.loop, i))
        return hook

    def _block_hook(self, layer: int):
        # The block's output is x + a + m (a, m: attention and MLP outputs), so d(loss)/d(output) is also
        # d(loss)/d(m): one norm, recorded under both names.
        record_grad = self._output_grad_hook((M.ACT_GRAD_NORM, M.ACT_GRAD_NORM_MLP), layer)

        last = layer == len(self.blocks)

        def hook(module, args, output):
            if not self._active:
                return
            stream, take = first_tensor(output), self.records.take
            keys = [(M.RESID_NORM, self.loop, layer)]
            ends = last and self.boundary is None  # counted from calls: the last block's output ends the loop
            if ends:
                keys.append((M.RESID_NORM_LOOP_END, self.loop, M.NONE))
            take([k[0] for k in keys], self._pend, keys, stream)  # (their means at the forward's end: _log_norms)
            for fn in self.on_loop_end if ends else ():
                take(names_of(fn), fn, self.loop, stream)
            for fn in self.listeners:
                take(names_of(fn), fn, self.loop, layer, stream)
            if self.act_grads:
                take((M.ACT_GRAD_NORM, M.ACT_GRAD_NORM_MLP), record_grad, module, args, stream)
        return hook

    def _output_grad_hook(self, metrics: tuple[str, ...], layer: int):
        """Forward hook recording ||d(loss)/d(output)|| under (loop, layer), under each name of `metrics`. Read on
        the residual stream, outside the compiled halves: h = x + a has d(loss)/d(h) = d(loss)/d(a) exactly (an
        add passes its gradient through), and likewise the block output for the MLP output."""
        def hook(module, args, output):
            # a loop count per sequence (model/per_sequence.py): its first phase sends no gradient by design, and its
            # loops' indices are the phases' steps, so `detached` (loops 1..n of a K-loop forward) does not apply
            phase = getattr(self.model, "gradless_loops", None)
            if self._active and self._grad and not torch.is_grad_enabled() and phase is not True:
                self._without_grad(metrics, layer)
            if not self._active or not (output.requires_grad or phase is True):
                return
            loop, scale = self.loop, self.grad_scale
            if phase is True or (phase is None and loop <= self.detached):  # no gradient reaches it: recorded as 0
                zero = torch.zeros((), device=output.device)
                for metric in metrics:
                    self.log(metric, zero, loop, layer)
                return

            def record(g):
                norm = gradient_norm(g, scale)
                for metric in metrics:
                    self.log(metric, norm, loop, layer)
            output.register_hook(self.records.hook(metrics, record))  # (runs in the backward: guarded too)
        return hook

    def _without_grad(self, metrics: tuple[str, ...], layer: int) -> None:
        """A block of a forward with gradient ran without (a reentrant activation checkpoint): no gradient of its
        output is seen; its backward recomputes it outside the recorded forward."""
        why = (f"{self.names[layer - 1]} ran without gradient inside a forward with gradient (a reentrant activation "
               "checkpoint, torch.utils.checkpoint(..., use_reentrant=True)?): use use_reentrant=False")
        self.records.skip(metrics, why)

    def _record_hook(self, record: Record, layer: int):
        """Forward hook on a block: `record` (moment after_block, flt_diag.records), when due, at (loop, layer)."""
        def hook(module, args, output):
            if self._active and record in self.due:
                take_record(record, self.log, (module, args, output), self.states, self.loop, layer, self.context)
        return hook
