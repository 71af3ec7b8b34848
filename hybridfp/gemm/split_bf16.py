"""``split_bf16``: the exact GEMM of a one-sided RHT pair as one BF16 GEMM over its split parts.

A GEMM that pairs an NVFP4 copy with the random Hadamard transform (RHT) on its reduction
dim with a copy that has none (e.g. wgrad of MXFP8 dy.col x NVFP4-RHT x.col) cannot stay in
the transformed domain: the exact GEMM (numerics §1, ``backends.emulate``) first undoes the RHT
of that one side in FP32 (``backends._to_original_domain``), and those FP32 values do not
fit in BF16. They fit in three BF16 numbers:

    v   = _to_original_domain(decode(R))           # FP32: exactly what emulate multiplies
    hi  = bf16(v); mid = bf16(v - hi); lo = bf16(v - hi - mid)   # each subtraction exact
    acc = [P | P | P] · [hi | mid | lo]ᵀ            # P: the other (BF16-exact) operand;
                                                   # one BF16 GEMM, FP32 accumulation

FP32 keeps a 24-bit significand and BF16 8, so ``v == hi + mid + lo`` exactly for
normal-range values; below about 2**-110 the bits ``lo`` must carry fall under BF16's
subnormal grid (2**-133) and would be lost, and a non-finite ``v`` does not split at all.
Every product of two BF16 numbers is exact in FP32, so ``acc`` is emulate's accumulator up
to the order of the FP32 additions (numerics §1). The split is checked on the device (one
synchronizing read of three flags); :func:`split_gemm` returns None when it is not exact and
the caller runs (and reports) the emulation instead.

Parts that are all zero are left out (on CUDA only trailing ones; adding an all-zero product
changes nothing).
For an NVFP4-RHT copy that is the usual case for ``lo``: each 16-element RHT tile lies in one
NVFP4 block (one E4M3 scale, 4 significant bits), so an inverse-transformed value is a
multiple of 1/8 of that scale below 24x it (8 bits): at most 12 significant bits, which
``hi`` and ``mid`` hold. So such a GEMM costs one BF16 GEMM over twice the reduction plus the
inverse transform (on CUDA one Triton pass that also splits: ``kernels/triton_split_rht.py``):
about half a BF16 GEMM's speed, its bound while the values stay exact.

Device independence: the BF16 GEMM is passed in (``mm``: cuBLAS BF16 with FP32 output on
CUDA, an IEEE FP32 matmul of the same values on the CPU; see ``bf16_tensorcore``), so the CPU
tests run this exact code path.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..tensors.storage import GemmOperand
from .backends import _to_original_domain

#: (x [m, k] BF16, y [n, k] BF16) -> x · yᵀ [m, n] FP32, exact products, FP32 accumulation.
BF16MM = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: Why :func:`split_gemm` declines a GEMM (the reason its caller reports).
INEXACT = "values below ~2**-110 or non-finite do not split exactly into three BF16 parts"


def split3(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hi, mid, lo) BF16 with hi = bf16(v), mid = bf16(v - hi), lo = bf16(v - hi - mid).

    Each subtraction is exact in FP32 (the rounded part shares the leading bits of what it
    is subtracted from), so only the three roundings to BF16 can lose bits: the last one.
    """
    if v.dtype != torch.float32:
        raise ValueError(f"split3 splits FP32 values; got {v.dtype}.")
    hi = v.to(torch.bfloat16)
    rest = v - hi.float()
    mid = rest.to(torch.bfloat16)
    lo = (rest - mid.float()).to(torch.bfloat16)
    return hi, mid, lo


def exact_parts(v: torch.Tensor) -> Optional[list[torch.Tensor]]:
    """The BF16 parts of ``v`` worth multiplying (hi always, mid / lo when not all zero) if
    ``hi + mid + lo == v`` for every element, else None. One device sync for all three flags."""
    hi, mid, lo = split3(v)
    exact = ((hi.float() + mid.float()) + lo.float() == v).all()
    flags = torch.stack([exact, mid.ne(0).any(), lo.ne(0).any()]).tolist()
    if not flags[0]:
        return None
    return [hi] + [p for p, nonzero in ((mid, flags[1]), (lo, flags[2])) if nonzero]


def original_domain_values(op: GemmOperand) -> torch.Tensor:
    """An RHT operand's values as ``emulate`` multiplies them: its block-decoded values in
    FP32 (a BF16 decode converts back exactly), inverse-transformed by ``_to_original_domain``."""
    return _to_original_domain(GemmOperand(op.values.float(), op.scale, op.k, op.rht))


def split_gemm(a: GemmOperand, b: GemmOperand, mm: BF16MM) -> Optional[torch.Tensor]:
    """FP32 accumulator Σ_k a[m, k] b[n, k] (no epilogue) of a one-sided RHT pair, or None
    when the RHT side's values do not split exactly (see the module doc; run ``emulate``).

    ``a``, ``b``: BF16-decoded operands, exactly one with ``rht``; the other's values are
    multiplied as they are, the RHT side's after the inverse transform and the split. The
    parts sit side by side along the reduction ([hi | mid (| lo)]) against the plain operand
    repeated as often, so one BF16 GEMM over the longer reduction sums every part's products
    in its FP32 accumulator (numerics §1: the emulation's accumulator up to the order of the FP32
    additions).
    """
    if a.rht == b.rht:
        raise ValueError(f"split_gemm takes a one-sided RHT pair; got rht={a.rht} on both sides.")
    plain, transformed = (b, a) if a.rht else (a, b)
    if plain.values.dtype != torch.bfloat16:
        raise ValueError(f"split_gemm: the non-RHT operand must be BF16-decoded; got {plain.values.dtype}.")
    k = plain.values.shape[1]
    if transformed.k != k:
        raise ValueError(f"split_gemm: reduction lengths differ: {k} (plain) vs {transformed.k} (RHT operand "
                         "after the inverse transform).")
    parts = _parts(transformed)
    if parts is None:
        return None
    reps = parts.shape[1] // k if k else 1
    wide = plain.values if reps == 1 else plain.values.repeat(1, reps)
    return mm(parts, wide) if a.rht else mm(wide, parts)


def _parts(op: GemmOperand) -> Optional[torch.Tensor]:
    """The RHT operand's exact BF16 parts side by side, [rows, parts * k] (hi, then mid / lo
    where not all zero), or None if they do not hold its values exactly. CUDA: one Triton pass
    (``kernels/triton_split_rht.py``, one synchronizing read of its three flags); elsewhere
    PyTorch (``original_domain_values`` + ``exact_parts``)."""
    if op.values.is_cuda:
        from ..kernels import triton_split_rht
        both, flags = triton_split_rht.inverse_rht_split(op.values, op.k)
        inexact, mid, lo = flags.tolist()
        if inexact:
            return None
        # a view of the first parts (row stride 3k): the GEMM reads it in place
        return both[:, :(3 if lo else 2 if mid else 1) * op.k]
    parts = exact_parts(original_domain_values(op))
    return None if parts is None else torch.cat(parts, 1)
