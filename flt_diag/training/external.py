"""Optional mirrors of the metrics table for TensorBoard and Weights & Biases (off by default).

The run folder's Parquet table stays the source of truth; these only copy rows, named
"<metric>" or "<metric>/loop<t>/layer<i>". `ExternalSinks` is the Trainer's callback for them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from flt_diag.instruments.callbacks import Callback
from flt_diag.storage.metric_names import NONE


def tag(metric: str, loop: int, layer: int) -> str:
    return "/".join([metric] + ([f"loop{loop}"] if loop != NONE else []) + ([f"layer{layer}"] if layer != NONE else []))


class ExternalSinks(Callback):
    """The mirrors a run asks for (rank 0): `--tensorboard` (a SummaryWriter writing to <run>/tensorboard),
    `--wandb <project>` (a W&B run, one log call per step); rows as they come, closed at the end."""

    def __init__(self):
        self.tensorboard: Any = None  # (a SummaryWriter)
        self.wandb: Any = None  # (a wandb run)

    def on_start(self, trainer) -> None:
        d, cfg = Path(trainer.run_dir), trainer.cfg
        if trainer.is_main and cfg.diagnostics.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ValueError("--tensorboard needs `pip install tensorboard`") from e
            self.tensorboard = SummaryWriter(str(d / "tensorboard"))
        if trainer.is_main and cfg.diagnostics.wandb:
            try:
                import wandb
            except ImportError as e:
                raise ValueError("--wandb needs `pip install wandb`") from e
            self.wandb = wandb.init(project=cfg.diagnostics.wandb, name=d.name, config=cfg.to_dict(), dir=str(d))

    def on_rows(self, trainer, step, rows) -> None:
        by_step: dict[int, dict] = {}
        for step, metric, loop, layer, value in rows:
            if self.tensorboard is not None:
                self.tensorboard.add_scalar(tag(metric, loop, layer), value, step)
            by_step.setdefault(step, {})[tag(metric, loop, layer)] = value
        if self.wandb is not None:
            for step, values in sorted(by_step.items()):
                self.wandb.log(values, step=step)

    def on_end(self, trainer) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
        self.tensorboard = self.wandb = None
