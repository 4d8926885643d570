"""A researcher's own stabiliser or record from outside the package, done wrong (issue "a stabiliser is one file";
a bad-input hunt of 2026-12-07): a record plugin that fails to load, names no Record or takes another's metric is
one warning line and left out, never a traceback on every command; a record option named like flt-diag's own is one
line; a stabiliser installed twice, or installed and registered, is one; its fields are checked; a hook that returns
the wrong shape, or a metric named like flt-diag's own, is one line naming it; a run made with a plugin and read
where it is not installed says what to install, and sets aside the options of records that were off."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flt_diag
from flt_diag.cli import main
from flt_diag.config.variants import unregister_stabiliser

REPO = Path(__file__).resolve().parents[1]
TRAIN = ["train", "--steps", "3", "--device", "cpu", "--preset", "tiny", "--loops", "2", "--depth", "1"]


def installed(root: Path, name: str, entry_points: str, modules: dict[str, str]) -> dict:
    """A distribution `name` on a PYTHONPATH of its own (its modules and an entry_points.txt): the environment of a
    child process that has it installed."""
    root.mkdir(parents=True, exist_ok=True)
    for module, text in modules.items():
        (root / f"{module}.py").write_text(text)
    info = root / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points)
    return {"PYTHONPATH": f"{REPO}:{root}", "PATH": "/usr/bin:/bin"}


def flt_diag_in(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flt_diag", *args], capture_output=True, text=True, env=env,
                          timeout=180)


RECORD_OK = ("from pydantic import Field\nfrom flt_diag.records import Record, RecordOptions\n"
             "class O(RecordOptions):\n    {name}: bool = Field(False, description='a test record')\n"
             "RECORD = Record(options=O, metrics={{'{metric}': 'a test metric'}}, moment='after_step', "
             "compute=lambda model: {{}})\n")


@pytest.mark.parametrize("text, said", [
    ("def broken(:\n", "SyntaxError"),
    ("import no_such_module_here\n", "ModuleNotFoundError"),
    ("RECORD = 3\n", "it names a int, no Record"),
    ("import sys\nsys.exit(3)\n", "SystemExit: 3"),  # (before: every command exited 3, silently, --help included)
    ("import sys\nsys.exit()\n", "SystemExit: (no code)"),
])
def test_a_broken_record_plugin_is_one_warning_and_every_command_still_runs(tmp_path, text, said):
    env = installed(tmp_path, "badrec", "[flt_diag.records]\nbad = badrec\n", {"badrec": text})
    run = flt_diag_in(env, "variants")
    assert run.returncode == 0, run.stderr
    warnings = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(warnings) == 1 and warnings[0].startswith("warning: record entry point bad = badrec left out")
    assert said in warnings[0] and "Traceback" not in run.stderr


def test_record_plugins_that_take_a_name_are_said_and_left_out_or_refused(tmp_path):
    """A record whose metric is another record's: left out with a warning; one whose option is flt-diag's own
    (flush_every): one error line, exit 2, where before it replaced the core option and training crashed."""
    clash = RECORD_OK.format(name="my_rms", metric="fixed_point_residual")
    env = installed(tmp_path / "a", "clashrec", "[flt_diag.records]\nc = clashrec\n", {"clashrec": clash})
    run = flt_diag_in(env, "variants")
    assert run.returncode == 0 and "left out: an earlier record names fixed_point_residual already" in run.stderr
    core = RECORD_OK.format(name="flush_every", metric="my_metric").replace("bool = Field(False", "int = Field(0")
    env = installed(tmp_path / "b", "corerec", "[flt_diag.records]\nc = corerec\n", {"corerec": core})
    run = flt_diag_in(env, "train", "--help")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines() == [
        "error: the record flush_every (corerec) names the option flush_every, which is flt-diag's own: rename it "
        "in the record"]


@pytest.mark.parametrize("option", ["osc_window", "preset", "workers", "seeds"])  # (a verdict option; the run's
# --preset; a command's --workers; a grid's --seeds: before, "duplicate parameter name", no record named)
def test_a_record_option_named_like_a_verdict_option_or_the_preset_is_one_line(tmp_path, option):
    """Before: the check knew the model's, training's and diagnostics' options only, so a record option named like
    the verdict's `osc_window` took its command-line option."""
    rec = RECORD_OK.format(name=option, metric="my_metric").replace("bool = Field(False", "int = Field(0")
    env = installed(tmp_path, "verdictrec", "[flt_diag.records]\nv = verdictrec\n", {"verdictrec": rec})
    run = flt_diag_in(env, "train", "--help")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines() == [
        f"error: the record {option} (verdictrec) names the option {option}, which is flt-diag's own: rename it in "
        "the record"]


STAB = ("from flt_diag import Stabiliser\nMINE = Stabiliser(name='mine', description='{d}', source='a plugin', "
        "block=lambda cfg: {{}})\n")


def test_a_stabiliser_installed_twice_or_installed_and_registered_is_one(tmp_path):
    env = installed(tmp_path / "one", "stab1", "[flt_diag.stabilisers]\nmine = stab1:MINE\n",
                    {"stab1": STAB.format(d="first")})
    other = installed(tmp_path / "two", "stab2", "[flt_diag.stabilisers]\nmine = stab2:MINE\n",
                      {"stab2": STAB.format(d="second")})
    both = {**env, "PYTHONPATH": f"{env['PYTHONPATH']}:{tmp_path / 'two'}"}
    run = flt_diag_in(both, "variants")
    assert run.returncode == 0, run.stderr
    assert "warning: stabiliser entry point mine (stab" in run.stderr and "another entry point has that name" in run.stderr
    code = "import flt_diag, stab1; flt_diag.register_stabiliser(stab1.MINE); print('ok')"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr
    assert other  # (the second distribution, on its own, is a plain plugin)


@pytest.mark.parametrize("field, value, said", [
    ("strength_max", "big", "`strength_max` must be a number above 0"),
    ("strength_max", -3.0, "`strength_max` must be a number above 0"),
    ("composes", "yes", "`composes` must be a bool"),
    ("update", "not a function", "update must be callable"),
])
def test_a_stabilisers_fields_are_checked_where_it_is_made(field, value, said):
    with pytest.raises(ValueError, match=said):
        flt_diag.Stabiliser(name="typed", description="d", source="s", block=lambda cfg: {}, **{field: value})


def _registered(**hooks) -> flt_diag.Stabiliser:
    stab = flt_diag.Stabiliser(name="own-test", description="d", source="this test", **hooks)
    return flt_diag.register_stabiliser(stab)


def test_a_hook_that_returns_the_wrong_shape_is_one_line_naming_it(tmp_path, capsys):
    _registered(update=lambda part, x_in, x, t: x[..., :3])
    try:
        assert main([*TRAIN, "--variant", "own-test", "--out", str(tmp_path / "run")]) == 2
    finally:
        unregister_stabiliser("own-test")
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "stabiliser own-test" in err[0] and "`update` hook returned (" in err[0], err


def test_a_metric_named_like_flt_diags_own_is_one_line_naming_it(tmp_path, capsys):
    _registered(block=lambda cfg: {}, part="p", parameters=lambda cfg: torch.nn.Linear(1, 1),
                metrics=lambda part: {"loss": torch.tensor(0.001)})
    try:
        assert main([*TRAIN, "--variant", "own-test", "--out", str(tmp_path / "run")]) == 2
    finally:
        unregister_stabiliser("own-test")
    err = capsys.readouterr().err
    assert "its metrics hook names flt-diag's own metric loss" in err and "Traceback" not in err


def test_a_run_made_with_a_plugin_read_without_it_says_what_to_install(tmp_path, capsys):
    """A run of a stabiliser of one's own, with a record of one's own installed but off, read where neither is: the
    record's options are set aside (it was off); the stabiliser is named, module and file; with the record on, the
    record is named."""
    _registered(block=lambda cfg: {})
    try:
        assert main([*TRAIN, "--variant", "own-test", "--out", str(tmp_path / "run")]) == 0
    finally:
        unregister_stabiliser("own-test")
    config = tmp_path / "run" / "config.json"
    c = json.loads(config.read_text())
    c["env"]["records"]["my_rms"] = "myrec"  # (as written where the record was installed: off)
    c["diagnostics"].update(my_rms=False, my_rms_every=50)
    config.write_text(json.dumps(c))
    capsys.readouterr()
    assert main(["summary", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "trained with the stabiliser own-test (module" in err and "not installed here" in err
    c["model"]["variant"] = "flt"  # (the stabiliser aside: the off record's options no longer stop it)
    config.write_text(json.dumps(c))
    summary = tmp_path / "run" / "summary.json"
    summary.write_text(json.dumps({**json.loads(summary.read_text()), "variant": "flt"}))
    assert main(["summary", str(tmp_path / "run")]) == 0, capsys.readouterr().err
    c["diagnostics"]["my_rms"] = True
    config.write_text(json.dumps(c))
    capsys.readouterr()
    assert main(["summary", str(tmp_path / "run")]) == 2
    assert "it ran with the record my_rms (myrec), which is not installed here" in capsys.readouterr().err
