"""examples/: each script runs as written (a subprocess, in a fresh folder) and its run folder reads as any
run; the README's Python snippet is a verbatim excerpt of one of them."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flt_diag.storage.folders import load_config, load_metrics, load_summary
from flt_diag.storage import metric_names as M

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
CASES = [("plain_loop.py", "runs/mine", None), ("hf_trainer.py", "runs/hf", "transformers"),
         ("lightning_module.py", "runs/pl", "lightning")]


def run_example(name: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}  # (one thread: a busy CPU shared well)
    return subprocess.run([sys.executable, str(EXAMPLES / name)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("name,folder,needs", CASES)
def test_an_example_runs_as_written(tmp_path, name, folder, needs):
    if needs:
        pytest.importorskip(needs)
    done = run_example(name, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / folder
    summary = load_summary(run)
    assert done.stdout.strip().splitlines()[-1] == summary.verdict
    df = load_metrics(run)
    loss = df[df.metric == M.LOSS].value
    assert len(loss) == 60 and loss.iloc[-5:].mean() < loss.iloc[:5].mean()  # it trained and learnt
    assert load_config(run).model.loops > 1
    from flt_diag.cli import main
    assert main(["summary", str(run)]) == 0


def readme_snippet() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- api:start -->")[1].split("<!-- api:end -->")[0]
    code = re.search(r"```python\n(.*?)```", block, re.S)
    assert code, "the README's API section has no python block"
    return code.group(1).rstrip("\n").splitlines()


def test_the_readme_snippet_is_an_excerpt_of_an_example():
    snippet = readme_snippet()
    assert len(snippet) >= 5
    found = []
    for path in sorted(EXAMPLES.glob("*.py")):
        lines = path.read_text().splitlines()
        n = len(snippet)
        if any(lines[i:i + n] == snippet for i in range(len(lines) - n + 1)):
            found.append(path.name)
    assert found, "the README's snippet is not a verbatim excerpt of any script in examples/"
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
