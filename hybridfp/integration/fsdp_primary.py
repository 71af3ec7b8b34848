"""Quantized primary weights under FSDP2: each rank holds its shard of the quantized weight.

A model built under ``hybridfp.quantized_model_init`` holds its weights as ``QuantizedTensor``
parameters. ``enable_quantized_all_gather(model)`` (before ``fully_shard``) turns each into a
:class:`QuantizedPrimaryWeight`: the Parameter FSDP2 shards is the weight's FP32 master (seeded
from ``get_high_precision_init_val()``, else the dequantized value), and every rank keeps, next
to its master shard, its shard of the quantized weight (both copies). The weight is quantized
once per optimizer step (:func:`quantize_sharded_weights`, which
``hybridfp.MasterWeightOptimizer.step`` calls), not at every gather: an all-gather packs the
stored codes of the copy the GEMMs about to run read (``fsdp_layout``; forward: rowwise,
backward after ``reshard_after_forward``: columnwise; ``copies="both"``: both).

Per-tensor scales (FP8 current scaling, NVFP4's global amax) come from the whole weight's amax:
every weight's local amax goes into one coalesced all-reduce (MAX) per shard group, and each
quantizer reads its weight's reduced amax in place of its own all-reduce
(:class:`_ReducedAmax`; NaN stays NaN, as in one process). Which leaves read the weight's own
amax is ``fsdp_amax``'s rule (``_weight_leaves``): a hybrid's columnwise child reading the
dequantized rowwise copy all-reduces that copy's amax over the shard group itself. Delayed
scaling encodes with its scale and records the reduced amax, so the history is the same on
every rank. A block that straddles two shards is encoded by the
rank where it starts, from the next rank's first high-precision rows (``fsdp.py``'s halo
gather), so every code is the one a single process quantizing the whole weight makes.

A tensor-parallel quantized primary weight (``tensor_parallel_primary``) on a ``(dp, tp)``
mesh: its tp shard plays the whole weight's part, FSDP2 shards it over dp, and its amax goes
over dp, then tp (``MeshAmax``: the whole weight's), so the gathered codes are bitwise the ones
tensor parallelism alone encodes; the forward gather refuses a recipe of another weight format.

A master written after its shard was encoded (a torch optimizer stepping it, a load, an
in-place edit) makes the next gather raise: the version counters, and a fingerprint of the
local master shard (its amax and float64 sum) for writes that move no counter (a ``foreach``
step on a DTensor). No optimizer hook is installed: ``MasterWeightOptimizer.step`` re-encodes.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
from torch import nn

from ..config import policy
from ..formats.common import amax_nan
from ..tensors import COLUMNWISE, ROWWISE, QuantizedTensor
from .fsdp_amax import _reads_amax, _weight_leaves
from .fsdp import _SETS, QuantizedGatherWeight, _block_aligned_rows, _fsdp_param_of, _gather_bytes, _layout, _Slot
from .fsdp_layout import assemble, gather_layout, pack, unpack
from .master_fingerprint import fingerprint, same_fingerprint
from .fsdp_tensor_parallel import MeshAmax


@dataclass
class _PrimarySlot(_Slot):
    """A primary weight's shared state: its quantizer and this rank's quantized shard."""

    quantizer: Any = None
    #: the whole weight's nominal dtype (what the module reads, and its gradient's dtype)
    nominal_dtype: Optional[torch.dtype] = None
    #: this rank's rows of the quantized weight (its block-aligned range), both copies
    shard: Optional[QuantizedTensor] = None
    #: the master's version counters when ``shard`` was encoded (a later write: stale): the
    #: DTensor's, the local tensor's identity and its own
    version: tuple = ()
    #: the local master shard's amax and float64 sum when ``shard`` was encoded: a write that
    #: moves no version counter (a foreach optimizer step on a DTensor, a ``.data`` write)
    #: changes them (the sum catches updates that leave the largest element as it was)
    fingerprint: Optional[torch.Tensor] = None
    #: a tensor-parallel primary weight: its tensor-parallel group (the amax goes over dp, then
    #: this group) and its tp shard's rows (what FSDP2 shards over dp); None / 0 otherwise
    tp_group: Any = None
    tp_rows: int = 0


class _ReducedAmax:
    """Stands in for a process group in a quantizer's amax reduction: the amax it would
    all-reduce is this weight's amax, already reduced with every other weight's in one
    collective (``quantizers.base.all_reduce_amax`` calls :meth:`reduce_amax`)."""

    def __init__(self, amax: torch.Tensor) -> None:
        self.amax = amax

    def reduce_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """Write the reduced amax into ``amax`` (in place, as an all-reduce would)."""
        return amax.copy_(self.amax.to(device=amax.device, dtype=amax.dtype).reshape(amax.shape))


def _leaves(q: Any) -> list[Any]:
    children = [getattr(q, n, None) for n in ("rowwise_quantizer", "columnwise_quantizer")]
    return [c for c in children if c is not None] or [q]


def _per_tensor(q: Any) -> bool:
    """Whether quantizer ``q`` (a leaf) takes a per-tensor amax of its input."""
    return hasattr(q, "amax_history") or hasattr(q, "with_amax_reduction")


def _weight_amax_leaves(q: Any) -> list[Any]:
    """The leaves of ``q`` that take the weight's own per-tensor amax (``fsdp_amax``'s rule):
    they read the coalesced all-reduce's result."""
    return [leaf for leaf in _weight_leaves(q) if _per_tensor(leaf) and (
        _reads_amax(leaf) or not hasattr(leaf, "with_amax_reduction"))]


def _derived_leaves(q: Any) -> list[Any]:
    """The per-tensor leaves of ``q`` whose amax is not the weight's (a hybrid's columnwise child
    reading the dequantized rowwise copy): each reduces its own amax over the shard group."""
    weight = _weight_leaves(q)
    return [leaf for leaf in _leaves(q) if _per_tensor(leaf) and all(leaf is not w for w in weight)]


def _check_quantizer(q: Any, who: str) -> None:
    """Refuse what a shard cannot encode as the whole weight: random draws (each rank would
    draw its own) and amaxes of anything but the weight itself (RHT, per-row amaxes)."""
    if q is None:
        raise RuntimeError(f"{who}: the quantized weight has no quantizer; build the model under "
                           "hybridfp.quantized_model_init(recipe=...).")
    if q.uses_randomness():
        raise ValueError(f"{who}: the weight quantizer {q!r} rounds stochastically; under FSDP2 each "
                         "rank would draw its own numbers, so the shards would not be the whole weight's "
                         "quantization. Use a weight quantizer without stochastic_rounding.")
    for leaf in _leaves(q):
        if getattr(leaf, "with_rht", False) or getattr(leaf, "row_scaled_nvfp4", False):
            raise ValueError(f"{who}: the weight quantizer {leaf!r} takes an amax of a transformed tensor "
                             "(with_rht) or per row (row_scaled_nvfp4); a quantized primary weight under "
                             "FSDP2 supports per-tensor amaxes of the weight only. Use a weight quantizer "
                             "without these options.")
    for leaf in _derived_leaves(q):
        if not hasattr(leaf, "with_amax_reduction"):
            raise ValueError(f"{who}: the weight quantizer's columnwise child {leaf!r} reads the dequantized "
                             "rowwise copy (columnwise_source='rowwise_dequantized') and keeps an amax history "
                             "(delayed scaling); a quantized primary weight under FSDP2 cannot record that "
                             "amax for the whole weight. Use columnwise_source='original' or a current-scaling "
                             "columnwise quantizer.")


class QuantizedPrimaryWeight(QuantizedGatherWeight):
    """The FP32 master (or its FSDP2 shard) of a quantized primary weight.

    The optimizer updates it in place, as any parameter; its rank's quantized shard is
    re-encoded from it by :func:`quantize_sharded_weights` (one coalesced amax all-reduce for
    every weight) and FSDP2's all-gather sends those stored codes.

    Parameters
    ----------
    data:
        The FP32 master weight.
    slot:
        The module slot it belongs to (made by ``enable_quantized_all_gather``).
    """

    _slot: _PrimarySlot

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"QuantizedPrimaryWeight({self._hp!r})"

    @property
    def quantizer(self) -> Any:
        """The weight quantizer its quantized shard is encoded with (``QuantizedTensor``'s name):
        the module adopts it as its weight quantizer when it builds its quantizers in a forward
        (the weight gathered), and the module's loaded quantizer state is applied to it at load
        (``QuantizedModule.set_extra_state``), before :func:`quantize_sharded_weights`
        re-encodes the shard with it."""
        return self._slot.quantizer

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...],
                            module: nn.Module, mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        """Pack this rank's stored quantized shard: the copies this gather sends (FSDP2 hook)."""
        slot = self._slot
        who = f"{type(module).__name__}.{slot.attr}"
        world, total = mesh.size(mesh.ndim - 1), outer_size[0]
        param = _sharded_param(self, slot)
        if slot.tp_group is not None:
            if param is not None:  # FSDP2 passes HSDP's shard mesh alone: the DTensor's tells
                _check_one_dp_dim(slot, param.device_mesh.ndim, who)
            if torch._C._current_graph_task_id() == -1:
                _check_recipe(slot, module, who)
        if slot.shard is None:  # the first gather: the weight was never quantized sharded
            _quantize_items([(param, self, mesh.get_group(mesh.ndim - 1), world, total, who)])
        elif not _unchanged(slot, param, self):
            raise RuntimeError(
                f"{who}: its FP32 master shard changed after its quantized shard was encoded, so a gather "
                "would send stale codes. Step with hybridfp.MasterWeightOptimizer, or call "
                "hybridfp.quantize_sharded_weights(model) after updating the masters (e.g. after a load).")
        sent = _SETS[slot.copies][-1 if torch._C._current_graph_task_id() != -1 else 0]
        layout = _layout(slot, slot.quantizer, self._hp, total, world, _SETS[slot.copies])
        # uneven shards: FSDP2 takes only inputs of the padded shard's shape (as in fsdp.py)
        padded = None if layout.even else (layout.shard_rows[0], *outer_size[1:])
        nbytes = _gather_bytes(self, slot, layout, sent, world, who, math.prod(padded) if padded else 1)
        dtype = getattr(mp_policy, "param_dtype", None) or slot.nominal_dtype
        # the shard as holding only the copies sent: the whole weight makes room for the others
        shard = slot.shard
        sent_only = assemble(shard, shard.shape[0], {(d, n): t for d in sent
                                                     for n, t in shard.qstorage.part(d).payloads[d].items()},
                             quantizer=slot.quantizer)
        buffer = pack(shard, layout, sent, nbytes)
        inputs = (buffer,) if padded is None else tuple(buffer.view(-1, *padded).unbind(0))
        return inputs, (layout, sent, sent_only, world, total, dtype, nbytes)


def _check_recipe(slot: _PrimarySlot, module: nn.Module, who: str) -> None:
    """A tensor-parallel primary weight's forward gather in an autocast region: the recipe's
    weight format must be the one the weight is held in (as under tensor parallelism alone)."""
    from ..recipes import current_autocast
    from .tensor_parallel_primary import check_held_format
    state = current_autocast()
    if state is not None:
        check_held_format(slot.quantizer, module.quantizers(state)["weight"][slot.index], who)


def _sharded_param(local: QuantizedPrimaryWeight, slot: _PrimarySlot) -> Optional[torch.Tensor]:
    """FSDP2's sharded parameter (the DTensor) whose local tensor is ``local``, or None."""
    record = slot.fsdp_param() if slot.fsdp_param is not None else None
    if record is None:
        record = _fsdp_param_of(local)
        slot.fsdp_param = weakref.ref(record) if record is not None else None
    return getattr(record, "sharded_param", None)


def _version(param: Optional[torch.Tensor], local: torch.Tensor) -> tuple:
    """Moves with every in-place write to the master shard: an optimizer (or a load) writes
    through the DTensor, whose version counter moves, not its local tensor's."""
    return (param._version if param is not None else -1, id(local), local._version)


def _unchanged(slot: _PrimarySlot, param: Optional[torch.Tensor], local: torch.Tensor) -> bool:
    """Whether the master shard is the one ``slot.shard`` was encoded from. FSDP2's lazy
    initialization may replace a padded shard's local tensor by a copy (same values, a new
    version counter): then the DTensor's counter alone decides."""
    now = _version(param, local)
    if now[1] != slot.version[1] and now[0] == slot.version[0]:
        slot.version = now
    return now == slot.version and same_fingerprint(_fingerprint(local), slot.fingerprint)


def _fingerprint(local: torch.Tensor) -> torch.Tensor:
    """The local master shard's fingerprint (``master_fingerprint``), unwrapped from its gather
    wrapper."""
    return fingerprint(getattr(local, "_hp", local))


def _items(params: Iterable[Any]) -> list[tuple]:
    """(parameter, local master shard, shard group, world, rows, name) of each sharded primary
    weight."""
    out = []
    for p in params:
        local = getattr(p, "_local_tensor", p)
        if isinstance(local, QuantizedPrimaryWeight):
            if not hasattr(p, "device_mesh"):
                raise ValueError(f"quantize_sharded_weights: {local._slot.attr} is not sharded yet; call it "
                                 "after fully_shard (or let the first all-gather quantize it).")
            out.append((p, local, *_shard_group(p, local._slot), local._slot.attr))
    return out


def _shard_group(param: Any, slot: _PrimarySlot) -> tuple[Any, int, int]:
    """(FSDP2's shard group, its size, the rows it shards) of sharded primary weight ``param``:
    a whole weight's rows over the mesh's last dimension, or a tensor-parallel primary weight's
    tp shard rows over dp (the first dimension of its ``(dp, tp)`` DTensor)."""
    mesh = param.device_mesh
    if slot.tp_group is None:
        return mesh.get_group(mesh.ndim - 1), mesh.size(mesh.ndim - 1), param.shape[0]
    _check_one_dp_dim(slot, mesh.ndim, slot.attr)
    return mesh.get_group(0), mesh.size(0), slot.tp_rows


def _check_one_dp_dim(slot: _PrimarySlot, ndim: int, who: str) -> None:
    """A tensor-parallel primary weight is sharded over one dp dimension: its DTensor's mesh is
    ``(dp, tp)`` (``ndim`` 2). HSDP (a replicate dimension too) is not supported: refused."""
    if ndim != 2:
        raise ValueError(f"{who}: a tensor-parallel quantized primary weight sharded over a {ndim}-D mesh "
                         "(HSDP); FSDP2 shards it over the one dp dimension of a (dp, tp) mesh: use "
                         "fully_shard(..., mesh=mesh['dp']) with a 1-D dp mesh.")


def _groups(group: Any, slot: _PrimarySlot) -> tuple:
    """The groups a weight's amax is reduced over, in order: the shard group, then (a
    tensor-parallel primary weight) its tensor-parallel group."""
    return (group,) if slot.tp_group is None else (group, slot.tp_group)


def quantize_sharded_weights(params: Any) -> int:
    """Quantize each sharded primary weight's shard from its FP32 master shard.

    Every weight with a per-tensor scale contributes its local amax to ONE all-reduce (MAX)
    per shard group; each rank then encodes its block-aligned rows (a straddling block's rows
    taken from the next rank) with the whole weight's amax, bitwise the rows of the whole
    weight's quantization. Delayed scaling records the reduced amax in its history.

    Parameters
    ----------
    params:
        A model (its parameters are scanned), or its parameters, after ``fully_shard``; the
        parameters that are not quantized primary weights are skipped. Collective: every rank
        of the shard group calls it with the same weights in the same order.

    Returns
    -------
    int
        The number of amax all-reduces issued: one per shard group holding a per-tensor-scaled
        weight (two for tensor-parallel weights: over dp, then tp), else 0.

    Raises
    ------
    ValueError
        A weight quantizer a shard cannot reproduce (stochastic rounding, RHT, per-row amaxes).

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> lin = torch.nn.Linear(4, 4)
    >>> hf.quantize_sharded_weights(lin)   # no quantized primary weight: nothing to do
    0
    """
    return _quantize_items(_items(params.parameters() if isinstance(params, nn.Module) else params))


def _quantize_items(items: list[tuple]) -> int:
    """:func:`quantize_sharded_weights` on ``_items``' tuples; the number of all-reduces."""
    import torch.distributed as dist

    amaxes: dict = {}  # groups -> [(item index, local amax)]
    for i, (param, local, group, world, total, who) in enumerate(items):
        slot = local._slot
        _check_quantizer(slot.quantizer, who)
        if _weight_amax_leaves(slot.quantizer):
            amaxes.setdefault(_groups(group, slot), []).append((i, amax_nan(local._hp.detach())))
    reduced = {}
    for groups, entries in amaxes.items():  # one collective per group for all its weights
        flat = torch.stack([a for _, a in entries]).float().reshape(-1)
        # NaN stays NaN, as one process's amax does: a MAX reduction's NaN handling varies by
        # backend, so each amax travels with a NaN flag in the same collective
        nan = torch.isnan(flat)
        both = torch.cat([torch.where(nan, torch.zeros_like(flat), flat), nan.float()])
        for group in groups:  # tensor-parallel: over dp, then tp (the whole weight's maximum)
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        n = flat.numel()
        out = torch.where(both[n:] > 0, torch.full_like(flat, math.nan), both[:n])
        reduced.update({i: out[k] for k, (i, _) in enumerate(entries)})
    derived = 0
    for i, (param, local, group, world, total, who) in enumerate(items):
        _encode(param, local, group, world, total, reduced.get(i))
        derived += len(_derived_leaves(local._slot.quantizer)) * len(_groups(group, local._slot))
    return sum(len(groups) for groups in amaxes) + derived


def _encode(param: Optional[torch.Tensor], local: QuantizedPrimaryWeight, group: Any, world: int,
            total: int, amax: Optional[torch.Tensor]) -> None:
    """Encode this rank's block-aligned rows of the weight into its quantized shard."""
    slot = local._slot
    q = slot.quantizer
    src = local._hp.detach()
    layout = _layout(slot, q, src, total, world, _SETS[slot.copies])
    if getattr(layout, "halo", not layout.aligned):  # whole blocks: rows up to the next boundary
        src = _block_aligned_rows(src, layout, group)
    first = slot.shard is None
    # the first encoding leaves delayed scaling's history as quantized_model_init left it
    enc = q.copy() if first else q
    enc.set_usage(rowwise=True, columnwise=True)
    own = [leaf for leaf in _weight_amax_leaves(enc) if hasattr(leaf, "with_amax_reduction")]
    derived = _derived_leaves(enc)  # their amax (of the dequantized rowwise rows) is reduced here
    leaves = own + derived
    saved = [(leaf.with_amax_reduction, leaf.amax_reduction_group) for leaf in leaves]
    for leaf in own:
        leaf.with_amax_reduction, leaf.amax_reduction_group = True, _ReducedAmax(amax)
    groups = _groups(group, slot)
    for leaf in derived:
        leaf.with_amax_reduction, leaf.amax_reduction_group = True, group if len(groups) == 1 else MeshAmax(groups)
    try:
        with torch.no_grad(), policy(decoded_copies="never"):  # codes travel, never BF16 decodes
            shard = enc.quantize(src)
    finally:
        for leaf, (on, group_) in zip(leaves, saved):
            leaf.with_amax_reduction, leaf.amax_reduction_group = on, group_
    if not first:
        for leaf in _weight_amax_leaves(enc):
            if hasattr(leaf, "record_amax"):  # delayed: the history sees the whole weight's amax
                leaf.record_amax(amax)
    shard.set_quantizer(q)
    slot.shard, slot.version, slot.fingerprint = shard, _version(param, local), _fingerprint(local)


def full_quantized_weight(param: Any) -> QuantizedTensor:
    """The whole quantized weight (both copies) of a sharded primary weight, gathered.

    Parameters
    ----------
    param:
        A parameter ``enable_quantized_all_gather`` made from a ``QuantizedTensor`` parameter,
        after ``fully_shard`` and at least one quantization of its shard. Collective over its
        shard group.

    Returns
    -------
    QuantizedTensor
        The whole weight, bitwise the codes a single process quantizing its master makes.

    Raises
    ------
    ValueError
        ``param`` is not a sharded quantized primary weight, or was never quantized.
    """
    import torch.distributed as dist
    local = getattr(param, "_local_tensor", param)
    if not isinstance(local, QuantizedPrimaryWeight) or not hasattr(param, "device_mesh"):
        raise ValueError("full_quantized_weight: expected a quantized primary weight sharded by fully_shard "
                         f"(enable_quantized_all_gather on a quantized_model_init model), got {type(local).__name__}.")
    slot = local._slot
    if slot.shard is None:
        raise ValueError(f"full_quantized_weight: {slot.attr} was never quantized sharded; call "
                         "hybridfp.quantize_sharded_weights(model) first.")
    group, world, total = _shard_group(param, slot)
    both = (ROWWISE, COLUMNWISE)
    probe = slot.quantizer.copy()
    probe.set_usage(rowwise=True, columnwise=True)

    def quantize_meta(rows: int) -> QuantizedTensor:
        with torch.no_grad(), policy(decoded_copies="never"):
            return probe.quantize(torch.empty((rows, *local.shape[1:]), dtype=local.dtype, device="meta"))
    layout = gather_layout(quantize_meta, total, world, (both,))
    buf = pack(slot.shard, layout, both)
    out = torch.empty(world * buf.numel(), dtype=torch.uint8, device=buf.device)
    dist.all_gather_into_tensor(out, buf, group=group)
    return assemble(slot.shard, total, unpack(out, world, layout, both), slot.nominal_dtype, quantizer=slot.quantizer)


def tensor_parallel_primary_local(p: torch.Tensor, slot: _Slot) -> QuantizedPrimaryWeight:
    """The local tensor FSDP2 shards over dp for tensor-parallel primary weight ``p`` (the FP32
    master DTensor ``tensor_parallel_primary.shard_primary`` made): its tp shard's FP32 master,
    holding its quantizer and tensor-parallel group; ``slot`` is the gather slot (attribute,
    weight index, copies). Its amax goes over dp, then tp: the whole weight's, the scale the
    tensor-parallel run encodes its shard with.

    Parameters
    ----------
    p:
        A tensor-parallel quantized primary weight (``is_tensor_parallel_primary``), not yet
        sharded by FSDP2.
    slot:
        The gather slot ``enable_quantized_all_gather`` made for the module's weight.

    Returns
    -------
    QuantizedPrimaryWeight
        The tp shard's FP32 master (sharing its storage), for ``DTensor(..., p._spec)``.
    """
    from .tensor_parallel_primary import SLOT_ATTR
    tp = getattr(p, SLOT_ATTR)
    local = p._local_tensor.detach()  # type: ignore[attr-defined]
    primary = _PrimarySlot(slot.attr, slot.index, slot.copies, quantizer=tp.quantizer, nominal_dtype=local.dtype,
                           tp_group=tp.group, tp_rows=local.shape[0])
    return QuantizedPrimaryWeight(local, primary)


def primary_parameter(p: QuantizedTensor, attr: str, index: int, copies: str) -> nn.Parameter:
    """A quantized parameter as the FSDP2 parameter of a quantized primary weight: its FP32
    master (its kept initial value, else its dequantized value) holding the quantizer."""
    init = p.get_high_precision_init_val()
    master = (init if init is not None else p.dequantize(torch.float32)).detach()
    master = master.to(device=p.device, dtype=torch.float32, copy=True)
    slot = _PrimarySlot(attr, index, copies, quantizer=p.quantizer, nominal_dtype=p.dtype)
    return nn.Parameter(QuantizedPrimaryWeight(master, slot), requires_grad=p.requires_grad)


def is_primary_shard(p: Any) -> bool:
    """Whether ``p`` is a quantized primary weight (sharded or not yet)."""
    return isinstance(getattr(p, "_local_tensor", p), QuantizedPrimaryWeight)
