"""Reliability, round four (issue 44): what watch() and probe.step() are given is checked where it comes in;
a refusal leaves nothing to clean up; the Hugging Face callback lets go of the model when train() raises;
replays follow the rows stored; the analysis scripts write as flt-diag does; and the partial cases
(pooling a map, a refused output, a refused resume, Lightning's skipped batch, a second step(), huge
losses, a linked top folder). Each one is one ProbeError line (API) or one `error:` line and a non-zero
exit (CLI), and leaves what was already written as it was."""
import json
import math
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn as nn

import flt_diag
from conftest import tiny_config, within
from cli_errors import one_error_line
from fake_runs import make_run, make_sweep
from probe_models import D, T, UniversalTransformer, batches, hf_fit, lightning_fit, lightning_module, lm_loss
from flt_diag.cli import main
from flt_diag.storage import metric_names as M
from flt_diag.storage.folders import CONFIG, SUMMARY, MetricsWriter, StorageError, folder_lock, load_metrics, write_json
from flt_diag.instruments.callbacks import Callback

REPO = Path(__file__).resolve().parents[1]


def _one_probe_error(excinfo, words: str) -> None:
    text = str(excinfo.value)
    assert type(excinfo.value).__name__ == "ProbeError" and "\n" not in text and words in text, text


def _files(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _hooks(model: nn.Module) -> int:
    """flt-diag's hooks on the model: forward (pre-)hooks of its modules, gradient hooks of its parameters."""
    found = [h for m in model.modules() for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())]
    found += [h for p in model.parameters() for h in (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values()]
    return sum(getattr(h, "__module__", "").startswith("flt_diag") for h in found)


def _train(model, folder, steps=3, loss_of=None, step_of=None, **options):
    """The plain loop of docs/api.md; loss_of / step_of give step()'s arguments."""
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    with flt_diag.watch(model, blocks=[model.layer], folder=folder, optimizer=opt, **options) as probe:
        for i, x in enumerate(batches(steps)):
            loss = lm_loss(model(x), x)
            loss.backward()
            opt.step()
            probe.step(loss=loss_of(loss) if loss_of else loss, step=step_of(i) if step_of else None)
            opt.zero_grad()
    return probe


# ---------------------------------------------------------------- watch() and step() check what they are given

with torch.device("meta"):
    META = UniversalTransformer(loops=3)

BAD_WATCH = {  # keyword -> (value, words of the one line)
    "optimizer": (object(), "has no param_groups"),
    "optimizer ": (types.SimpleNamespace(param_groups=[]), "has no parameter group"),
    "optimizer  ": (types.SimpleNamespace(param_groups=[{"params": []}]), "holds no learning rate"),
    "loss": (3, "loss= is a function of the model's output"),
    "callbacks": ([object()], "callbacks= item 1 (object) is not an flt-diag training callback"),
    "callbacks ": (Callback(), "callbacks= is a list"),
    "steps": (2**70, "watch(steps=1180591620717411303424)"),
    "seed": (-1, "watch(seed=-1)"),
    "grad_scale": (math.nan, "watch(grad_scale=nan)"),
    "diagnostics": ({"every": 3}, "diagnostics= is a flt_diag.config.run_config.DiagnosticsConfig"),
    "loop_boundary": ("end", "loop_boundary= is a module whose forward ends each loop, or 'manual'"),
    "head": (3, "head= is a module or function of the loop-end stream"),
    "loop_step": (3, "loop_step= is a function of one loop-end stream"),
    "targets": ("y", "targets= is a function of the forward's arguments"),
    "scheduler": (3, "scheduler= is a learning-rate scheduler"),
    "predictor_path": ("/nonexistent/p.json", "predictor_path='/nonexistent/p.json': no such predictor file"),
}


@pytest.mark.parametrize("keyword", list(BAD_WATCH))
def test_watch_refuses_a_keyword_of_the_wrong_kind_before_anything_is_made(tmp_path, keyword):
    value, words = BAD_WATCH[keyword]
    model = UniversalTransformer(loops=3)
    with pytest.raises(flt_diag.ProbeError) as e:
        flt_diag.watch(model, blocks=[model.layer], folder=tmp_path / "run", **{keyword.strip(): value})
    _one_probe_error(e, words)
    assert not (tmp_path / "run").exists() and _hooks(model) == 0


def test_watch_refuses_a_model_on_the_meta_device(tmp_path):
    with pytest.raises(flt_diag.ProbeError) as e:
        flt_diag.watch(META, blocks=[META.layer], folder=tmp_path / "run")
    _one_probe_error(e, "UniversalTransformer.embed.weight is on the meta device")
    assert not (tmp_path / "run").exists()


BAD_STEP = {  # step(loss=..., step=...) -> words of the one line
    "a generator": (dict(loss=lambda l: (v for v in [l])), "step(loss=...) gave generator"),
    "a string": (dict(loss=lambda l: "2.3"), "step(loss=...) gave str"),
    "a per-token vector": (dict(loss=lambda l: l.expand(4, T)), "a tensor of 32 values (shape (4, 8))"),
    "step 2**70": (dict(step=lambda i: 2**70), "step(step=1180591620717411303424): a step number from 0 to"),
    "step -1": (dict(step=lambda i: -1), "step(step=-1)"),
    "step 1.5": (dict(step=lambda i: 1.5), "an integer; not float"),
    "a step number again": (dict(step=lambda i: 0), "step(step=0) comes after step 0 was recorded"),
}


@pytest.mark.parametrize("case", list(BAD_STEP))
def test_step_refuses_a_wrong_argument_and_records_nothing_of_it(tmp_path, case):
    """The refused call changes nothing: the corrected call records the step as if the bad one never came."""
    given, words = BAD_STEP[case]
    torch.manual_seed(0)
    model = UniversalTransformer(loops=3)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    with flt_diag.watch(model, blocks=[model.layer], folder=tmp_path / "run", optimizer=opt) as probe:
        for i, x in enumerate(batches(2)):
            loss = lm_loss(model(x), x)
            loss.backward()
            opt.step()
            if i == 1:
                with pytest.raises(flt_diag.ProbeError) as e:
                    probe.step(loss=given["loss"](loss) if "loss" in given else loss,
                               step=given["step"](i) if "step" in given else None)
                _one_probe_error(e, words)
            rows = probe.step(loss=loss)
            assert {r[0] for r in rows} == {i}
            opt.zero_grad()
    df = load_metrics(tmp_path / "run")
    assert sorted(set(df.step)) == [0, 1] and (df[df.metric == M.LOSS].groupby("step").size() == 1).all()
    assert df[df.metric == M.LR].value.tolist() == pytest.approx([1e-3, 1e-3])


def test_a_loss_function_that_gives_no_loss_is_one_line_and_lets_go_of_the_model(tmp_path):
    model = UniversalTransformer(loops=3)
    x = batches(1)[0]
    probe = flt_diag.watch(model, blocks=[model.layer], folder=tmp_path / "run", loss=lambda out: out.mean(-1))
    with pytest.raises(flt_diag.ProbeError) as e:
        model(x)  # (no `with`: the probe lets go by itself)
    _one_probe_error(e, "the loss= function of watch() gave a tensor of 32 values")
    assert _hooks(model) == 0 and not (tmp_path / "run").exists()
    del probe


# ---------------------------------------------------------------- a refusal leaves nothing to clean up

class Unlooped(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.layer, self.head = nn.Embedding(32, D), nn.Linear(D, D), nn.Linear(D, 32)

    def forward(self, x):
        return self.head(self.layer(self.embed(x)))


@pytest.mark.parametrize("with_block", [True, False])
def test_a_refusal_at_the_first_forward_leaves_no_folder_and_the_retry_works(tmp_path, with_block):
    """blocks="auto" on forwards that reuse nothing: refused at the NOT_LOOPED_AFTER-th, nothing written."""
    from flt_diag.instruments.loop_hooks import NOT_LOOPED_AFTER
    folder, x = tmp_path / "run", batches(1)[0]
    model = Unlooped()
    model.blocks = nn.ModuleList([model.layer])  # (the list auto falls back to)
    with pytest.raises(flt_diag.NotLooped):
        if with_block:
            with flt_diag.watch(model, folder=folder) as probe:
                for _ in range(NOT_LOOPED_AFTER):
                    probe.step(loss=lm_loss(model(x), x))
        else:
            probe = flt_diag.watch(model, folder=folder)
            for _ in range(NOT_LOOPED_AFTER):
                probe.step(loss=lm_loss(model(x), x))
    assert not folder.exists() and _hooks(model) == 0
    with folder_lock(folder):  # the lock is free
        pass
    probe = _train(UniversalTransformer(loops=3), folder, steps=2)  # the corrected retry, same folder
    assert probe.summary is not None and (folder / SUMMARY).exists()


def test_given_blocks_that_never_loop_are_refused_at_the_tenth_recorded_forward_and_the_rows_stay(tmp_path, capsys):
    """Given blocks: a first forward that reuses none (a sampled loop count of 1?) is said, not refused; none of
    the first NOT_LOOPED_AFTER recorded forwards reusing one is refused, the hooks gone, the steps' rows kept."""
    from flt_diag.instruments.loop_hooks import NOT_LOOPED_AFTER
    model, folder = Unlooped(), tmp_path / "run"
    opt = torch.optim.SGD(model.parameters(), 0.1)
    done = 0
    with pytest.raises(flt_diag.NotLooped, match=f"any of the first {NOT_LOOPED_AFTER} recorded forwards"):
        with flt_diag.watch(model, blocks=[model.layer], folder=folder, optimizer=opt) as probe:
            for x in batches(NOT_LOOPED_AFTER + 2):
                loss = lm_loss(model(x), x)
                loss.backward()
                opt.step()
                probe.step(loss=loss)
                opt.zero_grad()
                done += 1
    assert done == NOT_LOOPED_AFTER - 1 and _hooks(model) == 0
    assert capsys.readouterr().err.count("was called more than once in the first recorded forward") == 1
    assert sorted(load_metrics(folder).step.unique()) == list(range(done)) and not (folder / SUMMARY).exists()


def test_a_refusal_at_the_first_step_leaves_no_folder(tmp_path):
    folder = tmp_path / "run"
    with pytest.raises(flt_diag.ProbeError):
        _train(UniversalTransformer(loops=3), folder, loss_of=lambda l: "nan")
    assert not folder.exists()
    made = tmp_path / "made"
    made.mkdir()  # a folder the user made, empty: left as it was found
    with pytest.raises(flt_diag.ProbeError):
        _train(UniversalTransformer(loops=3), made, loss_of=lambda l: object())
    assert made.is_dir() and not any(made.iterdir())


def test_the_rows_taken_before_an_exception_stay(tmp_path):
    def loss_of(loss, seen=[]):
        seen.append(1)
        if len(seen) == 3:
            raise KeyboardInterrupt
        return loss
    with pytest.raises(KeyboardInterrupt):
        _train(UniversalTransformer(loops=3), tmp_path / "run", steps=4, loss_of=loss_of)
    assert sorted(set(load_metrics(tmp_path / "run").step)) == [0, 1]
    assert not (tmp_path / "run" / SUMMARY).exists()


def test_a_folder_whose_lock_is_a_fifo_is_one_probe_error(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    os.mkfifo(folder / ".lock")
    with pytest.raises(flt_diag.ProbeError) as e:
        flt_diag.watch(UniversalTransformer(loops=3), blocks="layer", folder=folder)
    assert "\n" not in str(e.value) and str(folder) in str(e.value)


# ---------------------------------------------------------------- a second step() for one optimizer step

def test_a_second_step_for_one_optimizer_step_is_refused(tmp_path):
    model = UniversalTransformer(loops=3)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    with flt_diag.watch(model, blocks=[model.layer], folder=tmp_path / "run", optimizer=opt) as probe:
        x = batches(1)[0]
        loss = lm_loss(model(x), x)
        loss.backward()
        opt.step()
        probe.step(loss=loss)
        with pytest.raises(flt_diag.ProbeError) as e:
            probe.step(loss=loss)
        _one_probe_error(e, "step() came without a training forward of the model since step 0 was recorded")
    assert sorted(set(load_metrics(tmp_path / "run").step)) == [0]


# ---------------------------------------------------------------- the Hugging Face callback's exception path

class Raising(nn.Module):
    """Looped GPT-2 blocks whose forward raises at its `at`-th call."""

    def __init__(self, at: int):
        super().__init__()
        from probe_models import looped_gpt2
        self.inner, self.at, self.calls = looped_gpt2(loops=2), at, 0

    def forward(self, input_ids, labels=None):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("the model broke")
        return self.inner(input_ids, labels)


def test_the_hugging_face_callback_lets_go_when_the_model_raises(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from flt_diag.integrations.hf import FltDiagCallback
    torch.manual_seed(0)
    model = Raising(at=4)
    cb = FltDiagCallback(blocks="inner.gpt.transformer.h.*", folder=tmp_path / "hf", head=model.inner.gpt.lm_head)
    with pytest.raises(RuntimeError, match="the model broke"):
        hf_fit(model, [cb], tmp_path / "out", steps=5)
    assert _hooks(model) == 0 and "forward" not in model.__dict__  # every hook gone, the forward its own again
    with folder_lock(tmp_path / "hf"):  # the lock is free
        pass
    assert sorted(set(load_metrics(tmp_path / "hf").step)) == [0, 1, 2] and not (tmp_path / "hf" / SUMMARY).exists()
    model.at = 0  # the notebook's next train(), with the same callback: into a new folder, recorded in full
    cb.folder = tmp_path / "hf2"
    hf_fit(model, [cb], tmp_path / "out", steps=2)
    assert sorted(set(load_metrics(tmp_path / "hf2").step)) == [0, 1] and cb.summary is not None
    assert _hooks(model) == 0 and "forward" not in model.__dict__


def test_the_hugging_face_callback_closes_a_probe_left_open(tmp_path):
    """An exception outside the model's forward (here: raised by a callback after the first step) reaches no
    callback; the train() it leaves (wrapped at on_init_end) lets go of the model and the folder, close() after
    it has nothing left to do."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from flt_diag.integrations.hf import FltDiagCallback

    class Boom(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            raise ValueError("elsewhere")
    torch.manual_seed(0)
    model = Raising(at=0)
    cb = FltDiagCallback(blocks="inner.gpt.transformer.h.*", folder=tmp_path / "hf", head=model.inner.gpt.lm_head)
    with pytest.raises(ValueError, match="elsewhere"):
        hf_fit(model, [cb, Boom()], tmp_path / "out", steps=3)
    assert _hooks(model) == 0  # (no callback heard of it: the train() wrapper let go)
    cb.close()
    assert _hooks(model) == 0 and "forward" not in model.__dict__
    with folder_lock(tmp_path / "hf"):
        pass
    assert sorted(set(load_metrics(tmp_path / "hf").step)) == [0]


# ---------------------------------------------------------------- Lightning: a skipped batch

def test_lightning_skips_a_batch_whose_training_step_returns_none(tmp_path):
    pytest.importorskip("lightning")
    from flt_diag.integrations.lightning import FltDiagCallback
    torch.manual_seed(0)
    callback = FltDiagCallback(blocks="net.layer", folder=tmp_path / "pl")
    lightning_fit(lightning_module(loops=3, skip=1), callback, steps=4, n_batches=5)  # batch 1: None
    df = load_metrics(tmp_path / "pl")
    recorded = sorted(set(df[df.metric == M.LOSS].step))
    assert len(recorded) == 3 and callback.summary is not None  # the fit went on; the skipped batch is no step
    assert (df.groupby(["step", "metric", "loop", "layer"]).size() == 1).all()


# ---------------------------------------------------------------- replays follow the rows stored

def _claims(run: Path, steps: int) -> None:
    """A run folder from elsewhere whose summary and config claim `steps` steps, with one more row at step
    `steps - 1` (a gradient norm and a loss: what a crafted folder may hold)."""
    s = json.loads((run / SUMMARY).read_text())
    write_json(run / SUMMARY, {**s, "steps_done": steps, "steps": steps})
    cfg = json.loads((run / CONFIG).read_text())
    cfg["train"]["steps"] = steps
    write_json(run / CONFIG, cfg)
    w = MetricsWriter(run)
    w.extend([(steps - 1, M.LOSS, M.NONE, M.NONE, 3.0), (steps - 1, M.GRAD_NORM, M.NONE, M.NONE, 1.0)])
    w.flush()


def test_predict_online_follows_the_rows_stored(tmp_path, capsys):
    from flt_diag.judge import early_warning as EW
    from flt_diag.storage.files import load_predictor
    run = make_run(tmp_path / "run", "lt", 3, collapsed=True)
    stored = load_metrics(run)
    last = int(stored.step.max())
    _claims(run, 10**12)
    with within(120):
        assert main(["predict", str(run), "--online", "--csv", str(tmp_path / "b.csv")]) == 0
    got = pd.read_csv(tmp_path / "b.csv").warned_at.iloc[0]
    # by hand: every check up to 200 steps past the stored run (after it, the windows are empty until 10**12)
    m, pred = json.loads((run / CONFIG).read_text())["model"], load_predictor()
    series, start = EW.RunSeries(stored, m["loops"], m["depth"]), min(pred.models)
    p = {at: EW.probability(pred, EW.features_at(series, at, m["width"]), at)[0]
         for at in range(-(-start // 25) * 25, last + 200, 25)}
    first = next((at for at, v in p.items() if v >= pred.threshold), None)
    assert got == first if first is not None else (pd.isna(got) or got >= 10**12 - 100)


def test_the_replay_computes_only_the_checks_that_can_differ_and_finds_what_every_check_finds():
    from flt_diag.judge import early_warning as EW
    rng = np.random.default_rng(0)
    steps = list(range(0, 300)) + list(range(300, 2000, 10)) + [5000, 5001, 9000]  # dense, sparse, gaps
    rows = [(s, M.LOSS, M.NONE, M.NONE, 3 + rng.normal(0, .3) + (0.002 * (s - 800) if s > 800 else 0)) for s in steps]
    rows += [(s, M.GRAD_NORM, M.NONE, M.NONE, abs(rng.normal(1, .5))) for s in steps]
    df = pd.DataFrame(rows, columns=["step", "metric", "loop", "layer", "value"])
    pred = dict(features=["loss_climb", "grad_cv", "loss_slope"], threshold=0.9, models={
        str(k): dict(mean=[0.0] * 3, std=[1.0] * 3, coef=[c, 0.5, 0.2], intercept=-3.0)
        for k, c in ((25, 1.0), (600, -1.0), (7000, 3.0))})  # (only the model fitted at 7000 warns: in a gap)
    got = EW.first_warning(df, pred, loops=3, depth=2, d_model=64, steps_done=9001)
    run, best, first = EW.RunSeries(df, 3, 2), 0.0, None  # every check, one by one
    for at in range(25, 9002, 25):
        p, _ = EW.probability(pred, EW.features_at(run, at, 64), at)
        best = max(best, p)
        first = at if first is None and p >= 0.9 else first
    assert (got["warned_at"], got["p_max"]) == (first, pytest.approx(best)) and first == 7000


def test_summary_recompute_follows_the_rows_stored(tmp_path, capsys):
    from flt_diag.judge.verdict import resummarize
    run = make_run(tmp_path / "run", "lt", 3)
    before = resummarize(run)
    _claims(run, 10**12)
    with within(120):
        assert main(["summary", str(run), "--recompute"]) == 0
    after = json.loads((run / SUMMARY).read_text())
    assert after["oscillation_windows"][:-1] == before.as_written()["oscillation_windows"]  # the stored windows, and one more


# ---------------------------------------------------------------- a study nested 5,000 deep

@pytest.mark.parametrize("text", ["[ablation]\nloops = " + "[" * 5000 + "]" * 5000,
                                  "[ablation]\nloops = " + "{a=" * 5000 + "1" + "}" * 5000])
def test_a_study_nested_5000_deep_is_one_line(tmp_path, capsys, text):
    (tmp_path / "s.toml").write_text(text + "\n")
    assert main(["study", str(tmp_path / "s.toml")]) == 2
    assert "s.toml" in one_error_line(capsys)


# ---------------------------------------------------------------- the analysis scripts write as flt-diag does

def _script(name: str, *args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "analysis" / name), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("script,args", [("failure_rates.py", ["{sweep}", "--csv", "{out}"]),
                                         ("loop_dynamics_table.py", ["{sweep}", "--csv", "{out}"])])
@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_an_analysis_script_refuses_a_link_or_a_fifo_as_its_output(tmp_path, script, args, kind):
    sweep = make_sweep(tmp_path / "sw")
    target, out = tmp_path / "precious.txt", tmp_path / "out.csv"
    target.write_text("keep me")
    out.symlink_to(target) if kind == "link" else os.mkfifo(out)
    run = _script(script, *[a.format(sweep=sweep, out=out) for a in args], timeout=60)  # (a FIFO must not block)
    err = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2 and len(err) == 1 and err[0].startswith("error: ") and str(out) in err[0], run.stderr
    assert target.read_text() == "keep me" and (out.is_symlink() if kind == "link" else out.is_fifo())


def test_regenerate_refuses_a_linked_file_inside_the_sweep(tmp_path):
    sweep = make_sweep(tmp_path / "sw")
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    (sweep / "figures").mkdir()
    (sweep / "figures" / "table.md").symlink_to(target)
    run = _script("regenerate.py", sweep, timeout=600)
    assert run.returncode != 0 and "symbolic link" in run.stderr and "Traceback" not in run.stderr
    assert target.read_text() == "keep me"


# ---------------------------------------------------------------- partials

def test_summary_sensitivity_does_not_pool_a_map_with_a_sweep(tmp_path, capsys):
    from flt_diag.grids.stability_map import MapSpec, prepare_map_folder
    sweep = make_sweep(tmp_path / "sw")
    prepare_map_folder(MapSpec(tiny_config(steps=2), ["lt"], [2], [0], "lr", [0.5, 1.0], ["training"]), tmp_path / "map")
    assert main(["summary", str(sweep), str(tmp_path / "map"), "--sensitivity",
                 "--sensitivity-csv", str(tmp_path / "s.csv")]) == 2
    assert "is a map folder" in one_error_line(capsys) and not (tmp_path / "s.csv").exists()


@pytest.mark.parametrize("bad", ["folder", "link", "fifo", "no parent"])
def test_fit_predictor_writes_no_examples_when_out_is_refused(tmp_path, capsys, bad):
    sweep = make_sweep(tmp_path / "sw", seeds=(0, 1))
    out = tmp_path / "p.json"
    if bad == "folder":
        out.mkdir()
    elif bad == "link":
        (tmp_path / "elsewhere.json").write_text("{}")
        out.symlink_to(tmp_path / "elsewhere.json")
    elif bad == "fifo":
        os.mkfifo(out)
    else:
        out = tmp_path / "missing" / "p.json"
    code = main(["fit-predictor", str(sweep), "--out", str(out), "--at", "20", "--examples-out", str(tmp_path / "ex.csv")])
    assert code == 2 and one_error_line(capsys) and not (tmp_path / "ex.csv").exists()


def test_a_refused_resume_leaves_config_json_as_it_was(tmp_path, capsys):
    from flt_diag.training.trainer import train
    run = tmp_path / "run"
    cfg = tiny_config(variant="lt", loops=2, steps=4, checkpoint_every=2)
    train(cfg, run)
    (run / SUMMARY).unlink()  # an unfinished run ...
    (run / "metrics").rename(tmp_path / "elsewhere")
    (run / "metrics").symlink_to(tmp_path / "elsewhere")  # ... whose metrics/ is a link
    before = _files(run)
    with pytest.raises(StorageError, match="is a symbolic link"):
        train(cfg, run)
    after = _files(run)
    after.pop(".lock", None), before.pop(".lock", None)
    assert after == before


def test_a_top_folder_that_is_a_link_trains_and_resumes(tmp_path, capsys):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    args = ["train", "--steps", "4", "--checkpoint-every", "2", "--device", "cpu", "--variant", "lt", "--loops", "2",
            "--out", str(tmp_path / "link")]
    assert main(args) == 0 and (real / SUMMARY).exists()
    (real / SUMMARY).unlink()
    assert main(args) == 0 and (real / SUMMARY).exists() and (tmp_path / "link").is_symlink()
    cell = tmp_path / "sw" / "cells"  # a link inside a folder is still foreign
    cell.mkdir(parents=True)
    (cell / "lt_K02_seed0_lr1").symlink_to(real)
    before = _files(real)
    assert main(["run-ablation", "--loops", "2", "--variants", "lt", "--steps", "2", "--device", "cpu", "--workers", "1",
                 "--quiet", "--out", str(tmp_path / "sw")]) != 0
    assert _files(real) == before


def test_huge_and_non_finite_losses_give_no_numpy_warning(tmp_path, capsys):
    from flt_diag.judge.verdict import summarize
    from fake_runs import config as run_config
    steps = np.arange(400)
    loss = np.where(steps < 200, 3.0, 1e300) * np.where(steps % 2, 1, -1)
    df = pd.DataFrame(dict(step=np.r_[steps, steps, [400]], metric=[M.LOSS] * 400 + [M.GRAD_NORM] * 400 + [M.LOSS],
                           loop=M.NONE, layer=M.NONE, value=np.r_[loss, np.full(400, 1e308), [np.inf]]))
    from flt_diag.judge.spike_detectors import first_warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        summary = summarize(df, run_config("lt", 3), 4.0)
        fired = first_warnings(np.r_[np.full(300, 3.0), np.full(200, 1e308)])  # the baselines of predict --online
    assert summary.verdict != "stable" and fired["lightning"] == 300


def test_a_fifo_lock_in_a_run_folder_is_one_line_and_is_left_alone(tmp_path, capsys):
    import os
    from flt_diag.cli import main
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / ".lock")
    code = main(["train", "--preset", "tiny", "--steps", "2", "--out", str(run)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and ".lock is not a regular file" in err
    assert (run / ".lock").exists() and not (run / "config.json").exists()
