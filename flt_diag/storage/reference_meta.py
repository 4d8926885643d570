"""A reference checkpoint's meta_<step>.json (nanochat's GPTConfig and the looped model's K and variant under the
names the reference gives them), as pydantic models (flt_diag.storage.files.check_reference_meta loads with them;
flt_diag.training.reference reads them). Torch-free.
"""
from __future__ import annotations

from typing import Optional

from pydantic import Field

from flt_diag.config.grid_options import Loops
from flt_diag.config.run_config import ModelConfig
from flt_diag.storage.file_models import FreeFileModel, config_type

META_LOOP_KEYS = ("K", "n_loops", "loops", "num_loops")  # "K": the reference's GPTConfig
META_VARIANT_KEYS = ("model_type", "variant", "loop_type")  # "model_type": the reference's GPTConfig


class MetaModelConfig(FreeFileModel):
    """nanochat's sizes (bounded like the command line's), K and the variant under the reference's names (the
    first of META_LOOP_KEYS and META_VARIANT_KEYS that a file holds is read)."""

    sequence_len: Optional[config_type(ModelConfig, "seq_len")] = None  # type: ignore[valid-type]  # (as Summary)
    vocab_size: Optional[config_type(ModelConfig, "vocab_size")] = None  # type: ignore[valid-type]
    n_layer: Optional[config_type(ModelConfig, "depth")] = None  # type: ignore[valid-type]
    n_head: Optional[config_type(ModelConfig, "heads")] = None  # type: ignore[valid-type]
    n_embd: Optional[config_type(ModelConfig, "width")] = None  # type: ignore[valid-type]
    n_kv_head: Optional[config_type(ModelConfig, "heads")] = None  # type: ignore[valid-type]
    K: Optional[Loops] = None
    n_loops: Optional[Loops] = None
    loops: Optional[Loops] = None
    num_loops: Optional[Loops] = None
    model_type: Optional[str] = None
    variant: Optional[str] = None
    loop_type: Optional[str] = None


class ReferenceMeta(MetaModelConfig):
    """A reference checkpoint's meta_<step>.json: the sizes, K and variant at its top, or in its model_config."""

    sizes: Optional[MetaModelConfig] = Field(None, alias="model_config")
