"""Whether an FP32 master shard still holds the values its quantized copies were encoded from.

A version counter misses writes through ``.data`` or another tensor sharing the storage, so the
quantized primary weights (``fsdp_primary.py``, ``tensor_parallel_primary.py``) also compare a
fingerprint taken when they encoded: the shard's amax and its float64 sum, compared bitwise.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..formats.common import amax_nan


def fingerprint(x: torch.Tensor) -> torch.Tensor:
    """``x``'s amax (NaN kept) and float64 sum, as one float64 tensor of two elements.

    Parameters
    ----------
    x:
        A master shard (detached inside).

    Returns
    -------
    torch.Tensor
        ``[amax, sum]`` in float64, on ``x``'s device (one pass each over ``x``).

    Example
    -------
    >>> import torch
    >>> fingerprint(torch.tensor([1.0, -3.0])).tolist()
    [3.0, -2.0]
    """
    x = x.detach()
    return torch.stack([amax_nan(x).double().reshape(()), x.sum(dtype=torch.float64)])


def same_fingerprint(a: torch.Tensor, b: Optional[torch.Tensor]) -> bool:
    """Whether fingerprints ``a`` and ``b`` are bitwise equal (NaN equals NaN); False for a
    missing ``b``. Reads the result on the host (one synchronization on a GPU).

    Parameters
    ----------
    a, b:
        Fingerprints from :func:`fingerprint` (``b`` may live on another device, or be None).

    Returns
    -------
    bool

    Example
    -------
    >>> import torch
    >>> x = torch.tensor([1.0, float("nan")])
    >>> same_fingerprint(fingerprint(x), fingerprint(x.clone()))
    True
    """
    return b is not None and bool(torch.equal(a.view(torch.int64), b.to(a.device).view(torch.int64)))
