"""The worker pool of the grids: cells (and map lines) in parallel processes, one per CPU core or per GPU.

Workers are spawned (never forked: torch and threads), die with their parent (kill -9 included), and
take one GPU each from a queue on a CUDA machine. flt_diag.grids.sweep and flt_diag.grids.stability_map
submit their work here.
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import sys
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


def _worker_init(gpu_queue, parent_pid):
    die_with_parent(parent_pid)
    if gpu_queue is not None:
        os.environ["FLT_DIAG_DEVICE"] = f"cuda:{gpu_queue.get()}"


def _run_cell_in_worker(run_cell, base, cell, out, threads):
    return run_cell(base, cell, out, threads, os.environ.get("FLT_DIAG_DEVICE"))


def auto_workers(device: str) -> int:
    """One worker per GPU (CUDA) or per CPU core (each worker then runs one thread)."""
    import torch  # (as in run_cell)
    if device in ("auto", "cuda") and torch.cuda.is_available():
        return torch.cuda.device_count()
    return os.cpu_count() or 1


def run_parallel(base, todo, out, workers, monitor, run_cell: Callable, on_cell_done: Callable[[], None]):
    import torch  # (as in run_cell)
    n_gpu = torch.cuda.device_count() if base["train"]["device"] in ("auto", "cuda") else 0
    ctx = mp.get_context("spawn")
    gpu_queue = None
    if n_gpu:
        workers = min(workers, n_gpu)
        gpu_queue = ctx.Queue()
        for i in range(workers):
            gpu_queue.put(i)
        threads = None
    else:
        threads = max(1, (os.cpu_count() or 1) // workers)
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init,
                             initargs=(gpu_queue, os.getpid())) as pool:
        pending = {}
        queue = list(todo)
        while queue or pending:
            while queue and len(pending) < workers:
                cell = queue.pop(0)
                pending[pool.submit(_run_cell_in_worker, run_cell, base, cell, str(out), threads)] = cell
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
