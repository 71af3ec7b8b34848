"""Grouped per-tensor scaling kernels: an MoE layer's experts (row groups of one tensor), each
with its own per-tensor amax / FP8 scale, in one launch per pass instead of one per expert.

The rows of one group are consecutive and the groups in order (``moe.quantize.
quantize_grouped``'s layout). Two passes:

- :func:`group_amax`: max|x| of every group (NaN-propagating, 0 for an empty group): per tile
  one atomic max of the amax bits when all its rows are one group (the common case: groups of
  hundreds of rows), else one per row. Also serves NVFP4's per-expert global amax.
- :func:`quantize` (FP8 current scaling, numerics §2.1): tiles that never straddle two groups (one
  program per row tile of each group, the group found from the prefix sums of the groups' tile
  counts, so each tile has one scale and uneven groups launch no idle programs) — the group's
  scale from its amax (``_common_encode.current_scale``), ``fp8(clamp(x * scale))`` by
  ``_common_encode.fp8_encode``, and ``scale_inv = 1 / scale`` per group (IEEE division). The rowwise
  data is [R, C]; the columnwise data is each group's own transpose [C, m_e], written at a
  given element offset of one flat buffer with a given row stride (its own ``ld_e``, or one
  ``col_stride`` for all: the groups' transposes side by side as column blocks of one [C, W]
  matrix, ``moe.quantize_scaled``'s joined layout), each block ``ld_e`` wide (m_e <=
  ld_e <= m_e rounded up to 16; the caller starts each block 16-byte aligned, as cuBLAS reads
  its operands) — so every expert's columnwise copy is a view, ready for a per-expert TN GEMM
  (``torch._scaled_mm`` reads a row stride above the width as it is) or the grouped FP8
  GEMM. A tile's rows start at a
  multiple of its height within its group, so four rows go as one 32-bit word when the strides
  and offsets are multiples of 4 (as ``triton_fp8_tensorwise``), and the group's last tile
  writes zero codes for rows m_e .. ld_e - 1: the [C, ld_e] block is then the copy zero-padded
  along its reduction (the expert's token count), which cuBLAS FP8 needs a multiple of 16,
  with no padded copy per GEMM. (Storing single bytes at a per-row group stride and zeroing the
  tails in a second launch is slower.)

Bitwise equal, per group, to ``triton_fp8_tensorwise`` / ``formats.fp8_tensorwise`` on that
group alone (same helpers, same operation order; the scale depends only on the group's amax).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from ...utils.device import device_tensor, step_metadata
from .._common import (DTYPE_CODE, amax_bits, amax_nan, check_int32_tiles, empty, expert_row_tile, kernel_input,
                       load_f32, load_tile, store_transposed_rows_u8, tile_offsets)
from .._common_encode import current_scale, f32, fp8_encode, fp8_params, hw_fp8


@triton.jit
def _group_amax_kernel(x_ptr, group_ptr, out_ptr, R, C, sxr, sxc: tl.constexpr, DTYPE: tl.constexpr,
                       BR: tl.constexpr, BC: tl.constexpr):
    """Fold each tile's row amaxes into ``out_ptr[group]`` (int32 amax bits, zeroed by the caller)."""
    x, mask, lr, lc, r0, c0, pr, pc = load_tile(x_ptr, R, C, sxr, sxc, DTYPE, BR, BC)
    rmask = (r0 + lr) < R
    row = amax_nan(x, 1)
    g = tl.load(group_ptr + r0 + lr, mask=rmask, other=-1)
    first = tl.max(tl.where(rmask, g, -1), 0)
    low = tl.min(tl.where(rmask, g, 2147483647), 0)
    if low == first:  # one group in the tile: one atomic instead of BR
        tl.atomic_max(out_ptr + first, amax_bits(amax_nan(row, 0)))
    else:
        # a tile across a group boundary: one atomic for each of its first and last groups
        # (every row's own atomic on the same few addresses would serialize them: 64 experts'
        # amax would run at half the speed of 8 experts'), per row only for groups wholly inside
        # the tile
        tl.atomic_max(out_ptr + low, amax_bits(amax_nan(tl.where(g == low, row, 0.0), 0)))
        tl.atomic_max(out_ptr + first, amax_bits(amax_nan(tl.where(g == first, row, 0.0), 0)))
        tl.atomic_max(out_ptr + g, amax_bits(row), mask=rmask & (g > low) & (g < first))


def group_amax(x2: torch.Tensor, row_group: torch.Tensor, groups: int, *,
               block: tuple[int, int] = (64, 128)) -> torch.Tensor:
    """Per-group max|x2| (FP32 [groups], NaN-propagating, 0 for a group without rows) of non-empty
    2D ``x2``; ``row_group``: int32 [R], the group of each row."""
    rows, cols = x2.shape
    check_int32_tiles(rows, cols, *x2.stride())
    out = torch.zeros(groups, dtype=torch.int32, device=x2.device)
    br, bc = block
    grid = (triton.cdiv(rows, br) * triton.cdiv(cols, bc),)
    _group_amax_kernel[grid](kernel_input(x2), row_group, out, rows, cols, x2.stride(0), x2.stride(1),
                             DTYPE=DTYPE_CODE[x2.dtype], BR=br, BC=bc, num_warps=8)
    return out.view(torch.float32)


@triton.jit
def _grouped_fp8_kernel(x_ptr, amax_ptr, meta_ptr, rd_ptr, cd_ptr, sinv_ptr, C, G,
                        sxr, sxc: tl.constexpr, eps, POW2: tl.constexpr, ROW: tl.constexpr,
                        COL: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
                        FP8_MAX: tl.constexpr, DTYPE: tl.constexpr, BR: tl.constexpr,
                        BC: tl.constexpr, BG: tl.constexpr, HW: tl.constexpr, PACK: tl.constexpr,
                        ANCHOR: tl.constexpr, GP: tl.constexpr):
    """Row tile t = ``program_id(0) //`` column tiles of all the groups' row tiles laid end to
    end: its group g is found from the tiles' prefix sums (``_common.expert_row_tile``; ``GP``
    a power of two > G), so only tiles with rows are launched, however uneven the groups. Rows
    scaled by the group's current scale; rowwise codes at [r, c]; columnwise codes at
    ``offset + c * stride + (r - start)`` (the group's own transpose) for every row of the tile
    below ``ld`` — rows past the group's end read as zeros, so the tail up to ``ld`` gets zero
    codes. ``meta``: int64 [6G + 1]: first row, rows, ld, column offset, row stride per group,
    then the prefix sums of row tiles per group (G + 1)."""
    pid = tl.program_id(0)
    nc = tl.cdiv(C, BC)
    t, pc = pid // nc, pid % nc
    # the last group whose first tile is <= t (empty groups are skipped over): one vector load of
    # the prefix sums instead of a binary search's log2(G) dependent loads (with it, 64 groups
    # quantize about as fast as 8)
    g, gt = expert_row_tile(meta_ptr + 5 * G, t, G, GP)
    l0 = gt.to(tl.int32) * BR
    m = tl.load(meta_ptr + G + g).to(tl.int32)
    r0 = tl.load(meta_ptr + g).to(tl.int32) + l0
    c0 = pc * BC
    lr = tl.arange(0, BR)
    lc = tl.arange(0, BC)
    mask = ((l0 + lr) < m)[:, None] & ((c0 + lc) < C)[None, :]
    x = load_f32(x_ptr + r0.to(tl.int64) * sxr + c0.to(tl.int64) * sxc + tile_offsets(lr, lc, sxr, sxc),
                 mask, DTYPE)
    scale = current_scale(tl.load(amax_ptr + g), eps, FP8_MAX, POW2)
    code = fp8_encode(x * scale, FP8_MAX, MBITS, BIAS, HW)  # masked rows: x = 0 -> code 0
    if ROW:
        tl.store(rd_ptr + r0.to(tl.int64) * C + c0 + tile_offsets(lr, lc, C, 1), code, mask=mask)
    elif ANCHOR:  # never stores (m >= 0); keeps the coalesced tile layout (triton_fp8_tensorwise)
        tl.store(rd_ptr + tile_offsets(lr, lc, C, 1), code, mask=mask & ((lr[:, None] * 0 + m) < 0))
    if COL:
        ld = tl.load(meta_ptr + 2 * G + g).to(tl.int32)
        stride = tl.load(meta_ptr + 4 * G + g).to(tl.int32)
        store_transposed_rows_u8(cd_ptr + tl.load(meta_ptr + 3 * G + g), code, lr, lc, l0, c0, stride, ld, C, PACK)
    if pid == 0:  # every group's 1 / scale, empty groups included
        for g0 in range(0, G, BG):
            lg = g0 + tl.arange(0, BG)
            s = current_scale(tl.load(amax_ptr + lg, mask=lg < G, other=0.0), eps, FP8_MAX, POW2)
            tl.store(sinv_ptr + lg * 4, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s), mask=lg < G)


def _group_meta(splits: tuple[int, ...], lds: tuple[int, ...], offs: tuple[int, ...], strides: tuple[int, ...],
                br: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """(``_grouped_fp8_kernel``'s metadata on ``device``, its row tiles): one queued host-to-device
    copy (no stream sync), shared by the calls of one routing (``utils.device.step_metadata``: an MoE
    step's x and h, dy and dh lay out their groups alike): read-only."""
    starts, cum, at, tiles = [], [0], 0, 0
    for m in splits:
        starts.append(at)
        at += m
        tiles += -(-m // br)
        cum.append(tiles)
    meta = step_metadata(("grouped fp8 meta", splits, lds, offs, strides, br), device,
                         lambda: device_tensor(starts + list(splits + lds + offs + strides) + cum, device, torch.int64))
    return meta, tiles


def quantize(x2: torch.Tensor, amax: torch.Tensor, splits: Sequence[int], dtype: torch.dtype, *,
             eps: float = 0.0, power_2_scale: bool = False, rowwise: bool = True, columnwise: bool = True,
             col_offsets: Optional[Sequence[int]] = None, col_lds: Optional[Sequence[int]] = None,
             col_numel: Optional[int] = None, col_stride: Optional[int] = None,
             block: tuple[int, int] = (64, 128), num_warps: Optional[int] = None):
    """FP8 current scaling of the row groups of non-empty 2D ``x2`` (any strides; group e is the
    next ``splits[e]`` rows), each with its group's scale.

    ``amax``: FP32 [G] per-group amaxes (e.g. :func:`group_amax`, after any all-reduce).
    Columnwise: group e's transpose [C, m_e] goes at element ``col_offsets[e]`` of one flat
    buffer of ``col_numel`` elements with row stride ``col_lds[e]``, m_e <= ld_e <= m_e rounded
    up to 16; row tails m_e .. ld_e - 1 hold zero codes (the copy zero-padded along its
    reduction, as cuBLAS FP8 needs a multiple of 16). ``col_stride``: one row stride for every
    group instead (>= each ld_e): the groups' transposes side by side as column blocks of one
    [C, col_stride] matrix, block e ``ld_e`` wide from column ``col_offsets[e]``. Offsets and strides multiples of 4 move
    four rows per 32-bit store. Returns ``(row_data or None, col_data or None, scale_inv)``:
    rowwise [R, C] in ``dtype``, columnwise flat [col_numel] in ``dtype``, ``scale_inv`` FP32
    [G]. ``block`` / ``num_warps``: tiles of (64, 128) / 8 warps, as the per-tensor kernel's
    both-copies default (the fastest of the H200 sweep there); the row block must be a multiple of
    16 (the tail rule above).
    """
    rows, cols = x2.shape
    splits = [int(m) for m in splits]
    if x2.numel() == 0 or sum(splits) != rows:
        raise ValueError(f"grouped fp8 kernel needs a non-empty input whose rows are the groups "
                         f"({sum(splits)}); got {tuple(x2.shape)}.")
    br, bc = block
    if br % 16:
        raise ValueError(f"block rows {br} must be a multiple of 16 (zero row tails up to ld).")
    groups = amax.numel()
    if groups < 1 or groups != len(splits):
        raise ValueError(f"grouped fp8 kernel: {groups} amaxes for {len(splits)} groups; pass one per group.")
    if columnwise:
        if col_offsets is None or col_lds is None or col_numel is None:
            raise ValueError("columnwise=True needs col_offsets, col_lds and col_numel.")
        if len(col_offsets) != groups or len(col_lds) != groups:
            raise ValueError(f"col_offsets ({len(col_offsets)}) and col_lds ({len(col_lds)}) need one entry "
                             f"per group ({groups}).")
        # list comprehensions, not generators: one Python frame a check, not one per group
        if any([not m <= ld <= -(-m // 16) * 16 for m, ld in zip(splits, col_lds)]):
            raise ValueError(f"col_lds {list(col_lds)} must lie between each group's rows and their "
                             "round-up to 16.")
        strides = list(col_lds) if col_stride is None else [col_stride] * groups
        if any([ld > st for ld, st in zip(col_lds, strides)]):
            raise ValueError(f"col_stride {col_stride} is narrower than a group's block (col_lds {list(col_lds)}).")
        if any([o < 0 or o + (cols - 1) * st + ld > col_numel for o, ld, st in zip(col_offsets, col_lds, strides)]):
            raise ValueError(f"a columnwise block [{cols}, ld] at col_offsets {list(col_offsets)} overruns "
                             f"col_numel={col_numel}.")
    mbits, bias, fmax = fp8_params(dtype)
    check_int32_tiles(rows + 16, cols, *x2.stride())  # + 16: a row stride ld_e <= m_e + 15
    if columnwise and col_stride is not None:
        check_int32_tiles(col_stride)
    dev = x2.device
    rd = empty((rows, cols), dtype=dtype, device=dev) if rowwise else None
    cd = empty((col_numel,), dtype=dtype, device=dev) if columnwise else None
    # one 16-byte slot per expert: cuBLAS (torch._scaled_mm) rejects a scale pointer that is
    # not 16-byte aligned (CUBLAS_STATUS_NOT_SUPPORTED), and each expert's scale_inv is a view
    sinv = empty((groups, 4), dtype=torch.float32, device=dev)
    lds = list(col_lds) if columnwise else splits
    offs = list(col_offsets) if columnwise else [0] * groups
    strides = strides if columnwise else lds
    pack = columnwise and not any(map((4).__rmod__, offs + lds + strides))  # every v % 4 == 0
    meta, tiles = _group_meta(tuple(splits), tuple(lds), tuple(offs), tuple(strides), br, dev)
    dummy = torch.empty(1, dtype=torch.uint8, device=dev)
    grid = (tiles * triton.cdiv(cols, bc),)  # rows > 0: at least one tile
    _grouped_fp8_kernel[grid](
        kernel_input(x2), amax.float().contiguous(), meta,
        rd.view(torch.uint8) if rowwise else dummy, cd.view(torch.uint8) if columnwise else dummy, sinv,
        cols, groups, x2.stride(0), x2.stride(1), f32(eps), POW2=power_2_scale, ROW=rowwise,
        COL=columnwise, MBITS=mbits, BIAS=bias, FP8_MAX=fmax, DTYPE=DTYPE_CODE[x2.dtype], BR=br, BC=bc,
        BG=128, HW=hw_fp8(dev), PACK=pack, ANCHOR=not rowwise, GP=triton.next_power_of_2(groups + 1),
        num_warps=num_warps or 8)
    return rd, cd, sinv[:, 0]
