"""The experts' tensors of ``quantize_grouped`` built from its shared encodings, always as a
``GroupedTensor`` naming the joined copies (``moe/grouped_tensor.py``).

Where every expert's tensor is nothing but views of the shared encodings, it is joined only
(``expert_group``, ``_hybrid_group``, ``scaled_hybrid_group``, ``_scaled_group``): the joined
copies plus a cutter (``_cut_*``) that builds the per-expert tensors only when something
indexes them. Otherwise ``assemble`` / ``assemble_scaled`` build each expert's tensor now, from
slices of the shared copies (``_row_payloads``, ``_column_payloads``) and the expert's own
encoding of a copy that is not shared, and ``_built_group`` names the directions whose every
expert's copy is still a view of one shared encoding.
"""

from __future__ import annotations

from functools import partial
from typing import Optional, Sequence, Union

import torch

from ..formats.common import ceil_div
from ..utils.device import device_constant
from ..tensors import Float8Storage, HybridStorage, QuantizedStorage, QuantizedTensor
from .joined import column_slices
from ..tensors.storage import COLUMNWISE, ROWWISE, Payload
from ..quantizers.base import Quantizer
from .grouped_tensor import GroupedTensor, JoinedCopy
from .plan import (COLUMN_VIEWS, SHARED, any_hybrid, columnwise_child, derives_columnwise, is_hybrid,
                   row_local_mode, rowwise_child)
from .quantize_scaled import (Fp8Joined, GroupScaled, HybridGroups, encode_group_scaled, expert_nvfp4_rows,
                              fp8_parts)

#: ``quantize_grouped``'s result: the experts' tensors (None where an expert needs no copy) as a
#: ``GroupedTensor``, or a list where no copy is shared (each expert quantized on its own).
GroupedResult = Union[list[Optional[QuantizedTensor]], GroupedTensor]


def assemble(quantizers: Sequence[Optional[Quantizer]], x: torch.Tensor, splits: Sequence[int],
              rows: Optional[QuantizedStorage], cols: Optional[QuantizedStorage],
              col_starts: Optional[list[int]], own_rows: Sequence[Optional[QuantizedStorage]],
              row_starts: Optional[list[int]] = None, own_joined: Optional[JoinedCopy] = None) -> GroupedResult:
    """Each expert's tensor from the shared encodings (``rows`` with groups starting at
    ``row_starts``, default unpadded; ``cols`` with groups starting at ``col_starts``) or its
    own rowwise encoding (``own_rows``; ``own_joined``: the joined copy they are views of, if
    one encoding wrote them all); joined only where they are views only, else built."""
    views = isinstance(cols, COLUMN_VIEWS)
    group = (_hybrid_group(quantizers, splits, rows, cols, col_starts, views, row_starts, x.dtype)
             if any_hybrid(quantizers) else
             expert_group(quantizers, splits, rows, cols, col_starts, views, row_starts))
    if group is not None:
        return group
    row_payloads = _row_payloads(rows, splits, row_starts) if rows is not None else None
    col_payloads = (_column_payloads(cols, col_starts, splits, views)
                    if cols is not None and any(q is not None and q.columnwise_usage for q in quantizers) else None)
    out: list[Optional[QuantizedTensor]] = []
    xs = torch.split(x, list(splits))  # one op for every expert's rows (not a slice each)
    for e, (q, m) in enumerate(zip(quantizers, splits)):
        if q is None:
            out.append(None)
            continue
        direct = _direct_storage(q, rows, cols, row_payloads[e] if rows is not None else None,
                                 col_payloads[e] if col_payloads is not None else None, m)
        if direct is not None:
            out.append(QuantizedTensor(direct, q))
            continue
        row_part = None
        if q.rowwise_usage or derives_columnwise(q) or (rows is not None and row_local_mode(q) == SHARED):
            row_part = (rebuild(rows, row_payloads[e], None, rowwise_child(q).label, m)
                        if rows is not None else own_rows[e])
        col_part = None
        if q.columnwise_usage and cols is not None:
            col_part = rebuild(cols, None, col_payloads[e], columnwise_child(q).label, m)
        out.append(QuantizedTensor(_expert_storage(q, xs[e], row_part, col_part), q))
    return _built_group(quantizers, splits, out, rows, cols, col_starts, views, row_starts, own_joined)


def _built_group(quantizers: Sequence[Optional[Quantizer]], splits: Sequence[int],
                 out: list[Optional[QuantizedTensor]], rows: Optional[QuantizedStorage],
                 cols: Optional[QuantizedStorage], col_starts: Optional[list[int]], views: bool,
                 row_starts: Optional[list[int]], own_joined: Optional[JoinedCopy]) -> GroupedResult:
    """``assemble``'s built experts ``out`` as a ``GroupedTensor`` naming the joined copies their
    views come from (each encoded every expert's rows: an expert that does not hold a direction
    leaves its group unread): the rowwise one where experts hold their rowwise copies as slices
    of ``rows`` (or of ``own_joined``), the columnwise one where they hold column-slice views of
    ``cols`` (``COLUMN_VIEWS``), both the one Identity payload (``SHARED``). ``out`` itself
    where nothing is joined."""
    used = [q for q in quantizers if q is not None]
    joined: dict[str, JoinedCopy] = {}
    if not used or sum(splits) == 0:
        return out
    usage = {(q.rowwise_usage, q.columnwise_usage) for q in used}  # one set: not a test per expert
    rowwise, columnwise = any(r for r, _ in usage), any(c for _, c in usage)
    # one plan shares an encoding among quantizers of one format: the first speaks for all
    if rows is not None and row_local_mode(used[0]) == SHARED:  # Identity: one payload
        p = rows.payloads[ROWWISE]
        whole = rebuild(rows, p, p, used[0].label, sum(splits))
        joined = {d: JoinedCopy(whole, None) for d, use in ((ROWWISE, rowwise), (COLUMNWISE, columnwise)) if use}
    else:
        if rowwise and rows is not None:
            joined[ROWWISE] = JoinedCopy(rows, None if row_starts is None else list(row_starts))
        elif rowwise and own_joined is not None:
            joined[ROWWISE] = own_joined
        if columnwise and views and cols is not None and col_starts is not None:
            joined[COLUMNWISE] = JoinedCopy(cols, list(col_starts))
    return GroupedTensor(splits, joined, experts=out) if joined else out


def expert_group(quantizers: Sequence[Optional[Quantizer]], splits: Sequence[int],
                  rows: Optional[QuantizedStorage], cols: Optional[QuantizedStorage],
                  col_starts: Optional[list[int]], views: bool, row_starts: Optional[list[int]]
                  ) -> Optional[GroupedTensor]:
    """The experts' tensors as joined copies when each one is only views of the shared
    encodings (what ``_direct_storage`` builds for every expert, with one usage for all): the
    unpadded rowwise encoding, and a columnwise copy handed out as column-slice views
    (``COLUMN_VIEWS``) or shared with the rows (Identity). None otherwise (hybrids, an expert
    without a quantizer or with its own encoding, FP8 block's per-expert contiguous copies)."""
    qs = list(quantizers)
    if (row_starts is not None or not qs or sum(splits) == 0
            or None in qs or any_hybrid(qs)):
        return None
    usage = {(q.rowwise_usage, q.columnwise_usage) for q in qs}
    if len(usage) > 1:
        return None
    rowwise, columnwise = usage.pop()
    joined: dict[str, JoinedCopy] = {}
    if row_local_mode(qs[0]) == SHARED:  # Identity: one payload, both copies (the rows read transposed)
        if rows is None:
            return None
        p = rows.payloads[ROWWISE]
        whole = rebuild(rows, p, p, qs[0].label, sum(splits))
        joined = {d: JoinedCopy(whole, None) for d, use in ((ROWWISE, rowwise), (COLUMNWISE, columnwise)) if use}
    else:
        if rowwise:
            if rows is None:
                return None
            joined[ROWWISE] = JoinedCopy(rows, None)
        if columnwise:
            if cols is None or col_starts is None or not views:
                return None
            joined[COLUMNWISE] = JoinedCopy(cols, list(col_starts))
    if not joined:
        return None
    return GroupedTensor(splits, joined, partial(_cut_experts, qs, list(splits)))


def _hybrid_group(quantizers: Sequence[Optional[Quantizer]], splits: Sequence[int],
                  rows: Optional[QuantizedStorage], cols: Optional[QuantizedStorage],
                  col_starts: Optional[list[int]], views: bool, row_starts: Optional[list[int]],
                  dtype: torch.dtype) -> Optional[GroupedTensor]:
    """``expert_group`` for hybrids: every expert's rowwise part a row slice of the shared
    rowwise encoding (at ``row_starts`` if the groups were padded) and, if asked for, its
    columnwise part a column-slice view of the shared columnwise one — what ``_expert_storage``
    builds — and no idle child that ``_expert_storage`` would have ``observe`` the input (a
    side effect that must not wait for a lazy build). None otherwise."""
    qs = list(quantizers)
    if not qs or sum(splits) == 0 or any(not is_hybrid(q) for q in qs) or rows is None:
        return None
    usage = {(q.rowwise_usage, q.columnwise_usage, q.columnwise_source) for q in qs}
    if len(usage) > 1:
        return None
    rowwise, columnwise, source = usage.pop()
    if not rowwise or (not columnwise and source == "original"):
        return None  # an idle child observes the input
    joined = {ROWWISE: JoinedCopy(rows, None if row_starts is None else list(row_starts))}
    if columnwise:
        if cols is None or col_starts is None or not views:
            return None
        joined[COLUMNWISE] = JoinedCopy(cols, list(col_starts))
    return GroupedTensor(splits, joined, partial(_cut_hybrids, qs, list(splits), dtype))


def scaled_hybrid_group(quantizers: Sequence[Optional[Quantizer]], splits: Sequence[int], hg: HybridGroups,
                         starts: list[int], dtype: torch.dtype) -> Optional[GroupedTensor]:
    """``_hybrid_group`` for ``nvfp4_mxfp8_groups``' experts (NVFP4 with each expert's global
    amax -> MXFP8; Composer-2's weights): the rowwise joined copy is the padded groups' codes as
    one row-scaled NVFP4 storage (each row with its expert's amax), the columnwise one the
    shared MXFP8 copy; the per-expert tensors (``_cut_scaled_hybrids``) are the storages the
    per-expert path builds: plain 1D NVFP4 rows with the expert's own amax. None unless every
    expert is a hybrid of one usage reading its rows."""
    qs = list(quantizers)
    if not qs or sum(splits) == 0 or any(not is_hybrid(q) for q in qs):
        return None
    usage = {(q.rowwise_usage, q.columnwise_usage) for q in qs}
    if len(usage) > 1:
        return None
    rowwise, columnwise = usage.pop()
    if not rowwise:
        return None
    joined = {ROWWISE: JoinedCopy(hg.whole_rows, list(starts))}
    if columnwise:
        joined[COLUMNWISE] = JoinedCopy(hg.cols, list(starts))
    return GroupedTensor(splits, joined, partial(_cut_scaled_hybrids, qs, list(splits), dtype))


def assemble_scaled(quantizers: Sequence[Optional[Quantizer]], x: torch.Tensor, splits: Sequence[int],
                     q0: Quantizer) -> GroupedResult:
    """Plain quantizers whose every copy comes from one grouped encoding: each expert keeps the
    copies its usage asks for; a ``GroupedTensor`` on the joined copies where every expert
    keeps the same ones (``_scaled_group``)."""
    used = [q for q in quantizers if q is not None]
    scaled = encode_group_scaled(q0, x, splits, any(q.rowwise_usage for q in used),
                                 any(q.columnwise_usage for q in used))
    group = _scaled_group(quantizers, splits, scaled, x.dtype)
    if group is not None:
        return group
    fp8_dtype = getattr(q0, "dtype", None)
    out: list[Optional[QuantizedTensor]] = []
    for q, part, m in zip(quantizers, scaled.parts(), splits):
        if q is None:
            out.append(None)
            continue
        row = part.payloads[ROWWISE] if q.rowwise_usage else None
        col = part.payloads[COLUMNWISE] if q.columnwise_usage else None
        if row is part.payloads[ROWWISE] and col is part.payloads[COLUMNWISE]:
            # the expert keeps every copy the encoding wrote: its part is its storage (built
            # fresh for this call, nobody else holds it), labelled, not rebuilt
            part.label = q.label
            out.append(QuantizedTensor(part, q))
            continue
        storage = rebuild(part, row, col, q.label, m)
        storage.columnwise_zero_tail = col is not None and part.columnwise_zero_tail
        out.append(QuantizedTensor(storage, q))
    joined = scaled_joined(scaled, x.dtype, fp8_dtype, all(q.rowwise_usage for q in used),
                           all(q.columnwise_usage for q in used))
    return GroupedTensor(splits, joined, experts=out) if joined and sum(splits) else out


def scaled_joined(scaled: GroupScaled, dtype: torch.dtype, fp8_dtype: Optional[torch.dtype], rowwise: bool,
                  columnwise: bool) -> dict[str, JoinedCopy]:
    """The joined copies behind a grouped per-tensor-scaled encoding's parts, for the directions
    asked for that it wrote: FP8 current scaling's codes at scale 1 with each expert's
    ``scale_inv`` (``JoinedCopy.scales``); NVFP4's rows as one row-scaled storage (each row with
    its expert's amax: the decode carries each expert's global scale per row)."""
    j = scaled.fp8
    joined: dict[str, JoinedCopy] = {}
    if j is None:
        if rowwise and scaled.whole_rows is not None:
            joined[ROWWISE] = JoinedCopy(scaled.whole_rows(), None)
        return joined
    one = device_constant([1.0], j.scale_inv.device).reshape(())  # the codes' own scale
    if rowwise and j.rows is not None:
        joined[ROWWISE] = JoinedCopy(Float8Storage(j.rows.shape, dtype, {"data": j.rows, "scale_inv": one}, None,
                                                   fp8_dtype=fp8_dtype), None, j.scale_inv)
    if columnwise and j.cols is not None:
        c, width = j.cols.shape
        joined[COLUMNWISE] = JoinedCopy(Float8Storage(torch.Size((width, c)), dtype, None,
                                                      {"data": j.cols, "scale_inv": one}, fp8_dtype=fp8_dtype),
                                        list(j.col_starts), j.scale_inv)
    return joined


def _scaled_group(quantizers: Sequence[Optional[Quantizer]], splits: Sequence[int], scaled: GroupScaled,
                  dtype: torch.dtype) -> Optional[GroupedTensor]:
    """FP8 current-scaled experts of one usage as their joined copies (``JoinedCopy`` with each
    expert's ``scale_inv`` in ``scales``; the codes' storages at scale 1), the per-expert
    tensors (``fp8_parts``: the storages each expert's own quantize holds) built on access."""
    qs = list(quantizers)
    j = scaled.fp8
    # a list comprehension, not a generator: one Python frame, not one per expert
    if j is None or not qs or sum(splits) == 0 or any([q is None for q in qs]):
        return None
    usage = {(q.rowwise_usage, q.columnwise_usage) for q in qs}
    if len(usage) > 1:
        return None
    rowwise, columnwise = usage.pop()
    fp8_dtype = qs[0].dtype
    joined = scaled_joined(scaled, dtype, fp8_dtype, rowwise, columnwise)
    return GroupedTensor(splits, joined, partial(_cut_scaled, qs, list(splits), dtype, fp8_dtype))


def _direct_storage(q: Quantizer, rows: Optional[QuantizedStorage], cols: Optional[QuantizedStorage],
                    row_payload: Optional[Payload], col_payload: Optional[Payload],
                    m: int) -> Optional[QuantizedStorage]:
    """A plain quantizer's expert storage straight from the shared payloads, when every copy it
    asks for is shared: the storage ``_expert_storage`` makes, as one object instead of a part
    per copy rebuilt again into it (64 experts: 2-3 storages each per quantization). None where
    that path is needed (hybrids, a copy the expert encodes itself)."""
    if is_hybrid(q) or rows is None and cols is None:
        return None
    if row_local_mode(q) == SHARED:  # one payload serves both copies (Identity)
        if rows is None:
            return None
        return rebuild(rows, row_payload if q.rowwise_usage else None,
                        row_payload if q.columnwise_usage else None, q.label, m)
    if (q.rowwise_usage and rows is None) or (q.columnwise_usage and (cols is None or col_payload is None)):
        return None
    return rebuild(rows if q.rowwise_usage else cols, row_payload if q.rowwise_usage else None,
                   col_payload if q.columnwise_usage else None, q.label, m)


def _expert_storage(q: Quantizer, xe: torch.Tensor, row_part: Optional[QuantizedStorage],
                    col_part: Optional[QuantizedStorage]) -> QuantizedStorage:
    """Expert storage as ``q.encode(x_e, ...)`` builds it, from the shared parts (and the
    expert's own encoding of a copy that is not shared)."""
    shape = torch.Size(xe.shape)
    if is_hybrid(q):
        if q.columnwise_usage and col_part is None:
            src = row_part.dequantize(torch.float32, ROWWISE) if derives_columnwise(q) else xe
            col_part = q.columnwise_quantizer.encode(src, False, True, None)
        elif not q.columnwise_usage and q.columnwise_source == "original":
            q.columnwise_quantizer.observe(xe)  # as the hybrid does for its idle child
        if not q.rowwise_usage and not derives_columnwise(q):
            q.rowwise_quantizer.observe(xe)
        return HybridStorage(shape, xe.dtype, row_part if q.rowwise_usage else None, col_part, label=q.label)
    if row_local_mode(q) == SHARED:  # one payload serves both copies (Identity)
        part = row_part if row_part is not None else q.encode(xe, True, False, None)
        p = part.payloads[ROWWISE]
        return rebuild(part, p if q.rowwise_usage else None, p if q.columnwise_usage else None,
                        q.label, shape[0])
    if q.columnwise_usage and col_part is None:
        if row_part is None and q.rowwise_usage:  # nothing shared for this expert: one call
            return q.encode(xe, True, True, None)
        col_part = q.encode(xe, False, True, None)
    if q.rowwise_usage and row_part is None:
        row_part = q.encode(xe, True, False, None)
    like = row_part if row_part is not None else col_part
    out = rebuild(like, row_part.payloads[ROWWISE] if row_part is not None and q.rowwise_usage else None,
                   col_part.payloads[COLUMNWISE] if col_part is not None else None, q.label, shape[0])
    return out


def _cut_experts(qs: list[Quantizer], splits: list[int], joined: dict[str, JoinedCopy]) -> list[QuantizedTensor]:
    """The per-expert tensors of ``expert_group``'s joined copies: the storages
    ``_direct_storage`` makes, holding the directions ``joined`` holds."""
    rowwise, columnwise = ROWWISE in joined, COLUMNWISE in joined
    out: list[QuantizedTensor] = []
    if row_local_mode(qs[0]) == SHARED:
        whole = next(iter(joined.values())).storage
        for q, p, m in zip(qs, _row_payloads(whole, splits), splits):
            out.append(QuantizedTensor(rebuild(whole, p if rowwise else None, p if columnwise else None,
                                                q.label, m), q))
        return out
    rows = joined[ROWWISE].storage if rowwise else None
    row_pl = _row_payloads(rows, splits) if rows is not None else None
    cols = joined[COLUMNWISE] if columnwise else None
    col_pl = _column_payloads(cols.storage, cols.starts, splits, True) if cols is not None else None
    for e, (q, m) in enumerate(zip(qs, splits)):
        like = rows if rows is not None else cols.storage
        s = rebuild(like, row_pl[e] if row_pl is not None else None, col_pl[e] if col_pl is not None else None,
                     q.label, m)
        out.append(QuantizedTensor(s, q))
    return out


def _cut_hybrids(qs: list[Quantizer], splits: list[int], dtype: torch.dtype,
                 joined: dict[str, JoinedCopy]) -> list[QuantizedTensor]:
    """The per-expert hybrid tensors of ``_hybrid_group``'s joined copies (``_expert_storage``'s
    hybrid storages), holding the directions ``joined`` holds."""
    rows, cols = joined.get(ROWWISE), joined.get(COLUMNWISE)
    row_pl = _row_payloads(rows.storage, splits, rows.starts) if rows is not None else None
    col_pl = _column_payloads(cols.storage, cols.starts, splits, True) if cols is not None else None
    width = (rows or cols).storage.cols
    out: list[QuantizedTensor] = []
    for e, (q, m) in enumerate(zip(qs, splits)):
        row_part = (rebuild(rows.storage, row_pl[e], None, q.rowwise_quantizer.label, m)
                    if rows is not None else None)
        col_part = None
        if cols is not None:
            col_part = rebuild(cols.storage, None, col_pl[e], q.columnwise_quantizer.label, m)
        out.append(QuantizedTensor(HybridStorage(torch.Size((m, width)), dtype, row_part, col_part, label=q.label), q))
    return out


def _cut_scaled_hybrids(qs: list[Quantizer], splits: list[int], dtype: torch.dtype,
                        joined: dict[str, JoinedCopy]) -> list[QuantizedTensor]:
    """The per-expert hybrid tensors of ``scaled_hybrid_group``'s joined copies: rows as plain
    1D NVFP4 with the expert's amax (its rows' amax in the row-scaled joined copy; 0 for an
    expert without rows, as the segmented amax gives), columns as ``_cut_hybrids`` cuts them."""
    rows, cols = joined[ROWWISE], joined.get(COLUMNWISE)
    whole = rows.storage
    p = whole.payload(ROWWISE)
    zero = p["amax"].new_zeros(())
    amax = torch.stack([p["amax"][s] if m else zero for s, m in zip(rows.starts, splits)])
    row_parts = expert_nvfp4_rows(type(whole), {n: t for n, t in p.items() if n != "amax"}, amax, splits,
                                  rows.starts, whole.cols, whole.dtype, {**whole.meta, "row_scaled": False})
    col_pl = _column_payloads(cols.storage, cols.starts, splits, True) if cols is not None else None
    out: list[QuantizedTensor] = []
    for e, (q, m, row_part) in enumerate(zip(qs, splits, row_parts)):
        row_part.label = q.rowwise_quantizer.label
        col_part = None
        if cols is not None:
            col_part = rebuild(cols.storage, None, col_pl[e], q.columnwise_quantizer.label, m)
        out.append(QuantizedTensor(HybridStorage(torch.Size((m, whole.cols)), dtype, row_part, col_part, label=q.label), q))
    return out


def _cut_scaled(qs: list[Quantizer], splits: list[int], dtype: torch.dtype, fp8_dtype: torch.dtype,
                joined: dict[str, JoinedCopy]) -> list[QuantizedTensor]:
    """The per-expert tensors of ``_scaled_group``'s joined copies."""
    rows, cols = joined.get(ROWWISE), joined.get(COLUMNWISE)
    some = rows or cols
    j = Fp8Joined(rows.storage.payload(ROWWISE)["data"] if rows is not None else None,
                  cols.storage.payload(COLUMNWISE)["data"] if cols is not None else None,
                  some.scales, list(cols.starts) if cols is not None else [])
    parts = fp8_parts(j, splits, dtype, fp8_dtype, [q.label for q in qs])
    return [QuantizedTensor(p, q) for p, q in zip(parts, qs)]


def rebuild(like: QuantizedStorage, row: Optional[Payload], col: Optional[Payload], label: str,
             rows: int) -> QuantizedStorage:
    """A storage of ``like``'s class, dtype and options with these payloads and ``rows`` rows
    (an expert's own storage, not marked as a slice)."""
    shape = torch.Size((rows, like.shape[-1]))
    return type(like)(shape, like.dtype, row, col, label=label, **like.meta)


def _row_payloads(storage: QuantizedStorage, splits: Sequence[int],
                  starts: Optional[Sequence[int]] = None) -> list[Payload]:
    """Every expert's rowwise payload from a shared copy (groups of whole row blocks): row-slice
    views, one split per payload tensor for all experts when unpadded (``starts`` None), else
    rows [starts[e], starts[e] + m_e) of a copy of the padded groups."""
    index = storage._row_index[ROWWISE]
    out: list[Payload] = [{} for _ in splits]
    for name, t in storage.payload(ROWWISE).items():
        axis, div = index[name]  # shared formats hold no per-tensor entry (None)
        if starts is None:
            parts = torch.split(t, [ceil_div(m, div) for m in splits], dim=axis)
        else:
            parts = [t.narrow(axis, s // div, ceil_div(m, div)) for s, m in zip(starts, splits)]
        for p, part in zip(out, parts):
            p[name] = part
    return out


def _column_payloads(storage: QuantizedStorage, starts: Sequence[int], splits: Sequence[int],
                     views: bool) -> list[Payload]:
    """Every expert's columnwise payload: rows [start_e, start_e + m_e) of the shared copy:
    column-slice views of its transposed tensors (``views``, no copy: the grouped GEMM decodes
    them as one buffer, the ``GroupedTensor``'s joined copy; copying every slice would cost the MXFP8 MoE
    layer a copy pass per expert that path never reads: ``python -m bench.bench_moe``), else
    each expert's own contiguous copy of its slice (far cheaper than a scatter through an int64
    index per element)."""
    index = storage._row_index[COLUMNWISE]
    out: list[Payload] = [{} for _ in splits]
    for name, t in storage.payload(COLUMNWISE).items():
        if index[name] is None:  # a per-tensor entry (none in the shared block formats)
            for p in out:
                p[name] = t
            continue
        axis, div = index[name]
        if axis != 1:
            raise AssertionError(f"{type(storage).__name__} columnwise {name}: expected row index on axis 1")
        for p, part in zip(out, column_slices(t, [s // div for s in starts], [ceil_div(m, div) for m in splits])):
            p[name] = part if views else part.contiguous()
    return out
