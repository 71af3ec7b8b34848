"""What ``quantize_grouped`` shares among the experts, decided once per set of quantizers.

A :class:`Plan` names, per direction, the quantizer whose encoding every expert shares (and the
rows its blocks span), and ``Plan.strategy``: which encoding pass writes the experts' copies.
Per direction a copy is

- *row-local* (``ROW_LOCAL``: every row's codes and scales depend on that row alone —
  Identity, MXFP8 1x32, FP8 block 1x128, row-scaled NVFP4): encoded once, cut per expert;
- *tile-local* (``ROW_TILE``: MXFP8 32x32, FP8 block 128x128): likewise when every group is a
  whole number of tiles (an MoE layer's joined weights);
- *column blocks* (``COLUMN_BLOCK``: MXFP8 32x1, FP8 block 128x1 and 128x128 columnwise):
  encoded once from the groups zero-padded to whole blocks (zeros never raise a block amax,
  and a group's blocks then hold only its own rows);
- *per-expert scaled* (``quantize_scaled.GROUP_SCALED``: FP8 current scaling, 1D NVFP4 rows):
  one segmented amax and one cast pass, each expert with its own scale;
- else *per expert* (delayed scaling, random draws, other per-tensor copies): no plan, every
  expert quantizes on its own.

Plans are remembered by their owner (``PlanMemo``), keyed by what can change on live
quantizers (``_plan_key``).
"""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter, contains
from typing import Callable, Optional, Sequence

from ..tensors import DecodedMXFP8Storage, MXFP8Storage
from ..quantizers.base import Quantizer
from ..quantizers.float8_block import Float8BlockQuantizer
from ..quantizers.hybrid import HybridQuantizer
from ..quantizers.identity import IdentityQuantizer
from ..quantizers.mxfp8 import MXFP8Quantizer
from ..quantizers.nvfp4 import NVFP4Quantizer
from .quantize_scaled import BOTH, ROWS, group_scaled_mode


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
#: grouped GEMM decodes them as one buffer (the ``GroupedTensor``'s joined copy: MXFP8, BF16 path).
#: Other shared block copies (FP8 block: per-expert cuBLAS FP8 GEMMs, which read contiguous
#: operands) get one contiguous copy per expert here, once, not one per GEMM call.
COLUMN_VIEWS: tuple[type, ...] = (MXFP8Storage, DecodedMXFP8Storage)


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


def _column_block(q: Quantizer) -> Optional[int]:
    """Rows per block of ``q``'s columnwise copy if groups padded to it can share one encoding."""
    rule = COLUMN_BLOCK.get(type(q))
    return None if rule is None or q.uses_randomness() else rule(q)


#: The encoding passes of ``quantize_grouped`` (``Plan.strategy``; ``quantize.RUNNERS`` runs
#: them). ``SCALED``: plain per-tensor-scaled quantizers, every copy from one grouped encoding.
#: ``HYBRID_PASS``: hybrids with a row-local rowwise child and a column-block child derived
#: from the rowwise value: one hybrid encode of the zero-padded groups writes both copies.
#: ``ONE_ENCODE``: one plain quantizer for both copies and groups of whole column blocks (no
#: padding): one call writes both. ``SCALED_HYBRID``: per-expert-scaled NVFP4 rows with a
#: derived MXFP8 columnwise copy: one fused pass over the padded groups where the device has
#: it, else ``BY_DIRECTION``. ``PADDED_ENCODE``: one plain quantizer for both copies of padded
#: groups: the rowwise copy of x and the padded groups' columnwise copy from one encode.
#: ``BY_DIRECTION``: each direction on its own (shared where the plan shares it, else per
#: expert), the columnwise copy from x or from the rowwise value.
SCALED, HYBRID_PASS, ONE_ENCODE = "scaled", "hybrid pass", "one encode"
SCALED_HYBRID, PADDED_ENCODE, BY_DIRECTION = "scaled hybrid", "padded encode", "by direction"


def _one_quantizer(p: "Plan") -> bool:
    """Whether one plain quantizer writes both shared copies."""
    return p.row_q is not None and p.col_q is p.row_q


#: (strategy, when it applies), in order: the first that applies is the plan's.
STRATEGIES: tuple[tuple[str, Callable[["Plan", Sequence[int]], bool]], ...] = (
    (SCALED, lambda p, splits: p.scaled == BOTH),
    (HYBRID_PASS, lambda p, splits: (p.row_q is not None and p.row_block == 1 and not p.scaled
                                     and p.col_q is not None and p.derives_all)),
    (ONE_ENCODE, lambda p, splits: _one_quantizer(p) and not any(map(p.col_block.__rmod__, splits))),
    (SCALED_HYBRID, lambda p, splits: p.scaled == ROWS and p.col_q is not None and p.derives_all),
    (PADDED_ENCODE, lambda p, splits: _one_quantizer(p) and not p.scaled and not p.derives_any),
)


def _strategy(plan: "Plan", splits: Sequence[int]) -> str:
    """The first of ``STRATEGIES`` that applies to ``plan`` and ``splits``, else ``BY_DIRECTION``."""
    return next((name for name, applies in STRATEGIES if applies(plan, splits)), BY_DIRECTION)


class Plan:
    """What is shared: the rowwise quantizer and its row block (or None: per expert), the
    columnwise quantizer and its row block (or None), and ``scaled``: ``ROWS`` / ``BOTH`` when
    row_q's rowwise copy (``BOTH``: every copy of plain quantizers) comes from one grouped
    per-tensor-scaled encoding (``encode_group_scaled``); ``strategy``: the encoding pass
    (``STRATEGIES``), set with the plan."""

    def __init__(self, row_q: Optional[Quantizer], row_block: Optional[int],
                 col_q: Optional[Quantizer], col_block: Optional[int], scaled: Optional[str] = None) -> None:
        self.row_q, self.row_block, self.col_q, self.col_block = row_q, row_block, col_q, col_block
        self.scaled = scaled
        # whether any / every expert derives its columnwise source from its rowwise value: set by
        # ``_new_plan`` (usage is part of a remembered plan's key, so they hold while it is used)
        self.derives_any = self.derives_all = False
        self.strategy = BY_DIRECTION


#: type -> whether it is a HybridQuantizer (the plan asks for every expert of every call: a dict
#: lookup instead of an ABC isinstance check)
_HYBRID_TYPES: dict[type, bool] = {}


def is_hybrid(q: Optional[Quantizer]) -> bool:
    return _is_type_hybrid(type(q))


def any_hybrid(qs: Sequence[Optional[Quantizer]]) -> bool:
    """Whether some quantizer in ``qs`` is a hybrid (one lookup per distinct type, not per
    expert: this is asked for every expert list of every call)."""
    return any(map(_is_type_hybrid, set(map(type, qs))))


def _is_type_hybrid(t: type) -> bool:
    hybrid = _HYBRID_TYPES.get(t)
    if hybrid is None:
        hybrid = _HYBRID_TYPES[t] = issubclass(t, HybridQuantizer)
    return hybrid


def rowwise_child(q: Quantizer) -> Quantizer:
    return q.rowwise_quantizer if is_hybrid(q) else q


def columnwise_child(q: Quantizer) -> Quantizer:
    return q.columnwise_quantizer if is_hybrid(q) else q


def derives_columnwise(q: Quantizer) -> bool:
    return is_hybrid(q) and q.columnwise_usage and q.columnwise_source == "rowwise_dequantized"


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
        children = [rowwise_child(q) for q in used]
    return (tuple(map(id, quantizers)), tuple(map(_USAGE, used)),
            any(map(contains, map(vars, used), repeat("quantize"))),
            tuple([(getattr(c, "with_amax_reduction", False), id(getattr(c, "amax_reduction_group", None)))
                   for c in children]),
            not any(map((32).__rmod__, splits)), not any(map((128).__rmod__, splits)))  # m % 32, m % 128


def plan_for(quantizers: Sequence[Optional[Quantizer]], splits: Sequence[int],
          plans: Optional[PlanMemo] = None) -> Optional[Plan]:
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


def _new_plan(quantizers: Sequence[Optional[Quantizer]], splits: Sequence[int]) -> Optional[Plan]:
    """``plan_for`` computed afresh."""
    used = [q for q in quantizers if q is not None]
    if not used or any(q.uses_randomness() for q in used):
        return None  # random draws are seeded per quantize() call: keep the calls
    if any("quantize" in vars(q) for q in used):
        return None  # quantize() wrapped on the instance (hooks, spies): it must see every call
    if len({(type(q), getattr(q, "columnwise_source", None)) for q in used}) > 1:
        return None
    scaled = _scaled_plan(used)
    if scaled == BOTH:  # plain quantizers: the grouped encoding holds every copy
        plan = Plan(rowwise_child(used[0]), None, None, None, BOTH)
        plan.strategy = SCALED
        return plan
    row_q, row_block = (rowwise_child(used[0]), None) if scaled else _row_plan(used, splits)
    col_q, col_block = _col_plan(quantizers, used, row_q is not None)
    if row_q is None and col_q is None:
        return None
    plan = Plan(row_q, row_block, col_q, col_block, scaled)
    derives = [derives_columnwise(q) for q in used]
    plan.derives_any, plan.derives_all = any(derives), all(derives)
    plan.strategy = _strategy(plan, splits)
    return plan


def _scaled_plan(used: Sequence[Quantizer]) -> Optional[str]:
    """``BOTH`` / ``ROWS`` (see ``Plan``) if the experts' per-tensor scales can come from one
    grouped encoding: one setting, one amax-reduction group, and the copies it writes are read."""
    rows = [rowwise_child(q) for q in used]
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
    return ROWS if any(q.rowwise_usage or derives_columnwise(q) for q in used) else None


def _row_plan(used: Sequence[Quantizer], splits: Sequence[int]) -> tuple[Optional[Quantizer], Optional[int]]:
    if not any(q.rowwise_usage or derives_columnwise(q) for q in used):
        return None, None  # nobody reads the rows: a shared encoding would be wasted work
    rows = [rowwise_child(q) for q in used]
    block = _row_block(rows[0])
    if block is None or not _same_settings(rows) or any(m % block for m in splits):
        return None, None
    return rows[0], block


def _col_plan(quantizers: Sequence[Optional[Quantizer]], used: Sequence[Quantizer],
              rows_shared: bool) -> tuple[Optional[Quantizer], Optional[int]]:
    if not any(q.columnwise_usage for q in used):
        return None, None
    cols = [columnwise_child(q) for q in used]
    block = _column_block(cols[0])
    if block is None or not _same_settings(cols):
        return None, None
    if any(derives_columnwise(q) for q in used) and not rows_shared:
        # the derived source is then made per expert: every expert must make it
        if any(q is None or not derives_columnwise(q) for q in quantizers):
            return None, None
    return cols[0], block
