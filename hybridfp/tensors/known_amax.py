"""max|x| of a tensor, recorded by the kernel that wrote it, for per-tensor-scaled quantizers.

A per-tensor current-scaling quantizer reads its input twice: once for the amax, once to cast.
When the kernel that produced the tensor (the fused SwiGLU, forward and backward) computes the
amax of what it stores on the way, the quantizer's amax pass is a second read of memory that
can be skipped. The amax is exactly the one the quantizer would compute (the max is exact:
the same FP32 bits, NaN as the canonical quiet NaN).

An entry hangs off the tensor's storage (weakly: it dies with the memory) and is found by any
view covering the same elements: same storage offset, element count, dtype, and both
contiguous. The version counter, which views share, invalidates it on any in-place write.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

#: untyped storage -> {(storage offset, numel, dtype): (version, amax FP32 0-d tensor)}.
_TABLE: WeakIdKeyDictionary = WeakIdKeyDictionary()


def remember(x: torch.Tensor, amax: torch.Tensor) -> None:
    """Record ``amax`` (FP32 0-d, on x's device) as max|x| of the contiguous tensor ``x``."""
    if not x.is_contiguous() or x.is_inference():
        return  # no element range / no version counter to validate against
    if amax.dtype != torch.float32 or amax.dim() != 0 or amax.device != x.device:
        raise ValueError(f"known_amax.remember: amax must be a 0-d float32 tensor on {x.device}; "
                         f"got {amax.dtype} {tuple(amax.shape)} on {amax.device}.")
    key = (x.storage_offset(), x.numel(), x.dtype)
    _TABLE.setdefault(x.untyped_storage(), {})[key] = (x._version, amax)


def recall(x: torch.Tensor) -> Optional[torch.Tensor]:
    """The amax recorded for exactly ``x``'s elements, unchanged since, else None."""
    if not x.is_contiguous() or x.is_inference():
        return None
    entries = _TABLE.get(x.untyped_storage())
    if not entries:
        return None
    hit = entries.get((x.storage_offset(), x.numel(), x.dtype))
    return hit[1] if hit is not None and hit[0] == x._version else None


def clear() -> None:
    """Forget every recorded amax."""
    _TABLE.clear()
