"""One quantization of an input that several linear layers read.

A gated MLP as Hugging Face models write it (``down(act(gate(x)) * up(x))``) feeds the same
``x`` to two Linears. With quantizers that promise identical results (equal
``Quantizer.share_key``: stateless, deterministic, same settings) the second layer takes the
first one's copies instead of quantizing again: one quantize pass (and for MXFP8 / NVFP4 one
amax pass) fewer, and one saved columnwise copy instead of two. The results are bitwise those
of two separate quantizations.

The memo holds one entry per autocast region (its ``scratch``): the last input quantized and its
copies. An entry matches only the same elements (same storage, offset, shape, strides, dtype) at
the same version (an in-place write in between misses). It holds the source view, so the
memory cannot be freed and reused at the same address while the entry lives; a miss drops the
entry before quantizing, and the region's end drops it.

Eager mode only: the ``torch.compile`` ops (``nn/ops.py``) pass no memo. Inductor plans its own
buffers: once an intermediate is dead in the graph it writes another value into that buffer in
place, without the version counter, so an entry keyed on it would match the new value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Optional

import torch

from ..quantizers import Quantizer
from ..tensors import COLUMNWISE, ROWWISE, QuantizedTensor

_SLOT = "shared_input"


@dataclass
class _Entry:
    source: torch.Tensor
    version: int
    key: Hashable
    quantized: QuantizedTensor


def _same_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.storage_offset() == b.storage_offset() and a.shape == b.shape
            and a.stride() == b.stride() and a.dtype == b.dtype and a.device == b.device)


def quantize_input(x: torch.Tensor, q: Quantizer, rowwise: bool, columnwise: bool,
                   scratch: Optional[dict]) -> QuantizedTensor:
    """``q`` quantizes ``x`` into the requested copies, or hands out the copies an equal
    quantizer made of the same elements earlier in the region. ``scratch``: the autocast
    region's memo dict (None: no sharing). The result is a tensor of its own (its storage
    object is not the memo's), so the caller may drop copies from it."""
    key = q.share_key() if scratch is not None and not x.is_inference() else None
    if key is None:
        q.set_usage(rowwise=rowwise, columnwise=columnwise)
        return q.quantize(x)
    hit: Optional[_Entry] = scratch.get(_SLOT)
    if (hit is not None and hit.key == key and hit.version == x._version and _same_elements(hit.source, x)
            and (not rowwise or hit.quantized.has_direction(ROWWISE))
            and (not columnwise or hit.quantized.has_direction(COLUMNWISE))):
        return _own_view(hit.quantized, q, rowwise, columnwise)
    scratch.pop(_SLOT, None)  # before quantizing: the old entry's copies are not kept alongside
    q.set_usage(rowwise=rowwise, columnwise=columnwise)
    qx = q.quantize(x)
    scratch[_SLOT] = _Entry(x, x._version, key, qx)
    return _own_view(qx, q, rowwise, columnwise)


def _own_view(qx: QuantizedTensor, q: Quantizer, rowwise: bool, columnwise: bool) -> QuantizedTensor:
    """A QuantizedTensor over the same payload tensors with only the asked-for copies."""
    out = QuantizedTensor(qx.qstorage.shallow_copy(), q)
    if not (rowwise and columnwise):
        out.update_usage(rowwise_usage=rowwise, columnwise_usage=columnwise)
    return out
