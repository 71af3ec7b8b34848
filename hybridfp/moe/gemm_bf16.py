"""Path 1 of ``grouped_gemm`` (``grouped.py``'s docstring): the experts' copies decoded to BF16
(exactly, no epilogue factor) and one grouped matmul (``grouped.torch_grouped_mm``: CUTLASS's
``torch._grouped_mm``, or cuBLAS per group for few large groups), with the operand layouts it
takes: rows grouped for fprop / dgrad ([Σm, k] · [E, k, n]), the reduction grouped for wgrad
([m, Σk] · [Σk, n], each expert's reduction zero-padded to the TMA alignment). Copies that are
blocks of one shared encoding are decoded joined, and operands are gathered without a copy
where they are already joined."""

from __future__ import annotations

from itertools import accumulate
from typing import Callable, Optional, Sequence, Union

import torch

from ..utils.device import device_tensor, step_metadata
from .quantize import pad_row_groups
from ..tensors.storage import COLUMNWISE, ROWWISE, GemmOperand, QuantizedStorage
from ..gemm.bf16_decode import HAVE_TRITON, decode_bf16, decode_bf16_joined, held_transpose
from ..gemm.bf16_tensorcore import exact_bf16_gemm
from ..gemm.gemm import LAYOUTS
from .grouped_tensor import JoinedCopy
from .joined import joined_column_storage, joined_row_storage

#: (mat_a, mat_b, sizes) -> BF16 result, with ``torch._grouped_mm``'s semantics for the groups of
#: ``sizes`` (host ints: rows of ``mat_a`` for 2D x 3D, the reduction for 2D x 2D).
GroupedMM = Callable[[torch.Tensor, torch.Tensor, Sequence[int]], torch.Tensor]
#: TMA needs 16-byte aligned strides and group starts: 8 BF16 elements.
BF16_ALIGN = 8


def offsets(sizes: Sequence[int], device: torch.device) -> torch.Tensor:
    """The groups' end offsets on ``device`` (int32), as ``torch._grouped_mm``'s ``offs``
    (shared by the calls of one routing: ``utils.device.step_metadata``; read-only)."""
    ends = tuple(accumulate(sizes))
    return step_metadata(("grouped_mm offs", ends), device, lambda: device_tensor(list(ends), device, torch.int32))


def _output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised result, poisoned inside ``kernels._common.poisoned_outputs`` (tests: an
    element left unwritten shows) where Triton is installed; the kernels module needs Triton,
    which a CPU-only install of the library does not have."""
    if HAVE_TRITON:
        from ..kernels._common import empty  # imported here: Triton is optional on the CPU
        return empty(shape, dtype, device)
    return torch.empty(shape, dtype=dtype, device=device)


def per_group_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """A :data:`GroupedMM` as one ``torch.mm`` per group (cuBLAS on CUDA), writing straight into
    slices of one result: ``torch._grouped_mm``'s result and semantics (BF16 in, FP32
    accumulation, one rounding to BF16; a 2D x 2D group with an empty reduction gives zeros), with
    cuBLAS's BF16 split-K reductions and autocast off (``bf16_tensorcore.exact_bf16_gemm``), so
    numerics §1 holds as for one expert. The CUDA default for few large groups, where cuBLAS's
    per-shape kernels run faster than CUTLASS's grouped kernel (``grouped.per_group_wins``).
    Operands are the decoded copies the GEMM path hands it (no autograd: ``out=`` slices)."""
    sizes = [int(x) for x in sizes]
    groups, total = (mat_b.shape[0], mat_a.shape[0]) if mat_b.dim() == 3 else (len(sizes), mat_a.shape[1])
    if min(sizes, default=0) < 0 or len(sizes) != groups or sum(sizes) != total:
        raise ValueError(f"per_group_mm: sizes {sizes} must be {groups} non-negative group sizes summing to "
                         f"{total} (mat_a {tuple(mat_a.shape)}, mat_b {tuple(mat_b.shape)}).")
    starts = list(accumulate([0] + sizes))
    with exact_bf16_gemm(mat_a.device):
        if mat_b.dim() == 3:  # rows grouped: [Σm, k] · [G, k, n] -> [Σm, n]
            out = _output((starts[-1], mat_b.shape[-1]), mat_a.dtype, mat_a.device)
            for g, m in enumerate(sizes):
                if m:
                    torch.mm(mat_a[starts[g]:starts[g + 1]], mat_b[g], out=out[starts[g]:starts[g + 1]])
            return out
        # reduction grouped: [m, Σk] · [Σk, n] -> [G, m, n]
        out = _output((len(sizes), mat_a.shape[0], mat_b.shape[1]), mat_a.dtype, mat_a.device)
        for g, k in enumerate(sizes):
            if k:
                torch.mm(mat_a[:, starts[g]:starts[g + 1]], mat_b[starts[g]:starts[g + 1]], out=out[g])
            else:
                out[g].zero_()
        return out


def run_bf16(sa: Sequence[QuantizedStorage], sb: Sequence[QuantizedStorage], layout: str,
             grouped_mm: GroupedMM, ms: Sequence[int], ja: Optional[JoinedCopy] = None,
             jb: Optional[JoinedCopy] = None) -> Optional[torch.Tensor]:
    """Path 1, or None if some copy decodes with an epilogue factor (or a one-sided RHT).
    ``ms``: the experts' m; ``ja`` / ``jb``: the operands' joined copies, if their
    ``GroupedTensor`` holds them.

    Joined copies (``quantize_grouped``'s row-local rowwise copies, joined weights, zero-padded
    columnwise block copies) are decoded in one call straight into the grouped operand; the
    experts' own copies per expert, then concatenated."""
    da, db = LAYOUTS[layout]
    if layout == "NT":
        out = _run_bf16_joined_wgrad(sa, sb, grouped_mm, ja, jb)
        if out is not NotImplemented:
            return out
    whole_a = _joined_operand(sa, da, ja) if layout != "NT" else None
    # B of fprop / dgrad is the experts' weights: the decode is cached while they are unchanged
    whole_b = _joined_operand(sb, db, jb, cache=True) if layout != "NT" else None
    if any(w is not None and w.scale is not None for w in (whole_a, whole_b)):
        return None
    # Operands the grouped copy reads transposed (dgrad's B, both of wgrad) are taken as the
    # tensors they are views of where the decode is one (BF16 Identity columnwise copies): no
    # transposed view per expert, transposed back by the copy (3 of 5 aten ops of a BF16 step)
    rows_a = _held_transposes(sa, da) if layout == "NT" else None
    rows_b = _held_transposes(sb, db) if layout != "TN" and whole_b is None else None
    ops_a = _decoded_values(sa, da, whole_a, False) if rows_a is None else (None, [False] * len(sa))
    ops_b = _decoded_values(sb, db, whole_b, layout != "NT") if rows_b is None else (None, [False] * len(sb))
    if ops_a is None or ops_b is None or ops_a[1] != ops_b[1]:  # an epilogue factor; a one-sided RHT
        return None
    (vals_a, _), (vals_b, _) = ops_a, ops_b
    if layout != "NT":  # rows grouped: [Σm, k] · [E, k, n]
        mat_a = whole_a.values if whole_a is not None else torch.cat(vals_a)
        mat_b = (_experts_kn(whole_b.values, len(sb), db) if whole_b is not None else
                 _stack_transposed(vals_b, rows_b))
        return grouped_mm(mat_a, mat_b, ms)
    # Reduction grouped: [m, Σk] · [Σk, n]. Each group starts 16-byte aligned (TMA): pad every
    # expert's reduction to a multiple of 8 with zeros, which add nothing to the FP32 sums.
    ks = [v.shape[1] for v in vals_a] if vals_a is not None else [r.shape[0] for r in rows_a]
    padded = [-(-k // BF16_ALIGN) * BF16_ALIGN for k in ks]
    mat_a = _cat_columns(vals_a, padded, rows_a, _held_rows(ja, rows_a))
    mat_b = _cat_columns(vals_b, padded, rows_b, _held_rows(jb, rows_b)).t()
    return _wgrad_result(grouped_mm(mat_a, mat_b, padded), ks)


def _decoded_values(storages: Sequence[QuantizedStorage], direction: str, whole: Optional[GemmOperand],
                    cache: bool) -> Optional[tuple[list[torch.Tensor], list[bool]]]:
    """Every expert's BF16-decoded ``direction`` values (``whole``'s if decoded joined) and RHT
    flag; None if some copy carries an epilogue factor."""
    values, rht = [], []
    for s in storages:
        o = whole if whole is not None else decode_bf16(s, direction, cache=cache)
        if o.scale is not None:
            return None
        values.append(o.values)
        rht.append(o.rht)
    return values, rht


def _held_transposes(storages: Sequence[QuantizedStorage], direction: str) -> Optional[list[torch.Tensor]]:
    """Every expert's decoded values transposed, as the tensors the copies hold
    (``bf16_decode.held_transpose``), when each one's decode is a view of a held tensor; else None."""
    out = []
    for s in storages:
        t = held_transpose(s, direction)
        if t is None:
            return None
        out.append(t)
    return out


def _joined_operand(storages: Sequence[QuantizedStorage], direction: str, j: Optional[JoinedCopy],
                    cache: bool = False) -> Optional[GemmOperand]:
    """The experts' ``direction`` copies decoded in one call when ``j`` holds them joined:
    back-to-back rows of a row-local encoding (rowwise), or columns without padding (columnwise
    copies of joined weights: every expert's rows a whole number of blocks). None otherwise.
    Values: [Σ rows, k] (rowwise) or [n, Σ k] (columnwise, stored transposed). ``cache``: see
    ``decode_bf16_joined``."""
    sizes = [s.part(direction).rows for s in storages]
    if direction == ROWWISE:
        joined = joined_row_storage(j, direction, sizes)
    else:
        found = joined_column_storage(j, direction)
        if found is None:
            return None
        joined, starts = found
        if any(b - a != m for a, b, m in zip(starts, starts[1:] + [joined.rows], sizes)):
            return None  # padding between the copies: not one [E, k, n] operand
    return decode_bf16_joined(joined, storages, direction, cache=cache) if joined is not None else None


def _held_rows(j: Optional[JoinedCopy], rows: Optional[Sequence[torch.Tensor]]) -> Optional[torch.Tensor]:
    """The tensor ``j`` holds whose row blocks are the experts' held transposes ``rows`` (a BF16
    Identity columnwise copy: the experts' rows, read transposed), contiguous; else None."""
    if j is None or rows is None or j.starts is not None or j.scales is not None:
        return None
    whole = held_transpose(j.storage, COLUMNWISE)
    if whole is None or not whole.is_contiguous() or whole.shape[0] != sum(r.shape[0] for r in rows):
        return None
    return whole


def _experts_kn(values: torch.Tensor, experts: int, direction: str) -> torch.Tensor:
    """[E, k, n] views (no copy) of B's joined decode: rowwise [E*n, k] (joined weights'
    rowwise copies) or columnwise [n, E*k] (their transposed columnwise copies)."""
    values = values.contiguous()  # the decoders write contiguous tensors: no copy
    if direction == ROWWISE:
        n = values.shape[0] // experts
        return values.view(experts, n, values.shape[1]).transpose(1, 2)
    k = values.shape[1] // experts
    return values.view(values.shape[0], experts, k).permute(1, 2, 0)


def _run_bf16_joined_wgrad(sa: Sequence[QuantizedStorage], sb: Sequence[QuantizedStorage],
                           grouped_mm: GroupedMM, j_a: Optional[JoinedCopy], j_b: Optional[JoinedCopy]
                           ) -> Union[None, torch.Tensor, object]:
    """wgrad on joined columnwise copies of both operands (``j_a``, ``j_b``) with the same group
    layout: [m, Σk] · [Σk, n] straight from the two decodes, each expert's zero padding inside
    its own group. ``NotImplemented`` when the copies are not so joined (the caller then goes
    per expert)."""
    ja, jb = joined_column_storage(j_a, COLUMNWISE), joined_column_storage(j_b, COLUMNWISE)
    if ja is None or jb is None or ja[1] != jb[1] or ja[0].rows != jb[0].rows:
        return NotImplemented
    if any(-(-st // BF16_ALIGN) * BF16_ALIGN != st for st in ja[1]):
        return NotImplemented  # a group start not 16-byte aligned for TMA
    oa, ob = decode_bf16(ja[0], COLUMNWISE), decode_bf16(jb[0], COLUMNWISE)
    if oa.scale is not None or ob.scale is not None or oa.rht != ob.rht:
        return None
    ends = ja[1][1:] + [ja[0].rows]
    out = grouped_mm(oa.values, ob.values.t(), [e - s for s, e in zip(ja[1], ends)])
    return _wgrad_result(out, [s.part(COLUMNWISE).rows for s in sa])


def _wgrad_result(out: torch.Tensor, ks: Sequence[int]) -> torch.Tensor:
    """The experts' [E, n, k] result of a grouped wgrad; an empty reduction is a zero result
    (not left to the kernel)."""
    for e, k in enumerate(ks):
        if k == 0:
            out[e].zero_()
    return out


def _stack_transposed(parts: Optional[Sequence[torch.Tensor]], rows: Optional[Sequence[torch.Tensor]] = None
                      ) -> torch.Tensor:
    """[E, k, n] from the experts' [n, k] operands, in whichever layout copies them without a
    transpose: a BF16 Identity columnwise copy is a transposed view of the row-major weight,
    so stacking its transpose is a plain copy (the grouped kernel takes either layout).
    ``rows``: the parts' transposes, if held (``parts`` may then be None; no view op per expert)."""
    if rows is not None:
        if all(r.is_contiguous() for r in rows):
            return torch.stack(list(rows))
        parts = [r.t() for r in rows]
    if all(_t_contiguous(p) for p in parts):
        return torch.stack([p.t() for p in parts])
    return torch.stack(parts).transpose(1, 2)


def _cat_columns(parts: Optional[Sequence[torch.Tensor]], widths: Sequence[int],
                 rows: Optional[Sequence[torch.Tensor]] = None, whole: Optional[torch.Tensor] = None
                 ) -> torch.Tensor:
    """[rows, Σ widths]: part e in its columns, zero padding after it. Transposed views (BF16
    Identity columnwise copies) are gathered as row blocks of the transpose instead, so the
    copy never transposes (the result is then a column-major view). ``rows``: the parts'
    transposes, if held (``parts`` may then be None; no view op per expert); ``whole``: the
    tensor whose consecutive row blocks they are, if a joined copy holds it (``_held_rows``)."""
    if rows is not None and not all(r.is_contiguous() for r in rows):
        rows, parts = None, [r.t() for r in rows]
    if rows is not None or all(_t_contiguous(p) for p in parts):
        rows = rows if rows is not None else [p.t() for p in parts]
        heights = [r.shape[0] for r in rows]
        if whole is not None and all(
                -(-h // BF16_ALIGN) * BF16_ALIGN == w for h, w in zip(heights, widths)):
            # consecutive row blocks of one buffer (an Identity copy of x or dy): every group
            # zero-padded to a multiple of 8 rows in one pass (a Triton kernel on CUDA), not a
            # zero block and a concatenation per expert
            return pad_row_groups(whole, heights, BF16_ALIGN)[0].t()
        return _cat_rows(rows, widths).t()
    if all(p.shape[1] == w for p, w in zip(parts, widths)):
        return torch.cat(parts, dim=1)
    out = parts[0].new_zeros(parts[0].shape[0], sum(widths))
    start = 0
    for p, w in zip(parts, widths):
        out[:, start:start + p.shape[1]] = p
        start += w
    return out


def _t_contiguous(p: torch.Tensor) -> bool:
    """``p.t().is_contiguous()`` for a 2D ``p``, from its strides (no view op per expert)."""
    if p.numel() == 0:
        return True
    expected = 1
    for size, stride in ((p.shape[0], p.stride(0)), (p.shape[1], p.stride(1))):  # innermost of p.t() first
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _cat_rows(parts: Sequence[torch.Tensor], heights: Sequence[int]) -> torch.Tensor:
    """[Σ heights, cols]: part e in its rows, zero rows after it."""
    pieces: list[torch.Tensor] = []
    for p, h in zip(parts, heights):
        pieces.append(p)
        if h > p.shape[0]:
            pieces.append(p.new_zeros(h - p.shape[0], p.shape[1]))
    return torch.cat(pieces)
