"""Both loops the shared callbacks run in are a flt_diag.instruments.callbacks.Host, structurally
(tests/test_typing.py: a type checker finds no error here): flt-diag's own Trainer and the probe's stand-in."""
from __future__ import annotations

from flt_diag.instruments.callbacks import Host
from flt_diag.integrations.folder import Host as ProbeHost
from flt_diag.training.trainer import Trainer


def the_trainer(trainer: Trainer) -> Host:
    return trainer


def the_probe(host: ProbeHost) -> Host:
    return host
