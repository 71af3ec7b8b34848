"""``quantize_grouped``: quantize the row groups of one tensor (an MoE layer's experts), each
with its own quantizer, in as few calls as the formats allow.

Expert e owns rows ``[o_e, o_e + m_e)`` of ``x`` and quantizes them with ``quantizers[e]``
(usage flags as set on it). The result is, bit for bit, what ``quantizers[e].quantize(x_e)``
gives, but a copy whose blocks never need to straddle two experts is encoded once for all
experts and handed out per expert as views (row slices of the rowwise tensors; column slices
of the transposed MXFP8 columnwise ones, ``COLUMN_VIEWS``; FP8 block columnwise copies as each
expert's own contiguous copy, for its per-expert cuBLAS GEMMs):

- rowwise copies that are *row-local* (``ROW_LOCAL``: every row's codes and scales depend on
  that row alone — Identity, MXFP8 1x32, FP8 block 1x128, row-scaled NVFP4) are encoded once
  and sliced into views (adjacent: ``moe.joined.joined_rows`` reads them without a copy);
  *tile-local* ones (``ROW_TILE``: MXFP8 32x32, FP8 block 128x128) likewise when every group
  is a multiple of the tile height (an MoE layer's stacked weights, ``quantize_weights_grouped``).
- columnwise copies with blocks along the rows and no per-tensor scale (``COLUMN_BLOCK``: MXFP8
  32x1, FP8 block 128x1 and 128x128) are encoded once from the groups zero-padded to whole
  blocks (zeros never raise a block amax, and a group's blocks then hold only its own rows).
- per-tensor-scaled copies whose scale comes from the tensor's own amax (``GROUP_SCALED``: FP8
  current scaling, rowwise and columnwise; the rowwise copy of 1D NVFP4 with a global amax) are
  encoded once too: a segmented amax gives every expert its own amax, and one cast pass scales
  each row by its expert's value (the same bits as the expert's own quantize); the FP8
  columnwise copy is written directly as each expert's own transpose [K, m_e]
  (``quantize_scaled.py``).
- delayed scaling (each expert records its amax into its own history), other per-tensor copies
  and copies with random draws are encoded per expert, as the per-expert loop does.

A hybrid with ``columnwise_source="rowwise_dequantized"`` derives its columnwise source from
the rowwise copies (dequantized once when they are shared).
"""

from __future__ import annotations

from functools import partial
from itertools import repeat
from operator import attrgetter, contains
from typing import Callable, Optional, Sequence, Union

import torch

from ..config import current_policy
from ..formats.common import HIGH_PRECISION_DTYPES, ceil_div, check_input
from ..utils.device import device_constant, device_tensor, step_metadata
from ..tensors import (DecodedMXFP8Storage, Float8Storage, HybridStorage, MXFP8Storage, QuantizedStorage,
                       QuantizedTensor)
from .expert_tensors import ExpertTensors, JoinedCopy
from ..tensors.slicing import adjacent_rows, column_slices
from ..tensors.storage import COLUMNWISE, ROWWISE, Payload
from ..quantizers import fast
from ..quantizers.backends import QUANTIZE_KERNELS, row_mapped_kernel
from ..quantizers.base import Quantizer
from ..quantizers.float8_block import Float8BlockQuantizer
from ..quantizers.hybrid import HybridQuantizer
from ..quantizers.identity import IdentityQuantizer
from ..quantizers.mxfp8 import MXFP8Quantizer
from ..quantizers.nvfp4 import NVFP4Quantizer
from .quantize_scaled import (BOTH, ROWS, Fp8Joined, GroupScaled, HybridGroups, _offsets, encode_group_scaled,
                             expert_nvfp4_rows, fp8_parts, fused_nvfp4_mxfp8_supported, group_scaled_mode,
                             nvfp4_mxfp8_groups)

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
#: Columnwise copies handed to the experts as column-slice views of the shared encoding: the
#: grouped GEMM decodes them as one buffer (``moe.joined.joined_columns``: MXFP8, BF16 path).
#: Other shared block copies (FP8 block: per-expert cuBLAS FP8 GEMMs, which read contiguous
#: operands) get one contiguous copy per expert here, once, not one per GEMM call.
COLUMN_VIEWS: tuple[type, ...] = (MXFP8Storage, DecodedMXFP8Storage)
#: Rows per block of a columnwise copy that holds block scales only (no per-tensor entry).
COLUMN_BLOCK: dict[type, Callable[[Quantizer], Optional[int]]] = {
    MXFP8Quantizer: lambda q: 32,
    Float8BlockQuantizer: lambda q: 128,
}


def _pad_rows_kernel():
    """``kernels.moe.triton_pad_rows``, imported at first use (triton is optional)."""
    from ..kernels.moe import triton_pad_rows
    return triton_pad_rows


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


def _column_block(q: Quantizer) -> Optional[int]:
    """Rows per block of ``q``'s columnwise copy if groups padded to it can share one encoding."""
    rule = COLUMN_BLOCK.get(type(q))
    return None if rule is None or q.uses_randomness() else rule(q)


GroupedResult = Union[list[Optional[QuantizedTensor]], ExpertTensors]


def quantize_grouped(quantizers: Sequence[Optional[Quantizer]], x: torch.Tensor,
                     splits: Sequence[int], plans: Optional[PlanMemo] = None) -> GroupedResult:
    """``[quantizers[e].quantize(x_e) for each row group x_e of x]``, bitwise, with shared
    encodings where the formats allow (module docstring). ``quantizers[e] is None``: expert e
    needs no copy (its entry is None). ``x``: [Σ splits, K] high-precision, no autograd (call it
    inside an autograd.Function or under no_grad).

    Where every expert's tensor is only views of the shared encodings (plain quantizers of one
    usage, every copy shared: Identity, MXFP8), the result is an ``ExpertTensors``: a sequence of
    the same per-expert tensors, built on first access, that also hands the shared encodings to
    the grouped GEMM and the saved-for-backward record (``moe/expert_tensors.py``)."""
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
    plan = _plan(quantizers, splits, plans)
    if plan is None:
        return [None if q is None else q.quantize(xe) for q, xe in zip(quantizers, torch.split(x, splits))]
    for q in used:
        if not (q.rowwise_usage or q.columnwise_usage):
            raise ValueError(f"{q!r} has rowwise_usage=False and columnwise_usage=False: "
                             "enable at least one with set_usage().")
    check_input(x, f"input of {used[0]!r}" + (f" (role: {used[0].label})" if used[0].label else ""))
    return _quantize_planned(quantizers, plan, x, splits)


def quantize_weights_grouped(quantizers: Sequence[Quantizer], weights: Sequence[torch.Tensor],
                             plans: Optional[PlanMemo] = None, stacked: Optional[torch.Tensor] = None
                             ) -> Union[list[QuantizedTensor], ExpertTensors]:
    """``[q.quantize(w) for q, w in zip(quantizers, weights)]`` for experts' [N, K] weights of
    one shape, bitwise: the weights are stacked to [E*N, K] (a view when they are consecutive
    blocks of one buffer, else one copy) and quantized as row
    groups of N rows, so row-local / tile-local copies and columnwise block copies (N a whole
    number of blocks: no padding) are encoded once for all experts. ``stacked``: the caller's
    [E, N, K] tensor whose ``unbind(0)`` views ``weights`` are (``GroupedLinear(single_parameter=
    True)``), used as the stack without checking the views one by one."""
    shape = weights[0].shape
    if any(w.shape != shape or w.dim() != 2 for w in weights):
        raise ValueError(f"quantize_weights_grouped: the experts' weights must be 2D of one shape; got "
                         f"{sorted({tuple(w.shape) for w in weights})}.")
    if stacked is not None and (stacked.dim() != 3 or stacked.shape[0] != len(weights) or stacked.shape[1:] != shape
                                or not stacked.is_contiguous()):
        raise ValueError(f"quantize_weights_grouped: stacked must be the contiguous [{len(weights)}, "
                         f"{', '.join(map(str, shape))}] tensor the weights are views of; got "
                         f"{tuple(stacked.shape)}, strides {stacked.stride()}.")
    with torch.no_grad():
        if not _worth_stacking(quantizers, weights, plans, stacked):
            if _passthrough(quantizers, weights):
                return (_passthrough_group(quantizers, weights, stacked)
                        or [_wrap_weight(q, w) for q, w in zip(quantizers, weights)])
            return [q.quantize(w) for q, w in zip(quantizers, weights)]
        # weights that are consecutive blocks of one buffer (views of a stacked [E, N, K]
        # tensor) are viewed as the stack; otherwise one stacking copy (GroupedLinear's own
        # experts are separate tensors: views of one buffer would share one version counter,
        # and changing one expert would re-quantize them all)
        if stacked is None:
            stacked = adjacent_rows(list(weights))
        if stacked is None:
            stacked = torch.stack(list(weights))
        stacked = stacked.reshape(-1, shape[1])
        out = quantize_grouped(list(quantizers), stacked, [shape[0]] * len(weights), plans)
    return out if isinstance(out, ExpertTensors) else [t for t in out if t is not None]


def _passthrough(quantizers: Sequence[Quantizer], weights: Sequence[torch.Tensor]) -> bool:
    """Whether every expert's quantize() is an Identity passthrough with no cast (its tensor
    wraps the weight itself): plain ``IdentityQuantizer`` instances (no subclass, nothing
    wrapped on the instance, no quantize kernel registered for them) asked for some copy, of
    the weights' own dtype (None or equal), weights of a dtype quantizers read."""
    if QUANTIZE_KERNELS.get(IdentityQuantizer):
        return False
    return all(type(q) is IdentityQuantizer and not ({"quantize", "encode", "reference_encode"} & vars(q).keys())
               and q.dtype in (None, w.dtype) and w.dtype in HIGH_PRECISION_DTYPES
               and (q.rowwise_usage or q.columnwise_usage) for q, w in zip(quantizers, weights))


def _passthrough_group(quantizers: Sequence[Quantizer], weights: Sequence[torch.Tensor],
                       stacked: Optional[torch.Tensor] = None) -> Optional[ExpertTensors]:
    """The passthrough experts (``_passthrough``) as one joined Identity copy when the weights
    are consecutive blocks of one buffer (``GroupedLinear``'s packed weights, or ``stacked``):
    its per-expert tensors are ``_wrap_weight``'s (the same values, as views of the buffer)."""
    if stacked is None:
        stacked = adjacent_rows(list(weights)) if len(weights) > 1 else None
    elif len(weights) < 2:
        stacked = None
    if stacked is None or any(q.rowwise_usage != quantizers[0].rowwise_usage
                              or q.columnwise_usage != quantizers[0].columnwise_usage for q in quantizers):
        return None
    rows = quantizers[0].reference_encode(stacked.reshape(-1, weights[0].shape[1]), True, False)
    return _expert_group(quantizers, [weights[0].shape[0]] * len(weights), rows, None, None, False, None)


def _wrap_weight(q: IdentityQuantizer, w: torch.Tensor) -> QuantizedTensor:
    """``q.quantize(w)`` for a passthrough ``q`` (``_passthrough``), without its dispatch
    (quantize -> encode -> kernel lookup, host work repeated per expert, timed by ``python -m
    bench.bench_moe_overhead``): the reference encode,
    which wraps the detached weight, one payload for both copies."""
    return QuantizedTensor(q.reference_encode(w.detach(), q.rowwise_usage, q.columnwise_usage), q)


def _worth_stacking(quantizers: Sequence[Quantizer], weights: Sequence[torch.Tensor],
                    plans: Optional[PlanMemo] = None, stacked: Optional[torch.Tensor] = None) -> bool:
    """Whether one encoding of the stacked weights saves work: some copy is shared, and not
    only Identity passthroughs (each expert's is a view of its weight; stacking would copy),
    and, for per-tensor scales (``BOTH``: the stack shares launches, not encodings), weights
    small enough that the stacking copy costs less than the launches it saves
    (the policy's ``stack_scaled_max_numel``), or already one buffer."""
    if len(weights) < 2 or len({w.dtype for w in weights}) > 1:
        return False
    plan = _plan(list(quantizers), [weights[0].shape[0]] * len(weights), plans)
    if plan is None:
        return False
    if plan.scaled == BOTH and weights[0].numel() > current_policy().stack_scaled_max_numel:
        return stacked is not None or adjacent_rows(list(weights)) is not None
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
        # whether any / every expert derives its columnwise source from its rowwise value: set by
        # ``_new_plan`` (usage is part of a remembered plan's key, so they hold while it is used)
        self.derives_any = self.derives_all = False


#: type -> whether it is a HybridQuantizer (the plan asks for every expert of every call: a dict
#: lookup instead of an ABC isinstance check)
_HYBRID_TYPES: dict[type, bool] = {}


def _is_hybrid(q: Optional[Quantizer]) -> bool:
    return _is_type_hybrid(type(q))


def _any_hybrid(qs: Sequence[Optional[Quantizer]]) -> bool:
    """Whether some quantizer in ``qs`` is a hybrid (one lookup per distinct type, not per
    expert: this is asked for every expert list of every call)."""
    return any(map(_is_type_hybrid, set(map(type, qs))))


def _is_type_hybrid(t: type) -> bool:
    hybrid = _HYBRID_TYPES.get(t)
    if hybrid is None:
        hybrid = _HYBRID_TYPES[t] = issubclass(t, HybridQuantizer)
    return hybrid


def _rowwise_child(q: Quantizer) -> Quantizer:
    return q.rowwise_quantizer if _is_hybrid(q) else q


def _columnwise_child(q: Quantizer) -> Quantizer:
    return q.columnwise_quantizer if _is_hybrid(q) else q


def _derives_columnwise(q: Quantizer) -> bool:
    return _is_hybrid(q) and q.columnwise_usage and q.columnwise_source == "rowwise_dequantized"


def _same_settings(qs: Sequence[Quantizer]) -> bool:
    first = qs[0]
    kind, ref = type(first), first.settings()
    return all(q is first or (type(q) is kind and q.settings() == ref) for q in qs)


#: A caller's memo of plans (``quantize_grouped(..., plans=)``): ``_plan_key`` -> plan. The owner
#: of the quantizers keeps it (``GroupedLinear``: one per module, emptied when its quantizers are
#: rebuilt), so it lives and dies with them and never mixes two owners' quantizers. At 64 experts
#: planning walks every expert's quantizer a dozen times a call, four calls per layer and step.
PlanMemo = dict
#: Entries a memo keeps before it starts over (usage and split patterns of one module: a few).
PLANS_KEPT = 32


_USAGE = attrgetter("rowwise_usage", "columnwise_usage")
_ROWWISE_CHILD = attrgetter("rowwise_quantizer")


def _plan_key(quantizers: Sequence[Optional[Quantizer]], splits: Sequence[int]) -> tuple:
    """What a plan may depend on that can change on live quantizers: their identities (settings
    are constructor arguments, fixed for their life), usage flags, instance-level ``quantize``
    wrappers, their rowwise children's amax-reduction groups; and the splits' divisibility by
    a row block (1, 32 or 128). Built with C-level maps: it runs for every expert of every call."""
    used = [q for q in quantizers if q is not None]
    kinds = set(map(type, used))
    if not any(map(_is_type_hybrid, kinds)):
        children = used
    elif all(map(_is_type_hybrid, kinds)):
        children = list(map(_ROWWISE_CHILD, used))
    else:
        children = [_rowwise_child(q) for q in used]
    return (tuple(map(id, quantizers)), tuple(map(_USAGE, used)),
            any(map(contains, map(vars, used), repeat("quantize"))),
            tuple([(getattr(c, "with_amax_reduction", False), id(getattr(c, "amax_reduction_group", None)))
                   for c in children]),
            not any(map((32).__rmod__, splits)), not any(map((128).__rmod__, splits)))  # m % 32, m % 128


def _plan(quantizers: Sequence[Optional[Quantizer]], splits: Sequence[int],
          plans: Optional[PlanMemo] = None) -> Optional[_Plan]:
    """The shared encodings for these experts, or None when nothing can be shared (then each
    expert quantizes on its own, ``quantize`` and all); taken from / kept in ``plans`` when
    given (the key holds ids: the memo's owner keeps those quantizers alive while it lives)."""
    if plans is None:
        return _new_plan(quantizers, splits)
    key = _plan_key(quantizers, splits)
    try:
        return plans[key]
    except KeyError:
        pass
    if len(plans) >= PLANS_KEPT:
        plans.clear()
    plan = plans[key] = _new_plan(quantizers, splits)
    return plan


def _new_plan(quantizers: Sequence[Optional[Quantizer]], splits: Sequence[int]) -> Optional[_Plan]:
    """``_plan`` computed afresh."""
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
    plan = _Plan(row_q, row_block, col_q, col_block, scaled)
    derives = [_derives_columnwise(q) for q in used]
    plan.derives_any, plan.derives_all = any(derives), all(derives)
    return plan


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
def pad_row_groups(src: torch.Tensor, splits: Sequence[int], block: int) -> tuple[torch.Tensor, list[int]]:
    """``src`` with each row group zero-padded to a multiple of ``block`` rows (no copy when
    every group already is), and the groups' start rows. On CUDA one Triton pass
    (``kernels/moe/triton_pad_rows.py``); elsewhere a zero fill and an ``index_copy_``."""
    starts = _offsets(splits, block)
    if not any(map(block.__rmod__, splits)):  # every m % block == 0: no padding
        return src, starts
    total = _padded_total(splits, block, starts)
    if current_policy().quantize_kernels and fast._device_ok(src) and (src.shape[1] <= 1 or src.stride(1) == 1):
        with fast._on_device(src):
            return _pad_rows_kernel().pad_rows(src, _row_map(splits, starts, total, src)), starts
    out = src.new_zeros(total, src.shape[1])
    out.index_copy_(0, _padded_rows(src, splits, starts), src)
    return out, starts


def encode_padded_columns(q: Quantizer, src: torch.Tensor, splits: Sequence[int], block: int,
                          rowwise: bool = False) -> tuple[Optional[QuantizedStorage], QuantizedStorage, list[int]]:
    """(``q.encode(src, True, False)`` if ``rowwise`` else None, ``q``'s columnwise-only encode
    of ``pad_row_groups(src, splits, block)``, the groups' start rows). Where a kernel reads
    rows through a row map (``row_mapped_kernel``: MXFP8 1D on CUDA) the padded copy is never
    written and both copies come from one read of ``src`` (one pass instead of three: rowwise,
    padding, columnwise)."""
    starts = _offsets(splits, block)
    if any(map(block.__rmod__, splits)) and src.dim() == 2:  # some m % block: padding
        total = _padded_total(splits, block, starts)
        run = row_mapped_kernel(q, src, total)
        if run is not None:
            rows, cols = run(q, src, _row_map(splits, starts, total, src), rowwise)
            return rows, cols, starts
    rows = q.encode(src, True, False, None) if rowwise else None
    padded, starts = pad_row_groups(src, splits, block)
    return rows, q.encode(padded, False, True, None), starts


def _padded_total(splits: Sequence[int], block: int, starts: Sequence[int]) -> int:
    """Rows of the zero-padded groups (``starts``: their start rows)."""
    return starts[-1] + ceil_div(splits[-1], block) * block


def _padded_rows(src: torch.Tensor, splits: Sequence[int], starts: Sequence[int]) -> torch.Tensor:
    """The destination row in the padded groups of every source row of ``src``."""
    return padded_row_index(splits, starts, src.device)


def padded_row_index(splits: Sequence[int], starts: Sequence[int], device: torch.device) -> torch.Tensor:
    """int64 [Σ splits]: for every row of the groups stacked unpadded, its row in a layout
    where group e starts at row ``starts[e]`` (zero-padded groups; a padded encode read back),
    in O(1) ops for all groups: row r moves down by the padding before its group. Shared by the
    calls of one routing (``utils.device.step_metadata``): read-only."""
    splits, starts = tuple(map(int, splits)), tuple(starts)

    def build() -> torch.Tensor:
        total = sum(splits)
        shifts, counts = device_tensor([[p - s for p, s in zip(starts, _offsets(splits, 1))], list(splits)],
                                       device).unbind(0)
        return torch.arange(total, device=device) + torch.repeat_interleave(
            shifts, counts, output_size=total)  # output_size: no device sync
    return step_metadata(("padded rows", splits, starts), device, build)


def _row_map(splits: Sequence[int], starts: Sequence[int], total: int, src: torch.Tensor) -> torch.Tensor:
    """int32 [total]: the source row of each padded row, -1 for padding (what the kernels read);
    shared by the calls of one routing (``utils.device.step_metadata``): read-only."""
    def build() -> torch.Tensor:
        row_map = torch.full((total,), -1, dtype=torch.int32, device=src.device)
        row_map[_padded_rows(src, splits, starts)] = torch.arange(src.shape[0], dtype=torch.int32, device=src.device)
        return row_map
    return step_metadata(("row map", tuple(splits), tuple(starts), total), src.device, build)


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


def _quantize_planned(quantizers: Sequence[Optional[Quantizer]], plan: _Plan, x: torch.Tensor,
                      splits: Sequence[int]) -> list[Optional[QuantizedTensor]]:
    used = [q for q in quantizers if q is not None]
    starts = _offsets(splits, 1)
    if plan.scaled == BOTH:
        return _assemble_scaled(quantizers, x, splits, plan.row_q)
    if _one_hybrid_pass(plan, used):
        # one hybrid encode of the zero-padded groups: its rowwise copy (row-local: the padding
        # rows change no other row) read at the groups' padded starts, and the columnwise copy
        # derived from it in the same kernel pass (the fused hybrid kernel on CUDA), instead of
        # a dequantized FP32 copy of the rows written and read back
        padded, col_starts = pad_row_groups(x, splits, plan.col_block)
        both = used[0].encode(padded, True, True, None)
        return _assemble(quantizers, x, splits, both.part(ROWWISE), both.part(COLUMNWISE), col_starts, [],
                         row_starts=col_starts)
    if (plan.row_q is not None and plan.col_q is plan.row_q  # one plain quantizer for both copies
            and not any(map(plan.col_block.__rmod__, splits))):  # every m % col_block == 0
        # no padding (e.g. stacked weights): one call writes both copies (one kernel pass)
        both = plan.row_q.encode(x, True, True, None)
        return _assemble(quantizers, x, splits, both, both, starts, [])
    if (plan.scaled == ROWS and plan.col_q is not None and plan.derives_all
            and fused_nvfp4_mxfp8_supported(used[0], x)):
        # NVFP4 (per-expert global amax) -> MXFP8 from the rowwise value: one fused kernel pass
        # over the zero-padded groups writes both copies (no FP32 dequantized copy in memory)
        padded, col_starts = pad_row_groups(x, splits, plan.col_block)
        hg = nvfp4_mxfp8_groups(used[0], padded, splits, col_starts)
        group = _scaled_hybrid_group(quantizers, splits, hg, col_starts, x.dtype)
        if group is not None:
            return group
        own_rows = [_rebuild(p, p.payloads[ROWWISE], None, _rowwise_child(q).label, m) if q is not None else None
                    for q, p, m in zip(quantizers, hg.rows(), splits)]
        return _assemble(quantizers, x, splits, None, hg.cols, col_starts, own_rows)
    if (plan.row_q is not None and plan.col_q is plan.row_q and not plan.scaled
            and not plan.derives_any):
        # one plain quantizer for both copies of padded groups: one encode of x writes its
        # rowwise copy and the padded groups' columnwise copy (a row-mapped kernel) where one fits
        rows, cols, col_starts = encode_padded_columns(plan.row_q, x, splits, plan.col_block, rowwise=True)
        return _assemble(quantizers, x, splits, rows, cols, col_starts, [None] * len(splits))
    rows = plan.row_q.encode(x, True, False, None) if plan.row_q is not None and not plan.scaled else None
    own_rows: list[Optional[QuantizedStorage]] = [None] * len(splits)
    scaled_rows: Optional[torch.Tensor] = None
    if plan.scaled:  # every expert's rowwise copy from one grouped encoding (its own amax)
        scaled = encode_group_scaled(plan.row_q, x, splits, True, False)
        own_rows = [_rebuild(p, p.payloads[ROWWISE], None, _rowwise_child(q).label, m)
                    if q is not None and (q.rowwise_usage or _derives_columnwise(q)) else None
                    for q, p, m in zip(quantizers, scaled.parts(), splits)]
        scaled_rows = scaled.rows_fp32() if plan.derives_any else None
    elif rows is None:  # per expert, where read (rowwise usage or a derived columnwise source)
        for e, (q, s, m) in enumerate(zip(quantizers, starts, splits)):
            if q is not None and (q.rowwise_usage or _derives_columnwise(q)):
                own_rows[e] = _rowwise_child(q).encode(x[s:s + m], True, False, None)
    cols, col_starts = None, None
    if plan.col_q is not None:
        if plan.derives_any:
            # the forward's value exactly, in FP32 (as HybridQuantizer.reference_encode)
            src = (rows.dequantize(torch.float32, ROWWISE) if rows is not None else scaled_rows
                   if scaled_rows is not None else
                   torch.cat([r.dequantize(torch.float32, ROWWISE) for r in own_rows]))
        else:
            src = x
        _, cols, col_starts = encode_padded_columns(plan.col_q, src, splits, plan.col_block)
    return _assemble(quantizers, x, splits, rows, cols, col_starts, own_rows)


def _one_hybrid_pass(plan: _Plan, used: Sequence[Quantizer]) -> bool:
    """Whether every expert's copies come from one encode of the padded groups by the (shared
    settings of the) experts' hybrid: a row-local rowwise child, a columnwise block child
    derived from the rowwise value, every expert deriving it."""
    return (plan.row_q is not None and plan.row_block == 1 and not plan.scaled and plan.col_q is not None
            and plan.derives_all)


def _assemble(quantizers: Sequence[Optional[Quantizer]], x: torch.Tensor, splits: Sequence[int],
              rows: Optional[QuantizedStorage], cols: Optional[QuantizedStorage],
              col_starts: Optional[list[int]], own_rows: Sequence[Optional[QuantizedStorage]],
              row_starts: Optional[list[int]] = None) -> list[Optional[QuantizedTensor]]:
    """Each expert's tensor from the shared encodings (``rows`` with groups starting at
    ``row_starts``, default unpadded; ``cols`` with groups starting at ``col_starts``) or its
    own rowwise encoding (``own_rows``); an ``ExpertTensors`` where they are views only."""
    views = isinstance(cols, COLUMN_VIEWS)
    group = (_hybrid_group(quantizers, splits, rows, cols, col_starts, views, row_starts, x.dtype)
             if _any_hybrid(quantizers) else
             _expert_group(quantizers, splits, rows, cols, col_starts, views, row_starts))
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
                                 col_payloads[e] if col_payloads is not None else None, views, m)
        if direct is not None:
            out.append(QuantizedTensor(direct, q))
            continue
        row_part = None
        if q.rowwise_usage or _derives_columnwise(q) or (rows is not None and row_local_mode(q) == SHARED):
            row_part = (_rebuild(rows, row_payloads[e], None, _rowwise_child(q).label, m)
                        if rows is not None else own_rows[e])
        col_part = None
        if q.columnwise_usage and cols is not None:
            col_part = _rebuild(cols, None, col_payloads[e], _columnwise_child(q).label, m)
            col_part.columnwise_zero_padded = views  # slices of the zero-padded groups (``pad_row_groups``)
        out.append(QuantizedTensor(_expert_storage(q, xs[e], row_part, col_part), q))
    return out


def _expert_group(quantizers: Sequence[Optional[Quantizer]], splits: Sequence[int],
                  rows: Optional[QuantizedStorage], cols: Optional[QuantizedStorage],
                  col_starts: Optional[list[int]], views: bool, row_starts: Optional[list[int]]
                  ) -> Optional[ExpertTensors]:
    """The experts' tensors as joined copies when each one is only views of the shared
    encodings (what ``_direct_storage`` builds for every expert, with one usage for all): the
    unpadded rowwise encoding, and a columnwise copy handed out as column-slice views
    (``COLUMN_VIEWS``) or shared with the rows (Identity). None otherwise (hybrids, an expert
    without a quantizer or with its own encoding, FP8 block's per-expert contiguous copies)."""
    qs = list(quantizers)
    if (row_starts is not None or not qs or sum(splits) == 0
            or None in qs or _any_hybrid(qs)):
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
        whole = _rebuild(rows, p, p, qs[0].label, sum(splits))
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
    return ExpertTensors(splits, joined, partial(_cut_experts, qs, list(splits)))


def _hybrid_group(quantizers: Sequence[Optional[Quantizer]], splits: Sequence[int],
                  rows: Optional[QuantizedStorage], cols: Optional[QuantizedStorage],
                  col_starts: Optional[list[int]], views: bool, row_starts: Optional[list[int]],
                  dtype: torch.dtype) -> Optional[ExpertTensors]:
    """``_expert_group`` for hybrids: every expert's rowwise part a row slice of the shared
    rowwise encoding (at ``row_starts`` if the groups were padded) and, if asked for, its
    columnwise part a column-slice view of the shared columnwise one — what ``_expert_storage``
    builds — and no idle child that ``_expert_storage`` would have ``observe`` the input (a
    side effect that must not wait for a lazy build). None otherwise."""
    qs = list(quantizers)
    if not qs or sum(splits) == 0 or any(not _is_hybrid(q) for q in qs) or rows is None:
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
    return ExpertTensors(splits, joined, partial(_cut_hybrids, qs, list(splits), dtype))


def _scaled_hybrid_group(quantizers: Sequence[Optional[Quantizer]], splits: Sequence[int], hg: HybridGroups,
                         starts: list[int], dtype: torch.dtype) -> Optional[ExpertTensors]:
    """``_hybrid_group`` for ``nvfp4_mxfp8_groups``' experts (NVFP4 with each expert's global
    amax -> MXFP8; Composer-2's weights): the rowwise joined copy is the padded groups' codes as
    one row-scaled NVFP4 storage (each row with its expert's amax), the columnwise one the
    shared MXFP8 copy; the per-expert tensors (``_cut_scaled_hybrids``) are the storages the
    per-expert path builds: plain 1D NVFP4 rows with the expert's own amax. None unless every
    expert is a hybrid of one usage reading its rows."""
    qs = list(quantizers)
    if not qs or sum(splits) == 0 or any(not _is_hybrid(q) for q in qs):
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
    return ExpertTensors(splits, joined, partial(_cut_scaled_hybrids, qs, list(splits), dtype))


def _cut_scaled_hybrids(qs: list[Quantizer], splits: list[int], dtype: torch.dtype,
                        joined: dict[str, JoinedCopy]) -> list[QuantizedTensor]:
    """The per-expert hybrid tensors of ``_scaled_hybrid_group``'s joined copies: rows as plain
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
            col_part = _rebuild(cols.storage, None, col_pl[e], q.columnwise_quantizer.label, m)
            col_part.columnwise_zero_padded = True  # slices of the zero-padded groups
        out.append(QuantizedTensor(HybridStorage(torch.Size((m, whole.cols)), dtype, row_part, col_part, label=q.label), q))
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
        row_part = (_rebuild(rows.storage, row_pl[e], None, q.rowwise_quantizer.label, m)
                    if rows is not None else None)
        col_part = None
        if cols is not None:
            col_part = _rebuild(cols.storage, None, col_pl[e], q.columnwise_quantizer.label, m)
            col_part.columnwise_zero_padded = True  # slices of the zero-padded groups
        out.append(QuantizedTensor(HybridStorage(torch.Size((m, width)), dtype, row_part, col_part, label=q.label), q))
    return out


def _cut_experts(qs: list[Quantizer], splits: list[int], joined: dict[str, JoinedCopy]) -> list[QuantizedTensor]:
    """The per-expert tensors of ``_expert_group``'s joined copies: the storages
    ``_direct_storage`` makes, holding the directions ``joined`` holds."""
    rowwise, columnwise = ROWWISE in joined, COLUMNWISE in joined
    out: list[QuantizedTensor] = []
    if row_local_mode(qs[0]) == SHARED:
        whole = next(iter(joined.values())).storage
        for q, p, m in zip(qs, _row_payloads(whole, splits), splits):
            out.append(QuantizedTensor(_rebuild(whole, p if rowwise else None, p if columnwise else None,
                                                q.label, m), q))
        return out
    rows = joined[ROWWISE].storage if rowwise else None
    row_pl = _row_payloads(rows, splits) if rows is not None else None
    cols = joined[COLUMNWISE] if columnwise else None
    col_pl = _column_payloads(cols.storage, cols.starts, splits, True) if cols is not None else None
    for e, (q, m) in enumerate(zip(qs, splits)):
        like = rows if rows is not None else cols.storage
        s = _rebuild(like, row_pl[e] if row_pl is not None else None, col_pl[e] if col_pl is not None else None,
                     q.label, m)
        s.columnwise_zero_padded = columnwise  # slices of the zero-padded groups (``pad_row_groups``)
        out.append(QuantizedTensor(s, q))
    return out


def _direct_storage(q: Quantizer, rows: Optional[QuantizedStorage], cols: Optional[QuantizedStorage],
                    row_payload: Optional[Payload], col_payload: Optional[Payload], views: bool,
                    m: int) -> Optional[QuantizedStorage]:
    """A plain quantizer's expert storage straight from the shared payloads, when every copy it
    asks for is shared: the storage ``_expert_storage`` makes, as one object instead of a part
    per copy rebuilt again into it (64 experts: 2-3 storages each per quantization). None where
    that path is needed (hybrids, a copy the expert encodes itself)."""
    if _is_hybrid(q) or rows is None and cols is None:
        return None
    if row_local_mode(q) == SHARED:  # one payload serves both copies (Identity)
        if rows is None:
            return None
        return _rebuild(rows, row_payload if q.rowwise_usage else None,
                        row_payload if q.columnwise_usage else None, q.label, m)
    if (q.rowwise_usage and rows is None) or (q.columnwise_usage and (cols is None or col_payload is None)):
        return None
    out = _rebuild(rows if q.rowwise_usage else cols, row_payload if q.rowwise_usage else None,
                   col_payload if q.columnwise_usage else None, q.label, m)
    out.columnwise_zero_padded = views and q.columnwise_usage  # slices of the zero-padded groups
    return out


def _expert_storage(q: Quantizer, xe: torch.Tensor, row_part: Optional[QuantizedStorage],
                    col_part: Optional[QuantizedStorage]) -> QuantizedStorage:
    """Expert storage as ``q.encode(x_e, ...)`` builds it, from the shared parts (and the
    expert's own encoding of a copy that is not shared)."""
    shape = torch.Size(xe.shape)
    if _is_hybrid(q):
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
    out = _rebuild(like, row_part.payloads[ROWWISE] if row_part is not None and q.rowwise_usage else None,
                   col_part.payloads[COLUMNWISE] if col_part is not None else None, q.label, shape[0])
    out.columnwise_zero_padded = col_part is not None and col_part.columnwise_zero_padded
    return out


def _rebuild(like: QuantizedStorage, row: Optional[Payload], col: Optional[Payload], label: str,
             rows: int) -> QuantizedStorage:
    """A storage of ``like``'s class, dtype and options with these payloads and ``rows`` rows
    (an expert's own storage, not marked as a slice)."""
    shape = torch.Size((rows, like.shape[-1]))
    return type(like)(shape, like.dtype, row, col, label=label, **like.meta)


def _assemble_scaled(quantizers: Sequence[Optional[Quantizer]], x: torch.Tensor, splits: Sequence[int],
                     q0: Quantizer) -> GroupedResult:
    """Plain quantizers whose every copy comes from one grouped encoding: each expert keeps the
    copies its usage asks for; an ``ExpertTensors`` on the joined copies where every expert
    keeps the same ones (``_scaled_group``)."""
    used = [q for q in quantizers if q is not None]
    scaled = encode_group_scaled(q0, x, splits, any(q.rowwise_usage for q in used),
                                 any(q.columnwise_usage for q in used))
    group = _scaled_group(quantizers, splits, scaled, x.dtype)
    if group is not None:
        return group
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
        storage = _rebuild(part, row, col, q.label, m)
        storage.columnwise_zero_tail = col is not None and part.columnwise_zero_tail
        out.append(QuantizedTensor(storage, q))
    return out


def _scaled_group(quantizers: Sequence[Optional[Quantizer]], splits: Sequence[int], scaled: GroupScaled,
                  dtype: torch.dtype) -> Optional[ExpertTensors]:
    """FP8 current-scaled experts of one usage as their joined copies (``JoinedCopy`` with each
    expert's ``scale_inv`` in ``scales``; the codes' storages at scale 1), the per-expert
    tensors (``fp8_parts``: the storages each expert's own quantize holds) built on access."""
    qs = list(quantizers)
    j = scaled.fp8
    if j is None or not qs or sum(splits) == 0 or any(q is None for q in qs):
        return None
    usage = {(q.rowwise_usage, q.columnwise_usage) for q in qs}
    if len(usage) > 1:
        return None
    rowwise, columnwise = usage.pop()
    one = device_constant([1.0], j.scale_inv.device).reshape(())  # the codes' own scale
    fp8_dtype = qs[0].dtype
    joined: dict[str, JoinedCopy] = {}
    if rowwise:
        joined[ROWWISE] = JoinedCopy(Float8Storage(j.rows.shape, dtype, {"data": j.rows, "scale_inv": one}, None,
                                                   fp8_dtype=fp8_dtype), None, j.scale_inv)
    if columnwise:
        c, width = j.cols.shape
        joined[COLUMNWISE] = JoinedCopy(Float8Storage(torch.Size((width, c)), dtype, None,
                                                      {"data": j.cols, "scale_inv": one}, fp8_dtype=fp8_dtype),
                                        list(j.col_starts), j.scale_inv)
    return ExpertTensors(splits, joined, partial(_cut_scaled, qs, list(splits), dtype, fp8_dtype))


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


def _column_payloads(storage: QuantizedStorage, starts: Sequence[int], splits: Sequence[int],
                     views: bool) -> list[Payload]:
    """Every expert's columnwise payload: rows [start_e, start_e + m_e) of the shared copy:
    column-slice views of its transposed tensors (``views``, no copy: the grouped GEMM decodes
    them as one buffer, ``moe.joined.joined_columns``; copying every slice would cost the MXFP8 MoE
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
