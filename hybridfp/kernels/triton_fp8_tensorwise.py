"""FP8 per-tensor quantize kernels (numerics §2.1 current scaling, §2.2 delayed scaling).

Tile-local int32 offsets, the hardware FP8 conversion on the GPU (``_common`` says why both).

- current scaling: an amax pass (``_common.amax_kernel``, int32 atomic max of the amax bits),
  then one cast pass that computes the scale from that amax in every program and writes the
  rowwise data ``[R, C]`` and its transpose ``[C, R]`` from the same tile.
- delayed scaling: one cast pass with the quantizer's scale; each program also folds its tile
  amax into an amax buffer (atomic max), which the caller records in the amax history.

Bitwise equal to ``formats.fp8_tensorwise`` (scale rule ``_common_encode.current_scale``, data
``fp8(clamp(x * scale))`` by ``_common_encode.fp8_encode``, ``scale_inv = 1 / scale``
by IEEE division).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import (load_tile, empty, DTYPE_CODE, amax_bits, amax_nan, check_int32_tiles, kernel_input,
                      store_transposed_u8, tile_offsets)
from ._common_encode import current_scale, f32, fp8_encode, fp8_params, hw_fp8


@triton.jit
def _fp8_tensorwise_kernel(x_ptr, scale_ptr, amax_ptr, rd_ptr, cd_ptr, sinv_ptr, R, C, sxr, sxc: tl.constexpr,
                           eps, CURRENT: tl.constexpr, POW2: tl.constexpr, ROW: tl.constexpr,
                           COL: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
                           FP8_MAX: tl.constexpr, DTYPE: tl.constexpr, BR: tl.constexpr,
                           BC: tl.constexpr, HW: tl.constexpr, PACK: tl.constexpr,
                           ANCHOR: tl.constexpr = False):
    """CURRENT: scale from the amax at ``amax_ptr``. Else (delayed): scale read from
    ``scale_ptr`` and the tile amax folded into ``amax_ptr`` (int32 bits)."""
    x, mask, lr, lc, r0, c0, pr, pc = load_tile(x_ptr, R, C, sxr, sxc, DTYPE, BR, BC)
    if CURRENT:
        scale = current_scale(tl.load(amax_ptr), eps, FP8_MAX, POW2)
    else:
        scale = tl.load(scale_ptr)
        tl.atomic_max(amax_ptr, amax_bits(amax_nan(amax_nan(x, 1), 0)))
    code = fp8_encode(x * scale, FP8_MAX, MBITS, BIAS, HW)
    if ROW:
        tl.store(rd_ptr + r0.to(tl.int64) * C + c0 + tile_offsets(lr, lc, C, 1), code, mask=mask)
    elif ANCHOR:
        # A store that never happens (R >= 0 always, but only at run time): it gives the tile
        # the natural, coalesced layout that the rowwise store gives it in the row+col kernel.
        tl.store(rd_ptr + tile_offsets(lr, lc, C, 1), code, mask=mask & ((lr[:, None] * 0 + R) < 0))
    if COL:
        store_transposed_u8(cd_ptr, code, lr, lc, r0, c0, R, C, PACK)
    if (pr == 0) & (pc == 0):
        tl.store(sinv_ptr, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale))


def quantize(x2: torch.Tensor, dtype: torch.dtype, *, amax: Optional[torch.Tensor] = None,
             scale: Optional[torch.Tensor] = None, eps: float = 0.0, power_2_scale: bool = False,
             rowwise: bool = True, columnwise: bool = True, block: Optional[tuple[int, int]] = None,
             num_warps: Optional[int] = None, pack: bool = True, anchor: bool = True):
    """FP8 per-tensor quantization of non-empty 2D ``x2`` (any strides).

    Current scaling: pass ``amax`` (0-d FP32 on x2's device, e.g. from
    :func:`_common.global_amax`, after any all-reduce); the scale follows
    ``fp8_tensorwise.current_scale(amax, eps, power_2_scale)``.
    Delayed scaling: pass ``scale`` (0-d FP32); the returned ``amax`` is this tensor's max|x|.

    Returns ``(row_data or None, col_data or None, scale_inv, amax_or_None)``: the rowwise
    data ``[R, C]``, its transpose ``[C, R]``, ``1 / scale`` (0-d FP32), and (delayed only)
    the recorded amax (0-d FP32). ``pack``: write the transposed copy as int32 words of four
    rows when R % 4 == 0 (same bytes, fewer store instructions). ``anchor`` (columnwise only):
    compile in a never-taken rowwise store, which keeps the tile in the coalesced natural
    layout (without it Triton 3.6 lays the tile out for the transposed store, about half as
    fast on the H200). ``block`` / ``num_warps``: default the H200's fastest at the Llama-3-8B
    MLP's four operand shapes, E4M3 and E5M2 (timed under CUDA graphs): both copies (128, 64) /
    4 warps, one copy (32, 128) / 4 warps, each near device-copy bandwidth.
    """
    if (amax is None) == (scale is None):
        raise ValueError("pass exactly one of amax (current scaling) or scale (delayed scaling).")
    rows, cols = x2.shape
    if x2.numel() == 0:
        raise ValueError("fp8 tensorwise kernel needs a non-empty input (the caller handles empty).")
    mbits, bias, fmax = fp8_params(dtype)
    check_int32_tiles(rows, cols, *x2.stride())
    dev = x2.device
    rd = empty((rows, cols), dtype=dtype, device=dev) if rowwise else None
    cd = empty((cols, rows), dtype=dtype, device=dev) if columnwise else None
    sinv = empty((), dtype=torch.float32, device=dev)
    dummy = torch.empty(1, dtype=torch.uint8, device=dev)
    current = amax is not None
    if current:
        amax_buf, scale_buf, recorded = amax.float().contiguous(), sinv, None
    else:
        recorded = torch.zeros((), dtype=torch.int32, device=dev)
        amax_buf, scale_buf = recorded, scale.float().contiguous()
    both = rowwise and columnwise
    if block is None:  # the defaults of the docstring, 4 warps each
        (br, bc), warps = ((128, 64) if both else (32, 128)), 4
    else:
        (br, bc), warps = block, 8 if block[0] * block[1] >= 8192 else 4
    grid = (triton.cdiv(rows, br) * triton.cdiv(cols, bc),)
    extra = {"num_warps": num_warps or warps}
    _fp8_tensorwise_kernel[grid](
        kernel_input(x2), scale_buf, amax_buf, rd.view(torch.uint8) if rowwise else dummy,
        cd.view(torch.uint8) if columnwise else dummy, sinv, rows, cols, x2.stride(0), x2.stride(1),
        f32(eps), CURRENT=current, POW2=power_2_scale, ROW=rowwise, COL=columnwise, MBITS=mbits,
        BIAS=bias, FP8_MAX=fmax, DTYPE=DTYPE_CODE[x2.dtype], BR=br, BC=bc, HW=hw_fp8(dev),
        PACK=pack and rows % 4 == 0, ANCHOR=anchor and not rowwise, **extra)
    return rd, cd, sinv, (None if current else recorded.view(torch.float32))
