"""Registers the Triton quantize kernels (``hybridfp.kernels``) for CUDA tensors.

Each ``QuantizeKernel`` here produces exactly the storage its quantizer's ``reference_encode``
would (tests/kernels check it bitwise, on the CPU under ``TRITON_INTERPRET=1`` and on the GPU),
with one exception: NVFP4 stochastic rounding draws its random numbers in the kernel
(``kernels/triton_sr.py``: a Philox stream keyed by (seed, direction), not the reference's
``torch.rand`` stream), so its codes are another realisation of the same distribution: the
same seed gives the same bits on the GPU and under the interpreter whichever other copies or
hybrid children are made, and everything else (amaxes, scales, RHT) is bitwise the reference's.
Every other kernel's output is bitwise the reference's,
and its ``supports`` says False for every configuration it does not cover, so the registry
reports the fallback to the reference:

| quantizer                      | kernel                                                    |
|--------------------------------|-----------------------------------------------------------|
| Float8CurrentScalingQuantizer  | amax pass + one cast pass writing data and its transpose  |
|                                | (no amax pass for a tensor whose amax is ``known_amax``)  |
| Float8Quantizer (delayed)      | one cast pass writing both copies, amax recorded          |
| Float8BlockQuantizer           | 1D (1x128 + 128x1 transposed) and 2D (128x128), one pass  |
| MXFP8Quantizer                 | 1D (1x32 + 32x1 transposed) and 2D (32x32), one pass      |
| NVFP4Quantizer                 | amax pass + one cast pass: 1D (RHT fused on the columnwise |
|                                | copy, post-RHT amax in the amax pass), row-scaled, 2D;    |
|                                | stochastic rounding with in-kernel Philox draws           |
| HybridQuantizer (fused pairs)  | one cast pass writing both children's copies, looked up   |
|                                | by the children's kernel keys (``HYBRID_KERNELS``): FP8   |
|                                | current row + FP8 block 1D col ("original"); NVFP4 1D or  |
|                                | row-scaled row + MXFP8 1D col (either source; the         |
|                                | dequantized source never leaves registers); MXFP8 1D row  |
|                                | + NVFP4 1D col, RHT'd or not ("original"). Other pairs    |
|                                | run their children one after the other.                   |

Empty inputs go to the reference (nothing to launch). ``run`` also works on CPU tensors when
Triton runs in interpreter mode (how the CPU tests call it); ``supports`` only selects the
kernels for CUDA tensors. Without Triton nothing is registered.

The kernel modules (and so Triton) are imported inside the functions that launch them, at the
first kernel call, not with hybridfp: ``@triton.jit`` fixes compiled vs interpreted mode
(``TRITON_INTERPRET``) when Triton and the kernels are imported, importing Triton costs about a
second that CPU-only users skip, and Triton is an optional dependency.
"""

from __future__ import annotations

import importlib.util
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Hashable, Optional

import torch

from ..formats.common import HIGH_PRECISION_DTYPES, as_2d
from ..tensors import (DecodedMXFP8Storage, DecodedNVFP4Storage, Float8BlockStorage, Float8Storage, HybridStorage,
                       MXFP8Storage, NVFP4Storage, QuantizedStorage, known_amax)
from ..tensors.storage import COLUMNWISE, ROWWISE
from .base import all_reduce_amax
from .float8 import Float8CurrentScalingQuantizer, Float8Quantizer
from .float8_block import Float8BlockQuantizer
from .hybrid import HybridQuantizer
from .mxfp8 import MXFP8Quantizer
from .nvfp4 import NVFP4Quantizer
from .backends import (QuantizeKernel, hybrid_quantize_kernel, register_hybrid_quantize_kernel,
                       register_kernel_key, register_quantize_kernel, register_row_mapped_kernel)

HAVE_TRITON = importlib.util.find_spec("triton") is not None


#: Kernels index inside a tile with int32 offsets (``kernels._common.check_int32_tiles``):
#: 256 * (rows + cols + strides) must stay below 2**31.
_INT32_TILE_LIMIT = 2**31 // 256 - 1


def device_ok(x: torch.Tensor, rows: Optional[int] = None) -> bool:
    """Whether the Triton quantize kernels take ``x``.

    Parameters
    ----------
    x:
        The input: a CUDA tensor of a high-precision dtype (with Triton installed) qualifies
        while its rows, columns and strides fit the kernels' int32 in-tile offsets.
    rows:
        The kernel reads as many rows gathered from ``x`` (a row map) instead of x's own.

    Returns
    -------
    bool
        True where a kernel may run on ``x``.
    """
    if not (HAVE_TRITON and x.is_cuda and x.dtype in HIGH_PRECISION_DTYPES):
        return False
    cols = x.shape[-1] if x.dim() else 1
    rows = max(rows or 0, x.numel() // max(cols, 1))
    return rows + cols + sum(abs(s) for s in x.stride()) < _INT32_TILE_LIMIT


def on_device(x: torch.Tensor) -> AbstractContextManager:
    """The context in which kernels for ``x`` launch: ``x``'s GPU made current (Triton launches
    on the current device).

    Parameters
    ----------
    x:
        The kernel's input tensor.

    Returns
    -------
    AbstractContextManager
        ``torch.cuda.device(x.device)`` for a CUDA tensor, else a context that does nothing.
    """
    return torch.cuda.device(x.device) if x.is_cuda else nullcontext()


def _reduce(amax: Optional[torch.Tensor], q: Any) -> Optional[torch.Tensor]:
    """All-reduce a per-tensor amax exactly as the reference does (same function)."""
    if amax is None or not q.with_amax_reduction:
        return amax
    return all_reduce_amax(amax, q.amax_reduction_group)


def _tensor_amax(x2: torch.Tensor, q: Any) -> torch.Tensor:
    """max|x2| for per-tensor current scaling by ``q``, all-reduced as the reference does. An
    amax recorded by the kernel that wrote x2 (``known_amax``: the fused SwiGLU) saves the amax
    pass's read of x2; it is cloned before an in-place all-reduce so the record stays x2's own."""
    known = known_amax.recall(x2)
    if known is None:
        from ..kernels import _common
        return _reduce(_common.global_amax(x2), q)
    return _reduce(known.clone() if q.with_amax_reduction else known, q)


# ---------------------------------------------------------------------------- FP8 per tensor
def _fp8_storage(q: Any, x: torch.Tensor, rd, cd, scale_inv) -> Float8Storage:
    row = {"data": rd, "scale_inv": scale_inv} if rd is not None else None
    col = {"data": cd, "scale_inv": scale_inv} if cd is not None else None
    return Float8Storage(x.shape, x.dtype, row, col, label=q.label, fp8_dtype=q.dtype)


def _fp8_current_run(q: Any, x: torch.Tensor, rowwise: bool, columnwise: bool,
                     seed: Optional[int] = None):
    if x.numel() == 0:
        return q.reference_encode(x, rowwise, columnwise, seed)
    x2 = as_2d(x)
    from ..kernels import triton_fp8_tensorwise
    with on_device(x):
        amax = _tensor_amax(x2, q)
        rd, cd, scale_inv, _ = triton_fp8_tensorwise.quantize(
            x2, q.dtype, amax=amax, eps=q.amax_epsilon, power_2_scale=q.force_pow_2_scales,
            rowwise=rowwise, columnwise=columnwise)
    return _fp8_storage(q, x, rd, cd, scale_inv)


def _fp8_delayed_run(q: Any, x: torch.Tensor, rowwise: bool, columnwise: bool,
                     seed: Optional[int] = None):
    if x.numel() == 0:
        return q.reference_encode(x, rowwise, columnwise, seed)
    q._state_to(x.device)
    from ..kernels import triton_fp8_tensorwise
    with on_device(x):
        rd, cd, scale_inv, amax = triton_fp8_tensorwise.quantize(
            as_2d(x), q.dtype, scale=q.scale, rowwise=rowwise, columnwise=columnwise)
    q.record_amax(amax)
    return _fp8_storage(q, x, rd, cd, scale_inv)


# ---------------------------------------------------------------------------- FP8 block
def _fp8_block_run(q: Any, x: torch.Tensor, rowwise: bool, columnwise: bool,
                   seed: Optional[int] = None):
    if x.numel() == 0:
        return q.reference_encode(x, rowwise, columnwise, seed)
    from ..kernels import triton_fp8_block
    with on_device(x):
        row, col = triton_fp8_block.quantize(
            as_2d(x), q.dtype, block_dim=q.block_scaling_dim, power_2_scale=q.force_pow_2_scales,
            eps=q.amax_epsilon, rowwise=rowwise, columnwise=columnwise)
    return Float8BlockStorage(x.shape, x.dtype, _payload(row, "data", "scale_inv"),
                              _payload(col, "data", "scale_inv"), label=q.label, **q.storage_meta())


def _payload(pair, *names: str) -> Optional[dict[str, torch.Tensor]]:
    return None if pair is None else dict(zip(names, pair))


# ---------------------------------------------------------------------------- MXFP8
def _mxfp8_run(q: Any, x: torch.Tensor, rowwise: bool, columnwise: bool,
               seed: Optional[int] = None):
    if x.numel() == 0:
        return q.reference_encode(x, rowwise, columnwise, seed)
    from ..kernels import triton_mxfp8
    with on_device(x):
        row, col = triton_mxfp8.quantize(as_2d(x), q.dtype, rule=q.scale_rule, block_2d=q.with_2d_quantization,
                                         rowwise=rowwise, columnwise=columnwise, decoded=bool(q.hold_decoded))
    return _mxfp8_storage(q, x.shape, x.dtype, row, col)


def _mxfp8_storage(q: Any, shape: torch.Size, dtype: torch.dtype, row, col) -> QuantizedStorage:
    """The storage of the kernel's copies: codes and scales, or their BF16 decodes
    (``q.hold_decoded``)."""
    if q.hold_decoded:
        return DecodedMXFP8Storage(shape, dtype, _payload(row, "data"), _payload(col, "data"), label=q.label,
                                   **q.storage_meta())
    return MXFP8Storage(shape, dtype, _payload(row, "data", "scale"), _payload(col, "data", "scale"),
                        label=q.label, **q.storage_meta())


def _mxfp8_row_mapped_supports(q: Any, x2: torch.Tensor, rows: int) -> bool:
    """1D MXFP8 of a CUDA input whose gathered ``rows`` still fit the kernels' int32 tiles."""
    return not q.with_2d_quantization and x2.dim() == 2 and device_ok(x2, rows)


def _mxfp8_row_mapped_run(q: Any, x2: torch.Tensor, row_map: torch.Tensor,
                          rowwise: bool) -> tuple[Optional[QuantizedStorage], QuantizedStorage]:
    """(x2's own rowwise copy if ``rowwise``, the MXFP8 1D columnwise copy of the rows of x2
    gathered by ``row_map``) in one pass, no gathered copy written
    (``triton_mxfp8.quantize(row_map=...)``)."""
    from ..kernels import triton_mxfp8
    with on_device(x2):
        row, col = triton_mxfp8.quantize(x2, q.dtype, rule=q.scale_rule, rowwise=rowwise,
                                         row_map=row_map, decoded=bool(q.hold_decoded))
    rows = _mxfp8_storage(q, x2.shape, x2.dtype, row, None) if rowwise else None
    return rows, _mxfp8_storage(q, torch.Size((row_map.shape[0], x2.shape[1])), x2.dtype, None, col)


# ---------------------------------------------------------------------------- NVFP4
def _nvfp4_supports(q: Any, x: torch.Tensor, rowwise: bool, columnwise: bool) -> bool:
    # A row-scaled columnwise request is an error the reference raises.
    return device_ok(x) and not (q.row_scaled_nvfp4 and columnwise)


def _nvfp4_run(q: Any, x: torch.Tensor, rowwise: bool, columnwise: bool,
               seed: Optional[int] = None):
    if x.numel() == 0 or (q.row_scaled_nvfp4 and columnwise):
        return q.reference_encode(x, rowwise, columnwise, seed)
    if q.stochastic_rounding and seed is None:
        seed = q.draw_seed()
    x2 = as_2d(x)
    sr = q.stochastic_rounding
    from ..kernels import triton_nvfp4 as nv
    with on_device(x):
        if q.with_2d_quantization:
            amax = _reduce(nv.amaxes(x2)[0], q)
            row, col = nv.quantize_2d(x2, amax, rowwise=rowwise, columnwise=columnwise,
                                      seed=seed if sr else None)
            row_amax = col_amax = amax
        else:
            post_rht = columnwise and q.with_rht and q.with_post_rht_amax
            need_global = (rowwise and not q.row_scaled_nvfp4) or (columnwise and not post_rht)
            g, per_row, rht_amax = nv.amaxes(
                x2, amax=need_global, row_amax=rowwise and q.row_scaled_nvfp4, rht_amax=post_rht)
            g, rht_amax = _reduce(g, q), _reduce(rht_amax, q)
            row_amax = (per_row if q.row_scaled_nvfp4 else g) if rowwise else None
            col_amax = (rht_amax if post_rht else g) if columnwise else None
            row, col = nv.quantize_1d(x2, row_amax, col_amax, rht=q.with_rht, seed=seed if sr else None)
    rp = None if row is None else {"data": row[0], "scale": row[1], "amax": row_amax}
    cp = None if col is None else {"data": col[0], "scale": col[1], "amax": col_amax}
    return NVFP4Storage(x.shape, x.dtype, rp, cp, label=q.label, **q.storage_meta())


def _supports_any(q: Any, x: torch.Tensor, rowwise: bool, columnwise: bool) -> bool:
    return device_ok(x)


# ---------------------------------------------------------------------------- kernel keys
# What each quantizer's settings select for one direction's copy (the hybrid pair lookup).
# Settings a kernel takes as arguments (element dtype, scale rule, eps, power-of-two scales)
# are not part of the key.
def _fp8_current_key(q: Any, direction: str) -> Hashable:
    return ("fp8_current",)


def _fp8_block_key(q: Any, direction: str) -> Hashable:
    return ("fp8_block", f"{q.block_scaling_dim}d")


def _mxfp8_key(q: Any, direction: str) -> Hashable:
    return ("mxfp8", "2d" if q.with_2d_quantization else "1d")


def _nvfp4_key(q: Any, direction: str) -> Optional[Hashable]:
    if q.with_2d_quantization or q.stochastic_rounding:
        return None  # no fused kernel takes these yet
    if direction == "rowwise":  # RHT only transforms the columnwise copy
        return ("nvfp4", "1d_row_scaled" if q.row_scaled_nvfp4 else "1d")
    return ("nvfp4", "1d_rht" if q.with_rht else "1d")


KERNEL_KEY_FUNCTIONS: dict[type, Callable[[Any, str], Optional[Hashable]]] = {
    Float8CurrentScalingQuantizer: _fp8_current_key,
    Float8BlockQuantizer: _fp8_block_key,
    MXFP8Quantizer: _mxfp8_key,
    NVFP4Quantizer: _nvfp4_key,
}


# ---------------------------------------------------------------------------- fused hybrids
def _hybrid_fp8_current_block_run(hq: Any, x: torch.Tensor, rowwise: bool, columnwise: bool,
                                  seed: Optional[int] = None):
    """Hybrid(row=FP8 current scaling, col=FP8 block 1D), both copies: one amax pass, one cast
    pass (``kernels.triton_hybrid_fp8``)."""
    rq, cq = hq.rowwise_quantizer, hq.columnwise_quantizer
    if x.numel() == 0 or not (rowwise and columnwise):
        return hq.reference_encode(x, rowwise, columnwise, seed)
    x2 = as_2d(x)
    from ..kernels import triton_hybrid_fp8
    with on_device(x):
        amax = _tensor_amax(x2, rq)
        (rd, sinv), (cd, cs) = triton_hybrid_fp8.quantize(
            x2, amax, rq.dtype, cq.dtype, row_eps=rq.amax_epsilon, row_power_2_scale=rq.force_pow_2_scales,
            col_eps=cq.amax_epsilon, col_power_2_scale=cq.force_pow_2_scales)
    row = Float8Storage(x.shape, x.dtype, {"data": rd, "scale_inv": sinv}, None, label=rq.label,
                        fp8_dtype=rq.dtype)
    col = Float8BlockStorage(x.shape, x.dtype, None, {"data": cd, "scale_inv": cs}, label=cq.label,
                             **cq.storage_meta())
    return HybridStorage(x.shape, x.dtype, row, col, label=hq.label)


def _hybrid_both(hq: Any, x: torch.Tensor, rowwise: bool, columnwise: bool) -> bool:
    return device_ok(x) and rowwise and columnwise


def _hybrid_nvfp4_mxfp8_supports(hq: Any, x: torch.Tensor, rowwise: bool, columnwise: bool) -> bool:
    # a rowwise-only copy held decoded too (the NVFP4 kernel writes codes only)
    derive = hq.columnwise_source == "rowwise_dequantized"
    return device_ok(x) and ((columnwise and (rowwise or derive)) or (rowwise and ROWWISE in hq.hold_decoded))


def _hybrid_nvfp4_mxfp8_run(hq: Any, x: torch.Tensor, rowwise: bool, columnwise: bool,
                            seed: Optional[int] = None):
    """Hybrid(row=NVFP4 1D (per-tensor or row-scaled), col=MXFP8 1D), either source: one amax
    pass, one cast pass (``kernels.triton_hybrid_nvfp4``); with "rowwise_dequantized" and only
    the columnwise copy asked for, the rowwise copy is computed in registers and not stored."""
    rq, cq = hq.rowwise_quantizer, hq.columnwise_quantizer
    derive = hq.columnwise_source == "rowwise_dequantized"
    dec_row, dec_col = ROWWISE in hq.hold_decoded, COLUMNWISE in hq.hold_decoded
    if x.numel() == 0 or not ((columnwise and (rowwise or derive)) or (rowwise and dec_row)):
        return hq.reference_encode(x, rowwise, columnwise, seed)
    x2 = as_2d(x)
    rs = rq.row_scaled_nvfp4
    from ..kernels import triton_hybrid_nvfp4, triton_nvfp4
    with on_device(x):
        g, per_row, _ = triton_nvfp4.amaxes(x2, amax=not rs, row_amax=rs)
        amax = per_row if rs else _reduce(g, rq)
        row, col = triton_hybrid_nvfp4.quantize(
            x2, amax, cq.dtype, rule=cq.scale_rule, rowwise=rowwise, columnwise=columnwise,
            source=hq.columnwise_source, decoded=(dec_row, dec_col))
    rp = None
    if row is not None:  # codes and block scales, or their BF16 decode (hold_decoded)
        rp = (DecodedNVFP4Storage if dec_row else NVFP4Storage)(
            x.shape, x.dtype, {**_payload(row[:1] if dec_row else row, "data", "scale"), "amax": amax}, None,
            label=rq.label, **rq.storage_meta())
    cp = None
    if col is not None:  # the reference's columnwise child reads the FP32 dequantized value: FP32
        cp = (DecodedMXFP8Storage if dec_col else MXFP8Storage)(
            x.shape, torch.float32 if derive else x.dtype, None, _payload(col[:1] if dec_col else col, "data", "scale"),
            label=cq.label, **cq.storage_meta())
    return HybridStorage(x.shape, x.dtype, rp, cp, label=hq.label)


def _hybrid_mxfp8_nvfp4_run(hq: Any, x: torch.Tensor, rowwise: bool, columnwise: bool,
                            seed: Optional[int] = None):
    """Hybrid(row=MXFP8 1D, col=NVFP4 1D, RHT'd or not), both copies from the original: the
    NVFP4 amax pass (post-RHT amax where the child asks for it), one cast pass writing both
    copies (``kernels.triton_hybrid_mxfp8_nvfp4``)."""
    rq, cq = hq.rowwise_quantizer, hq.columnwise_quantizer
    if x.numel() == 0 or not (rowwise and columnwise):
        return hq.reference_encode(x, rowwise, columnwise, seed)
    x2 = as_2d(x)
    post_rht = cq.with_rht and cq.with_post_rht_amax
    from ..kernels import triton_hybrid_mxfp8_nvfp4, triton_nvfp4
    with on_device(x):
        g, _, rht_amax = triton_nvfp4.amaxes(x2, amax=not post_rht, rht_amax=post_rht)
        amax = _reduce(rht_amax if post_rht else g, cq)
        row, col = triton_hybrid_mxfp8_nvfp4.quantize(x2, amax, rq.dtype, rule=rq.scale_rule, rht=cq.with_rht)
    rp = MXFP8Storage(x.shape, x.dtype, _payload(row, "data", "scale"), None, label=rq.label,
                      **rq.storage_meta())
    cp = NVFP4Storage(x.shape, x.dtype, None, {"data": col[0], "scale": col[1], "amax": amax}, label=cq.label,
                      **cq.storage_meta())
    return HybridStorage(x.shape, x.dtype, rp, cp, label=hq.label)


HYBRID_FP8_CURRENT_BLOCK_KERNEL = QuantizeKernel("triton_hybrid_fp8_current_block", _hybrid_both,
                                                 _hybrid_fp8_current_block_run)
HYBRID_NVFP4_MXFP8_KERNEL = QuantizeKernel("triton_hybrid_nvfp4_mxfp8", _hybrid_nvfp4_mxfp8_supports,
                                           _hybrid_nvfp4_mxfp8_run)
HYBRID_MXFP8_NVFP4_KERNEL = QuantizeKernel("triton_hybrid_mxfp8_nvfp4", _hybrid_both, _hybrid_mxfp8_nvfp4_run)

#: (rowwise key, columnwise key, columnwise_source) -> fused hybrid kernel.
HYBRID_KERNELS: dict[tuple[Hashable, Hashable, str], QuantizeKernel] = {
    (("fp8_current",), ("fp8_block", "1d"), "original"): HYBRID_FP8_CURRENT_BLOCK_KERNEL,
    **{(("nvfp4", row), ("mxfp8", "1d"), src): HYBRID_NVFP4_MXFP8_KERNEL
       for row in ("1d", "1d_row_scaled") for src in ("original", "rowwise_dequantized")},
    **{(("mxfp8", "1d"), ("nvfp4", col), "original"): HYBRID_MXFP8_NVFP4_KERNEL for col in ("1d", "1d_rht")},
}


def _hybrid_supports(hq: Any, x: torch.Tensor, rowwise: bool, columnwise: bool) -> bool:
    kernel = hybrid_quantize_kernel(hq)
    return kernel is not None and kernel.supports(hq, x, rowwise, columnwise)


def _hybrid_run(hq: Any, x: torch.Tensor, rowwise: bool, columnwise: bool, seed: Optional[int] = None):
    kernel = hybrid_quantize_kernel(hq)
    if kernel is None:
        return hq.reference_encode(x, rowwise, columnwise, seed)
    return kernel.run(hq, x, rowwise, columnwise, seed)


#: The HybridQuantizer entry: dispatches on the pair of children (``HYBRID_KERNELS``).
HYBRID_KERNEL = QuantizeKernel("triton_hybrid", _hybrid_supports, _hybrid_run)


FP8_CURRENT_KERNEL = QuantizeKernel("triton_fp8_current", _supports_any, _fp8_current_run)
FP8_DELAYED_KERNEL = QuantizeKernel("triton_fp8_delayed", _supports_any, _fp8_delayed_run)
FP8_BLOCK_KERNEL = QuantizeKernel("triton_fp8_block", _supports_any, _fp8_block_run)
MXFP8_KERNEL = QuantizeKernel("triton_mxfp8", _supports_any, _mxfp8_run)
NVFP4_KERNEL = QuantizeKernel("triton_nvfp4", _nvfp4_supports, _nvfp4_run)

#: quantizer class -> its Triton kernel (what tests call on CPU tensors).
KERNELS: dict[type, QuantizeKernel] = {
    Float8CurrentScalingQuantizer: FP8_CURRENT_KERNEL,
    Float8Quantizer: FP8_DELAYED_KERNEL,
    Float8BlockQuantizer: FP8_BLOCK_KERNEL,
    MXFP8Quantizer: MXFP8_KERNEL,
    NVFP4Quantizer: NVFP4_KERNEL,
    HybridQuantizer: HYBRID_KERNEL,
}

if HAVE_TRITON:
    for _cls, _kernel in KERNELS.items():
        register_quantize_kernel(_cls, _kernel)
    for _cls, _key in KERNEL_KEY_FUNCTIONS.items():
        register_kernel_key(_cls, _key)
    register_row_mapped_kernel(MXFP8Quantizer, _mxfp8_row_mapped_supports, _mxfp8_row_mapped_run)
    for (_row, _col, _src), _kernel in HYBRID_KERNELS.items():
        register_hybrid_quantize_kernel(_row, _col, _src, _kernel)
