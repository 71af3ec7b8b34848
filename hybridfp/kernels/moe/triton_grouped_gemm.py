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
(tensor cores; numerics §1: exact up to accumulation order), then computes exactly what
``hybridfp.gemm.emulate`` does after its matmul, in the same FP32 order (FMA contraction off):
``v = acc * (sa[i] * sb[j])`` (a missing side is 1), ``v = v + bias[j]``, one rounding to the
output dtype (BF16 on the bits, round to nearest even, torch's NaN bits).

Two kernels compute the rows-grouped product (``grouped_rows(kernel=...)``), the same sums and
the same epilogue (``_epilogue``), differing only in how operands reach the tensor cores:

- ``"pointer"`` (``_grouped_kernel``): one program per output tile, masked pointer loads
  (cp.async); any strides and alignment; also the reduction-grouped kernel;
- ``"tma"`` (``_tma_rows_kernel``, Hopper+): a persistent grid (one program per SM looping over
  the swizzled tiles) reading A and B through host-built TMA descriptors (``TensorDescriptor``),
  which feed wgmma from shared memory. It needs what TMA needs (``tma_applies``): unit inner
  strides, 16-byte aligned bases and row strides (K % 8 == 0 for contiguous BF16), B's experts
  joined as one [E * N, K] matrix. A tile running past its expert's last row reads the next
  expert's rows, and one past the last column tile reads the next expert's weights: those
  output rows / columns are masked at the store; past the matrices' ends and in the K tail TMA
  fills zeros. A tile's reduction runs over the same K tiles in the same order in both kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ...utils.device import sm_count, tile_plan, to_device
from .._common import empty, expert_row_tile, swizzled_tile
from .._common_encode import bf16_nan16
from ..triton_epilogue import OUT_CODE, store_out

#: (BM, BN, BK, warps, stages): the fastest of ``python -m bench.bench_grouped_gemm --part bf16
#: --pointer-tiles`` on an NVIDIA H200
TILE = (128, 256, 64, 8, 3)
#: Row tiles that share a sweep over the column tiles (L2 swizzle). Programs launched together
#: then read GROUP_M row tiles and a few column tiles instead of one column tile and every row
#: tile of a wave (on the 8-expert fc1 such a wave reads ~130 MB of A for 2 MB of B: memory-bound).
GROUP_M = 16


@triton.jit
def _widen(x, BITS: tl.constexpr):
    """A loaded BF16 operand tile for ``tl.dot``; ``BITS`` (the interpreter): int16 bits widened
    to their exact FP32 value (as ``_load_bf16``)."""
    if BITS:
        return (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return x


@triton.jit
def _load_bf16(ptrs, mask, BITS: tl.constexpr):
    """A BF16 tile for ``tl.dot``. ``BITS`` (the interpreter, whose BF16 loads are not usable):
    the operand arrives as int16 bits and is widened to its exact FP32 value instead."""
    return _widen(tl.load(ptrs, mask=mask, other=0), BITS)


@triton.jit
def _grouped_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, out_ptr, meta_ptr, T, N, E,
                    sam, sak, sbe, sbn, sbk, sa_e, soe, som,
                    SA: tl.constexpr, SB: tl.constexpr, BIAS: tl.constexpr, OUT: tl.constexpr,
                    NAN16: tl.constexpr, BITS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, KALIGN: tl.constexpr, GROUP: tl.constexpr, EP: tl.constexpr):
    # one program per (row tile t, column tile j), swizzled for L2 reuse; row tile t's expert
    # from the tile-count prefix sums at the start of meta (utils.device.tile_plan)
    t, j = swizzled_tile(tl.program_id(0), T, N, BN, GROUP)
    e, te = expert_row_tile(meta_ptr, t, E, EP)
    # the expert's first row, end row, first k, end k
    meta = meta_ptr + (E + 1) + e.to(tl.int64) * 4
    r0 = tl.load(meta) + te * BM
    r1 = tl.load(meta + 1)
    # KALIGN: every reduction range starts and ends on a multiple of it (the host checks). The
    # hint is what lets the compiler prove 16-byte aligned, uniformly masked K runs: without it
    # every operand element is its own 2-byte load (no vector loads, no cp.async pipelining)
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
    """(the kernel's metadata: ``utils.device.tile_plan`` of the experts' (r0, r1, k0, k1); T, its row
    tiles; ``KALIGN``: the largest of 8, 4, 2, 1 dividing every k0 and k1 of an expert with
    programs, so the promise holds by construction). Experts with no rows or no reduction get
    no program (their output stays as the caller initialised it)."""
    meta = np.array([(r0, r1, k0, k1) for (r0, r1), (k0, k1) in zip(row_ranges, k_ranges)],
                    dtype=np.int64).reshape(-1, 4)
    rows = np.where(meta[:, 3] > meta[:, 2], meta[:, 1] - meta[:, 0], 0)
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
        if not any(map(a.__rmod__, bounds)):  # every b % a == 0 (C-level: one bound per expert)
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


@dataclass(frozen=True)
class TmaConfig:
    """Tile and loop schedule of the TMA rows kernel (``_tma_rows_kernel``).

    ``bm, bn, bk``: the output tile and the K step; ``warps``, ``stages``: the launch's
    ``num_warps`` / ``num_stages`` (shared-memory ring depth of the K loop); ``group_m``: row
    tiles per L2 swizzle group; ``programs``: persistent programs (None: one per SM on CUDA, 4 in
    the interpreter). ``flatten``: the persistent tile loop and the K loop pipelined as one
    loop, so the next tile's loads overlap this tile's epilogue. No warp specialization:
    ``tl.range(..., warp_specialize=True)`` on the K loop compiles for sm90 with Triton 3.6 (with
    4 warps: a producer and two consumer warp groups), but on an NVIDIA H200 it hangs in the GPU
    test."""

    bm: int = 128
    bn: int = 256
    bk: int = 64
    warps: int = 8
    stages: int = 3
    group_m: int = GROUP_M
    flatten: bool = False
    programs: Optional[int] = None


#: The TMA kernel's default: the fastest config of ``python -m bench.bench_grouped_gemm --part
#: bf16`` on an NVIDIA H200 (the 8-expert MoE's fc1 / fc2 fprop, against ``torch._grouped_mm``
#: without an epilogue and against the pointer kernel).
TMA_CONFIG = TmaConfig(flatten=True)
#: Configs the benchmark sweeps (name -> config): tile shapes and ring depths whose shared memory
#: fits the H200's 227 KB with a BF16 output (``python -m bench.tools.sass_count --resources
#: --match "grouped gemm tma"``), with and without the flattened loop.
TMA_CONFIGS: dict[str, TmaConfig] = {
    "128x256x64 w8 st3": TmaConfig(),
    "128x256x64 w8 st4": TmaConfig(stages=4),
    "128x256x64 w8 st3 flat": TmaConfig(flatten=True),
    "128x256x64 w8 st4 flat": TmaConfig(stages=4, flatten=True),
    "128x256x64 w8 st3 g8": TmaConfig(group_m=8),
    "256x128x64 w8 st3": TmaConfig(bm=256, bn=128),
    "128x128x64 w8 st5 flat": TmaConfig(bn=128, stages=5, flatten=True),
}
#: Configs for an FP32 output (name -> config). The epilogue stores through shared memory
#: (a BM x BN x 4 byte layout change beside the K ring), so the BF16 default needs 278 KB with an
#: FP32 output, past the H200's 227 KB (an OutOfResources at launch); these fit
#: (``python -m bench.tools.sass_count --resources --match "tma f32"``).
TMA_F32_CONFIGS: dict[str, TmaConfig] = {
    "128x256x64 w8 st2 flat": TmaConfig(stages=2, flatten=True),
    "128x128x64 w8 st4 flat": TmaConfig(bn=128, stages=4, flatten=True),
    "128x128x64 w8 st5 flat": TmaConfig(bn=128, stages=5, flatten=True),
    "256x128x64 w8 st2 flat": TmaConfig(bm=256, bn=128, stages=2, flatten=True),
}
#: The TMA kernel's default for an FP32 output (see TMA_F32_CONFIGS).
TMA_F32_CONFIG = TMA_F32_CONFIGS["128x128x64 w8 st4 flat"]


def default_tma_config(out_dtype: torch.dtype) -> TmaConfig:
    """The TMA kernel's config for outputs of ``out_dtype``: :data:`TMA_F32_CONFIG` for FP32 (its
    epilogue's shared memory), :data:`TMA_CONFIG` for 16-bit outputs. The two tile the K loop
    alike (BK 64) but differ in BN, so on the GPU a BF16 output and an FP32 output of one
    product agree to FP32 accumulation order (numerics §1), not bit for bit."""
    return TMA_F32_CONFIG if out_dtype == torch.float32 else TMA_CONFIG


@triton.jit
def tma_tile(meta_ptr, tile, T, N, E, BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr, EP: tl.constexpr):
    """Where persistent tile ``tile`` lies, in the pointer kernel's swizzled order: (expert e,
    column tile j, first row r0 in A, expert's end row r1, first row of B's [E * N, K] view)."""
    t, j = swizzled_tile(tile, T, N, BN, GROUP)
    e, te = expert_row_tile(meta_ptr, t, E, EP)
    meta = meta_ptr + (E + 1) + e.to(tl.int64) * 4  # (r0, r1, k0, k1): k is [0, K) here
    r0 = (tl.load(meta) + te * BM).to(tl.int32)
    r1 = tl.load(meta + 1)
    # B is [E * N, K]: expert e's column j * BN is row e * N + j * BN (int32: the host checks)
    return e, j, r0, r1, e * N + j * BN


@triton.jit
def _tma_rows_kernel(a_desc, b_desc, sa_ptr, sb_ptr, bias_ptr, out_ptr, meta_ptr, T, N, K, E, som, P,
                     SA: tl.constexpr, SB: tl.constexpr, BIAS: tl.constexpr, OUT: tl.constexpr,
                     NAN16: tl.constexpr, BITS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, GROUP: tl.constexpr, EP: tl.constexpr, FLATTEN: tl.constexpr):
    # P persistent programs; program p takes tiles p, p + P, ... of the same swizzled order as
    # the pointer kernel's grid (so a wave's operands stay in L2 the same way)
    tiles = T * tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for tile in tl.range(tl.program_id(0), tiles, P, flatten=FLATTEN):
        e, j, r0, r1, b_row = tma_tile(meta_ptr, tile, T, N, E, BM, BN, GROUP, EP)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kt in range(0, k_tiles):
            a = _widen(a_desc.load([r0, kt * BK]), BITS)
            b = _widen(b_desc.load([b_row, kt * BK]), BITS)
            acc = tl.dot(a, b.T, acc)
        rows = r0 + tl.arange(0, BM)
        cols = j * BN + tl.arange(0, BN)
        _epilogue(acc, rows.to(tl.int64), cols.to(tl.int64), rows < r1, cols < N, e.to(tl.int64), sa_ptr, sb_ptr,
                  bias_ptr, out_ptr, N, 0, 0, som, SA, SB, BIAS, OUT, NAN16, BITS)


#: Rows / columns a tile may reach past the operands' ends (the largest TmaConfig tile side):
#: the kernel's row and column indices are int32, so the operands keep this margin below 2**31.
_TILE_MARGIN = 256


def tma_applies(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the TMA kernel can read ``a`` [M, K] and ``b`` [E, N, K] (BF16) as they are:
    unit inner strides, rows that do not overlap (a stride-0 broadcast is left to the pointer
    kernel), 16-byte aligned bases and row strides, B's experts one [E * N, K] matrix
    (``b.stride(0) == N * b.stride(1)``), row / column indices of every tile within int32.
    Where it does not, ``grouped_rows`` runs the pointer kernel (the same computation)."""
    (m, k), (e, n, _) = a.shape, b.shape
    size = a.element_size()
    return (a.stride(1) == 1 and b.stride(2) == 1 and (e <= 1 or b.stride(0) == n * b.stride(1))
            and a.stride(0) >= k and b.stride(1) >= k
            and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
            and (a.stride(0) * size) % 16 == 0 and (b.stride(1) * size) % 16 == 0
            and max(m, e * n, k) + _TILE_MARGIN < 2**31)


def _launch_tma(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, plan: tuple[torch.Tensor, int, int],
                sa: Optional[torch.Tensor], sb: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                cfg: TmaConfig) -> torch.Tensor:
    """Run the TMA kernel over ``plan`` (``_plan``'s metadata and row tiles; its KALIGN is not
    needed: TMA reads any K tail itself)."""
    meta, row_tiles, _ = plan
    (m, k), (e, n, _) = a.shape, b.shape
    if row_tiles == 0 or n == 0:
        return out
    dst = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
    dummy = out
    bits = not a.is_cuda  # the interpreter: BF16 read as its int16 bits (see _load_bf16)
    if bits:
        a, b = a.view(torch.int16), b.view(torch.int16)
    a_desc = TensorDescriptor(a, [m, k], [a.stride(0), 1], [cfg.bm, cfg.bk])
    b_desc = TensorDescriptor(b, [e * n, k], [b.stride(1), 1], [cfg.bn, cfg.bk])
    tiles = row_tiles * triton.cdiv(n, cfg.bn)
    programs = cfg.programs or (sm_count(a.device.index or 0) if a.is_cuda else 4)
    programs = min(programs, tiles)
    _tma_rows_kernel[(programs,)](
        a_desc, b_desc, sa if sa is not None else dummy, sb if sb is not None else dummy,
        bias if bias is not None else dummy, dst, to_device(meta, out.device), row_tiles, n, k, e, out.stride(0),
        programs, SA=sa is not None, SB=sb is not None, BIAS=bias is not None, OUT=OUT_CODE[out.dtype],
        NAN16=bf16_nan16(out.device), BITS=bits, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP=cfg.group_m,
        EP=triton.next_power_of_2(e + 1), FLATTEN=cfg.flatten,
        num_warps=cfg.warps, num_stages=cfg.stages, enable_fp_fusion=False)
    return out


def _rows_kernel(kernel: Optional[str], a: torch.Tensor, b: torch.Tensor) -> str:
    """The kernel ``grouped_rows`` runs: the caller's choice (``"tma"`` only where
    ``tma_applies``: said, not replaced), else TMA on a Hopper-or-newer GPU where it applies and
    the pointer kernel elsewhere (the interpreter included). Both compute the same sums."""
    if kernel not in (None, "tma", "pointer"):
        raise ValueError(f"grouped_rows: kernel must be 'tma', 'pointer' or None; got {kernel!r}.")
    empty_out = a.shape[0] * b.shape[1] == 0  # nothing runs: no operand is read
    if kernel == "tma" and a.is_cuda and torch.cuda.get_device_capability(a.device) < (9, 0):
        raise ValueError(f"grouped_rows: kernel='tma' needs a Hopper or newer GPU (TMA); "
                         f"{torch.cuda.get_device_name(a.device)} is sm"
                         f"{''.join(map(str, torch.cuda.get_device_capability(a.device)))}. Use kernel='pointer' (or None).")
    if kernel == "tma" and not empty_out and not tma_applies(a, b):
        raise ValueError(f"grouped_rows: kernel='tma' needs unit inner strides, 16-byte aligned bases and row "
                         f"strides (K % 8 == 0 for contiguous BF16) and b's experts joined as one [E*N, K] "
                         f"matrix; got a strides {a.stride()}, b strides {b.stride()}. Use kernel='pointer' "
                         f"(or None) for these operands.")
    if kernel is None:
        hopper = a.is_cuda and torch.cuda.get_device_capability(a.device) >= (9, 0)
        kernel = "tma" if hopper and tma_applies(a, b) else "pointer"
    return kernel


def grouped_rows(a: torch.Tensor, b: torch.Tensor, splits: list[int], *, scale_a: Optional[torch.Tensor] = None,
                 scale_b: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                 out_dtype: torch.dtype = torch.bfloat16,
                 tile: tuple[int, int, int, int, int] = TILE, group_m: int = GROUP_M,
                 kernel: Optional[str] = None, tma: Optional[TmaConfig] = None) -> torch.Tensor:
    """fprop / dgrad: ``out[r_e + i, j] = ep(Σ_k a[r_e + i, k] b[e, j, k])`` for expert e's rows.

    ``a`` [Σ splits, K] and ``b`` [E, N, K] BF16 (any strides); ``scale_a`` [Σ splits] (per row),
    ``scale_b`` and ``bias`` [E, N], all FP32 or None; returns [Σ splits, N] in ``out_dtype``.
    ``kernel``: ``"pointer"`` (``tile``, ``group_m``), ``"tma"`` (``tma``, None:
    ``default_tma_config(out_dtype)``; a ValueError where ``tma_applies`` is false) or None
    (``_rows_kernel``: TMA on Hopper+ where it applies).
    ``tile`` / ``group_m`` other than the defaults configure the pointer kernel only: a
    ValueError if the TMA kernel would run (pass ``kernel="pointer"``, or ``tma=``)."""
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
    chosen = _rows_kernel(kernel, a, b)
    if chosen == "tma" and (tuple(tile) != TILE or group_m != GROUP_M):
        raise ValueError(f"grouped_rows: tile={tile} / group_m={group_m} configure the pointer kernel, but the "
                         f"TMA kernel runs here; pass kernel='pointer' to time that tile, or a TmaConfig as tma=.")
    if chosen == "tma":
        cfg = tma or default_tma_config(out_dtype)
        return _launch_tma(a, b, out, _plan(ranges, [(0, k)] * e, cfg.bm), scale_a, scale_b, bias, cfg)
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
