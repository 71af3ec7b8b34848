"""``quantize_grouped``: quantize the row groups of one tensor (an MoE layer's experts), each
with its own quantizer, in as few calls as the formats allow.

Expert e owns rows ``[o_e, o_e + m_e)`` of ``x`` and quantizes them with ``quantizers[e]``
(usage flags as set on it). The result is, bit for bit, what ``quantizers[e].quantize(x_e)``
gives, but a copy whose blocks never need to straddle two experts is encoded once for all
experts and handed out per expert as views (row slices; each expert's columnwise tensors
copied per expert into contiguous tensors):

- rowwise copies that are *row-local* (``ROW_LOCAL``: every row's codes and scales depend on
  that row alone — Identity, MXFP8 1x32, FP8 block 1x128, row-scaled NVFP4) are encoded once
  and sliced into views (adjacent: ``gemm.joined.joined_rows`` reads them without a copy);
  *tile-local* ones (``ROW_TILE``: MXFP8 32x32, FP8 block 128x128) likewise when every group
  is a multiple of the tile height (an MoE layer's stacked weights, ``quantize_weights_grouped``).
- columnwise copies with blocks along the rows and no per-tensor scale (``COLUMN_BLOCK``: MXFP8
  32x1, FP8 block 128x1 and 128x128) are encoded once from the groups zero-padded to whole
  blocks (zeros never raise a block amax, and a group's blocks then hold only its own rows).
- per-tensor-scaled copies whose scale comes from the tensor's own amax (``GROUP_SCALED``: FP8
  current scaling, rowwise and columnwise; the rowwise copy of 1D NVFP4 with a global amax) are
  encoded once too: a segmented amax gives every expert its own amax, and one cast pass scales
  each row by its expert's value (the same bits as the expert's own quantize); the FP8
  columnwise copy is written directly as each expert's own transpose [K, m_e].
- delayed scaling (each expert records its amax into its own history), other per-tensor copies
  and copies with random draws are encoded per expert, as the per-expert loop does.

A hybrid with ``columnwise_source="rowwise_dequantized"`` derives its columnwise source from
the rowwise copies (dequantized once when they are shared).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

import torch

from ..formats import fp8_tensorwise, nvfp4
from ..formats.common import amax_nan, ceil_div, check_input, saturating_cast_fp8
from ..tensors import Float8Storage, HybridStorage, NVFP4Storage, QuantizedStorage, QuantizedTensor
from ..tensors.storage import COLUMNWISE, ROWWISE, Payload
from . import fast
from .backends import select_quantize_kernel
from .base import Quantizer, all_reduce_amax
from .float8 import Float8CurrentScalingQuantizer
from .float8_block import Float8BlockQuantizer
from .hybrid import HybridQuantizer
from .identity import IdentityQuantizer
from .mxfp8 import MXFP8Quantizer
from .nvfp4 import NVFP4Quantizer

#: How a quantizer's rowwise copy relates to its rows: ``SEPARATE`` — row-local, and the
#: columnwise copy is a separate encoding; ``SHARED`` — row-local, and both copies are the same
#: payload (Identity); None — not row-local (per-tensor or 2D scales).
SEPARATE, SHARED = "separate", "shared"
ROW_LOCAL: dict[type, Callable[[Quantizer], Optional[str]]] = {
    IdentityQuantizer: lambda q: SHARED,
    MXFP8Quantizer: lambda q: None if q.with_2d_quantization else SEPARATE,
    Float8BlockQuantizer: lambda q: SEPARATE if q.block_scaling_dim == 1 else None,
    # row scaling excludes RHT, 2D and stochastic rounding (the quantizer refuses them)
    NVFP4Quantizer: lambda q: SEPARATE if q.row_scaled_nvfp4 else None,
}
#: Tile height of a 2D-scaled rowwise copy (codes and scales depend on whole tiles of rows).
ROW_TILE: dict[type, Callable[[Quantizer], Optional[int]]] = {
    MXFP8Quantizer: lambda q: 32 if q.with_2d_quantization else None,
    Float8BlockQuantizer: lambda q: 128 if q.block_scaling_dim == 2 else None,
}
#: Rows per block of a columnwise copy that holds block scales only (no per-tensor entry).
COLUMN_BLOCK: dict[type, Callable[[Quantizer], Optional[int]]] = {
    MXFP8Quantizer: lambda q: 32,
    Float8BlockQuantizer: lambda q: 128,
}


def row_local_mode(q: Quantizer) -> Optional[str]:
    """``SEPARATE`` / ``SHARED`` if ``q``'s rowwise copy is row-local (see ``ROW_LOCAL``), else None."""
    if q.uses_randomness():  # random draws are laid out per tensor, not per row
        return None
    rule = ROW_LOCAL.get(type(q))
    return None if rule is None else rule(q)


def _row_block(q: Quantizer) -> Optional[int]:
    """Rows that ``q``'s rowwise codes depend on together: 1 (row-local), a tile height, or None."""
    if row_local_mode(q) is not None:
        return 1
    rule = ROW_TILE.get(type(q))
    return None if rule is None or q.uses_randomness() else rule(q)


#: Which copies a grouped per-tensor-scaled encoding (``GROUP_SCALED``, module end) writes.
ROWS, BOTH = "rowwise", "both"


def group_scaled_mode(q: Quantizer) -> Optional[str]:
    """``BOTH`` / ``ROWS`` if ``q``'s per-tensor-scaled copies (both, or the rowwise one) can be
    encoded for all experts at once (see ``GROUP_SCALED``), else None."""
    if q.uses_randomness():
        return None
    entry = GROUP_SCALED.get(type(q))
    return None if entry is None else entry.copies(q)


def _column_block(q: Quantizer) -> Optional[int]:
    """Rows per block of ``q``'s columnwise copy if groups padded to it can share one encoding."""
    rule = COLUMN_BLOCK.get(type(q))
    return None if rule is None or q.uses_randomness() else rule(q)


def quantize_grouped(quantizers: Sequence[Optional[Quantizer]], x: torch.Tensor,
                     splits: Sequence[int]) -> list[Optional[QuantizedTensor]]:
    """``[quantizers[e].quantize(x_e) for each row group x_e of x]``, bitwise, with shared
    encodings where the formats allow (module docstring). ``quantizers[e] is None``: expert e
    needs no copy (its entry is None). ``x``: [Σ splits, K] high-precision, no autograd (call it
    inside an autograd.Function or under no_grad)."""
    splits = [int(m) for m in splits]
    if len(quantizers) != len(splits):
        raise ValueError(f"quantize_grouped: {len(quantizers)} quantizers for {len(splits)} row groups; "
                         "pass one (or None) per expert.")
    if x.dim() != 2 or x.shape[0] != sum(splits):
        raise ValueError(f"quantize_grouped: x must be [{sum(splits)}, K] (the row groups stacked); "
                         f"got {tuple(x.shape)}.")
    if x.requires_grad and torch.is_grad_enabled():
        raise ValueError("quantize_grouped does not record autograd; call it with grad disabled "
                         "(inside an autograd.Function) or on x.detach().")
    used = [q for q in quantizers if q is not None]
    plan = _plan(quantizers, splits)
    if plan is None:
        return [None if q is None else q.quantize(xe) for q, xe in zip(quantizers, torch.split(x, splits))]
    for q in used:
        if not (q.rowwise_usage or q.columnwise_usage):
            raise ValueError(f"{q!r} has rowwise_usage=False and columnwise_usage=False: "
                             "enable at least one with set_usage().")
    check_input(x, f"input of {used[0]!r}" + (f" (role: {used[0].label})" if used[0].label else ""))
    return _quantize_planned(quantizers, plan, x, splits)


def quantize_weights_grouped(quantizers: Sequence[Quantizer], weights: Sequence[torch.Tensor]
                             ) -> list[QuantizedTensor]:
    """``[q.quantize(w) for q, w in zip(quantizers, weights)]`` for experts' [N, K] weights of
    one shape, bitwise: the weights are stacked to [E*N, K] (one copy) and quantized as row
    groups of N rows, so row-local / tile-local copies and columnwise block copies (N a whole
    number of blocks: no padding) are encoded once for all experts."""
    shape = weights[0].shape
    if any(w.shape != shape or w.dim() != 2 for w in weights):
        raise ValueError(f"quantize_weights_grouped: the experts' weights must be 2D of one shape; got "
                         f"{sorted({tuple(w.shape) for w in weights})}.")
    with torch.no_grad():
        if not _worth_stacking(quantizers, weights):
            return [q.quantize(w) for q, w in zip(quantizers, weights)]
        stacked = torch.stack(list(weights)).reshape(-1, shape[1])
        out = quantize_grouped(list(quantizers), stacked, [shape[0]] * len(weights))
    return [t for t in out if t is not None]


def _worth_stacking(quantizers: Sequence[Quantizer], weights: Sequence[torch.Tensor]) -> bool:
    """Whether one encoding of the stacked weights saves work: some copy is shared, and not
    only Identity passthroughs (each expert's is a view of its weight; stacking would copy)."""
    if len(weights) < 2 or len({w.dtype for w in weights}) > 1:
        return False
    plan = _plan(list(quantizers), [weights[0].shape[0]] * len(weights))
    if plan is None:
        return False
    return any(q is not None and not isinstance(q, IdentityQuantizer) for q in (plan.row_q, plan.col_q))


# ---------------------------------------------------------------------------- planning
class _Plan:
    """What is shared: the rowwise quantizer and its row block (or None: per expert), the
    columnwise quantizer and its row block (or None), and ``scaled``: ``ROWS`` / ``BOTH`` when
    row_q's rowwise copy (``BOTH``: every copy of plain quantizers) comes from one grouped
    per-tensor-scaled encoding (``encode_group_scaled``)."""

    def __init__(self, row_q: Optional[Quantizer], row_block: Optional[int],
                 col_q: Optional[Quantizer], col_block: Optional[int], scaled: Optional[str] = None) -> None:
        self.row_q, self.row_block, self.col_q, self.col_block = row_q, row_block, col_q, col_block
        self.scaled = scaled


def _rowwise_child(q: Quantizer) -> Quantizer:
    return q.rowwise_quantizer if isinstance(q, HybridQuantizer) else q


def _columnwise_child(q: Quantizer) -> Quantizer:
    return q.columnwise_quantizer if isinstance(q, HybridQuantizer) else q


def _derives_columnwise(q: Quantizer) -> bool:
    return (isinstance(q, HybridQuantizer) and q.columnwise_usage
            and q.columnwise_source == "rowwise_dequantized")


def _same_settings(qs: Sequence[Quantizer]) -> bool:
    first = qs[0]
    return all(type(q) is type(first) and q.settings() == first.settings() for q in qs)


def _plan(quantizers: Sequence[Optional[Quantizer]], splits: Sequence[int]) -> Optional[_Plan]:
    """The shared encodings for these experts, or None when nothing can be shared (then each
    expert quantizes on its own, ``quantize`` and all)."""
    used = [q for q in quantizers if q is not None]
    if not used or any(q.uses_randomness() for q in used):
        return None  # random draws are seeded per quantize() call: keep the calls
    if any("quantize" in vars(q) for q in used):
        return None  # quantize() wrapped on the instance (hooks, spies): it must see every call
    if len({(type(q), getattr(q, "columnwise_source", None)) for q in used}) > 1:
        return None
    scaled = _scaled_plan(used)
    if scaled == BOTH:  # plain quantizers: the grouped encoding holds every copy
        return _Plan(_rowwise_child(used[0]), None, None, None, BOTH)
    row_q, row_block = (_rowwise_child(used[0]), None) if scaled else _row_plan(used, splits)
    col_q, col_block = _col_plan(quantizers, used, row_q is not None)
    if row_q is None and col_q is None:
        return None
    return _Plan(row_q, row_block, col_q, col_block, scaled)


def _scaled_plan(used: Sequence[Quantizer]) -> Optional[str]:
    """``BOTH`` / ``ROWS`` (see ``_Plan``) if the experts' per-tensor scales can come from one
    grouped encoding: one setting, one amax-reduction group, and the copies it writes are read."""
    rows = [_rowwise_child(q) for q in used]
    mode = group_scaled_mode(rows[0])
    if mode is None or not _same_settings(rows):
        return None
    if len({(getattr(q, "with_amax_reduction", False), id(getattr(q, "amax_reduction_group", None)))
            for q in rows}) > 1:
        return None
    hybrid = isinstance(used[0], HybridQuantizer)
    if mode == BOTH and not hybrid:
        return BOTH
    if not hybrid and any(q.columnwise_usage for q in used):
        return None  # its columnwise copy is the expert's own encoding, sharing the expert's amax
    return ROWS if any(q.rowwise_usage or _derives_columnwise(q) for q in used) else None


def _row_plan(used: Sequence[Quantizer], splits: Sequence[int]) -> tuple[Optional[Quantizer], Optional[int]]:
    if not any(q.rowwise_usage or _derives_columnwise(q) for q in used):
        return None, None  # nobody reads the rows: a shared encoding would be wasted work
    rows = [_rowwise_child(q) for q in used]
    block = _row_block(rows[0])
    if block is None or not _same_settings(rows) or any(m % block for m in splits):
        return None, None
    return rows[0], block


def _col_plan(quantizers: Sequence[Optional[Quantizer]], used: Sequence[Quantizer],
              rows_shared: bool) -> tuple[Optional[Quantizer], Optional[int]]:
    if not any(q.columnwise_usage for q in used):
        return None, None
    cols = [_columnwise_child(q) for q in used]
    block = _column_block(cols[0])
    if block is None or not _same_settings(cols):
        return None, None
    if any(_derives_columnwise(q) for q in used) and not rows_shared:
        # the derived source is then made per expert: every expert must make it
        if any(q is None or not _derives_columnwise(q) for q in quantizers):
            return None, None
    return cols[0], block


# ---------------------------------------------------------------------------- encoding
def _offsets(splits: Sequence[int], block: int) -> list[int]:
    """Start row of each group once every group is padded to whole blocks."""
    out, at = [], 0
    for m in splits:
        out.append(at)
        at += ceil_div(m, block) * block
    return out


def _padded(src: torch.Tensor, splits: Sequence[int], block: int) -> tuple[torch.Tensor, list[int]]:
    """``src`` with each row group zero-padded to a multiple of ``block`` rows (no copy when
    every group already is), and the groups' start rows."""
    starts = _offsets(splits, block)
    if all(m % block == 0 for m in splits):
        return src, starts
    total = starts[-1] + ceil_div(splits[-1], block) * block
    # destination row of source row r: r + (padding before its group), in O(1) ops for all groups
    shifts = torch.tensor([p - s for p, s in zip(starts, _offsets(splits, 1))], device=src.device)
    counts = torch.tensor(splits, device=src.device)
    index = torch.arange(src.shape[0], device=src.device) + torch.repeat_interleave(
        shifts, counts, output_size=src.shape[0])  # output_size: no device sync
    out = src.new_zeros(total, src.shape[1])
    out.index_copy_(0, index, src)
    return out, starts


def _row_payloads(storage: QuantizedStorage, splits: Sequence[int]) -> list[Payload]:
    """Every expert's rowwise payload from an unpadded shared copy (groups of whole row blocks):
    row-slice views, one split per payload tensor for all experts."""
    index = storage._row_index[ROWWISE]
    out: list[Payload] = [{} for _ in splits]
    for name, t in storage.payload(ROWWISE).items():
        axis, div = index[name]  # shared formats hold no per-tensor entry (None)
        for p, part in zip(out, torch.split(t, [ceil_div(m, div) for m in splits], dim=axis)):
            p[name] = part
    return out


def _quantize_planned(quantizers: Sequence[Optional[Quantizer]], plan: _Plan, x: torch.Tensor,
                      splits: Sequence[int]) -> list[Optional[QuantizedTensor]]:
    used = [q for q in quantizers if q is not None]
    starts = _offsets(splits, 1)
    if plan.scaled == BOTH:
        return _assemble_scaled(quantizers, x, splits, plan.row_q)
    if (plan.row_q is not None and plan.col_q is plan.row_q  # one plain quantizer for both copies
            and all(m % plan.col_block == 0 for m in splits)):
        # no padding (e.g. stacked weights): one call writes both copies (one kernel pass)
        both = plan.row_q.encode(x, True, True, None)
        return _assemble(quantizers, x, splits, both, both, starts, [])
    rows = plan.row_q.encode(x, True, False, None) if plan.row_q is not None and not plan.scaled else None
    own_rows: list[Optional[QuantizedStorage]] = [None] * len(splits)
    scaled_rows: Optional[torch.Tensor] = None
    if plan.scaled:  # every expert's rowwise copy from one grouped encoding (its own amax)
        scaled = encode_group_scaled(plan.row_q, x, splits, True, False)
        own_rows = [_rebuild(p, p.payloads[ROWWISE], None, _rowwise_child(q).label, m)
                    if q is not None and (q.rowwise_usage or _derives_columnwise(q)) else None
                    for q, p, m in zip(quantizers, scaled.parts, splits)]
        scaled_rows = scaled.rows_fp32() if any(_derives_columnwise(q) for q in used) else None
    elif rows is None:  # per expert, where read (rowwise usage or a derived columnwise source)
        for e, (q, s, m) in enumerate(zip(quantizers, starts, splits)):
            if q is not None and (q.rowwise_usage or _derives_columnwise(q)):
                own_rows[e] = _rowwise_child(q).encode(x[s:s + m], True, False, None)
    cols, col_starts = None, None
    if plan.col_q is not None:
        if any(_derives_columnwise(q) for q in used):
            # the forward's value exactly, in FP32 (as HybridQuantizer.reference_encode)
            src = (rows.dequantize(torch.float32, ROWWISE) if rows is not None else scaled_rows
                   if scaled_rows is not None else
                   torch.cat([r.dequantize(torch.float32, ROWWISE) for r in own_rows]))
        else:
            src = x
        padded, col_starts = _padded(src, splits, plan.col_block)
        cols = plan.col_q.encode(padded, False, True, None)
    return _assemble(quantizers, x, splits, rows, cols, col_starts, own_rows)


def _assemble(quantizers: Sequence[Optional[Quantizer]], x: torch.Tensor, splits: Sequence[int],
              rows: Optional[QuantizedStorage], cols: Optional[QuantizedStorage],
              col_starts: Optional[list[int]], own_rows: Sequence[Optional[QuantizedStorage]]
              ) -> list[Optional[QuantizedTensor]]:
    """Each expert's tensor from the shared encodings (``rows`` unpadded; ``cols`` with groups
    starting at ``col_starts``) or its own rowwise encoding (``own_rows``)."""
    starts = _offsets(splits, 1)
    row_payloads = _row_payloads(rows, splits) if rows is not None else None
    col_payloads = (_column_payloads(cols, col_starts, splits)
                    if cols is not None and any(q is not None and q.columnwise_usage for q in quantizers) else None)
    out: list[Optional[QuantizedTensor]] = []
    for e, (q, s, m) in enumerate(zip(quantizers, starts, splits)):
        if q is None:
            out.append(None)
            continue
        row_part = None
        if q.rowwise_usage or _derives_columnwise(q) or (rows is not None and row_local_mode(q) == SHARED):
            row_part = (_rebuild(rows, row_payloads[e], None, _rowwise_child(q).label, m)
                        if rows is not None else own_rows[e])
        col_part = None
        if q.columnwise_usage and cols is not None:
            col_part = _rebuild(cols, None, col_payloads[e], _columnwise_child(q).label, m)
        out.append(QuantizedTensor(_expert_storage(q, x[s:s + m], row_part, col_part), q))
    return out


def _expert_storage(q: Quantizer, xe: torch.Tensor, row_part: Optional[QuantizedStorage],
                    col_part: Optional[QuantizedStorage]) -> QuantizedStorage:
    """Expert storage as ``q.encode(x_e, ...)`` builds it, from the shared parts (and the
    expert's own encoding of a copy that is not shared)."""
    shape = torch.Size(xe.shape)
    if isinstance(q, HybridQuantizer):
        if q.columnwise_usage and col_part is None:
            src = row_part.dequantize(torch.float32, ROWWISE) if _derives_columnwise(q) else xe
            col_part = q.columnwise_quantizer.encode(src, False, True, None)
        elif not q.columnwise_usage and q.columnwise_source == "original":
            q.columnwise_quantizer.observe(xe)  # as the hybrid does for its idle child
        if not q.rowwise_usage and not _derives_columnwise(q):
            q.rowwise_quantizer.observe(xe)
        return HybridStorage(shape, xe.dtype, row_part if q.rowwise_usage else None, col_part, label=q.label)
    if row_local_mode(q) == SHARED:  # one payload serves both copies (Identity)
        part = row_part if row_part is not None else q.encode(xe, True, False, None)
        p = part.payloads[ROWWISE]
        return _rebuild(part, p if q.rowwise_usage else None, p if q.columnwise_usage else None,
                        q.label, shape[0])
    if q.columnwise_usage and col_part is None:
        if row_part is None and q.rowwise_usage:  # nothing shared for this expert: one call
            return q.encode(xe, True, True, None)
        col_part = q.encode(xe, False, True, None)
    if q.rowwise_usage and row_part is None:
        row_part = q.encode(xe, True, False, None)
    like = row_part if row_part is not None else col_part
    return _rebuild(like, row_part.payloads[ROWWISE] if row_part is not None and q.rowwise_usage else None,
                    col_part.payloads[COLUMNWISE] if col_part is not None else None, q.label, shape[0])


def _rebuild(like: QuantizedStorage, row: Optional[Payload], col: Optional[Payload], label: str,
             rows: int) -> QuantizedStorage:
    """A storage of ``like``'s class, dtype and options with these payloads and ``rows`` rows
    (an expert's own storage, not marked as a slice)."""
    shape = torch.Size((rows, like.shape[-1]))
    return type(like)(shape, like.dtype, row, col, label=label, **like.meta)


# ---------------------------------------------------------------------------- per-tensor scales
class GroupScaled(NamedTuple):
    """A grouped per-tensor-scaled encoding: every expert's storage (its own amax and scale; the
    copies asked for) and the rowwise copies dequantized, stacked [Σ m_e, K] FP32 (a callable:
    only a derived columnwise source needs it)."""

    parts: list[QuantizedStorage]
    rows_fp32: Callable[[], torch.Tensor]


class _GroupScaledRule(NamedTuple):
    copies: Callable[[Quantizer], Optional[str]]  # BOTH / ROWS / None (these settings: per expert)
    encode: Callable[[Quantizer, torch.Tensor, Sequence[int], bool, bool, bool], GroupScaled]


def encode_group_scaled(q: Quantizer, x: torch.Tensor, splits: Sequence[int], rowwise: bool,
                        columnwise: bool, *, kernel: Optional[bool] = None) -> GroupScaled:
    """The copies of every row group of 2D ``x`` as ``q.encode(x_e, rowwise, columnwise)`` makes
    them, bitwise, for a quantizer with ``group_scaled_mode(q)`` (``columnwise`` only for
    ``BOTH``), from one segmented amax and one cast pass. ``kernel``: the Triton kernels
    (``kernels/triton_grouped_fp8.py``, ``triton_nvfp4``) or the PyTorch formats; None: the
    kernels where q's own encode would take one (CUDA), else PyTorch. Labels are left empty."""
    splits = [int(m) for m in splits]
    if kernel is None:
        kernel = x.numel() > 0 and select_quantize_kernel(q, x, rowwise, columnwise) is not None
    with fast._on_device(x):
        return GROUP_SCALED[type(q)].encode(q, x, splits, rowwise, columnwise, kernel)


def _assemble_scaled(quantizers: Sequence[Optional[Quantizer]], x: torch.Tensor, splits: Sequence[int],
                     q0: Quantizer) -> list[Optional[QuantizedTensor]]:
    """Plain quantizers whose every copy comes from one grouped encoding: each expert keeps the
    copies its usage asks for."""
    used = [q for q in quantizers if q is not None]
    scaled = encode_group_scaled(q0, x, splits, any(q.rowwise_usage for q in used),
                            any(q.columnwise_usage for q in used))
    out: list[Optional[QuantizedTensor]] = []
    for q, part, m in zip(quantizers, scaled.parts, splits):
        if q is None:
            out.append(None)
            continue
        row = part.payloads[ROWWISE] if q.rowwise_usage else None
        col = part.payloads[COLUMNWISE] if q.columnwise_usage else None
        out.append(QuantizedTensor(_rebuild(part, row, col, q.label, m), q))
    return out


def _reduced(q: Quantizer, amax: torch.Tensor) -> torch.Tensor:
    """Every expert's amax all-reduced as its own quantizer would (MAX is elementwise)."""
    if getattr(q, "with_amax_reduction", False):
        return all_reduce_amax(amax, q.amax_reduction_group)
    return amax


def _group_tensors(splits: Sequence[int], device: torch.device) -> tuple[torch.Tensor, ...]:
    """(group of each row, first row of each group, rows of each group), int32 on ``device``."""
    meta = torch.tensor([_offsets(splits, 1), list(splits)], dtype=torch.int32).to(device)
    start, count = meta.unbind(0)
    group = torch.arange(len(splits), dtype=torch.int32, device=device).repeat_interleave(
        count, output_size=sum(splits))  # output_size: no device sync
    return group, start, count


def _per_row(values: torch.Tensor, counts: torch.Tensor, rows: int) -> torch.Tensor:
    """Each group's value repeated over its rows ([G] -> [rows])."""
    return values.repeat_interleave(counts, output_size=rows)


def _segment_amax(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """max|x| of every row group (FP32 [G]; NaN propagates; 0 for an empty group), as
    ``amax_nan`` of each group alone (a max is exact whatever the order)."""
    return torch.segment_reduce(amax_nan(x, dim=1), "max", lengths=counts, unsafe=True, initial=0.0)


#: Integer dtype of each element size: payloads move as raw bits (any dtype, float8 included).
_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _block_offsets(sizes: Sequence[int], element_size: int) -> tuple[list[int], int]:
    """(start of each block, total) in elements for blocks laid end to end, each starting 16-byte
    aligned: cuBLAS reads its operand pointers 16-byte aligned, as a fresh tensor is."""
    align = max(16 // element_size, 1)
    starts, at = [], 0
    for n in sizes:
        starts.append(at)
        at += ceil_div(n, align) * align
    return starts, at


def _column_blocks(t: torch.Tensor, widths: Sequence[int]) -> list[torch.Tensor]:
    """Column group e of ``t`` [K, W] (``widths[e]`` columns, any strides) as its own contiguous
    [K, w_e] tensor, all views of one buffer written by one scatter (``_block_offsets``). With
    ``t = data.t()`` they are the row groups' transposes (``triton_grouped_fp8``'s layout)."""
    k, w = t.shape
    offs, total = _block_offsets([k * wd for wd in widths], t.element_size())
    meta = torch.tensor([_offsets(widths, 1), list(widths), offs]).to(t.device)
    start, width, off = meta.unbind(0)
    start_c, width_c, off_c = (_per_row(v, width, w) for v in (start, width, off))
    j = torch.arange(w, device=t.device)
    dest = (off_c + j - start_c)[None, :] + torch.arange(k, device=t.device)[:, None] * width_c[None, :]
    bits = _BITS_DTYPE[t.element_size()]
    flat = torch.empty(total, dtype=bits, device=t.device)
    flat.index_put_((dest,), t.view(bits))
    flat = flat.view(t.dtype)
    return [flat.as_strided((k, wd), (wd, 1), o) for wd, o in zip(widths, offs)]


def _column_payloads(storage: QuantizedStorage, starts: Sequence[int], splits: Sequence[int]) -> list[Payload]:
    """Every expert's columnwise payload: rows [start_e, start_e + m_e) of the shared copy
    (columns of its transposed tensors), each expert's tensors its own contiguous copy.

    One column slice copied per expert and payload tensor. (A single scatter for all experts
    through an int64 index per element measured far slower on the H200 for large experts:
    the MXFP8 MoE layer with 8 experts of ffn 14336 went from 101 to 148 ms.)"""
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
        for p, s, m in zip(out, starts, splits):
            p[name] = t.narrow(1, s // div, ceil_div(m, div)).contiguous()
    return out


def _fp8_current_groups(q: Quantizer, x: torch.Tensor, splits: Sequence[int], rowwise: bool,
                        columnwise: bool, kernel: bool) -> GroupScaled:
    """FP8 current scaling per expert (SPEC §2.1): scale_e from expert e's amax."""
    rows, cols = x.shape
    counts = torch.tensor(list(splits), device=x.device)
    cds: Optional[list[torch.Tensor]] = None
    if kernel:
        k = fast._kernels("triton_grouped_fp8")
        group, start, count = _group_tensors(splits, x.device)
        amax = _reduced(q, k.group_amax(x, group, len(splits)))
        offs, total = _block_offsets([cols * m for m in splits], 1)
        rd, cd, sinv = k.quantize(x, amax, group, start, count, q.dtype, eps=q.amax_epsilon,
                                  power_2_scale=q.force_pow_2_scales, rowwise=rowwise, columnwise=columnwise,
                                  col_offset=torch.tensor(offs).to(x.device), col_numel=total)
        if cd is not None:
            cds = [cd.as_strided((cols, m), (m, 1), o) for m, o in zip(splits, offs)]
    else:
        amax = _reduced(q, _segment_amax(x, counts))
        scale = fp8_tensorwise.current_scale(amax, q.dtype, eps=q.amax_epsilon, power_2_scale=q.force_pow_2_scales)
        sinv = torch.ones_like(scale) / scale  # IEEE division, as fp8_tensorwise.quantize
        data = saturating_cast_fp8(x.float() * _per_row(scale, counts, rows)[:, None], q.dtype)
        rd = data if rowwise else None
        cds = _column_blocks(data.t(), splits) if columnwise else None
    sinvs = sinv.unbind(0)
    rds = torch.split(rd, list(splits)) if rd is not None else None
    parts: list[QuantizedStorage] = []
    for e, m in enumerate(splits):
        row = {"data": rds[e], "scale_inv": sinvs[e]} if rds is not None else None
        col = {"data": cds[e], "scale_inv": sinvs[e]} if cds is not None else None
        parts.append(Float8Storage(torch.Size((m, cols)), x.dtype, row, col, fp8_dtype=q.dtype))

    def rows_fp32() -> torch.Tensor:
        return rd.float() * _per_row(sinv, counts, rows)[:, None]  # each expert's decode
    return GroupScaled(parts, rows_fp32)


def _nvfp4_groups(q: Quantizer, x: torch.Tensor, splits: Sequence[int], rowwise: bool,
                  columnwise: bool, kernel: bool) -> GroupScaled:
    """1D NVFP4 rowwise copies, each with its expert's global amax: row-scaled NVFP4 with the
    expert's amax on each of its rows (SPEC §2.5's arithmetic is per row either way)."""
    if columnwise or not rowwise:
        raise ValueError("grouped NVFP4 encodes the rowwise copy only; quantize the columnwise copy per expert.")
    rows, cols = x.shape
    counts = torch.tensor(list(splits), device=x.device)
    if kernel:
        group, _, _ = _group_tensors(splits, x.device)
        amax = _reduced(q, fast._kernels("triton_grouped_fp8").group_amax(x, group, len(splits)))
        row_amax = amax[group]
        (data, scale), _ = fast._kernels("triton_nvfp4").quantize_1d(x, row_amax, None)
    else:
        amax = _reduced(q, _segment_amax(x, counts))
        row_amax = _per_row(amax, counts, rows)
        data, scale = nvfp4.quantize_1d(x, row_amax)
    meta = q.storage_meta()
    parts: list[QuantizedStorage] = [
        NVFP4Storage(torch.Size((m, cols)), x.dtype, {"data": d, "scale": s, "amax": a}, None, **meta)
        for m, d, s, a in zip(splits, torch.split(data, list(splits)), torch.split(scale, list(splits)),
                              amax.unbind(0))]

    def rows_fp32() -> torch.Tensor:
        whole = NVFP4Storage(x.shape, x.dtype, {"data": data, "scale": scale, "amax": row_amax}, None,
                             **{**meta, "row_scaled": True})
        return whole.decode(ROWWISE)  # q x S_dec_b x S_dec per row: each expert's decode
    return GroupScaled(parts, rows_fp32)


#: Quantizers whose per-tensor scale comes from the tensor's own amax, so every expert's scale
#: can come from one segmented amax: which copies one grouped encoding writes, and how.
GROUP_SCALED: dict[type, _GroupScaledRule] = {
    Float8CurrentScalingQuantizer: _GroupScaledRule(lambda q: BOTH, _fp8_current_groups),
    # 1D with a global amax: the rowwise copy (RHT concerns the columnwise copy only; row-scaled
    # NVFP4 is row-local already, 2D tiles straddle rows)
    NVFP4Quantizer: _GroupScaledRule(
        lambda q: None if q.with_2d_quantization or q.row_scaled_nvfp4 else ROWS, _nvfp4_groups),
}
