"""Path 1 of ``grouped_gemm`` (``gemm_bf16.py``) on ``GroupedTensor``' joined copies.

When both operands come from grouped quantizations whose every expert is views of shared
encodings (``moe/grouped_tensor.py``), the grouped BF16 path needs nothing per expert: the
experts' m are the splits, the format checks are one storage's, and the operands are the joined
copies' decodes. This computes exactly what ``run_bf16`` computes on the per-expert views of the
same copies (it decodes the same joined tensors, gathers them the same way, and calls the same
grouped matmul), without building 64 storages per operand and re-discovering that they are
joined. ``grouped.py`` decides whether path 1 applies (its ``_torch_path`` rules, on the
joined storages); this runs it, or returns None where the per-expert code must (then it does).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .grouped_tensor import JoinedCopy
from ..tensors.storage import COLUMNWISE, ROWWISE, GemmOperand
# the modules, not their functions: tests count decodes / padding passes by patching them there
from ..gemm import bf16_decode
from . import gemm_bf16
from ..gemm.gemm import LAYOUTS
from .gemm_bf16 import BF16_ALIGN, GroupedMM, _experts_kn, _wgrad_result


def run_joined(ja: JoinedCopy, jb: JoinedCopy, splits_a: Sequence[int], splits_b: Sequence[int], layout: str,
               grouped_mm: GroupedMM) -> Optional[torch.Tensor]:
    """The grouped BF16 GEMM ``layout`` on joined copies (A's experts split by ``splits_a``, B's
    by ``splits_b``), or None where ``run_bf16`` would not take its joined branches (shapes
    that do not pair up, alignment, a decode with an epilogue factor or one-sided RHT)."""
    da, db = LAYOUTS[layout]
    if layout == "NT":
        return _wgrad(ja, jb, splits_a, splits_b, grouped_mm)
    ka, n, kb = ja.storage.cols, _fixed_n(jb, db, splits_b), _reductions(jb, db, splits_b)
    if n is None or any(k != ka for k in kb) or n % BF16_ALIGN or ka % BF16_ALIGN or ja.starts is not None:
        return None  # uneven experts / misaligned dims: the per-expert checks say why
    whole_a = bf16_decode.decode_bf16(ja.storage, ROWWISE)
    mat_b = _weights_kn(jb, db, splits_b)
    if mat_b is None or whole_a.scale is not None or whole_a.rht:
        return None
    return grouped_mm(whole_a.values, mat_b, splits_a)


def _fixed_n(j: JoinedCopy, direction: str, splits: Sequence[int]) -> Optional[int]:
    """B's output width n, the same for every expert (None if not)."""
    if direction == COLUMNWISE:
        return j.storage.cols
    return splits[0] if len(set(splits)) == 1 else None


def _reductions(j: JoinedCopy, direction: str, splits: Sequence[int]) -> list[int]:
    """B's reduction length per expert: its copy's cols (rowwise) or rows (columnwise)."""
    return [j.storage.cols] * len(splits) if direction == ROWWISE else list(splits)


def _weights_kn(jb: JoinedCopy, direction: str, splits: Sequence[int]) -> Optional[torch.Tensor]:
    """B of fprop / dgrad (the experts' weights) as [E, k, n]: the joined decode's views
    (``_experts_kn``, the decode cached while the weights are unchanged), or the joined rows
    of a BF16 Identity columnwise copy (what ``_stack_transposed`` copies out of the experts'
    held transposes: here a view when they are one contiguous buffer, else the same stack)."""
    s, experts = jb.storage, len(splits)
    if direction == COLUMNWISE and jb.starts is None:  # Identity: held transposes = the rows
        data = s.payload(COLUMNWISE)["data"]
        if data.dtype != torch.bfloat16:
            return None
        if not data.is_contiguous():
            return torch.stack(list(torch.split(data, data.shape[0] // experts)))
        return data.view(experts, data.shape[0] // experts, data.shape[1])
    if direction == COLUMNWISE and (s.rows != sum(splits) or jb.starts != [sum(splits[:e]) for e in range(experts)]):
        return None  # padding between the experts' copies: not one [E, k, n] operand
    # cached under the joined copy's own payload while it is unchanged (micro-batches)
    op: GemmOperand = bf16_decode.decode_bf16_joined(s, [s], direction, cache=True)
    if op.scale is not None or op.rht:
        return None
    return _experts_kn(op.values, experts, direction)


def _wgrad(ja: JoinedCopy, jb: JoinedCopy, splits_a: Sequence[int], splits_b: Sequence[int],
           grouped_mm: GroupedMM) -> Optional[torch.Tensor]:
    """dW_e = dy_eᵀ x_e for every e, the reduction (the experts' rows) grouped: zero-padded
    column copies side by side (MXFP8: ``_run_bf16_joined_wgrad``), or BF16 rows padded to the
    TMA alignment in one pass (Identity: ``_cat_columns``)."""
    if list(splits_a) != list(splits_b):
        return None
    if ja.starts is not None and jb.starts is not None:
        if ja.starts != jb.starts or ja.storage.rows != jb.storage.rows:
            return None
        if any(-(-st // BF16_ALIGN) * BF16_ALIGN != st for st in ja.starts):
            return None
        oa, ob = bf16_decode.decode_bf16(ja.storage, COLUMNWISE), bf16_decode.decode_bf16(jb.storage, COLUMNWISE)
        if oa.scale is not None or ob.scale is not None or oa.rht != ob.rht:
            return None
        ends = ja.starts[1:] + [ja.storage.rows]
        sizes = [e - s for s, e in zip(ja.starts, ends)]
        out = grouped_mm(oa.values, ob.values.t(), sizes)
        return _wgrad_result(out, splits_a)
    if ja.starts is None and jb.starts is None:
        da_, db_ = ja.storage.payload(COLUMNWISE)["data"], jb.storage.payload(COLUMNWISE)["data"]
        if (da_.dtype != torch.bfloat16 or db_.dtype != torch.bfloat16
                or not da_.is_contiguous() or not db_.is_contiguous()):
            return None
        padded = [-(-m // BF16_ALIGN) * BF16_ALIGN for m in splits_a]
        mat_a = gemm_bf16.pad_row_groups(da_, splits_a, BF16_ALIGN)[0].t()
        mat_b = gemm_bf16.pad_row_groups(db_, splits_b, BF16_ALIGN)[0].t().t()
        return _wgrad_result(grouped_mm(mat_a, mat_b, padded), splits_a)
    return None
