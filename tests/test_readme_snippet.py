"""The README's Python snippet runs as a user first meets it: copied from README.md and pasted into a fresh
interpreter (a new process, an empty folder, nothing imported or defined beforehand). It is fed line by line to
code.InteractiveConsole, which compiles as the interactive prompt does (a block ends at a blank line; a name
the snippet uses but never defines is a NameError printed there)."""
import os
import re
import subprocess
import sys
from pathlib import Path

from flt_diag.storage.folders import load_config, load_metrics, load_summary
from flt_diag.storage import metric_names as M

ROOT = Path(__file__).resolve().parents[1]
PASTE = """import code, sys
console = code.InteractiveConsole()
for line in sys.stdin.read().splitlines():
    console.push(line)
console.push("")
"""


def snippet() -> str:
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- api:start -->")[1].split("<!-- api:end -->")[0]
    code = re.search(r"```python\n(.*?)```", block, re.S)
    assert code, "the README's API section has no python block"
    return code.group(1)


def test_the_readme_snippet_runs_pasted_into_a_fresh_interpreter(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", PASTE], input=snippet(), cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and "Traceback" not in done.stderr and "Error" not in done.stderr, done.stderr[-3000:]
    run = tmp_path / "runs" / "mine"
    summary = load_summary(run)
    assert done.stdout.strip().splitlines()[-1] == summary.verdict  # the snippet's last line printed it
    assert load_config(run).model.loops == 4  # one layer, called 4 times, found by blocks="auto"
    loss = load_metrics(run).query("metric == @M.LOSS").value
    assert len(loss) == 60 and loss.iloc[-5:].mean() < loss.iloc[:5].mean()  # 60 steps, and it learnt

