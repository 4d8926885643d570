"""Optional mirrors of the metrics table for TensorBoard and Weights & Biases (off by default).

The run folder's Parquet table stays the source of truth; these only copy rows, named
"<metric>" or "<metric>/loop<t>/layer<i>". `ExternalSinks` is the Trainer's callback for them.
"""
from __future__ import annotations

from pathlib import Path

from flt_diag.instruments.callbacks import Callback
from flt_diag.storage.metric_names import NONE


def tag(metric: str, loop: int, layer: int) -> str:
    return "/".join([metric] + ([f"loop{loop}"] if loop != NONE else []) + ([f"layer{layer}"] if layer != NONE else []))


class TensorBoardSink:
    def __init__(self, run_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ValueError("--tensorboard needs `pip install tensorboard`") from e
        self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def extend(self, rows) -> None:
        for step, metric, loop, layer, value in rows:
            self.writer.add_scalar(tag(metric, loop, layer), value, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, project: str, run_dir: Path, config: dict):
        try:
            import wandb
        except ImportError as e:
            raise ValueError("--wandb needs `pip install wandb`") from e
        self.run = wandb.init(project=project, name=Path(run_dir).name, config=config, dir=str(run_dir))

    def extend(self, rows) -> None:
        by_step: dict[int, dict] = {}
        for step, metric, loop, layer, value in rows:
            by_step.setdefault(step, {})[tag(metric, loop, layer)] = value
        for step, values in sorted(by_step.items()):
            self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class ExternalSinks(Callback):
    """The mirrors a run asks for (rank 0): `--tensorboard`, `--wandb <project>`; rows as they come,
    closed at the end."""

    def __init__(self):
        self.sinks: list = []

    def on_start(self, trainer) -> None:
        d, cfg = trainer.run_dir, trainer.cfg
        if trainer.is_main and cfg.diagnostics.tensorboard:
            self.sinks.append(TensorBoardSink(d))
        if trainer.is_main and cfg.diagnostics.wandb:
            self.sinks.append(WandbSink(cfg.diagnostics.wandb, d, cfg.to_dict()))

    def on_rows(self, trainer, step, rows) -> None:
        for sink in self.sinks:
            sink.extend(rows)

    def on_end(self, trainer) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []
