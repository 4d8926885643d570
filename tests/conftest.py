import contextlib
import os
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/equations.py, tests/fake_runs.py, tests/processes.py

import processes  # noqa: E402  (found through the path above)


def _terminated(signum, frame):
    raise KeyboardInterrupt  # so that pytest still tears the fixtures down (`spawn` kills its children)


if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # a killed test run leaves no child behind either
    signal.signal(signal.SIGTERM, _terminated)


@pytest.fixture
def spawn():
    """spawn(args, **popen_kwargs) -> Popen in a process group of its own; when the test ends (passed
    or failed) the whole group is killed and the child reaped."""
    started = []

    def _start(args, **kwargs):
        started.append(processes.start(args, **kwargs))
        return started[-1]
    yield _start
    for p in started:
        processes.kill_group(p)


@pytest.fixture(scope="session", autouse=True)
def token_cache(tmp_path_factory):
    """One token cache for the whole session (the stdlib corpus is tokenized once, ~5 s)."""
    if "FLT_DIAG_TEST_CACHE" in os.environ:
        path = Path(os.environ["FLT_DIAG_TEST_CACHE"])
    else:
        path = tmp_path_factory.mktemp("token-cache")
    old = os.environ.get("FLT_DIAG_CACHE")
    os.environ["FLT_DIAG_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("FLT_DIAG_CACHE", None)
    else:
        os.environ["FLT_DIAG_CACHE"] = old


def tiny_config(**model_and_train):
    """The tiny preset with small overrides: tiny_config(variant="lt", loops=2, steps=5)."""
    from flt_diag.config.run_config import build_config
    from flt_diag.model.transformer import ModelConfig
    model_fields = set(ModelConfig.model_fields)
    model = {k: v for k, v in model_and_train.items() if k in model_fields}
    train = {k: v for k, v in model_and_train.items() if k not in model_fields and k != "diagnostics"}
    train.setdefault("eval_every", 0)
    train.setdefault("eval_batches", 1)
    train.setdefault("device", "cpu")
    return build_config("tiny", model=model, train=train, diagnostics=model_and_train.get("diagnostics"))


@contextlib.contextmanager
def within(seconds: int):
    """Fails (TimeoutError), not hangs, when the block takes longer than `seconds` (SIGALRM): a command blocked
    on a FIFO, a training loop that never ends."""
    def late(*_):
        raise TimeoutError(f"took more than {seconds} s")
    old = signal.signal(signal.SIGALRM, late)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
