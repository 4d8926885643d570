"""The process a run trains in: its device, rank and world size (joining the process group under
torchrun), and the CPU thread settings (the environment record: flt_diag.instruments.records), which a run holds
while its Trainer builds the model and while its fit runs, and gives back as the caller had them after each (two
Trainers made before either fits each train under their own settings, and the caller keeps its own)."""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from flt_diag.config.run_config import RunConfig


def start_process(cfg: RunConfig) -> tuple[torch.device, int, int]:
    """(device, rank, world size) of this process; joins the process group when launched with
    torchrun (WORLD_SIZE > 1: nccl on CUDA, gloo on CPU). The thread settings: run_cpu_settings."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device(cfg.train.device)  # settled: cpu, cuda or cuda:N, checked against this machine
    if world > 1:
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
    return device, rank, world


def set_run_cpu_settings(cfg: RunConfig, device: torch.device) -> None:
    """The run's thread count and subnormal flush in this process."""
    if device.type == "cpu":
        # One thread by default: tiny models are bound by per-op overhead, and OpenMP threads
        # that wait for a core slow a step down many times when other processes share the machine
        # (benchmarks/README.md, "Threads").
        torch.set_num_threads(cfg.train.threads or 1)
        # A collapsing LT drives activation gradients through the loops towards 1e-20 and
        # below; subnormal arithmetic makes such steps several times slower (benchmarks/README.md).
        # (The setting holds for the calling thread, so for all compute at one thread.)
        torch.set_flush_denormal(cfg.train.flush_denormal)
    elif cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)


@contextlib.contextmanager
def run_cpu_settings(cfg: RunConfig, device: torch.device):
    """The run's CPU settings inside the block, the caller's as they were after it (also when it raises)."""
    caller = cpu_settings()
    set_run_cpu_settings(cfg, device)
    try:
        yield
    finally:
        restore_cpu_settings(caller)


@dataclass(frozen=True)
class CpuSettings:
    """What start_process changes in the calling process: torch's intra-op threads, and whether subnormal floats
    are flushed to zero (the calling thread's)."""

    threads: int
    flush_denormal: bool


def cpu_settings() -> CpuSettings:
    """The caller's CpuSettings now. torch has no getter for the flush: a subnormal float doubled reads zero when it
    is on (a CPU without the setting never flushes, and set_flush_denormal is a no-op there)."""
    subnormal = torch.tensor(1e-40, dtype=torch.float32)
    return CpuSettings(torch.get_num_threads(), bool((subnormal * 2.0).item() == 0.0))


def restore_cpu_settings(settings: CpuSettings) -> None:
    """Give the caller back its settings (a notebook or a test process trains on, then computes as before)."""
    torch.set_num_threads(settings.threads)
    torch.set_flush_denormal(settings.flush_denormal)
