"""``grouped_gemm``: the per-expert GEMMs of one layout, in one grouped kernel call when exact.

An MoE layer runs, per expert e, the three GEMMs of a linear (``gemm.py``'s layouts) on its
own operands, quantized with its own scales. Written on stored copies (``A_s[m, k] · B_s[n, k]ᵀ``):

| layout | GEMM  | per expert                          | grouped form (``torch._grouped_mm``)          |
|--------|-------|-------------------------------------|-----------------------------------------------|
| "TN"   | fprop | y_e [m_e, N]  = x_e W_eᵀ             | 2D × 3D: [Σm_e, K] · [E, K, N] → [Σm_e, N]     |
| "NN"   | dgrad | dx_e [m_e, K] = dy_e W_e             | 2D × 3D: [Σm_e, N] · [E, N, K] → [Σm_e, K]     |
| "NT"   | wgrad | dW_e [N, K]   = dy_eᵀ x_e            | 2D × 2D, groups along the reduction → [E, N, K]|

Paths, first that applies (``grouped_path`` says which and why):

1. ``gemm_bf16`` — every expert's pair block-decodes exactly into BF16
   (``bf16_decode.bf16_exact_reason`` is None for both copies) AND has no epilogue factor
   (MXFP8, power-of-two FP8 block, BF16; no per-tensor ``scale_inv`` or NVFP4 ``S_dec``), the
   output is BF16 and there is no bias: decode with ``decode_bf16``, one ``torch_grouped_mm``
   (CUTLASS's ``torch._grouped_mm``, or cuBLAS per expert for few large experts:
   ``per_group_wins``; BF16 tensor cores, FP32 accumulation, one rounding to BF16 — numerics §1
   exactly). Epilogue
   factors are excluded because ``torch._grouped_mm`` writes only its input dtype (BF16; torch
   2.11-2.13 reject ``out_dtype=float32`` for BF16 inputs), so a factor applied afterwards would
   round twice. Likewise an FP32 output (FP32 parameters' wgrad) or a bias (added in FP32
   before the one rounding) keeps a GEMM on the per-expert path. Pairs with a native cuBLAS
   FP8 kernel (FP8 block) stay on it: FP8 tensor cores beat decode + BF16.
2. ``grouped_fp8_rowwise`` — fprop/dgrad (2D × 3D) of E4M3 × E4M3 per-tensor FP8 pairs on
   sm90 with a BF16 output and no bias, unless the experts are large
   (``per_expert_fp8_faster``: cuBLAS per expert then runs faster than the grouped CUTLASS
   kernel): one ``torch._scaled_grouped_mm`` with per-row scale
   vectors built from the experts' ``scale_inv`` (epilogue: FP32 accumulator × scale_a[m] ×
   scale_b[e, n], one rounding). Accumulation is the FP8 MMA's with periodic FP32 promotion
   (numerics §1's documented Hopper exception), bounded in tests/gemm/test_gemm_grouped.py.
   Fast accumulation stays off even for fprop: on an H200 (torch 2.11, 4 x [2048, 4096] x
   [1408, 4096]) it adds 4.6e-4 to the BF16 result's relative error (27% of the elements off
   the correctly rounded value) against 4.9e-6 without it.
2b. ``grouped_fp8_triton`` — per-tensor FP8 pairs that path 2 does not take (E5M2 gradients in
   dgrad, every wgrad; any E4M3 / E5M2 mix, any output dtype, a bias) while the experts are
   small (``per_expert_fp8_faster`` says no), on CUDA from the policy's ``many_experts``
   experts on or when forced: one Triton FP8 grouped GEMM (``gemm_fp8.py``), the FP8 MMA
   with FP32 promotion every 128 products as path 2 and cuBLAS (numerics §1's exception).
3. ``gemm_triton`` — BF16-exact pairs that paths 1-2 cannot finish exactly (an epilogue
   factor, a bias, an FP32 / FP16 output): one Triton grouped GEMM with a per-expert FP32
   epilogue (``gemm_triton.py``). Used on CUDA from the policy's ``many_experts`` experts
   on (the per-expert loop is host-bound there) for experts below its
   ``grouped_triton_max_flops`` (larger ones hide the loop's launches), for any count where its
   ``grouped_triton_devices`` lists the device type, or when the caller forces it.
4. ``per_expert`` — everything else: ``gemm()`` per expert (its backend per pair, or the
   exact emulation with its report). Always on the CPU.

The grouped matmul of path 1 is a parameter (``grouped_mm``): tests pass
:func:`reference_grouped_mm`, an exact FP32 emulation with ``torch._grouped_mm``'s semantics,
to run the decode / grouping / padding logic of the CUDA path on the CPU.
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache
from itertools import accumulate
from typing import Callable, Optional, Sequence, Union

import torch

from ..config import current_policy
from ..utils.device import device_tensor
from .grouped_tensor import GroupedTensor, JoinedCopy
from .joined import joined_of, joined_row_storage
from ..tensors.storage import GemmOperand, QuantizedStorage
from ..gemm import fast
from ..gemm.backends import emulate, report_emulated, select
from ..gemm.bf16_decode import bf16_exact_reason
from ..gemm.gemm import GEMM_OF_LAYOUT, LAYOUTS, gemm, operand_storage
from . import gemm_fp8
from . import gemm_triton
from .gemm_bf16 import BF16_ALIGN, GroupedMM, offsets, per_group_mm, run_bf16
from .gemm_joined import run_joined

GROUPED_BF16, GROUPED_FP8_ROWWISE, PER_EXPERT = "grouped_bf16", "grouped_fp8_rowwise", "per_expert"
GROUPED_TRITON = "grouped_triton"
GROUPED_FP8_TRITON = gemm_fp8.GROUPED_FP8_TRITON
#: (GEMM, path) -> calls: which path each grouped GEMM took, counted over the process (all
#: threads) for benchmarks and tests. A diagnostic the library only ever adds to, never reads
#: (no behaviour depends on it); read differences (``Counter(PATH_COUNTS) - before``).
PATH_COUNTS: Counter = Counter()
#: TMA needs 16-byte aligned strides and group starts: 16 FP8 elements (BF16: grouped_bf16).
_FP8_ALIGN = 16
#: CUTLASS grouped kernels in torch take fewer than 1024 groups.
_MAX_GROUPS = 1023
_NATIVE_FP8 = (fast.TENSORWISE_BACKEND, fast.BLOCK_BACKEND)




def per_group_wins(sizes: Sequence[int]) -> bool:
    """Whether cuBLAS per group beats CUTLASS's grouped kernel for groups of ``sizes``: few large
    groups: at most the policy's ``per_group_max_groups`` (each is a launch and host work, which a
    many-expert MoE step cannot afford) of at least ``per_group_min_mean`` rows (or reduction
    columns) on average. On the H200 (the MoE's fc1 / fc2 fprop, dgrad and wgrad over 32768
    routed rows, even and uneven splits), cuBLAS per expert is faster than CUTLASS in every GEMM
    at 8 experts of 4096 rows and mostly at 16 of 2048, about even at 32 of 1024, and clearly
    slower at 64 of 512; the 8-expert MXFP8 and Composer-2 MoE steps run faster with it
    (``python -m bench.bench_moe``'s "[cuBLAS per expert BF16]" and "[CUTLASS grouped BF16]"
    rows)."""
    pol = current_policy()
    return 0 < len(sizes) <= pol.per_group_max_groups and sum(sizes) >= pol.per_group_min_mean * len(sizes)


def torch_grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """The CUDA grouped matmul of path 1 (BF16 in, FP32 accumulation, BF16 out): cuBLAS per group
    (``gemm_bf16.per_group_mm``) or ``torch._grouped_mm`` over the groups of ``sizes``, as
    the policy's ``bf16_per_group_cublas`` says (None: :func:`per_group_wins`). Both compute each output
    from one FP32 accumulator rounded once (numerics §1). Operands recording autograd take
    ``torch._grouped_mm`` (``per_group_mm`` writes into slices of one result: no autograd)."""
    use = current_policy().bf16_per_group_cublas
    if use is None:
        use = per_group_wins(sizes) and not (
            torch.is_grad_enabled() and (mat_a.requires_grad or mat_b.requires_grad))
    if use:
        return per_group_mm(mat_a, mat_b, sizes)
    return torch._grouped_mm(mat_a, mat_b, offs=offsets(sizes, mat_a.device))


def reference_grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """``torch._grouped_mm``'s result computed exactly (FP32 products and accumulation per group,
    one rounding to ``mat_a``'s dtype), by the exact emulation ``gemm`` uses; runs anywhere.

    2D × 3D: group g's ``sizes[g]`` rows of ``mat_a`` times ``mat_b[g]``; 2D × 2D: group g's
    columns of ``mat_a`` / rows of ``mat_b``, result [G, m, n] (zeros for an empty group).
    Operands go to :func:`emulate` as [m, k] and [n, k] row-major FP32, as ``gemm`` hands it
    block-decoded copies, so equal values give bitwise-equal results on one device.
    """
    ends = list(accumulate(int(s) for s in sizes))
    starts = [0] + ends[:-1]
    if mat_b.dim() == 3:
        parts = [_emulate_bf16(mat_a[s:e], mat_b[g].t()) for g, (s, e) in enumerate(zip(starts, ends))]
        return torch.cat(parts) if parts else mat_a.new_zeros(0, mat_b.shape[-1])
    return torch.stack([_emulate_bf16(mat_a[:, s:e], mat_b[s:e].t()) for s, e in zip(starts, ends)])


def _emulate_bf16(a: torch.Tensor, b_nk: torch.Tensor) -> torch.Tensor:
    a32, b32 = a.float().contiguous(), b_nk.float().contiguous()
    return emulate(GemmOperand(a32, None, a32.shape[1]), GemmOperand(b32, None, b32.shape[1]), a.dtype)


def grouped_gemm(A: Sequence[torch.Tensor], B: Sequence[torch.Tensor], layout: str = "TN", *,
                 out_dtype: torch.dtype = torch.bfloat16,
                 biases: Optional[Sequence[Optional[torch.Tensor]]] = None,
                 grouped_mm: Optional[GroupedMM] = None,
                 use_triton: Optional[bool] = None) -> Union[torch.Tensor, list[torch.Tensor]]:
    """The GEMM ``layout`` selects (``gemm``'s table) for every expert e on ``A[e]``, ``B[e]``.

    Returns, for "TN" / "NN", one [Σ m_e, n] tensor (the experts' results joined by rows, in
    order; an expert with m_e = 0 contributes no rows); for "NT", a list of the experts' [n, k]
    results (views of one [E, n, k] tensor on the grouped paths). ``biases`` (fprop only): one
    [n] bias or None per expert. ``grouped_mm``: the grouped BF16 matmul of path 1 (default
    ``torch_grouped_mm`` on CUDA devices that have ``torch._grouped_mm``); passing one forces
    path 1 wherever the operands allow it, the CPU included (tests). ``use_triton``: take (True) or never take
    (False) the Triton grouped path where paths 1-2 do not apply; None: as
    ``gemm_triton.enabled`` decides (CUDA from the policy's ``many_experts`` experts on).

    Raises:
        ValueError: an unknown layout, operand counts that differ (or none), biases outside
            fprop or not one per expert, or experts' shapes that do not pair up.
    """
    out = _grouped_gemm(A, B, layout, out_dtype, biases, grouped_mm, use_triton)
    return list(out.unbind(0)) if layout == "NT" and isinstance(out, torch.Tensor) else out


def grouped_wgrad(A: Sequence[torch.Tensor], B: Sequence[torch.Tensor], *,
                  out_dtype: torch.dtype = torch.bfloat16, grouped_mm: Optional[GroupedMM] = None,
                  use_triton: Optional[bool] = None) -> Union[torch.Tensor, list[torch.Tensor]]:
    """``grouped_gemm(A, B, "NT", ...)`` as the path wrote it: one [E, n, k] tensor on the
    grouped paths (the experts' results are its [n, k] slices), a list of separate [n, k]
    tensors on the per-expert path. Lets a caller that wants one [E, n, k] gradient use the
    grouped result as it is instead of stacking the experts' results again.

    Parameters and Raises: as ``grouped_gemm``'s (no biases: wgrad takes none)."""
    return _grouped_gemm(A, B, "NT", out_dtype, None, grouped_mm, use_triton)


def _grouped_gemm(A: Sequence[torch.Tensor], B: Sequence[torch.Tensor], layout: str, out_dtype: torch.dtype,
                  biases: Optional[Sequence[Optional[torch.Tensor]]], grouped_mm: Optional[GroupedMM],
                  use_triton: Optional[bool]) -> Union[torch.Tensor, list[torch.Tensor]]:
    """``grouped_gemm``'s work; "NT" results as ``grouped_wgrad`` describes them."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is unknown; use 'TN' (fprop), 'NN' (dgrad) or 'NT' (wgrad).")
    if len(A) != len(B) or not A:
        raise ValueError(f"grouped_gemm needs one A and one B operand per expert (at least one); got "
                         f"{len(A)} A and {len(B)} B operands.")
    if biases is not None and (layout != "TN" or len(biases) != len(A)):
        raise ValueError("grouped_gemm biases are for fprop ('TN') only, one (or None) per expert; got "
                         f"{len(biases)} for {len(A)} experts with layout {layout!r}.")
    has_bias = biases is not None and any(b is not None for b in biases)
    joined = _run_joined(A, B, layout, out_dtype, has_bias, grouped_mm, biases, use_triton)
    if joined is not None:
        PATH_COUNTS[(GEMM_OF_LAYOUT[layout], joined[1])] += 1
        return joined[0]
    da, db = LAYOUTS[layout]
    sa = [operand_storage(a, da, f"A[{e}]") for e, a in enumerate(A)]
    sb = [operand_storage(b, db, f"B[{e}]") for e, b in enumerate(B)]
    ms = _check_shapes(sa, sb, layout)  # the experts' m, read once for every use below
    path, _ = grouped_path(sa, sb, layout, out_dtype, has_bias, forced=grouped_mm is not None,
                           use_triton=use_triton, ms=ms)
    # the experts' copies a GroupedTensor holds joined, as its producer states them
    ja, jb = joined_of(A, da), joined_of(B, db)
    out: Optional[Union[torch.Tensor, list[torch.Tensor]]] = None
    if path == GROUPED_BF16:
        out = run_bf16(sa, sb, layout, grouped_mm or torch_grouped_mm, ms, ja, jb)
    elif path == GROUPED_FP8_ROWWISE:
        out = _run_fp8_rowwise(sa, sb, layout, ja, jb)
    elif path == GROUPED_TRITON:
        out = gemm_triton.run(sa, sb, layout, out_dtype, biases, ja, jb)
    elif path == GROUPED_FP8_TRITON:
        out = gemm_fp8.run(sa, sb, layout, out_dtype, biases)
    if out is None:  # per expert (also when a copy turned out to carry an epilogue factor)
        path = PER_EXPERT
        out = _run_per_expert(A, B, layout, out_dtype, biases, sa, sb, ms, ja, jb)
    PATH_COUNTS[(GEMM_OF_LAYOUT[layout], path)] += 1
    return out


def _run_joined(A: Sequence[torch.Tensor], B: Sequence[torch.Tensor], layout: str, out_dtype: torch.dtype,
                has_bias: bool, grouped_mm: Optional[GroupedMM],
                biases: Optional[Sequence[Optional[torch.Tensor]]] = None, use_triton: Optional[bool] = None
                ) -> Optional[tuple[Union[torch.Tensor, list[torch.Tensor]], str]]:
    """(result, path) straight on two ``GroupedTensor``' joined copies: path 1
    (``gemm_joined.py``) when ``_torch_path``'s rules give it for them, decided once on the
    joined storages (one format per operand, so one answer for every expert); FP8 per-expert
    scaled copies on the Triton FP8 grouped GEMM (``gemm_fp8.run_joined``) when
    ``_fp8_joined_path`` takes them; an fprop with an epilogue factor on the Triton grouped
    GEMM (``gemm_triton.run_joined``) where ``grouped_path`` would take it. None: the
    per-expert code decides."""
    if (not (isinstance(A, GroupedTensor) and isinstance(B, GroupedTensor)) or len(A) != len(B)
            or not (A.joined_only and B.joined_only)):
        return None
    da, db = LAYOUTS[layout]
    ja, jb = A.joined(da), B.joined(db)
    if ja is None or jb is None or len(A) > _MAX_GROUPS:
        return None
    if ja.scales is not None or jb.scales is not None:
        if ja.scales is None or jb.scales is None or not _fp8_joined_path(A, B, ja, jb, layout, out_dtype, use_triton):
            return None
        out = gemm_fp8.run_joined(ja, jb, A.splits, B.splits, layout, out_dtype, biases)
        return None if out is None else (out, GROUPED_FP8_TRITON)
    # the same rules on the two joined storages as on the experts' (one format per operand);
    # run_joined checks the experts' own dims
    path, _ = _torch_path([ja.storage.part(da)], [jb.storage.part(db)], layout, out_dtype, has_bias,
                          grouped_mm is not None)
    if path == GROUPED_BF16:
        out = run_joined(ja, jb, A.splits, B.splits, layout, grouped_mm or torch_grouped_mm)
        return None if out is None else (out, GROUPED_BF16)
    if (path == PER_EXPERT and layout == "TN"
            and gemm_triton.enabled(ja.storage.device, use_triton, len(A),
                                    mean_expert_flops(A.splits, *_joined_fixed_dims(B, ja, jb, layout)))
            and gemm_triton.unsupported([ja.storage], [jb.storage], layout, out_dtype, False) is None):
        # an epilogue factor / bias / FP32 output on joined rows (Composer-2's fprop): the Triton
        # grouped GEMM straight on them, as grouped_path would choose for the experts' views
        out = gemm_triton.run_joined(ja, jb, A.splits, B.splits, layout, out_dtype, biases)
        return None if out is None else (out, GROUPED_TRITON)
    return None


def _fp8_joined_path(A: GroupedTensor, B: GroupedTensor, ja: JoinedCopy, jb: JoinedCopy, layout: str,
                     out_dtype: torch.dtype, use_triton: Optional[bool]) -> bool:
    """Whether FP8 joined copies take the Triton FP8 grouped GEMM for this GEMM — all three
    GEMMs, fprop included (the joined lane builds nothing per expert): the Triton paths on
    (``gemm_triton.enabled``), small experts (``per_expert_fp8_faster`` says no: large ones
    run faster on cuBLAS per expert, the experts cut out of the joined copies) and FP8 tensor
    cores where verified (``gemm_fp8.unsupported``)."""
    if not gemm_triton.enabled(ja.storage.device, use_triton, len(A)):
        return False
    # the same crossovers as the experts' lists (``_fp8_path``): the same Triton kernel competes
    if per_expert_fp8_faster(A.splits, *_joined_fixed_dims(B, ja, jb, layout), triton=layout != "NT"):
        return False
    return gemm_fp8.unsupported([ja.storage], layout, out_dtype) is None


def _joined_fixed_dims(B: GroupedTensor, ja: JoinedCopy, jb: JoinedCopy, layout: str) -> tuple[int, int]:
    """The dims every expert shares on joined copies (A's splits are the varying dim): NT
    (m, n); TN (n, k), n the weights' rows; NN (n, k)."""
    return {"NT": (ja.storage.cols, jb.storage.cols), "TN": (B.splits[0], ja.storage.cols),
            "NN": (jb.storage.cols, ja.storage.cols)}[layout]


def grouped_path(sa: Sequence[QuantizedStorage], sb: Sequence[QuantizedStorage], layout: str,
                 out_dtype: torch.dtype, has_bias: bool, forced: bool = False,
                 use_triton: Optional[bool] = None, ms: Optional[Sequence[int]] = None) -> tuple[str, str]:
    """(path, why) for these single-format storages (see the module docstring). Paths 1-2 are
    chosen on formats; where neither applies, the Triton grouped path if enabled and able.
    ``ms``: the experts' m (``_check_shapes``'s result) if known."""
    path, why = _torch_path(sa, sb, layout, out_dtype, has_bias, forced, ms)
    triton_on = gemm_triton.enabled(sa[0].device, use_triton, len(sa))
    if triton_on and path in (PER_EXPERT, GROUPED_FP8_ROWWISE) and gemm_fp8.per_tensor_fp8(sa, sb, layout):
        return _fp8_path(sa, sb, layout, out_dtype, path, why, ms)
    if path != PER_EXPERT or not triton_on:
        return path, why
    # the size limit is measured for fprop; dgrad and wgrad keep the expert-count rule
    flops = mean_expert_flops(_varying(sa, sb, layout, ms), *_fixed_dims(sa, sb, layout)) if layout == "TN" else None
    if not gemm_triton.enabled(sa[0].device, use_triton, len(sa), flops):
        return PER_EXPERT, f"{why}; experts large enough for the per-expert loop ({flops:.3g} FLOPs each)"
    da, db = LAYOUTS[layout]
    keys = {(a.format_key(da), b.format_key(db)) for a, b in zip(sa, sb)}
    native = any(select(ka, kb, layout, sa[0].device) in _NATIVE_FP8 for ka, kb in keys)
    why_not = gemm_triton.unsupported(sa, sb, layout, out_dtype, native)
    if why_not is not None:
        return PER_EXPERT, f"{why}; Triton grouped path: {why_not}"
    return GROUPED_TRITON, f"Triton grouped GEMM, FP32 epilogue (torch's grouped paths: {why})"


def _fp8_path(sa: Sequence[QuantizedStorage], sb: Sequence[QuantizedStorage], layout: str,
              out_dtype: torch.dtype, path: str, why: str, ms: Optional[Sequence[int]]) -> tuple[str, str]:
    """Per-tensor FP8 experts with the Triton paths on: the Triton FP8 grouped GEMM
    (``gemm_fp8.py``) unless path 2 takes them (kept unless the policy's
    ``over_scaled_grouped_mm``),
    the experts are big enough for cuBLAS per expert, or the GPU is not one it is verified on."""
    if path == GROUPED_FP8_ROWWISE and not current_policy().over_scaled_grouped_mm:
        return path, why
    n, k = _fixed_dims(sa, sb, layout)
    sizes = _varying(sa, sb, layout, ms)
    # fprop / dgrad against the Triton kernel have their own, measured crossover; wgrad keeps
    # the general one (its varying dim is the reduction)
    if per_expert_fp8_faster(sizes, n, k, triton=layout != "NT"):
        return PER_EXPERT, "experts large enough for cuBLAS's per-expert FP8 kernels (faster than a grouped one)"
    why_not = gemm_fp8.unsupported(sa, layout, out_dtype)
    if why_not is not None:
        return PER_EXPERT, f"{why}; Triton FP8 grouped path: {why_not}"
    return GROUPED_FP8_TRITON, f"Triton FP8 grouped GEMM (torch's grouped paths: {why})"


def _torch_path(sa: Sequence[QuantizedStorage], sb: Sequence[QuantizedStorage], layout: str,
                out_dtype: torch.dtype, has_bias: bool, forced: bool,
                ms: Optional[Sequence[int]] = None) -> tuple[str, str]:
    """Path 1 (``torch._grouped_mm``), path 2 (``torch._scaled_grouped_mm``) or per expert."""
    da, db = LAYOUTS[layout]
    device = sa[0].device
    if out_dtype != torch.bfloat16:
        return PER_EXPERT, f"output dtype {out_dtype} (grouped kernels write BF16 only)"
    if has_bias:
        return PER_EXPERT, "a bias is added in FP32 before the one rounding; grouped kernels take none"
    if len(sa) > _MAX_GROUPS:
        return PER_EXPERT, f"more than {_MAX_GROUPS} experts"
    keys = {(a.format_key(da), b.format_key(db)) for a, b in zip(sa, sb)}
    backends = [select(ka, kb, layout, device) for ka, kb in keys]  # once per distinct pair
    if layout != "NT" and all(b is fast.TENSORWISE_BACKEND for b in backends):
        why = _fp8_rowwise_unsupported(sa, sb, layout, device)
        if why is None and per_expert_fp8_faster(_ms(sa, sb, layout, ms), *_fixed_dims(sa, sb, layout)):
            why = "experts large enough for cuBLAS's per-expert FP8 kernels (faster than the grouped one)"
        return (PER_EXPERT, why) if why else (GROUPED_FP8_ROWWISE, "E4M3 per-tensor pairs")
    if any(b in _NATIVE_FP8 for b in backends):
        return PER_EXPERT, "native cuBLAS FP8 kernel per expert"
    if not (forced or _grouped_mm_device(device)):
        return PER_EXPERT, f"no grouped BF16 kernel on {device}"
    for e, (a, b) in enumerate(zip(sa, sb)):
        why = bf16_exact_reason(a, da) or bf16_exact_reason(b, db)
        if why is not None:
            return PER_EXPERT, f"expert {e}: {why}"
        if a.part(da).has_epilogue_scale(da) or b.part(db).has_epilogue_scale(db):
            # decided before decoding: finding the factor after decoding every expert would
            # decode them all a second time on the per-expert path
            return PER_EXPERT, f"expert {e}: a global scale goes to an FP32 epilogue"
    n, k = _fixed_dims(sa, sb, layout)
    if n % BF16_ALIGN or k % BF16_ALIGN:
        return PER_EXPERT, f"grouped dims {n}, {k} not multiples of {BF16_ALIGN} (TMA alignment)"
    return GROUPED_BF16, "BF16-exact pairs"


def per_expert_fp8_faster(ms: Sequence[int], n: int, k: int, triton: bool = False) -> bool:
    """Whether per-tensor FP8 experts are big enough that per-expert cuBLAS FP8 GEMMs beat the
    grouped kernel: a mean GEMM size (:func:`mean_expert_flops`) of at least the policy's
    ``per_expert_fp8_flops``, or its ``per_expert_fp8_triton_flops`` where the grouped kernel is
    the Triton FP8 one. Where the thresholds come from: their docstrings in ``hybridfp.config``.

    Parameters:
        ms: each expert's varying dim: its rows (fprop / dgrad: [m_e, k] x [k, n]) or its
            reduction (wgrad); empty experts (0) are not averaged in.
        n, k: the dims every expert shares.
        triton: compare against the Triton FP8 grouped GEMM (fprop / dgrad) instead of
            ``torch._scaled_grouped_mm`` or the wgrad kernel.

    Returns:
        True for cuBLAS per expert; False (also when every expert is empty) for the grouped kernel.
    """
    pol = current_policy()
    threshold = pol.per_expert_fp8_triton_flops if triton else pol.per_expert_fp8_flops
    return any(ms) and mean_expert_flops(ms, n, k) >= threshold


def mean_expert_flops(ms: Sequence[int], n: int, k: int) -> float:
    """The mean FLOPs (2 m n k) of a non-empty expert's GEMM: the size the policy's per-expert
    thresholds compare.

    Parameters:
        ms: each expert's varying dim (rows, or the reduction in wgrad); 0 for an empty expert.
        n, k: the dims every expert shares.

    Returns:
        2 · mean(non-zero ``ms``) · n · k; 0.0 when every expert is empty.
    """
    filled = [m for m in ms if m]
    return 2.0 * sum(filled) * n * k / len(filled) if filled else 0.0


@lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _grouped_mm_device(device: torch.device) -> bool:
    """torch's CUTLASS grouped kernels: sm90 / sm100 (others take a slow per-group fallback)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and _capability(device)[0] in (9, 10)


def _check_shapes(sa: list[QuantizedStorage], sb: list[QuantizedStorage], layout: str) -> list[int]:
    """Per expert, the reduction lengths agree; across experts, the dims that do not vary agree.
    Returns the experts' m."""
    dims = [_dims(a, b, layout) for a, b in zip(sa, sb)]
    for e, (m, n, ka, kb) in enumerate(dims):
        if ka != kb:
            raise ValueError(f"grouped_gemm {layout} ({GEMM_OF_LAYOUT[layout]}), expert {e}: reduction "
                             f"lengths differ ({ka} vs {kb}; {sa[e].describe()}, {sb[e].describe()}).")
    fixed = {(n, k) if layout != "NT" else (m, n) for m, n, k, _ in dims}
    if len(fixed) > 1:
        what = "output width and reduction length" if layout != "NT" else "output shape"
        raise ValueError(f"grouped_gemm {layout} ({GEMM_OF_LAYOUT[layout]}): the experts' {what} "
                         f"differ ({sorted(fixed)}); every expert must have the same weight shape.")
    return [d[0] for d in dims]


def _ms(sa: Sequence[QuantizedStorage], sb: Sequence[QuantizedStorage], layout: str,
        ms: Optional[Sequence[int]]) -> list[int]:
    """The experts' m: ``ms`` if given, else read from the storages."""
    return list(ms) if ms is not None else [_dims(a, b, layout)[0] for a, b in zip(sa, sb)]


def _varying(sa: Sequence[QuantizedStorage], sb: Sequence[QuantizedStorage], layout: str,
             ms: Optional[Sequence[int]]) -> list[int]:
    """The experts' varying dim: their m (fprop / dgrad) or their reduction (wgrad: token
    counts); with :func:`_fixed_dims` the three dims of each expert's GEMM."""
    return [_dims(a, b, layout)[2] for a, b in zip(sa, sb)] if layout == "NT" else _ms(sa, sb, layout, ms)


def _dims(a: QuantizedStorage, b: QuantizedStorage, layout: str) -> tuple[int, int, int, int]:
    """(m, n, k of A, k of B) of one expert's GEMM on the stored copies."""
    da, db = LAYOUTS[layout]
    m, ka = (a.rows, a.cols) if da == "rowwise" else (a.cols, a.rows)
    n, kb = (b.rows, b.cols) if db == "rowwise" else (b.cols, b.rows)
    return m, n, ka, kb


def _fixed_dims(sa: Sequence[QuantizedStorage], sb: Sequence[QuantizedStorage], layout: str) -> tuple[int, int]:
    """The two dims that every expert shares: (n, k) for TN/NN, (m, n) for NT."""
    m, n, k, _ = _dims(sa[0], sb[0], layout)
    return (n, k) if layout != "NT" else (m, n)


def _fp8_rowwise_unsupported(sa: Sequence[QuantizedStorage], sb: Sequence[QuantizedStorage], layout: str,
                             device: torch.device) -> Optional[str]:
    """Why path 2 cannot take these per-tensor FP8 pairs (None: it can)."""
    da, db = LAYOUTS[layout]
    device = torch.device(device)
    if device.type != "cuda" or _capability(device)[0] != 9:
        return "torch._scaled_grouped_mm rowwise FP8 is used on sm90 only"
    dtypes = {s.payload(da)["data"].dtype for s in sa} | {s.payload(db)["data"].dtype for s in sb}
    if dtypes != {torch.float8_e4m3fn}:
        return f"element types {sorted(str(d) for d in dtypes)}; torch._scaled_grouped_mm takes E4M3 only"
    n, k = _fixed_dims(sa, sb, layout)
    if n % _FP8_ALIGN or k % _FP8_ALIGN:
        return f"grouped dims {n}, {k} not multiples of {_FP8_ALIGN}"
    return None


def _run_fp8_rowwise(sa: Sequence[QuantizedStorage], sb: Sequence[QuantizedStorage], layout: str,
                     ja: Optional[JoinedCopy] = None, jb: Optional[JoinedCopy] = None) -> torch.Tensor:
    """Path 2: per-expert per-tensor scales as per-row / per-column scale vectors. ``ja`` /
    ``jb``: the operands' joined copies, if their ``GroupedTensor`` holds them."""
    da, db = LAYOUTS[layout]
    pa, pb = [s.payload(da) for s in sa], [s.payload(db) for s in sb]
    ms = [p["data"].shape[0] for p in pa]
    n = pb[0]["data"].shape[0]
    # Joined rowwise codes (grouped_scaled's one cast pass; joined weights) are the operand
    # without a copy; otherwise cat / stack on the bytes (not every torch build concatenates
    # float8 tensors).
    mat_a = _fp8_rows(ja, da, ms)
    if mat_a is None:
        mat_a = torch.cat([p["data"].view(torch.uint8) for p in pa]).view(torch.float8_e4m3fn)
    whole_b = _fp8_rows(jb, db, [n] * len(pb))
    if whole_b is not None:
        mat_b = whole_b.view(len(pb), n, whole_b.shape[1]).transpose(1, 2)
    else:
        mat_b = torch.stack([p["data"].view(torch.uint8) for p in pb]).view(torch.float8_e4m3fn).transpose(1, 2)
    # per-row / per-column scale vectors in a few ops for all experts (not three per expert)
    sa_e = torch.stack([gemm_fp8.scalar(p["scale_inv"]) for p in pa]).float()
    scale_a = sa_e.repeat_interleave(device_tensor(ms, sa_e.device), output_size=sum(ms))
    scale_b = torch.stack([gemm_fp8.scalar(p["scale_inv"]) for p in pb]).float()[:, None].expand(len(pb), n)
    return torch._scaled_grouped_mm(mat_a, mat_b, scale_a.contiguous(), scale_b.contiguous(),
                                    offs=offsets(ms, mat_a.device), out_dtype=torch.bfloat16,
                                    use_fast_accum=False)  # see the module docstring


def _run_per_expert(A: Sequence[torch.Tensor], B: Sequence[torch.Tensor], layout: str, out_dtype: torch.dtype,
                    biases: Optional[Sequence[Optional[torch.Tensor]]], sa: Sequence[QuantizedStorage],
                    sb: Sequence[QuantizedStorage], ms: Optional[Sequence[int]] = None,
                    ja: Optional[JoinedCopy] = None, jb: Optional[JoinedCopy] = None
                    ) -> Union[torch.Tensor, list[torch.Tensor]]:
    """Path 4: ``gemm`` per expert; where every pair runs on the exact emulation, the same
    ``emulate`` per expert on operands decoded once per joined copy (``_emulated_operands``).
    fprop / dgrad write each expert's rows straight into the joined [Σm_e, n] result (``gemm``'s
    ``out``: no concatenation pass over the whole output). ``ms``: the experts' m if known;
    ``ja`` / ``jb``: the operands' joined copies, if their ``GroupedTensor`` holds them."""
    bs = biases if biases is not None else [None] * len(A)
    ops = _emulated_operands(sa, sb, layout, ja, jb)
    if ops is None:
        one = _one_gemm(A, B, sa, sb, layout, out_dtype)
        if layout == "NT":
            return [one(e, bias, None) for e, bias in enumerate(bs)]
        ms, n = _ms(sa, sb, layout, ms), _dims(sa[0], sb[0], layout)[1]
        out = torch.empty((sum(ms), n), dtype=out_dtype, device=sa[0].device)
        start = 0
        for e, (bias, m) in enumerate(zip(bs, ms)):
            one(e, bias, out[start:start + m])
            start += m
        return out
    else:
        n = _dims(sa[0], sb[0], layout)[1]
        for bias in bs:
            if bias is not None and tuple(bias.shape) != (n,):
                raise ValueError(f"gemm bias must have shape [{n}]; got {tuple(bias.shape)}.")
        outs = [emulate(a, b, out_dtype, bias) for a, b, bias in zip(*ops, bs)]
    return outs if layout == "NT" else torch.cat(outs)


def _common_backend(sa: Sequence[QuantizedStorage], sb: Sequence[QuantizedStorage], layout: str):
    """The backend ``gemm()`` would select for every expert's pair, if it is one and the same
    (e.g. cuBLAS FP8 per-tensor for all), else None."""
    da, db = LAYOUTS[layout]
    keys = {(a.format_key(da), b.format_key(db)) for a, b in zip(sa, sb)}
    backends = {select(ka, kb, layout, sa[0].device) for ka, kb in keys}
    return backends.pop() if len(backends) == 1 else None


def _one_gemm(A: Sequence[torch.Tensor], B: Sequence[torch.Tensor], sa: Sequence[QuantizedStorage],
              sb: Sequence[QuantizedStorage], layout: str, out_dtype: torch.dtype
              ) -> Callable[[int, Optional[torch.Tensor], Optional[torch.Tensor]], torch.Tensor]:
    """Expert e's GEMM as ``gemm()`` computes it, ``(e, bias, out) -> result``: where every pair
    selects one backend, that backend's ``run`` straight on the storages, without re-checking
    operands, keys and backend per expert (grouped_gemm checked the shapes; at 64 experts
    ``gemm()`` per expert would be about a third of an FP8 MoE step's host time) — the same
    backend call, so the same result; else ``gemm()`` itself."""
    backend = _common_backend(sa, sb, layout)
    if backend is None:
        return lambda e, bias, out: gemm(A[e], B[e], layout, out_dtype=out_dtype, bias=bias, out=out)
    n = _dims(sa[0], sb[0], layout)[1]

    def run(e: int, bias: Optional[torch.Tensor], out: Optional[torch.Tensor]) -> torch.Tensor:
        if bias is not None and tuple(bias.shape) != (n,):
            raise ValueError(f"gemm bias must have shape [{n}]; got {tuple(bias.shape)}.")
        res = backend.run(sa[e], sb[e], layout, out_dtype=out_dtype, bias=bias,
                          **({"out": out} if out is not None and backend.writes_out else {}))
        return res if out is None or res is out else out.copy_(res)
    return run


def _emulated_operands(sa: Sequence[QuantizedStorage], sb: Sequence[QuantizedStorage], layout: str,
                       ja: Optional[JoinedCopy] = None, jb: Optional[JoinedCopy] = None
                       ) -> Optional[tuple[list[GemmOperand], list[GemmOperand]]]:
    """Every expert's GEMM operands as ``gemm()`` hands them to the exact emulation, or None if
    some pair has a fast backend (then ``gemm()`` per expert). A joined copy of back-to-back
    row-local rows (``ja`` / ``jb``: shared row-local encodings, joined weights) is
    block-decoded once and cut by rows: elementwise decoding makes the cuts bitwise each
    expert's own decode. The emulation is reported once per pair, as ``gemm()`` does."""
    da, db = LAYOUTS[layout]
    device = sa[0].device
    pairs = {}
    for a, b in zip(sa, sb):
        pairs.setdefault((a.format_key(da), b.format_key(db)), a.label or b.label or "a direct gemm() call")
    if any(select(ka, kb, layout, device) is not None for ka, kb in pairs):
        return None
    for (ka, kb), role in pairs.items():
        report_emulated(GEMM_OF_LAYOUT[layout], role, ka, kb, layout, device)
    return _decoded(sa, da, ja), _decoded(sb, db, jb)


def _decoded(storages: Sequence[QuantizedStorage], direction: str, j: Optional[JoinedCopy]) -> list[GemmOperand]:
    """``s.gemm_operand(direction)`` per storage; ``j``'s rows decoded in one call."""
    joined = joined_row_storage(j, direction, [s.part(direction).rows for s in storages])
    if joined is None:
        return [s.part(direction).gemm_operand(direction) for s in storages]
    whole = joined.gemm_operand(direction)
    per_row = whole.scale is not None and whole.scale.dim() == 1
    out, start = [], 0
    for s in storages:
        stop = start + s.part(direction).rows
        scale = whole.scale[start:stop] if per_row else whole.scale
        out.append(GemmOperand(whole.values[start:stop], scale, whole.k, whole.rht))
        start = stop
    return out


def _fp8_rows(j: Optional[JoinedCopy], direction: str, sizes: Sequence[int]) -> Optional[torch.Tensor]:
    """The FP8 codes of ``j`` when it holds the experts' rowwise copies back to back (per-expert
    ``scales`` allowed: the codes are what path 2 reads), else None."""
    if j is None or direction != "rowwise" or j.starts is not None and j.starts != list(accumulate([0] + list(sizes)))[:-1]:
        return None
    data = j.storage.part(direction).payload(direction)["data"]
    return data if data.is_contiguous() and data.shape[0] == sum(sizes) else None
