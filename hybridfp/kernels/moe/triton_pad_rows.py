"""Row groups zero-padded to whole blocks, in one pass: the source of a shared columnwise
block encoding (``moe.quantize.pad_row_groups``).

Output row r copies source row ``row_map[r]``, or is zero where ``row_map[r] < 0`` (the
padding after each group). One read of the source and one write of the output: the PyTorch
form (a zero fill of the whole output, then ``index_copy_`` through an int64 index) writes
the output twice and runs at about a third of the copy bandwidth on the H200. The elements move
as raw bits (integers of the element's width), so the copy is bitwise for every dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._common import empty

#: rows x columns per program: 16 KiB of BF16 (a 2-byte element moves in 8-byte vectors)
_BR, _BC = 16, 512
_BITS = {2: torch.int16, 4: torch.int32, 1: torch.int8, 8: torch.int64}


@triton.jit
def _pad_rows_kernel(src_ptr, dst_ptr, map_ptr, R, C, s_src, s_dst, BR: tl.constexpr, BC: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    rmask = r < R
    cmask = c < C
    src_row = tl.load(map_ptr + r, mask=rmask, other=-1)
    take = (src_row >= 0)[:, None] & cmask[None, :]
    v = tl.load(src_ptr + src_row.to(tl.int64)[:, None] * s_src + c[None, :], mask=take, other=0)
    tl.store(dst_ptr + r.to(tl.int64)[:, None] * s_dst + c[None, :], v, mask=rmask[:, None] & cmask[None, :])


def pad_rows(src: torch.Tensor, row_map: torch.Tensor) -> torch.Tensor:
    """[len(row_map), C]: row r is ``src[row_map[r]]`` (bitwise), or zeros where row_map[r] < 0.

    ``src``: [R, C] with unit column stride; ``row_map``: contiguous int32 on src's device, every
    entry < R (not checked: that would cost a device sync; the caller builds it from the
    groups)."""
    if src.dim() != 2 or (src.shape[1] > 1 and src.stride(1) != 1):
        raise ValueError(f"pad_rows reads a 2D source with unit column stride; got shape "
                         f"{tuple(src.shape)}, strides {src.stride()}.")
    if (row_map.dtype != torch.int32 or row_map.dim() != 1 or row_map.device != src.device
            or not row_map.is_contiguous()):
        raise ValueError(f"pad_rows needs a contiguous 1D int32 row map on {src.device}; got "
                         f"{row_map.dtype}, {tuple(row_map.shape)}, strides {row_map.stride()} on "
                         f"{row_map.device}.")
    rows, cols = row_map.shape[0], src.shape[1]
    out = empty((rows, cols), src.dtype, src.device)
    if out.numel() == 0:
        return out
    bits = _BITS[src.element_size()]
    grid = (triton.cdiv(rows, _BR), triton.cdiv(cols, _BC))
    _pad_rows_kernel[grid](src.view(bits), out.view(bits), row_map, rows, cols, src.stride(0), out.stride(0),
                           BR=_BR, BC=_BC)
    return out
