"""The probe: one run's instruments behind one record guard, and the order they run in at each moment - the
diagnostics (their hooks on the blocks), the loop dynamics those hooks feed, the online early warning. flt-diag's
Trainer runs one on its own model as its first callback; LoopProbe, what flt_diag.watch returns, holds one
(`LoopProbe.probe`) and drives its moments from the hooks of a model it did not build. Both build and order their
instruments here, so the two cannot drift apart."""
from __future__ import annotations

from flt_diag.config.run_config import DiagnosticsConfig
from flt_diag.instruments.callbacks import Callback, Host
from flt_diag.instruments.diagnostics import DiagnosticsCallback
from flt_diag.instruments.dynamics_callback import LoopDynamicsCallback
from flt_diag.instruments.guard import MOMENTS, Records
from flt_diag.instruments.warning_callback import CollapseWarning


class Probe(Callback):
    """The instruments of a run: `build(groups, ...)` makes the diagnostics (again where the blocks change: watch's
    blocks="auto"); `start(host, part)` starts one where its host is ready for it (on_start: all); every other moment
    goes to the started ones, in the order diagnostics, loop dynamics, early warning. Its state (resume.pt) is each
    part's, by class name."""

    def __init__(self, cfg: DiagnosticsConfig, dynamics: LoopDynamicsCallback | None = None,
                 warning: CollapseWarning | None = None):
        self.cfg, self.dynamics, self.warning = cfg, dynamics, warning
        self.diag: DiagnosticsCallback | None = None
        self.records = dynamics.records if dynamics is not None else Records()  # (one guard: not_recorded names all)
        if warning is not None:
            warning.records = self.records
        self.started: list[Callback] = []

    def build(self, groups: dict[str, list], **diagnostics) -> DiagnosticsCallback:
        """The diagnostics of the parameter `groups` (`diagnostics`: DiagnosticsCallback's hooks, grad_scale, for a
        model flt-diag did not write), whose hooks feed the loop dynamics each recorded loop end."""
        d = self.dynamics
        assert d is not None  # (the diagnostics feed the loop dynamics)
        self.diag = DiagnosticsCallback(self.cfg, groups, loop_end=[d.loop_end], head=d.head, targets=d.targets_of,
                                        **diagnostics)
        self.diag.records = self.records
        return self.diag

    def at_step(self, targets=None) -> None:
        """probe.step(targets=): the records whose finish is at the step (the exit loss of the kept loop ends)."""
        if self.diag is not None and self.diag in self.started:
            self.diag.at_step(targets)

    @property
    def parts(self) -> list[Callback]:
        return [p for p in (self.diag, self.dynamics, self.warning) if p is not None]

    def start(self, host: Host, part: Callback | None) -> None:
        if part is not None and part not in self.started:
            part.on_start(host)
            self.started = [p for p in self.parts if p in self.started or p is part]

    def on_start(self, trainer: Host) -> None:
        for part in self.parts:
            self.start(trainer, part)

    def on_end(self, trainer: Host) -> None:
        started, self.started = self.started, []
        for part in started:
            part.on_end(trainer)

    def state_dict(self) -> dict:
        return {type(p).__name__: p.state_dict() for p in self.parts}

    def load_state_dict(self, state: dict) -> None:
        for p in self.parts:
            if type(p).__name__ in state:
                p.load_state_dict(state[type(p).__name__])


def _to_started(moment: str):
    """A moment of the Probe (each per-step one, on_finish, on_summary): to every started part, in order."""
    def forward(self: Probe, trainer: Host, *args) -> None:
        for part in self.started:
            getattr(part, moment)(trainer, *args)
    forward.__name__, forward.__qualname__ = moment, f"Probe.{moment}"
    return forward


for _moment in (*MOMENTS, "on_finish", "on_summary"):
    setattr(Probe, _moment, _to_started(_moment))
