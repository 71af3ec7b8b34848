"""Quantize-kernel registry: fast implementations of a quantizer's ``encode`` by device.

A kernel registers for a quantizer class name with ``supports(q, x, rowwise, columnwise)``
and ``run(q, x, rowwise, columnwise, seed) -> storage``; it must produce exactly the storage
``q.reference_encode`` would (kernels are tested bitwise against it). ``Quantizer.encode``
takes the first kernel that supports the call, else the PyTorch reference. On a GPU, running
the reference because no kernel fits is reported once per quantizer configuration.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch


class ReferenceQuantizeWarning(UserWarning):
    """A quantization on a GPU ran the PyTorch reference because no fast kernel fits."""


@dataclass(frozen=True)
class QuantizeKernel:
    """A fast ``encode`` for some configurations of one quantizer class."""

    name: str
    supports: Callable[..., bool]
    run: Callable[..., Any]


QUANTIZE_KERNELS: dict[str, list[QuantizeKernel]] = {}
_ENABLED = [True]
_REPORTED: set[str] = set()


def register_quantize_kernel(quantizer_class: str, kernel: QuantizeKernel) -> None:
    """Register ``kernel`` for quantizers of class name ``quantizer_class`` (latest first)."""
    QUANTIZE_KERNELS.setdefault(quantizer_class, []).insert(0, kernel)


@contextmanager
def kernels_enabled(enabled: bool) -> Iterator[None]:
    """Turn fast quantize kernels off (or on) inside the block, e.g. to compare with the
    reference."""
    old = _ENABLED[0]
    _ENABLED[0] = enabled
    try:
        yield
    finally:
        _ENABLED[0] = old


def select_quantize_kernel(q: Any, x: torch.Tensor, rowwise: bool, columnwise: bool) -> Optional[QuantizeKernel]:
    """The kernel for this call, or None (reference). Reports a GPU fallback once."""
    if not _ENABLED[0]:
        return None
    for k in QUANTIZE_KERNELS.get(type(q).__name__, ()):
        if k.supports(q, x, rowwise, columnwise):
            return k
    if x.is_cuda and q.has_fast_kernels:
        copies = "+".join(d for d, on in (("rowwise", rowwise), ("columnwise", columnwise)) if on)
        role = f" for {q.label}" if q.label else ""
        what = f"{q!r}{role} ({copies}, {x.dtype})"
        if what not in _REPORTED:
            _REPORTED.add(what)
            warnings.warn(f"hybridfp: no fast quantize kernel for {what} on {x.device}; running the "
                          "PyTorch reference (exact, slower).", ReferenceQuantizeWarning, stacklevel=4)
    return None
