"""Grouped FP8 x FP8 GEMM on FP8 tensor cores, one launch for every expert of an MoE layer, for
per-tensor-scaled operands (FP8 current / delayed scaling) in any E4M3 / E5M2 mix.

Why: at 64 small experts the per-expert cuBLAS loop is host-bound (four GEMMs a layer, one
launch sequence each), and torch's grouped FP8 kernel (``torch._scaled_grouped_mm``) takes
E4M3 rows only — not dgrad's E5M2 gradients nor wgrad's reduction-grouped operands.

Each expert's operands are FP8 views with unit column stride, read where they lie:
``out[o_e + i, j] = ep(Σ_{k < K_e} A_e[i, k] · B_e[j, k])`` with A_e [M_e, K_e], B_e [N, K_e] —
fprop / dgrad: A_e the expert's rows of a [Σm, K] copy, B_e its weight copy; wgrad: A_e, B_e the
expert's columnwise copies (its token count is the reduction). Per expert the kernel gets the
element offset of A_e / B_e from the first expert's base pointer and their row strides, so no
operand is joined or copied (an FP8 element is one byte: element offsets are byte offsets;
the experts' views may lie in different allocations of the same device).

Accumulation (numerics §1's documented Hopper exception): the FP8 MMA sums each ``PROMOTE``-long K
chunk in its own reduced-precision accumulator, which is then added to an FP32 accumulator
(Triton's ``max_num_imprecise_acc``) — cuBLAS's behaviour without fast accumulation, as the
per-expert cuBLAS path. Epilogue in FP32 as ``hybridfp.gemm.emulate``: ``v = acc * (sa_e *
sb_e)``, ``+ bias_e[j]``, one rounding to the output dtype (FMA contraction off).

Under the interpreter (CPU tests) the codes are decoded to their exact FP32 values and summed
in FP32 (``CODES``): the same products, the FP32 accumulation the MMA's promotion approximates.
"""

from __future__ import annotations

import numbers
from math import gcd
from typing import Optional, Sequence, Union

import numpy as np
import torch
import triton
import triton.language as tl

from ...utils.device import tile_plan, to_device
from .._common import expert_row_tile, swizzled_tile
from .._common_encode import bf16_nan16
from ..triton_decode import fp8_f32
from ..triton_epilogue import OUT_CODE, store_out
from .triton_grouped_fp8_tma import Fp8TmaConfig, applies as tma_applies, launch as launch_tma

#: (BM, BN, BK, warps, stages) for fprop / dgrad (rows grouped): the fastest of ``python -m
#: bench.bench_grouped_gemm --part fp8 --pointer-tiles`` at the 64-expert MoE shapes on an
#: NVIDIA H200.
TILE = (128, 128, 128, 8, 4)
#: wgrad (reduction grouped: each expert's reduction is its few hundred tokens, so a program's
#: K loop is short): a shallower K step and pipeline is faster there than TILE or deeper
#: pipelines (``python -m bench.bench_grouped_gemm --part fp8 --pointer-tiles
#: --wgrad`` on an NVIDIA H200).
WGRAD_TILE = (128, 128, 64, 4, 3)
#: K elements the FP8 MMA sums before its partial sum is added to the FP32 accumulator (at most
#: one BK step; cuBLAS and DeepGEMM promote every 128 as well). It costs no measurable time on an
#: NVIDIA H200.
PROMOTE = 128
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
#: Row tiles that sweep the column tiles together (L2 swizzle, as triton_grouped_gemm).
GROUP_M = 8
#: Per-expert fields of the kernel's metadata (after the E + 1 row tile prefix sums): A offset, A row stride, B offset, B row stride,
#: K, first output row, rows (M_e).
_FIELDS = tl.constexpr(7)


@triton.jit
def _kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, out_ptr, meta_ptr, T, N, E,
            BIAS: tl.constexpr, OUT: tl.constexpr, NAN16: tl.constexpr, CODES: tl.constexpr,
            E5A: tl.constexpr, E5B: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
            ALIGN: tl.constexpr, GROUP: tl.constexpr, PROMOTE: tl.constexpr, EP: tl.constexpr):
    # one program per (row tile t, column tile j), swizzled for L2 reuse; row tile t's expert
    # from the tile-count prefix sums at the start of meta (utils.device.tile_plan)
    t, j = swizzled_tile(tl.program_id(0), T, N, BN, GROUP)
    e, te = expert_row_tile(meta_ptr, t, E, EP)
    # A offset, A row stride, B offset, B row stride, K, out row, rows
    meta = meta_ptr + (E + 1) + e.to(tl.int64) * _FIELDS
    # ALIGN (host-checked) divides every offset, stride and K: lets the compiler prove 16-byte
    # vector loads and cp.async pipelining on FP8 rows
    a_off = tl.multiple_of(tl.load(meta), ALIGN)
    a_ld = tl.multiple_of(tl.load(meta + 1), ALIGN)
    b_off = tl.multiple_of(tl.load(meta + 2), ALIGN)
    b_ld = tl.multiple_of(tl.load(meta + 3), ALIGN)
    k_e = tl.multiple_of(tl.load(meta + 4), ALIGN)
    o_row = tl.load(meta + 5)
    rows = te * BM + tl.arange(0, BM)
    cols = j * BN + tl.arange(0, BN)
    rmask, cmask = rows < tl.load(meta + 6), cols < N
    kk = tl.arange(0, BK)
    a_ptrs = a_ptr + a_off + rows.to(tl.int64)[:, None] * a_ld + kk[None, :]
    b_ptrs = b_ptr + b_off + cols.to(tl.int64)[None, :] * b_ld + kk[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, k_e, BK):
        kmask = (k + kk) < k_e
        a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
        if CODES:  # the interpreter: exact FP32 values of the codes, FP32 sums
            acc = tl.dot(fp8_f32(a.to(tl.int32), E5A), fp8_f32(b.to(tl.int32), E5B), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=PROMOTE)
        a_ptrs += BK
        b_ptrs += BK
    e64 = e.to(tl.int64)
    v = acc * (tl.load(sa_ptr + e64) * tl.load(sb_ptr + e64))
    c64 = cols.to(tl.int64)
    if BIAS:
        v = v + tl.load(bias_ptr + e64 * N + c64, mask=cmask, other=0.0)[None, :]
    optrs = out_ptr + (o_row + rows.to(tl.int64))[:, None] * N + c64[None, :]
    store_out(optrs, v, rmask[:, None] & cmask[None, :], OUT, NAN16, HW=not CODES)


def _operand_row(what: str, e: int, t: torch.Tensor, k: int) -> tuple[int, int, int]:
    """(rows, row stride, data pointer) of expert e's operand, checked: FP8, 2D, at least ``k``
    columns with unit stride (a size-1 dim's stride is never used: torch gives such dims
    arbitrary strides)."""
    shape, stride = t.shape, t.stride()
    if len(shape) != 2 or shape[1] < k or t.dtype not in _FP8:
        raise ValueError(f"grouped FP8 GEMM: {what}[{e}] must be a 2D E4M3 / E5M2 tensor with at least "
                         f"{k} columns (its reduction); got {t.dtype} {tuple(shape)}.")
    if (shape[1] > 1 and stride[1] != 1) or (shape[0] > 1 and stride[0] < k):
        raise ValueError(f"grouped FP8 GEMM: {what}[{e}] must have unit column stride and a row "
                         f"stride of at least its reduction {k}; got strides {tuple(stride)}.")
    return shape[0], stride[0], t.data_ptr()


def grouped_fp8(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], ks: Sequence[int],
                scale_a: torch.Tensor, scale_b: torch.Tensor, out: torch.Tensor, out_rows: Sequence[int], *,
                bias: Optional[torch.Tensor] = None, tile: tuple[int, int, int, int, int] = TILE,
                promote: int = PROMOTE, group_m: int = GROUP_M, tma: Optional[Fp8TmaConfig] = None,
                prefer_tma: Optional[Fp8TmaConfig] = None) -> torch.Tensor:
    """``out[out_rows[e] + i, j] = ep(Σ_{k < ks[e]} a[e][i, k] · b[e][j, k])`` for every expert e.

    ``a[e]`` [M_e, ≥ ks[e]] and ``b[e]`` [N, ≥ ks[e]]: FP8 (E4M3 or E5M2, one dtype per side),
    unit column stride; ``scale_a`` / ``scale_b``: FP32 [E], each expert's ``scale_inv``;
    ``bias``: FP32 [E, N] or None; ``out``: contiguous [R, N] (BF16, FP16 or FP32) whose rows
    ``out_rows[e] .. + M_e`` take expert e's result. An expert with M_e = 0 gets no program;
    one with ks[e] = 0 writes its epilogue of zero sums. ``tma`` / ``prefer_tma``: the TMA kernel
    (``triton_grouped_fp8_tma``) instead of the pointer kernel (``_launch``). Returns ``out``."""
    experts = len(a)
    if len(b) != experts or len(ks) != experts or len(out_rows) != experts or experts == 0:
        raise ValueError(f"grouped FP8 GEMM: one A, B, K and output row per expert; got {len(a)}, {len(b)}, "
                         f"{len(ks)}, {len(out_rows)}.")
    n = _check_common(experts, out, scale_a, scale_b, bias)
    if len({t.dtype for t in a}) > 1 or len({t.dtype for t in b}) > 1:
        raise ValueError("grouped FP8 GEMM: every expert's A (and every B) must have the same FP8 dtype.")
    pa, pb = a[0].data_ptr(), b[0].data_ptr()
    # one pass over the views (their pointers and strides are only known one by one): per
    # expert its offsets from the first expert's pointers, strides, K, output row and rows
    meta, align, rows_out = [], 16, out.shape[0]
    for e in range(experts):
        k, o = int(ks[e]), int(out_rows[e])
        m, lda, ptr_a = _operand_row("A", e, a[e], k)
        nb, ldb, ptr_b = _operand_row("B", e, b[e], k)
        if nb != n:
            raise ValueError(f"grouped FP8 GEMM: B[{e}] has {nb} rows; out has {n} columns.")
        _check_out_rows(e, o, m, rows_out)
        if k and m:
            meta.append((ptr_a - pa, lda, ptr_b - pb, ldb, k, o, m))
            align = gcd(gcd(gcd(gcd(gcd(align, ptr_a - pa), lda), ptr_b - pb), ldb), k)
        else:  # reads nothing: offsets stay 0
            meta.append((0, 0, 0, 0, 0, o, m))
    align = gcd(gcd(align, pa % 16), pb % 16)
    return _launch(a[0], b[0], scale_a, scale_b, bias, out, np.array(meta, dtype=np.int64).reshape(-1, 7), n, tile,
                   promote, group_m, align, tma, prefer_tma)


Ints = Union[int, Sequence[int], torch.Tensor]


def grouped_fp8_at(base_a: torch.Tensor, base_b: torch.Tensor, ms: Ints, a_offs: Ints, a_lds: Ints,
                   b_offs: Ints, b_lds: Ints, ks: Ints, scale_a: torch.Tensor, scale_b: torch.Tensor,
                   out: torch.Tensor, out_rows: Ints, *, bias: Optional[torch.Tensor] = None,
                   tile: tuple[int, int, int, int, int] = TILE, promote: int = PROMOTE,
                   group_m: int = GROUP_M, tma: Optional[Fp8TmaConfig] = None,
                   prefer_tma: Optional[Fp8TmaConfig] = None) -> torch.Tensor:
    """:func:`grouped_fp8` with the experts' operands given as places in two contiguous FP8
    tensors (joined copies) instead of views: expert e's A is ``ms[e]`` rows of ``base_a`` from
    element ``a_offs[e]`` with row stride ``a_lds[e]``, its B the N (``out``'s width) rows of
    ``base_b`` from ``b_offs[e]`` with row stride ``b_lds[e]``, both ``ks[e]`` long. Each
    per-expert argument is a sequence of host ints (or a CPU int tensor) with one value per
    expert (E: ``scale_a``'s length), or one int for all of them. Every expert's extent is
    checked to lie inside its base.

    The host work is a few vectorized numpy ops on [E] vectors (no per-expert Python loop, no
    per-tile table). With torch CPU tensors instead, the host work of the calls would be a large
    share of a 64-expert MoE step's host time."""
    experts = scale_a.numel()  # checked below: scale_a is [E]
    if experts == 0:
        raise ValueError("grouped FP8 GEMM: at least one expert (scale_a is empty).")
    n = _check_common(experts, out, scale_a, scale_b, bias)
    for what, t in (("base_a", base_a), ("base_b", base_b)):
        if t.dtype not in _FP8 or not t.is_contiguous():
            raise ValueError(f"grouped FP8 GEMM: {what} must be a contiguous E4M3 / E5M2 tensor; got {t.dtype}, "
                             f"strides {t.stride()}.")
    # numpy, not torch, for these [E] host vectors: a numpy op on a small vector costs about a
    # tenth of a torch CPU op, and a call makes ~40 of them
    lists = [_host_ints(w, v, experts) for w, v in zip(_NAMES, (ms, ks, out_rows, a_offs, a_lds, b_offs, b_lds))]
    try:
        table = np.array(lists, dtype=np.int64)
    except OverflowError:  # a value outside int64: the same error as one outside [0, 2**48]
        i, e, v = next((i, e, v) for i, row in enumerate(lists) for e, v in enumerate(row)
                       if not -(1 << 63) <= v < (1 << 63))
        raise ValueError(f"grouped FP8 GEMM: {_NAMES[i]}[{e}] is {v}; every count, offset and stride must lie "
                         f"in [0, 2**48].") from None
    # every value in [0, 2**48] first (no tensor has more elements), so the extent arithmetic
    # below cannot wrap around in int64
    out_of_range = (table < 0) | (table > _MAX_VALUE)
    if out_of_range.any():
        i, e = (int(v) for v in np.argwhere(out_of_range)[0])
        raise ValueError(f"grouped FP8 GEMM: {_NAMES[i]}[{e}] is {int(table[i, e])}; every count, offset and stride "
                         f"must lie in [0, 2**48].")
    m, k, o, a_off, a_ld, b_off, b_ld = table
    la, lb = base_a.numel(), base_b.numel()
    # every check in one vector pass; the first failing expert is re-checked one by one for its message
    active = (k > 0) & (m > 0)
    bad = (o + m > out.shape[0]) | (active & (_overruns(a_off, a_ld, m, k, la) | _overruns(b_off, b_ld, n, k, lb)))
    if bad.any():
        _raise_for(int(np.flatnonzero(bad)[0]), table, n, out.shape[0], la, lb)
    # experts that read nothing keep offsets, strides and K at 0 (their rows still get the
    # epilogue of zero sums)
    fields = np.stack((a_off, a_ld, b_off, b_ld, k), 1) * active[:, None]
    low = fields % 16
    low = np.where(low > 0, low & -low, 16).min()  # the lowest set bit: gcd(16, ...) of all of them
    align = gcd(gcd(int(low), base_a.data_ptr() % 16), base_b.data_ptr() % 16)
    return _launch(base_a, base_b, scale_a, scale_b, bias, out, np.concatenate((fields, o[:, None], m[:, None]), 1), n,
                   tile, promote, group_m, align, tma, prefer_tma)


#: ``grouped_fp8_at``'s per-expert arguments, in its table's row order (error messages)
_NAMES = ("ms", "ks", "out_rows", "a_offs", "a_lds", "b_offs", "b_lds")
#: Largest count, offset or stride ``grouped_fp8_at`` takes: products of two stay below 2**63
#: only through the division in ``_overruns``; sums of three stay below 2**50.
_MAX_VALUE = 1 << 48


def _overruns(off: np.ndarray, ld: np.ndarray, rows, k: np.ndarray, limit: int) -> np.ndarray:
    """Whether ``rows`` rows of ``k`` elements from ``off`` with row stride ``ld`` leave a base
    of ``limit`` elements (or overlap themselves: ld < k), per expert, without forming
    ``(rows - 1) * ld`` (which may not fit in int64): (rows - 1) <= room // ld."""
    room = limit - off - k  # every term in [0, 2**48]: no wrap-around
    rows = np.asarray(rows, dtype=np.int64)
    many = rows > 1
    return (room < 0) | (many & ((ld < k) | (rows - 1 > np.maximum(room, 0) // np.maximum(ld, 1))))


def _host_ints(what: str, v: Ints, experts: int) -> list[int]:
    """``v`` as a list of ``experts`` host ints (one int: the same for every expert)."""
    if isinstance(v, numbers.Integral):
        return [int(v)] * experts
    values = v.tolist() if isinstance(v, (torch.Tensor, np.ndarray)) else [int(x) for x in v]
    if isinstance(values, int):  # a 0-d tensor
        return [values] * experts
    if len(values) != experts:
        raise ValueError(f"grouped FP8 GEMM: {what} needs one value per expert ({experts}) or one for all; got "
                         f"{len(values)}.")
    return values


def _raise_for(e: int, table: np.ndarray, n: int, rows_out: int, la: int, lb: int) -> None:
    """The error for expert e, which failed ``grouped_fp8_at``'s vector checks."""
    m, k, o, a_off, a_ld, b_off, b_ld = table[:, e].tolist()
    _check_out_rows(e, o, m, rows_out)
    for what, off, ld, r, limit in (("A", a_off, a_ld, m, la), ("B", b_off, b_ld, n, lb)):
        if off < 0 or (r > 1 and ld < k) or off + (r - 1) * ld + k > limit:
            raise ValueError(f"grouped FP8 GEMM: expert {e}'s {what} ({r} rows of {k} from element {off}, row "
                             f"stride {ld}) does not lie inside its base of {limit} elements.")
    raise AssertionError(f"grouped FP8 GEMM: expert {e} failed a vector check that its own checks pass.")


def _check_out_rows(e: int, o: int, m: int, rows_out: int) -> None:
    if o < 0 or o + m > rows_out:
        raise ValueError(f"grouped FP8 GEMM: expert {e}'s {m} result rows from row {o} do not fit "
                         f"in out's {rows_out} rows.")


def _check_common(experts: int, out: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                  bias: Optional[torch.Tensor]) -> int:
    """Check the output, scales and bias; returns N (out's width)."""
    if out.dim() != 2 or not out.is_contiguous() or out.dtype not in OUT_CODE:
        raise ValueError(f"grouped FP8 GEMM: out must be a contiguous 2D BF16 / FP16 / FP32 tensor; got "
                         f"{out.dtype} {tuple(out.shape)}.")
    n = out.shape[1]
    for what, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if s.dtype != torch.float32 or tuple(s.shape) != (experts,) or not s.is_contiguous():
            raise ValueError(f"grouped FP8 GEMM: {what} must be contiguous FP32 [{experts}]; got {s.dtype} "
                             f"{tuple(s.shape)}.")
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (experts, n) or not bias.is_contiguous()):
        raise ValueError(f"grouped FP8 GEMM: bias must be contiguous FP32 [{experts}, {n}]; got {bias.dtype} "
                         f"{tuple(bias.shape)}.")
    return n


def _launch(base_a: torch.Tensor, base_b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
            bias: Optional[torch.Tensor], out: torch.Tensor, meta: np.ndarray, n: int,
            tile: tuple[int, int, int, int, int], promote: int, group_m: int, align: int,
            tma: Optional[Fp8TmaConfig] = None, prefer_tma: Optional[Fp8TmaConfig] = None) -> torch.Tensor:
    """Run the pointer kernel (``tile``), or the TMA kernel: ``tma`` (an error where it cannot
    read the operands) or ``prefer_tma`` (where it can; else the pointer kernel, the same sums)."""
    if tma is None and prefer_tma is not None and tma_applies(meta, n, align, out, prefer_tma):
        return launch_tma(base_a, base_b, scale_a, scale_b, bias, out, meta, n, prefer_tma, promote)
    if tma is not None:
        if not tma_applies(meta, n, align, out, tma):
            raise ValueError(f"grouped FP8 GEMM: the TMA kernel needs every operand base, expert offset, row stride "
                             f"and K a multiple of 16 bytes (found {align}), every dimension below 2**31 and, "
                             f"with tma_store, out's base and rows 16-byte aligned; pass tma=None for these "
                             f"operands (the pointer kernel: the same sums).")
        return launch_tma(base_a, base_b, scale_a, scale_b, bias, out, meta, n, tma, promote)
    bm, bn, bk, warps, stages = tile
    experts = meta.shape[0]
    packed, row_tiles = tile_plan(meta[:, 6], meta, bm)
    if row_tiles == 0 or n == 0:
        return out
    device = out.device
    codes = not out.is_cuda  # the interpreter (see module docstring)
    aa, bb = (base_a.view(torch.uint8), base_b.view(torch.uint8)) if codes else (base_a, base_b)
    dst = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
    grid = (row_tiles * triton.cdiv(n, bn),)
    _kernel[grid](aa, bb, scale_a, scale_b, bias if bias is not None else scale_a, dst, to_device(packed, device),
                  row_tiles, n, experts, BIAS=bias is not None, OUT=OUT_CODE[out.dtype], NAN16=bf16_nan16(device),
                  CODES=codes, E5A=base_a.dtype == torch.float8_e5m2, E5B=base_b.dtype == torch.float8_e5m2,
                  BM=bm, BN=bn, BK=bk, ALIGN=align, GROUP=group_m, PROMOTE=min(promote, bk),
                  EP=triton.next_power_of_2(experts + 1), num_warps=warps, num_stages=stages,
                  enable_fp_fusion=False)
    return out
