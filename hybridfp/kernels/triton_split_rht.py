"""Inverse RHT and exact BF16 split of an RHT operand in one pass (the one-sided RHT GEMM).

``gemm/split_bf16.py`` multiplies an NVFP4 copy that carries the random Hadamard transform on
its reduction dim with a copy that does not: the RHT side goes back to the original domain
(``formats.rht.apply_inverse_rht``: per 16-element tile, the unnormalized Walsh-Hadamard
transform, x 0.25, x the signs) and its FP32 values are split into BF16 parts
``hi = bf16(v)``, ``mid = bf16(v - hi)``, ``lo = bf16(v - hi - mid)`` (``split_bf16.split3``).
In PyTorch that is ~20 passes over an FP32 copy; here it is one read of the BF16-decoded
values and one write of the parts, side by side in one [R, 3K] BF16 matrix (hi | mid | lo),
so a single BF16 GEMM over the doubled (or tripled) reduction sums them.

Bitwise equal to the PyTorch path: the transform runs as an FP32 ``tl.dot`` with the ±1
matrix (IEEE products and sums; every partial sum of an NVFP4 tile's 16 values is exact in
FP32: one E4M3 block scale times a multiple of 0.5 below 96), the roundings to BF16 on the
bits (round to nearest even, as torch's cast; the interpreter's own cast truncates). Flags
(int32 [3], maxed over the programs): some element does not split exactly
(``(hi + mid) + lo != v``: NaN, inf, or bits below BF16's subnormal grid), some ``mid`` is
nonzero, some ``lo`` is nonzero — what ``split_bf16.exact_parts`` decides on.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats.rht import RHT_SIGNS, TILE
from ._common import DTYPE_CODE, check_int32_tiles, kernel_input, load_f32

#: Bit j set where the RHT's sign s_j is -1 (numerics §2.5's fixed vector).
SIGN_MASK = sum(1 << j for j, s in enumerate(RHT_SIGNS) if s < 0)
#: Rows x 16-element tiles a program transforms (H200-sized: 32 x 128 elements, 4 warps).
BLOCK = (32, 8)


@triton.jit
def _bf16_rne(x):
    """(BF16 bits as int32, their FP32 value) of FP32 ``x``, rounded to nearest even on the bits."""
    b = x.to(tl.int32, bitcast=True)
    h = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return h, (h << 16).to(tl.float32, bitcast=True)


@triton.jit
def _split_kernel(y_ptr, out_ptr, flags_ptr, R, K, KP, sy0, sy1, so0,
                  DTYPE: tl.constexpr, SIGNS: tl.constexpr, BR: tl.constexpr, BT: tl.constexpr):
    BK: tl.constexpr = BT * 16
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    r64 = rows.to(tl.int64)
    inside = (rows < R)[:, None] & (cols < KP)[None, :]
    y = load_f32(y_ptr + r64[:, None] * sy0 + cols[None, :].to(tl.int64) * sy1, inside, DTYPE)
    # each row's 16-element tiles as rows of a [BR * BT, 16] matrix, times H16 (symmetric:
    # H[i, j] = (-1)^popcount(i & j)), then x 0.25 x s_j: apply_inverse_rht's order
    i = tl.arange(0, 16)[:, None]
    j = tl.arange(0, 16)[None, :]
    b = i & j
    h = (1 - 2 * ((b ^ (b >> 1) ^ (b >> 2) ^ (b >> 3)) & 1)).to(tl.float32)
    s = (1 - 2 * ((SIGNS >> tl.arange(0, 16)) & 1)).to(tl.float32)
    t = tl.dot(tl.reshape(y, (BR * BT, 16)), h, input_precision="ieee")
    v = tl.reshape((t * 0.25) * s[None, :], (BR, BK))
    hb, hf = _bf16_rne(v)
    rest = v - hf
    mb, mf = _bf16_rne(rest)
    lb, lf = _bf16_rne(rest - mf)
    keep = (rows < R)[:, None] & (cols < K)[None, :]
    inexact = keep & ((hf + mf) + lf != v)
    optrs = out_ptr + r64[:, None] * so0 + cols[None, :]
    tl.store(optrs, hb.to(tl.int16), mask=keep)
    tl.store(optrs + K, mb.to(tl.int16), mask=keep)
    tl.store(optrs + 2 * K, lb.to(tl.int16), mask=keep)
    tl.atomic_max(flags_ptr, tl.max(tl.max(inexact.to(tl.int32), 1), 0))
    tl.atomic_max(flags_ptr + 1, tl.max(tl.max((keep & (mf != 0)).to(tl.int32), 1), 0))
    tl.atomic_max(flags_ptr + 2, tl.max(tl.max((keep & (lf != 0)).to(tl.int32), 1), 0))


def inverse_rht_split(y: torch.Tensor, k: int, *, block: tuple[int, int] = BLOCK
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(parts, flags) for 2D ``y`` [R, KP] (KP a multiple of 16: an RHT copy's stored width; BF16,
    FP16 or FP32 values in the RHT domain): ``parts`` BF16 [R, 3k] = [hi | mid | lo] of
    ``apply_inverse_rht(y, k)`` (cropped to its first ``k`` columns), ``flags`` int32 [3]
    (inexact somewhere, mid nonzero somewhere, lo nonzero somewhere), both on ``y``'s device,
    bitwise what ``split_bf16.split3`` and ``exact_parts`` compute from the PyTorch transform."""
    if y.dim() != 2 or y.shape[1] % TILE or y.dtype not in DTYPE_CODE:
        raise ValueError(f"inverse_rht_split takes 2D BF16 / FP16 / FP32 values whose width is a multiple of "
                         f"{TILE}; got {y.dtype} {tuple(y.shape)}.")
    rows, kp = y.shape
    if not 0 <= kp - k < TILE:
        raise ValueError(f"inverse_rht_split: k={k} does not fit a stored RHT width of {kp}.")
    check_int32_tiles(rows, 3 * max(k, 1))
    parts = torch.empty((rows, 3 * k), dtype=torch.bfloat16, device=y.device)
    flags = torch.zeros(3, dtype=torch.int32, device=y.device)
    if rows == 0 or k == 0:
        return parts, flags
    br, bt = block
    grid = (triton.cdiv(rows, br), triton.cdiv(kp, bt * TILE))
    _split_kernel[grid](kernel_input(y), parts.view(torch.int16), flags, rows, k, kp, y.stride(0), y.stride(1), parts.stride(0),
                        DTYPE=DTYPE_CODE[y.dtype], SIGNS=SIGN_MASK, BR=br, BT=bt, num_warps=4,
                        enable_fp_fusion=False)
    return parts, flags
