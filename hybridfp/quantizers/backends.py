"""Quantize-kernel registry: fast implementations of a quantizer's ``encode`` by device.

A kernel registers for a quantizer class (looked up by ``type(q)``: exactly that class) with ``supports(q, x, rowwise, columnwise)``
and ``run(q, x, rowwise, columnwise, seed) -> storage``; it must produce exactly the storage
``q.reference_encode`` would (kernels are tested bitwise against it). ``Quantizer.encode``
takes the first kernel that supports the call, else the PyTorch reference. On a GPU, running
the reference because no kernel fits is reported once per quantizer configuration.

Fused hybrid kernels (one pass writing a ``HybridQuantizer``'s two copies) are looked up by the
pair of its children's *kernel keys* and its ``columnwise_source``: each quantizer class
registers a function ``key(q, direction) -> hashable or None`` naming the kernel variant its
settings select for that direction's copy (e.g. ``("mxfp8", "1d")``), and a fused kernel
registers for ``(rowwise key, columnwise key, source)``. No pair registered: the hybrid runs
its children one after the other (each with its own kernel).

Row-mapped columnwise kernels (``register_row_mapped_kernel``) encode the columnwise copy of
rows gathered through a row map (zero rows where the map is negative): the zero-padded row
groups of a grouped columnwise block copy, read in place instead of written out first.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional

import torch

from ..config import current_policy


class ReferenceQuantizeWarning(UserWarning):
    """A quantization on a GPU ran the PyTorch reference because no fast kernel fits."""


@dataclass(frozen=True)
class QuantizeKernel:
    """A fast ``encode`` for some configurations of one quantizer class."""

    name: str
    supports: Callable[..., bool]
    run: Callable[..., Any]


#: quantizer class -> its kernels, latest registration first.
QUANTIZE_KERNELS: dict[type, list[QuantizeKernel]] = {}
#: quantizer class -> key(q, direction): the kernel variant q's settings select (or None).
KERNEL_KEYS: dict[type, Callable[[Any, str], Optional[Hashable]]] = {}
#: (rowwise child's key, columnwise child's key, columnwise_source) -> fused hybrid kernel.
HYBRID_QUANTIZE_KERNELS: dict[tuple[Hashable, Hashable, str], QuantizeKernel] = {}
#: quantizer class -> (supports(q, x2, rows), run(q, x2, row_map, rowwise) -> (rowwise storage of x2
#: or None, columnwise storage of the gathered rows)).
ROW_MAPPED_KERNELS: dict[type, tuple[Callable[..., bool], Callable[..., Any]]] = {}
_REPORTED: set[str] = set()


def register_quantize_kernel(quantizer_class: type, kernel: QuantizeKernel) -> None:
    """Register ``kernel`` for quantizers of class ``quantizer_class`` (latest first).

    Parameters
    ----------
    quantizer_class:
        The quantizer class; instances of exactly this class use the kernel.
    kernel:
        Its ``supports`` / ``run`` pair; tried before kernels registered earlier.
    """
    QUANTIZE_KERNELS.setdefault(quantizer_class, []).insert(0, kernel)


def register_kernel_key(quantizer_class: type, key: Callable[[Any, str], Optional[Hashable]]) -> None:
    """Register how quantizers of class ``quantizer_class`` name their kernel variant.

    Parameters
    ----------
    quantizer_class:
        The quantizer class (exactly this class).
    key:
        ``key(q, direction)``: the kernel variant q's settings select for that direction's
        copy, or None where no fused kernel takes it.
    """
    KERNEL_KEYS[quantizer_class] = key


def register_hybrid_quantize_kernel(rowwise_key: Hashable, columnwise_key: Hashable, source: str,
                                    kernel: QuantizeKernel) -> None:
    """Register a fused kernel for hybrids whose children have these kernel keys and source."""
    HYBRID_QUANTIZE_KERNELS[(rowwise_key, columnwise_key, source)] = kernel


def register_row_mapped_kernel(quantizer_class: type, supports: Callable[..., bool], run: Callable[..., Any]) -> None:
    """Register a columnwise encode through a row map for quantizers of class
    ``quantizer_class``: ``supports(q, x2, rows)`` says whether it takes ``rows`` gathered rows
    of ``x2``; ``run(q, x2, row_map, rowwise)`` must return exactly
    ``(q.encode(x2, True, False) if rowwise else None, q.encode(gathered, False, True))`` where
    row r of ``gathered`` is ``x2[row_map[r]]``, or zeros where ``row_map[r] < 0`` (every row
    of x2 mapped once). Callers go around ``q.encode``: an ``encode`` replaced on an instance
    is not called (``moe.quantize`` plans only around a replaced ``quantize``)."""
    ROW_MAPPED_KERNELS[quantizer_class] = (supports, run)


def row_mapped_kernel(q: Any, x2: torch.Tensor, rows: int) -> Optional[Callable[..., Any]]:
    """The registered ``run(q, x2, row_map, rowwise)`` for a columnwise copy of ``rows`` rows of ``x2``
    gathered by a row map (see ``register_row_mapped_kernel``), or None where none fits (the
    caller then gathers the rows and encodes)."""
    entry = ROW_MAPPED_KERNELS.get(type(q))
    if entry is None or not current_policy().quantize_kernels or not entry[0](q, x2, rows):
        return None
    return entry[1]


def kernel_key(q: Any, direction: str) -> Optional[Hashable]:
    """The kernel variant ``q`` selects for its ``direction`` copy (None: no key registered)."""
    key = KERNEL_KEYS.get(type(q))
    return None if key is None else key(q, direction)


def hybrid_quantize_kernel(hq: Any) -> Optional[QuantizeKernel]:
    """The fused kernel registered for hybrid ``hq``'s pair of children, or None."""
    row = kernel_key(hq.rowwise_quantizer, "rowwise")
    col = kernel_key(hq.columnwise_quantizer, "columnwise")
    if row is None or col is None:
        return None
    return HYBRID_QUANTIZE_KERNELS.get((row, col, hq.columnwise_source))


def select_quantize_kernel(q: Any, x: torch.Tensor, rowwise: bool, columnwise: bool) -> Optional[QuantizeKernel]:
    """The kernel for this call, or None (reference: also wherever the policy turns
    ``quantize_kernels`` off). Reports a GPU fallback once."""
    if not current_policy().quantize_kernels:
        return None
    for k in QUANTIZE_KERNELS.get(type(q), ()):
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
