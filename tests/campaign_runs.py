"""A cell runner for the campaign tests (tests/test_campaigns.py), importable by a child process: it writes a
probe's run folder as the Trainer would, in its order (config.json, metrics, summary.json last, each atomically),
without training: the probe breaks ("collapsed") where its lr scale is above THRESHOLD x (1 + 0.1 x seed). Each
finished probe is appended to `log` (one name a line) after its summary.json is written; `pause` seconds between
the files leave a kill room to land mid-probe. It holds the probe's lock while it writes, as the Trainer does."""
from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

from conftest import tiny_config
from flt_diag.judge.verdict import summarize
from flt_diag.storage.folders import CELLS, CONFIG, SUMMARY, MetricsWriter, folder_lock, load_metrics, write_json

THRESHOLD = 1.3
CODE = {"flt_diag": "0.1.0", "commit": "abcdef0123456789abcdef0123456789abcdef01", "clean": True}


def breaks(cell) -> bool:
    return cell.lr_scale > THRESHOLD * (1 + 0.1 * cell.seed)


class Probe:
    def __init__(self, log: Path | None = None, pause: float = 0.0, code: dict | None = None):
        self.log, self.pause, self.code, self.runs = log, pause, code or CODE, []

    def __call__(self, cfg, cell, out, *rest, **named) -> str:
        d = Path(out) / CELLS / cell.name
        with folder_lock(d, root=Path(out)):
            for p in d.iterdir():  # a killed attempt's files (or a finished run's, if asked again: the log tells)
                if p.name != ".lock":
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
            self.runs.append(cell.name)
            stored = tiny_config(variant=cell.variant, loops=cell.loops, seed=cell.seed, lr_scale=cell.lr_scale,
                                 steps=10)
            write_json(d / CONFIG, stored.to_dict() | {"env": {"code": self.code, "host": "test"}})
            time.sleep(self.pause)
            w = MetricsWriter(d)
            for step in range(10):
                w.add(step, "loss", -1, -1, 3.0 - 0.1 * step)
            w.flush()
            time.sleep(self.pause)
            write_json(d / SUMMARY, summarize(load_metrics(d), stored).as_written()
                       | dict(verdict="collapsed" if breaks(cell) else "stable"))
        if self.log is not None:
            with open(self.log, "a") as f:
                f.write(cell.name + "\n")
                f.flush()
                os.fsync(f.fileno())
        return "done"


def main(out: str, archive: str, log: str, pause: str) -> None:
    """A child process's campaign: the map of tests/test_campaigns.py's kill test, archived as it goes."""
    from flt_diag.grids.campaign import CampaignOptions
    from flt_diag.grids.stability_map import run_map
    from flt_diag.results.run_archiver import FolderArchive
    from test_campaigns import kill_spec
    run_map(kill_spec(), Path(out), runner=Probe(Path(log), float(pause)), report=lambda s: None,
            options=CampaignOptions(archive=FolderArchive(Path(archive))))


if __name__ == "__main__":
    main(*sys.argv[1:])
