"""GEMM epilogue in one pass over the FP32 accumulator: global scales, bias, cast (or accumulate).

``epilogue(acc, scale_a, scale_b, bias, out_dtype, accumulate_into)`` computes, per element,
exactly what ``hybridfp.gemm.emulate`` does after its matmul, in the same FP32 order:

    v = acc * (sa[i] * sb[j])        # each scale: None (1), 0-d, or a vector (per row / column)
    v = v + bias[j]                  # bias in FP32
    out = cast(v)                    # or: accumulate_into[i, j] = cast(accumulate_into + v)

FMA contraction is off (``enable_fp_fusion=False``) so ``acc * s + bias`` rounds twice, like
the reference. The BF16 cast is done on the bits (round to nearest even; the interpreter's
BF16 cast truncates), with torch's NaN bits for the device; FP16 uses Triton's cast (correct
in both modes). Separate torch ops would read and write the [m, n] FP32 tensor once per step.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import empty
from ._common_encode import bf16_nan16

#: output dtype -> constexpr code
OUT_CODE: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _load_scale(ptr, idx, n, KIND: tl.constexpr):
    """Scale per index: 1 (KIND 0), the 0-d value (1) or ``ptr[idx]`` (2)."""
    if KIND == 2:
        return tl.load(ptr + idx, mask=idx < n, other=1.0)
    elif KIND == 1:
        return tl.load(ptr + idx * 0)
    else:
        return tl.full(idx.shape, 1.0, tl.float32)


@triton.jit
def _load_out(ptrs, mask, OUT: tl.constexpr):
    """The destination's current values in FP32 (BF16 widened from its bits: exact)."""
    if OUT == 1:
        return (tl.load(ptrs, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def out_value(v, OUT: tl.constexpr, NAN16: tl.constexpr, HW: tl.constexpr = False):
    """FP32 ``v`` in the output dtype (OUT_CODE) with one rounding, as stored: BF16 as its int16
    bits (round to nearest even on the bits; torch's NaN bits ``NAN16``), FP16 by Triton's cast,
    FP32 as is. ``HW`` (compiled code only: the interpreter's BF16 cast truncates): BF16 by the
    hardware's round-to-nearest-even conversion, two values an instruction, NaN still made
    ``NAN16`` — bitwise the integer path's result (GPU test), in a third of its instructions,
    which the grouped GEMMs' epilogues pay once per output element."""
    if OUT == 1 and HW:
        h = v.to(tl.bfloat16).to(tl.int16, bitcast=True)
        return tl.where(v != v, tl.full(v.shape, NAN16, tl.int16), h)
    elif OUT == 1:
        b = v.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        return tl.where(v != v, NAN16, b).to(tl.int16)
    elif OUT == 2:
        return v.to(tl.float16)
    else:
        return v


@triton.jit
def store_out(optrs, v, mask, OUT: tl.constexpr, NAN16: tl.constexpr, HW: tl.constexpr = False):
    """Store FP32 ``v`` at ``optrs`` in the output dtype (:func:`out_value`)."""
    tl.store(optrs, out_value(v, OUT, NAN16, HW), mask=mask)


@triton.jit
def _epilogue_kernel(acc_ptr, sa_ptr, sb_ptr, bias_ptr, out_ptr, M, N, acc_stride, os0, os1: tl.constexpr,
                     SA: tl.constexpr, SB: tl.constexpr, BIAS: tl.constexpr, ACCUM: tl.constexpr,
                     OUT: tl.constexpr, NAN16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     HW: tl.constexpr = False):
    pid = tl.program_id(0)
    nn = tl.cdiv(N, BN)
    rows = (pid // nn) * BM + tl.arange(0, BM)
    cols = (pid % nn) * BN + tl.arange(0, BN)
    r64 = rows.to(tl.int64)
    c64 = cols.to(tl.int64)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    v = tl.load(acc_ptr + r64[:, None] * acc_stride + c64[None, :], mask=mask, other=0.0)
    if SA != 0 or SB != 0:
        v = v * (_load_scale(sa_ptr, rows, M, SA)[:, None] * _load_scale(sb_ptr, cols, N, SB)[None, :])
    if BIAS:
        v = v + tl.load(bias_ptr + cols, mask=cols < N, other=0.0)[None, :]
    optrs = out_ptr + r64[:, None] * os0 + c64[None, :] * os1
    if ACCUM:
        v = _load_out(optrs, mask, OUT) + v
    store_out(optrs, v, mask, OUT, NAN16, HW)


def _scale_kind(s: Optional[torch.Tensor], n: int, what: str) -> int:
    if s is None:
        return 0
    if s.dtype != torch.float32 or s.dim() > 1 or (s.dim() == 1 and s.shape[0] != n):
        raise ValueError(f"epilogue: {what} must be None, a 0-d or a [{n}] FP32 tensor; got "
                         f"{s.dtype} {tuple(s.shape)}.")
    return 2 if s.dim() == 1 else 1


def supported(out_dtype: torch.dtype, accumulate_into: Optional[torch.Tensor]) -> bool:
    """Whether :func:`epilogue` takes this destination (else the caller uses torch ops)."""
    if accumulate_into is None:
        return out_dtype in OUT_CODE
    return accumulate_into.dtype in OUT_CODE


def epilogue(acc: torch.Tensor, scale_a: Optional[torch.Tensor], scale_b: Optional[torch.Tensor],
             bias: Optional[torch.Tensor], out_dtype: torch.dtype,
             accumulate_into: Optional[torch.Tensor] = None, *, block: tuple[int, int] = (32, 128),
             num_warps: int = 4, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The result of an FP32 accumulator ``acc`` [m, n] (row-major), see the module doc;
    ``out`` (an [m, n] ``out_dtype`` tensor, any strides; not with ``accumulate_into``): written
    there instead of a new tensor."""
    if acc.dtype != torch.float32 or acc.dim() != 2 or acc.stride(1) != 1:
        raise ValueError(f"epilogue: acc must be a row-major 2D FP32 tensor; got {acc.dtype} "
                         f"{tuple(acc.shape)} strides {acc.stride()}.")
    if not supported(out_dtype, accumulate_into):
        raise ValueError(f"epilogue writes {sorted(map(str, OUT_CODE))}; got "
                         f"{(accumulate_into.dtype if accumulate_into is not None else out_dtype)}.")
    m, n = acc.shape
    sa_kind, sb_kind = _scale_kind(scale_a, m, "scale_a"), _scale_kind(scale_b, n, "scale_b")
    if out is not None and (accumulate_into is not None or out.shape != (m, n) or out.dtype != out_dtype
                            or out.device != acc.device):
        raise ValueError(f"epilogue: out must be a [{m}, {n}] {out_dtype} tensor on {acc.device} and "
                         f"accumulate_into None; got {out.dtype} {tuple(out.shape)} on {out.device}"
                         f"{' with accumulate_into' if accumulate_into is not None else ''}.")
    if out is None:
        out = accumulate_into if accumulate_into is not None else empty((m, n), out_dtype, acc.device)
    if out.numel() == 0:
        return out
    bias32 = bias.to(device=acc.device, dtype=torch.float32).contiguous() if bias is not None else None
    dummy = acc
    dst = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
    bm, bn = block
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _epilogue_kernel[grid](acc, scale_a if sa_kind else dummy, scale_b if sb_kind else dummy,
                           bias32 if bias32 is not None else dummy, dst, m, n, acc.stride(0),
                           out.stride(0), out.stride(1), SA=sa_kind, SB=sb_kind,
                           BIAS=bias32 is not None, ACCUM=accumulate_into is not None,
                           OUT=OUT_CODE[out.dtype], NAN16=bf16_nan16(acc.device),
                           BM=bm, BN=bn, HW=acc.is_cuda, num_warps=num_warps, enable_fp_fusion=False)
    return out
