"""A record is one file (flt_diag.records): a toy record in one file outside the package
(tests/toy_records/gradient_square.py), registered by flt_diag.register_record, is an option of the config and a flag of the command line, a row of the generated
docs/cli.md table, a metric name with its definition, and recorded, when switched on and only on its steps, by
flt-diag's Trainer and by flt_diag.watch; its value against the gradients' own norm. Two records that name one
option are refused."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pydantic import Field

import flt_diag.records as records
from flt_diag.records import Record, RecordOptions

TESTS = Path(__file__).resolve().parent
TOY = TESTS / "toy_records"

# One process (the records are read once, when the config is first imported): the toy record is registered
# before anything else of flt_diag is imported.
SCRIPT = """
import json, math, sys
import flt_diag
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import gradient_square
flt_diag.register_record(gradient_square.RECORD)
out = sys.argv[3]

import torch
from flt_diag.cli import main
from flt_diag.cli.table import options_markdown
from flt_diag.config.run_config import DiagnosticsConfig
from flt_diag.storage import metric_names as M
from flt_diag.storage.folders import load_config, load_metrics
from probe_models import UniversalTransformer, batches, lm_loss

def rows(folder, metric):
    df = load_metrics(folder)
    return {int(r.step): float(r.value) for r in df[(df.metric == metric) & (df.loop == -1) & (df.layer == -1)].itertuples()}

result = dict(named=M.RECORDED.get("toy_grad_square"),
              documented=[line for line in options_markdown().splitlines() if "--toy-every" in line])
for name, flags in (("on", ["--toy-every", "2"]), ("off", [])):
    code = main(["train", "--steps", "4", "--device", "cpu", "--eval-every", "0", "--eval-batches", "1",
                 "--out", f"{out}/{name}", *flags])
    result[name] = dict(code=code, toy=rows(f"{out}/{name}", "toy_grad_square"),
                        grad_norm=rows(f"{out}/{name}", "grad_norm"),
                        option=load_config(f"{out}/{name}").diagnostics.toy_every,
                        modules=json.load(open(f"{out}/{name}/config.json"))["env"]["records"])

torch.manual_seed(0)
model = UniversalTransformer(loops=3)
opt = torch.optim.AdamW(model.parameters(), 1e-3)
by_hand = {}
with flt_diag.watch(model, blocks=[model.layer], folder=f"{out}/watch", optimizer=opt,
                    diagnostics=DiagnosticsConfig(toy_every=2)) as probe:
    for s, x in enumerate(batches(5)):
        loss = lm_loss(model(x), x)
        loss.backward()
        by_hand[s] = sum(float(p.grad.double().square().sum()) for p in model.parameters())
        opt.step()
        probe.step(loss=loss)
        opt.zero_grad()
result["watch"] = dict(toy=rows(f"{out}/watch", "toy_grad_square"), by_hand=by_hand)
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("toy")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(TOY), str(TESTS), str(out)], cwd=TESTS,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_record_in_one_file_is_named_and_documented(toy):
    assert toy["named"] == "sum of the squared gradient entries of every parameter, before clipping"
    assert toy["documented"] == ["| `--toy-every` | run-ablation, map, train | 0 | Toy: the squared gradient norm "
                                 "every N steps; 0 = never. |"]


def test_a_record_in_one_file_is_recorded_by_the_trainer_when_switched_on(toy):
    on, off = toy["on"], toy["off"]
    assert on["code"] == off["code"] == 0 and (on["option"], off["option"]) == (2, 0)
    assert on["modules"] == {"attention_stats": "flt_diag.records.attention", "toy_every": "gradient_square",
                             "loop_dynamics": "flt_diag.records.exit_loss, flt_diag.records.fixed_point_residual, "
                                              "flt_diag.records.token_similarity",
                             "dynamics_every": "flt_diag.records.loop_map, flt_diag.records.loop_map_agreement",
                             "sharpness_every": "flt_diag.records.sharpness"}
    assert off["toy"] == {}
    assert sorted(on["toy"]) == ["0", "2"]  # (steps 0..3; JSON keys)
    for step, value in on["toy"].items():  # (before clipping: the global gradient norm the Trainer records)
        assert value == pytest.approx(on["grad_norm"][step] ** 2, rel=1e-4)


def test_a_record_in_one_file_is_recorded_by_watch(toy):
    watch = toy["watch"]
    assert sorted(watch["toy"]) == ["0", "2", "4"]
    for step, value in watch["toy"].items():
        assert value == pytest.approx(watch["by_hand"][step], rel=1e-6)


def test_a_second_record_naming_an_option_already_named_is_said_and_left_out(monkeypatch, capsys):
    """(Before 2026-12-07 a ValueError at import: a traceback on every command.) The first is kept."""
    sys.path.insert(0, str(TOY))
    import gradient_square
    again = Record(options=gradient_square.ToyOptions, metrics={"x": "x"}, moment="after_backward", compute=dict)
    monkeypatch.setattr(records, "_REGISTERED", [gradient_square.RECORD, again])
    records.all_records.cache_clear()
    try:
        got = records.all_records()
        assert [r for r in got if r is gradient_square.RECORD] and not [r for r in got if r is again]
        err = capsys.readouterr().err
        assert "warning: record toy_every" in err and "left out: an earlier record names toy_every" in err
    finally:
        monkeypatch.undo()
        records.all_records.cache_clear()
        sys.path.remove(str(TOY))
    assert [r.switch for r in records.all_records()] == ["attention_stats", "loop_dynamics", "loop_dynamics",
                                                             "dynamics_every", "dynamics_every", "sharpness_every",
                                                             "loop_dynamics"]


def test_a_record_registered_after_the_records_were_read_is_one_line():
    records.all_records()
    late = Record(options=ToyOptions, metrics={"late": "late"}, moment="after_step", compute=dict)
    with pytest.raises(RuntimeError, match="^the record late_every .* came after flt-diag's records were read"):
        records.register_record(late)
    assert late not in records._REGISTERED


class ToyOptions(RecordOptions):
    late_every: int = Field(0, description="late", ge=0)


class FloatSwitch(RecordOptions):
    s: float = 0.0


class BoolSwitch(RecordOptions):
    s: bool = False


@pytest.mark.parametrize("options, moment", [(FloatSwitch, "after_block"), (BoolSwitch, "after_forward"),
                                             (dict, "after_step")])
def test_a_record_needs_a_bool_or_int_switch_and_a_known_moment(options, moment):
    with pytest.raises(ValueError):
        Record(options=options, metrics={"m": "m"}, moment=moment, compute=lambda *a: {})
