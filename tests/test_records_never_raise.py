"""No record raises into the user's forward, backward or training step (flt_diag.instruments.guard; docs/api.md,
"No record stops the training"). Each record of flt_diag.watch is made to fail by fault injection (its function
monkeypatched to raise), and a NaN stream makes the effective rank's eigendecomposition impossible: the training
runs every step, summary.json is written with the verdict (`diverged`: the last step's loss is NaN) and its
`not_recorded` names the record, said once on stderr. What head=, targets= and loop_step= return is checked at
the record; a step(loss=) too large for a float is recorded as inf, a sparse scalar densified. flt-diag's own
Trainer shares the guard: its records fail the same way and the run ends with its summary."""
import json
import math
from fractions import Fraction

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flt_diag
from conftest import tiny_config
from flt_diag.config.run_config import DiagnosticsConfig
from flt_diag.instruments import diagnostics, dynamics_callback, loop_hooks
from flt_diag.instruments import loop_dynamics as D
from flt_diag.instruments.diagnostics import DiagnosticsCallback
from flt_diag.instruments.dynamics_callback import LoopDynamicsCallback
from flt_diag.instruments.guard import MOMENTS, Instrument, recording
from flt_diag.instruments.loop_hooks import LoopHooks
from flt_diag.instruments.warning_callback import CollapseWarning
from flt_diag.integrations import moments
from flt_diag.integrations.loop_probe import LoopProbe
from flt_diag.integrations.moments import ProbeMoments
from flt_diag.records import attention as ATTENTION
from flt_diag.records import exit_loss as EXIT
from flt_diag.records import fixed_point_residual as RESIDUAL
from flt_diag.records import token_similarity as SIMILARITY
from flt_diag.storage import metric_names as M
from flt_diag.storage.folders import load_metrics
from flt_diag.training import trainer

V, D_, B, T = 16, 8, 2, 4
ALL = DiagnosticsConfig(exit_loss_every=1, dynamics_every=1, dynamics_batch=1, krylov_dim=2, dynamics_iters=1,
                        perturbation_dirs=1)  # every record, every step
LOOP_MAP = (M.LOOP_GAIN, M.LOOP_SPECTRAL_RADIUS, M.LOOP_SPECTRAL_RESIDUAL, M.LOOP_MEAN_GAIN,
            M.LOOP_PERTURBATION_GROWTH)
GROUPED = (M.GRAD_NORM, M.GRAD_NORM_CLIPPED, M.UPDATE_RATIO, M.PARAM_NORM)  # (per parameter group: "<metric>/<group>")


class Core(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_, D_)

    def forward(self, h, e):
        return torch.tanh(self.lin(h) + e) + 0.5 * h


class Huginn(nn.Module):
    """A Huginn-style recurrent-depth toy: a prelude (the embedding), one core block looped with the embedding
    injected at every loop, a coda (the head)."""

    def __init__(self, loops: int = 3):
        super().__init__()
        self.loops, self.embed, self.core, self.head = loops, nn.Embedding(V, D_), Core(), nn.Linear(D_, V)

    def forward(self, x):
        e = self.embed(x)
        h = torch.zeros_like(e)
        for _ in range(self.loops):
            h = self.core(h, e)
        return self.head(h)


def injected(*args, **kwargs):
    raise RuntimeError("injected fault")


def injected_once(original):
    """`original`, but raising at its first call (a record without which the verdict has no loss at all)."""
    calls = []

    def fn(*args, **kwargs):
        calls.append(1)
        return injected() if len(calls) == 1 else original(*args, **kwargs)
    return fn


@recording(M.LOOPS_RUN)
def injected_count(*args, **kwargs):
    raise RuntimeError("injected fault")


def my_record(loop, layer, stream):  # a record of the user's own (probe.hooks.listeners)
    raise RuntimeError("injected fault")


def train(folder, steps=3, nan_loss_at=2, nan_weights_at=None, given_loss=True, listener=None, **options):
    """The plain loop on the toy, every record on (ALL) unless options say; the last step's loss given as NaN.
    Returns (steps done, the summary, summary.json as stored)."""
    torch.manual_seed(0)
    model = Huginn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    options = {"diagnostics": ALL, "head": model.head, "targets": lambda x: x,
               "loop_step": lambda h: model.core(h, torch.zeros_like(h)), **options}
    probe = flt_diag.watch(model, blocks=[model.core], folder=folder, optimizer=opt, **options)
    if listener is not None:
        probe.hooks.listeners.append(listener)
    done = []
    for i in range(steps):
        if i == nan_weights_at:
            with torch.no_grad():
                model.core.lin.weight.fill_(math.nan)
        x = torch.randint(0, V, (B, T), generator=g)
        loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        probe.step(loss=(math.nan if i == nan_loss_at else loss) if given_loss else None)
        opt.zero_grad()
        done.append(i)
    summary = probe.close()
    return done, summary, json.loads((folder / "summary.json").read_text())


def said(err: str) -> list[list[str]]:
    """The record names of each 'not recorded' line on stderr."""
    return [line.split(": ", 1)[1].split(" not recorded")[0].split(", ") for line in err.splitlines()
            if line.startswith("flt_diag: ") and " not recorded" in line]


def check_went_on(done, summary, stored, names, words, err, steps=3, verdict="diverged"):
    assert done == list(range(steps)) and stored["steps_done"] == steps  # the training ran every step
    assert summary.verdict == stored["verdict"] == verdict  # the summary is written with its verdict
    not_recorded = stored["evidence"]["not_recorded"]
    for name in names:
        assert words in not_recorded[name], (name, not_recorded)
        assert sum(name in line for line in said(err)) == 1, (name, err)  # said once


# (where, what, the record names it takes, watch options): each record's function made to raise
FAULTS = {
    "resid_norm per token": (loop_hooks, "per_token_norms", (M.RESID_NORM, M.RESID_NORM_LOOP_END), {}),
    "resid_norm means": (loop_hooks, "token_norm_means", (M.RESID_NORM, M.RESID_NORM_LOOP_END), {}),
    "act_grad_norm, forward": (LoopHooks, "_output_grad_hook", (M.ACT_GRAD_NORM, M.ACT_GRAD_NORM_MLP), "factory"),
    "act_grad_norm, backward": (loop_hooks, "gradient_norm", (M.ACT_GRAD_NORM, M.ACT_GRAD_NORM_MLP), {}),
    "loops_run": (LoopProbe, "_count_loops", (M.LOOPS_RUN,), "count"),
    "gradient squares": (diagnostics, "segment_squares", ("grad_norm/<group>", "grad_norm_clipped/<group>",
                                                          "update_ratio/<group>"), {}),
    "gradient pairs": (diagnostics, "pair_sums", ("grad_norm/<group>", M.GRAD_COSINE, M.SIGN_FLIP), {}),
    "cosines and flips": (diagnostics, "consecutive_stats", ("grad_norm/<group>", M.GRAD_COSINE, M.SIGN_FLIP), {}),
    "parameters kept": (DiagnosticsCallback, "_keep_before", ("update_ratio/<group>", "param_norm/<group>"), {}),
    "token_cosine": (SIMILARITY, "token_cosine_per_sequence", (M.TOKEN_COSINE,), {}),
    "effective_rank": (SIMILARITY, "effective_rank_per_sequence", (M.EFFECTIVE_RANK,), {}),
    "exit_loss": (EXIT, "exit_loss", (M.EXIT_LOSS,), {}),
    "targets": (EXIT, "checked_targets", (M.EXIT_LOSS,), {}),
    "fixed_point_residual per loop": (RESIDUAL, "keep", (M.FIXED_POINT_RESIDUAL,), {}),
    "fixed_point_residual ratios": (RESIDUAL, "ratios", (M.FIXED_POINT_RESIDUAL,), {}),
    "loop map": (D, "loop_map_records", LOOP_MAP, {}),
    "early warning": (CollapseWarning, "_keep", ("early_warning",), {}),
    "grad_norm, total": (ProbeMoments, "_total_norm", (M.GRAD_NORM,), {"diagnostics": DiagnosticsConfig(dense_steps=1, record_every=3)}),
    "grad_norm, grad_hooks": (moments, "gradient_norm", (M.GRAD_NORM,), {"grad_hooks": True}),
    "loss of loss=": (ProbeMoments, "_mean_loss", (M.LOSS,), {"loss": lambda out: out.mean(), "given_loss": False,
                                                              "nan_weights_at": 2, "once": True}),
    "a record of the user's own": (None, None, ("my_record",), {"listener": my_record}),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_record_that_raises_is_skipped_named_and_the_training_goes_on(tmp_path, monkeypatch, capfd, fault):
    where, name, names, options = FAULTS[fault]
    if options == "factory":  # (the hook LoopHooks makes, raising)
        monkeypatch.setattr(where, name, lambda self, metrics, layer: injected)
    elif options == "count":
        monkeypatch.setattr(where, name, injected_count)
    elif where is not None:
        once = isinstance(options, dict) and options.get("once")
        monkeypatch.setattr(where, name, injected_once(getattr(where, name)) if once else injected)
    options = {k: v for k, v in options.items() if k != "once"} if isinstance(options, dict) else {}
    done, summary, stored = train(tmp_path / "run", **options)
    check_went_on(done, summary, stored, names, "RuntimeError: injected fault", capfd.readouterr().err)


def test_every_record_is_made_to_fail_by_one_fault_above(tmp_path):
    """The faults above reach every record a run takes: each metric of a run with every record on (and each
    parameter group's) is named by one of them, but the lr the optimizer gives."""
    train(tmp_path / "run")
    named = {n for _, _, names, _ in FAULTS.values() for n in names}
    for metric in set(load_metrics(tmp_path / "run").metric) - {M.LR}:
        base, _, group = metric.partition("/")
        key = f"{base}/<group>" if group and base in GROUPED else base if base in (M.GRAD_COSINE, M.SIGN_FLIP) \
            else metric
        assert key in named, metric


def test_a_nan_stream_skips_the_effective_rank_and_the_run_ends_diverged(tmp_path, capfd):
    """The issue's run: the weights turn NaN at step 1, watched without stop_on_collapse; at each exit-loss step
    linalg.eigh cannot take the NaN stream. The run goes on to its end, its verdict diverged."""
    cfg = DiagnosticsConfig(exit_loss_every=2)
    done, summary, stored = train(tmp_path / "run", steps=5, nan_loss_at=None, nan_weights_at=1, warn=True,
                                  diagnostics=cfg)
    err = capfd.readouterr().err
    check_went_on(done, summary, stored, (M.EFFECTIVE_RANK,), "the loop-end stream is not finite", err, steps=5)
    assert summary.evidence.nonfinite_step == 1 and "the loss is nan at step 1" in err
    df = load_metrics(tmp_path / "run")
    ranks = df[df.metric == M.EFFECTIVE_RANK]
    assert set(ranks.step) == {0}  # taken where the stream is finite, skipped where it is not
    assert ranks.value.between(1, min(T, D_)).all()


# (watch options, a step() targets, the record skipped, the words of why): what the user's functions return
BAD_RETURNS = {
    "head= a tuple": (dict(head=lambda h: (h,)), None, M.EXIT_LOSS, "head= gave tuple"),
    "head= too few classes": (dict(head=lambda h: torch.zeros(*h.shape[:-1], 3)), None, M.EXIT_LOSS,
                              "outside the 3 classes"),
    "head= integer logits": (dict(head=lambda h: torch.zeros(*h.shape[:-1], V, dtype=torch.long)), None,
                             M.EXIT_LOSS, "torch.int64 logits"),
    "head= one row for all": (dict(head=lambda h: torch.zeros(V)), None, M.EXIT_LOSS, "one row of class scores"),
    "targets= float": (dict(targets=lambda x: x.float()), None, M.EXIT_LOSS, "torch.float32 targets"),
    "targets= a tuple": (dict(targets=lambda x: (x, x)), None, M.EXIT_LOSS, "targets= gave tuple"),
    "targets= an int": (dict(targets=lambda x: 3), None, M.EXIT_LOSS, "targets= gave int"),
    "targets= out of range": (dict(targets=lambda x: x + V), None, M.EXIT_LOSS, f"outside the {V} classes"),
    "targets= negative": (dict(targets=lambda x: x - V), None, M.EXIT_LOSS, f"outside the {V} classes"),
    "targets= another shape": (dict(targets=lambda x: x[:, :2]), None, M.EXIT_LOSS, "do not fit the loop-end stream"),
    "step(targets=) a tuple": (dict(targets=None), (1, 2), M.EXIT_LOSS, "step(targets=) gave tuple"),
    "loop_step= a tuple": (dict(loop_step=lambda h: (h,)), None, M.LOOP_GAIN, "loop_step= gave tuple"),
    "loop_step= an int": (dict(loop_step=lambda h: 1), None, M.LOOP_GAIN, "loop_step= gave int"),
    "loop_step= another shape": (dict(loop_step=lambda h: h[..., :2]), None, M.LOOP_GAIN,
                                 "loop_step= gave a tensor of shape (1, 4, 2)"),
}


@pytest.mark.parametrize("case", BAD_RETURNS)
def test_what_head_targets_and_loop_step_return_is_checked_at_the_record(tmp_path, monkeypatch, capfd, case):
    options, step_targets, name, words = BAD_RETURNS[case]
    if step_targets is not None:  # step(targets=...) given at each step
        original = LoopProbe.step
        monkeypatch.setattr(LoopProbe, "step", lambda self, loss=None, step=None, targets=None:
                            original(self, loss, step, step_targets))
    done, summary, stored = train(tmp_path / "run", **options)
    check_went_on(done, summary, stored, (name,), words, capfd.readouterr().err)
    assert not (load_metrics(tmp_path / "run").metric == name).any()


def test_targets_with_ignored_positions_are_taken(tmp_path):
    """-100 marks a position the exit loss leaves out, as F.cross_entropy does: not out of range."""
    train(tmp_path / "run", targets=lambda x: x.masked_fill(x % 2 == 0, -100))
    assert (load_metrics(tmp_path / "run").metric == M.EXIT_LOSS).sum() == 3 * 3  # 3 steps, 3 loops


@pytest.mark.parametrize("given, stored", [(10**400, math.inf), (-10**400, -math.inf), (Fraction(10**400, 3), math.inf),
                                           (torch.tensor([[2.5]]).to_sparse(), 2.5),
                                           (torch.tensor([[2.5]]).to_sparse_csr(), 2.5)])
def test_a_loss_too_large_for_a_float_is_inf_and_a_sparse_scalar_its_value(tmp_path, given, stored):
    model = Huginn()
    with flt_diag.watch(model, blocks=[model.core], folder=tmp_path / "run") as probe:
        model(torch.zeros(B, T, dtype=torch.long)).sum().backward()
        probe.step(loss=given)
    df = load_metrics(tmp_path / "run")
    assert df[df.metric == M.LOSS].value.tolist() == [stored]
    assert probe.summary.verdict == ("diverged" if math.isinf(stored) else probe.summary.verdict)


def test_a_nested_tensor_as_the_loss_is_one_probe_error_line(tmp_path):
    model = Huginn()
    with flt_diag.watch(model, blocks=[model.core], folder=tmp_path / "run") as probe:
        model(torch.zeros(B, T, dtype=torch.long)).sum().backward()
        with pytest.raises(flt_diag.ProbeError) as e:
            probe.step(loss=torch.nested.nested_tensor([torch.ones(2)]))
        assert "step(loss=...) gave a nested tensor" in str(e.value) and "\n" not in str(e.value)
        probe.step(loss=1.0)  # (the refused call recorded nothing: the corrected one is the step)
    assert load_metrics(tmp_path / "run").query("metric == 'loss'").value.tolist() == [1.0]


def test_every_hook_on_a_watched_model_and_every_moment_is_guarded(tmp_path):
    """The guard cannot be forgotten: each hook flt-diag registers on the model (forward, pre-forward, gradient)
    runs through it, but the probe's own two (its refusals: they let go of the model, then raise); each per-step
    moment of an Instrument is wrapped."""
    model = Huginn()
    probe = flt_diag.watch(model, blocks=[model.core], folder=tmp_path / "run", head=model.head,
                           targets=lambda x: x, loop_step=lambda h: h, grad_hooks=True, loop_boundary=model.core)
    hooks = [h for m in model.modules() for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())]
    hooks += [h for p in model.parameters() for h in p._post_accumulate_grad_hooks.values()]
    own = [h for h in hooks if getattr(h, "__func__", None) in (LoopProbe._begin_forward, LoopProbe._end_forward)]
    assert len(own) == 2 and len(hooks) > 2 + len(list(model.parameters()))
    assert all(getattr(h, "guarded_by", None) is probe.records for h in hooks if h not in own)
    for cls in (DiagnosticsCallback, LoopDynamicsCallback, CollapseWarning):
        assert issubclass(cls, Instrument)
        assert all(getattr(getattr(cls, m), "guarded_moment", False) for m in MOMENTS if m in vars(cls))
    probe.close()


def test_the_trainers_records_share_the_guard(tmp_path, monkeypatch, capfd):
    """flt-diag's own model and Trainer: the records only it takes (the attention statistics, the loop map of its
    own model, the per-loop gradient agreement, the sharpness, the attention output's gradient) made to fail at
    once: the run ends with its summary, each said once."""
    monkeypatch.setattr(LoopHooks, "_record_hook", lambda self, record, layer: injected)  # (the attention's)
    for where, name in ((D, "loop_map_stats"), (D, "loop_gradient_agreement"), (dynamics_callback, "sharpness"),
                        (loop_hooks, "gradient_norm")):
        monkeypatch.setattr(where, name, injected)
    cfg = tiny_config(loops=2, steps=3, diagnostics=dict(attention_stats=True, dynamics_every=1, sharpness_every=1,
                                                         exit_loss_every=1, dynamics_batch=1, krylov_dim=2,
                                                         dynamics_iters=1, perturbation_dirs=1))
    summary = trainer.train(cfg, tmp_path / "run")
    err = capfd.readouterr().err
    assert summary.steps_done == 3 and (tmp_path / "run" / "summary.json").exists()
    names = [n for line in said(err) for n in line]
    for name in (ATTENTION.MAX_LOGIT, ATTENTION.ENTROPY, *LOOP_MAP, M.LOOP_GRAD_COSINE, M.SHARPNESS, M.ACT_GRAD_NORM,
                 M.ACT_GRAD_NORM_ATTN):
        assert names.count(name) == 1, (name, err)
    assert (load_metrics(tmp_path / "run").metric == M.EFFECTIVE_RANK).any()  # the others still taken
    written = json.loads((tmp_path / "run" / "summary.json").read_text())["evidence"]["not_recorded"]
    for name in (ATTENTION.ENTROPY, M.LOOP_GRAD_COSINE, M.SHARPNESS):  # named in the summary, as a watch run's are
        assert name in written and "injected fault" in written[name], written
    from flt_diag.judge.verdict import resummarize
    assert resummarize(tmp_path / "run").evidence.not_recorded == written  # and kept when the run is re-judged


def test_records_taken_together_that_fail_alike_are_said_in_one_line_each_why(capsys):
    """The guard's take_all (the records of one loop end): failures grouped by why, one stderr line per why naming
    every record it skips, in the order first met; a record that works is taken; a ProbeError goes through."""
    from flt_diag.instruments.guard import ProbeError, Records, Skipped
    from flt_diag.records import Unrecordable
    taken = []

    def fails(why):
        def f(*args):
            raise Unrecordable(why)
        return f

    def skips(*args):
        raise Skipped({"c1": "a stream of the wrong shape", "c2": "no targets"})

    guard = Records()
    guard.take_all([(("a",), fails("a stream of the wrong shape"), ()), (("b",), lambda x: taken.append(x), (7,)),
                    (("c1", "c2"), skips, ()), (("d",), fails("no targets"), ())])
    lines = capsys.readouterr().err.strip().splitlines()
    assert taken == [7] and len(lines) == 2
    assert lines[0].startswith("flt_diag: a, c1 not recorded: a stream of the wrong shape; skipped where")
    assert lines[1].startswith("flt_diag: c2, d not recorded: no targets; skipped where")
    with pytest.raises(ProbeError):
        guard.take_all([(("e",), lambda: (_ for _ in ()).throw(ProbeError("refused")), ())])
