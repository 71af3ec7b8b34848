"""When a module may reuse a weight it quantized earlier instead of quantizing it again.

The rule (``QuantizedModule.quantized_weight``, ``GroupedLinear.quantized_weights``):

- A cached quantized weight is valid only inside the ``hybridfp.autocast`` region it was made
  in (the region's ``AutocastState.token``; a checkpoint replay region carries its forward
  region's token, so a recomputation reads the weight its forward read). Any write to a weight
  between two regions is therefore seen (outside a :func:`weight_caching` scope), including writes that leave the version counter as
  it was: ``p.data.add_`` in custom optimizers, EMA swaps through ``.data``, ``p.data = t``,
  FSDP2's copy of the all-gathered weight (``_unsafe_preserve_version_counter``).
- Inside one region an entry is reused while the call passes the same weight object with the
  same version, the quantizer state and recipe are those it was quantized with, and it
  holds the copies the call needs (a missing columnwise copy quantizes again).
- Across regions reuse is explicit, with TransformerEngine's ``is_first_microbatch`` forward
  argument: None (default) follows the two rules above; True quantizes anew and keeps the copy
  for later regions; False reuses the kept copy as it is (the caller promises the weight did
  not change, e.g. the later micro-batches of one step) and raises if none is kept, or if the
  recipe, the quantizer state (delayed scaling updates at every region end: run its
  micro-batches in one region, or inside :func:`weight_caching`), the weight object or its version moved since,
  or if it lacks a copy the call needs.

A weight's version (``WeightKey.of``) is its version counter and the rewrites noted for its
memory (``utils.rewrites.current_versions``). FSDP2 gathers a weight it shards in high precision
into the same unsharded Parameter at every unshard, keeping that Parameter's version counter,
while the optimizer steps (and a load writes) the sharded Parameter; ``integration/fsdp.py``
watches those gathers and notes a rewrite when one carries a shard that moved since the previous
gather (a step, foreach and fused ones included, or a load), so no entry survives new values in
the weight, in a region or across regions. A gather of unchanged shards (backward's, the next
micro-batch's) notes nothing and the entry stays.

Delayed scaling moves a weight quantizer's scale at every region end, so without help a step
split into several regions (gradient accumulation) encodes its high-precision weight once per
region, each at another scale, where a quantized primary weight (``quantized_model_init``) holds
the one encoding made at the optimizer step. :func:`weight_caching` is the opt-in that makes the
two alike, as TransformerEngine's cached weight workspace (``is_first_microbatch=False``) is
reused across its scale updates: inside it an entry made in the scope serves every later region
of the scope while the weight object, its version and the recipe are unchanged, whatever
the quantizer state did since; a region it serves records no weight amax, so delayed scaling's
weight history and scale move as with a quantized primary weight (bitwise the same training).
Checkpoint replays of a region it served read the same entry, also after the scope ended.

What is not seen: a write that bypasses the version counter *between two calls of one module
inside one region* (an optimizer step through ``.data`` between two forwards of one region);
call ``invalidate_weight_cache()`` (on every rank) after such a write. An optimizer step is seen
whatever its implementation: a fused one (``fused=True``) moves no version counter, so the end
of every optimizer step notes a rewrite of each stepped weight a cache entry was made from
(``utils.optimizer_steps``). Entries that outlive their
region (a :func:`weight_caching` scope, ``is_first_microbatch=False``) do not see such writes
between regions either, to a weight or to its FSDP2 shard; ``p.data = t`` and a module's
``.to(dtype)`` / ``.to(device)`` (which assign ``.data``) are such writes: call
``invalidate_weight_cache()`` after them, or make them outside the scope.

Every rank decides the same: a decision compares only what the same program makes equal on
every rank — the region token and the weight by identity (``is``; both held by the entry, so
neither address can be recycled for another object while it lives), version counters (moved by
the same in-place ops everywhere; FSDP2's copies leave them) and noted rewrites (FSDP2's gathers
of shards the same steps and loads moved on every rank), quantizer state versions (moved
at region ends), the recipe key and the copies the call needs. No data pointer enters: an
allocator may or may not hand a re-gathered weight its old address, differently per rank, and a
cache hit on one rank but not another would skip a delayed-scaling amax record there (and with
it the amax all-reduce at the region's end, where the other ranks would wait).
"""

from __future__ import annotations

import contextvars
from collections import deque
from contextlib import contextmanager
from typing import Any, Iterator, NamedTuple, Optional, Sequence

from ..tensors import COLUMNWISE
from ..utils.optimizer_steps import on_stepped_parameters
from ..utils.rewrites import current_versions, note_rewrite

#: How many regions an entry remembers having served in its scope (checkpoint replays of older
#: ones, backward passes more regions late than this, quantize again).
SERVED_REGIONS = 1024
#: The active :func:`weight_caching` scope's token (None: none), per thread as autocast's region.
_SCOPE: contextvars.ContextVar[Optional[object]] = contextvars.ContextVar("hybridfp_weight_scope", default=None)


@contextmanager
def weight_caching(enabled: bool = True) -> Iterator[None]:
    """Quantize each high-precision weight once for all the autocast regions inside (the
    micro-batches of one optimizer step), as a quantized primary weight is.

    Inside, a module's cached quantized weight made in the scope is reused by its later regions
    while the weight Parameter, its version counter (an in-place optimizer step moves it: the
    next region quantizes anew; under FSDP2 a step or a load of its shards, seen at the next
    gather) and the recipe are unchanged; delayed scaling's scale updates at
    the region ends do not expire it (the weight keeps the encoding of its first region and its
    quantizer records no amax in the regions that reuse it). So k regions per step with FP32
    weights train bitwise as with ``quantized_model_init`` weights and FP32 masters. Nested
    scopes are one scope. Writes that bypass the version counter (``p.data``) are not seen
    inside: call ``module.invalidate_weight_cache()`` after one.

    Parameters
    ----------
    enabled:
        False: no scope (the default rule: a region's weights are its own).

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> lin, recipe = hf.Linear(32, 32), hf.DelayedScaling()
    >>> with hf.weight_caching():
    ...     for x in torch.randn(3, 4, 32):          # three micro-batches of one step
    ...         with hf.autocast(recipe=recipe):
    ...             y = lin(x)
    ...         y.sum().backward()
    >>> state = lin.get_extra_state()["quantizers"]  # one weight amax recorded: one update
    >>> state["weight.0"]["state"]["updates"], state["input.0"]["state"]["updates"]
    (1, 3)
    """
    outer = _SCOPE.get()
    token = _SCOPE.set((outer if outer is not None else object()) if enabled else None)
    try:
        yield
    finally:
        _SCOPE.reset(token)


class WeightKey(NamedTuple):
    """What a quantized weight's values depend on besides the weight object itself."""

    versions: Any  #: the weight's version (``of``: ``utils.rewrites.current_versions``; a tuple of them for several weights)
    state: Any  #: the quantizer's ``state_version()`` (a tuple for several quantizers)
    recipe: Any  #: the key of the quantizer build that encoded it (recipe configuration, decoded-copies mode), or a replaced build's quantizers

    @classmethod
    def of(cls, weight: Any, state: Any, recipe: Any) -> "WeightKey":
        """The key of ``weight`` quantized by a quantizer in ``state`` under ``recipe``.

        The weight's version is its version counter and the rewrites noted for its memory
        (``utils.rewrites.current_versions``): FSDP2 all-gathers a sharded weight into the same
        unsharded Parameter at every unshard, keeping its version counter, so after an optimizer
        step or a load of the shards the counter alone would still match the entry of the
        previous values (``integration/fsdp.py`` notes a rewrite when the shard moved).
        """
        return cls(current_versions((weight,))[0], state, recipe)


class WeightEntry(NamedTuple):
    """One cached quantized weight (or several experts' as one entry)."""

    key: WeightKey
    qw: Any  #: a QuantizedTensor, a list of them or a GroupedTensor
    weight: Any  #: the weight tensor (or list of tensors) it was made from, held
    region: object  #: the token of the autocast region it was made in
    kept: bool  #: kept for later regions (made by a call with ``is_first_microbatch=True``)
    scope: object = None  #: the ``weight_caching`` scope it was made in (None: none)
    #: tokens of the later regions it served in its scope (their checkpoint replays reuse it);
    #: the latest ``SERVED_REGIONS``, so a scope around a whole run with frozen weights stays small
    served: Any = ()


def check_is_first_microbatch(value: Any, who: str) -> None:
    """Raises TypeError unless ``value`` is None, True or False."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{who}: is_first_microbatch must be None, True or False; got {value!r}.")


def same_weights(a: Any, b: Any) -> bool:
    """The same tensor object(s): identity, element by element for lists."""
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(x is y for x, y in zip(a, b)))
    return a is b


def has_columnwise(qw: Any) -> bool:
    """Whether a cached value (one tensor, a list of them, or a GroupedTensor) holds the
    columnwise copy the dgrad GEMM reads."""
    if isinstance(qw, (list, tuple)):
        return all(t.has_direction(COLUMNWISE) for t in qw)
    return qw.has_direction(COLUMNWISE)


def reusable(entry: Optional[WeightEntry], weight: Any, key: WeightKey, columnwise: bool,
             region: Optional[object], is_first_microbatch: Optional[bool], who: str) -> bool:
    """Whether ``entry`` may serve this call (see the module docstring for the rule).

    Parameters
    ----------
    entry: the cached entry of this slot, or None.
    weight: the weight tensor (or list of tensors) of this call.
    key: this call's ``WeightKey``.
    columnwise: whether the call needs the columnwise copy (a dgrad will read it).
    region: the active region's token (None: no region, nothing is reused).
    is_first_microbatch: None, True or False (TransformerEngine's semantics).
    who: the module, for error messages.

    Returns
    -------
    True to reuse ``entry.qw``, False to quantize anew. Inside a :func:`weight_caching` scope
    an entry made there also serves the scope's later regions (recorded on the entry).

    Raises
    ------
    RuntimeError: ``is_first_microbatch=False`` and the kept copy is missing or does not match.
    """
    if is_first_microbatch is True:
        return False
    if is_first_microbatch is False:
        _check_kept(entry, weight, key, columnwise, who)
        return True
    if (entry is None or region is None or not same_weights(entry.weight, weight)
            or (columnwise and not has_columnwise(entry.qw))):
        return False
    if entry.region is region:
        return entry.key == key
    return _scope_serves(entry, key, region)


def _in_scope(entry: WeightEntry) -> bool:
    """``entry`` was made in the active ``weight_caching`` scope."""
    scope = _SCOPE.get()
    return scope is not None and entry.scope is scope


def _scope_serves(entry: WeightEntry, key: WeightKey, region: object) -> bool:
    """Whether ``entry`` serves ``region`` through its ``weight_caching`` scope: the weight's
    version and the recipe as when it was made (the quantizer state may have moved), and the
    region either one it served already (a checkpoint replay, possibly after the scope ended) or
    a new region of the active scope, which it then records as served."""
    if entry.key.versions != key.versions or entry.key.recipe != key.recipe:
        return False
    if any(r is region for r in entry.served):
        return True
    if not _in_scope(entry):
        return False
    entry.served.append(region)  # a deque made by new_entry: the entry stays one object
    return True


def _check_kept(entry: Optional[WeightEntry], weight: Any, key: WeightKey, columnwise: bool, who: str) -> None:
    """Raises unless ``entry`` is a kept copy that ``is_first_microbatch=False`` may reuse."""
    fix = "call with is_first_microbatch=True first (the first micro-batch of each step)"
    if entry is None or not entry.kept:
        raise RuntimeError(f"{who}: is_first_microbatch=False reuses the weight quantized by an earlier "
                           "call with is_first_microbatch=True, but none is kept (none made since the "
                           f"module's quantizers were built for this recipe, or a later call replaced it); {fix}.")
    if entry.key.recipe != key.recipe:
        raise RuntimeError(f"{who}: is_first_microbatch=False, but the recipe changed since the kept "
                           f"weight was quantized; {fix}.")
    if entry.key.state != key.state and not _in_scope(entry):
        raise RuntimeError(f"{who}: is_first_microbatch=False, but the weight's quantizer state changed "
                           "since the kept weight was quantized (delayed scaling updates its scale when "
                           "a region ends: run the micro-batches of one step in one autocast region, "
                           f"or inside hybridfp.weight_caching()); {fix}.")
    if not same_weights(entry.weight, weight):
        raise RuntimeError(f"{who}: is_first_microbatch=False, but the weight Parameter was replaced since "
                           f"the kept weight was quantized; {fix}.")
    if entry.key.versions != key.versions:
        raise RuntimeError(f"{who}: is_first_microbatch=False, but the weight changed in place since the "
                           f"kept weight was quantized (an optimizer step?); {fix}.")
    if columnwise and not has_columnwise(entry.qw):
        raise RuntimeError(f"{who}: is_first_microbatch=False and this call needs the weight's columnwise "
                           "copy (its input requires grad), but the kept weight was quantized without it "
                           f"(no dgrad in that call); {fix} with grad enabled.")


def new_entry(old: Optional[WeightEntry], key: WeightKey, qw: Any, weight: Any,
              region: Optional[object], is_first_microbatch: Optional[bool]) -> WeightEntry:
    """The entry for a weight just quantized. It is kept for later regions when asked
    (``is_first_microbatch=True``) or when it replaces a copy kept in this same region (a
    call that needed the columnwise copy the kept one lacked)."""
    kept = is_first_microbatch is True or (
        old is not None and old.kept and region is not None and old.region is region)
    _mark_cached(weight)
    return WeightEntry(key, qw, weight, region, kept, _SCOPE.get() if region is not None else None,
                       deque(maxlen=SERVED_REGIONS))


#: set on a weight tensor some cache entry was made from: an optimizer step over it is noted as
#: a rewrite of its memory (:func:`_note_stepped`)
_CACHED_ATTR = "_hybridfp_weight_cached"


def _mark_cached(weight: Any) -> None:
    """Marks ``weight`` (a tensor or a list of them) as cached, and has every optimizer step
    report the parameters it went over to :func:`_note_stepped`."""
    [setattr(w, _CACHED_ATTR, True) for w in (weight if isinstance(weight, (list, tuple)) else (weight,))]
    on_stepped_parameters(_note_stepped)


def _note_stepped(params: Sequence[Any]) -> None:
    """After an optimizer step (``utils.optimizer_steps``): notes a rewrite of each stepped
    cached weight's memory. A fused step (``fused=True``) moves no version counter, so the
    version alone would still match the entry of the weight before the step. The rewrite stamp
    is the cache's own (``utils.rewrites``): autograd's counters stay as the step left them (a
    moved counter would make autograd refuse a backward whose saved tensors share the
    parameter's counter, e.g. views of one flat buffer stepped inside backward)."""
    for p in params:
        if getattr(p, _CACHED_ATTR, False):
            note_rewrite(p)


def join_keys(keys: Sequence[WeightKey]) -> WeightKey:
    """One key for several weights quantized as one entry (an MoE layer's experts)."""
    # list comprehensions, not generators: one frame each, not one step per expert
    return WeightKey(tuple([k.versions for k in keys]), tuple([k.state for k in keys]),
                     keys[0].recipe if keys else None)


def split_entry(entry: WeightEntry) -> list[WeightEntry]:
    """The per-weight entries of a joined one (``join_keys``): same region, same keptness."""
    k = entry.key
    return [WeightEntry(WeightKey(v, s, k.recipe), qw, w, entry.region, entry.kept, entry.scope, entry.served)
            for v, s, qw, w in zip(k.versions, k.state, entry.qw, entry.weight)]
