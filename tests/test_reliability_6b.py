"""Issue 67, items 4-8 (round six of the reliability work): a run is known by what it is, not by its name (one run
archived once, a copied record is one line, --to never inside an archive of runs, analysis arms read from the
stored config); a destination that is a link, a dangling link, a FIFO or a device is named as such; eval-loops on
other data keeps the rows already written; targets= that gives None is said; Ctrl-C drops torch.compile's queued
kernel builds."""
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

import processes
from flt_diag.cli import main

TRAIN = ["train", "--steps", "3", "--device", "cpu", "--preset", "tiny", "--loops", "2", "--depth", "1"]


def _one_error_line(capsys) -> str:
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("done") / "run1"
    assert main([*TRAIN, "--out", str(run)]) == 0
    return run


# --------------------------------------------------------------------------- 8: Ctrl-C and torch.compile's queue

CHILD = r"""
import os, signal, sys, time
from pathlib import Path
signal.signal(signal.SIGINT, signal.default_int_handler)  # (a background test run inherits SIGINT ignored)
import torch._inductor.config as inductor
inductor.compile_threads = 2  # builds on a pool, as on any CPU with two cores or more
from torch._inductor.async_compile import AsyncCompile
from flt_diag.config.run_config import build_config
from flt_diag.instruments.callbacks import Callback
from flt_diag.training.trainer import train
marks, out, n = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])

def build(i):  # a kernel build: a compiler run of half a second, leaving a mark
    time.sleep(0.5)
    (marks / str(i)).touch()

class CtrlCWhileCompiling(Callback):  # the step waits for its kernels, as inductor's async_compile.wait does
    def on_step_end(self, trainer, step):
        futures = [AsyncCompile.pool().submit(build, i) for i in range(n)]
        os.kill(os.getpid(), signal.SIGINT)
        futures[-1].result()

cfg = build_config("tiny", model=dict(loops=2, depth=1), train=dict(steps=20, device="cpu", eval_every=0,
                                                                     eval_batches=1, compile=False))
try:
    train(cfg, out, callbacks=[CtrlCWhileCompiling()])
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(130)
"""


def test_ctrl_c_while_kernels_build_runs_none_of_the_queued_builds(tmp_path):
    """The exit after Ctrl-C does not wait for torch.compile's queued kernel builds (issue 67: 49.5 s): of 20
    queued half-second builds on two threads, only those already running when the signal came (two) run; with
    the queue left as it was, Python's exit runs all 20. Counted by the marks the builds leave, not timed."""
    marks, n = tmp_path / "marks", 20
    marks.mkdir()
    done = processes.run([sys.executable, "-c", CHILD, str(marks), str(tmp_path / "run"), str(n)], timeout=300,
                         capture_output=True, text=True)
    assert done.returncode == 130 and "interrupted" in done.stdout, done.stderr[-2000:]
    built = len(list(marks.iterdir()))
    assert built <= n // 4, f"{built} of {n} queued builds ran after Ctrl-C"
