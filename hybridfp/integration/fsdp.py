"""FSDP2 with a quantized all-gather: the ranks send their weight shards already quantized.

``enable_quantized_all_gather(model)`` (before ``fully_shard``) wraps each hybridfp module's
high-precision weight in :class:`QuantizedGatherWeight`, which implements FSDP2's
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``: before an all-gather every rank quantizes
its shard with the module's weight quantizer for the active recipe (per-tensor amaxes reduced
over the shard group, so every rank encodes with the whole weight's scale) and packs the
copies the GEMMs about to run read (``fsdp_layout``); after it, the whole weight is a
``QuantizedTensor`` the module reads as it reads a quantized parameter, bitwise the
quantization of the whole weight.

Per direction (``copies="per_direction"``, the default): the forward's all-gather sends the
rowwise copy (fprop reads it), the backward's — FSDP2 all-gathers again before backward when
the module reshards after forward — the columnwise copy (dgrad reads it), quantized with the
forward's quantizer state (a copy made at the forward gather: delayed scaling's scale may
move at the region's end). Modules whose parameters stay gathered from forward to backward
(FSDP2's root module, ``reshard_after_forward=False``) or whose forward is recomputed in
backward (activation checkpointing) need both copies in one gather: ``copies="both"``; in
per-direction mode reading a copy that was not gathered raises, naming that option.

Each gather sends its copies' own bytes. FSDP2 sizes a parameter's all-gather output by its
first gather and reuses it; the two copies of one format are the same size, and for a hybrid
of two formats the output is dropped when the size changes, so FSDP2 makes one of the new size
(``_gather_bytes``).

Any number of rows: where the world size does not divide them FSDP2 pads the last shards
(``torch.chunk``) and takes only all-gather inputs of the padded shard's shape, so the bytes go
as uint8 tensors of that shape; the layout cuts each rank's encoded rows back out, so padding
never reaches the weight. ``fsdp_amax.precompute_weight_amax`` replaces the per-gather amax
all-reduces by one per step.

Tensor parallelism (a 2-D ``(dp, tp)`` mesh): a weight that hybridfp's tensor-parallel styles
made a DTensor is wrapped in its local tensor, which FSDP2 shards over dp and gathers back;
its amax goes over dp, then tp, so the gathered copies are the tensor-parallel layer's own
quantization of its shard (``fsdp_tensor_parallel``).

Without the quantized all-gather, FSDP2 refills a high-precision weight's unsharded Parameter
at every unshard, keeping its version counter: the gathers of each such weight the
quantized-weight cache reads are watched, and one that carries a stepped or loaded shard notes
a rewrite its cache key sees (the last section below; ``nn/weight_cache.py``).
"""

from __future__ import annotations

import dataclasses
import math
import types
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from ..config import policy
from ..recipes import current_autocast
from ..tensors import COLUMNWISE, ROWWISE, QuantizedTensor
from ..utils.optimizer_steps import on_stepped_parameters
from ..utils.rewrites import note_rewrite, register_refresher
from .fsdp_amax import reduced_amax
from .fsdp_layout import GatherLayout, assemble, gather_layout, pack, unpack
from .fsdp_tensor_parallel import MeshAmax, check_tensor_parallel_blocks, tensor_parallel_spec, wrap_tensor_parallel

aten = torch.ops.aten

COPIES = ("per_direction", "both")
_SETS = {"per_direction": ((ROWWISE,), (COLUMNWISE,)), "both": ((ROWWISE, COLUMNWISE),)}

#: Ops FSDP2 applies to a parameter while sharding, moving and padding it: their results stay
#: wrapped (they are the same weight's shards); every other op sees the plain tensor.
_PRESERVE = {
    aten.detach.default, aten.alias.default, aten.split.Tensor, aten.split_with_sizes.default,
    aten.slice.Tensor, aten.view.default, aten._unsafe_view.default, aten.as_strided.default,
    aten.new_zeros.default, aten.new_empty.default, aten.copy_.default, aten._to_copy.default,
    aten._pin_memory.default, aten.clone.default, aten.narrow.default,
}


@dataclass
class _Slot:
    """What every shard of one weight shares: its module's weight slot and the gather state."""

    attr: str
    index: int
    copies: str
    #: the quantizer of the latest forward gather, copied: the backward gather encodes with it
    backward_q: Optional[Any] = None
    layouts: dict = field(default_factory=dict)
    #: FSDP2's record of the parameter (weakly), found at the first gather of a hybrid weight
    fsdp_param: Optional[Any] = None
    warned_padding: bool = False
    #: the weight's amax reduced by precompute_weight_amax (fsdp_amax.py), else None
    amax: Optional[Any] = None


class QuantizedGatherWeight(torch.Tensor):
    """A high-precision weight (or its FSDP2 shard) whose FSDP2 all-gather is quantized.

    Every op but the sharding ones FSDP2 applies runs on the plain tensor (the optimizer
    updates it in place); saving gives the plain tensor.

    Parameters
    ----------
    data:
        The high-precision weight.
    slot:
        The module slot it belongs to (made by :func:`enable_quantized_all_gather`).
    """

    _hp: torch.Tensor
    _slot: _Slot

    @staticmethod
    def __new__(cls, data: torch.Tensor, slot: _Slot) -> "QuantizedGatherWeight":
        t = torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(),
                                                storage_offset=data.storage_offset(), dtype=data.dtype,
                                                device=data.device, requires_grad=data.requires_grad)
        t._hp, t._slot = data, slot
        return t

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"QuantizedGatherWeight({self._hp!r})"

    def __reduce_ex__(self, protocol: int) -> Any:
        return self._hp.detach().__reduce_ex__(protocol)  # saved as the plain tensor

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        slot = None
        wrappers = {}

        def unwrap(t: "QuantizedGatherWeight") -> torch.Tensor:
            nonlocal slot
            slot = t._slot
            wrappers[id(t._hp)] = t
            return t._hp

        out = func(*tree_map_only(cls, unwrap, args), **tree_map_only(cls, unwrap, kwargs))
        if func is aten.clone.default:  # a new weight (deepcopy): its own gather state
            slot = dataclasses.replace(slot, backward_q=None, layouts={}, fsdp_param=None, warned_padding=False,
                                       amax=None)
        if func in _PRESERVE:
            return tree_map_only(torch.Tensor, lambda o: wrappers[id(o)] if id(o) in wrappers else cls(o, slot), out)
        # in-place ops return their (unwrapped) first argument: hand back the wrapper itself
        return tree_map_only(torch.Tensor, lambda o: wrappers.get(id(o), o), out)

    # ------------------------------------------------------------------ FSDP2 extension
    def fsdp_pre_all_gather(self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...],
                            module: nn.Module, mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        """Quantize this rank's shard and pack the copies this gather sends (FSDP2 hook)."""
        slot = self._slot
        owner = module  # FSDP2's own record of the module holding the weight (a deepcopy's too)
        who = f"{type(owner).__name__}.{slot.attr}"
        group = mesh.get_group(mesh.ndim - 1)
        in_backward = torch._C._current_graph_task_id() != -1
        sets = _SETS[slot.copies]
        if not in_backward:
            state = current_autocast()
            if state is None:
                raise RuntimeError(
                    f"{who}: FSDP2 all-gathers this weight quantized (enable_quantized_all_gather) but no "
                    "hybridfp.autocast region is active; run the model's forward inside hybridfp.autocast.")
            q = owner.quantizers(state)["weight"][slot.index]
            tp = tensor_parallel_spec(owner, slot.index)
            if tp is None:
                _check_delayed(q, state, group, who)
                q.set_amax_reduction_group(group)  # every rank encodes with the whole weight's scale
            else:
                # a tensor-parallel shard: the layer's scale is its whole weight's, so the amax
                # goes over dp, then tp (delayed scaling: the layers' own rule, the caller reduces
                # the pending amaxes over every rank before the region ends)
                check_tensor_parallel_blocks(q, owner, slot.index, tuple(outer_size), who)
                q.set_amax_reduction_group(MeshAmax((group, tp.group)))
            sent = sets[0]
            slot.backward_q = q.copy()  # the forward's state: delayed scaling moves at region end
        else:
            if slot.backward_q is None:
                raise RuntimeError(f"{who}: FSDP2's backward all-gather came before any forward gather.")
            q, sent = slot.backward_q, sets[-1]
        param_dtype = getattr(mp_policy, "param_dtype", None) or self.dtype
        src = self._hp.detach()
        src = src.to(param_dtype) if param_dtype != src.dtype else src  # what the module would read
        world, total = mesh.size(mesh.ndim - 1), outer_size[0]
        layout = _layout(slot, q, src, total, world, sets)
        own = src
        if layout.halo:  # encode whole blocks: the rows up to the next block boundary
            src = _block_aligned_rows(src, layout, group)
        q.set_usage(rowwise=ROWWISE in sent, columnwise=COLUMNWISE in sent)
        # codes travel, never BF16 decodes; a precomputed amax replaces the per-gather all-reduce
        with torch.no_grad(), policy(decoded_copies="never"), reduced_amax(q, self, layout.halo, own, who):
            shard = q.quantize(src)
        # uneven shards: FSDP2 takes only inputs of the padded shard's shape, so the bytes go as
        # uint8 tensors of that shape, as many as they fill
        padded = None if layout.even else (layout.shard_rows[0], *outer_size[1:])
        nbytes = _gather_bytes(self, slot, layout, sent, world, who, math.prod(padded) if padded else 1)
        buffer = pack(shard, layout, sent, nbytes)
        inputs = (buffer,) if padded is None else tuple(buffer.view(-1, *padded).unbind(0))
        return inputs, (layout, sent, shard, world, total, param_dtype, nbytes)

    def fsdp_post_all_gather(self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *, out: Optional[torch.Tensor] = None
                             ) -> Optional[tuple[QuantizedTensor, tuple[torch.Tensor, ...]]]:
        """Rebuild the whole quantized weight from the ranks' buffers (FSDP2 hook)."""
        layout, sent, shard, world, rows, dtype, nbytes = metadata
        if len(all_gather_outputs) == 1:
            gathered = all_gather_outputs[0]
        else:  # uneven shards: each rank's bytes are its pieces of the outputs, in order
            gathered = torch.cat([o.reshape(world, -1) for o in all_gather_outputs], dim=1).reshape(-1)
        tensors = unpack(gathered, world, layout, sent, nbytes)
        for o in all_gather_outputs:  # unpacked: FSDP2 allocates them again for the next gather
            o.untyped_storage().resize_(0)
        if out is None:
            whole = _whole_with_room(shard, rows, tensors, layout, dtype)
            inner = tuple(whole.qstorage.tensors())
            _free_unsent(whole, sent)
            return whole, inner
        # a tensor-parallel weight's unsharded parameter is the DTensor wrapping the gathered one
        _refill(out._local_tensor if isinstance(out, DTensor) else out, shard, tensors, sent)
        return None


def _layout(slot: _Slot, q: Any, src: torch.Tensor, total: int, world: int, sets: tuple) -> GatherLayout:
    """The weight's gather layout for quantizer ``q`` (memoized per settings and shape)."""
    key = (repr(q.settings()), type(q).__name__, tuple(src.shape), src.dtype, total, world)
    layout = slot.layouts.get(key)
    if layout is None:
        probe_q = q.copy()
        probe_q.set_amax_reduction_group(None)
        probe_q.set_usage(rowwise=True, columnwise=True)

        def quantize_meta(rows: int) -> QuantizedTensor:
            with torch.no_grad(), policy(decoded_copies="never"):
                return probe_q.quantize(torch.empty((rows, *src.shape[1:]), dtype=src.dtype, device="meta"))
        layout = slot.layouts[key] = gather_layout(quantize_meta, total, world, sets)
    return layout


def _gather_bytes(local: torch.Tensor, slot: _Slot, layout: GatherLayout, sent: tuple, world: int,
                  who: str, unit: int = 1) -> int:
    """The bytes this gather sends per rank: the copies' own size, rounded up to a multiple of
    ``unit`` (an unevenly sharded weight's padded shard elements). FSDP2 sizes a parameter's
    all-gather output by its first gather and reuses it, so where a hybrid's two copies differ
    in size the output made for the other one is dropped (FSDP2 then makes one of the new
    size: it is only a transfer buffer, the weight's tensors are its own). Where FSDP2's
    parameter record cannot be found (another torch version), every gather sends the larger
    copy's size, padded, and a warning says so once."""
    def whole(n: int) -> int:
        return -(-n // unit) * unit

    sizes = {whole(n) for n in layout.set_bytes.values()}
    if len(sizes) == 1:
        return whole(layout.nbytes)
    record = slot.fsdp_param() if slot.fsdp_param is not None else None
    if record is None:
        record = _fsdp_param_of(local)
        slot.fsdp_param = weakref.ref(record) if record is not None else None
    if record is None or not hasattr(record, "all_gather_outputs"):
        if not slot.warned_padding:
            slot.warned_padding = True
            warnings.warn(f"{who}: FSDP2's parameter record was not found (torch {torch.__version__}); "
                          f"both gathers of this hybrid weight send {layout.nbytes} bytes per rank, the "
                          "larger copy's size, padded.", stacklevel=3)
        return whole(layout.nbytes)
    nbytes = whole(layout.set_bytes[sent])
    outputs = record.all_gather_outputs
    if outputs and sum(o.numel() for o in outputs) != nbytes * world:
        record.all_gather_outputs = []  # FSDP2 allocates outputs of this gather's size
    return nbytes


def _fsdp_records() -> Iterator[Any]:
    """FSDP2's records (``FSDPParam``) of every parameter its live module states manage."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
    except ImportError:
        return
    for ref in list(_module_state_mapping.values()):
        state = ref() if isinstance(ref, weakref.ref) else ref
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        for group in groups:
            yield from getattr(group, "fsdp_params", ())


def _fsdp_param_of(local: torch.Tensor) -> Any:
    """FSDP2's record (``FSDPParam``) of the parameter whose local shard is ``local``, or None."""
    for record in _fsdp_records():
        if getattr(record, "_sharded_local_tensor", None) is local:
            return record
    return None


def _block_aligned_rows(src: torch.Tensor, layout: GatherLayout, group: Any) -> torch.Tensor:
    """This rank's rows from its shard's first block boundary to the next rank's: the rows of
    a block that straddles shards are encoded by the rank where the block starts, which takes
    them from the following ranks (one all-gather of each rank's first ``layout.halo`` rows,
    high precision: fewer than a block, or a whole shard where blocks are longer than shards)."""
    import torch.distributed as dist
    rank, world, halo = dist.get_rank(group), len(layout.rank_rows), layout.halo
    c = layout.shard_rows[0]  # FSDP2's chunk: rank j's shard starts at row j * c
    first = src.new_zeros((halo, *src.shape[1:]))
    first[:min(halo, src.shape[0])] = src[:halo]  # a shorter shard's first rows, zero-padded
    firsts = torch.empty((world * halo, *src.shape[1:]), dtype=src.dtype, device=src.device)
    dist.all_gather_into_tensor(firsts, first, group=group)
    lo = sum(layout.rank_rows[:rank])
    hi = lo + layout.rank_rows[rank]
    if hi == lo:  # no block starts in this shard
        return src[:0]
    pieces = [src[lo - rank * c:min(hi, rank * c + src.shape[0]) - rank * c]]
    for j in range(rank + 1, world):
        if j * c >= hi:
            break
        pieces.append(firsts[j * halo:j * halo + min(layout.shard_rows[j], hi - j * c)])
    return torch.cat(pieces)


def _check_delayed(q: Any, state: Any, group: Any, who: str) -> None:
    """Delayed scaling's scale comes from each rank's amax history: the ranks agree only when
    the region reduces the amaxes (its ``amax_reduction_group``)."""
    if q.has_state() and state.amax_reduction_group is None:
        raise ValueError(
            f"{who}: the recipe's weight quantizer keeps a scale from its amax history (delayed "
            "scaling); under FSDP2 each rank sees only its shard, so the ranks' scales would differ. "
            "Pass amax_reduction_group=<the FSDP2 shard group> to hybridfp.autocast.")


def _whole_with_room(shard: QuantizedTensor, rows: int, tensors: dict, layout: GatherLayout,
                     dtype: torch.dtype) -> QuantizedTensor:
    """The whole weight holding every copy any gather sends, those not sent now allocated
    empty: later gathers refill these same tensors (autograd may have saved them)."""
    whole = layout.whole.qstorage
    every = {}
    for d in whole.directions():
        for name, t in whole.part(d).payloads[d].items():
            if (d, name) in tensors:
                every[(d, name)] = tensors[(d, name)]
            elif shard.qstorage.has(d):  # a per-tensor entry of a copy sent now
                every[(d, name)] = shard.qstorage.part(d).payloads[d][name].clone()
            else:  # a copy not sent now: room of the whole weight's size
                every[(d, name)] = torch.empty(t.shape, dtype=t.dtype, device=shard.device)
    return assemble(layout.whole, rows, every, dtype, quantizer=shard.quantizer)


def _free_unsent(whole: QuantizedTensor, sent: tuple[str, ...]) -> None:
    """Free the copies this gather did not send: reading one before a gather refills it fails.
    A tensor both copies hold (high precision keeps one for both directions) stays."""
    storage = whole.qstorage
    kept = {id(t) for d in sent for t in storage.part(d).payloads[d].values()}
    for d in storage.directions():
        if d not in sent:
            for t in storage.part(d).payloads[d].values():
                if id(t) not in kept:
                    t.untyped_storage().resize_(0)


def _refill(out: QuantizedTensor, shard: QuantizedTensor, tensors: dict, sent: tuple[str, ...]) -> None:
    """Copy a later gather's copies into the unsharded weight's own tensors (FSDP2 allocated
    them again), keeping their version counters as FSDP2 does for its parameters."""
    storage = out.qstorage
    for d in sent:
        dst = storage.part(d).payloads[d]
        src_shard = shard.qstorage.part(d).payloads[d]
        for name, t in dst.items():
            src = tensors.get((d, name), src_shard[name])
            with torch.autograd._unsafe_preserve_version_counter(t):
                t.copy_(src)
            note_rewrite(t)  # caches keyed on the version (the GEMMs' BF16 decodes) must see it
    _free_unsent(out, sent)


def enable_quantized_all_gather(model: nn.Module, *, copies: str = "per_direction") -> int:
    """Make FSDP2 all-gather the weights of ``model``'s hybridfp modules quantized.

    Call it before ``fully_shard``. Each weight a hybridfp module quantizes for its GEMMs
    (``quantized_weight_slots``: Linear's, LayerNormLinear's, LayerNormMLP's fc1 / fc2) becomes
    a :class:`QuantizedGatherWeight` Parameter; the optimizer keeps updating the
    high-precision shards. Run the forward inside ``hybridfp.autocast``. A tensor-parallel
    weight (a DTensor from ``ColwiseParallel`` / ``RowwiseParallel`` / ``LayerNormMLPParallel``:
    call this after ``parallelize_module``, then ``fully_shard(..., mesh=mesh["dp"])``) keeps its
    placement and its local tensor is wrapped; its gathers encode with the tensor-parallel
    layer's scale (the amax over dp and tp). A weight held quantized
    (``quantized_model_init``) becomes a ``QuantizedPrimaryWeight``: its FP32 master is sharded
    and each rank keeps its shard of the quantized weight, re-encoded once per optimizer step
    (``hybridfp.quantize_sharded_weights``; ``MasterWeightOptimizer.step`` calls it).

    Parameters
    ----------
    model:
        The model (or one submodule: another call may give another part other ``copies``).
    copies:
        "per_direction": the forward gather sends the rowwise copy, the backward gather the
        columnwise copy. "both": every gather sends both (modules not resharded after forward,
        such as FSDP2's root module, and activation checkpointing).

    Returns
    -------
    int
        The number of weights wrapped.

    Raises
    ------
    ValueError
        An unknown ``copies``; a weight already sharded by FSDP2 (call this first); a DTensor
        weight not placed by hybridfp's tensor-parallel styles.
    """
    if copies not in COPIES:
        raise ValueError(f"enable_quantized_all_gather: copies={copies!r}; expected one of {COPIES}.")
    n = 0
    for module in model.modules():
        unjoin = getattr(module, "unjoin_primary", None)
        if callable(unjoin):  # experts held as one encoding: each Parameter is sharded on its own
            unjoin()
        for attr, index in getattr(module, "quantized_weight_slots", ()):
            p = getattr(module, attr)
            if isinstance(p, QuantizedGatherWeight) or isinstance(getattr(p, "_local_tensor", None), QuantizedGatherWeight):
                getattr(p, "_local_tensor", p)._slot.copies = copies
                n += 1
                continue
            if isinstance(p, QuantizedTensor):  # quantized_model_init: a quantized primary weight
                from .fsdp_primary import primary_parameter
                setattr(module, attr, primary_parameter(p, attr, index, copies))
                n += 1
                continue
            if isinstance(p, DTensor):  # tensor-parallel: FSDP2 shards (and gathers) its local tensor
                slot = _Slot(attr, index, copies)
                setattr(module, attr, wrap_tensor_parallel(module, attr, p, lambda t, s=slot: QuantizedGatherWeight(t, s)))
                n += 1
                continue
            if type(p.data) is not torch.Tensor:
                raise ValueError(f"{type(module).__name__}.{attr} is a {type(p.data).__name__}; call "
                                 "enable_quantized_all_gather before fully_shard.")
            slot = _Slot(attr, index, copies)
            setattr(module, attr, nn.Parameter(QuantizedGatherWeight(p.data, slot), requires_grad=p.requires_grad))
            n += 1
    return n


# ------------------------------------------------------------------ high-precision gathers and the weight cache
# FSDP2 gathers a weight it shards in high precision (no quantized all-gather) into the same
# unsharded Parameter at every unshard and keeps its version counter; the optimizer steps (a load
# writes) the sharded Parameter. A quantized-weight cache entry that outlives its autocast region
# (``weight_caching()``, ``is_first_microbatch``) would match the refilled weight by identity and
# version and serve the codes of the shard's previous values. So the gathers of every such weight
# the cache reads are watched: a gather that carries another shard state than the previous one
# (another sharded Parameter, its version counter moved, or an optimizer step over it: foreach and
# fused steps move no counter) notes a rewrite of the unsharded memory (``utils.rewrites``), which
# the cache's key reads. A gather of unchanged shards (the backward's, the next micro-batch's)
# notes nothing: reuse within a step stays. Every rank notes alike (the same steps and loads).

#: on a watched ``FSDPParam``: the state of the shard its latest gather carried (``_shard_state``)
_GATHERED_ATTR = "_hybridfp_gathered_shard"
#: on a tensor the weight cache read: its memory was looked up in ``_REFILLED`` (a tensor keeps its
#: memory, so one lookup per tensor; FSDP2 refills the same unsharded Parameter)
_CHECKED_ATTR = "_hybridfp_refill_checked"
#: unsharded memory (an untyped storage) -> whether an FSDP2 gather of a high-precision weight
#: refills it (its record watched); weakly keyed, as the storage lives as long as the record
_REFILLED: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: on the sharded Parameter of a watched weight: the optimizer steps that went over it (an
#: attribute, not a table: a weak reference to a Parameter makes ``torch.utils.swap_tensors``,
#: which ``Module.to`` uses for DTensor parameters, refuse it)
_STEPS_ATTR = "_hybridfp_fsdp_steps"

try:
    from torch.distributed._composable_state import _module_state_mapping as _FSDP_STATES
except ImportError:  # another torch: no FSDP2 state is found, nothing is watched
    _FSDP_STATES = {}


def _shard_state(record: Any) -> tuple:
    """What a gather of ``record``'s parameter carries: its sharded Parameter (held: compared by
    identity, never by address; the record holds it too), that Parameter's and its local
    tensor's version counters (a write through ``to_local()`` moves only the latter) and the
    optimizer steps over it."""
    shard = record.sharded_param
    if not hasattr(shard, _STEPS_ATTR):
        setattr(shard, _STEPS_ATTR, 0)
    local = getattr(shard, "_local_tensor", shard)
    return shard, shard._version, local._version, getattr(shard, _STEPS_ATTR)


def _same_shard(seen: Optional[tuple], now: tuple) -> bool:
    """Whether shard state ``now`` is ``seen`` (the same Parameter, versions and steps)."""
    return seen is not None and seen[0] is now[0] and seen[1:] == now[1:]


def _high_precision_unsharded(record: Any) -> Optional[torch.Tensor]:
    """The tensor a module reads of ``record``'s gathered parameter (a tensor-parallel weight's
    local tensor), or None: not gathered yet, or gathered through an FSDP2 extension (the
    quantized all-gather: the module reads the gathered QuantizedTensor as it is, and
    :func:`_refill` notes its rewrites)."""
    if hasattr(getattr(record, "_sharded_local_tensor", None), "fsdp_pre_all_gather"):
        return None
    unsharded = getattr(record, "_unsharded_param", None)
    if unsharded is None:
        return None
    return unsharded._local_tensor if isinstance(unsharded, DTensor) else unsharded


def _on_gather(record: Any) -> None:
    """After a gather of watched ``record``: notes a rewrite when it carried another shard state."""
    now = _shard_state(record)
    if not _same_shard(getattr(record, _GATHERED_ATTR, None), now):
        local = _high_precision_unsharded(record)
        if local is not None:
            note_rewrite(local)
    setattr(record, _GATHERED_ATTR, now)


def _watched_init_unsharded_param(record: Any) -> None:
    """``record.init_unsharded_param`` of a watched record: FSDP2's, then :func:`_on_gather`."""
    type(record).init_unsharded_param(record)
    _on_gather(record)


def _watch(record: Any) -> None:
    """Watch the gathers of ``record``'s parameter: FSDP2 calls its ``init_unsharded_param``
    after every all-gather's copy-out (one rank or several), so a method bound on the record
    sees each.

    Called when the cache first reads a weight, inside the forward whose gather filled it, so
    the memory holds the shard as it is now, which becomes the watched state. (A first read
    after a step FSDP2 did not gather, the parameter kept unsharded across it, would take the
    stepped shard for the memory's; FSDP2 itself computes with the values before the step then.)"""
    on_stepped_parameters(_count_steps)
    record.init_unsharded_param = types.MethodType(_watched_init_unsharded_param, record)
    setattr(record, _GATHERED_ATTR, _shard_state(record))


def _note_refills(ts: Sequence[torch.Tensor]) -> None:
    """``utils.rewrites`` refresher, run when the quantized-weight cache reads weights ``ts``:
    the first time a weight's memory is met, watch the gathers of every FSDP2 parameter gathered
    in high precision so far (one pass over FSDP2's records), its own included where FSDP2
    refills it. Later reads cost an attribute read per weight; without FSDP2 state, nothing."""
    if not _FSDP_STATES:
        return
    for t in ts:
        if getattr(t, _CHECKED_ATTR, False):
            continue
        storage = t.untyped_storage()
        if storage not in _REFILLED:
            for record in _fsdp_records():
                local = _high_precision_unsharded(record)
                if local is not None and local.untyped_storage() not in _REFILLED:
                    _watch(record)
                    _REFILLED[local.untyped_storage()] = True
            if storage not in _REFILLED:
                _REFILLED[storage] = False
        setattr(t, _CHECKED_ATTR, True)


def _count_steps(params: Sequence[torch.Tensor]) -> None:
    """After an optimizer step over ``params`` (``utils.optimizer_steps``: foreach and fused
    steps included, which move no version counter): counts it on each watched sharded Parameter."""
    for p in params:
        if hasattr(p, _STEPS_ATTR):
            setattr(p, _STEPS_ATTR, getattr(p, _STEPS_ATTR) + 1)


register_refresher(_note_refills)
