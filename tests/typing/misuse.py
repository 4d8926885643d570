"""Misuse of the public API that a type checker must report (tests/test_typing.py): one error per line marked."""
import torch.nn as nn

import flt_diag
from flt_diag.integrations.hf import FltDiagCallback


def train(model: nn.Module) -> None:
    flt_diag.watch(model, folder="runs/x", warmdown="20%")  # error: arg-type
    FltDiagCallback(folder="runs/hf", warn="yes")  # error: arg-type
    probe = flt_diag.watch(model)
    verdict: int = probe.verdict().verdict  # error: assignment
    print(probe.verdict()["verdict"])  # error: index
    print(verdict)
