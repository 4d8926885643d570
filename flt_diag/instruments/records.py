"""What every run records besides its metrics table, flt-diag's Trainer and flt_diag.watch alike: the
step's scalars (StepLog) and the environment a run trained in (stored in config.json and summary.json)."""
from __future__ import annotations

import os
import platform
import socket
import sys
import time
from typing import NamedTuple

import numpy
import pandas  # type: ignore[import-untyped]  # (pandas ships no types; pandas-stubs is no dependency)
import torch

from flt_diag.records import all_records
from flt_diag.storage import metric_names as M
from flt_diag.storage.code_version import code_version
from flt_diag.storage.machine import cpu_info


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
    env["cpu"] = cpu_info()  # the CPU's model and SIMD flags: another CPU kind gives other numbers (DESIGN.md §5)
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    env["code"] = code_version()  # the version, commit and clean tree of the code that made the run
    env["flt_diag"] = env["code"]["flt_diag"]
    modules: dict[str, list[str]] = {}  # each record the run knew (by its switch: the config's diagnostics say which
    for r in all_records():  # ran) and the module that defines it (a user's own: its module; records that share
        modules.setdefault(r.switch, []).append(r.module)  # one switch, the loop dynamics: theirs, joined by ", ")
    env["records"] = {switch: ", ".join(names) for switch, names in modules.items()}
    return env


class StepLog:
    """Scalars of one step, kept on the device until `collect` (one host transfer). A recorded step adds a few
    dozen scalars: a 0-d tensor is kept as it is (consecutive ones of one device and dtype are stacked at
    `collect`: no view op each), a Python number as a number (no tensor made for it); all are stored through float32."""

    def __init__(self) -> None:
        self.keys: list[tuple[str, int, int]] = []
        self.values: list[list[torch.Tensor] | torch.Tensor | float] = []  # a run of 0-d tensors, a vector, a number

    def add(self, metric: str, value: torch.Tensor | float, loop: int = M.NONE, layer: int = M.NONE) -> None:
        if not torch.is_tensor(value):
            self.values.append(float(value))
        else:
            v = value.detach() if value.requires_grad else value
            last = self.values[-1] if self.values else None
            if v.dim():
                self.values.append(v.reshape(1))  # (one element, or the error of a value that is not one scalar)
            elif isinstance(last, list) and last[0].device == v.device and last[0].dtype == v.dtype:
                last.append(v)
            else:
                self.values.append([v])
        self.keys.append((metric, loop, layer))  # (after the value: a refused one leaves no key behind)

    def add_vector(self, keys: list[tuple[str, int, int]], values: torch.Tensor) -> None:
        """Several scalars at once: values[i] under keys[i] = (metric, loop, layer)."""
        if len(keys) != values.numel():
            raise ValueError(f"{len(keys)} keys for {values.numel()} values")
        self.keys.extend(keys)
        values = values.detach() if values.requires_grad else values
        self.values.append(values if values.dim() == 1 else values.reshape(-1))

    def collect(self, step: int) -> list[Row]:
        if not self.values:
            return []
        parts = [torch.stack(v) if isinstance(v, list) else v for v in self.values if not isinstance(v, float)]
        vals: list[float] = []
        if parts:
            devices = {v.device for v in parts}
            target = next(d for d in devices if d.type != "cpu") if len(devices) > 1 else parts[0].device
            parts = [v if v.dtype == torch.float32 and v.device == target else v.to(target, torch.float32)
                     for v in parts]  # (each to float32 before the cat: an int next to a float16 stays exact)
            vals = torch.cat(parts).tolist()  # the one sync
        numbers = [v for v in self.values if isinstance(v, float)]
        if numbers:  # each in its place, through float32 as the tensors are
            tensors, floats = iter(vals), iter(torch.tensor(numbers, dtype=torch.float32).tolist())
            vals = []
            for v in self.values:
                if isinstance(v, float):
                    vals.append(next(floats))
                else:
                    vals.extend(next(tensors) for _ in range(len(v) if isinstance(v, list) else v.numel()))
        rows = [Row(step, m, lp, ly, v) for (m, lp, ly), v in zip(self.keys, vals)]
        self.keys, self.values = [], []
        return rows
