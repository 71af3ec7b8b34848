"""The quantized linear as two ``torch.library`` custom ops, so ``torch.compile`` traces a
hybridfp module without a graph break.

Eager calls run ``LinearFunction`` (``nn/linear_function.py``). Under ``torch.compile`` the
module's forward calls ``hybridfp::linear_forward`` instead, and its registered backward
``hybridfp::linear_backward``: Dynamo sees two opaque ops on plain tensors and never traces
the quantizers, ``QuantizedTensor`` construction or the GEMM dispatch. Both ops run the same
``forward_gemm`` / ``backward_gemms`` as the eager function, with the module's quantizers
looked up when the op runs, so results are bitwise the eager ones and stateful quantizers
(delayed scaling) record their amaxes as in eager (the region end updates them as usual).

The forward op returns y and the payload tensors of what backward reads (the copies eager
saves; an input saved as it is, ``save_original_input`` or ``backward_override=
"high_precision"``, is saved by the autograd wrapper instead of being returned, since an op's
outputs may not alias its inputs). Which payloads, with which shapes, is worked out by the
same ``forward_gemm`` run on meta tensors with copies of the quantizers (the ops' fake
implementation, and the backward's skeletons to rebuild the saved copies), memoized per
module, quantizer set and call signature.

The traced wrapper passes the module as ``id(module)`` (the registry below maps it back; a
module registers itself when made or unpickled) and the configuration (recipe, decoded-copies
policy) as a string, so Dynamo guards on it and a change recompiles; a recipe's factory is keyed
by value where its equality is known to be that of fixed attributes (an equal
``CustomRecipe(per_gemm(...))`` made each step reuses the graph), else by identity (see
``_object_key``). Each forward op call also returns a one-element CPU tensor carrying what its
backward needs besides tensors: the GEMM set's context (quantizers, options) and the policy the
forward ran under. Autograd saves it with the copies and hands it to the backward op, which
runs under that context and policy, as the eager function's backward reads its ``ctx``: a
forward under another recipe or policy in between changes nothing.

The shared input quantization (``nn/shared_input.py``) is not used inside the ops: its memo
recognises an input by storage, shape and version counter, and inductor writes a later value
into a dead intermediate's buffer without bumping the version, so the memo could hand out
copies of the old value. Each op quantizes its own input (bitwise the shared copies).

A quantized weight parameter (``quantized_model_init``) goes in as its payload tensors (Dynamo
does not trace ``QuantizedTensor``); the op rebuilds it on them, so fprop reads what eager's
``quantized_weight`` returns, and saves them for dgrad as eager does. Its gradient is given to
the parameter by a nested backward from the backward op (``.grad`` and hooks as in eager).

Not covered (documented in README.md): ``torch.utils.checkpoint`` records / replays of
compiled calls (the module's ``__call__`` records nothing while traced), and ``GroupedLinear``.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import weakref
from typing import Any, Optional

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import guard_int

from ..config import Policy, current_policy, use_policy
from ..recipes import AutocastState, current_autocast
from ..tensors import QuantizedTensor
from .base import mark_not_offload
from .linear_function import (LinearContext, LinearFunction, backward_gemms, bias_grad, forward_gemm,
                              torch_autocast_off)

#: id(module) -> module, for the ops (which take plain values only); entries die with modules.
_MODULES: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
#: module -> {GEMM set index: its latest forward's context, without the module}, read while
#: tracing (the saved copies' plan).
_CONTEXTS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
#: The plan memo: module -> {ids of a quantizer set (input, weight, grad_output): (weak
#: references to those quantizers, {call signature: plan})}. Per quantizer set, so the plans of
#: a set the module rebuilt away go once its quantizers are gone (see :func:`_plan_memo`);
#: plans hold no quantizer, so they keep none alive.
_PLANS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()

# how backward reads x / W: not at all, the op's input itself, payloads the op returned, or (a
# quantized weight parameter) the held weight's payloads the op took as inputs
_NONE, _INPUT, _PAYLOAD, _HELD = 0, 1, 2, 3


def register(module: Any) -> None:
    """Make ``module`` reachable from the ops by ``id(module)`` (called by the modules when
    made and when unpickled / deep-copied)."""
    _MODULES[id(module)] = module


def _module(key: int) -> Any:
    module = _MODULES.get(key)
    if module is None:
        raise RuntimeError("hybridfp::linear_forward: the module of this compiled call is not "
                           "registered (a hybridfp module made without its __init__?); build it "
                           "with its constructor, or call hybridfp.nn.ops.register(module).")
    return module


def config_key(state: AutocastState) -> str:
    """The configuration a compiled graph was traced for (Dynamo guards on it): the policy
    fields the quantizers depend on (decoded copies) and the recipe: a dataclass recipe's field
    values, a ``CustomRecipe``'s factory (:func:`_object_key`) and options, else the recipe
    object (:func:`_object_key`). The forward op computes it again when it runs and refuses a
    graph traced for another value, so it reads nothing a call may change: a factory's lazily
    made attributes (a cache, a call counter) are not part of it.

    Parameters
    ----------
    state:
        The active autocast region.

    Returns
    -------
    str
        Equal for configurations one graph serves.
    """
    pol = current_policy()
    return repr((pol.decoded_copies, pol.decoded_unverified_on_cuda, _recipe_key(state.recipe)))


def _recipe_key(recipe: Any) -> str:
    if not dataclasses.is_dataclass(recipe):
        factory = getattr(recipe, "qfactory", None)  # CustomRecipe: its factory and options
        return repr((type(recipe).__name__, _object_key(recipe if factory is None else factory),
                     getattr(recipe, "fprop_fast_accumulation", None), getattr(recipe, "backward_override", None)))
    return repr((type(recipe).__name__, tuple((f.name, repr(getattr(recipe, f.name)))
                                              for f in dataclasses.fields(recipe))))


_SCALARS = (str, int, float, bool, type(None))


def _plain(value: Any) -> bool:
    """Whether ``value`` is data whose ``repr`` is its value (scalars, tuples, lists, dicts)."""
    if isinstance(value, _SCALARS):
        return True
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return False


#: Factory classes whose ``__eq__`` compares exactly these attributes, set when the factory is
#: made and never changed by calling it: keyed by their values. By name, since ``PlanFactory``
#: lives in ``hybridfp.analyze``, a layer above this one; the exact class only (a subclass may
#: compare or change other state).
_BY_VALUE: dict[tuple[str, str], tuple[str, ...]] = {
    ("hybridfp.recipes.factories", "per_gemm"): ("fprop", "dgrad", "wgrad"),
    ("hybridfp.analyze.recommend", "PlanFactory"): ("plan", "default"),
}


def _object_key(obj: Any) -> Any:
    """A factory (or non-dataclass recipe) as a compiled graph's key: a class of
    :data:`_BY_VALUE` by the values of the attributes its ``__eq__`` compares (plain data),
    so an equal one made each step passes the guards (Dynamo guards on the values read here)
    and one that differs traces again; anything else by identity.

    Identity, not the object's attributes, for other classes, even ones defining ``__eq__``:
    which attributes their equality reads is unknown, and a factory may add or change
    attributes when called (a lazy cache, a counter), which happens between the trace (that
    reads the key before the quantizers are built) and the run (that reads it again). Dynamo
    guards on the attribute values it read, not on attributes added later, so such a key
    would differ at run time while the guards still pass. An equal object of such a class
    made anew traces again; Dynamo drops a graph whose guarded object died, so a new one at
    its address traces again too."""
    cls = type(obj)
    names = _BY_VALUE.get((cls.__module__, cls.__qualname__))
    if names is not None:
        values = tuple((n, getattr(obj, n, None)) for n in names)
        if _plain(values):
            return (cls.__module__, cls.__qualname__, values)
    return ("id", id(obj))


class _MetaWeights:
    """Stands in for the module in the meta shape pass: the weight is quantized directly (no
    cache entry written), everything else is the module's."""

    def __init__(self, module: Any) -> None:
        self._m = module

    def quantized_weight(self, weight: torch.Tensor, q: Any, columnwise: bool, index: int = 0, *,
                         region: Optional[object] = None, is_first_microbatch: Optional[bool] = None) -> Any:
        q.set_usage(rowwise=True, columnwise=columnwise)
        return q.quantize(weight)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._m, name)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What backward reads of x and W, and the forward op's payload outputs (meta tensors). A
    skeleton is (storage without tensors, payload slot groups): the quantizer a saved copy is
    rebuilt with is the caller's (its context's), the one the plan was memoized for."""

    x_form: int
    x_skel: Any
    x_meta: tuple
    w_form: int
    w_skel: Any
    w_meta: tuple


def _sizes(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s shape as ints: a symbolic size (dynamic shapes) is specialized, so each new size
    traces again. The saved copies' shapes come from a meta pass at concrete sizes (block
    counts and padding are not symbolic expressions of the formats' code)."""
    return tuple(guard_int(d) for d in t.shape)


def _form(saved: Optional[torch.Tensor], given: torch.Tensor) -> tuple[int, Any, tuple]:
    """How backward reads ``saved``; for a quantized copy, its skeleton, its payload slots
    grouped by the tensor they hold (``tensors()`` order) and the meta tensors."""
    if saved is None:
        return _NONE, None, ()
    if saved is given:
        return _INPUT, None, ()
    storage = saved.qstorage
    groups = storage._tensor_slots()
    tensors, skel = storage.split_tensors()
    return _PAYLOAD, (skel, groups), tuple(tensors)


def _plan_memo(module: Any, quantizers: tuple) -> dict:
    """The plans of ``module`` for the quantizer set ``quantizers`` (its memo table, made when
    first asked). Entries are keyed by the quantizers' ids and checked against weak references
    (an id is reused once its object dies); a new set drops the entries of sets whose
    quantizers died, so the table holds the sets still alive (the module's current one, and
    those calls in flight or their records still hold), not one per rebuild."""
    table = _PLANS.setdefault(module, {})
    ids = tuple(id(q) for q in quantizers)
    entry = table.get(ids)
    if entry is not None and all(r() is q for r, q in zip(entry[0], quantizers)):
        return entry[1]
    for k, (refs, _) in list(table.items()):  # a copy: another thread may add a set meanwhile
        if any(r() is None for r in refs):
            table.pop(k, None)
    plans: dict = {}
    table[ids] = (tuple(weakref.ref(q) for q in quantizers), plans)
    return plans


def _plan(lc: LinearContext, x_shape: tuple, x_dtype: torch.dtype, w_shape: tuple, w_dtype: torch.dtype,
          needs_dgrad: bool, needs_wgrad: bool, held: bool = False) -> _Plan:
    """``forward_gemm``'s saved copies for these shapes, from a run on meta tensors with copies
    of the quantizers (their state untouched), memoized per module, quantizer set and signature
    (:func:`_plan_memo`). ``held``: the weight is a quantized parameter, whose payloads (the
    op's inputs) backward reads as eager's saved weight does."""
    module = lc.module
    key = (getattr(module, "_qkey", None), lc.weight_index, x_shape, x_dtype, w_shape, w_dtype, needs_dgrad,
           needs_wgrad, held, lc.backward_override, lc.save_original_input)
    memo = _plan_memo(module, (lc.input_q, lc.weight_q, lc.grad_q))
    if key in memo:
        return memo[key]
    with unset_fake_temporarily(), torch.no_grad():
        x = torch.empty(x_shape, dtype=x_dtype, device="meta")
        w = torch.empty(w_shape, dtype=w_dtype, device="meta")
        meta_lc = dataclasses.replace(lc, input_q=lc.input_q.copy(), weight_q=lc.weight_q.copy(),
                                      grad_q=lc.grad_q.copy(), module=_MetaWeights(module), scratch=None,
                                      region=None, is_first_microbatch=None)
        _, sx, sw = forward_gemm(x, w, None, meta_lc, needs_dgrad, needs_wgrad, run_gemm=False)
    xf, xs, xm = _form(sx, x)
    wf, ws, wm = _form(sw, w)
    if held:  # forward_gemm saves the held weight itself (never a copy of it) when dgrad needs it
        wf, ws, wm = (_HELD if needs_dgrad else _NONE), None, ()
    plan = _Plan(xf, xs, xm, wf, ws, wm)
    memo[key] = plan
    return plan


def _forward_context(module: Any, index: int, is_first_microbatch: int) -> LinearContext:
    state = current_autocast()
    if state is None:
        raise RuntimeError(f"{module._who()}: its compiled quantized GEMM ran outside hybridfp.autocast. "
                           "A torch.utils.checkpoint inside a compiled function recomputes the forward "
                           "in backward, outside the region: not supported under torch.compile; "
                           "checkpoint without compiling, or compile without checkpointing hybridfp "
                           "modules. Otherwise the graph is stale: call torch._dynamo.reset().")
    ifm = None if is_first_microbatch < 0 else bool(is_first_microbatch)
    # no shared-input memo (see the module docstring): under inductor an input's buffer may
    # hold another value at the same version by the time a later op would look it up
    lc = dataclasses.replace(module.linear_context(state, index, ifm, grad_enabled=True), scratch=None)
    # without the module: a weak-keyed entry whose value held its key would keep it alive
    _CONTEXTS.setdefault(module, {})[index] = dataclasses.replace(lc, module=None, region=None)
    return lc


#: The attribute of a forward op call's record tensor that holds its :class:`_CallRecord`.
_RECORD = "_hybridfp_linear_call"
_SERIALS = itertools.count(1)
#: module -> {GEMM set index: {serial: record} of its latest _RECENT forward op calls}: the
#: record of a call whose record tensor a saved-tensor hook handed back as a copy (see
#: _read_record); enough for the forwards a pipeline or accumulation schedule keeps in flight.
_RECENT_CALLS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
_RECENT = 64


@dataclasses.dataclass(frozen=True, eq=False)
class _CallRecord:
    """What one forward op call's backward needs besides tensors: its context (without the
    module, which the backward op looks up by key: a record held in ``_RECENT_CALLS`` must not keep
    its module alive) and the policy the forward ran under."""

    lc: LinearContext
    policy: Policy


def _call_record(module: Any, index: int, lc: LinearContext) -> torch.Tensor:
    """A one-element CPU tensor naming this call (a serial), carrying its context and the policy
    now. Autograd saves it as it saves the copies, so the record lives as long as the graph that
    may run this call's backward; on the CPU its value is read without a device sync. CPU offload
    leaves it in place (a copy would lose the attribute)."""
    serial = next(_SERIALS)
    record = _CallRecord(dataclasses.replace(lc, module=None, region=None), current_policy())
    token = torch.tensor([serial], dtype=torch.int64)
    setattr(token, _RECORD, record)
    mark_not_offload(token)
    recent = _RECENT_CALLS.setdefault(module, {}).setdefault(index, collections.OrderedDict())
    recent[serial] = record
    if len(recent) > _RECENT:
        recent.popitem(last=False)
    return token


def _read_record(module: Any, index: int, token: torch.Tensor) -> tuple[LinearContext, Policy]:
    """The context (with its module) and policy of the forward call ``token`` names."""
    record = getattr(token, _RECORD, None)
    if record is None:  # a saved-tensor hook returned a copy (save_on_cpu(pin_memory=True)): its value names the call
        record = _RECENT_CALLS.get(module, {}).get(index, {}).get(int(token.reshape(-1)[0]))
        if record is None:
            raise RuntimeError(
                f"{module._who()}: the compiled backward of GEMM set {index} cannot find its forward's "
                "context: a saved-tensor hook handed back a copy of the forward's record tensor (an "
                f"int64 CPU tensor of one element), and the module ran more than {_RECENT} forwards "
                "since. Keep that tensor in place in the hook (hybridfp.mark_not_offload marks it), "
                "or run fewer forwards of the module before their backwards.")
    return dataclasses.replace(record.lc, module=module), record.policy


def _fresh(out: list[torch.Tensor], inputs: tuple) -> list[torch.Tensor]:
    """An op's outputs may alias neither its inputs nor each other: clone any that would (an
    identity copy holding the input itself). Cloning keeps the values, so results stay bitwise."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t is not None and t.numel()}
    res = []
    for t in out:
        p = t.untyped_storage().data_ptr()
        if t.numel() and p in seen:
            t = t.clone()
            p = t.untyped_storage().data_ptr()
        seen.add(p)
        res.append(t)
    return res


#: What the forward op takes in the weight's place for a quantized weight parameter (which
#: Dynamo cannot hand to an op): an empty tensor that requires grad when the parameter does, so
#: the op's output is differentiable as eager's is. Its gradient is always None (never written);
#: the weight's own reaches the parameter from the backward op (:func:`_accumulate_held_grad`).
_HELD_WITH_GRAD = torch.empty(0, requires_grad=True)
_HELD_NO_GRAD = torch.empty(0)


def _held_param(module: Any, index: int) -> QuantizedTensor:
    """The quantized weight parameter of GEMM set ``index`` (``quantized_weight_slots``)."""
    for attr, i in module.quantized_weight_slots:
        p = getattr(module, attr, None)
        if i == index and isinstance(p, QuantizedTensor):
            return p
    raise RuntimeError(f"{module._who()}: the compiled graph was traced with a quantized weight for GEMM set "
                       f"{index}, which the module no longer holds; call torch._dynamo.reset().")


def _held_weight(module: Any, index: int, payloads: list[torch.Tensor]) -> QuantizedTensor:
    """The held weight rebuilt on the payload tensors the op took (the parameter's own, unless a
    recomputation or AOTAutograd hands copies): what eager's ``quantized_weight`` returns."""
    p = _held_param(module, index)
    try:
        storage = p.qstorage.with_tensors(list(payloads))
    except ValueError:
        raise RuntimeError(f"{module._who()}: the quantized weight {p.qstorage.describe()} does not have the "
                           "payload layout the compiled graph was traced with; call torch._dynamo.reset().") from None
    return QuantizedTensor(storage, p.quantizer)


class _HeldGrad(torch.autograd.Function):
    """The edge from a gradient to a quantized weight parameter: backward hands it on as is."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return torch.zeros((), dtype=w.dtype, device=w.device).expand(w.shape)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g


def _accumulate_held_grad(param: QuantizedTensor, dw: torch.Tensor) -> None:
    """Give ``dw`` to the quantized weight parameter through autograd (a nested backward from
    the backward op): it accumulates into ``param.grad`` as eager's does (a plain tensor of the
    weight's nominal dtype) and the parameter's hooks run (DDP's among them). The compiled
    graph cannot take the parameter itself as an input (Dynamo does not trace
    ``QuantizedTensor``)."""
    with torch.enable_grad():
        link = _HeldGrad.apply(param)
    torch.autograd.backward(link, dw)


@torch.library.custom_op("hybridfp::linear_forward", mutates_args=())
def linear_forward(x2: torch.Tensor, weight: torch.Tensor, weight_payloads: list[torch.Tensor],
                   bias: Optional[torch.Tensor], key: int, index: int, config: str, needs_dgrad: bool,
                   needs_wgrad: bool, is_first_microbatch: int, held: bool) -> list[torch.Tensor]:
    """fprop of GEMM set ``index`` of module ``key``: [y, payloads backward reads, the call's
    record (:func:`_call_record`)]. ``held``: the weight is the module's quantized parameter,
    rebuilt from ``weight_payloads`` (``weight`` is then an empty stand-in)."""
    module = _module(key)
    lc = _forward_context(module, index, is_first_microbatch)
    if config != config_key(current_autocast()):  # type: ignore[arg-type]
        raise RuntimeError(f"{module._who()}: the active recipe is not the one this graph was compiled "
                           "for; call torch._dynamo.reset() (torch.compile guards on the recipe).")
    w = _held_weight(module, index, weight_payloads) if held else weight
    with torch_autocast_off(x2):
        y, sx, sw = forward_gemm(x2, w, bias, lc, needs_dgrad, needs_wgrad)
    plan = _plan(lc, tuple(x2.shape), x2.dtype, tuple(w.shape), w.dtype, needs_dgrad, needs_wgrad, held)
    out = [y]
    for form, skel, saved, given in ((plan.x_form, plan.x_skel, sx, x2), (plan.w_form, plan.w_skel, sw, w)):
        same = _HELD if held and given is w else _INPUT
        if form != (_NONE if saved is None else same if saved is given else _PAYLOAD):
            raise RuntimeError(f"{module._who()}: the compiled graph expected other saved tensors than "
                               "this call makes; call torch._dynamo.reset() to recompile.")
        if form == _PAYLOAD:
            out += _payloads(saved, skel, module)
    out.append(_call_record(module, index, lc))
    return _fresh(out, (x2, weight, bias, *weight_payloads))


def _payloads(t: Any, skel: Any, module: Any) -> list[torch.Tensor]:
    """``t``'s payload tensors grouped as the meta pass grouped them (the order the graph was
    traced with: a real storage may list its tensors in another order)."""
    storage, groups = t.qstorage, skel[1]
    slots = {(d, n) for d in storage.directions() for n in storage.payloads[d]}
    if slots != {s for g in groups for s in g} or any(
            storage.payloads[d][n] is not storage.payloads[g[0][0]][g[0][1]] for g in groups for d, n in g):
        raise RuntimeError(f"{module._who()}: the saved copy {storage.describe()} does not have the "
                           "layout the compiled graph was traced with; call torch._dynamo.reset().")
    return [storage.payloads[g[0][0]][g[0][1]] for g in groups]


def _rebuild(skel: Any, tensors: list[torch.Tensor], quantizer: Any) -> QuantizedTensor:
    """Inverse of :func:`_payloads` (as ``linear_function.unpack``), a tensor of ``quantizer``
    (the live one of the call's context, not the meta pass's copy)."""
    storage, _groups = skel
    return QuantizedTensor(storage.with_tensors(list(tensors)), quantizer)


def _weight_meta(module: Any, index: int, weight: torch.Tensor, held: bool) -> tuple[tuple, torch.dtype]:
    """The weight's shape (ints) and nominal dtype: the held parameter's, else ``weight``'s."""
    if held:
        p = _held_param(module, index)
        return tuple(p.shape), p.dtype
    return _sizes(weight), weight.dtype


@linear_forward.register_fake
def _linear_forward_fake(x2, weight, weight_payloads, bias, key, index, config, needs_dgrad, needs_wgrad,
                         is_first_microbatch, held):
    module = _module(key)
    with unset_fake_temporarily():  # quantizers built here hold real state tensors (delayed scaling)
        lc = _forward_context(module, index, -1)
    xs = _sizes(x2)
    ws, w_dtype = _weight_meta(module, index, weight, held)
    plan = _plan(lc, xs, x2.dtype, ws, w_dtype, needs_dgrad, needs_wgrad, held)
    out = [x2.new_empty((xs[0], ws[0]))]
    for m in plan.x_meta + plan.w_meta:
        out.append(torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=x2.device))
    out.append(torch.empty(1, dtype=torch.int64, device="cpu"))  # the call's record
    return out


@torch.fx.node.has_side_effect  # a held weight's gradient is given to the parameter, not returned
@torch.library.custom_op("hybridfp::linear_backward", mutates_args=())
def linear_backward(dy2: torch.Tensor, saved: list[torch.Tensor], record: torch.Tensor, key: int, index: int,
                    in_features: int, x_dtype: torch.dtype, w_dtype: torch.dtype, needs_dgrad: bool,
                    needs_wgrad: bool, bias_grad_dtype: Optional[torch.dtype], held: bool) -> list[torch.Tensor]:
    """dgrad / wgrad / bias grad of GEMM set ``index`` of module ``key``: the gradients asked
    for, in that order; a held (quantized parameter) weight's gradient is accumulated into the
    parameter instead of returned. ``record``: the forward call's record, whose context and
    policy this backward runs with (as the eager backward re-enters its forward's)."""
    module = _module(key)
    lc, pol = _read_record(module, index, record)
    m, n = dy2.shape
    plan = _plan(lc, (m, in_features), x_dtype, (n, in_features), w_dtype, needs_dgrad, needs_wgrad, held)
    rest = list(saved)
    sx = sw = None
    if plan.x_form != _NONE:
        k = 1 if plan.x_form == _INPUT else len(plan.x_meta)
        sx = rest[0] if plan.x_form == _INPUT else _rebuild(plan.x_skel, rest[:k], lc.input_q)
        rest = rest[k:]
    if plan.w_form == _HELD:
        sw = _held_weight(module, index, rest)
    elif plan.w_form != _NONE:
        sw = rest[0] if plan.w_form == _INPUT else _rebuild(plan.w_skel, rest, lc.weight_q)
    with use_policy(pol), torch_autocast_off(dy2):
        dx, dw = backward_gemms(dy2, sx, sw, lc, x_dtype, w_dtype, needs_dgrad, needs_wgrad)
        db = bias_grad(dy2, bias_grad_dtype) if bias_grad_dtype is not None else None
    if held and dw is not None:
        _accumulate_held_grad(_held_param(module, index), dw)
        dw = None
    return _fresh([t for t in (dx, dw, db) if t is not None], (dy2, *saved))


@linear_backward.register_fake
def _linear_backward_fake(dy2, saved, record, key, index, in_features, x_dtype, w_dtype, needs_dgrad,
                          needs_wgrad, bias_grad_dtype, held):
    m, n = dy2.shape
    out = []
    if needs_dgrad:
        out.append(dy2.new_empty((m, in_features), dtype=x_dtype))
    if needs_wgrad and not held:
        out.append(dy2.new_empty((n, in_features), dtype=w_dtype))
    if bias_grad_dtype is not None:
        out.append(dy2.new_empty((n,), dtype=bias_grad_dtype))
    return out


def _setup_context(ctx: Any, inputs: tuple, output: list) -> None:
    x2, weight, payloads, bias, key, index, _config, needs_dgrad, needs_wgrad, _ifm, held = inputs
    module = _module(key)
    lc = dataclasses.replace(_CONTEXTS[module][index], module=module)
    ws, w_dtype = _weight_meta(module, index, weight, held)
    plan = _plan(lc, _sizes(x2), x2.dtype, ws, w_dtype, needs_dgrad, needs_wgrad, held)
    saved: list[torch.Tensor] = []
    pos = 1
    for form, meta, given in ((plan.x_form, plan.x_meta, x2), (plan.w_form, plan.w_meta, weight)):
        if form == _INPUT:
            saved.append(given)
        elif form == _HELD:
            saved += list(payloads)
        elif form == _PAYLOAD:
            saved += output[pos:pos + len(meta)]
            pos += len(meta)
    ctx.save_for_backward(*saved, output[-1])  # the call's record last
    ctx.args = (key, index, guard_int(x2.shape[1]), x2.dtype, w_dtype, needs_dgrad, needs_wgrad,
                bias.dtype if bias is not None and bias.requires_grad else None, held)
    ctx.n_payloads = len(payloads)


def _backward(ctx: Any, grads: list) -> tuple:
    key, index, in_features, x_dtype, w_dtype, needs_dgrad, needs_wgrad, bias_dtype, held = ctx.args
    *saved, record = ctx.saved_tensors
    out = list(linear_backward(grads[0].contiguous(), saved, record, key, index, in_features,
                               x_dtype, w_dtype, needs_dgrad, needs_wgrad, bias_dtype, held))
    dx = out.pop(0) if needs_dgrad else None
    dw = out.pop(0) if needs_wgrad and not held else None  # held: given to the parameter (None here)
    db = out.pop(0) if bias_dtype is not None else None
    return dx, dw, [None] * ctx.n_payloads, db, None, None, None, None, None, None, None


torch.library.register_autograd("hybridfp::linear_forward", _backward, setup_context=_setup_context)


def quantized_linear(module: Any, index: int, x: torch.Tensor, weight: torch.Tensor,
                     bias: Optional[torch.Tensor], state: AutocastState,
                     is_first_microbatch: Optional[bool]) -> torch.Tensor:
    """GEMM set ``index`` of ``module`` on ``x`` inside the region ``state``: ``LinearFunction``
    in eager mode, the custom ops under ``torch.compile`` (same numbers, no graph break).

    Parameters
    ----------
    module:
        A module with ``linear_context(state, index, is_first_microbatch, grad_enabled)``.
    index:
        The GEMM set (LayerNormMLP: 0 for fc1, 1 for fc2).
    x, weight, bias:
        The input [..., K], the weight [N, K] and the bias (or None).
    state:
        The active autocast region.
    is_first_microbatch:
        As ``Linear.forward``'s.

    Returns
    -------
    torch.Tensor
        [..., N] in ``x``'s dtype.
    """
    if not torch.compiler.is_compiling():
        return LinearFunction.apply(x, weight, bias, module.linear_context(state, index, is_first_microbatch))
    grad = torch.is_grad_enabled()
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    ifm = -1 if is_first_microbatch is None else int(is_first_microbatch)
    held = isinstance(weight, QuantizedTensor)  # a quantized parameter: its payloads go in plain
    needs_wgrad = grad and weight.requires_grad
    payloads = weight.qstorage.tensors() if held else []
    if held:
        weight = _HELD_WITH_GRAD if needs_wgrad else _HELD_NO_GRAD
    out = torch.ops.hybridfp.linear_forward(x2, weight, payloads, bias, id(module), index, config_key(state),
                                            grad and x.requires_grad, needs_wgrad, ifm, held)
    y = out[0]
    return y.reshape(*x.shape[:-1], y.shape[-1])
