"""Reading torch files a user may have been sent (checkpoint.pt, resume.pt, reference checkpoints):
always `weights_only=True` - tensors, numbers, strings and containers, never code - and any failure
(missing, truncated, corrupt, crafted) as one StorageError line."""
from __future__ import annotations

from pathlib import Path

import torch

from .storage import StorageError


def load(path, map_location="cpu"):
    path = Path(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise StorageError(f"missing {path}") from None
    except Exception as e:  # unpickling errors, zip errors, refused globals, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StorageError(f"unreadable {path}: {first}") from None
