"""Quantized primary weights of a ``GroupedLinear`` held as one joined encoding.

Under ``quantized_model_init`` every expert's ``weight{i}`` is its own ``QuantizedTensor``
Parameter. Kept apart, a 64-expert layer pays for that twice a step: re-encoding the weights
from their FP32 masters takes one encode per expert (host work: launches for 64 experts x 2
layers), and every fprop / dgrad re-joins the experts' copies into one grouped operand. So the
layer joins them once: it encodes a ``GroupedTensor`` of the weights' layout (``quantize_weights
_grouped``, the same quantizers), copies each expert's payload into its cut and makes that cut
the Parameter's storage. The Parameters stay the same objects (optimizers, checkpoints and
``update_quantized`` see nothing new) and every write to one lands in the joined copies, which
the grouped GEMMs then read as they are (:meth:`PrimaryGroup.holds`), and re-encoding from the
masters is one grouped encode and one copy per joined tensor (:func:`requantize_primary`),
bitwise each expert's own ``update_quantized``.

Formats whose grouped encoding is not views of joined copies (per-expert copies: delayed
scaling's amax histories, stochastic rounding's draws, FP8 block columnwise copies for cuBLAS)
are not joined; their experts keep their own storages and the per-expert paths.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Sequence

import torch

from ..nn.base import mark_not_offload
from ..quantizers.base import set_usages
from ..tensors import QuantizedStorage, QuantizedTensor
from ..tensors.storage import DIRECTIONS
from .grouped_tensor import GroupedTensor
from .quantize_weights import quantize_weights_grouped

#: id(a joined Parameter's storage) -> (that storage, its module, its expert index), weakly: how
#: ``quantize_master_weights`` finds the layer that can re-encode a Parameter with its experts
#: (a Parameter carries no reference to its module). Keyed by the storage, not the Parameter: a
#: weak reference to a Parameter would make ``torch.utils.swap_tensors`` refuse it. Entries are
#: checked against the module's own record before use, so a recycled id or a copy never matches.
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref, int]] = {}


class PrimaryGroup:
    """The experts' quantized primary weights and the ``GroupedTensor`` their storages are cuts of.

    Parameters
    ----------
    group:
        The joined encoding (joined-only form).
    params:
        The experts' Parameters, in order.
    """

    def __init__(self, group: GroupedTensor, params: Sequence[QuantizedTensor]) -> None:
        self.group = group
        self.params = tuple(params)
        self.storages = tuple(p.qstorage for p in params)
        self.directions = group.directions()
        self.plans: dict = {}  # quantize_grouped's plan memo for the re-encodes

    def holds(self, weights: Sequence[torch.Tensor]) -> bool:
        """Whether ``weights`` are this group's Parameters, each still holding its cut with every
        joined copy (a Parameter replaced, a storage swapped or a copy dropped: no longer).

        Parameters
        ----------
        weights:
            The experts' weights a GEMM is about to read, in order.

        Returns
        -------
        bool
            True when the joined encoding is their current value."""
        if len(weights) != len(self.params):
            return False
        dirs = self.directions
        # ``_storage``, not the ``qstorage`` property: asked of every expert at every forward
        for w, p, s in zip(weights, self.params, self.storages):
            if w is not p or w._storage is not s or s.directions() != dirs:
                return False
        return True


def _slots(storage: QuantizedStorage) -> list[tuple[str, str, torch.Tensor]]:
    """(direction, name, tensor) of every payload tensor, in a fixed order."""
    return [(d, n, t) for d in storage.directions() for n, t in sorted(storage.payloads[d].items())]


def _same_layout(a: QuantizedStorage, b: QuantizedStorage, dtype: bool = True) -> bool:
    """Whether two storages hold the same copies in the same format, options and tensor shapes
    (``dtype``: and the same high-precision dtype; an encode of FP32 masters into a BF16
    Parameter's buffers writes the same codes)."""
    if type(a) is not type(b) or a.shape != b.shape or (dtype and a.dtype != b.dtype) \
            or a.directions() != b.directions() or a.decoded_directions() != b.decoded_directions():
        return False
    sa, sb = _slots(a), _slots(b)
    return len(sa) == len(sb) and all(
        (da, na, ta.shape, ta.dtype) == (db, nb, tb.shape, tb.dtype) for (da, na, ta), (db, nb, tb) in zip(sa, sb))


def _encode_joined(params: Sequence[QuantizedTensor], values: torch.Tensor, plans: Optional[dict]
                   ) -> Optional[GroupedTensor]:
    """The experts' [E, N, K] ``values`` encoded by their Parameters' quantizers into the copies
    and layout (codes or decoded copies) the Parameters hold; None where that is not one
    joined-only ``GroupedTensor``. The quantizers' usage and decoded-copy settings are restored."""
    qs = [p.quantizer for p in params]
    if any([q is None or q.uses_randomness() or q.has_state() for q in qs]) or len({id(q) for q in qs}) != len(qs):
        # a draw would advance torch's generator, an amax would be recorded into the state (a
        # hybrid's has_state asks both children); shared quantizers cannot differ per expert
        return None
    want = params[0].directions()
    decoded = params[0].qstorage.decoded_directions()
    saved = [(q.rowwise_usage, q.columnwise_usage, q._hold_decoded) for q in qs]
    try:
        set_usages(qs, ["rowwise" in want] * len(qs), ["columnwise" in want] * len(qs))
        for q in qs:
            q._hold_decoded = decoded  # the layout the Parameters hold, as update_quantized writes
        out = quantize_weights_grouped(qs, list(values.unbind(0)), plans, stacked=values)
    finally:
        set_usages(qs, [r for r, _, _ in saved], [c for _, c, _ in saved])
        for q, (_, _, h) in zip(qs, saved):
            q._hold_decoded = h
    return out if isinstance(out, GroupedTensor) and out.joined_only else None


def join_primary(module: Any, params: Sequence[torch.Tensor]) -> Optional[PrimaryGroup]:
    """Join ``module``'s experts' quantized Parameters ``params`` into one encoding (module
    docstring): each Parameter's payload copied into its cut of a joined layout, the cut made its
    storage. None (nothing changed) where they cannot be: not all quantized, of different
    layouts, on the meta device, or a format whose grouped encoding is not joined copies.

    Parameters
    ----------
    module:
        The ``GroupedLinear`` holding ``params`` (registered as their owner).
    params:
        Its experts' ``weight{i}`` in order.

    Returns
    -------
    The group, or None."""
    if len(params) < 2 or not all(isinstance(p, QuantizedTensor) for p in params):
        return None
    first = params[0].qstorage
    if params[0].is_meta or any(not _same_layout(first, p.qstorage) for p in params[1:]):
        return None
    values = torch.zeros((len(params), *first.shape), dtype=params[0].dtype, device=params[0].device)
    with torch.no_grad():
        group = _encode_joined(params, values, None)
        if group is None:
            return None
        cuts = [t.qstorage for t in group.experts()]
        if any(not _same_layout(c, p.qstorage) for c, p in zip(cuts, params)) or not _all_views(group, cuts):
            return None
        for c, p in zip(cuts, params):
            for (_, _, dst), (_, _, src) in zip(_slots(c), _slots(p.qstorage)):
                dst.copy_(src)
    for i, (c, p) in enumerate(zip(cuts, params)):
        c.label = p.qstorage.label
        p._storage = c  # the Parameter's copies are now views of the joined ones
        _OWNERS[id(c)] = (weakref.ref(c), weakref.ref(module), i)
        weakref.finalize(c, _forget, id(c))
    # the Parameters hold these buffers anyway: an offload context moving them would free nothing
    mark_not_offload(*_joined_tensors(group), *(t for c in cuts for _, _, t in _slots(c)))
    return PrimaryGroup(group, params)


def _joined_tensors(group: GroupedTensor) -> list[torch.Tensor]:
    """Every tensor of ``group``'s joined copies (storages' payloads and per-expert scales)."""
    out: list[torch.Tensor] = []
    for d in DIRECTIONS:
        j = group.joined(d)
        if j is not None:
            out += [t for _, _, t in _slots(j.storage)] + ([j.scales] if j.scales is not None else [])
    return out


def _all_views(group: GroupedTensor, cuts: Sequence[QuantizedStorage]) -> bool:
    """Whether every payload tensor of every expert's cut lies in the memory of a joined tensor,
    and every joined tensor is so reached by some cut (a per-tensor-scaled joined copy's own
    ``scale_inv``, a constant 1 its codes are read with, excepted): then a write through a
    Parameter changes what the GEMMs read, and nothing the GEMMs read is the joined copies'
    alone. A cut holding a tensor of its own (a hybrid's per-expert amax stacked anew) fails."""
    memory = {t.untyped_storage().data_ptr() for t in _joined_tensors(group)}
    reached = {t.untyped_storage().data_ptr() for c in cuts for _, _, t in _slots(c)}
    if not reached <= memory:
        return False
    for d in DIRECTIONS:
        j = group.joined(d)
        if j is None:
            continue
        for _, name, t in _slots(j.storage):
            if t.untyped_storage().data_ptr() not in reached and not (j.scales is not None and name == "scale_inv"):
                return False
    return True


def _forget(key: int) -> None:
    """Drop a dead storage's ``_OWNERS`` entry (its weak reference is cleared by then; an entry
    whose storage lives belongs to another)."""
    entry = _OWNERS.get(key)
    if entry is not None and entry[0]() is None:
        del _OWNERS[key]


def unjoin_primary(group: PrimaryGroup) -> None:
    """Give each of ``group``'s Parameters still holding its cut its own contiguous copies (the
    same values); the joined encoding is then no one's.

    Parameters
    ----------
    group:
        The module's joined primary weights (``GroupedLinear.unjoin_primary`` drops its record)."""
    for p, s in zip(group.params, group.storages):
        _OWNERS.pop(id(s), None)
        if p.qstorage is s:
            p._storage = s.map_tensors(lambda t: t.clone(memory_format=torch.contiguous_format), copies=True)


def owner_of(p: torch.Tensor) -> Optional[tuple[Any, int]]:
    """The layer whose joined primary weights hold ``p``.

    Parameters
    ----------
    p:
        A quantized Parameter.

    Returns
    -------
    (the ``GroupedLinear``, the expert index), or None: not joined, or no longer (its module
    dead, its group replaced or dropped)."""
    s = p.qstorage
    entry = _OWNERS.get(id(s))
    if entry is None:
        return None
    ref, module_ref, i = entry
    module = module_ref()
    if ref() is not s or module is None:
        _OWNERS.pop(id(s), None)  # a dead module or a recycled id
        return None
    group = getattr(module, "_primary", None)
    if group is None or i >= len(group.params) or group.params[i] is not p or group.storages[i] is not s:
        return None
    return module, i


def stacked_view(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """``torch.stack(tensors)`` as a view, without a copy, where the tensors already lie one
    after another in one memory block (each contiguous, of one shape and dtype, expert ``i`` at
    ``i`` times one tensor's size from the first); else None.

    Parameters
    ----------
    tensors:
        Equally shaped tensors, in order.

    Returns
    -------
    The [len(tensors), *shape] view (detached), or None."""
    if not tensors:
        return None
    first = tensors[0]
    n, base, memory = first.numel(), first.storage_offset(), first.untyped_storage().data_ptr()
    for i, t in enumerate(tensors):
        if (t.shape != first.shape or t.dtype != first.dtype or t.device != first.device or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != memory or t.storage_offset() != base + i * n):
            return None
    return first.detach().as_strided((len(tensors), *first.shape), (n, *first.stride()), base)


def requantize_primary(group: PrimaryGroup, masters: Sequence[torch.Tensor]) -> bool:
    """Re-encode ``group``'s Parameters from their masters (one per expert, in order) with one
    grouped encode and one copy per joined tensor: bitwise each Parameter's ``update_quantized``
    (the same quantizers and copies). False, with nothing written, where the group no longer
    holds its Parameters as joined (the caller re-encodes them one by one).

    Parameters
    ----------
    group:
        The layer's joined primary weights.
    masters:
        One high-precision master per expert, in order, each of its Parameter's shape.

    Returns
    -------
    bool
        Whether the Parameters were re-encoded.

    Raises
    ------
    ValueError
        A master's shape differs from its Parameter's."""
    if not group.holds(group.params):
        return False
    shape = group.params[0].shape
    for i, m in enumerate(masters):
        if tuple(m.shape) != tuple(shape):
            raise ValueError(f"quantize_master_weights: the master of expert {i} has shape {tuple(m.shape)}, "
                             f"its parameter {group.params[i].qstorage.describe()}.")
    with torch.no_grad():
        # masters held as one [E, N, K] buffer (MasterWeightOptimizer packs a joined layer's)
        # are read in place: a stack would move 8 bytes an element and hold 4 more meanwhile
        values = stacked_view(masters)
        if values is None:
            values = torch.stack([m.detach() for m in masters])
        fresh = _encode_joined(group.params, values, group.plans)
        if fresh is None or fresh.directions() != group.directions:
            return False
        pairs = []
        for d in DIRECTIONS:
            old, new = group.group.joined(d), fresh.joined(d)
            if old is None:
                continue
            if not _same_layout(old.storage, new.storage, dtype=False) or (old.scales is None) != (new.scales is None):
                return False
            pairs += [(a, b) for (_, _, a), (_, _, b) in zip(_slots(old.storage), _slots(new.storage))]
            if old.scales is not None:
                pairs.append((old.scales, new.scales))
        for a, b in pairs:
            if a.data_ptr() != b.data_ptr():  # a shared constant (a scaled copy's scale_inv 1) is left alone
                a.copy_(b)
    return True
