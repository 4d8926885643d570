"""docs/extending.md, "## Your own record": its code block, extracted and run as it stands in a fresh process, records
`stream_rms` at every loop of every step (against h(t)'s RMS by hand, from the block's outputs captured around it),
and the run's config.json names the record's module. The same record joins by the entry-point group
`flt_diag.records` (a package's metadata on the path, as pip installs it): `flt-diag train --stream-rms`."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def code_block() -> str:
    text = (REPO / "docs" / "extending.md").read_text()
    section = text[text.index("## Your own record"):]
    section = section[:m.start()] if (m := re.search(r"\n## ", section[3:])) else section
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


CAPTURE = """
streams = []
_forward = Looped.forward
def forward(self, x):  # (the doc's model, its loop-end states captured by hand)
    for _ in range(3):
        x = self.block(x)
        streams.append(x.detach().double())
    return x
Looped.forward = forward
"""


def test_the_docs_record_runs_as_written(tmp_path):
    code = code_block()
    head, tail = code.split("\nmodel = Looped()", 1)
    script = head + CAPTURE + "\nmodel = Looped()" + tail + (
        "\nimport json\nprint(json.dumps([float(s.square().mean().sqrt()) for s in streams]))\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    by_hand = json.loads(proc.stdout.strip().splitlines()[-1])
    sys.path.insert(0, str(REPO))
    from flt_diag.storage.folders import load_metrics
    df = load_metrics(tmp_path / "runs" / "rms")
    got = df[df.metric == "stream_rms"].sort_values(["step", "loop"])
    assert [(int(s), int(t)) for s, t in zip(got.step, got.loop)] == [(s, t) for s in range(3) for t in (1, 2, 3)]
    assert list(got.value) == pytest.approx(by_hand, rel=1e-6)
    env = json.loads((tmp_path / "runs" / "rms" / "config.json").read_text())["env"]
    assert env["records"]["stream_rms"] == "__main__"


def test_a_record_joins_the_command_line_by_its_entry_point(tmp_path):
    package = tmp_path / "site"
    (package / "my_lab").mkdir(parents=True)
    (package / "my_lab" / "__init__.py").write_text("")
    record = code_block().split("\nfrom flt_diag.config.run_config")[0].replace("flt_diag.register_record(", "RECORD = (")
    (package / "my_lab" / "stream_rms.py").write_text(record)
    info = package / "my_lab-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-lab\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text('[flt_diag.records]\nstream_rms = my_lab.stream_rms:RECORD\n')
    proc = subprocess.run([sys.executable, "-m", "flt_diag", "train", "--steps", "1", "--loops", "2", "--device", "cpu",
                           "--eval-every", "0", "--eval-batches", "1", "--stream-rms", "--out", str(tmp_path / "run")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": f"{REPO}:{package}"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    from flt_diag.storage.folders import load_metrics
    df = load_metrics(tmp_path / "run")
    assert sorted(df[df.metric == "stream_rms"].loop) == [1, 2]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["env"]["records"]["stream_rms"] == \
        "my_lab.stream_rms"
