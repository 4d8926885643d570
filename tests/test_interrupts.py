"""SIGINT to a grid's parent process alone (`kill -INT PID`, as a job scheduler or a notebook sends it,
not a terminal's Ctrl-C to the whole group) stops its workers too: exit 130 within seconds, no process
left, and the same command run again takes the folder up (its cells were released). One case per
command with a worker pool: a new pool is covered by adding its command to POOLS."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

GRID = ["--variants", "lt", "flt", "--loops", "2", "--steps", "5000", "--device", "cpu", "--workers", "2",
        "--depth", "1"]
POOLS = {"run-ablation": ["run-ablation", *GRID, "--quiet"],
         "map": ["map", *GRID, "--lo", "1", "--hi", "2", "--ratio", "2", "--criteria", "training"]}


def _default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # (as tests/test_reliability.py: a background suite ignores it)


def _children(pid: int) -> set[int]:
    """Every descendant of `pid`, read from /proc (no psutil)."""
    parents = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            parents[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _start(command, out):
    return subprocess.Popen([sys.executable, "-m", "flt_diag", *command, "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=_default_sigint)


def _wait_training(out: Path, since: float, deadline: float) -> None:
    """Until two cells report progress written after `since` (both workers train)."""
    while time.time() < deadline:
        fresh = [p for p in out.rglob("progress.json") if p.stat().st_mtime > since]
        if len(fresh) >= 2:
            return
        time.sleep(0.3)
    pytest.fail("the workers did not start training")


def _interrupt_parent(p, seen: set) -> None:
    seen |= _children(p.pid)
    assert len(seen) >= 2, "no worker processes"
    os.kill(p.pid, signal.SIGINT)  # the parent alone
    t0 = time.monotonic()
    try:
        _, err = p.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail("still running 10 s after SIGINT to the parent")
    assert p.returncode == 130 and time.monotonic() - t0 < 10, err[-2000:]
    assert "interrupted" in err and "Traceback" not in err, err[-2000:]
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and any(map(_alive, seen)):
        time.sleep(0.1)
    assert not [k for k in seen if _alive(k)], "processes left after the interrupt"


@pytest.mark.parametrize("name", list(POOLS))
def test_sigint_to_the_parent_alone_stops_the_workers_and_the_rerun_resumes(tmp_path, name):
    out, seen, procs = tmp_path / "out", set(), []
    try:
        for _ in range(2):  # the first run, then the re-run takes the released folder up
            since = time.time()
            procs.append(_start(POOLS[name], out))
            _wait_training(out, since, time.time() + 240)  # a loaded machine: spawned workers, first compile
            _interrupt_parent(procs[-1], seen)
    finally:
        for pid in [p.pid for p in procs] + sorted(seen):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        for p in procs:
            p.kill() if p.poll() is None else None


def _sleep_forever(_):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a worker that swallows Ctrl-C (as compiled code may)
    time.sleep(600)


def test_an_interrupted_pool_stops_its_own_workers_and_no_other_child():
    """interruptible: on KeyboardInterrupt its workers are stopped (SIGINT ignored: SIGTERM then), within
    seconds; a multiprocessing child the caller started before the pool lives on."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    from flt_diag.grids.worker_pool import interruptible
    ctx = mp.get_context("spawn")
    bystander = ctx.Process(target=time.sleep, args=(60,))
    bystander.start()
    try:
        pool = ProcessPoolExecutor(2, mp_context=ctx)
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            with interruptible(pool):
                [pool.submit(_sleep_forever, i) for i in range(3)]
                deadline = time.monotonic() + 60
                while len(mp.active_children()) < 3 and time.monotonic() < deadline:  # both workers up
                    time.sleep(0.05)
                workers = [p for p in mp.active_children() if p is not bystander]
                time.sleep(1.0)  # both are inside the task
                raise KeyboardInterrupt
        assert time.monotonic() - t0 < 30
        # (by /proc, not Process.exitcode: the executor's own thread may be reaping a killed worker just now,
        # and multiprocessing then reports it alive for a moment)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(p.pid) for p in workers):
            time.sleep(0.05)
        assert len(workers) == 2 and not [p.pid for p in workers if _alive(p.pid)]
        assert bystander.is_alive() and _alive(bystander.pid)
    finally:
        bystander.kill()
        bystander.join()


def _interrupted_twice(_):
    from flt_diag.grids.worker_pool import task
    with task():  # as a cell or a map line runs in a worker
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
            return "first interrupt not raised"
        except KeyboardInterrupt:
            os.kill(os.getpid(), signal.SIGINT)  # the second (the parent forwarding its own): must not break this
            time.sleep(0.2)
            return "cleaned up" if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else "handler left on"


def _pid_then_sleep(path):
    from flt_diag.grids.worker_pool import task
    with task():
        Path(path).write_text(str(os.getpid()))
        time.sleep(60)


def test_an_idle_worker_leaves_quietly_on_an_interrupt(tmp_path, capfd):
    """A worker waiting for work (more workers than cells) has nothing to clean up: on SIGINT it exits 130 at
    once, without the traceback the executor's queue would print."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    from flt_diag.grids.worker_pool import worker_setup
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # (a background suite ignores it)
    before = set(mp.active_children())
    pool = ProcessPoolExecutor(2, mp_context=mp.get_context("spawn"), initializer=worker_setup,
                               initargs=(os.getpid(),))
    try:
        for f in [pool.submit(time.sleep, 1.0) for _ in range(2)]:  # two workers spawned (on demand), both done
            f.result(timeout=60)
        workers = [p for p in mp.active_children() if p not in before]
        pool.submit(_pid_then_sleep, str(tmp_path / "busy"))  # one of them busy, the other idle
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (tmp_path / "busy").exists():
            time.sleep(0.05)
        busy = int((tmp_path / "busy").read_text())
        assert len(workers) == 2 and busy in [p.pid for p in workers]
        (idle,) = [p for p in workers if p.pid != busy]
        os.kill(idle.pid, signal.SIGINT)
        deadline = time.monotonic() + 10  # (the executor's thread may reap it: its exit code appears a moment later)
        while time.monotonic() < deadline and idle.exitcode is None:
            time.sleep(0.05)
        err = capfd.readouterr().err
        assert idle.exitcode == 130 and "Traceback" not in err, (idle.exitcode, err[-2000:])
    finally:
        signal.signal(signal.SIGINT, previous)
        for p in mp.active_children():
            p.kill()
        pool.shutdown(wait=False, cancel_futures=True)


def test_a_worker_raises_on_the_first_interrupt_and_ignores_the_second():
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    from flt_diag.grids.worker_pool import worker_setup
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # (a background suite ignores it)
    try:
        with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"), initializer=worker_setup,
                                 initargs=(os.getpid(),)) as pool:
            assert pool.submit(_interrupted_twice, 0).result(timeout=60) == "cleaned up"
    finally:
        signal.signal(signal.SIGINT, previous)
