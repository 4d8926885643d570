"""Settling a run's config, once, before anything runs.

Options (from the command line, a study file or a Python call) become one RunConfig that is ready to
run: the preset and the device are decided (auto: cuda where this machine has CUDA, else cpu), the
vocabulary is the tokenizer's (padded to a multiple of 64), the corpus and the tokenizer file exist,
and the early-warning predictor loads when the run will use it. Every problem is one ValueError line
(DataError for data). The Trainer, the sweeps and the maps take a settled config as given: they
neither settle nor validate it again (the Trainer only refuses a config that did not come through
here, `check_settled`). `comparable` and `differences`: the fields that decide what a run computes, to
check a run, sweep or map folder against a new command. No torch is imported but by `_cuda_devices`.

    from flt_diag.training.settle import run_config
    cfg = run_config(dict(preset="tiny", loops=6, steps=200, device="cpu"))  # then Trainer(cfg, "runs/x")
"""
from __future__ import annotations

import re
from pathlib import Path

from flt_diag.instruments.warning_callback import predictor
from flt_diag.config.run_config import (TASK_DIALS, TASKS, DiagnosticsConfig, ModelConfig, RunConfig, TrainConfig, build_config,
                                        given_sections, padded_vocab, replaced)
from flt_diag.config.option_fields import check, with_fact
from flt_diag.data.corpus import DataError, get_tokenizer, resolve_corpus
from flt_diag.data.tasks import bytes_only, make_task

# Fields that may differ when a run folder is reused (they do not change what is computed: their fields say
# volatile=True; the loop-dynamics switches change what is recorded, never the trajectory).
VOLATILE_TRAIN_FIELDS, VOLATILE_DIAGNOSTICS_FIELDS = with_fact(TrainConfig, "volatile"), with_fact(DiagnosticsConfig,
                                                                                                    "volatile")
DEVICE = re.compile(r"auto|cpu(?::\d+)?|cuda(?::(\d+))?")


def run_config(given: dict, **grid) -> RunConfig:
    """The settled RunConfig of the config options given (flat option values by flag or field name, and the
    preset; None = not given), with the fields a grid sets per cell (variant, loops, seed, lr_scale) where given."""
    return settle(unsettled_config(given, **grid))


def unsettled_config(given: dict, **grid) -> RunConfig:
    """The same config, checked but not settled (a grid's `--list` runs nothing, so it needs no tokenizer):
    the preset is decided, the device and the vocabulary are not."""
    sections = given_sections({**{k: v for k, v in given.items() if k != "preset"},
                               **{k: v for k, v in grid.items() if v is not None}})
    if sections["diagnostics"].get("stop_on_collapse"):
        sections["diagnostics"]["warn"] = True
    cuda = choose_device(sections["train"].get("device") or "auto").startswith("cuda")
    return build_config(given.get("preset") or "auto", cuda, **sections)


def settle(cfg: RunConfig) -> RunConfig:
    """A copy of `cfg` ready to run (device decided, vocabulary from the tokenizer, corpus, tokenizer
    and predictor checked); `cfg` itself is not changed. Settling a settled config changes nothing."""
    if cfg.model.variant is None:
        raise ValueError("variant is unset: flt-diag's Trainer trains one of its variants (lt, lt-ii, lt-ai, fla, flt)")
    device = choose_device(cfg.train.device)
    check_data(cfg.train.data, cfg.train.tokenizer, cfg)
    d = cfg.diagnostics
    if d.warn or d.stop_on_collapse or d.predictor is not None:
        predictor(d.predictor)
    # the two settled values alone are checked against their fields (the rest was validated when `cfg` was built:
    # `loops` and every other option are checked where they are declared, once, not again here)
    vocab = check(ModelConfig.model_fields["vocab_size"].rebuild_annotation(),
                  padded_vocab(tokenizer_vocab(cfg.train.tokenizer)), "vocab_size", ModelConfig.model_fields["vocab_size"])
    return cfg.model_copy(update=dict(model=cfg.model.model_copy(update=dict(vocab_size=vocab)),
                                      train=cfg.train.model_copy(update=dict(device=device))))


def check_settled(cfg: RunConfig, tokenizer_vocab: int) -> None:
    """The Trainer's guard: a config that did not come through `settle` is refused (one line)."""
    if cfg.train.device == "auto" or cfg.model.vocab_size != padded_vocab(tokenizer_vocab):
        raise ValueError(f"the config is not settled (device {cfg.train.device}, vocabulary {cfg.model.vocab_size} "
                         f"for a tokenizer of {tokenizer_vocab}); pass it through flt_diag.training.settle.settle first")


def choose_device(name: str) -> str:
    """auto -> cuda or cpu; cpu, cuda and cuda:N are checked against this machine."""
    match = DEVICE.fullmatch(name)
    if match is None:
        raise ValueError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N")
    if name.startswith("cpu"):
        return "cpu"
    gpus = _cuda_devices()
    if name == "auto":
        return "cuda" if gpus else "cpu"
    if not gpus:
        raise ValueError("device cuda requested but CUDA is not available")
    if match.group(1) is not None and int(match.group(1)) >= gpus:
        raise ValueError(f"device {name} requested but there are {gpus} GPUs")
    return name


def _cuda_devices() -> int:
    import torch  # only here, and only for a device other than cpu: torch is what knows whether there is CUDA
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_data(data: str, tokenizer: str | None, cfg: RunConfig | None = None) -> None:
    """The corpus or task is one flt-diag can read (with the run's config, a task's dials against its
    sequence length), and a tokenizer given as a file exists (DataError)."""
    if data not in TASKS:
        resolve_corpus(data)
    elif cfg is None:
        bytes_only(data, tokenizer)
    else:
        make_task(replaced(cfg.train, data=data, sampling="random"), cfg.model.seq_len)
    if tokenizer is not None and tokenizer.endswith(".json") and not Path(tokenizer).exists():
        raise DataError(f"tokenizer file {tokenizer} does not exist")


def tokenizer_vocab(name: str | None) -> int:
    """The tokenizer's vocabulary size; one DataError line if it cannot be loaded."""
    if name is None:
        raise DataError("a run needs a tokenizer (--tokenizer)")
    try:
        return get_tokenizer(name).vocab_size
    except DataError as e:
        if "Qwen" not in name:
            raise
        raise DataError(f"{e} (paper presets use the reference's Qwen3 tokenizer: fetch it once with network "
                        "access, or pass --tokenizer path/to/tokenizer.json)") from None


def comparable(cfg_dict: dict) -> dict:
    """The parts of a config that decide what a run computes (verdict thresholds, logging
    mirrors and intervals, and the dials of a task the run does not train on, can change without
    invalidating a run folder; folders written before the task dials existed still resume)."""
    d = {k: dict(v) if isinstance(v, dict) else v for k, v in cfg_dict.items()
         if k not in ("env", "corpus", "verdict", "imported_from", "note", "n_params")}
    data = d["train"].get("data")  # (None: no task)
    for k in (*VOLATILE_TRAIN_FIELDS, *set(TASK_DIALS) - set(TASKS.get(data, ()))):  # type: ignore[arg-type]
        d["train"].pop(k, None)  # (and the dials of a task its data does not read)
    for k in VOLATILE_DIAGNOSTICS_FIELDS:
        d.get("diagnostics", {}).pop(k, None)
    if isinstance(d.get("model"), dict) and d["model"].get("strength", 1.0) == 1.0:
        d["model"].pop("strength", None)  # (folders written before --strength ran at 1: they still resume)
    return d


def differences(a: dict, b: dict) -> list[str]:
    """`section.field: old -> new` for every field in which two (comparable) configs differ."""
    out = []
    for section in sorted(set(a) | set(b)):
        sa, sb = a.get(section), b.get(section)
        if isinstance(sa, dict) and isinstance(sb, dict):
            out += [f"{section}.{k}: {sa.get(k)!r} -> {sb.get(k)!r}" for k in sorted(set(sa) | set(sb))
                    if sa.get(k) != sb.get(k)]
        elif sa != sb:
            out.append(f"{section}: {sa!r} -> {sb!r}")
    return out
