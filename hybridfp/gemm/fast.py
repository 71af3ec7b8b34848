"""The cuBLAS FP8 GEMM backends (``hybridfp.kernels.cublas_fp8``) in the gemm registry.

| backend               | A copy           | B copy                 | layouts    | accumulation          |
|-----------------------|------------------|------------------------|------------|-----------------------|
| cublas_fp8_tensorwise | FP8 per-tensor   | FP8 per-tensor         | TN, NN, NT | FP32 promotion; fast if asked |
| cublas_fp8_block      | FP8 block 1x128  | FP8 block 1x128/128x128| TN, NN, NT | FP32 promotion per k block |
|                       | FP8 block 128x128| FP8 block 1x128        |            |                       |

Element types: E4M3/E5M2 in any combination but E5M2 x E5M2 (cuBLAS has none). Devices:
CUDA sm89+ for per-tensor, sm90 (Hopper) for block scales. Operands arrive in the TN layout
cuBLAS needs (every stored copy is [rows, k]), so no layout needs a transpose.

Numerics (numerics §1): FP32 accumulation reordered, plus Hopper's FP8 MMA exception (partial
sums inside one promotion interval keep fewer than FP32's bits) — bounded in
tests/kernels/test_kernels_cublas_fp8.py. ``gemm(fast_accumulation=True)`` (a recipe's
``fprop_fast_accumulation``, as TE and torchao use for fprop) keeps them for the whole k loop
on the per-tensor backend: outside numerics §1, so opt-in, with its own bound in those tests.

A ``supports`` sees formats, not shapes. Per-tensor operands whose k or n is not a multiple of
16 are zero-padded (a view for an MoE expert's zero-tailed columnwise copy, ``_padded`` below); a
block-scaled shape cuBLAS cannot take (k not a multiple of 128 and the alignments in
``cublas_fp8.block_shape_supported``) runs on the exact BF16 tensor-core path or the exact
emulation instead, reported once per (GEMM, pair, reason).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch

from ..kernels import cublas_fp8
from ..tensors.storage import COLUMNWISE, QuantizedStorage
from . import bf16_tensorcore
from .backends import Backend, FormatKey, emulate, register_backend, report_fallback
from .gemm import GEMM_OF_LAYOUT, LAYOUTS

TENSORWISE, BLOCK = "FP8 per-tensor", "FP8 block"
_REPORTED: set[tuple[str, str, str, str]] = set()


def pair_kind(key_a: FormatKey, key_b: FormatKey) -> Optional[str]:
    """"tensorwise" / "block" if cuBLAS has an FP8 kernel for this format pair, else None."""
    try:
        (name_a, opts_a), (name_b, opts_b) = key_a, key_b  # type: ignore[misc]
        oa, ob = dict(opts_a), dict(opts_b)
    except (TypeError, ValueError):
        return None
    if name_a != name_b or not cublas_fp8.dtype_pair_supported(oa.get("fp8_dtype"), ob.get("fp8_dtype")):
        return None
    if name_a == TENSORWISE:
        return "tensorwise"
    if name_a == BLOCK and oa.get("block") == ob.get("block") == cublas_fp8.BLOCK and (
            oa.get("block_dim"), ob.get("block_dim")) in cublas_fp8.BLOCK_PAIRS:
        return "block"
    return None


@lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _device_ok(device: torch.device, kind: str) -> bool:
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    major, minor = _capability(device)
    if kind == "block":  # torch's DeepSeek-style scaling is sm90-only
        return major == 9
    return (major, minor) >= (8, 9)


def _supports(kind: str):
    def supports(key_a: FormatKey, key_b: FormatKey, layout: str, device: torch.device) -> bool:
        return layout in LAYOUTS and pair_kind(key_a, key_b) == kind and _device_ok(device, kind)
    supports.__name__ = f"supports_{kind}"
    return supports


def _emulated(sa: QuantizedStorage, sb: QuantizedStorage, layout: str, why: str,
              out_dtype: torch.dtype, bias: Optional[torch.Tensor],
              accumulate_into: Optional[torch.Tensor]) -> torch.Tensor:
    """A shape cuBLAS FP8 cannot take: the exact BF16 tensor-core GEMM where both copies decode
    exactly into BF16 (about BF16 speed, and exact: no FP8-MMA accumulation exception), else
    the exact FP32 emulation; reported once either way."""
    da, db = LAYOUTS[layout]
    key_a, key_b = sa.format_key(da), sb.format_key(db)
    use_bf16 = bf16_tensorcore.supports(key_a, key_b, layout, sa.device)
    report_fallback(_REPORTED, GEMM_OF_LAYOUT[layout], key_a, key_b, why, "cuBLAS FP8 kernel for this shape",
                    "the exact BF16 tensor-core path (bf16_tensorcore)" if use_bf16 else "the exact emulation path")
    if use_bf16:
        return bf16_tensorcore.run(sa, sb, layout, out_dtype=out_dtype, bias=bias, accumulate_into=accumulate_into)
    return emulate(sa.gemm_operand(da), sb.gemm_operand(db), out_dtype, bias, accumulate_into)


def _finish(run_mm, out_dtype: torch.dtype, accumulate_into: Optional[torch.Tensor]) -> torch.Tensor:
    """Plain result, or ``accumulate_into += result`` (FP32 result, one rounding to its dtype)."""
    if accumulate_into is None:
        return run_mm(out_dtype)
    accumulate_into.add_(run_mm(torch.float32))
    return accumulate_into


def run_tensorwise(sa: QuantizedStorage, sb: QuantizedStorage, layout: str, *,
                   out_dtype: torch.dtype = torch.bfloat16, bias: Optional[torch.Tensor] = None,
                   accumulate_into: Optional[torch.Tensor] = None, fast_accumulation: bool = False,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-tensor FP8 x per-tensor FP8; cuBLAS fast accumulation only when asked (see
    :func:`hybridfp.gemm.gemm`). ``out``: cuBLAS writes the result there when no output
    column is padded (``gemm`` copies any other result into it).

    torch wants k and n multiples of 16: other shapes (e.g. the wgrad of an MoE expert, whose
    reduction is its token count) are zero-padded to them — exact, since the padded products
    are zeros — and the padded output columns dropped."""
    da, db = LAYOUTS[layout]
    pa, pb = sa.payload(da), sb.payload(db)
    (m, k), n = pa["data"].shape, pb["data"].shape[0]
    if m == 0 or n == 0 or k == 0:
        return _emulated(sa, sb, layout, "an empty operand", out_dtype, bias, accumulate_into)
    kp, np_ = -(-k // 16) * 16, -(-n // 16) * 16
    a, b = _padded(sa, da, pa["data"], m, kp), _padded(sb, db, pb["data"], np_, kp)
    bias_p = bias if bias is None or np_ == n else torch.nn.functional.pad(bias, (0, np_ - n))

    def run_mm(dtype: torch.dtype) -> torch.Tensor:
        res = cublas_fp8.gemm_tensorwise(a, pa["scale_inv"], b, pb["scale_inv"], out_dtype=dtype,
                                         bias=bias_p, use_fast_accum=fast_accumulation,
                                         out=out if np_ == n else None)
        return res if np_ == n else res[:, :n].contiguous()
    return _finish(run_mm, out_dtype, accumulate_into)


def _padded(s: QuantizedStorage, direction: str, data: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """FP8 ``data`` [r, k] zero-padded to [rows, cols]: a view of the same memory when only the
    reduction grows and the copy's rows continue with zero codes far enough
    (``columnwise_zero_tail``: an MoE expert's columnwise copy, whose wgrad reduction is its
    token count), else ``pad_fp8``'s padded copy."""
    r, k = data.shape
    if (r, k) != (rows, cols) and r == rows:
        view = zero_tail_view(s, direction, data, cols)
        if view is not None:
            return view
    return cublas_fp8.pad_fp8(data, rows, cols)


def zero_tail_view(s: QuantizedStorage, direction: str, data: torch.Tensor, cols: int) -> Optional[torch.Tensor]:
    """``data`` [r, k] of ``s``'s ``direction`` copy widened to [r, cols] (cols >= k) as a view of
    the same memory, if its rows continue with zero codes that far (``columnwise_zero_tail``:
    an MoE expert's columnwise copy, whose wgrad reduction is its token count), else None."""
    r = data.shape[0]
    if direction == COLUMNWISE and s.columnwise_zero_tail and data.stride(1) == 1 \
            and data.stride(0) >= cols and _fits(data, r, cols):
        return data.as_strided((r, cols), (data.stride(0), 1))
    return None


def _fits(data: torch.Tensor, rows: int, cols: int) -> bool:
    """Whether the [rows, cols] view at ``data``'s offset and row stride lies inside its memory
    (a copy that kept the strides but not the tail, e.g. of a one-row tensor, does not)."""
    end = data.storage_offset() + (rows - 1) * data.stride(0) + cols
    return end <= data.untyped_storage().nbytes() // data.element_size()


def run_block(sa: QuantizedStorage, sb: QuantizedStorage, layout: str, *,
              out_dtype: torch.dtype = torch.bfloat16, bias: Optional[torch.Tensor] = None,
              accumulate_into: Optional[torch.Tensor] = None, fast_accumulation: bool = False) -> torch.Tensor:
    """FP8 block x FP8 block (1x128 x 1x128, 1x128 x 128x128, 128x128 x 1x128). The scales are
    applied per k block, so partial sums are promoted to FP32 per block whatever
    ``fast_accumulation`` says."""
    da, db = LAYOUTS[layout]
    pa, pb = sa.payload(da), sb.payload(db)
    (m, k), n = pa["data"].shape, pb["data"].shape[0]
    bda, bdb = sa.meta["block_dim"], sb.meta["block_dim"]
    if not cublas_fp8.block_shape_supported(m, n, k, bda, bdb):
        return _emulated(sa, sb, layout, _block_shape_reason(m, n, k, bda, bdb), out_dtype, bias,
                         accumulate_into)

    def run_mm(dtype: torch.dtype) -> torch.Tensor:
        return cublas_fp8.gemm_blockwise(pa["data"], pa["scale_inv"], bda, pb["data"], pb["scale_inv"],
                                         bdb, out_dtype=dtype, bias=bias)
    return _finish(run_mm, out_dtype, accumulate_into)


def _block_shape_reason(m: int, n: int, k: int, bda: int, bdb: int) -> str:
    if k % cublas_fp8.BLOCK:
        return "k must be a multiple of 128"
    if n % 16:
        return "n must be a multiple of 16"
    if bda == 1 and m % 4:
        return "m must be a multiple of 4 for 1x128 scales"
    return "k/128 must be a multiple of 4 with 128x128 scales"


TENSORWISE_BACKEND = Backend("cublas_fp8_tensorwise", _supports("tensorwise"), run_tensorwise, writes_out=True)
BLOCK_BACKEND = Backend("cublas_fp8_block", _supports("block"), run_block)
register_backend(TENSORWISE_BACKEND)
register_backend(BLOCK_BACKEND)
