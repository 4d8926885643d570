"""The run folder of a probe (flt_diag.probe.watch): the RunConfig it stores for the user's model (its
shape as seen by the hooks, the loops it ran) and config.json with what the probe saw. `self` is the
LoopProbe. `Host`: what the training callbacks read of a Trainer, for a loop flt-diag does not run."""
from __future__ import annotations

from pathlib import Path

import torch

from flt_diag.storage.folders import CONFIG, write_json
from flt_diag.instruments.diagnostics import ProbeError
from flt_diag.probe.model import head_count_of, vocab_size_of
from flt_diag.instruments.records import StepLog, environment
from flt_diag.vocab.config import ModelConfig, RunConfig, TrainConfig


def probe_run_config(self, steps: int) -> RunConfig:
    if self.shape is None:
        raise ProbeError("step() came before any recorded training forward of the model: call it after each "
                         "optimizer step, with the model in training mode")
    width = self.shape[-1]
    batch, seq = (self.shape[0], self.shape[1]) if len(self.shape) >= 3 else (1, self.shape[0])
    loops = self.loops_seen.most_common(1)[0][0] if self.loops_seen else 1
    try:
        model = ModelConfig(vocab_size=self.vocab_size or vocab_size_of(self.model, self.head) or 1,
                            n_layer=len(self.blocks), n_embd=width, n_head=head_count_of(self.blocks, width),
                            sequence_len=max(2, seq), variant=self.variant, loops=max(1, loops))
    except ValueError as e:
        raise ProbeError(f"the model's shape cannot be stored: {str(e).splitlines()[0]}") from None
    device = next(iter(self.params)).device if self.params else torch.device("cpu")
    train = TrainConfig(steps=max(1, steps), batch_size=batch, seed=self.seed, data="external", tokenizer=None,
                        device=device.type, eval_every=0, checkpoint_every=0, grad_clip=0)
    return RunConfig(model=model, train=train, diagnostics=self.dcfg)

def write_probe_config(self, cfg: RunConfig) -> None:
    device = torch.device(cfg.train.device)
    write_json(self.folder / CONFIG, {
        **cfg.to_dict(), "n_params": sum(p.numel() for p in self.model.parameters()), "env": environment(device),
        "note": self.note or f"{type(self.model).__name__} diagnosed by flt_diag.watch; the train section's "
                             "recipe fields are flt-diag's defaults, not this model's",
        **({"corpus": {"unigram_entropy": self.unigram_entropy}} if self.unigram_entropy is not None else {}),
        "probe": {"model": type(self.model).__name__, "blocks": self.names,
                  "loops_counted": "from the blocks' calls" if self.boundary is None else "at a loop boundary",
                  "loops_seen": {str(k): n for k, n in sorted(self.loops_seen.items())},
                  "parameter_groups": list(self.groups)}})


class Host:
    """What the training callbacks read of a Trainer, for a loop flt-diag does not run."""

    def __init__(self, model, run_dir: Path):
        self.model, self.run_dir, self.log = model, run_dir, StepLog()
        self.cfg: RunConfig | None = None
        self.start_step, self.is_main = 0, True
        self.stop_requested: str | None = None
        self.prediction: dict | None = None

    def request_stop(self, reason: str, prediction: dict | None = None) -> None:
        self.stop_requested, self.prediction = reason, prediction
