"""Block-decode kernels: one stored copy -> BF16 ``[rows, k_stored]`` values in one pass.

What each computes is ``storage.gemm_operand(direction).values.to(torch.bfloat16)`` (see
``hybridfp.gemm.bf16_decode``), bit for bit, for:

| function         | stored copy                                  | value                      |
|------------------|----------------------------------------------|----------------------------|
| decode_fp8       | FP8 per-tensor codes                         | code (scale_inv kept aside)|
| decode_mxfp8     | FP8 codes, E8M0 per 1x32 / 32x32             | code * 2**(e - 127)        |
| decode_fp8_block | FP8 codes, power-of-two FP32 per 1xB / BxB   | code * scale_inv           |
| decode_nvfp4     | packed E2M1 (low nibble first), E4M3 per 1x16 / 16x16 | e2m1 * e4m3 (S_dec kept aside) |

Exactness (why no FP32 rounding can differ from the reference): an FP8 code has at most 4
significant bits and an E2M1 x E4M3 product at most 6, so every product whose exponent lies
in BF16's normal range is exact in FP32 and in BF16; its BF16 bits are the FP32 bits' top
half. Only power-of-two-scaled FP8 tiles with tiny scales (E8M0 byte, or scale_inv exponent,
below ``BIAS + MBITS``: blocks of magnitude below ~2**-108) can land in the subnormal range,
where the reference rounds twice (to an FP32 subnormal, then to BF16). A tile holding such a
scale takes the exact integer path (:func:`_pow2_scale_exact`), which performs both
roundings on the bits; GPU flush-to-zero settings then never matter. NVFP4 products are at
least 2**-10 and never subnormal.

FP8 codes are widened with Triton's FP8 -> FP32 conversion, which is exact for every finite
code in both modes; the interpreter gets NaN / inf codes wrong (E4M3 0x7F -> 480, E5M2 inf ->
65536), so those are set from the code bits. NaN results use the bits torch's BF16 cast gives
on the device (``_common_encode.bf16_nan_bits``). Outputs are written as int16 bits (the
interpreter's BF16 cast truncates).

Speed: the decode reaches well under device-copy bandwidth (bytes read + written), less than a
plain dequantize kernel, and decode plus cuBLAS BF16 runs close to a BF16 GEMM (``python -m
bench.bench_gemm_pairs`` on an NVIDIA H200 measures both).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import empty, program_tile, tile_grid
from ._common_encode import bf16_nan16, e2m1_value

#: kernel kinds: FP8 codes alone, x E8M0 bytes, x power-of-two FP32, packed E2M1 x E4M3
_PLAIN, _E8M0, _POW2_F32, _NVFP4 = (tl.constexpr(i) for i in range(4))
#: default tile (rows, cols), 4 warps: the fastest tile for the per-tensor and 2D-block decodes
#: (``python -m bench.bench_gemm_pairs`` on an NVIDIA H200). The 1x32 / 1x16 block decodes are
#: faster with short, wide tiles (fewer registers per thread): _TILE_1D on _WARPS_1D warps, the
#: fastest tile for them on an NVIDIA H200 (every tile's output is bitwise the same).
_TILE = (32, 256)
_TILE_1D = (4, 512)
_WARPS_1D = 2
#: register cap of the MXFP8 1x32 decode: the rare exact path for small scales
#: (``_pow2_scale_exact``) makes the compiler hold 128 registers a thread, which limits the
#: kernel to 25 % occupancy. With a cap the spills land on that path; 56 is the fastest cap on
#: an NVIDIA H200 (output bit for bit the uncapped one; a lower cap is slower again). NVFP4's
#: decode does not gain from a cap.
_MAXNREG_E8M0_1D = 56


@triton.jit
def fp8_f32(c, E5M2: tl.constexpr):
    """FP32 value of FP8 code bytes ``c`` (int32, 0..255): exact, specials from the bits."""
    if E5M2:
        v = c.to(tl.uint8).to(tl.float8e5, bitcast=True).to(tl.float32)
        mag = c & 0x7F
        inf = tl.where((c & 0x80) != 0, -float("inf"), float("inf"))
        v = tl.where(mag >= 0x7C, tl.where(mag == 0x7C, inf, float("nan")), v)
    else:
        v = c.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        v = tl.where((c & 0x7F) == 0x7F, float("nan"), v)
    return v


@triton.jit
def top_half(v, NAN16: tl.constexpr):
    """BF16 bits (int32, low 16 bits) of FP32 ``v`` that BF16 holds exactly (or inf / NaN)."""
    return tl.where(v != v, NAN16, v.to(tl.int32, bitcast=True) >> 16)


@triton.jit
def _pow2_scale_exact(v, e, NAN16: tl.constexpr):
    """BF16 bits of ``bf16(fp32(v * 2**(e - 127)))`` for exact FP32 ``v`` with at most 4
    significant bits, any int32 ``e``, in integer arithmetic: the FP32 product is rounded
    (RNE) onto FP32's subnormal grid where it falls there, then rounded (RNE) to BF16 —
    the reference's two roundings."""
    vb = v.to(tl.int32, bitcast=True)
    a = vb & 0x7FFFFFFF
    ex = a >> 23
    en = ex + e - 127
    full = (a & 0x7FFFFF) | 0x800000
    sh = tl.minimum(tl.maximum(1 - en, 1), 25)  # full < 2**24: a shift of 25 leaves 0
    q = full >> sh
    rem = full & ((1 << sh) - 1)
    half = 1 << (sh - 1)
    q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    r = tl.where(en >= 255, 0x7F800000, tl.where(en >= 1, (en << 23) | (a & 0x7FFFFF), q))
    r = tl.where(a == 0, 0, r)
    r = tl.where(ex == 255, a, r)  # inf stays inf
    b = (r + 0x7FFF + ((r >> 16) & 1)) >> 16  # FP32 bits -> BF16, RNE
    b = b | ((vb >> 16) & 0x8000)
    return tl.where(v != v, NAN16, b)


@triton.jit
def e8m0_f32(e):
    """The FP32 values of E8M0 bytes ``e`` (int32), as ``formats.mxfp8.e8m0_to_float`` gives them:
    2**(e - 127) built from its bits (byte 0 is the subnormal 2**-127 = 0x400000, which a shift
    of the exponent field cannot express), 255 NaN."""
    return tl.where(e == 255, 0x7FC00000, tl.where(e == 0, 0x400000, e << 23)).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_scaled_bits(v, e, NAN16: tl.constexpr):
    """BF16 bits (int32) of ``bf16(fp32(v * 2**(e - 127)))``: FP8 values ``v`` (exact FP32, as
    :func:`fp8_f32` gives) times their E8M0 bytes ``e`` (int32, ``v``'s shape), as
    ``formats.mxfp8.dequantize_1d(...).to(bfloat16)`` computes it — for kernels that write a
    decoded copy themselves (``triton_mxfp8``'s ``decoded``). One IEEE FP32 multiply (2**-127
    is the subnormal 0x400000, as ``e8m0_to_float`` builds it; Triton's FP32 multiply keeps
    subnormals: no ``.ftz`` in its PTX, checked by ``bench/tools/sass_count.py``'s decoded cases)
    and a round-to-nearest-even of the product's bits to BF16, subnormals included: about 8
    instructions an element and no branch (the decode kernel's tile test and integer path held
    255 registers in a 64-element-per-thread quantize tile)."""
    p = (v * e8m0_f32(e)).to(tl.int32, bitcast=True)
    bits = (p + 0x7FFF + ((p >> 16) & 1)) >> 16
    return tl.where((p & 0x7FFFFFFF) > 0x7F800000, NAN16, bits)


@triton.jit
def _expand(s, BR: tl.constexpr, BC: tl.constexpr, SC: tl.constexpr):
    """Per-row block values ``s`` [BR, BC/SC] broadcast to the elements of a [BR, BC] tile."""
    return tl.reshape(tl.broadcast_to(s[:, :, None], (BR, BC // SC, SC)), (BR, BC))


@triton.jit
def _decode_kernel(src_ptr, s_ptr, out_ptr, R, C, src_stride, s_stride, NSR, NSC,
                   KIND: tl.constexpr, E5M2: tl.constexpr, SR: tl.constexpr, SC: tl.constexpr,
                   SAFE_E: tl.constexpr, NAN16: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                   PAIRS: tl.constexpr = False, GRID2: tl.constexpr = False):
    pr, pc = program_tile(C, BR, BC, GRID2)
    rows = pr * BR + tl.arange(0, BR)
    cols = pc * BC + tl.arange(0, BC)
    r64 = rows.to(tl.int64)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    # The block scales of each tile row, [BR, BC/SC] (padding reads the neutral scale 1). A 2D
    # block's scale is read once per row (from cache): tiles then need not span whole SR-row
    # blocks — a 128x256 tile for 128x128 blocks took 150 s to compile for sm90 (Triton 3.6).
    sr = rows // SR
    sc = pc * (BC // SC) + tl.arange(0, BC // SC)
    smask = (sr < NSR)[:, None] & (sc < NSC)[None, :]
    sptr = s_ptr + sr.to(tl.int64)[:, None] * s_stride + sc[None, :]
    if KIND == _NVFP4:
        if PAIRS:
            # Even C: byte b holds elements 2b (low nibble) and 2b + 1, whose BF16 bits leave as
            # one little-endian int32 word — each byte read once, full-width stores (out_ptr is
            # the output viewed as int32 [R, C/2]).
            HB: tl.constexpr = BC // 2
            wcol = pc * HB + tl.arange(0, HB)
            wmask = (rows < R)[:, None] & (wcol < C // 2)[None, :]
            byte = tl.load(src_ptr + r64[:, None] * src_stride + wcol[None, :], mask=wmask,
                           other=0).to(tl.int32)
            s = _expand(fp8_f32(tl.load(sptr, mask=smask, other=0x38).to(tl.int32), False), BR, HB, SC // 2)
            lo = top_half(e2m1_value(byte & 15) * s, NAN16)
            hi = top_half(e2m1_value(byte >> 4) * s, NAN16)
            tl.store(out_ptr + r64[:, None] * (C // 2) + wcol[None, :], (lo & 0xFFFF) | (hi << 16), mask=wmask)
        else:
            # Element j sits in byte j // 2 (low nibble first); each byte is read for both of
            # its elements (the second read hits the cache). The sign comes from the code bit,
            # never from a float negation: Triton 3.6 lowers ``-x`` to ``0 - x``, which turns
            # E2M1's -0.0 (code 8) into +0.0 on the GPU.
            byte = tl.load(src_ptr + r64[:, None] * src_stride + (cols // 2)[None, :], mask=mask,
                           other=0).to(tl.int32)
            code = (byte >> ((cols & 1) * 4)[None, :]) & 15
            s = fp8_f32(tl.load(sptr, mask=smask, other=0x38).to(tl.int32), False)  # E4M3 scales
            bits = top_half(e2m1_value(code) * _expand(s, BR, BC, SC), NAN16)
            tl.store(out_ptr + r64[:, None] * C + cols[None, :], bits.to(tl.int16), mask=mask)
    else:
        c = tl.load(src_ptr + r64[:, None] * src_stride + cols[None, :], mask=mask, other=0).to(tl.int32)
        v = fp8_f32(c, E5M2)
        if KIND == _PLAIN:
            bits = top_half(v, NAN16)
        else:
            if KIND == _E8M0:
                e = tl.load(sptr, mask=smask, other=127).to(tl.int32)
                s = tl.where(e == 255, float("nan"), (e << 23).to(tl.float32, bitcast=True))
            else:  # power-of-two FP32 scale_inv: e is its biased exponent, subnormals included
                s = tl.load(sptr, mask=smask, other=1.0)
                sb = s.to(tl.int32, bitcast=True) & 0x7FFFFFFF
                e = sb >> 23
                sub_log2 = ((sb & 0x7FFFFF).to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
                e = tl.where(e == 0, sub_log2 - 22, e)
                e = tl.where(e == 255, 255, e)
            if tl.min(tl.min(e, 1), 0) >= SAFE_E:
                # Every product is a BF16 normal (or inf / NaN): one exact FP32 multiply.
                bits = top_half(v * _expand(s, BR, BC, SC), NAN16)
            else:
                ee = _expand(e, BR, BC, SC)
                # A NaN / inf scale (exponent 255) multiplies as IEEE does: NaN, inf or NaN.
                special = top_half(v * _expand(s, BR, BC, SC), NAN16)
                bits = tl.where(ee == 255, special, _pow2_scale_exact(v, ee, NAN16))
        tl.store(out_ptr + r64[:, None] * C + cols[None, :], bits.to(tl.int16), mask=mask)


def _launch(src: torch.Tensor, scale: torch.Tensor | None, cols: int, kind: int, *,
            fp8_dtype: torch.dtype = torch.float8_e4m3fn, block: tuple[int, int] = (1, 1),
            tile: Optional[tuple[int, int]] = None, num_warps: Optional[int] = None,
            pairs: bool = False, maxnreg: Optional[int] = None) -> torch.Tensor:
    """Decode the [rows, cols] copy whose raw bytes are ``src`` (last dim contiguous).
    ``pairs`` (NVFP4, even ``cols``): write two elements per int32 word. ``tile`` / ``num_warps``
    default to ``_TILE_1D`` / ``_WARPS_1D`` for 1x32 and 1x16 block scales, else ``_TILE`` / 4;
    ``maxnreg``: a register cap per thread (GPU compile option; 0: none), default
    ``_MAXNREG_E8M0_1D`` for the MXFP8 1x32 decode at its default tile, else none."""
    rows = src.shape[0]
    out = empty((rows, cols), torch.bfloat16, src.device)
    if out.numel() == 0:
        return out
    if src.stride(-1) != 1:
        src = src.contiguous()
    sr, sc = block
    one_d = sr == 1 and kind in (_E8M0.value, _NVFP4.value)
    if maxnreg is None:  # the cap is tuned for the default tile
        default_tile = tile is None and num_warps is None
        maxnreg = _MAXNREG_E8M0_1D if default_tile and one_d and kind == _E8M0.value else 0
    tile = tile or (_TILE_1D if one_d else _TILE)
    num_warps = num_warps or (_WARPS_1D if one_d else 4)
    br, bc = tile[0], max(tile[1], sc)
    if scale is None:
        scale = src  # _PLAIN reads no scales; the kernel still takes a pointer argument
    elif scale.stride(-1) != 1:
        scale = scale.contiguous()
    mbits, bias = (2, 15) if fp8_dtype == torch.float8_e5m2 else (3, 7)
    grid, grid2 = tile_grid(rows, cols, br, bc)
    _decode_kernel[grid](src, scale, out.view(torch.int32 if pairs else torch.int16), rows, cols, src.stride(0),
                         scale.stride(0), scale.shape[0], scale.shape[1], KIND=kind,
                         E5M2=fp8_dtype == torch.float8_e5m2, SR=sr, SC=sc, SAFE_E=bias + mbits,
                         NAN16=bf16_nan16(src.device), BR=br, BC=bc,
                         PAIRS=pairs, GRID2=grid2, num_warps=num_warps,
                         **({"maxnreg": maxnreg} if maxnreg and src.is_cuda else {}))
    return out


def _check(what: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise ValueError(f"decode: {what} must be {dtype} of shape {shape}; got {t.dtype} "
                         f"{tuple(t.shape)}.")


def decode_fp8(data: torch.Tensor, **launch: object) -> torch.Tensor:
    """FP8 codes [r, c] -> BF16 (exact; the per-tensor scale_inv stays with the caller)."""
    if data.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"decode_fp8: data must be an FP8 tensor; got {data.dtype}.")
    return _launch(data.view(torch.uint8), None, data.shape[1], _PLAIN.value, fp8_dtype=data.dtype, **launch)


def decode_mxfp8(data: torch.Tensor, scale: torch.Tensor, *, block_2d: bool = False,
                 **launch: object) -> torch.Tensor:
    """MXFP8 codes [r, c] x E8M0 ``scale`` (1x32: [r, ceil(c/32)]; 32x32: [ceil(r/32),
    ceil(c/32)]) -> BF16, as ``formats.mxfp8.dequantize_1d/2d(...).to(bfloat16)``."""
    r, c = data.shape
    _check("MXFP8 scale", scale, (-(-r // 32) if block_2d else r, -(-c // 32)), torch.uint8)
    return _launch(data.view(torch.uint8), scale, c, _E8M0.value, fp8_dtype=data.dtype,
                   block=(32 if block_2d else 1, 32), **launch)


def decode_fp8_block(data: torch.Tensor, scale_inv: torch.Tensor, *, block: int = 128,
                     block_dim: int = 1, **launch: object) -> torch.Tensor:
    """FP8 codes [r, c] x power-of-two FP32 ``scale_inv`` per 1 x block (block_dim 1) or
    block x block tile (block_dim 2) -> BF16. The scales must be powers of two (the
    storage's ``pow2_scales``): only the exponent is read."""
    r, c = data.shape
    nb = -(-c // block)
    _check("FP8 block scale_inv", scale_inv, (r if block_dim == 1 else -(-r // block), nb), torch.float32)
    return _launch(data.view(torch.uint8), scale_inv, c, _POW2_F32.value, fp8_dtype=data.dtype,
                   block=(1 if block_dim == 1 else block, block), **launch)


#: Device types on which the NVFP4 decode writes element pairs as int32 words (one read per
#: byte, full-width stores) by default. On CUDA the pairs form is bitwise the per-element one
#: (tests/kernels/test_kernels_decode.py: ``test_gpu_nvfp4_pairs``) and several times faster
#: (``python -m bench.bench_gemm_pairs``).
PAIRS_BY_DEFAULT = frozenset({"cpu", "cuda"})


def decode_nvfp4(packed: torch.Tensor, scale: torch.Tensor, cols: int, *, block_2d: bool = False,
                 pairs: bool | None = None, **launch: object) -> torch.Tensor:
    """Packed E2M1 [r, ceil(cols/2)] x E4M3 block scales (1x16: [r, ceil(cols/16)]; 16x16:
    [ceil(r/16), ceil(cols/16)]) -> BF16 [r, cols] (the global S_dec is not applied).

    ``pairs``: write each byte's two elements as one int32 word (even ``cols`` only; None:
    where :data:`PAIRS_BY_DEFAULT` and ``cols`` allow)."""
    r = packed.shape[0]
    _check("NVFP4 data", packed, (r, -(-cols // 2)), torch.uint8)
    _check("NVFP4 scale", scale, (-(-r // 16) if block_2d else r, -(-cols // 16)), torch.float8_e4m3fn)
    if pairs is None:
        pairs = packed.device.type in PAIRS_BY_DEFAULT and cols % 2 == 0
    if pairs and cols % 2:
        raise ValueError(f"decode_nvfp4(pairs=True) needs an even number of columns; got {cols}.")
    return _launch(packed, scale.view(torch.uint8), cols, _NVFP4.value,
                   block=(16 if block_2d else 1, 16), pairs=pairs, **launch)
