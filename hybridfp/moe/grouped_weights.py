"""The experts' weight layouts of ``GroupedLinear`` and their quantized copies.

``pack_weights``: the per-expert Parameters ``weight{i}`` live in one [E, N, K] buffer;
``single_parameter``: one [E, N, K] Parameter ``weight`` whose ``unbind(0)`` views are the
experts' weights. Either way the weights are quantized together (``quantize_weights_grouped``)
and cached per expert (slots 0..E-1), for all experts quantized as one joined encoding
(``_GROUP_SLOT``), or for the one Parameter (``_STACK_SLOT``) (``nn/weight_cache.py``). The
module hands its layout to ``quantize_weights_grouped`` (``stacked=``: the packed buffer or the
one Parameter), so the joined weights are read in place without looking for them.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ..quantizers import Quantizer
from ..quantizers.base import set_usages
from ..tensors import QuantizedTensor
from ..nn.base import mark_not_offload
from ..nn.recompute import method_unseen_by_selective_checkpoint
from ..utils.rewrites import current_versions
from ..nn.weight_cache import WeightKey, join_keys, new_entry, reusable, split_entry
from .grouped_tensor import GroupedTensor
from .grouped_linear_function import plan_memo
from .primary_group import join_primary, unjoin_primary
from .quantize_weights import quantize_weights_grouped

#: ``_wcache`` key of the experts' weights quantized together (``GroupedTensor``); the
#: per-expert entries use the expert index.
_GROUP_SLOT = -1
#: ``_wcache`` key of ``single_parameter``'s experts quantized from the one weight Parameter
#: (``_quantized_stack``: a list or a ``GroupedTensor``, keyed by the Parameter).
_STACK_SLOT = -2


class GroupedWeights:
    """``GroupedLinear``'s weight layouts (mixed in before ``QuantizedModule``): packing,
    loading either layout's keys, re-packing after moves, the experts' weights and biases, and
    their quantized copies through the module's weight cache."""

    @property
    def quantized_weight_slots(self) -> tuple[tuple[str, int], ...]:
        """``quantized_model_init``'s slots (``QuantizedModule.quantized_weight_slots``): each
        expert's ``weight{i}`` with its own quantizer set ``i`` (per-expert scales and amax
        histories, as the high-precision layer quantizes them).

        Raises
        ------
        NotImplementedError
            ``single_parameter=True``: one [E, N, K] Parameter would have to hold one encoding
            for experts whose weight quantizers are separate (a per-tensor scale and an amax
            history per expert), and a parameter's encoding is its quantizer's."""
        if self.single_parameter:
            raise NotImplementedError(
                f"{self._who()}: quantized_model_init cannot hold a single_parameter=True layer's "
                "weight quantized: its one [num_gemms, out, in] Parameter would need one encoding "
                "for experts that each quantize with their own quantizer (per-expert scales and "
                "amax histories). Build the layer with single_parameter=False (one quantized "
                "Parameter weight{i} per expert), or outside quantized_model_init.")
        return tuple((f"weight{i}", i) for i in range(self.num_gemms))

    def after_weights_quantized(self) -> None:
        """Called by ``quantized_model_init`` once the experts' weights are QuantizedTensor
        parameters: the packed high-precision buffer they were slices of is let go, and the
        quantized ones are joined into one encoding where the format allows (``primary_group``)."""
        self._pack()
        self._join_primary()
        # joined again after moves and loads if joined now, or once materialized (meta device)
        self._join_wanted = self._primary is not None or any(getattr(w, "is_meta", False) for w in self.weights())

    def _join_primary(self) -> None:
        """Join the experts' quantized Parameters into one encoding (``primary_group.join_primary``).
        Only at construction and after a move or a load: never in a forward, where FSDP2 may
        hand in gathered Parameters whose buffers it writes again later."""
        self._primary = join_primary(self, self.weights()) if not self.single_parameter else None

    def _rejoin_primary(self) -> None:
        """After a move or a load: quantized Parameters built to be joined (not un-joined since)
        and not held so now (new Parameters or buffers; built on the meta device) are joined
        again, as built."""
        if self._join_wanted and (self._primary is None or not self._primary.holds(self.weights())):
            self._join_primary()

    def unjoin_primary(self) -> None:
        """Give each expert's quantized Parameter its own contiguous copies again (the values
        unchanged) and drop the joined encoding: for code that takes the Parameters over one by
        one (``enable_quantized_all_gather`` shards each with FSDP2)."""
        group, self._primary = self._primary, None
        self._join_wanted = False
        if group is not None:
            unjoin_primary(group)

    def _primary_weights(self, weights: Sequence[torch.Tensor]) -> Optional[GroupedTensor]:
        """The joined quantized primary weights when ``weights`` are the experts' Parameters still
        held joined; else None (the per-expert route)."""
        group = self._primary
        return group.group if group is not None and group.holds(weights) else None

    def _pack(self) -> None:
        """Move the expert weights into one buffer (``pack_weights``) and remember it, unless they
        still are its slices or are not plain dense tensors (DTensor shards, quantized
        parameters, meta tensors: their storage belongs to someone else)."""
        if self.single_parameter:  # one buffer already
            return
        ws = self.weights()
        if not self.pack_weights or len(ws) < 2:
            self._packed = None
            return
        # plain dense tensors first: a wrapper subclass (DTensor) may not expose a data pointer
        if (any(type(w.data) is not torch.Tensor or w.is_meta or w.layout != torch.strided for w in ws)
                or len({(w.shape, w.dtype, w.device) for w in ws}) > 1):
            self._packed = None
            return
        if self.packed_buffer(ws) is not None:
            return
        with torch.no_grad():
            buf = torch.stack([w.detach() for w in ws])
            for w, b in zip(ws, buf):
                # .data keeps each Parameter's own version counter (a change to one expert
                # re-quantizes that expert only), unlike Parameters made from views
                w.data = b
        self._packed = buf

    def packed_buffer(self, weights: Optional[Sequence[torch.Tensor]] = None) -> Optional[torch.Tensor]:
        """The [E, N, K] buffer ``pack_weights`` moved the experts' weights into, while each of
        ``weights`` (default: the module's) still is its slice e; None otherwise (never packed,
        a ``.data =`` or ``load_state_dict(assign=True)`` since, or ``single_parameter``, whose
        buffer is the Parameter ``weight``).

        Parameters
        ----------
        weights:
            The experts' weights in order (the module's Parameters ``weight{i}``).

        Returns
        -------
        The buffer, or None."""
        buf = self._packed
        ws = self.weights() if weights is None else weights
        if buf is None or len(ws) != buf.shape[0]:
            return None
        # a replaced expert has another address or dtype; slice e starts e strides in
        base, step, dtype = buf.data_ptr(), buf.stride(0) * buf.element_size(), buf.dtype
        for e, w in enumerate(ws):
            if w.data_ptr() != base + e * step or w.dtype != dtype or w.shape != buf.shape[1:]:
                return None
        return buf

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        """``nn.Module``'s, after rewriting the other layout's keys into this module's (``weight{i}``
        / ``bias{i}`` stacked into ``weight`` / ``bias`` with ``single_parameter``, and back), so a
        checkpoint loads into either layout. ``load_state_dict`` hands this a copy of the dict."""
        for name in ("weight", "bias"):
            per_expert = [f"{prefix}{name}{i}" for i in range(self.num_gemms)]
            if self.single_parameter and prefix + name not in state_dict and all(k in state_dict for k in per_expert):
                parts = [state_dict[k] for k in per_expert]
                # experts of different shapes are left as they are: torch then reports the keys
                if all(torch.is_tensor(t) and t.shape == parts[0].shape for t in parts):
                    for k in per_expert:
                        del state_dict[k]
                    state_dict[prefix + name] = torch.stack(parts)
            elif not self.single_parameter and prefix + name in state_dict and per_expert[0] not in state_dict:
                whole = state_dict[prefix + name]
                if torch.is_tensor(whole) and whole.dim() >= 1 and whole.shape[0] == self.num_gemms:
                    del state_dict[prefix + name]
                    # copies, not views of one tensor: with assign=True each expert keeps its own
                    # version counter (an update to one re-quantizes that expert only)
                    state_dict.update(zip(per_expert, (t.clone() for t in whole.unbind(0))))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._pack()  # assign=True put new tensors in place: back into one buffer
        self._rejoin_primary()

    def _apply(self, fn: Any, recurse: bool = True) -> "GroupedWeights":
        """``nn.Module._apply`` (``.to()``, ``.cuda()``, ``.half()``: each parameter moved on its
        own), then the weights re-packed into one buffer."""
        out = super()._apply(fn, recurse)
        self._rejoin_primary()
        if self.single_parameter:
            # the views (and the cached quantized weights keyed by them) belong to the old tensor:
            # dropped now, so a move (``.cpu()`` to offload) frees it
            self._views, self._views_key = [[], []], None
            self._wcache.clear()
        self._pack()
        return out

    def weights(self) -> list[torch.Tensor]:
        """Expert weights in order: the Parameters ``weight{i}``, or with ``single_parameter``
        views of ``weight`` [i] (detached: gradients reach ``weight`` through ``forward``)."""
        if self.single_parameter:
            return self._expert_views()[0]
        return self._per_expert("weight")

    def biases(self) -> list[torch.Tensor]:
        """Expert biases in order (empty without bias); detached views of ``bias`` with
        ``single_parameter``."""
        if not self.use_bias:
            return []
        if self.single_parameter:
            return self._expert_views()[1]
        return self._per_expert("bias")

    def _per_expert(self, stem: str) -> list[torch.Tensor]:
        """``{stem}0``, ``{stem}1``, ... read from the module's Parameter table, with no
        ``nn.Module.__getattr__`` call per expert (every forward asks), or through ``getattr``
        where a name is not a registered Parameter (a parametrization's property)."""
        params = self._parameters
        names = [f"{stem}{i}" for i in range(self.num_gemms)]
        return [params[n] if n in params else getattr(self, n) for n in names]

    def _expert_views(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``single_parameter``: per-expert detached views of ``weight`` and ``bias``, made again
        only when a parameter's tensor changes (``.to()``, ``.data =``, ``load_state_dict(assign=
        True)``): an in-place update keeps them (their version counter is the parameter's)."""
        w, b = self.weight, self.bias
        for what, t in (("weight", w), ("bias", b)):
            if isinstance(t, QuantizedTensor):
                raise ValueError(f"GroupedLinear {self.name or ''}: single_parameter=True takes a high-precision "
                                 f"{what} [num_gemms, ...]; got a quantized one. Quantized parameters need one "
                                 "per expert: build the module with single_parameter=False (weight{i}).")
        key = tuple((id(t), t.data_ptr(), t.shape, t.dtype, t.device) for t in (w, b) if t is not None)
        if key != self._views_key:
            self._views = [list(w.detach().unbind(0)), list(b.detach().unbind(0)) if b is not None else []]
            self._views_key = key
        return self._views[0], self._views[1]

    # a forward's miss is mostly its recomputation's hit: hidden from selective activation
    # checkpointing, which numbers ops per call (nn/recompute.py); QuantizedModule.quantized_weight
    # hides its own miss path
    @method_unseen_by_selective_checkpoint
    def quantized_weights(self, weights: Sequence[torch.Tensor], qs: Sequence[Quantizer], columnwise: bool,
                          region: Optional[object] = None,
                          is_first_microbatch: Optional[bool] = None) -> Sequence[torch.Tensor]:
        """Every expert's ``quantized_weight`` (same cache entries and rule, nn/weight_cache.py),
        the ones not reusable quantized together by ``quantize_weights_grouped`` (one encoding of
        the joined weights where the formats allow; bitwise each expert's own). All experts
        quantized as views of shared encodings come back (and are cached) as one
        ``GroupedTensor``. ``region`` / ``is_first_microbatch``: as ``quantized_weight``'s, for
        every expert at once."""
        if any([w.is_inference() for w in weights]):  # no version counters: never cached
            return [w if isinstance(w, QuantizedTensor) else self._uncached_inference_weight(w, q, columnwise,
                                                                                           is_first_microbatch)
                    for w, q in zip(weights, qs)]
        if self.single_parameter and weights is self._views[0]:
            return self._quantized_stack(qs, columnwise, region, is_first_microbatch)
        held = self._primary_weights(weights)
        if held is not None:  # quantized primary weights, joined: read as they are
            return held
        who = self._who()
        # the keys _weight_key gives, for every expert at once: one build check, one version
        # read (no Python call per expert beyond the key itself: bench_moe_overhead)
        build_key = self._build_key_of(list(qs))
        plain = [w for w in weights if not isinstance(w, QuantizedTensor)]
        versions = iter(current_versions(plain))
        keys: list = [None if isinstance(w, QuantizedTensor) else WeightKey(next(versions), q.state_version(), build_key)
                      for w, q in zip(weights, qs)]
        joined = self._wcache.get(_GROUP_SLOT)
        if joined is not None:
            # reusable() may raise (is_first_microbatch=False): the entry stays for a retry
            if None not in keys and reusable(joined, list(weights), join_keys(keys), columnwise, region,
                                             is_first_microbatch, who):
                return joined.qw
            del self._wcache[_GROUP_SLOT]
            if is_first_microbatch is None:
                # some weights changed: the unchanged experts keep their quantized tensors
                # (per-expert entries from here on, same region), the others are quantized below
                for i, entry in enumerate(split_entry(joined)):
                    self._wcache[i] = entry
        out: list[Optional[torch.Tensor]] = [None] * len(weights)
        missing = []  # keys were read before quantizing (as quantized_weight does)
        for i, (w, key) in enumerate(zip(weights, keys)):
            if key is None:  # already quantized (quantized parameters)
                mark_not_offload(w)  # the parameter holds its payloads: offloading them frees nothing
                out[i] = w
            elif reusable(self._wcache.get(i), w, key, columnwise, region, is_first_microbatch, who):
                out[i] = self._wcache[i].qw
            else:
                missing.append(i)
        if missing:
            set_usages([qs[i] for i in missing], [True] * len(missing), [columnwise] * len(missing))
            # every expert at once: the packed buffer is the joined weights (read in place)
            packed = self.packed_buffer(weights) if len(missing) == len(weights) else None
            qws = quantize_weights_grouped([qs[i] for i in missing], [weights[i] for i in missing],
                                           plan_memo(self), stacked=packed)
            if isinstance(qws, GroupedTensor) and len(missing) == len(weights):
                # all experts quantized together as views of shared encodings: cached as one
                # entry (its per-expert tensors are built only if something asks for them);
                # per-expert entries of older weights would only hold memory now
                for i in range(len(weights)):
                    self._wcache.pop(i, None)
                self._wcache[_GROUP_SLOT] = new_entry(joined, join_keys(keys), qws, list(weights), region,
                                                      is_first_microbatch)
                return qws
            for i, qw in zip(missing, qws):
                self._wcache[i] = new_entry(self._wcache.get(i), keys[i], qw, weights[i], region, is_first_microbatch)
                out[i] = qw
        return out  # type: ignore[return-value]

    def _quantized_stack(self, qs: Sequence[Quantizer], columnwise: bool, region: Optional[object] = None,
                         is_first_microbatch: Optional[bool] = None) -> Sequence[torch.Tensor]:
        """``quantized_weights`` of ``single_parameter``'s expert views: one cache entry for the
        one Parameter (its version counter is every expert's; the quantizers are the module's,
        rebuilt only with a new recipe key, which empties the cache), the stacked weight handed
        to ``quantize_weights_grouped`` as it is. The per-expert path would build 64 keys and check
        the views' adjacency twice a call (host work a 64-expert MoE step cannot afford:
        ``python -m bench.bench_moe_overhead``); the results are the same tensors."""
        w = self.weight
        key = WeightKey.of(w, tuple([q.state_version() for q in qs]), self._build_key_of(list(qs)))
        entry = self._wcache.get(_STACK_SLOT)
        if reusable(entry, w, key, columnwise, region, is_first_microbatch, self._who()):
            return entry.qw  # type: ignore[union-attr]
        set_usages(qs, [True] * len(qs), [columnwise] * len(qs))
        qws = quantize_weights_grouped(qs, self._views[0], plan_memo(self), stacked=w.detach())
        self._wcache[_STACK_SLOT] = new_entry(entry, key, qws, w, region, is_first_microbatch)
        return qws
