"""Fused hybrid quantize: NVFP4 1D rowwise + MXFP8 1D columnwise in one cast pass (numerics §3).

The Composer-2 / ``per_gemm(fprop="nvfp4", wgrad or dgrad="mxfp8")`` operand: rowwise copy
NVFP4 1x16 (per-tensor or row-scaled global amax), columnwise copy MXFP8 32x1 of either
the original input (``columnwise_source="original"``) or the exact FP32 dequantized rowwise
value (``"rowwise_dequantized"``): ``(e2m1 * fp32(S_dec_b)) * S_dec``, computed in registers,
never written to memory. An amax pass (``triton_nvfp4.amaxes``) comes first; then one program
per [BR, BC] tile, one 32-row block at a time:

- rowwise: NVFP4 blocks along the columns, packed codes and E4M3 scales stored. The
  dequantized value comes from the rounding itself (``triton_nvfp4_tile.e2m1_rne``: the rounded
  magnitude the FMA already holds) times the block scale's FP32 value from the scale
  computation (``block_scales_dec``), then S_dec: no decode of the stored codes;
- columnwise, ``method="natural"`` (the default): the block is read as four [8, BC] slices of
  rows 4i + k, each quantized rowwise on its own, so that the four rows of a column's code
  word sit in one thread (``triton_mxfp8.col_block_rows4``, as the MXFP8 natural pass:
  no data exchange, wide transposed stores);
- columnwise, ``method="trans"``: the whole [32, BC] block ``tl.trans``-posed into [BC, 32] and
  ``triton_mxfp8.col_block_32``. The compiler keeps the natural register layout, so the column
  amax and the 4-row words take cross-thread exchanges (the slower method on the H200).

Re-reading the block transposed from cache and recomputing the NVFP4 blocks in that layout
(warp shuffles) instead costs several times the NVFP4 quantize alone on the H200 and gives
wrong bytes at awkward shapes on the GPU (right in the interpreter), so neither method does it.

Bitwise equal to the two children run separately (and so to ``formats``): the NVFP4 arithmetic
is ``triton_nvfp4``'s (same helpers, numerics §2.5 order), the MXFP8 ``triton_mxfp8``'s.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import (program_tile, DTYPE_CODE, Copies, amax_nan, check_int32_tiles, empty, kernel_input, load_f32,
                      store_words_t, tile_grid, tile_offsets)
from ._common_encode import bf16_nan16, f32, fp8_params, hw_fp8
from .triton_decode import top_half
from .triton_mxfp8 import NATURAL_HW, col_block_32, col_block_rows4, col_decoded_32, natural_rows4, store_scales_t
from .triton_nvfp4_tile import RCP6, block_scales_dec, e2m1_rne, global_scales, pack_last, row_scales

MX_BLOCK = 32
NV_BLOCK = 16


@triton.jit
def _row_scales(scales_ptr, rows, R):
    """(S_enc, S_dec) [N, 1] of the [N] absolute ``rows`` (row-scaled), loaded from the
    ``triton_nvfp4_tile.row_scales`` pairs at ``scales_ptr`` (rows past R take the last row's, only
    multiplied by zeros)."""
    r = tl.minimum(rows, R - 1)
    return tl.load(scales_ptr + 2 * r)[:, None], tl.load(scales_ptr + 2 * r + 1)[:, None]


@triton.jit
def _rowwise(x, r0, c0, lr, lc, R, C, s_enc, s_dec, rd_ptr, rs_ptr, RCP6, ROW: tl.constexpr,
             HW: tl.constexpr, WORDS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
             DEC_ROW: tl.constexpr = False, NAN16: tl.constexpr = 0):
    """NVFP4 1x16 rowwise copy of the natural tile ``x`` [BR, BC] (``s_enc``/``s_dec``: 0-d or
    [BR, 1] row-scaled), with ROW stored (packed codes, 0 past C: the odd-width padding nibble;
    E4M3 block scales). Returns the FP32 dequantized value ``(q * fp32(S_dec_b)) * S_dec``, left
    to right as ``NVFP4Storage.decode`` (the first product is exact); the E2M1 value q comes
    from the rounding itself (``triton_nvfp4_tile.e2m1_rne``), not from a decode of the code.
    ``DEC_ROW``: ROW stores the copy's BF16 block decode ``q * fp32(S_dec_b)`` instead (int16
    bits into ``rd_ptr``, exact: at most 6 significant bits; no scales; S_dec stays with the
    global amax)."""
    rmask = (r0 + lr) < R
    xb = tl.reshape(x, [BR, BC // 16, 16])
    sdb, enc, dec = block_scales_dec(amax_nan(xb, 2), s_enc, s_dec, RCP6, HW)
    code, q = e2m1_rne(xb * enc[:, :, None])  # q: the E2M1 value * 2**-22; NaN elements: fixed per word below
    if ROW and DEC_ROW:  # the block decode below (the compiler computes it once)
        blocks = tl.reshape(q * (dec * 4194304.0)[:, :, None], [BR, BC])
        tl.store(rd_ptr + r0.to(tl.int64) * C + c0 + tile_offsets(lr, lc, C, 1), top_half(blocks, NAN16).to(tl.int16),
                 mask=rmask[:, None] & ((c0 + lc) < C)[None, :])
    elif ROW:
        code = tl.where(((c0 + lc) < C)[None, :], tl.reshape(code, [BR, BC]), 0)
        # a block is NaN iff its encode scale is (block_scales): its codes are sign bits only
        nan = tl.reshape(tl.broadcast_to((enc != enc)[:, :, None], [BR, BC // 16, 2]), [BR, BC // 8])
        if WORDS:  # C % 8 == 0: 8 codes (one thread's columns) per int32 store
            w = tl.reshape(code, [BR, BC // 8, 8])
            w = tl.sum(w << (tl.arange(0, 8) * 4)[None, None, :], axis=2)  # disjoint bits: sum == or
            w = tl.where(nan, w & -0x77777778, w)  # 0x88888888
            lw = tl.arange(0, BC // 8)
            wbase = rd_ptr.to(tl.pointer_type(tl.int32)) + r0.to(tl.int64) * (C // 8) + c0 // 8
            tl.store(wbase + tile_offsets(lr, lw, C // 8, 1), w,
                     mask=rmask[:, None] & ((c0 // 8 + lw) < C // 8)[None, :])
        else:
            nb = (C + 1) // 2
            lb = tl.arange(0, BC // 2)
            nan2 = tl.reshape(tl.broadcast_to(nan[:, :, None], [BR, BC // 8, 4]), [BR, BC // 2])
            byte = pack_last(code, BR, BC)
            tl.store(rd_ptr + r0.to(tl.int64) * nb + c0 // 2 + tile_offsets(lr, lb, nb, 1),
                     tl.where(nan2, byte & 0x88, byte), mask=rmask[:, None] & ((c0 // 2 + lb) < nb)[None, :])
        nbc = tl.cdiv(C, 16)
        ls = tl.arange(0, BC // 16)
        tl.store(rs_ptr + r0.to(tl.int64) * nbc + c0 // 16 + tile_offsets(lr, ls, nbc, 1), sdb,
                 mask=rmask[:, None] & ((c0 // 16 + ls) < nbc)[None, :])
    # q * 2**-22 times fp32(S_dec_b) * 2**22 (exact): q * fp32(S_dec_b), rounded once as the decode does
    return tl.reshape(q * (dec * 4194304.0)[:, :, None], [BR, BC]) * s_dec


@triton.jit
def _nvfp4_mxfp8_kernel(x_ptr, amax_ptr, rd_ptr, rs_ptr, cd_ptr, cs_ptr, R, C, NBR, sxr, sxc: tl.constexpr, RCP6, RCP,
                        ROW: tl.constexpr, COL: tl.constexpr, ROW_SCALED: tl.constexpr,
                        SRC_DEQ: tl.constexpr, RCEIL: tl.constexpr, EMAX: tl.constexpr,
                        MBITS: tl.constexpr, BIAS: tl.constexpr, FP8_MAX: tl.constexpr,
                        DTYPE: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                        PACK: tl.constexpr, WORDS: tl.constexpr, HW: tl.constexpr, WIDE: tl.constexpr = False,
                        NATURAL: tl.constexpr = False, GRID2: tl.constexpr = False, DEC_ROW: tl.constexpr = False,
                        DEC_COL: tl.constexpr = False, NAN16: tl.constexpr = 0):
    """``amax_ptr``: the global amax, or with ROW_SCALED each row's (S_enc, S_dec)
    (``triton_nvfp4_tile.row_scales``). ROW: store the NVFP4 rowwise copy. COL: the MXFP8 columnwise copy, of the dequantized
    rowwise value with SRC_DEQ (computed whether or not ROW stores it), else of x. Each 32-row
    block of the tile is read once (coalesced rows), either

    - whole, its columnwise source transposed by ``tl.trans`` (the compiler keeps the natural
      layout: the column amax and the 4-row code words then need cross-thread exchanges), or
    - ``NATURAL``: as four [8, BC] slices of rows 4i + k (``triton_mxfp8.natural_rows``), each
      quantized rowwise on its own; a column's four rows of a code word then sit in one thread
      (``triton_mxfp8.col_block_rows4``: no exchange, wide transposed stores).

    ``DEC_ROW`` / ``DEC_COL``: that copy as its BF16 decode instead (``quantize``'s
    ``decoded``; DEC_COL with the "trans" method only: ``triton_mxfp8.col_decoded_32``)."""
    pr, pc = program_tile(C, BR, BC, GRID2)
    lc = tl.arange(0, BC)
    cmask = (pc * BC + lc) < C
    nbr = tl.cdiv(R, 32)
    c0 = pc * BC
    if ROW_SCALED:
        g_enc, g_dec = 1.0, 1.0  # unused: each slice's rows have their own scales
    else:
        # once per program: inside the slice loop the compiler reloaded the amax after every store
        # (they might alias) and redid both divisions, ~4 instructions per element (sm90 SASS)
        g_enc, g_dec = global_scales(amax_ptr)
    if NATURAL:
        r0 = pr * BR
        xbase = x_ptr + r0.to(tl.int64) * sxr + c0.to(tl.int64) * sxc
        for b in tl.static_range(BR // 32):
            l4 = b * 8 + tl.arange(0, 8)  # tile-local word rows
            x0, x1, x2, x3 = natural_rows4(xbase, l4, lc, R - r0, cmask, sxr, sxc, DTYPE, amax_ptr, False)
            if ROW or SRC_DEQ:
                d0 = _slice_rowwise(x0, r0, c0, l4 * 4, lc, R, C, amax_ptr, g_enc, g_dec, rd_ptr, rs_ptr, RCP6, ROW,
                                    ROW_SCALED, HW, WORDS, BC, DEC_ROW, NAN16)
                d1 = _slice_rowwise(x1, r0, c0, l4 * 4 + 1, lc, R, C, amax_ptr, g_enc, g_dec, rd_ptr, rs_ptr, RCP6, ROW,
                                    ROW_SCALED, HW, WORDS, BC, DEC_ROW, NAN16)
                d2 = _slice_rowwise(x2, r0, c0, l4 * 4 + 2, lc, R, C, amax_ptr, g_enc, g_dec, rd_ptr, rs_ptr, RCP6, ROW,
                                    ROW_SCALED, HW, WORDS, BC, DEC_ROW, NAN16)
                d3 = _slice_rowwise(x3, r0, c0, l4 * 4 + 3, lc, R, C, amax_ptr, g_enc, g_dec, rd_ptr, rs_ptr, RCP6, ROW,
                                    ROW_SCALED, HW, WORDS, BC, DEC_ROW, NAN16)
                if SRC_DEQ:
                    x0, x1, x2, x3 = d0, d1, d2, d3
            if COL:
                e = col_block_rows4(x0, x1, x2, x3, cd_ptr, l4, lc, cmask, r0, c0, pr, R, RCEIL, EMAX, MBITS, BIAS,
                                    FP8_MAX, RCP, HW, BR, PACK)
                if b == 0:
                    e_first = e
                store_scales_t(cs_ptr, e_first, e, b, pr, c0, lc, cmask, nbr, NBR, BR, WIDE)
    else:
        l32 = tl.arange(0, 32)
        for b in tl.static_range(BR // 32):
            r0 = pr * BR + b * 32
            mask = ((r0 + l32) < R)[:, None] & cmask[None, :]
            x = load_f32(x_ptr + r0.to(tl.int64) * sxr + c0.to(tl.int64) * sxc + tile_offsets(l32, lc, sxr, sxc),
                         mask, DTYPE)
            src = x
            if ROW or SRC_DEQ:
                deq = _slice_rowwise(x, r0, c0, l32, lc, R, C, amax_ptr, g_enc, g_dec, rd_ptr, rs_ptr, RCP6, ROW,
                                     ROW_SCALED, HW, WORDS, BC, DEC_ROW, NAN16)
                if SRC_DEQ:
                    src = deq
            if COL and DEC_COL:
                col_decoded_32(tl.trans(src), cd_ptr, lc, c0, r0, R, C, RCEIL, EMAX, MBITS, BIAS, FP8_MAX, RCP, HW,
                               NAN16)
            elif COL:
                e, qc = col_block_32(tl.trans(src), RCEIL, EMAX, MBITS, BIAS, FP8_MAX, RCP, HW)
                store_words_t(cd_ptr, qc, lc, c0, r0, R, C, PACK, WIDE)
                if b == 0:
                    e_first = e
                store_scales_t(cs_ptr, e_first, e, b, pr, c0, lc, cmask, nbr, NBR, BR, WIDE)


@triton.jit
def _slice_rowwise(x, r0, c0, lr, lc, R, C, amax_ptr, g_enc, g_dec, rd_ptr, rs_ptr, RCP6, ROW: tl.constexpr,
                   ROW_SCALED: tl.constexpr, HW: tl.constexpr, WORDS: tl.constexpr, BC: tl.constexpr,
                   DEC_ROW: tl.constexpr = False, NAN16: tl.constexpr = 0):
    """:func:`_rowwise` of the rows ``r0 + lr`` of ``x`` with their global scales: the rows' own
    (``ROW_SCALED``: ``amax_ptr`` holds the rows' (S_enc, S_dec) pairs) or the tensor's ``g_enc`` /
    ``g_dec``."""
    if ROW_SCALED:
        s_enc, s_dec = _row_scales(amax_ptr, r0 + lr, R)
    else:
        s_enc, s_dec = g_enc, g_dec
    return _rowwise(x, r0, c0, lr, lc, R, C, s_enc, s_dec, rd_ptr, rs_ptr, RCP6, ROW, HW, WORDS, x.shape[0], BC,
                    DEC_ROW, NAN16)


#: wide columnwise stores. "trans": a column's code words leave two threads wide
#: (``_common.store_words_t``); both methods: with 64-row tiles both blocks' scale bytes of a column
#: in one 2-byte store (``triton_mxfp8.store_scales_t``). "natural"'s code words are wide anyway.
#: On the H200 the wide stores are neutral to slightly faster: the kernel is bound by instruction
#: issue.
WIDE_STORES = True

#: how each 32-row block reaches the columnwise copy: "trans" (``tl.trans`` of the whole block)
#: or "natural" (four [8, BC] slices of rows 4i + k; see :func:`_nvfp4_mxfp8_kernel`)
METHODS = ("trans", "natural")
#: the default method and each method's default (block, warps): the fastest for both column
#: sources on an NVIDIA H200 (16384x4096 BF16, row-scaled); "natural" also compiles to fewer instructions per element for
#: sm90 (Triton 3.6).
METHOD = "natural"
DEFAULT_TILES = {"trans": ((32, 64), 2), "natural": ((32, 64), 2)}


def quantize(x2: torch.Tensor, row_amax: torch.Tensor, col_dtype: torch.dtype, *, rule: str = "rceil",
             rowwise: bool = True, columnwise: bool = True, source: str = "rowwise_dequantized",
             block: Optional[tuple[int, int]] = None, num_warps: Optional[int] = None, pack: bool = True,
             maxnreg: Optional[int] = None, wide_stores: Optional[bool] = None,
             method: Optional[str] = None, decoded: tuple[bool, bool] = (False, False)) -> Copies:
    """NVFP4 rowwise + MXFP8 columnwise of non-empty 2D ``x2`` (any strides) in one pass.

    ``row_amax``: the NVFP4 global amax (0-d) or per-row amaxes ([R], row-scaled), already
    reduced. Returns ``(row, col)``: ``row`` = (packed data, E4M3 scales) as
    ``formats.nvfp4.quantize_1d(x2, row_amax)`` (None unless ``rowwise``); ``col`` = (data,
    E8M0 scales) as ``formats.mxfp8.quantize_1d(src.t(), col_dtype, rule=rule)`` with ``src``
    the FP32 dequantized rowwise value (``source="rowwise_dequantized"``) or ``x2``
    (``"original"``); None unless ``columnwise``. ``block``: (rows, columns) per program,
    multiples of 32, with ``num_warps`` (default BC / 32, at most 8); both default to the
    method's ``DEFAULT_TILES``. ``maxnreg``: a register cap per thread (GPU
    compile option; CUDA only), default none (or 0). ``wide_stores``: with 64-row tiles both
    blocks' scale bytes of a column in one store, and for "trans" the columnwise codes two
    threads wide per column (whole-sector L2 requests, ``_common.store_words_t``); default
    ``WIDE_STORES``.
    ``method``: one of ``METHODS`` (default ``METHOD``); "natural" converts to FP8 by inline PTX
    on the GPU (``triton_mxfp8.NATURAL_HW``: a code word from two paired conversions), as the
    MXFP8 natural pass does.
    ``decoded`` (rowwise, columnwise): that copy as its BF16 decode instead, ``(values, None)``:
    the rowwise copy's ``formats.nvfp4.decode_blocks_1d`` (block-decoded, S_dec left to the
    global amax), the columnwise copy's ``formats.mxfp8.dequantize_1d``, both rounded to BF16
    (exact; ``tensors.decoded``). A decoded columnwise copy takes the "trans" method (its
    transposed [BC, 32] block: ``triton_mxfp8.col_decoded_32``), its default tile unless given.
    """
    dec_row, dec_col = decoded
    if dec_col and columnwise:
        if method == "natural":
            raise ValueError("a decoded columnwise copy is written by the 'trans' method; pass method=None or "
                             "'trans'.")
        method = "trans"
    method = method or METHOD
    if method not in METHODS:
        raise ValueError(f"method={method!r} is unknown; use one of {METHODS}.")
    if block is None:
        block, num_warps = DEFAULT_TILES[method][0], num_warps or DEFAULT_TILES[method][1]
    if source not in ("original", "rowwise_dequantized"):
        raise ValueError(f"source={source!r} is unknown; use 'original' or 'rowwise_dequantized'.")
    if rule not in ("rceil", "floor"):
        raise ValueError(f"rule={rule!r} is unknown; use 'rceil' or 'floor'.")
    br, bc = block
    if br % MX_BLOCK or bc % MX_BLOCK:
        raise ValueError(f"block={block} must be multiples of {MX_BLOCK}.")
    rows, cols = x2.shape
    check_int32_tiles(rows, cols, *x2.stride())
    mbits, bias, fmax = fp8_params(col_dtype)
    dev = x2.device
    row = col = None
    hw = (NATURAL_HW if method == "natural" else True) if hw_fp8(dev) else False
    if rowwise:
        row = ((empty((rows, cols), dtype=torch.bfloat16, device=dev), None) if dec_row else
               (empty((rows, (cols + 1) // 2), dtype=torch.uint8, device=dev),
                empty((rows, triton.cdiv(cols, NV_BLOCK)), dtype=torch.float8_e4m3fn, device=dev)))
    if columnwise:
        col = ((empty((cols, rows), dtype=torch.bfloat16, device=dev), None) if dec_col else
               (empty((cols, rows), dtype=col_dtype, device=dev),
                empty((cols, triton.cdiv(rows, MX_BLOCK)), dtype=torch.uint8, device=dev)))
    dummy = torch.empty(1, dtype=torch.uint8, device=dev)
    # decoded rows: exact BF16 bits as int16; decoded columns: BF16 on the GPU (the hardware
    # conversions of triton_mxfp8.decoded_values), int16 bits in the interpreter
    rd = (row[0].view(torch.int16) if dec_row else row[0]) if row else dummy
    rs = row[1].view(torch.uint8) if row and not dec_row else dummy
    cd = ((col[0] if hw else col[0].view(torch.int16)) if dec_col else col[0].view(torch.uint8)) if col else dummy
    cs = col[1] if col and not dec_col else dummy
    grid, grid2 = tile_grid(rows, cols, br, bc)
    row_scaled = row_amax.dim() == 1
    # the rows' scales only where the kernel reads them (a rowwise copy or its dequantized value)
    needs_scales = row_scaled and (rowwise or source == "rowwise_dequantized")
    _nvfp4_mxfp8_kernel[grid](
        kernel_input(x2), row_scales(row_amax) if needs_scales else row_amax.float().contiguous(),
        rd, rs, cd, cs, rows, cols, triton.cdiv(rows, MX_BLOCK), x2.stride(0), x2.stride(1), RCP6,
        f32(1.0 / fmax),
        ROW=rowwise, COL=columnwise, ROW_SCALED=row_scaled,
        SRC_DEQ=source == "rowwise_dequantized", RCEIL=rule == "rceil", EMAX={3: 8, 2: 15}[mbits],
        MBITS=mbits, BIAS=bias, FP8_MAX=fmax, DTYPE=DTYPE_CODE[x2.dtype], BR=br, BC=bc,
        PACK=pack and rows % 4 == 0, WORDS=cols % 8 == 0,
        HW=hw, WIDE=WIDE_STORES if wide_stores is None else wide_stores, NATURAL=method == "natural", GRID2=grid2,
        **({"DEC_ROW": True} if dec_row and rowwise else {}), **({"DEC_COL": True} if dec_col and columnwise else {}),
        **({"NAN16": bf16_nan16(dev)} if (dec_row and rowwise) or (dec_col and columnwise) else {}),
        num_warps=num_warps or min(max(bc // 32, 1), 8), **({"maxnreg": maxnreg} if maxnreg and dev.type == "cuda" else {}))
    return row, col
