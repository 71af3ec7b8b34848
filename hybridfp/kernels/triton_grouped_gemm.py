"""Grouped BF16 GEMM with an FP32 epilogue per expert, for the MoE pairs ``torch._grouped_mm``
cannot take exactly (an epilogue factor: FP8 per-tensor ``scale_inv``, NVFP4 ``S_dec``, per-row
scales; a bias; an FP32 / FP16 output).

Operands are the experts' copies block-decoded into BF16 (exact, ``gemm/bf16_decode.py``), on
stored copies ``out_e[i, j] = Σ_k A_e[i, k] · B_e[j, k]``, in two arrangements:

- rows grouped (fprop / dgrad): ``A`` [Σm_e, K] (expert e's rows ``[r_e, r_{e+1})``), ``B``
  [E, N, K]; ``out`` [Σm_e, N];
- reduction grouped (wgrad): ``A`` [M, ΣK_e], ``B`` [N, ΣK_e] (expert e's reduction
  ``[k_e, k_{e+1})``); ``out`` [E, M, N].

The host hands the kernel each expert's row range and reduction range and the prefix sums of
the experts' row tile counts; each program finds its expert from those (``_common.
expert_row_tile``), so zero-size experts get no program and the host builds E rows, not one
per tile. Each program accumulates ``tl.dot`` products in FP32
(tensor cores; SPEC §1: exact up to accumulation order), then computes exactly what
``hybridfp.gemm.emulate`` does after its matmul, in the same FP32 order (FMA contraction off):
``v = acc * (sa[i] * sb[j])`` (a missing side is 1), ``v = v + bias[j]``, one rounding to the
output dtype (BF16 on the bits, round to nearest even, torch's NaN bits).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import bf16_nan16, empty, expert_row_tile, swizzled_tile
from .host import tile_plan, to_device
from .triton_epilogue import OUT_CODE, store_out

#: (BM, BN, BK, warps, stages): the fastest of bench_grouped_gemm_kernel's sweep on the H200 (s12)
TILE = (128, 256, 64, 8, 3)
#: Row tiles that share a sweep over the column tiles (L2 swizzle). Programs launched together
#: then read GROUP_M row tiles and a few column tiles instead of one column tile and every row
#: tile of a wave (on the 8-expert fc1 a wave read ~130 MB of A for 2 MB of B: memory-bound).
GROUP_M = 16


@triton.jit
def _load_bf16(ptrs, mask, BITS: tl.constexpr):
    """A BF16 tile for ``tl.dot``. ``BITS`` (the interpreter, whose BF16 loads are not usable):
    the operand arrives as int16 bits and is widened to its exact FP32 value instead."""
    if BITS:
        return (tl.load(ptrs, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _grouped_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, out_ptr, meta_ptr, T, N, E,
                    sam, sak, sbe, sbn, sbk, sa_e, soe, som,
                    SA: tl.constexpr, SB: tl.constexpr, BIAS: tl.constexpr, OUT: tl.constexpr,
                    NAN16: tl.constexpr, BITS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, KALIGN: tl.constexpr, GROUP: tl.constexpr, EP: tl.constexpr):
    # one program per (row tile t, column tile j), swizzled for L2 reuse; row tile t's expert
    # from the tile-count prefix sums at the start of meta (host.tile_plan)
    t, j = swizzled_tile(tl.program_id(0), T, N, BN, GROUP)
    e, te = expert_row_tile(meta_ptr, t, E, EP)
    # the expert's first row, end row, first k, end k
    meta = meta_ptr + (E + 1) + e.to(tl.int64) * 4
    r0 = tl.load(meta) + te * BM
    r1 = tl.load(meta + 1)
    # KALIGN: every reduction range starts and ends on a multiple of it (the host checks). The
    # hint is what lets the compiler prove 16-byte aligned, uniformly masked K runs: without it
    # every operand element was its own 2-byte load (no vector loads, no cp.async pipelining)
    k0 = tl.multiple_of(tl.load(meta + 2), KALIGN)
    k1 = tl.multiple_of(tl.load(meta + 3), KALIGN)
    rows = r0 + tl.arange(0, BM)
    cols = j * BN + tl.arange(0, BN)
    r64, c64, e64 = rows.to(tl.int64), cols.to(tl.int64), e.to(tl.int64)
    rmask, cmask = rows < r1, cols < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(k0, k1, BK):
        kk = k + tl.arange(0, BK)
        kmask = kk < k1
        a = _load_bf16(a_ptr + r64[:, None] * sam + kk.to(tl.int64)[None, :] * sak,
                       rmask[:, None] & kmask[None, :], BITS)
        b = _load_bf16(b_ptr + e64 * sbe + c64[None, :] * sbn + kk.to(tl.int64)[:, None] * sbk,
                       kmask[:, None] & cmask[None, :], BITS)
        acc = tl.dot(a, b, acc)
    _epilogue(acc, r64, c64, rmask, cmask, e64, sa_ptr, sb_ptr, bias_ptr, out_ptr, N, sa_e, soe, som,
              SA, SB, BIAS, OUT, NAN16, BITS)


@triton.jit
def _epilogue(acc, r64, c64, rmask, cmask, e64, sa_ptr, sb_ptr, bias_ptr, out_ptr, N, sa_e, soe, som,
              SA: tl.constexpr, SB: tl.constexpr, BIAS: tl.constexpr, OUT: tl.constexpr, NAN16: tl.constexpr,
              BITS: tl.constexpr):
    """Store ``ep(acc)`` for the tile's rows ``r64`` and columns ``c64`` of expert ``e64``: what
    ``gemm.emulate`` does after its matmul, in its FP32 order (shared by both kernels, so the
    pointer and TMA variants compute the same epilogue)."""
    v = acc
    if SA or SB:
        if SA:
            sa = tl.load(sa_ptr + e64 * sa_e + r64, mask=rmask, other=1.0)
        else:
            sa = tl.full((acc.shape[0],), 1.0, tl.float32)
        if SB:
            sb = tl.load(sb_ptr + e64 * N + c64, mask=cmask, other=1.0)
        else:
            sb = tl.full((acc.shape[1],), 1.0, tl.float32)
        v = v * (sa[:, None] * sb[None, :])
    if BIAS:
        v = v + tl.load(bias_ptr + e64 * N + c64, mask=cmask, other=0.0)[None, :]
    optrs = out_ptr + e64 * soe + r64[:, None] * som + c64[None, :]
    store_out(optrs, v, rmask[:, None] & cmask[None, :], OUT, NAN16, HW=not BITS)


def _plan(row_ranges: list[tuple[int, int]], k_ranges: list[tuple[int, int]], bm: int
          ) -> tuple[torch.Tensor, int, int]:
    """(the kernel's metadata: ``host.tile_plan`` of the experts' (r0, r1, k0, k1); T, its row
    tiles; ``KALIGN``: the largest of 8, 4, 2, 1 dividing every k0 and k1 of an expert with
    programs, so the promise holds by construction). Experts with no rows or no reduction get
    no program (their output stays as the caller initialised it)."""
    meta = torch.tensor([(r0, r1, k0, k1) for (r0, r1), (k0, k1) in zip(row_ranges, k_ranges)],
                        dtype=torch.int64).reshape(-1, 4)
    rows = torch.where(meta[:, 3] > meta[:, 2], meta[:, 1] - meta[:, 0], 0)
    packed, row_tiles = tile_plan(rows, meta, bm)
    bounds = meta[rows > 0, 2:].reshape(-1).tolist()
    return packed, row_tiles, _alignment(bounds)


def _check(what: str, t: Optional[torch.Tensor], shape: tuple[int, ...]) -> None:
    if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != shape or not t.is_contiguous()):
        raise ValueError(f"grouped GEMM: {what} must be a contiguous FP32 tensor of shape {shape}; "
                         f"got {t.dtype} {tuple(t.shape)}.")


def _alignment(bounds: list[int]) -> int:
    """The largest of 8, 4, 2, 1 dividing every reduction bound (8 BF16 elements: one 16-byte
    vector load)."""
    for a in (8, 4, 2):
        if all(b % a == 0 for b in bounds):
            return a
    return 1


def _launch(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, plan: tuple[torch.Tensor, int, int], n: int,
            sbe: int, sa: Optional[torch.Tensor], sa_e: int, sb: Optional[torch.Tensor],
            bias: Optional[torch.Tensor], soe: int, tile: tuple[int, int, int, int, int],
            group_m: int = GROUP_M) -> torch.Tensor:
    """Run the kernel over ``plan`` (``_plan``: the metadata, its row tiles and ``KALIGN``)."""
    meta, row_tiles, kalign = plan
    if row_tiles == 0 or n == 0:
        return out
    bm, bn, bk, warps, stages = tile
    dst = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
    dummy = a
    bits = not a.is_cuda  # the interpreter (see _load_bf16)
    if bits:
        a, b = a.view(torch.int16), b.view(torch.int16)
    experts = (meta.shape[0] - 1) // 5  # E + 1 prefix sums, then 4 fields per expert
    grid = (row_tiles * triton.cdiv(n, bn),)
    _grouped_kernel[grid](a, b, sa if sa is not None else dummy, sb if sb is not None else dummy,
                          bias if bias is not None else dummy, dst, to_device(meta, out.device), row_tiles, n, experts,
                          a.stride(0), a.stride(1), sbe, b.stride(-2), b.stride(-1), sa_e, soe, out.stride(-2),
                          SA=sa is not None, SB=sb is not None, BIAS=bias is not None,
                          OUT=OUT_CODE[out.dtype], NAN16=bf16_nan16(a.device),
                          BITS=bits, BM=bm, BN=bn, BK=bk, KALIGN=kalign, GROUP=group_m,
                          EP=triton.next_power_of_2(experts + 1), num_warps=warps, num_stages=stages,
                          enable_fp_fusion=False)
    return out


def grouped_rows(a: torch.Tensor, b: torch.Tensor, splits: list[int], *, scale_a: Optional[torch.Tensor] = None,
                 scale_b: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                 out_dtype: torch.dtype = torch.bfloat16,
                 tile: tuple[int, int, int, int, int] = TILE, group_m: int = GROUP_M) -> torch.Tensor:
    """fprop / dgrad: ``out[r_e + i, j] = ep(Σ_k a[r_e + i, k] b[e, j, k])`` for expert e's rows.

    ``a`` [Σ splits, K] and ``b`` [E, N, K] BF16 (any strides); ``scale_a`` [Σ splits] (per row),
    ``scale_b`` and ``bias`` [E, N], all FP32 or None; returns [Σ splits, N] in ``out_dtype``."""
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16 or a.dim() != 2 or b.dim() != 3:
        raise ValueError(f"grouped_rows: a [M, K] and b [E, N, K] must be BF16; got {a.dtype} "
                         f"{tuple(a.shape)}, {b.dtype} {tuple(b.shape)}.")
    (m, k), (e, n, kb) = a.shape, b.shape
    if kb != k or e != len(splits) or sum(splits) != m or k == 0 or min(splits, default=0) < 0:
        raise ValueError(f"grouped_rows: a {tuple(a.shape)}, b {tuple(b.shape)} and splits (sum "
                         f"{sum(splits)}, {len(splits)} experts, none negative) do not fit together (K > 0).")
    _check("scale_a", scale_a, (m,))
    _check("scale_b", scale_b, (e, n))
    _check("bias", bias, (e, n))
    out = empty((m, n), out_dtype, a.device)
    starts = [sum(splits[:i]) for i in range(e + 1)]
    ranges = [(starts[i], starts[i + 1]) for i in range(e)]
    return _launch(a, b, out, _plan(ranges, [(0, k)] * e, tile[0]), n, b.stride(0), scale_a, 0, scale_b, bias, 0,
                   tile, group_m)


def grouped_reduction(a: torch.Tensor, b: torch.Tensor, splits: list[int], *,
                      scale_a: Optional[torch.Tensor] = None, scale_b: Optional[torch.Tensor] = None,
                      out_dtype: torch.dtype = torch.bfloat16,
                      tile: tuple[int, int, int, int, int] = TILE, group_m: int = GROUP_M) -> torch.Tensor:
    """wgrad: ``out[e, i, j] = ep(Σ_{k in expert e's columns} a[i, k] b[j, k])``.

    ``a`` [M, Σ splits], ``b`` [N, Σ splits] BF16; ``scale_a`` [E, M], ``scale_b`` [E, N] FP32 or
    None; returns [E, M, N] in ``out_dtype`` (an expert with no columns: zeros)."""
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16 or a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"grouped_reduction: a [M, K] and b [N, K] must be BF16; got {a.dtype} "
                         f"{tuple(a.shape)}, {b.dtype} {tuple(b.shape)}.")
    (m, k), (n, kb) = a.shape, b.shape
    e = len(splits)
    if kb != k or sum(splits) != k or min(splits, default=0) < 0:
        raise ValueError(f"grouped_reduction: a {tuple(a.shape)}, b {tuple(b.shape)} and splits (sum "
                         f"{sum(splits)}, none negative) do not fit together.")
    _check("scale_a", scale_a, (e, m))
    _check("scale_b", scale_b, (e, n))
    out = empty((e, m, n), out_dtype, a.device)
    starts = [sum(splits[:i]) for i in range(e + 1)]
    for i in (i for i in range(e) if splits[i] == 0):  # no program: the epilogue of zero sums
        v = torch.zeros(m, n, dtype=torch.float32, device=a.device)
        if scale_a is not None or scale_b is not None:
            ones = torch.ones((), dtype=torch.float32, device=a.device)
            sa_i = scale_a[i] if scale_a is not None else ones.expand(m)
            sb_i = scale_b[i] if scale_b is not None else ones.expand(n)
            v = v * (sa_i[:, None] * sb_i[None, :])
        out[i] = v.to(out_dtype)
    plan = _plan([(0, m)] * e, [(starts[i], starts[i + 1]) for i in range(e)], tile[0])
    return _launch(a, b, out, plan, n, 0, scale_a, m, scale_b, None, m * n, tile, group_m)
