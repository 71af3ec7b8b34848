"""Path ``gemm_triton`` of ``grouped_gemm``: the experts' BF16-exact pairs that
``torch._grouped_mm`` cannot finish exactly — an epilogue factor (FP8 per-tensor ``scale_inv``,
NVFP4 ``S_dec``, row-scaled NVFP4's per-row scales), a bias, an FP32 / FP16 output — in one
Triton grouped GEMM with an FP32 epilogue per expert (``kernels/moe/triton_grouped_gemm.py``).

Every copy is block-decoded into BF16 (exact; ``bf16_decode``), the decoded values of all
experts are arranged as the kernel reads them (rows grouped for fprop / dgrad, reduction
grouped for wgrad), and each expert's global scales are spread over its rows / columns, so the
kernel applies ``acc * (sa[i] * sb[j]) + bias[j]`` in FP32 and rounds once: numerics §1 up to the
FP32 accumulation order, like ``bf16_tensorcore`` for one expert.

Not taken (the caller keeps its per-expert loop): pairs with a native cuBLAS FP8 kernel (FP8
per-tensor, FP8 block: FP8 tensor cores), copies that do not decode exactly into BF16, a
one-sided RHT pair, mixed bias / no-bias experts, an empty reduction in fprop / dgrad.

On CUDA the path is taken by default from the policy's ``many_experts`` experts on
(``hybridfp.config.Policy``), where the per-expert loop is host-bound, for experts whose GEMMs
are below its ``grouped_triton_max_flops`` (larger ones hide the loop's launches and run faster
per expert); for any count and size only where
its ``grouped_triton_devices`` lists the device type (default empty); the caller may force it
either way (``grouped_gemm(..., use_triton=...)``; tests
force it on the CPU, in the interpreter). Its GPU tests (``tests/kernels/test_kernels_grouped_gemm.py
-m gpu``, and the 64-expert step in ``tests/nn/test_grouped_linear_overhead_gpu.py``) pass on the
H200. Speed on the H200 (``python -m bench.bench_grouped_gemm --part bf16`` and ``python -m
bench.bench_moe``'s "[Triton grouped]" and "[per-expert GEMMs]" rows):

- the kernel alone, fprop / dgrad: the persistent TMA kernel runs the 8-expert MoE's fc1 / fc2
  on par with ``torch._grouped_mm``, the pointer kernel somewhat slower. wgrad runs the pointer
  kernel (its bounds are the routed token counts, so it usually runs with ``KALIGN`` 1);
- the Composer-2 MoE layer at 64 experts (ffn 1408): about twice as fast as with per-expert
  GEMMs; at 8 experts (ffn 14336) on par with the per-expert loop, so the policy's
  ``grouped_triton_devices`` is empty by default.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..config import current_policy
from .quantize import padded_row_index
from .grouped_tensor import JoinedCopy
from ..tensors.storage import QuantizedStorage
from ..gemm.bf16_decode import HAVE_TRITON, bf16_exact_reason, decode_bf16, decode_bf16_joined
from ..gemm.gemm import LAYOUTS
from .joined import joined_row_storage, padded_row_span

#: output dtypes the kernel writes
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def enabled(device: torch.device, use_triton: Optional[bool], experts: int = 1,
            flops: Optional[float] = None) -> bool:
    """Whether to consider this path: forced by the caller, else by the policy's
    ``grouped_triton_devices``, else on CUDA for its ``many_experts`` experts or more and, where
    ``flops`` is given, experts below its ``grouped_triton_max_flops`` (larger ones run faster
    per expert).

    Parameters:
        device: where the operands live.
        use_triton: the caller's choice (True / False wins), or None for the policy's.
        experts: the number of experts in the GEMM.
        flops: the mean FLOPs of a non-empty expert's GEMM (``moe.gemm.mean_expert_flops``),
            or None where no size limit applies.

    Returns:
        True to consider the Triton grouped GEMM (it may still decline the pairs:
        :func:`unsupported`).
    """
    if use_triton is not None:
        return use_triton
    kind, pol = torch.device(device).type, current_policy()
    if kind in pol.grouped_triton_devices:
        return HAVE_TRITON
    return (HAVE_TRITON and kind == "cuda" and experts >= pol.many_experts
            and (flops is None or flops < pol.grouped_triton_max_flops))


def unsupported(sa: Sequence[QuantizedStorage], sb: Sequence[QuantizedStorage], layout: str,
                out_dtype: torch.dtype, native_fp8: bool) -> Optional[str]:
    """Why this path cannot take the experts' pairs (None: it can)."""
    if out_dtype not in OUT_DTYPES:
        return f"output dtype {out_dtype}"
    if native_fp8 and not current_policy().grouped_triton_native_fp8:
        return "native cuBLAS FP8 kernel per expert"
    da, db = LAYOUTS[layout]
    for e, (a, b) in enumerate(zip(sa, sb)):
        why = bf16_exact_reason(a, da) or bf16_exact_reason(b, db)
        if why is not None:
            return f"expert {e}: {why}"
    return None


def _kernels():
    from ..kernels.moe import triton_grouped_gemm
    return triton_grouped_gemm


def _spread(scales: Sequence[Optional[torch.Tensor]], sizes: Sequence[int], device: torch.device
            ) -> Optional[torch.Tensor]:
    """The experts' global scales (None = 1, 0-d, or one per row) spread to ``sizes[e]`` values
    each and concatenated ([Σ sizes] FP32); None when no expert has one."""
    if all(sc is None for sc in scales):
        return None
    one = torch.ones((), dtype=torch.float32, device=device)
    parts = []
    for sc, n in zip(scales, sizes):
        sc = one if sc is None else sc.to(torch.float32)
        parts.append(sc.expand(n) if sc.dim() == 0 else sc)
    return torch.cat(parts)


def joined_bias(biases: Optional[Sequence[Optional[torch.Tensor]]], n: int, device: torch.device
          ) -> tuple[bool, Optional[torch.Tensor]]:
    """(usable, [E, n] FP32 bias or None): every expert has a bias, or none has."""
    if biases is None or all(b is None for b in biases):
        return True, None
    if any(b is None for b in biases):
        return False, None  # adding 0.0 for a missing bias would turn -0.0 into +0.0
    return True, torch.stack([b.to(device=device, dtype=torch.float32) for b in biases]).reshape(len(biases), n)


def run(sa: Sequence[QuantizedStorage], sb: Sequence[QuantizedStorage], layout: str, out_dtype: torch.dtype,
        biases: Optional[Sequence[Optional[torch.Tensor]]] = None, ja: Optional[JoinedCopy] = None,
        jb: Optional[JoinedCopy] = None) -> Optional[torch.Tensor]:
    """The experts' GEMMs in one kernel, or None when a decoded pair turns out unsuitable (a
    one-sided RHT, stored lengths that differ, mixed biases, an empty fprop / dgrad reduction).
    ``ja`` / ``jb``: the operands' joined copies, if their ``GroupedTensor`` holds them."""
    da, db = LAYOUTS[layout]
    device = sa[0].device
    if layout == "NT":
        return _run_reduction(sa, sb, da, db, out_dtype, device)
    weights = _weights_operand(sb, db, jb)  # B of fprop / dgrad: the weights
    if weights is None:
        return None
    mat_b, scales_b, rhts_b = weights
    _, n, k = mat_b.shape
    usable, bias = joined_bias(biases, n, device)
    rows = _rows_operand(sa, da, device, ja)
    if not usable or rows is None or k == 0:
        return None
    mat_a, scale_a, rhts = rows
    if mat_a.shape[1] != k or any(r != rb for r, rb in zip(rhts, rhts_b)):
        return None
    scale_b = _spread(scales_b, [n] * len(sb), device)
    return _kernels().grouped_rows(
        mat_a, mat_b, [s.rows for s in sa], out_dtype=out_dtype,
        bias=bias, scale_a=scale_a, scale_b=None if scale_b is None else scale_b.reshape(len(sb), n))


def _weights_operand(sb: Sequence[QuantizedStorage], db: str, jb: Optional[JoinedCopy]
                     ) -> Optional[tuple[torch.Tensor, list[Optional[torch.Tensor]], list[bool]]]:
    """(B [E, n, k] BF16, each expert's epilogue scale, each expert's RHT flag). The experts'
    joined weights (``jb``: back-to-back rows of one encoding, row-scaled where each expert has
    its own global scale) are decoded in one call, cached while unchanged, and viewed [E, n, k]
    (each expert's scale its own part's); otherwise each expert's copy is decoded (cached) and
    stacked. None if their decoded shapes differ."""
    joined = joined_row_storage(jb, db, [b.part(db).rows for b in sb], single_rows=False)
    if joined is not None:
        whole = decode_bf16_joined(joined, sb, db, cache=True)
        values = whole.values.contiguous()  # the decoders write contiguous tensors: no copy
        scales = [b.part(db).epilogue_scale(db) for b in sb]  # each expert's own, not the first's
        return values.view(len(sb), values.shape[0] // len(sb), values.shape[1]), scales, [whole.rht] * len(sb)
    ops = [decode_bf16(b, db, cache=True) for b in sb]
    if len({tuple(op.values.shape) for op in ops}) > 1:
        return None
    return torch.stack([op.values for op in ops]), [op.scale for op in ops], [op.rht for op in ops]


def _rows_operand(sa: Sequence[QuantizedStorage], da: str, device: torch.device, ja: Optional[JoinedCopy]
                  ) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor], list[bool]]]:
    """(A [Σm_e, k] BF16, its scales per row [Σm_e] FP32 or None, each expert's RHT flag): one
    decode when ``ja`` holds the experts' rows joined (back to back, or at padded group starts),
    else per expert and concatenated; None if the experts' stored lengths differ."""
    joined = joined_row_storage(ja, da, [a.part(da).rows for a in sa])
    if joined is not None:
        whole = decode_bf16(joined, da)
        return whole.values, _spread([whole.scale], [whole.values.shape[0]], device), [whole.rht] * len(sa)
    span = padded_row_span(ja, da)
    if span is not None:
        gathered = _gathered_rows(span[0], da, span[1], [s.rows for s in sa], device)
        return None if gathered is None else (*gathered[:2], [gathered[2]] * len(sa))
    ops = [decode_bf16(a, da) for a in sa]
    if len({op.values.shape[1] for op in ops}) > 1:
        return None
    sizes = [op.values.shape[0] for op in ops]
    return torch.cat([op.values for op in ops]), _spread([op.scale for op in ops], sizes, device), [op.rht for op in ops]



def _gathered_rows(storage: QuantizedStorage, direction: str, starts: Optional[Sequence[int]],
                   sizes: Sequence[int], device: torch.device
                   ) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor], bool]]:
    """(the experts' rows [Σ sizes, k] BF16, their scales per row FP32 or None, the RHT flag)
    from one decode of ``storage`` — rows spanning the experts', expert e's group from row
    ``starts[e]`` (a padded encode read at the groups' padded starts; None: consecutive) — and
    one gather of the experts' own rows. None where a per-tensor factor would be one expert's
    only."""
    whole = decode_bf16(storage, direction)
    if whole.scale is not None and whole.scale.dim() != 1:
        return None
    values, scale = whole.values, None if whole.scale is None else whole.scale.to(torch.float32)
    if starts is not None:
        index = padded_row_index(sizes, starts, device)  # each expert's rows in the span
        values = values.index_select(0, index)
        scale = None if scale is None else scale.index_select(0, index)
    return values, scale, whole.rht


def _run_reduction(sa: Sequence[QuantizedStorage], sb: Sequence[QuantizedStorage], da: str, db: str,
                   out_dtype: torch.dtype, device: torch.device) -> Optional[torch.Tensor]:
    """wgrad: A_e [m, k_e], B_e [n, k_e] joined along the reduction; [E, m, n] out."""
    ops_a = [decode_bf16(a, da) for a in sa]
    ops_b = [decode_bf16(b, db) for b in sb]
    if any(oa.rht != ob.rht or oa.values.shape[1] != ob.values.shape[1] for oa, ob in zip(ops_a, ops_b)):
        return None
    m, n = ops_a[0].values.shape[0], ops_b[0].values.shape[0]
    splits = [op.values.shape[1] for op in ops_a]
    mat_a = torch.cat([op.values for op in ops_a], dim=1)
    mat_b = torch.cat([op.values for op in ops_b], dim=1)
    scale_a = _spread([op.scale for op in ops_a], [m] * len(sa), device)
    scale_b = _spread([op.scale for op in ops_b], [n] * len(sb), device)
    out = _kernels().grouped_reduction(
        mat_a, mat_b, splits, out_dtype=out_dtype,
        scale_a=None if scale_a is None else scale_a.reshape(len(sa), m),
        scale_b=None if scale_b is None else scale_b.reshape(len(sb), n))
    return out


def run_joined(ja: JoinedCopy, jb: JoinedCopy, splits_a: Sequence[int], splits_b: Sequence[int], layout: str,
               out_dtype: torch.dtype, biases: Optional[Sequence[Optional[torch.Tensor]]] = None
               ) -> Optional[torch.Tensor]:
    """fprop on two ``GroupedTensor``' joined rowwise copies (x's, its groups at ``ja.starts``
    if padded; the joined weights', N rows per expert), computing what :func:`run` computes on
    the experts' views without building them: x's span decoded once and its experts' rows
    gathered, the weights decoded once (cached while unchanged) with their per-row epilogue
    scales (a row-scaled joined copy holds each expert's global scale on its rows). None where
    the copies do not pair up (dgrad / wgrad, uneven weights, a one-sided RHT)."""
    if layout != "TN" or len(set(splits_b)) != 1 or ja.scales is not None or jb.scales is not None:
        return None
    experts, n = len(splits_a), splits_b[0]
    if jb.starts is not None and jb.starts != [e * n for e in range(experts)]:
        return None  # padding between the experts' weights: not one [E, n, k] operand
    device = ja.storage.device
    rows = _gathered_rows(ja.storage, "rowwise", ja.starts, splits_a, device)
    whole_b = decode_bf16(jb.storage, "rowwise", cache=True)
    if whole_b.scale is not None and whole_b.scale.dim() != 1:
        return None  # a per-tensor factor would be one expert's only
    if rows is None or rows[2] != whole_b.rht or rows[0].shape[1] != whole_b.values.shape[1] or n == 0:
        return None
    usable, bias = joined_bias(biases, n, device)
    if not usable:
        return None
    mat_b = whole_b.values.contiguous()
    scale_b = None if whole_b.scale is None else whole_b.scale.to(torch.float32).reshape(experts, n)
    return _kernels().grouped_rows(rows[0], mat_b.view(experts, n, mat_b.shape[1]), list(splits_a),
                                   out_dtype=out_dtype, bias=bias, scale_a=rows[1], scale_b=scale_b)
