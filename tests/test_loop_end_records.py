"""Records at the loop's end, with a state (flt_diag.records, moment loop_end), and a record's value checked inside
its own guard (issue 67 item 3). One process registers, before the config is first read, a toy loop-end record in
one file outside the package (tests/toy_records/stream_change.py: ||h(t) - h(t-1)||, its state the previous h) and
five after_step records that return what is no {metric: number}: a string, a list, a value that is a string, a
tensor of three values, an int beyond a float. Under flt_diag.watch the toy's rows equal the change of the block's
outputs captured by hand (float64); under flt-diag's Trainer it is recorded at loops 2..K of every step. Each bad
record is the one named in not_recorded, with why, and the built-in records of its moment (update_ratio/<group>,
param_norm/<group>) keep every step's rows."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

SCRIPT = """
import json, sys
import flt_diag
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import stream_change
from pydantic import Field
from flt_diag.records import Record, RecordOptions
flt_diag.register_record(stream_change.RECORD)

BAD = {"text": lambda model: "not a dict", "listed": lambda model: [1.0], "string": lambda model: {"bad_string": "1.5"},
       "many": lambda model: {"bad_many": __import__("torch").ones(3)}, "huge": lambda model: {"bad_huge": 10 ** 400}}
for name, fn in BAD.items():
    options = type(f"{name}Options", (RecordOptions,), {"__annotations__": {f"bad_{name}_on": bool},
                                                         f"bad_{name}_on": Field(False, description=name)})
    flt_diag.register_record(Record(options=options, metrics={f"bad_{name}": name}, moment="after_step", compute=fn))

import torch
from flt_diag.cli import main
from flt_diag.config.run_config import DiagnosticsConfig
from flt_diag.storage.folders import load_metrics
from probe_models import UniversalTransformer, batches, lm_loss
out = sys.argv[3]

def rows(folder, metric):
    df = load_metrics(folder)
    return [(int(r.step), int(r.loop), float(r.value)) for r in df[df.metric == metric].itertuples()]

torch.manual_seed(0)
model = UniversalTransformer(loops=3)
opt = torch.optim.AdamW(model.parameters(), 1e-3)
streams = []
model.layer.register_forward_hook(lambda m, a, o: streams.append(o.detach().double().clone()))
by_hand = []
bad = {f"bad_{name}_on": True for name in BAD}
with flt_diag.watch(model, blocks=[model.layer], folder=f"{out}/watch", optimizer=opt,
                    diagnostics=DiagnosticsConfig(toy_change=True, **bad)) as probe:
    for s, x in enumerate(batches(3)):
        streams.clear()
        loss = lm_loss(model(x), x)
        by_hand += [(s, t + 1, float((streams[t] - streams[t - 1]).norm())) for t in range(1, len(streams))]
        loss.backward()
        opt.step()
        probe.step(loss=loss)
        opt.zero_grad()
summary = json.load(open(f"{out}/watch/summary.json"))
code = main(["train", "--steps", "2", "--loops", "3", "--device", "cpu", "--eval-every", "0", "--eval-batches", "1",
             "--toy-change", "--out", f"{out}/train"])
df = load_metrics(f"{out}/watch")
print(json.dumps(dict(toy=rows(f"{out}/watch", "toy_stream_change"), by_hand=by_hand,
                      not_recorded=summary["evidence"]["not_recorded"],
                      builtin={m: sorted(set(df[df.metric == m].step.tolist())) for m in df.metric.unique()
                               if m.startswith(("update_ratio/", "param_norm/"))},
                      bad_rows=int(df.metric.str.startswith("bad_").sum()),
                      train=dict(code=code, toy=rows(f"{out}/train", "toy_stream_change")))))
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("loop_end")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(TESTS / "toy_records"), str(TESTS), str(out)],
                          cwd=TESTS, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_loop_end_record_with_state_equals_the_streams_change_by_hand(run):
    assert [(s, t) for s, t, _ in run["toy"]] == [(s, t) for s, t, _ in run["by_hand"]] == \
        [(s, t) for s in range(3) for t in (2, 3)]
    for (_, _, got), (_, _, want) in zip(run["toy"], run["by_hand"]):
        assert got == pytest.approx(want, rel=1e-6)  # (stored through float32)


def test_a_loop_end_record_is_recorded_by_the_trainer(run):
    train = run["train"]
    assert train["code"] == 0 and [(s, t) for s, t, _ in train["toy"]] == [(0, 2), (0, 3), (1, 2), (1, 3)]
    # (the blocks' output projections start at zero: at step 0 no loop changes the stream; after one update they do)
    assert [v == 0 for _, _, v in train["toy"]] == [True, True, False, False]


@pytest.mark.parametrize("name, why", [
    ("bad_text", "it returned str; a record returns {metric: number}"),
    ("bad_listed", "it returned list; a record returns {metric: number}"),
    ("bad_string", "its bad_string is str; a record's value is one real number"),
    ("bad_many", "its bad_many is a tensor of shape (3,) (torch.float32); a record's value is one real number"),
    ("bad_huge", "its bad_huge is int 10000000000000000000..., beyond a float")])
def test_a_record_whose_value_is_no_number_is_the_one_named(run, name, why):
    assert run["not_recorded"][name].startswith(why), run["not_recorded"]


def test_the_moments_own_records_keep_every_step(run):
    assert not [n for n in run["not_recorded"] if n.startswith(("update_ratio", "param_norm"))], run["not_recorded"]
    assert run["builtin"] and all(steps == [0, 1, 2] for steps in run["builtin"].values()), run["builtin"]
    assert run["bad_rows"] == 0
