"""The worker pool of the grids: cells (and map lines) in parallel processes, one per CPU core or per GPU.

Workers are spawned (never forked: torch and threads), die with their parent (kill -9 included), and
take one GPU each from a queue on a CUDA machine. flt_diag.grids.sweep and flt_diag.grids.stability_map
submit their work here.
"""
from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Callable


def die_with_parent(parent_pid: int) -> None:
    """In a worker process: be killed when the parent dies (even by kill -9), so that no orphan
    keeps training a cell that a re-run of the sweep will train again (Linux; elsewhere a no-op).
    A parent that died before this ran is noticed by its pid, and the worker leaves at once."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        except OSError:  # pragma: no cover - no glibc
            pass
    if os.getppid() != parent_pid:
        os._exit(1)


_busy = False  # in a worker: whether it is running a task (a cell, a map line) now


@contextlib.contextmanager
def task():
    """Mark a worker busy while it runs one task (see _interrupt_once)."""
    global _busy
    _busy = True
    try:
        yield
    finally:
        _busy = False


def _interrupt_once(signum, frame):
    """A worker's SIGINT handler: the first interrupt raises KeyboardInterrupt in a running task (which
    then cleans up: its run folder stays resumable), later ones are ignored, so that the second SIGINT a
    worker gets when Ctrl-C reaches the whole process group and the parent then forwards its own cannot
    break the first one's clean-up (a traceback from inside the executor was printed once, in a loop of the
    Ctrl-C test). An idle worker (waiting for work, nothing to clean up) leaves quietly at once, instead of
    a traceback from the executor's queue. The parent's SIGTERM, then SIGKILL, still end a worker that hangs."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not _busy:
        os._exit(130)
    raise KeyboardInterrupt


def worker_setup(parent_pid: int, gpu_queue=None) -> None:
    """In a worker process of a grid's pool: die with the parent, handle an interrupt once, take a GPU
    from `gpu_queue` (where given)."""
    die_with_parent(parent_pid)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # (a parent started with SIGINT ignored, as `cmd &`
        # in a non-interactive shell or under `trap '' INT` does: its workers ignore it too)
        signal.signal(signal.SIGINT, _interrupt_once)
    if gpu_queue is not None:
        os.environ["FLT_DIAG_DEVICE"] = f"cuda:{gpu_queue.get()}"


def spawn_pool(workers: int, gpu_queue=None) -> ProcessPoolExecutor:
    """A grid's pool: `workers` spawned processes, each set up by `worker_setup`."""
    return ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=worker_setup,
                               initargs=(os.getpid(), gpu_queue))


def _run_cell_in_worker(run_cell, cfg, cell, out, threads):
    with task():
        return run_cell(cfg, cell, out, threads, os.environ.get("FLT_DIAG_DEVICE"))


def auto_workers(device: str) -> int:
    """One worker per GPU (CUDA) or per CPU core (each worker then runs one thread)."""
    import torch  # (as in run_cell)
    if device in ("auto", "cuda") and torch.cuda.is_available():
        return torch.cuda.device_count()
    return os.cpu_count() or 1


def run_parallel(todo: list, device: str, out, workers, monitor, run_cell: Callable, on_cell_done: Callable[[], None]):
    """Run `todo`, (cell, its RunConfig) pairs, with `run_cell` in `workers` processes (one GPU each where `device`
    is auto or cuda and there are GPUs), calling `on_cell_done` after each."""
    import torch  # (as in run_cell)
    n_gpu = torch.cuda.device_count() if device in ("auto", "cuda") else 0
    gpu_queue, threads = None, max(1, (os.cpu_count() or 1) // workers)  # (on CPUs: the cores shared out)
    if n_gpu:  # one GPU each, from a queue
        workers, threads = min(workers, n_gpu), None
        gpu_queue = mp.get_context("spawn").Queue()
        for i in range(workers):
            gpu_queue.put(i)
    pool = spawn_pool(workers, gpu_queue)
    with interruptible(pool):
        pending: dict = {}  # (a future -> its cell)
        queue = list(todo)
        while queue or pending:
            while queue and len(pending) < workers:
                cell, cfg = queue.pop(0)
                pending[pool.submit(_run_cell_in_worker, run_cell, cfg, cell, str(out), threads)] = cell
                monitor.start(cell)
            done, _ = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            for fut in done:
                cell = pending.pop(fut)
                try:
                    result = fut.result()
                except Exception as e:  # a worker process died
                    result = f"error: {type(e).__name__}: {e}"
                monitor.finish(cell, result)
                on_cell_done()
            monitor.poll()


GRACE_S = 2.0  # after SIGINT, how long the workers get to stop on their own (then SIGTERM, then SIGKILL)


@contextlib.contextmanager
def interruptible(pool: ProcessPoolExecutor):
    """Own a process pool: on success shut it down and wait for it; on Ctrl-C or any other exception in
    the parent (whoever sent the SIGINT: a terminal's whole process group, `kill -INT` of the parent
    alone, a scheduler) cancel what has not started, forward the interrupt to the workers, and stop them:
    SIGINT, then after GRACE_S SIGTERM, then SIGKILL. The parent never waits on a running cell (a worker
    may swallow KeyboardInterrupt inside compiled code); the exception is re-raised.

    Enter it before the first submit: the workers are told apart from the parent's other children as the
    multiprocessing children (`multiprocessing.active_children()`, public API) that did not exist on entry
    (the executor spawns its workers on submit and keeps no public list of them)."""
    before = set(mp.active_children())
    try:
        yield pool
    except BaseException:
        stop_pool(pool, [p for p in mp.active_children() if p not in before])
        raise
    pool.shutdown(wait=True)


def stop_pool(pool: ProcessPoolExecutor, processes: list, grace_s: float = GRACE_S) -> None:
    """Cancel what has not started and stop `processes` (the pool's workers): SIGINT, SIGTERM, SIGKILL."""
    pool.shutdown(wait=False, cancel_futures=True)
    for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 1.0), (signal.SIGKILL, 1.0)):
        alive = [p for p in processes if p.is_alive()]
        for p in alive:
            with contextlib.suppress(OSError, ValueError):
                os.kill(p.pid, sig)
        deadline = time.monotonic() + wait_s
        for p in alive:
            with contextlib.suppress(OSError, ValueError, AssertionError):
                p.join(max(0.0, deadline - time.monotonic()))
