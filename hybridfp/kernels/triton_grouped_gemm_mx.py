"""Prototype (opt-in, not on any default path): the TMA rows kernel of the grouped GEMM with B
read as MXFP8 codes and decoded to BF16 in registers, inside the K loop.

``grouped_rows_mxfp8b(a, b_codes, b_scales, splits, ...)`` computes what
``triton_grouped_gemm.grouped_rows(a, decode(b), splits, kernel="tma", tma=cfg)`` computes, where
``decode(b)`` is the BF16 block decode of the MXFP8 rowwise copy (``formats.mxfp8.dequantize_1d(
codes, scales).to(bfloat16)``, what ``gemm.bf16_decode`` and ``triton_decode.decode_mxfp8``
produce), but without writing and re-reading that decoded copy: per K tile the program reads
B's FP8 codes (1 byte an element, a TMA descriptor over the uint8 view) and its E8M0 bytes
(BK/32 per row, pointer loads), decodes them to BF16 and hands the tile to ``tl.dot`` with A's
BF16 tile. Everything else is ``_tma_rows_kernel``'s: the persistent swizzled schedule, the
expert lookup, the K tiles in the same order, the same ``_epilogue``.

The property (tests/kernels/test_kernels_grouped_gemm_mx.py, interpreter and GPU): at the same
``TmaConfig`` the output equals, bit for bit, ``_tma_rows_kernel`` on the in-memory decode. It
rests on the decoded tile being bitwise the in-memory decode's tile:

- an element is ``bf16(fp32(code) * 2**(e - 127))``: the FP8 code widened exactly (hardware
  ``cvt`` on the GPU), one IEEE FP32 multiply by the power of two built from the bits (byte 0 is
  the FP32 subnormal 2**-127, 0xFF is NaN; Triton emits no ``.ftz``, so products below FP32's
  normal range are rounded, not flushed) and one round-to-nearest-even to BF16 (hardware
  ``cvt.rn.bf16.f32``: NaN as torch's GPU cast gives it) — the reference's two roundings; the
  interpreter (whose BF16 cast truncates) takes the integer path of
  ``triton_decode.e8m0_scaled_bits`` and widens the bits as ``_widen`` does;
- what lies outside B is zero, as TMA's fill gives the BF16 path: codes past the matrix end
  and past K are zero-filled by TMA and their scale bytes are read as 127 (1.0), so no NaN
  scale can meet a fill. K must be a multiple of 32 (whole blocks: a partial last block would
  put its scale, possibly NaN, on filled codes);
- column tiles reaching past an expert's N read the next expert's rows (real codes and scales,
  NaN included): only their output columns, masked at the store, see them.

Compiled offline for sm90 (Triton 3.6, ``python -m bench.tools.sass_count --resources --match
mxfp8b``): the decode is ``cvt.rn.f16x2.e4m3x2`` + ``cvt.f32.f16`` (hardware, no integer
sequence), ``mul.rn.f32`` (no ``.ftz``), ``cvt.rn.bf16x2.f32``. The decoded tile is staged in
shared memory and each wgmma
waited for (``pendings = 0``: decode and MMA serialize).

Speed: on an NVIDIA H200 (the 8-expert MoE's fc1 / fc2 fprop) this kernel is bitwise equal to
the two passes it replaces (decode, then the TMA kernel) but clearly slower than them, so it is
a prototype that no GEMM path selects. A transposed form (the decoded B as wgmma's register
operand) gives whole blocks of inf outputs on the GPU where the two-pass result is finite (the
interpreter agrees bitwise), so it is not offered.

Limitations: A stays BF16; B rowwise 1x32 blocks only (fprop: W.rowwise [N, K]; dgrad's W.columnwise,
stored transposed [K, N] with 1x32 blocks along the reduction, has the same layout; 32x32 blocks
would need the scale row index ``row // 32``).
"""

from __future__ import annotations

from typing import NoReturn, Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._common import bf16_nan16, empty
from .host import to_device
from .triton_decode import _expand, _fp8_f32, e8m0_f32, e8m0_scaled_bits
from .triton_epilogue import OUT_CODE
from .triton_grouped_gemm import (_TILE_MARGIN, TmaConfig, default_tma_config, _check, _epilogue, _plan, _sm_count,
                                  _widen, tma_tile)

#: elements per E8M0 scale (MXFP8 1x32 blocks)
BLOCK = 32


#: Configs compared on the GPU and by ``bench.tools.sass_count`` (BK a multiple of 32).
MX_CONFIGS: dict[str, TmaConfig] = {
    "128x256x64 w8 s3": TmaConfig(),
    "128x256x64 w8 s3 flat": TmaConfig(flatten=True),
    "128x256x128 w8 s3": TmaConfig(bk=128),
    "128x128x64 w8 s4": TmaConfig(bn=128, stages=4),
}


@triton.jit
def _decode_tile(c, e, E5M2: tl.constexpr, BITS: tl.constexpr, NAN16: tl.constexpr):
    """B's BF16 operand tile from FP8 code bytes ``c`` (uint8 [BN, BK]) and their E8M0 bytes
    ``e`` (int32 [BN, BK / 32], one per 32 codes of a row): ``bf16(fp32(code) * 2**(e - 127))``
    bit for bit the reference decode. The power of two is built once per block and then
    broadcast to the block's codes. ``BITS`` (the interpreter): the exact FP32 value of those
    BF16 bits instead (what ``_widen`` makes of the in-memory decode's int16 bits)."""
    BN: tl.constexpr = c.shape[0]
    BK: tl.constexpr = c.shape[1]
    if BITS:
        bits = e8m0_scaled_bits(_fp8_f32(c.to(tl.int32), E5M2), _expand(e, BN, BK, 32), NAN16)
        return _widen(bits.to(tl.int16), True)
    else:
        if E5M2:
            v = c.to(tl.float8e5, bitcast=True).to(tl.float32)
        else:
            v = c.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        return (v * _expand(e8m0_f32(e), BN, BK, 32)).to(tl.bfloat16)


@triton.jit
def _tma_rows_mxfp8b_kernel(a_desc, b_desc, bs_ptr, sa_ptr, sb_ptr, bias_ptr, out_ptr, meta_ptr, T, N, K, E,
                            som, sbs, P,
                            SA: tl.constexpr, SB: tl.constexpr, BIAS: tl.constexpr, OUT: tl.constexpr,
                            NAN16: tl.constexpr, BITS: tl.constexpr, E5M2: tl.constexpr, BM: tl.constexpr,
                            BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, EP: tl.constexpr,
                            FLATTEN: tl.constexpr):
    # _tma_rows_kernel with B's tile decoded from codes (b_desc: uint8 [E * N, K]) and E8M0 bytes
    # (bs_ptr: [E * N, K / 32], row stride sbs) in registers; K % 32 == 0 (whole blocks)
    tiles = T * tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    KB = K // 32  # scale bytes per row
    NB: tl.constexpr = BK // 32  # scale bytes per row of a K tile
    ROWS = E * N
    for tile in tl.range(tl.program_id(0), tiles, P, flatten=FLATTEN):
        e, j, r0, r1, b_row = tma_tile(meta_ptr, tile, T, N, E, BM, BN, GROUP, EP)
        brows = b_row + tl.arange(0, BN)
        sptr = bs_ptr + brows.to(tl.int64)[:, None] * sbs
        rmask = (brows < ROWS)[:, None]
        # the scale bytes of K tile kt + 1 are loaded in iteration kt (their latency hides behind the
        # tile's decode and MMA: Triton does not pipeline a load that feeds arithmetic, not a dot);
        # past the matrix or past K: the neutral byte 127 (the codes there are TMA's zeros)
        kb = tl.arange(0, NB)
        s_next = tl.load(sptr + kb[None, :], mask=rmask & (kb < KB)[None, :], other=127)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kt in range(0, k_tiles):
            s = s_next.to(tl.int32)
            kb = (kt + 1) * NB + tl.arange(0, NB)
            s_next = tl.load(sptr + kb[None, :], mask=rmask & (kb < KB)[None, :], other=127)
            a = _widen(a_desc.load([r0, kt * BK]), BITS)
            c = b_desc.load([b_row, kt * BK])
            b = _decode_tile(c, s, E5M2, BITS, NAN16)
            acc = tl.dot(a, b.T, acc)
        rows = r0 + tl.arange(0, BM)
        cols = j * BN + tl.arange(0, BN)
        _epilogue(acc, rows.to(tl.int64), cols.to(tl.int64), rows < r1, cols < N, e.to(tl.int64), sa_ptr, sb_ptr,
                  bias_ptr, out_ptr, N, 0, 0, som, SA, SB, BIAS, OUT, NAN16, BITS)


_CODE_DTYPES = (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)


def _fail(msg: str) -> NoReturn:
    raise ValueError(f"grouped_rows_mxfp8b: {msg}")


def _check_operands(a: torch.Tensor, b_codes: torch.Tensor, b_scales: torch.Tensor, splits: list[int],
                    cfg: TmaConfig) -> None:
    """Shapes, dtypes and what TMA needs, each refusal naming the tensor and the fix."""
    if a.dtype != torch.bfloat16 or a.dim() != 2:
        _fail(f"a must be a BF16 [M, K] matrix; got {a.dtype} {tuple(a.shape)}.")
    if b_codes.dtype not in _CODE_DTYPES or b_codes.dim() != 3:
        _fail(f"b_codes must be the MXFP8 rowwise codes [E, N, K] as float8_e4m3fn / float8_e5m2 or uint8 "
              f"(E4M3 bytes); got {b_codes.dtype} {tuple(b_codes.shape)}.")
    (m, k), (e, n, kb) = a.shape, b_codes.shape
    if kb != k or k == 0:
        _fail(f"a {tuple(a.shape)} and b_codes {tuple(b_codes.shape)} must share K > 0.")
    if k % BLOCK:
        _fail(f"K = {k} must be a multiple of {BLOCK} (whole MXFP8 blocks); pad K, or decode B "
              f"(triton_decode.decode_mxfp8) and use triton_grouped_gemm.grouped_rows.")
    if e != len(splits) or sum(splits) != m or min(splits, default=0) < 0:
        _fail(f"splits (sum {sum(splits)}, {len(splits)} experts, none negative) must give a's {m} rows to "
              f"b_codes' {e} experts.")
    if b_scales.dtype != torch.uint8 or tuple(b_scales.shape) != (e, n, k // BLOCK):
        _fail(f"b_scales must be the E8M0 bytes (uint8) of shape {(e, n, k // BLOCK)} (one per 32 elements "
              f"of K); got {b_scales.dtype} {tuple(b_scales.shape)}.")
    if cfg.bk % BLOCK or cfg.bk & (cfg.bk - 1):
        _fail(f"the TmaConfig's bk = {cfg.bk} must be a power of two and a multiple of {BLOCK} (a K tile "
              f"holds whole blocks; Triton's block shapes are powers of two).")
    devices = {t.device for t in (a, b_codes, b_scales)}
    if len(devices) != 1:
        _fail(f"a, b_codes and b_scales must be on one device; got {sorted(map(str, devices))}.")
    if a.is_cuda and torch.cuda.get_device_capability(a.device) < (9, 0):
        _fail(f"needs a Hopper or newer GPU (TMA); {torch.cuda.get_device_name(a.device)} is not. Decode B "
              f"(triton_decode.decode_mxfp8) and use triton_grouped_gemm.grouped_rows(kernel='pointer').")
    if m * n == 0:  # an empty output: nothing is read, no layout to refuse (as grouped_rows)
        return
    if a.stride(1) != 1 or a.stride(0) < k or a.data_ptr() % 16 or (a.stride(0) * 2) % 16:
        _fail(f"a must have unit inner stride, rows not overlapping and a 16-byte aligned base and row "
              f"stride (TMA); got strides {a.stride()} (call .contiguous() on it; K % 8 == 0).")
    if (b_codes.stride(2) != 1 or b_codes.stride(1) < k or (e > 1 and b_codes.stride(0) != n * b_codes.stride(1))
            or b_codes.data_ptr() % 16 or b_codes.stride(1) % 16):
        _fail(f"b_codes must be one [E*N, K] matrix (experts stacked), unit inner stride, 16-byte aligned base "
              f"and row stride (TMA); got strides {b_codes.stride()} (call .contiguous() on it; K % 16 == 0).")
    if b_scales.stride(2) != 1 or (e > 1 and b_scales.stride(0) != n * b_scales.stride(1)):
        _fail(f"b_scales must be one [E*N, K/32] matrix (experts stacked) with unit inner stride; got strides "
              f"{b_scales.stride()} (call .contiguous() on it).")
    if max(m, e * n, k) + _TILE_MARGIN >= 2**31:
        _fail(f"a {tuple(a.shape)} / b_codes {tuple(b_codes.shape)}: tile indices must stay within int32.")


def grouped_rows_mxfp8b(a: torch.Tensor, b_codes: torch.Tensor, b_scales: torch.Tensor, splits: list[int], *,
                        scale_a: Optional[torch.Tensor] = None, scale_b: Optional[torch.Tensor] = None,
                        bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16,
                        tma: Optional[TmaConfig] = None) -> torch.Tensor:
    """fprop with MXFP8 weights: ``out[r_e + i, j] = ep(Σ_k a[r_e + i, k] · w_e[j, k])`` with
    ``w_e = dequantize_1d(b_codes[e], b_scales[e])`` (bitwise ``grouped_rows(a, w, splits,
    kernel="tma", tma=tma)`` on the BF16 decode ``w``, without materialising it).

    ``a`` [Σ splits, K] BF16; ``b_codes`` [E, N, K] FP8 codes (float8_e4m3fn / float8_e5m2, or
    uint8 read as E4M3), ``b_scales`` [E, N, K/32] E8M0 bytes, K % 32 == 0; ``scale_a`` [Σ splits],
    ``scale_b`` / ``bias`` [E, N] FP32 or None; returns [Σ splits, N] in ``out_dtype``. ``tma``: a
    ``TmaConfig`` (None: ``default_tma_config(out_dtype)``: an FP32 output needs its smaller
    shared memory). Hopper+
    GPU, or CPU tensors under ``TRITON_INTERPRET=1``."""
    tma = tma or default_tma_config(out_dtype)
    _check_operands(a, b_codes, b_scales, splits, tma)
    if out_dtype not in OUT_CODE:
        _fail(f"out_dtype must be one of {sorted(map(str, OUT_CODE))}; got {out_dtype}.")
    (m, k), (e, n, _) = a.shape, b_codes.shape
    _check("scale_a", scale_a, (m,))
    _check("scale_b", scale_b, (e, n))
    _check("bias", bias, (e, n))
    out = empty((m, n), out_dtype, a.device)
    starts = [sum(splits[:i]) for i in range(e + 1)]
    meta, row_tiles, _ = _plan([(starts[i], starts[i + 1]) for i in range(e)], [(0, k)] * e, tma.bm)
    if row_tiles == 0 or n == 0:
        return out
    cfg = tma
    dst = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
    bits = not a.is_cuda  # the interpreter: BF16 read as its int16 bits
    if bits:
        a = a.view(torch.int16)
    e5m2 = b_codes.dtype == torch.float8_e5m2
    codes = b_codes.view(torch.uint8)
    a_desc = TensorDescriptor(a, [m, k], [a.stride(0), 1], [cfg.bm, cfg.bk])
    b_desc = TensorDescriptor(codes, [e * n, k], [codes.stride(1), 1], [cfg.bn, cfg.bk])
    tiles = row_tiles * triton.cdiv(n, cfg.bn)
    programs = cfg.programs or (_sm_count(a.device.index or 0) if a.is_cuda else 4)
    programs = min(programs, tiles)
    dummy = out
    _tma_rows_mxfp8b_kernel[(programs,)](
        a_desc, b_desc, b_scales, scale_a if scale_a is not None else dummy,
        scale_b if scale_b is not None else dummy, bias if bias is not None else dummy, dst,
        to_device(meta, out.device), row_tiles, n, k, e, out.stride(0), b_scales.stride(1), programs,
        SA=scale_a is not None, SB=scale_b is not None, BIAS=bias is not None, OUT=OUT_CODE[out.dtype],
        NAN16=bf16_nan16(out.device), BITS=bits, E5M2=e5m2, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP=cfg.group_m,
        EP=triton.next_power_of_2(e + 1), FLATTEN=cfg.flatten,
        num_warps=cfg.warps, num_stages=cfg.stages, enable_fp_fusion=False)
    return out
