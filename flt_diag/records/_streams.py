"""What the records and the loop hooks share of a stream (a helper of records/, no record: its name starts with _):
the per-token norms of a tensor, kept for the last tensor normed, so that the loop hooks' residual norms and the
fixed-point residual take one norm per loop end, not one each. Torch is imported where a norm is taken (records/ is
torch-free until a record is)."""
from __future__ import annotations

import weakref
from typing import Any

_last_norms: tuple = (None, -1, None)  # (weakref to a tensor, its _version, its per-token norms)


def per_token_norms(x: Any) -> Any:
    """The L2 norm of x's last dim per token, outside autograd by no_grad (not a detach: one dispatched operation
    fewer). The last tensor's norms are kept, by identity and version (a weak reference: the tensor is not kept
    alive), so that the loop hooks and the loop dynamics take one norm per loop end, not one each."""
    import torch
    global _last_norms
    ref, version, norms = _last_norms
    if ref is not None and ref() is x and not x.is_inference() and x._version == version:
        return norms
    with torch.no_grad():
        norms = torch.linalg.vector_norm(x, dim=-1)
    _last_norms = (None, -1, None) if x.is_inference() else (weakref.ref(x), x._version, norms)
    return norms


def alias_norms(alias: Any, x: Any) -> None:
    """`alias` is x.detach() (its storage and version counter): x's kept norms, if kept, are kept for it too."""
    global _last_norms
    ref, version, norms = _last_norms
    if ref is not None and ref() is x and x._version == version and not alias.is_inference():
        _last_norms = (weakref.ref(alias), version, norms)
