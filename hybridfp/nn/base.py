"""What every hybridfp module shares: building quantizers from the active recipe, naming
roles, caching quantized weights, finishing stateful quantizers at the end of a step, and
reporting GEMMs that run emulated. Their quantizers' state in ``state_dict`` is
``quantizer_state.py``'s (``QuantizedModule`` inherits it)."""

from __future__ import annotations

import contextvars
from collections import Counter
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Policy, current_policy
from ..gemm import reads_bf16_decodes, report_emulated
from ..quantizers import Quantizer
from ..quantizers.base import reduce_pending_amaxes
from ..recipes import AutocastState, QuantizerRole, current_autocast
from ..tensors import COLUMNWISE, ROWWISE, MissingDirectionError, QuantizedTensor
from . import quantized_init, recompute
from .quantizer_state import QuantizerStateMixin, _extra_state_not_for_save_pretrained
from .weight_cache import WeightEntry, WeightKey, new_entry, reusable

SLOTS = ("input", "weight", "grad_output")
#: The slots quantized in the forward pass, inside the autocast region.
FORWARD_SLOTS = ("input", "weight")

#: Inside a checkpointed forward's module call: (the module, the (key, quantizers) builds its
#: ``quantizers()`` returned in the call), per thread and task as autocast's regions.
_CALL_QUANTIZERS: contextvars.ContextVar[Optional[tuple[Any, list]]] = contextvars.ContextVar(
    "hybridfp_call_quantizers", default=None)

#: While a module call of a checkpointed segment is recomputed: (the module, the key of the
#: quantizer build its forward used), per thread and task.
_REPLAYED_BUILD: contextvars.ContextVar[Optional[tuple[Any, Any]]] = contextvars.ContextVar(
    "hybridfp_replayed_build", default=None)

#: The attribute :func:`mark_not_offload` sets: CPU offload leaves such a saved tensor in place.
NOT_OFFLOADED = "_hybridfp_not_offloaded"


def mark_not_offload(*tensors: Optional[torch.Tensor]) -> None:
    """Keep these tensors where they are when a CPU offload context sees them saved for backward
    (TransformerEngine's name). hybridfp marks the payloads of its cached quantized weights: the
    module's weight cache holds them anyway, so moving them would free nothing. None is skipped.

    Parameters
    ----------
    *tensors:
        Plain tensors (for a ``QuantizedTensor``, its payload tensors are marked).

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> t = torch.zeros(4)
    >>> hf.mark_not_offload(t)
    >>> getattr(t, "_hybridfp_not_offloaded")
    True
    """
    for t in tensors:
        if isinstance(t, QuantizedTensor):
            mark_not_offload(*t.qstorage.tensors())
        elif t is not None:
            setattr(t, NOT_OFFLOADED, True)


def _replay_copies(quantizers: Optional[dict]) -> Optional[dict]:
    """``quantizers`` (slot -> list) for a checkpoint record or replay: the stateful ones of the
    forward slots as copies (their state now: a later region end moves the module's own; a
    replay's quantizing must not record into the record's), the others as they are (the
    gradient quantizer is the live one, as in a backward without recompute)."""
    if quantizers is None or not any(q.has_state() for s in FORWARD_SLOTS for q in quantizers.get(s, ())):
        return quantizers
    # copied after the forward's call, before the recomputation's: hidden from selective
    # activation checkpointing, which would number the copies' ops in the other calls' places
    return recompute.unseen_by_selective_checkpoint(lambda: {
        slot: [q.copy() if slot in FORWARD_SLOTS and q.has_state() else q for q in qs]
        for slot, qs in quantizers.items()})


#: The three GEMMs of a linear: (name, layout, (slot, direction) of A, (slot, direction) of B).
GEMMS = (
    ("fprop", "TN", ("input", ROWWISE), ("weight", ROWWISE)),
    ("dgrad", "NN", ("grad_output", ROWWISE), ("weight", COLUMNWISE)),
    ("wgrad", "NT", ("grad_output", COLUMNWISE), ("input", COLUMNWISE)),
)

#: Per slot, the copies that are only ever GEMM operands (never saved as the module's
#: activations: the input's columnwise copy is): candidates for copies held as their BF16
#: decodes (``Quantizer.hold_decoded``), as the policy's ``decoded_copies`` says.
DECODED_COPIES = {"weight": (ROWWISE, COLUMNWISE), "grad_output": (ROWWISE, COLUMNWISE), "input": (ROWWISE,)}



def _unrecognised_recompute() -> bool:
    """Whether the calling thread runs a forward inside a backward pass, not as the replay of a
    recorded module call (``nn/recompute.py``). Under torch.compile it runs when the graph is
    traced and its result is a constant of the graph (no guard): a retrace inside a backward
    pass, as a checkpoint recomputing a compiled module makes, is refused as it is traced."""
    return torch._C._current_graph_task_id() != -1 and not recompute.in_replay()


# what torch._dynamo.assume_constant_result sets, set here: reaching torch._dynamo would import
# Dynamo with hybridfp (tests/test_import.py); tests/nn/test_compile.py's one-graph tests trace
# through this call and fail if Dynamo stops reading the mark
_unrecognised_recompute._dynamo_marked_constant = True  # type: ignore[attr-defined]



class QuantizedModule(QuantizerStateMixin, nn.Module):
    """Base of Linear, LayerNormLinear and GroupedLinear.

    ``name`` is the module's qualified name (set by ``hybridfp.convert`` / ``set_names``,
    or passed in); it appears in every role and error message.

    Parameters
    ----------
    name:
        The qualified name (None: "").
    num_quantizer_sets:
        Quantizers per slot (one per expert for GroupedLinear).
    """

    module_type = "linear"
    in_features: int  # set by every subclass
    #: Whether this module's quantize calls may use an amax recorded by the kernel that wrote
    #: the input (``Quantizer.reads_known_amax``); see :meth:`quantizers`.
    reads_recorded_amax = True
    #: Whether its quantize calls may use per-row-group amaxes recorded by the kernel that wrote
    #: the input (an MoE layer's experts, ``hybridfp.tensors.known_amax`` with splits).
    reads_recorded_group_amax = False
    #: The tensor-parallel plan a ``hybridfp.ColwiseParallel`` / ``RowwiseParallel`` /
    #: ``LayerNormMLPParallel`` style installed (its ``forward`` runs the module on the local
    #: shards, its ``group`` reduces delayed scaling's amaxes); None: not parallelized.
    _tensor_parallel: Any = None
    #: Whether the module's backward honours a recipe's ``backward_override``; one that does
    #: not refuses such a recipe (see :meth:`quantizers`) rather than ignore it.
    supports_backward_override = False
    #: (parameter attribute, quantizer set) of each weight ``quantized_model_init`` may hold as a
    #: QuantizedTensor parameter; empty: the module does not support it (it refuses).
    quantized_weight_slots: tuple[tuple[str, int], ...] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # each subclass's constructor ends by quantizing its weights inside
        # hybridfp.quantized_model_init (nn/quantized_init.py)
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            cls.__init__ = quantized_init.construction(cls.__dict__["__init__"])  # type: ignore[method-assign]

    def __init__(self, name: Optional[str] = None, num_quantizer_sets: int = 1) -> None:
        super().__init__()
        self.name = name or ""
        self._num_sets = num_quantizer_sets
        # (region key, quantizers built for it) as one value: a thread reads both at once while
        # another thread's region, of another recipe, may rebuild them
        self._qpair: tuple[Optional[tuple], dict[str, list[Quantizer]]] = (None, {})
        self._stateful: list[Quantizer] = []  # of _quantizers: those with state (``Quantizer.has_state``)
        # cached quantized weights by slot (expert index; GroupedLinear's joined entries use
        # negative slots): see weight_cache.py for when an entry may be reused
        self._wcache: dict[int, WeightEntry] = {}
        self._reads_known_amax = False  # any built quantizer reads recorded amaxes (see quantizers())
        self._reads_known_group_amax = False  # ... recorded per row group
        # its _extra_state (a dict) stays out of an enclosing transformers model's save_pretrained
        self.register_state_dict_post_hook(_extra_state_not_for_save_pretrained)

    def check_input_features(self, x: torch.Tensor) -> None:
        """A clear error naming the module when x's last dim is not ``in_features`` (the GEMM
        would otherwise fail deep inside with operand shapes only)."""
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            who = self._who()
            raise ValueError(f"{who}: the input has shape {tuple(x.shape)}; its last dimension must "
                             f"be in_features={self.in_features}.")

    @staticmethod
    def torch_autocast_input(x: torch.Tensor) -> torch.Tensor:
        """Under torch's autocast (AMP) the GEMM input takes the autocast dtype, as
        ``nn.Linear``'s does: torch casts F.linear's inputs but not a custom Function's. The
        GEMMs themselves then run with autocast off (see ``torch_autocast_off``)."""
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            return x.to(torch.get_autocast_dtype(device_type))
        return x

    def high_precision_linear(self, x: torch.Tensor, weight: torch.Tensor,
                              bias: Optional[torch.Tensor]) -> torch.Tensor:
        """Outside hybridfp.autocast: F.linear with the (master) parameters cast to the
        activation dtype, as the quantized path does (FP32 params accept BF16 inputs)."""
        self._refuse_silent_recompute()
        return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))

    def _refuse_silent_recompute(self, quantized: bool = False) -> None:
        """A module forward run inside a backward pass, and not as the replay of a recorded call
        (``nn/recompute.py``), is a recomputation hybridfp did not recognise (a checkpoint nested
        in another's recomputation, saved-tensor hooks inside the checkpointed function, an eager
        checkpoint around a compiled module, another recompute scheme). Unquantized, a module
        that ran quantized would silently give high-precision gradients; quantized
        (``quantized``), it would run with the live region's quantizers, not its forward's, and
        record into their state (delayed scaling's amax history). Say so instead."""
        if not (quantized or self._quantizers) or not torch.is_grad_enabled() or not _unrecognised_recompute():
            return
        where = ("inside a hybridfp.autocast region it did not run its forward in" if quantized
                 else "outside hybridfp.autocast")
        raise RuntimeError(
            f"{type(self).__name__} {self.name}: forward run during backward {where} and not as a "
            "recognised torch.utils.checkpoint recomputation (a checkpoint nested in another "
            "checkpoint's recomputation, saved-tensor hooks entered inside the checkpointed "
            "function, an eager checkpoint around a torch.compile'd module, or another recompute "
            "scheme), which would " + ("record into that region's quantizers" if quantized
                                       else "run it in high precision")
            + ". Checkpoint with torch.utils.checkpoint without nesting, around eager modules "
            "(compile the checkpointed function as a whole instead), with saved-tensor hooks "
            "outside it.")

    # ------------------------------------------------------------------ checkpoint recompute
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``nn.Module``'s call, recorded inside a ``torch.utils.checkpoint`` forward and
        replayed in its recomputation (the forward's region, policy and quantizer state): see
        ``hybridfp/nn/recompute.py``."""
        if torch.compiler.is_compiling():  # traced by torch.compile: nothing to record (nn/ops.py)
            return super().__call__(*args, **kwargs)
        replay = recompute.replay_for(self)
        if replay is not None:
            record, cursor = replay
            # a checkpoint nested in the recomputed segment records the same call
            nested = recompute.record_call(self, record.state, record.policy, record.quantizers)
            if nested is not None:
                nested.build_key = record.build_key
            # the replayed quantizers are copies: the weights the forward cached are found under
            # the key of the build they came from
            token = _REPLAYED_BUILD.set((self, record.build_key))
            try:
                with recompute.replaying(record, cursor, _replay_copies(record.quantizers)):
                    return super().__call__(*args, **kwargs)
            finally:
                _REPLAYED_BUILD.reset(token)
        record = recompute.record_call(self, current_autocast(), current_policy())
        if record is None or record.state is None:
            return super().__call__(*args, **kwargs)
        if record.opens_segment and torch._C._len_torch_dispatch_stack() and recompute.selective_checkpoint_active():
            # the recomputation starts with an empty memo of shared input quantizations: so does
            # the forward under selective activation checkpointing, or an input quantized before
            # the segment would be quantized in the recomputation only (ops it never saved)
            record.state.scratch.clear()
        # the quantizers this call builds or finds (quantizers() reports them here): the module's
        # own after the call may be another thread's, built for another recipe meanwhile
        used: list[tuple] = []
        token = _CALL_QUANTIZERS.set((self, used))
        try:
            out = super().__call__(*args, **kwargs)
        finally:
            _CALL_QUANTIZERS.reset(token)
        key, quantizers = used[-1] if used else self._qpair
        self._refuse_random_forward_under_checkpoint(quantizers)
        record.quantizers, record.build_key = _replay_copies(quantizers), key
        return out

    def _refuse_random_forward_under_checkpoint(self, quantizers: dict[str, list[Quantizer]]) -> None:
        """A forward quantizer that rounds stochastically cannot be replayed draw for draw by a
        recomputation yet: a weight the recomputation finds cached skips its draw and shifts every
        later one, and torch restores its own RNG state, not a quantizer's own generator. The
        recomputed forward would then differ from the one the loss came from, silently."""
        for slot in FORWARD_SLOTS:
            for q in quantizers.get(slot, ()):
                if q.uses_randomness():
                    raise NotImplementedError(
                        f"{type(self).__name__} {self.name}: its {slot} quantizer ({type(q).__name__}) "
                        "rounds stochastically in the forward, which a torch.utils.checkpoint "
                        "recomputation does not replay draw for draw. Round the forward roles to "
                        "nearest in this recipe (stochastic rounding of gradients is fine), or leave "
                        "this module out of the checkpointed segment.")

    # ------------------------------------------------------------------ quantizers
    def role(self, tensor_type: str) -> QuantizerRole:
        """The role of one of this module's slots."""
        return QuantizerRole(self.module_type, tensor_type, self.name)

    def set_role(self, tensor_type: str, index: int) -> QuantizerRole:
        """The role of quantizer set ``index`` of a slot: :meth:`role`, the same for every set
        (GroupedLinear's experts), unless a module names its sets (LayerNormMLP: fc1, fc2)."""
        return self.role(tensor_type)

    def quantizers(self, state: AutocastState) -> dict[str, list[Quantizer]]:
        """This module's quantizers for the active region, (re)built if the recipe changed.

        The recipe is asked once per slot (per expert for grouped modules) at build time, not
        on every forward. A rebuild drops cached quantized weights.
        """
        override = getattr(state.recipe, "backward_override", None)
        if override is not None and not self.supports_backward_override:
            raise NotImplementedError(
                f"{self._who()}: the recipe's backward_override={override!r} is not implemented "
                f"for {type(self).__name__}; use a recipe with backward_override=None for it.")
        if state.replay_quantizers is not None:  # a recomputation: the forward's quantizers
            return state.replay_quantizers
        self._refuse_silent_recompute(quantized=True)
        pol = current_policy()
        # the policy fields _hold_decoded reads: a changed one rebuilds (no stale hold_decoded)
        key = (state.key(), pol.decoded_copies, pol.decoded_unverified_on_cuda)
        pair = self._qpair
        if key != pair[0]:
            # made in a forward only (a recomputation replays the forward's): hidden from
            # selective activation checkpointing, whose recomputation would not see its ops
            pair = recompute.unseen_by_selective_checkpoint(self._build_quantizers, state, pol, key)
            self._report_emulated(pair[1])  # here: its warning names quantizers()'s caller (stacklevel)
        state.note_module(self)
        call = _CALL_QUANTIZERS.get()
        if call is not None and call[0] is self:
            call[1].append(pair)
        if self._reads_known_amax:
            state.reads_known_amax = True
        if self._reads_known_group_amax:
            state.reads_known_group_amax = True
        return pair[1]

    def _build_quantizers(self, state: AutocastState, pol: Policy,
                          key: tuple) -> tuple[tuple, dict[str, list[Quantizer]]]:
        """Build the quantizers of every slot for the region key ``key`` (the recipe's, with
        ``pol``'s fields that matter) and make them the module's; returns (key, quantizers)."""
        built: dict[str, list[Quantizer]] = {}
        for slot in SLOTS:
            qs = []
            for index in range(self._num_sets):
                role = self.set_role(slot, index)
                q = state.recipe.quantizer(role)
                q.role = role
                if state.amax_reduction_group is not None:  # keep a factory's own group otherwise
                    q.set_amax_reduction_group(state.amax_reduction_group)
                qs.append(q)
            built[slot] = qs
        quantized_init.adopt_weight_quantizers(self, built)  # quantized weight parameters
        if state.amax_reduction_group is not None:
            for q in built["weight"]:
                q.set_amax_reduction_group(state.amax_reduction_group)
        self._validate_quantizers(built)
        self._restore_loaded_state(built)
        self._hold_decoded(built, pol)
        self._qpair = pair = (key, built)
        # the quantizers whose state can move: the only ones asked for versions and step
        # ends (an MoE layer holds three per expert; most formats keep no state)
        self._stateful = [q for qs in built.values() for q in qs if q.has_state()]
        reads = any(q.reads_known_amax for qs in built.values() for q in qs)
        self._reads_known_amax = self.reads_recorded_amax and reads
        self._reads_known_group_amax = self.reads_recorded_group_amax and reads
        self._wcache.clear()  # also the kept copies: is_first_microbatch=False then raises
        return pair

    @property
    def _qkey(self) -> Optional[tuple]:
        """The region key the built quantizers were made for (None: none built)."""
        return self._qpair[0]

    @property
    def _quantizers(self) -> dict[str, list[Quantizer]]:
        """The built quantizers by slot (empty: none built)."""
        return self._qpair[1]

    def _validate_quantizers(self, built: dict[str, list[Quantizer]]) -> None:
        """Hook for module-specific checks (GroupedLinear needs homogeneous experts)."""

    def _hold_decoded(self, built: dict[str, list[Quantizer]], pol: Policy) -> None:
        """Set ``hold_decoded`` on every quantizer (``DECODED_COPIES``, as ``pol.decoded_copies``
        says: see ``hybridfp.config.Policy``)."""
        mode, device = pol.decoded_copies, self._device()
        # a quantizer object a factory handed to several slots holds nothing decoded: its
        # setting would serve another slot too (an input's saved columnwise copy in BF16)
        seen = Counter(id(q) for qs in built.values() for q in {id(q): q for q in qs}.values())
        for slot, candidates in DECODED_COPIES.items():
            qs = built[slot]
            if any(seen[id(q)] > 1 for q in qs):
                for q in qs:
                    q.hold_decoded = ()
                continue
            want = frozenset(d for d in candidates if mode == "always" or (
                mode == "auto" and device.type == "cuda" and all(
                    reads_bf16_decodes(built[sa][0].format_key(da), built[sb][0].format_key(db), layout, device)
                    for _, layout, (sa, da), (sb, db) in GEMMS if (slot, d) in ((sa, da), (sb, db)))))
            held = frozenset.intersection(*(q.decodable(want) for q in qs)) if qs and mode != "never" else frozenset()
            if mode == "auto" and any(type(q).__name__ in pol.decoded_unverified_on_cuda for q in qs):
                held = frozenset()
            for q in qs:
                q.hold_decoded = held

    def _report_emulated(self, built: dict[str, list[Quantizer]]) -> None:
        device = self._device()
        for gemm_name, layout, (slot_a, dir_a), (slot_b, dir_b) in GEMMS:
            qa, qb = built[slot_a][0], built[slot_b][0]
            report_emulated(gemm_name, self.name or self.module_type, qa.format_key(dir_a),
                            qb.format_key(dir_b), layout, device)

    def _device(self) -> torch.device:
        p = next(self.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    def quantizer_roles(self) -> dict[str, list[QuantizerRole]]:
        """Slot -> roles of the quantizers built (empty before the first quantized forward)."""
        return {slot: [q.role for q in qs] for slot, qs in self._quantizers.items()}

    def stateful_quantizers(self) -> list[Quantizer]:
        """The quantizers keeping state (delayed scaling), which an autocast region's end updates."""
        return list(self._stateful)

    def finish_step(self, amax_reduction_group: Optional[Any] = None) -> None:
        """End of an autocast region: stateful quantizers update (delayed scaling)."""
        if self._tensor_parallel is not None and amax_reduction_group is None and self._stateful:
            # operands split across the tensor-parallel ranks recorded the amax of their shard:
            # one all-reduce over the group for the module's quantizers, then local updates
            reduce_pending_amaxes(self._stateful, self._tensor_parallel.group)
        for q in self._stateful:
            q.finish_step(amax_reduction_group)

    def discard_step(self) -> None:
        """An autocast region this module ran in raised: its forward quantizers (the slots of
        ``FORWARD_SLOTS``) drop the amaxes they recorded there, so the failed step changes no
        scale. Gradient quantizers keep theirs: they record in backward passes, which normally
        run between regions and belong to the step that the next region's end finishes."""
        for slot in FORWARD_SLOTS:
            for q in self._quantizers.get(slot, ()):
                if q.has_state():
                    q.discard_step()

    def held_weight_quantizers(self) -> dict[int, Quantizer]:
        """The quantizers the weights this module holds quantized (``quantized_model_init``)
        are encoded with, by quantizer set: a ``QuantizedTensor`` parameter's own, or the one
        FSDP2's sharded quantized primary weight encodes its shard with (its local tensor's
        ``quantizer``). The module adopts each as its weight quantizer when it builds its
        quantizers with the weight at hand (a forward, for a sharded weight).

        Returns
        -------
        dict
            Quantizer set -> quantizer; empty when the weights are held in high precision.

        Example
        -------
        >>> import hybridfp as hf
        >>> with hf.quantized_model_init(recipe=hf.DelayedScaling()):
        ...     lin = hf.Linear(16, 16)
        >>> lin.held_weight_quantizers()[0] is lin.weight.quantizer
        True
        >>> hf.Linear(16, 16).held_weight_quantizers()
        {}
        """
        try:
            slots = self.quantized_weight_slots
        except NotImplementedError:  # a layout that cannot hold its weights quantized holds none
            return {}
        held = {}
        for attr, index in slots:
            p = getattr(self, attr, None)
            if p is not None and hasattr(p, "to_local"):  # a DTensor: FSDP2's shard of the master
                with torch.no_grad():  # the local tensor itself, not an autograd view of it
                    p = p.to_local()
            q = getattr(p, "quantizer", None)
            if isinstance(q, Quantizer):
                held[index] = q
        return held

    def _drop_quantizers(self) -> None:
        """Forget the built quantizers and what was quantized with them (the next forward builds
        new ones)."""
        self._qpair, self._stateful = (None, {}), []
        self._wcache.clear()

    # ------------------------------------------------------------------ weights
    def quantized_weight(self, weight: torch.Tensor, q: Quantizer, columnwise: bool, index: int = 0, *,
                         region: Optional[object] = None,
                         is_first_microbatch: Optional[bool] = None) -> QuantizedTensor:
        """The weight quantized by ``q``, from the cache where the rule of ``weight_cache``
        allows: within the autocast region ``region`` (its ``AutocastState.token``; None: no
        reuse) while the weight, the quantizer's state and the recipe are unchanged, and across
        regions only as ``is_first_microbatch`` asks (TransformerEngine's semantics).

        Parameters
        ----------
        weight: the (master) weight; a ``QuantizedTensor`` (quantized parameter) is returned as is.
        q: the weight quantizer. columnwise: the call needs the columnwise copy (dgrad).
        index: the cache slot (the expert of a GroupedLinear).
        region: the active region's token. is_first_microbatch: None, True or False.

        Returns
        -------
        The quantized weight.

        Raises
        ------
        RuntimeError: ``is_first_microbatch=False`` without a matching kept copy.
        """
        if isinstance(weight, QuantizedTensor):  # already quantized (quantized parameters)
            if not weight.has_direction(ROWWISE) or (columnwise and not weight.has_direction(COLUMNWISE)):
                # raised in forward, before any GEMM: backward would fail later, farther from the cause
                role = f" (role: {q.label})" if q.label else ""
                raise MissingDirectionError(
                    f"{self._who()}: the quantized weight{role} holds the copies {list(weight.directions())}; "
                    f"this call needs rowwise{' and columnwise' if columnwise else ''}. Create the module "
                    "inside hybridfp.quantized_model_init (it quantizes both copies).")
            if weight.qstorage.unallocated(ROWWISE):
                raise RuntimeError(
                    f"{self._who()}: the weight's rowwise copy has no memory: FSDP2 all-gathered only "
                    "its columnwise copy (for backward) and this forward runs after that, as "
                    "activation checkpointing's recomputation does. Gather both copies for this "
                    "module: hybridfp.enable_quantized_all_gather(module, copies='both').")
            mark_not_offload(weight)  # the parameter holds its payloads: offloading them frees nothing
            return weight
        if weight.is_inference():
            return self._uncached_inference_weight(weight, q, columnwise, is_first_microbatch)
        key = self._weight_key(weight, q, index)
        hit = self._cached_weight(index, weight, key, columnwise, region, is_first_microbatch)
        if hit is not None:
            return hit
        q.set_usage(rowwise=True, columnwise=columnwise)
        with torch.no_grad():
            # a miss in a forward is mostly a hit in its recomputation (no op): hidden from
            # selective activation checkpointing, which would hand the ops after it other ops'
            # saved outputs (``recompute.hidden_from_selective_checkpoint``)
            qw = recompute.unseen_by_selective_checkpoint(q.quantize, weight.detach())
        mark_not_offload(qw)  # the cache below holds it: offloading its saved copies frees nothing
        if recompute.in_replay():  # a recomputation reads the cache, never replaces a later entry
            return qw
        # ``key`` stays valid after quantizing: delayed scaling's state moves only at region ends
        self._wcache[index] = new_entry(self._wcache.get(index), key, qw, weight, region, is_first_microbatch)
        return qw

    def _uncached_inference_weight(self, weight: torch.Tensor, q: Quantizer, columnwise: bool,
                                   is_first_microbatch: Optional[bool]) -> QuantizedTensor:
        """A weight made under ``torch.inference_mode`` quantized anew: an inference tensor keeps
        no version counter, so a cache could not see a write to it (it would serve old codes).

        Raises
        ------
        RuntimeError
            ``is_first_microbatch=False``: nothing is kept to reuse.
        """
        if is_first_microbatch is False:
            raise RuntimeError(
                f"{self._who()}: is_first_microbatch=False reuses a kept quantized weight, but this "
                "weight was made under torch.inference_mode (an inference tensor tracks no writes, so "
                "none is kept). Build the module outside inference_mode (run it inside), or leave "
                "is_first_microbatch unset.")
        q.set_usage(rowwise=True, columnwise=columnwise)
        with torch.no_grad():
            return q.quantize(weight.detach())

    def _weight_key(self, weight: torch.Tensor, q: Quantizer, index: int = 0) -> WeightKey:
        """What a quantized weight depends on besides the weight object (compared by identity,
        held by the entry) and the region: its version (counter and noted rewrites:
        ``WeightKey.of``), the quantizer state, the recipe. Never an address: see
        weight_cache.py (ranks must decide alike)."""
        return WeightKey.of(weight, q.state_version(), self._build_key_of([q], index))

    def _build_key_of(self, qs: list[Quantizer], start: int = 0) -> Any:
        """The key of the quantizer build the weight quantizers ``qs`` (sets ``start`` on) come
        from, for the weight cache: the built key while they are the module's current ones; in a
        recomputation (they are copies of its forward's) the key its forward recorded; else
        (another thread's region, of another recipe, rebuilt them since this call got them) a
        key naming ``qs`` themselves, which only calls holding them match."""
        replayed = _REPLAYED_BUILD.get()
        if replayed is not None and replayed[0] is self:
            return replayed[1]
        key, built = self._qpair  # one read: the key and the quantizers it was built for
        ws = built.get("weight", ())
        if len(ws) >= start + len(qs) and all([a is b for a, b in zip(ws[start:], qs)]):
            return key
        return ("replaced build", tuple(qs))

    def _cached_weight(self, index: int, weight: Any, key: WeightKey, columnwise: bool,
                       region: Optional[object], is_first_microbatch: Optional[bool]) -> Optional[QuantizedTensor]:
        """The cached quantized weight of slot ``index`` if this call may reuse it
        (``weight_cache.reusable``), else None; raises for ``is_first_microbatch=False``
        without a matching kept copy."""
        entry = self._wcache.get(index)
        if reusable(entry, weight, key, columnwise, region, is_first_microbatch, self._who()):
            return entry.qw  # type: ignore[union-attr]
        return None

    def _who(self) -> str:
        """The module's class and name, for messages."""
        return f"{type(self).__name__} {self.name}".rstrip()

    def invalidate_weight_cache(self) -> None:
        """Forget cached quantized weights, kept ones included. Entries already expire with
        their autocast region; this is needed only after a write that bypasses the version
        counter (``.data``) between two calls of the module inside one region. Call it on every
        rank: cache hits must be the same everywhere (see weight_cache.py).

        Example
        -------
        >>> import torch, hybridfp as hf
        >>> lin = hf.Linear(32, 32)
        >>> with hf.autocast(recipe=hf.MXFP8BlockScaling()):
        ...     _ = lin(torch.randn(2, 32))
        ...     _ = lin.weight.data.zero_()      # bypasses the version counter
        ...     lin.invalidate_weight_cache()
        ...     y = lin(torch.randn(2, 32))
        >>> torch.equal(y, lin.bias.detach().expand(2, 32))   # the zeroed weight was used
        True
        """
        self._wcache.clear()

