"""MXFP8 quantize kernels (SPEC §2.4): one read of the input writes every requested copy.

- 1D: rowwise 1x32 blocks ``[R, C]`` + E8M0 ``[R, ceil(C/32)]``, and columnwise 32x1 blocks
  stored transposed ``[C, R]`` + ``[C, ceil(R/32)]``, from the same [BR, BC] tile (read from
  device memory once; the columnwise copy re-reads it from cache as transposed [BC, 32]
  tiles whose 32 rows sit in one thread: ``_common.load_rows32_t``).
- 2D: 32x32 tiles; the columnwise copy is the rowwise one transposed (data and scales).

Bitwise equal to ``formats.mxfp8`` (tests/kernels/test_kernels_mxfp8.py): the E8M0 byte is
computed from the FP32 amax bits exactly as ``e8m0_from_amax``; ``x / 2**k`` is computed as
``x * 2**-k`` with the reciprocal built from bits (both are the correctly rounded value of the
same real number, and every 2**-k for a valid byte is an FP32 number), then clamped and
rounded to the FP8 grid by ``_common.fp8_encode``. Data are written as uint8 code bytes into
the FP8 outputs (on the GPU the hardware conversion gives those bytes; tile-local int32
offsets; ``_common`` says why).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_decode import e8m0_scaled_bits
from ._common import (program_tile, load_tile, DTYPE_CODE, Copies, amax_nan, check_int32_tiles, empty, f32, fp8_encode,
                      fp8_params, hw_fp8, bf16_nan16, store_bf16_words, store_bf16_words_t, kernel_input, load_f32, load_rows32_t, store_transposed_u8,
                      store_words_t, tile_offsets)

BLOCK = 32
_BLOCK = tl.constexpr(BLOCK)  # the same, visible inside kernels


@triton.jit
def _e8m0_byte(amax, RCEIL: tl.constexpr, EMAX: tl.constexpr, RCP):
    """``formats.mxfp8.e8m0_from_amax`` (int32 byte) of non-negative block amaxes."""
    if RCEIL:
        bits = (amax * RCP).to(tl.int32, bitcast=True) & 0x7FFFFFFF
        exp = bits >> 23
        man = bits & 0x7FFFFF
        tiny = (exp == 0) & (man <= 0x400000)
        up = (man != 0) & (exp != 0xFE) & (tiny == 0)
        e = exp + up.to(tl.int32)
    else:
        exp = (amax.to(tl.int32, bitcast=True) & 0x7FFFFFFF) >> 23
        e = tl.minimum(tl.maximum(exp - EMAX, 0), 0xFE)
    e = tl.where(amax == float("inf"), 0xFE, e)
    return tl.where(amax != amax, 0xFF, e)


@triton.jit
def _e8m0_value(e):
    """FP32 ``2**(e - 127)`` of E8M0 bytes (int32; e = 0 is the FP32 subnormal 2**-127); NaN for 0xFF."""
    bits = tl.where(e == 0, 0x400000, e << 23)
    return tl.where(e == 0xFF, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_value(code, MBITS: tl.constexpr):
    """FP32 values of FP8 code bytes (uint8) by the hardware conversion (exact, NaN / inf included)."""
    if MBITS == 2:
        return code.to(tl.float8e5, bitcast=True).to(tl.float32)
    return code.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _e8m0_inverse(e):
    """FP32 ``2**(127 - e)`` (exact: 2**127 .. 2**-127) of E8M0 bytes; NaN for 0xFF."""
    bits = tl.where(e == 0xFE, 0x400000, (254 - e) << 23)
    return tl.where(e == 0xFF, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def col_block_32(xt, RCEIL: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
                 FP8_MAX: tl.constexpr, RCP, HW: tl.constexpr):
    """(E8M0 bytes [BC] int32, FP8 codes [BC, 32] uint8) of the 32x1 blocks of a transposed
    FP32 tile ``xt`` [BC, 32] (one block per column; see ``_common.load_rows32_t``)."""
    e = _e8m0_byte(amax_nan(xt, 1), RCEIL, EMAX, RCP)
    return e, fp8_encode(xt * _e8m0_inverse(e)[:, None], FP8_MAX, MBITS, BIAS, HW)


@triton.jit
def _mxfp8_1d_kernel(x_ptr, rd_ptr, rs_ptr, cd_ptr, cs_ptr, rb_ptr, cb_ptr, R, C, sxr, sxc: tl.constexpr, RCP,
                     ROW: tl.constexpr, COL: tl.constexpr, RCEIL: tl.constexpr,
                     EMAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
                     FP8_MAX: tl.constexpr, DTYPE: tl.constexpr, BR: tl.constexpr,
                     BC: tl.constexpr, PACK: tl.constexpr, HW: tl.constexpr,
                     ROW_BF16: tl.constexpr = False, COL_BF16: tl.constexpr = False,
                     NAN16: tl.constexpr = 0, R_EVEN: tl.constexpr = False, C_EVEN: tl.constexpr = False):
    """One [BR, BC] tile per program. Rowwise 1x32 blocks from the natural tile (a block's 32
    columns sit in a few neighbouring threads); columnwise 32x1 blocks from transposed
    [BC, 32] tiles re-read from cache (``_common.load_rows32_t``: register-local block amax,
    word stores), one per 32 rows. (Transposing each 32-row slice in registers instead,
    ``tl.trans``, measured 0.181 vs 0.142 ms row+col on the H200: not kept.)

    ``ROW_BF16`` / ``COL_BF16``: also write that copy block-decoded into BF16 (at ``rb_ptr``
    [R, C] / ``cb_ptr`` [C, R], the layouts ``triton_decode.decode_mxfp8`` gives), from the
    codes and scales still in registers. On the GPU (``HW``): the hardware FP8 -> FP32
    conversion, one IEEE FP32 multiply by the block's 2**(e - 127) and the RNE conversion to
    BF16 — exact for BF16-normal values, and for tiny blocks the same two roundings (FP32
    subnormal, then BF16) as the reference, since Triton does not flush FP32 subnormals; the
    GPU tests hold it to the decode kernel's integer path bit for bit. Under the interpreter
    (whose FP8 and BF16 casts are not IEEE): ``triton_decode.e8m0_scaled_bits``, the decode
    kernel's own arithmetic (as bits)."""
    pr, pc = program_tile(C, BR, BC)
    r0, c0 = pr * BR, pc * BC
    lc = tl.arange(0, BC)
    xbase = x_ptr + r0.to(tl.int64) * sxr + c0.to(tl.int64) * sxc
    if ROW:
        lr = tl.arange(0, BR)
        mask = ((r0 + lr) < R)[:, None] & ((c0 + lc) < C)[None, :]
        x = load_f32(xbase + tile_offsets(lr, lc, sxr, sxc), mask, DTYPE)
        xb = tl.reshape(x, [BR, BC // _BLOCK, _BLOCK])
        e = _e8m0_byte(amax_nan(xb, 2), RCEIL, EMAX, RCP)
        y = tl.reshape(xb * _e8m0_inverse(e)[:, :, None], [BR, BC])
        code = fp8_encode(y, FP8_MAX, MBITS, BIAS, HW)
        tl.store(rd_ptr + r0.to(tl.int64) * C + c0 + tile_offsets(lr, lc, C, 1), code, mask=mask)
        if ROW_BF16:
            if HW:
                # The block values broadcast the way ``y`` was (from xb's layout, then the same
                # reshape), so they share the codes' register layout: no shared-memory shuffle.
                sv = tl.reshape(tl.broadcast_to(_e8m0_value(e)[:, :, None], [BR, BC // _BLOCK, _BLOCK]), [BR, BC])
                out = (_fp8_value(code, MBITS) * sv).to(tl.bfloat16)
            else:
                ee = tl.reshape(tl.broadcast_to(e[:, :, None], (BR, BC // _BLOCK, _BLOCK)), (BR, BC))
                out = e8m0_scaled_bits(code.to(tl.int32), ee, tl.min(tl.min(e, 1), 0) >= BIAS + MBITS,
                                       MBITS == 2, NAN16).to(tl.int16).to(tl.bfloat16, bitcast=True)
            if C_EVEN:
                store_bf16_words(rb_ptr, out, lr, r0, c0, R, C)
            else:
                tl.store(rb_ptr + r0.to(tl.int64) * C + c0 + tile_offsets(lr, lc, C, 1), out, mask=mask)
        nbc = tl.cdiv(C, _BLOCK)
        lb = tl.arange(0, BC // _BLOCK)
        smask = ((r0 + lr) < R)[:, None] & ((pc * (BC // _BLOCK) + lb) < nbc)[None, :]
        tl.store(rs_ptr + r0.to(tl.int64) * nbc + pc * (BC // _BLOCK) + tile_offsets(lr, lb, nbc, 1),
                 e.to(tl.uint8), mask=smask)
    if COL:
        cmask = (c0 + lc) < C
        nbr = tl.cdiv(R, _BLOCK)
        for b in tl.static_range(BR // _BLOCK):
            xt = load_rows32_t(xbase, b * _BLOCK, lc, R - r0, cmask, sxr, sxc, DTYPE)
            e, code = col_block_32(xt, RCEIL, EMAX, MBITS, BIAS, FP8_MAX, RCP, HW)
            store_words_t(cd_ptr, code, lc, c0, r0 + b * _BLOCK, R, C, PACK)
            if COL_BF16:
                if HW:
                    out = (_fp8_value(code, MBITS) * _e8m0_value(e)[:, None]).to(tl.bfloat16)
                else:
                    out = e8m0_scaled_bits(code.to(tl.int32), tl.broadcast_to(e[:, None], (BC, _BLOCK)),
                                           tl.min(e, 0) >= BIAS + MBITS, MBITS == 2, NAN16)
                    out = out.to(tl.int16).to(tl.bfloat16, bitcast=True)
                rb = r0 + b * _BLOCK
                if R_EVEN:
                    store_bf16_words_t(cb_ptr, out, lc, c0, rb, R, C)
                else:
                    l32 = tl.arange(0, _BLOCK)
                    tl.store(cb_ptr + c0.to(tl.int64) * R + rb + tile_offsets(lc, l32, R, 1), out,
                             mask=cmask[:, None] & ((rb + l32) < R)[None, :])
            blk = pr * (BR // _BLOCK) + b
            tl.store(cs_ptr + (c0 + lc).to(tl.int64) * nbr + blk, e.to(tl.uint8),
                     mask=cmask & ((lc * 0 + blk) < nbr))  # a vector test: see _common._row


@triton.jit
def _mxfp8_2d_kernel(x_ptr, rd_ptr, rs_ptr, cd_ptr, cs_ptr, R, C, sxr, sxc: tl.constexpr, RCP,
                     ROW: tl.constexpr, COL: tl.constexpr, RCEIL: tl.constexpr,
                     EMAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
                     FP8_MAX: tl.constexpr, DTYPE: tl.constexpr, BR: tl.constexpr,
                     BC: tl.constexpr, PACK: tl.constexpr, HW: tl.constexpr):
    x, mask, lr, lc, r0, c0, pr, pc = load_tile(x_ptr, R, C, sxr, sxc, DTYPE, BR, BC)
    xb = tl.reshape(x, [BR // _BLOCK, _BLOCK, BC // _BLOCK, _BLOCK])
    e = _e8m0_byte(amax_nan(amax_nan(xb, 3), 1), RCEIL, EMAX, RCP)  # [BR/32, BC/32]
    y = tl.reshape(xb * _e8m0_inverse(e)[:, None, :, None], [BR, BC])
    code = fp8_encode(y, FP8_MAX, MBITS, BIAS, HW)
    nbr = tl.cdiv(R, _BLOCK)
    nbc = tl.cdiv(C, _BLOCK)
    sr = pr * (BR // _BLOCK) + tl.arange(0, BR // _BLOCK)
    sc = pc * (BC // _BLOCK) + tl.arange(0, BC // _BLOCK)
    smask = (sr < nbr)[:, None] & (sc < nbc)[None, :]
    e8 = e.to(tl.uint8)
    if ROW:
        tl.store(rd_ptr + r0.to(tl.int64) * C + c0 + tile_offsets(lr, lc, C, 1), code, mask=mask)
        tl.store(rs_ptr + sr[:, None] * nbc + sc[None, :], e8, mask=smask)
    if COL:
        store_transposed_u8(cd_ptr, code, lr, lc, r0, c0, R, C, PACK)
        tl.store(cs_ptr + sc[None, :] * nbr + sr[:, None], e8, mask=smask)


def quantize(x2: torch.Tensor, dtype: torch.dtype, *, rule: str = "rceil", block_2d: bool = False,
             rowwise: bool = True, columnwise: bool = True, block: Optional[tuple[int, int]] = None,
             num_warps: Optional[int] = None, pack: bool = True) -> Copies:
    """MXFP8-quantize 2D ``x2`` (any strides); returns ``(row, col)``, each ``(data, scale)`` or
    None: the same tensors as ``formats.mxfp8.quantize_1d(x2)`` / ``quantize_1d(x2.t())``
    (``block_2d``: ``quantize_2d(x2)`` and its transpose). ``block``: the tile (multiples of 32;
    default 1D (64, 128) with BC / 32 warps: one column per thread in the columnwise copy, the
    layout it is written for; 2D (64, 64) / 8 warps, the H200 sweep's fastest); ``pack``: write
    the transposed copy as int32 words of 4 rows when R % 4 == 0 (same bytes).
    """
    row, col, _, _ = quantize_decoded(x2, dtype, rule=rule, block_2d=block_2d, rowwise=rowwise,
                                      columnwise=columnwise, block=block, num_warps=num_warps, pack=pack)
    return row, col


def quantize_decoded(x2: torch.Tensor, dtype: torch.dtype, *, rule: str = "rceil", block_2d: bool = False,
                     rowwise: bool = True, columnwise: bool = True, decoded_rowwise: bool = False,
                     decoded_columnwise: bool = False, block: Optional[tuple[int, int]] = None,
                     num_warps: Optional[int] = None, pack: bool = True
                     ) -> tuple[Optional[tuple[torch.Tensor, torch.Tensor]], Optional[tuple[torch.Tensor, torch.Tensor]],
                                Optional[torch.Tensor], Optional[torch.Tensor]]:
    """:func:`quantize`, plus (1D only) each copy asked for in ``decoded_rowwise`` /
    ``decoded_columnwise`` block-decoded into BF16 in the same pass: ``(row, col, row_bf16,
    col_bf16)``, the decoded copies [rows, cols] / [cols, rows] bitwise
    ``triton_decode.decode_mxfp8`` of the codes (None where not asked). Why: a GEMM on the BF16
    tensor-core path (Hopper has no MXFP8 MMA) decodes each copy it reads; written here, the
    copy is not read back from memory for a separate decode pass."""
    if rule not in ("rceil", "floor"):
        raise ValueError(f"rule={rule!r} is unknown; use 'rceil' or 'floor'.")
    if (decoded_rowwise and not rowwise) or (decoded_columnwise and not columnwise):
        raise ValueError("quantize_decoded: a decoded copy needs its quantized copy (decoded_rowwise needs "
                         "rowwise=True, decoded_columnwise needs columnwise=True).")
    if block_2d and (decoded_rowwise or decoded_columnwise):
        raise ValueError("quantize_decoded: decoded copies are written by the 1D (1x32) kernel only; "
                         "decode a 32x32-block copy with triton_decode.decode_mxfp8(block_2d=True).")
    rows, cols = x2.shape
    br, bc = block or ((64, 64) if block_2d else (64, 128))
    if br % BLOCK or bc % BLOCK:
        raise ValueError(f"block={block} must be multiples of {BLOCK}.")
    mbits, bias, fmax = fp8_params(dtype)
    check_int32_tiles(rows, cols, *x2.stride())
    dev = x2.device
    nbr, nbc = triton.cdiv(rows, BLOCK), triton.cdiv(cols, BLOCK)
    row = col = None
    if rowwise:
        row = (empty((rows, cols), dtype=dtype, device=dev),
               empty((nbr if block_2d else rows, nbc), dtype=torch.uint8, device=dev))
    if columnwise:
        col = (empty((cols, rows), dtype=dtype, device=dev),
               empty((nbc, nbr) if block_2d else (cols, nbr), dtype=torch.uint8, device=dev))
    row_bf16 = empty((rows, cols), torch.bfloat16, dev) if decoded_rowwise else None
    col_bf16 = empty((cols, rows), torch.bfloat16, dev) if decoded_columnwise else None
    if x2.numel() == 0:
        return row, col, row_bf16, col_bf16
    dummy = torch.empty(1, dtype=torch.uint8, device=dev)
    rd, rs = (row[0].view(torch.uint8), row[1]) if row else (dummy, dummy)
    cd, cs = (col[0].view(torch.uint8), col[1]) if col else (dummy, dummy)
    grid = (triton.cdiv(rows, br) * triton.cdiv(cols, bc),)
    common = dict(ROW=rowwise, COL=columnwise, RCEIL=rule == "rceil", EMAX={3: 8, 2: 15}[mbits], MBITS=mbits,
                  BIAS=bias, FP8_MAX=fmax, DTYPE=DTYPE_CODE[x2.dtype], BR=br, BC=bc,
                  PACK=pack and rows % 4 == 0, HW=hw_fp8(dev))
    args = (kernel_input(x2), rd, rs, cd, cs)
    tail = (rows, cols, x2.stride(0), x2.stride(1), f32(1.0 / fmax))
    if block_2d:
        _mxfp8_2d_kernel[grid](*args, *tail, **common, num_warps=num_warps or 8)
    else:
        decoded = tuple(dummy if t is None else t for t in (row_bf16, col_bf16))
        _mxfp8_1d_kernel[grid](*args, *decoded, *tail, **common, ROW_BF16=decoded_rowwise,
                               COL_BF16=decoded_columnwise, NAN16=bf16_nan16(dev), R_EVEN=rows % 2 == 0,
                               C_EVEN=cols % 2 == 0,
                               num_warps=num_warps or min(max(bc // 32, 1), 8))
    return row, col, row_bf16, col_bf16
