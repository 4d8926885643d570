"""The online early warning (`--warn`, `--stop-on-collapse`): a training callback that computes the
features of flt_diag/judge/early_warning.py from the rows of the running training and checks P(collapse)."""
from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Sequence
from pathlib import Path

from flt_diag.storage import metric_names as M
from flt_diag.storage.folders import load_metrics
from flt_diag.judge.early_warning import (CHECK_EVERY, PACKAGED, WINDOW, RunSeries, evidence_text, features_at,
                                         loop_series, probability)
from flt_diag.config.run_config import DiagnosticsConfig
from flt_diag.storage.file_models import PredictorFile
from flt_diag.storage.files import load_predictor, predictor_of
from flt_diag.instruments.guard import Instrument


def predictor(path: str | None) -> PredictorFile:
    """The early-warning predictor at `path` (None: the packaged one), checked. Read once per
    process and version of the file: settling checks it, the run's warning uses the same copy."""
    try:
        stat = Path(path or PACKAGED).stat()
        version = (stat.st_mtime_ns, stat.st_size)
    except OSError:
        version = None  # load_predictor says what is wrong with it
    return copy.deepcopy(_load_predictor(path, version))


@functools.lru_cache(maxsize=8)
def _load_predictor(path: str | None, version) -> PredictorFile:
    return load_predictor(path)


def collapse_warning(cfg: DiagnosticsConfig, always: bool = False) -> "CollapseWarning | None":
    """The run's early warning, as its diagnostics ask: `--warn` prints, `--stop-on-collapse` prints and stops, the
    predictor `--predictor` (None: the packaged one). None where neither is asked, unless `always` (flt_diag.watch:
    every probe's summary holds the prediction; silent without warn)."""
    if not (always or cfg.warn or cfg.stop_on_collapse):
        return None
    loud = cfg.warn or cfg.stop_on_collapse
    return CollapseWarning(predictor(cfg.predictor), stop=cfg.stop_on_collapse, say=None if loud else (lambda text: None))


class CollapseWarning(Instrument):
    """Checks P(collapse) every `every` steps from the predictor's first fitted step on; the first
    time it reaches the threshold, prints a warning with the evidence, and with `stop` ends the run
    there (verdict collapsed, predicted at that step). Keeps the few series the features need: the
    global ones (GLOBAL), the first and last loop's residual norm, the activation gradient at the first
    and the last block. Added to a run that resumes without its state (`--warn` may change on reuse),
    it reads the series of the steps already trained back from the run's metrics table. A check that fails is said
    once and skipped (the record guard, flt_diag.instruments.guard): the training goes on."""

    RECORDS = {"on_rows": ("early_warning",)}

    GLOBAL = (M.LOSS, M.GRAD_NORM, M.GRAD_COSINE)

    def __init__(self, predictor: dict | PredictorFile, stop: bool = False, threshold: float | None = None, every: int = CHECK_EVERY,
                 say=None):
        self.predictor, self.stop, self.every = predictor_of(predictor), stop, every
        self.threshold = self.predictor.threshold if threshold is None else threshold
        self.rows: list[tuple] = []
        self.warned_at: int | None = None
        self.last: dict | None = None  # the latest check: step, p_collapse, threshold, evidence
        self.say = say or (lambda text: print(text, file=sys.stderr, flush=True))
        self.first = min(self.predictor.models)
        self.restored = False

    def on_start(self, trainer) -> None:
        r = trainer.recipe
        self.loops, self.depth, self.d = r.loops, r.depth, r.width
        self.label = f"{r.variant or 'model'} K={r.loops}"
        if getattr(trainer, "start_step", 0) and not self.restored:
            stored = load_metrics(trainer.run_dir, [*self.GLOBAL, M.RESID_NORM_LOOP_END, M.ACT_GRAD_NORM])
            stored = stored[stored.step < trainer.start_step]
            self._keep((int(step), str(metric), int(loop), int(layer), float(v)) for step, metric, loop, layer, v in
                       stored.itertuples(index=False, name=None))

    def _keep(self, rows) -> None:
        """Only the rows of the series the features read (features_at: loop_series and GLOBAL, each at its own
        (loop, layer)), not the per-group gradient norms that share a metric name with them."""
        keep = {(metric, M.NONE, M.NONE) for metric in self.GLOBAL} | set(loop_series(self.loops, self.depth))
        self.rows += [tuple(r) for r in rows if (r[1], r[2], r[3]) in keep]

    def _forget(self, done: int) -> None:
        """Drop the rows no later check reads: every series but the loss is read over the WINDOW steps before
        the check (the next one is later), the loss over the whole run (its running minimum). The kept rows beside
        the loss stay bounded by the window, not the run's length."""
        oldest = done - WINDOW
        self.rows = [r for r in self.rows if r[0] >= oldest or r[1] == M.LOSS]

    def on_rows(self, trainer, step: int, rows: Sequence[tuple]) -> None:
        if self.warned_at is not None:  # (it warns once: no check reads rows after that)
            return
        self._keep(rows)
        done = step + 1
        if done < self.first or done % self.every:
            return
        feats = features_at(RunSeries.of_rows(self.rows, self.loops, self.depth), done, self.d)
        self._forget(done)
        p, contrib = probability(self.predictor, feats, done)
        text = evidence_text(feats, contrib)
        self.last = dict(step=done, p_collapse=p, threshold=self.threshold, evidence=text)
        if p >= self.threshold:
            self.warned_at = done
            self.say(f"warning: {self.label}: collapse predicted at step {done} (P={p:.2f}; {text})")
            if self.stop:
                trainer.request_stop(f"collapse predicted at step {done}",
                                     prediction=dict(step=done, p_collapse=p, evidence=text, features=feats))

    def state_dict(self) -> dict:
        return {"rows": list(self.rows), "warned_at": self.warned_at}

    def load_state_dict(self, state: dict) -> None:
        self.rows, self.warned_at = [tuple(r) for r in state["rows"]], state["warned_at"]
        self.restored = True
