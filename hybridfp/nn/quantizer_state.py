"""A hybridfp module's quantizer state in ``state_dict``: the ``_extra_state`` entry that saves its
quantizers' state (delayed scaling's amax history and scale) and restores it, checked against
the quantizers it is applied to. ``QuantizedModule`` inherits it (:class:`QuantizerStateMixin`)."""

from __future__ import annotations

import sys
from typing import Any, Optional

from torch import nn

from ..quantizers import Quantizer
from ..tensors import COLUMNWISE, ROWWISE

#: Layout version of the quantizer state a module keeps in ``state_dict`` (``get_extra_state``).
EXTRA_STATE_VERSION = 1


def _describe(q: Quantizer) -> dict[str, str]:
    """What a saved quantizer state must match: class names (a hybrid's children too) and the
    formats of the two copies."""
    parts = [getattr(q, n) for n in ("rowwise_quantizer", "columnwise_quantizer") if hasattr(q, n)]
    kind = type(q).__name__ + (f"({', '.join(type(c).__name__ for c in parts)})" if parts else "")
    return {"kind": kind, "format": f"rowwise {q.format_key(ROWWISE)}; columnwise {q.format_key(COLUMNWISE)}"}


def holds_quantizer_state(state: Any) -> bool:
    """Whether a :meth:`QuantizerStateMixin.get_extra_state` dict carries state a load would
    restore: a quantizer's non-empty ``get_state()`` (delayed scaling's amax history and scale),
    of a built quantizer or of one a weight is held quantized by. A recipe without state keeps
    only its quantizers' kinds and formats there (``{}`` states): nothing to restore.

    Parameters
    ----------
    state:
        A module's ``_extra_state`` entry; anything but a dict counts as state (unknown).

    Returns
    -------
    bool

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> from hybridfp.nn.quantizer_state import holds_quantizer_state
    >>> lin = hf.Linear(16, 16)
    >>> with hf.autocast(recipe=hf.MXFP8BlockScaling()):
    ...     _ = lin(torch.randn(2, 16))
    >>> holds_quantizer_state(lin.get_extra_state())
    False
    >>> with hf.autocast(recipe=hf.DelayedScaling(amax_history_len=4)):
    ...     _ = lin(torch.randn(2, 16))
    >>> holds_quantizer_state(lin.get_extra_state())
    True
    """
    if not isinstance(state, dict):
        return True
    entries = [e for part in ("quantizers", "held") if isinstance(state.get(part), dict)
               for e in state[part].values()]
    return any(not isinstance(e, dict) or e.get("state") for e in entries)


def _summary(obj: Any) -> str:
    """A short description of an unexpected extra state, for error messages."""
    if isinstance(obj, dict):
        return f"a dict with keys {sorted(map(str, obj))[:8]}"
    return type(obj).__name__


def _extra_state_not_for_save_pretrained(module: nn.Module, state_dict: dict, prefix: str,
                                         local_metadata: dict) -> None:
    """A state-dict post-hook of hybridfp modules: their ``_extra_state`` (the quantizers' state,
    a dict) stays in ``state_dict()`` (torch checkpoints keep it), and its key joins the
    ``_keys_to_ignore_on_save`` set of every enclosing module that has one (transformers'
    ``PreTrainedModel``, whose ``save_pretrained`` writes tensors only and drops those keys from
    the ``state_dict()`` it just took). The enclosing modules are those whose ``state_dict`` call
    is running: their frames, each with its own prefix, so a key is relative to each of them (a
    converted decoder inside an unconverted ``...ForCausalLM`` works as a converted whole)."""
    key = prefix + "_extra_state"
    if key not in state_dict:
        return
    code = nn.Module.state_dict.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            local = frame.f_locals
            owner, outer = local.get("self"), local.get("prefix")
            ignore = getattr(owner, "_keys_to_ignore_on_save", None)
            if isinstance(ignore, set) and isinstance(outer, str) and key.startswith(outer):
                ignore.add(key[len(outer):])
        frame = frame.f_back


class QuantizerStateMixin:
    """The ``state_dict`` side of ``QuantizedModule`` (mixed in before ``nn.Module``, whose
    ``_load_from_state_dict`` it extends): :meth:`get_extra_state` saves the built quantizers'
    state, :meth:`set_extra_state` keeps a loaded one until the next build applies it (a weight
    held quantized takes its entry at once).

    It reads what the module defines: ``_quantizers`` (the built quantizers by slot),
    ``held_weight_quantizers()``, ``_drop_quantizers()`` and ``_who()``; the module's quantizer
    build calls :meth:`_restore_loaded_state` with the quantizers it built.
    """

    #: A quantizer state loaded before this module built its quantizers (``set_extra_state``),
    #: applied when they are built; None when there is none.
    _loaded_state: Optional[dict] = None
    #: Of ``_loaded_state``'s entries, those applied at load to the quantizer of a weight held
    #: quantized (entry name -> that quantizer): the build adopts that quantizer as it is, since
    #: its state may have moved since (None: none).
    _loaded_applied: Optional[dict[str, Quantizer]] = None

    def get_extra_state(self) -> dict:
        """The quantizers' state for ``state_dict`` (delayed scaling's amax history and scale):
        tensors and plain values only, so ``torch.load(weights_only=True)`` and
        ``torch.distributed.checkpoint`` take it.

        Returns
        -------
        dict
            ``{"version": 1, "built": False}`` for a module that has not built quantizers
            (nothing to restore; with ``"held": {"weight.<set>": ...}`` when a weight is held
            quantized by a stateful quantizer: that quantizer's state), else ``{"version": 1, "built": True, "quantizers":
            {"<slot>.<set>": {"kind": class names, "format": the copies' formats, "state":
            Quantizer.get_state()}}}``, one entry per slot and quantizer set (an expert of
            GroupedLinear); a state loaded and not yet applied is returned as loaded (a
            weight held quantized: its quantizer's state, applied at load).

        Example
        -------
        >>> import torch, hybridfp as hf
        >>> lin = hf.Linear(16, 16)
        >>> lin.get_extra_state()
        {'version': 1, 'built': False}
        >>> with hf.autocast(recipe=hf.DelayedScaling(amax_history_len=4)):
        ...     _ = lin(torch.randn(2, 16))
        >>> sorted(lin.get_extra_state()["quantizers"])
        ['grad_output.0', 'input.0', 'weight.0']
        """
        if self._quantizers:
            # a weight held quantized is encoded by its own quantizer: the module's weight
            # quantizer, adopted at the build (adopt_weight_quantizers)
            entries = {}
            for slot, qs in self._quantizers.items():
                for i, q in enumerate(qs):
                    entries[f"{slot}.{i}"] = {**_describe(q), "state": q.get_state()}
            return {"version": EXTRA_STATE_VERSION, "built": True, "quantizers": entries}
        if self._loaded_state is not None:
            if not self._loaded_applied:
                return self._loaded_state
            # a held weight's quantizer took its entry at load: its state now is the module's
            saved = self._loaded_state["quantizers"]
            return {**self._loaded_state, "quantizers": {
                name: {**entry, "state": self._loaded_applied[name].get_state()} if name in self._loaded_applied
                else entry for name, entry in saved.items()}}
        # not built, but a weight held quantized by a stateful quantizer (its encode recorded an
        # amax): that state is the module's too, or a load would keep the target's own
        held = {f"weight.{i}": {**_describe(q), "state": q.get_state()}
                for i, q in self.held_weight_quantizers().items() if q.has_state()}
        if held:
            return {"version": EXTRA_STATE_VERSION, "built": False, "held": held}
        return {"version": EXTRA_STATE_VERSION, "built": False}

    def set_extra_state(self, state: Any) -> None:
        """Restore :meth:`get_extra_state`'s dict: the quantizers built so far are dropped, and
        the state is applied when the next forward under a recipe builds new ones (which then
        checks that they are the saved ones: same slots, classes and formats). A module saved
        before it ran starts with fresh quantizers, as the saved module would have.

        A weight held quantized (``quantized_model_init``, also as FSDP2's sharded quantized
        primary weight) takes its weight quantizer's entry at once: that quantizer re-encodes
        the weight from its master before any forward (``MasterWeightOptimizer.load_state_dict``,
        ``quantize_sharded_weights``), which must use the loaded scale to give the saved codes.

        Parameters
        ----------
        state:
            The module's ``_extra_state`` entry of a state dict.

        Raises
        ------
        ValueError
            For a state of another layout, or one that says quantizers were saved but holds
            none (``torch.distributed.checkpoint`` loaded into a module that had not built its
            quantizers), or a weight quantizer state saved from another quantizer than the one
            a held weight is encoded with (nothing is loaded then). The next forward raises one
            for quantizers that differ from the saved ones.

        Example
        -------
        >>> import torch, hybridfp as hf
        >>> recipe = hf.DelayedScaling(amax_history_len=4)
        >>> a, b = hf.Linear(16, 16), hf.Linear(16, 16)
        >>> with hf.autocast(recipe=recipe):
        ...     _ = a(torch.randn(2, 16))
        >>> _ = b.load_state_dict(a.state_dict())   # calls set_extra_state; applied at b's build
        >>> with hf.autocast(recipe=recipe):
        ...     _ = b(torch.randn(2, 16))
        >>> sa = a.get_extra_state()["quantizers"]["weight.0"]["state"]
        >>> sb = b.get_extra_state()["quantizers"]["weight.0"]["state"]
        >>> torch.equal(sa["scale"], sb["scale"])
        True
        """
        who = self._who()
        if not isinstance(state, dict) or state.get("version") != EXTRA_STATE_VERSION or "built" not in state:
            raise ValueError(f"{who}: the '_extra_state' entry is not a hybridfp quantizer state (version "
                             f"{EXTRA_STATE_VERSION}); got {_summary(state)}.")
        if not state["built"]:
            held = state.get("held", {})
            if not isinstance(held, dict):
                raise ValueError(f"{who}: the '_extra_state' entry's 'held' is not a dict of weight quantizer "
                                 f"states; got {_summary(held)}.")
            mine = {f"weight.{i}": q for i, q in self.held_weight_quantizers().items() if q.has_state()}
            # the saved module's held weight quantizers' state: this module's take it now (a
            # module holding its weights in high precision builds fresh ones, as without it)
            if held and mine:
                if set(held) != set(mine):
                    raise ValueError(f"{who}: the loaded state holds weight quantizer states for {sorted(held)}, "
                                     f"this module holds stateful quantized weights {sorted(mine)}; load it into "
                                     "a module built under the same recipe in quantized_model_init.")
                names = {name: mine[name] for name in held}
                self._check_saved_kinds(held, names, "the weight is held quantized by")
                self._set_quantizer_states(held, names)
            self._drop_quantizers()  # the next forward builds fresh ones, as the saved module would
            self._loaded_state, self._loaded_applied = None, None
            return
        if not isinstance(state.get("quantizers"), dict) or not state["quantizers"]:
            raise ValueError(
                f"{who}: the loaded state says the saved module had built its quantizers, but holds "
                "no quantizer state. torch.distributed.checkpoint loads only the entries of the "
                "state_dict it is given: take that state_dict from a model whose modules have built "
                "their quantizers (run one forward under hybridfp.autocast with the recipe first).")
        # a held weight is re-encoded from its master before the next forward (an optimizer's
        # load, quantize_sharded_weights) by its own quantizer, which the build then adopts: it
        # takes its state now, or that encode would use the scale it had before the load
        saved = state["quantizers"]
        applied = {f"weight.{i}": q for i, q in self.held_weight_quantizers().items() if f"weight.{i}" in saved}
        self._check_saved_kinds(saved, applied, "the weight is held quantized by")
        self._set_quantizer_states(saved, applied)
        # the rest is applied to the quantizers the next forward builds under its recipe and
        # policy (and checked against them then): applied to the ones built now, a rebuild for
        # another key before that forward would drop it
        self._drop_quantizers()
        self._loaded_state, self._loaded_applied = state, applied or None

    def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        """``nn.Module``'s, accepting a state dict without this module's ``_extra_state`` (a plain
        PyTorch model's, or one saved without quantizer state): the quantizers then start
        fresh, as they would without a checkpoint."""
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        key = prefix + "_extra_state"
        if key not in state_dict and key in missing_keys:
            missing_keys.remove(key)

    def _restore_loaded_state(self, built: dict[str, list[Quantizer]]) -> None:
        """Apply a state loaded before the quantizers existed to the ones just built."""
        if self._loaded_state is not None:
            self._apply_quantizer_state(self._loaded_state, built, self._loaded_applied or {})
            self._loaded_state, self._loaded_applied = None, None

    def _apply_quantizer_state(self, state: dict, built: dict[str, list[Quantizer]],
                               applied: dict[str, Quantizer]) -> None:
        """Check that ``state`` was saved from quantizers like ``built`` (per slot and set: class
        names and formats), then set each one's state; all or nothing. A built quantizer that
        is the one ``applied`` names for its entry (a held weight's, set at load) keeps the
        state it has: it may have moved since the load."""
        who, saved = self._who(), state["quantizers"]
        names = {f"{slot}.{i}": q for slot, qs in built.items() for i, q in enumerate(qs)}
        if set(saved) != set(names):
            raise ValueError(f"{who}: the loaded quantizer state has the slots / sets {sorted(saved)}, "
                             f"this module builds {sorted(names)}; load it into a module of the same shape.")
        self._check_saved_kinds(saved, names, "the active recipe builds")
        self._set_quantizer_states(saved, {name: q for name, q in names.items() if applied.get(name) is not q})

    def _check_saved_kinds(self, saved: dict, names: dict[str, Quantizer], whose: str) -> None:
        """Each quantizer of ``names`` is of the class and formats its entry of ``saved`` was
        saved from; ``whose`` says where the quantizer comes from, for the error."""
        who = self._who()
        for name, q in names.items():
            slot, index = name.rsplit(".", 1)
            mine, theirs = _describe(q), {k: saved[name].get(k) for k in ("kind", "format")}
            if mine != theirs:
                raise ValueError(
                    f"{who}: slot {slot!r} (quantizer set {index}): the loaded state was saved from "
                    f"{theirs['kind']} [{theirs['format']}], {whose} {mine['kind']} "
                    f"[{mine['format']}]. Run under the recipe the checkpoint was saved with, or drop "
                    "this module's '_extra_state' entry to start its quantizers fresh.")

    def _set_quantizer_states(self, saved: dict, names: dict[str, Quantizer]) -> None:
        """Set each quantizer of ``names`` to its entry of ``saved`` (each state's keys and
        shapes checked by the quantizer); all or nothing."""
        who = self._who()
        before = {name: q.get_state() for name, q in names.items()}
        try:
            for name, q in names.items():
                try:
                    q.set_state(saved[name].get("state", {}))
                except ValueError as e:
                    slot, index = name.rsplit(".", 1)
                    raise ValueError(f"{who}: slot {slot!r} (quantizer set {index}): {e}") from None
        except ValueError:
            for name, q in names.items():
                q.set_state(before[name])
            raise
