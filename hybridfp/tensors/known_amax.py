"""max|x| of a tensor, recorded by the kernel that wrote it, for per-tensor-scaled quantizers.

A per-tensor current-scaling quantizer reads its input twice: once for the amax, once to cast.
When the kernel that produced the tensor (the fused SwiGLU, forward and backward) computes the
amax of what it stores on the way, the quantizer's amax pass is a second read of memory that
can be skipped. The amax is exactly the one the quantizer would compute (the max is exact:
the same FP32 bits, NaN as the canonical quiet NaN).

An entry hangs off the tensor's storage (weakly: it dies with the memory) and is found by any
view covering the same elements: same storage offset, element count, dtype, and both
contiguous. The version counter, which views share, invalidates it on any in-place write.

With ``splits`` an entry holds the amax of each row group instead (an MoE layer's experts: FP8
current scaling gives each expert the scale of its own rows' amax), found only under the same
splits.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

#: untyped storage -> {(storage offset, numel, dtype, splits, row width): (version, amax FP32 tensor)}.
_TABLE: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _groups(splits: Optional[Sequence[int]]) -> Optional[tuple[int, ...]]:
    # map: C-level, no Python frame per group (an MoE layer asks for each expert's every call)
    return None if splits is None else tuple(map(int, splits))


def _key(x: torch.Tensor, groups: Optional[tuple[int, ...]]) -> tuple:
    """The entry's key: x's elements, and for row groups also the row width they are rows of."""
    return (x.storage_offset(), x.numel(), x.dtype, groups, None if groups is None else x.shape[-1])


def remember(x: torch.Tensor, amax: torch.Tensor, splits: Optional[Sequence[int]] = None) -> None:
    """Record ``amax`` (FP32, on x's device) as max|x| of the contiguous tensor ``x``: 0-d, or
    with ``splits`` (rows of each group of x's rows, its last dimension the columns) one value
    per group, [len(splits)].

    Raises
    ------
    ValueError
        ``amax`` of another dtype, shape or device; ``splits`` that do not add up to x's rows.
    """
    groups = _groups(splits)
    shape = () if groups is None else (len(groups),)
    if amax.dtype != torch.float32 or tuple(amax.shape) != shape or amax.device != x.device:
        raise ValueError(f"known_amax.remember: amax must be a float32 tensor of shape {shape} on {x.device}; "
                         f"got {amax.dtype} {tuple(amax.shape)} on {amax.device}.")
    if groups is not None and (x.dim() == 0 or sum(groups) * x.shape[-1] != x.numel()):
        raise ValueError(f"known_amax.remember: splits {list(groups)} do not cover the rows of a tensor "
                         f"of shape {tuple(x.shape)}.")
    if not x.is_contiguous() or x.is_inference():
        return  # no element range / no version counter to validate against
    key = _key(x, groups)
    _TABLE.setdefault(x.untyped_storage(), {})[key] = (x._version, amax)


def recall(x: torch.Tensor, splits: Optional[Sequence[int]] = None) -> Optional[torch.Tensor]:
    """The amax recorded for exactly ``x``'s elements (with ``splits``: for those row groups),
    unchanged since, else None."""
    if not x.is_contiguous() or x.is_inference():
        return None
    entries = _TABLE.get(x.untyped_storage())
    if not entries:
        return None
    hit = entries.get(_key(x, _groups(splits)))
    return hit[1] if hit is not None and hit[0] == x._version else None


def clear() -> None:
    """Forget every recorded amax."""
    _TABLE.clear()
