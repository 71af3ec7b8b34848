"""Path ``grouped_fp8_triton`` of ``grouped_gemm``: per-tensor FP8 experts (FP8 current or
delayed scaling, E4M3 / E5M2 in any mix) in one Triton FP8 grouped GEMM
(``kernels/moe/triton_grouped_fp8_gemm.py``) instead of one cuBLAS ``_scaled_mm`` per expert.

Taken for the GEMMs ``torch._scaled_grouped_mm`` (path 2) cannot run — dgrad with E5M2
gradients, every wgrad (its experts are grouped along the reduction) — when the experts are
small enough that the per-expert loop is host-bound (``grouped.per_expert_fp8_faster`` says
no), on CUDA from the policy's ``many_experts`` experts on, or when the caller forces the
Triton paths (``use_triton=True``; the CPU tests, in the interpreter).

Experts held as joined copies (``GroupedTensor`` of FP8 current scaling: rows [Σm, C], columns
one [C, Σ padded m] matrix, each expert's ``scale_inv`` in ``JoinedCopy.scales``) take all three
GEMMs here, fprop included (:func:`run_joined`, called by ``grouped._run_joined``): nothing is
built per expert, since at 64 experts per-expert objects would be most of the FP8-current MoE
step's host time (``python -m bench.bench_moe --experts 64`` on an NVIDIA H200 measures the
step).

Numerics: the FP8 MMA with its partial sums promoted to FP32 every 128 products (numerics §1's
Hopper exception, as cuBLAS without fast accumulation), each expert's ``scale_inv`` pair
applied in an FP32 epilogue with its bias, one rounding — what the per-expert cuBLAS path
computes, up to the accumulation order. The operands are read where they lie: the experts'
rowwise copies as rows of one buffer or not, the weights joined or not, wgrad's columnwise
copies in their zero-padded blocks (so the reduction runs over 16-aligned lengths).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Optional, Sequence

import torch

from ..config import current_policy
from .grouped_tensor import JoinedCopy
from ..tensors.storage import QuantizedStorage
from ..gemm.fast import TENSORWISE, zero_tail_view
from ..gemm.gemm import LAYOUTS
from .gemm_triton import joined_bias

GROUPED_FP8_TRITON = "grouped_fp8_triton"
#: output dtypes the kernel writes
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: GPU architectures (compute capability major) where this path is verified: Hopper (the
#: H200's GPU tests). Ada and Blackwell have FP8 MMA too, with their own accumulation
#: behaviour: unverified, so they keep cuBLAS per expert. (The interpreter: anywhere.)
VERIFIED_MAJOR = (9,)
# Which kernel runs (the TMA kernel's config for fprop / dgrad and for wgrad, or the pointer
# kernel) and whether per-expert E4M3 lists take this path over torch._scaled_grouped_mm are
# the policy's grouped_fp8_tma_rows, grouped_fp8_tma_wgrad and over_scaled_grouped_mm
# (hybridfp.config.Policy). The interpreter keeps the pointer kernel unless a test asks for
# the TMA one.


def _kernels():
    from ..kernels.moe import triton_grouped_fp8_gemm
    return triton_grouped_fp8_gemm


def _tma(name: Optional[str], device: torch.device):
    """The TMA kernel's config called ``name`` (the policy's ``grouped_fp8_tma_rows`` /
    ``grouped_fp8_tma_wgrad``) for operands on ``device`` (CUDA only), or None."""
    if name is None or torch.device(device).type != "cuda":
        return None
    from ..kernels.moe.triton_grouped_fp8_tma import CONFIGS as configs
    if name not in configs:
        raise ValueError(f"the policy's grouped FP8 TMA config {name!r} (Policy.grouped_fp8_tma_rows / "
                         f"grouped_fp8_tma_wgrad) is unknown; use None or one of {sorted(configs)}.")
    return configs[name]


def per_tensor_fp8(sa: Sequence[QuantizedStorage], sb: Sequence[QuantizedStorage], layout: str) -> bool:
    """Whether every expert's pair is per-tensor FP8 on both sides (any E4M3 / E5M2 mix)."""
    da, db = LAYOUTS[layout]
    return all(a.format_key(da)[0] == TENSORWISE and b.format_key(db)[0] == TENSORWISE for a, b in zip(sa, sb))


def unsupported(sa: Sequence[QuantizedStorage], layout: str, out_dtype: torch.dtype) -> Optional[str]:
    """Why this path cannot take per-tensor FP8 experts on their device (None: it can)."""
    if out_dtype not in OUT_DTYPES:
        return f"output dtype {out_dtype}"
    device = torch.device(sa[0].device)
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] not in VERIFIED_MAJOR:
        return f"verified on sm{VERIFIED_MAJOR[0]}x (Hopper) only; cuBLAS per expert elsewhere"
    return None


def run(sa: Sequence[QuantizedStorage], sb: Sequence[QuantizedStorage], layout: str, out_dtype: torch.dtype,
        biases: Optional[Sequence[Optional[torch.Tensor]]] = None
        ) -> Optional[torch.Tensor]:
    """The experts' GEMMs in one launch, or None (mixed biases: the per-expert loop)."""
    da, db = LAYOUTS[layout]
    pa, pb = [s.payload(da) for s in sa], [s.payload(db) for s in sb]
    device = sa[0].device
    scale_a = torch.stack([scalar(p["scale_inv"]) for p in pa]).float()
    scale_b = torch.stack([scalar(p["scale_inv"]) for p in pb]).float()
    n = pb[0]["data"].shape[0]
    if layout == "NT":
        m = pa[0]["data"].shape[0]
        a, ks_a = _reduction_operands(sa, pa, da)
        b, ks_b = _reduction_operands(sb, pb, db)
        ks = [min(ka, kb) for ka, kb in zip(ks_a, ks_b)]  # a zero tail read on one side only adds nothing
        out = torch.empty((len(sa) * m, n), dtype=out_dtype, device=device)
        k = _kernels()
        k.grouped_fp8(a, b, ks, scale_a, scale_b, out, [e * m for e in range(len(sa))], tile=k.WGRAD_TILE,
                      prefer_tma=_tma(current_policy().grouped_fp8_tma_wgrad, device))
        return out.view(len(sa), m, n)
    usable, bias = joined_bias(biases, n, device)
    if not usable:
        return None
    a, b = [p["data"] for p in pa], [p["data"] for p in pb]
    ms = [t.shape[0] for t in a]
    starts = [sum(ms[:e]) for e in range(len(ms))]
    out = torch.empty((sum(ms), n), dtype=out_dtype, device=device)
    return _kernels().grouped_fp8(a, b, [a[0].shape[1]] * len(a), scale_a, scale_b, out, starts, bias=bias,
                                  prefer_tma=_tma(current_policy().grouped_fp8_tma_rows, device))


def _reduction_operands(ss: Sequence[QuantizedStorage], ps: Sequence[dict], direction: str
                        ) -> tuple[list[torch.Tensor], list[int]]:
    """wgrad operands (the experts' columnwise copies [rows, m_e]) and each one's reduction:
    m_e rounded up to 16 where the copy continues with zero codes that far
    (``fast.zero_tail_view``), else m_e. The zero products change nothing, and 16-aligned
    lengths let the kernel use 16-byte loads."""
    ops, ks = [], []
    for s, p in zip(ss, ps):
        data, k = p["data"], p["data"].shape[1]
        wide = zero_tail_view(s, direction, data, -(-k // 16) * 16) if k % 16 else None
        ops.append(data if wide is None else wide)
        ks.append(k if wide is None else wide.shape[1])
    return ops, ks


def scalar(t: torch.Tensor) -> torch.Tensor:
    """``t.reshape(())`` without a view op when ``t`` is 0-d already (one per expert)."""
    return t if t.dim() == 0 else t.reshape(())


def run_joined(ja: JoinedCopy, jb: JoinedCopy, splits_a: Sequence[int], splits_b: Sequence[int], layout: str,
               out_dtype: torch.dtype, biases: Optional[Sequence[Optional[torch.Tensor]]] = None
               ) -> Optional[torch.Tensor]:
    """The experts' GEMMs straight on two FP8 ``GroupedTensor``' joined copies (per-expert
    ``scales``; ``moe.assemble._scaled_group``): no per-expert tensor is built. Rows
    joined [Σm, C] (unpadded); columns one [C, width] matrix, expert e at column ``starts[e]``,
    zero codes to its block's 16-aligned end. None where the copies do not pair up (the caller
    then runs the per-expert code)."""
    da, db = LAYOUTS[layout]
    a, b = ja.storage.payload(da)["data"], jb.storage.payload(db)["data"]
    sa, sb = ja.scales.contiguous(), jb.scales.contiguous()
    experts = len(splits_a)
    k = _kernels()
    if layout == "NT":  # dW_e [N, K] = dy_e^T x_e: both column matrices, the same blocks
        if ja.starts != jb.starts or list(splits_a) != list(splits_b) or ja.starts is None:
            return None
        (n_rows, width), (k_rows, width_b) = a.shape, b.shape
        if width != width_b:
            return None
        ends = ja.starts[1:] + [width]
        ks = [e - s for s, e in zip(ja.starts, ends)]  # each block: its tokens, then zero codes
        out = torch.empty((experts * n_rows, k_rows), dtype=out_dtype, device=a.device)
        k.grouped_fp8_at(a, b, n_rows, ja.starts, width, jb.starts, width, ks, sa, sb, out,
                         [e * n_rows for e in range(experts)], tile=k.WGRAD_TILE,
                         prefer_tma=_tma(current_policy().grouped_fp8_tma_wgrad, a.device))
        return out.view(experts, n_rows, k_rows)
    if ja.starts is not None:
        return None
    usable, bias = joined_bias(biases, _width(jb, db, splits_b), a.device)
    if not usable:
        return None
    # host lists, not CPU tensors: a torch op on [E] costs ~10x a list comprehension
    ms, red = list(splits_a), a.shape[1]
    starts = list(accumulate(ms, initial=0))[:-1]
    if db == "rowwise":  # fprop: the joined weights' rows, expert e's N rows from row e*N
        if jb.starts is not None or len(set(splits_b)) != 1 or b.shape[1] != red:
            return None
        n = splits_b[0]
        b_offs, b_ld = [e * n * red for e in range(experts)], red
    else:  # dgrad: the weights' columnwise matrix [K, width], expert e's N columns at starts[e]
        if jb.starts is None or any([m != red for m in splits_b]):  # a list: no frame per expert
            return None
        n, b_ld = b.shape[0], b.shape[1]
        b_offs = jb.starts
    out = torch.empty((sum(splits_a), n), dtype=out_dtype, device=a.device)
    return k.grouped_fp8_at(a, b, ms, [s * red for s in starts], red, b_offs, b_ld, red, sa, sb, out, starts,
                            bias=bias, prefer_tma=_tma(current_policy().grouped_fp8_tma_rows, a.device))


def _width(jb: JoinedCopy, direction: str, splits: Sequence[int]) -> int:
    """The output width N of fprop / dgrad: the weights' rows per expert or the column matrix's rows."""
    return splits[0] if direction == "rowwise" else jb.storage.payload(direction)["data"].shape[0]
