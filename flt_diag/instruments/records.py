"""What every run records besides its metrics table, flt-diag's Trainer and flt_diag.watch alike: the
step's scalars (StepLog) and the environment a run trained in (stored in config.json and summary.json)."""
from __future__ import annotations

import os
import platform
import socket
import sys
import time
from importlib.metadata import version
from typing import NamedTuple

import numpy
import pandas  # type: ignore[import-untyped]  # (pandas ships no types; pandas-stubs is no dependency)
import torch

from flt_diag.storage import metric_names as M


class Row(NamedTuple):
    """One scalar of the metrics table: (step, metric, loop, layer, value); loop / layer -1: not per loop / layer."""
    step: int
    metric: str
    loop: int
    layer: int
    value: float


def environment(device: torch.device) -> dict:
    env = dict(python=sys.version.split()[0], torch=torch.__version__, numpy=numpy.__version__,
               pandas=pandas.__version__, platform=platform.platform(), host=socket.gethostname(),
               device=str(device), threads=torch.get_num_threads(), world_size=int(os.environ.get("WORLD_SIZE", 1)),
               started=time.strftime("%Y-%m-%dT%H:%M:%S"))
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    try:
        env["flt_diag"] = version("flt-diag")
    except Exception:
        env["flt_diag"] = "unknown"
    return env


class StepLog:
    """Scalars of one step, kept on the device until `collect` (one host transfer)."""

    def __init__(self) -> None:
        self.keys: list[tuple[str, int, int]] = []
        self.values: list[torch.Tensor] = []

    def add(self, metric: str, value: torch.Tensor | float, loop: int = M.NONE, layer: int = M.NONE) -> None:
        self.keys.append((metric, loop, layer))
        if torch.is_tensor(value):
            self.values.append((value.detach() if value.requires_grad else value).reshape(1))
        else:
            self.values.append(torch.tensor([float(value)]))

    def add_vector(self, keys: list[tuple[str, int, int]], values: torch.Tensor) -> None:
        """Several scalars at once: values[i] under keys[i] = (metric, loop, layer)."""
        if len(keys) != values.numel():
            raise ValueError(f"{len(keys)} keys for {values.numel()} values")
        self.keys.extend(keys)
        self.values.append(values.detach().reshape(-1))

    def collect(self, step: int) -> list[Row]:
        if not self.values:
            return []
        devices = {v.device for v in self.values}
        if len(devices) == 1:  # (cat promotes the dtypes; float32 after, as each value would be)
            vals = torch.cat(self.values).to(torch.float32).tolist()  # the one sync
        else:
            target = next(d for d in devices if d.type != "cpu")
            vals = torch.cat([v.to(target, torch.float32) for v in self.values]).tolist()
        rows = [Row(step, m, lp, ly, v) for (m, lp, ly), v in zip(self.keys, vals)]
        self.keys, self.values = [], []
        return rows
