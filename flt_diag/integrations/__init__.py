"""The public probe, `flt_diag.watch` (docs/api.md): flt-diag's instruments on a looped model flt-diag did not
build, trained by any loop - watch.py (the function), loop_probe.py and moments.py (LoopProbe: its hooks, run
folder and the moments of a step), options.py, checks.py, model.py, folder.py, results.py - and the same probe as
callbacks of the training frameworks the field uses, each an optional extra imported only when used: `hf`
(transformers' Trainer, extra hf-trainer) and `lightning` (Lightning's Trainer, extra lightning)."""
from __future__ import annotations

from collections.abc import Mapping

import torch

from flt_diag.instruments.loop_hooks import ProbeError


def needs_extra(module: str, extra: str, package: str) -> ImportError:
    """The one-line error of an integration imported without its extra."""
    return ImportError(f"flt_diag.integrations.{module} needs {package}: pip install 'flt-diag[{extra}]'")


def output_loss(output) -> torch.Tensor:
    """The loss in a model's output: output["loss"] (a dict, a Hugging Face ModelOutput), output.loss,
    or the tensor itself."""
    if isinstance(output, Mapping) and output.get("loss") is not None:
        return output["loss"]
    if torch.is_tensor(getattr(output, "loss", None)):
        return output.loss
    if torch.is_tensor(output) and output.dim() == 0:
        return output
    raise ProbeError(f"the model returned {type(output).__name__} with no loss; give loss= (output -> loss tensor)")
