"""``quantized_model_init``: hybridfp modules created inside hold their weights as
``QuantizedTensor`` parameters in the recipe's weight format (TransformerEngine's name).

A module finishing its construction inside the context (``QuantizedModule.__init_subclass__``
wraps every subclass's ``__init__``) quantizes its weight parameters once, with the recipe's
weight quantizer for its role, both copies (rowwise for fprop, columnwise for dgrad). Its
forward then reads the parameter as the quantized weight (``QuantizedModule.quantized_weight``)
and, when the module builds its quantizers, adopts the parameter's quantizer as its weight
quantizer (:func:`adopt_weight_quantizers`): one quantizer, so delayed scaling's state is saved
with the module and moves as in a high-precision-weight run. Updates come from FP32 master
weights (``hybridfp.quantize_master_weights`` / ``hybridfp.MasterWeightOptimizer``).
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from ..recipes import Recipe, current_autocast
from ..recipes.autocast import default_recipe
from ..tensors import QuantizedTensor
from ..tensors.quantized_tensor import PARAM_NAME_ATTR as PARAM_NAME
from .quantizer_state import _describe


@dataclass(frozen=True)
class _InitConfig:
    recipe: Recipe
    preserve_high_precision_init_val: bool


_ACTIVE: contextvars.ContextVar[Optional[_InitConfig]] = contextvars.ContextVar("hybridfp_quantized_init", default=None)


@contextmanager
def quantized_model_init(enabled: bool = True, recipe: Optional[Recipe] = None,
                         preserve_high_precision_init_val: bool = False) -> Iterator[None]:
    """Create hybridfp modules whose weights are ``QuantizedTensor`` parameters.

    Linear, LayerNormLinear, LayerNormMLP and GroupedLinear (each expert's ``weight{i}``)
    created inside hold each weight in the recipe's weight format (both copies); biases and
    norm weights stay high precision. Train them with FP32 master weights:
    ``hybridfp.MasterWeightOptimizer`` (a plain torch optimizer refuses quantized parameters at
    its first step). A GroupedLinear with ``single_parameter=True`` refuses the option.

    Parameters
    ----------
    enabled:
        False: modules are created as usual (high-precision weights).
    recipe:
        The recipe whose weight quantizers encode the weights; None: the active
        ``hybridfp.autocast`` region's recipe, else ``Float8CurrentScaling()``. Run the model
        under the same recipe (a different weight format is a clear error at its forward).
    preserve_high_precision_init_val:
        Keep each weight's initial high-precision value on the CPU
        (``param.get_high_precision_init_val()``; free it with
        ``param.clear_high_precision_init_val()``) to seed FP32 master weights exactly.

    Raises
    ------
    NotImplementedError
        A module inside that cannot hold quantized weights (GroupedLinear with
        ``single_parameter=True``).
    ValueError
        With ``preserve_high_precision_init_val``, a module created on the meta device (no
        value to keep).

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> with hf.quantized_model_init(recipe=hf.MXFP8BlockScaling(), preserve_high_precision_init_val=True):
    ...     lin = hf.Linear(64, 32)
    >>> type(lin.weight).__name__, lin.weight.get_high_precision_init_val().dtype
    ('QuantizedTensor', torch.float32)
    >>> with hf.autocast(recipe=hf.MXFP8BlockScaling()):
    ...     y = lin(torch.randn(4, 64))
    >>> y.shape
    torch.Size([4, 32])
    """
    if not enabled:
        token = _ACTIVE.set(None)
    else:
        if recipe is None:
            state = current_autocast()
            recipe = state.recipe if state is not None else default_recipe()
        if not isinstance(recipe, Recipe):
            raise TypeError(f"quantized_model_init: recipe must be a hybridfp Recipe or None, got {type(recipe).__name__}.")
        token = _ACTIVE.set(_InitConfig(recipe, bool(preserve_high_precision_init_val)))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _weight_slots(module: nn.Module) -> tuple[tuple[str, int], ...]:
    """(parameter attribute, quantizer set) of each weight ``module`` holds, or a clear error."""
    slots = getattr(module, "quantized_weight_slots", ())
    if not slots:
        raise NotImplementedError(
            f"{type(module).__name__}: quantized_model_init(enabled=True) is not supported for this "
            "module (its weights cannot be held as QuantizedTensor parameters); create it outside "
            "quantized_model_init, or with quantized_model_init(enabled=False).")
    return slots


def build_part(make: Callable[[], nn.Module]) -> nn.Module:
    """``make()`` with ``quantized_model_init`` off: a module whose constructor builds a hybridfp
    module only to take over its initialised weights (under its own roles, quantized with its
    own weights at the end of its construction) builds it here, so it is not quantized twice.

    Parameters
    ----------
    make:
        Builds the part.

    Returns
    -------
    torch.nn.Module
        The part, its weights high precision.
    """
    token = _ACTIVE.set(None)
    try:
        return make()
    finally:
        _ACTIVE.reset(token)


def construction(init: Any) -> Any:
    """Wrap a QuantizedModule subclass's ``__init__``: the outermost construction finishing
    inside ``quantized_model_init`` quantizes the module's weights."""

    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        # a subclass's __init__ calls its base's (both wrapped): only the outermost call of
        # this object quantizes, once its own construction is complete. Modules built inside
        # it (a user's adapter) quantize at the end of their own; a module that borrows a
        # part's initialisation (LayerNormMLP's fc1 / fc2) builds it unquantized (build_part).
        depth = self.__dict__.get("_hybridfp_init_depth", 0)
        self.__dict__["_hybridfp_init_depth"] = depth + 1
        try:
            init(self, *args, **kwargs)
        finally:
            self.__dict__["_hybridfp_init_depth"] = depth
        if depth == 0 and _ACTIVE.get() is not None:
            quantize_module_weights(self, _ACTIVE.get())

    wrapped.__wrapped__ = init  # type: ignore[attr-defined]
    wrapped.__doc__, wrapped.__name__, wrapped.__qualname__ = init.__doc__, init.__name__, init.__qualname__
    return wrapped


def quantize_module_weights(module: Any, cfg: _InitConfig) -> None:
    """Replace ``module``'s weight parameters by ``QuantizedTensor`` parameters (both copies)."""
    for attr, index in _weight_slots(module):
        p = getattr(module, attr)
        if isinstance(p, QuantizedTensor):
            continue
        role = module.set_role("weight", index)
        q = cfg.recipe.quantizer(role)
        q.role = role
        q.set_usage(rowwise=True, columnwise=True)
        with torch.no_grad():
            qw = q.quantize(p.detach())
        param = nn.Parameter(qw, requires_grad=p.requires_grad)
        setattr(param, PARAM_NAME, f"{type(module).__name__}.{attr}")
        if cfg.preserve_high_precision_init_val:
            if p.is_meta:  # nothing to keep, and the masters would later be seeded from nothing
                raise ValueError(
                    f"quantized_model_init(preserve_high_precision_init_val=True): {type(module).__name__}."
                    f"{attr} is on the meta device, so it has no initial value to keep. Create the module "
                    "on a real device, or pass preserve_high_precision_init_val=False (MasterWeightOptimizer "
                    "then seeds its masters from the quantized weights).")
            param._high_precision_init_val = p.detach().to("cpu", copy=True)
        setattr(module, attr, param)
    # a module holding its weights in a shared buffer (GroupedLinear's pack_weights) lets go of
    # the high-precision one now
    after = getattr(module, "after_weights_quantized", None)
    if callable(after):
        after()


def _describe_format(q: Any) -> str:
    d = _describe(q)
    return f"{d['kind']} [{d['format']}]"


def adopt_weight_quantizers(module: Any, built: dict) -> None:
    """Make each held quantized weight's quantizer the module's weight quantizer of its set (the
    one its forward, region ends and extra state use), after checking the active recipe builds
    the same format; a parameter whose quantizer was lost (e.g. ``torch.load`` of the parameter
    itself) takes the built one. FSDP2's sharded quantized primary weight counts as held, so a
    build outside a forward (its weights sharded) adopts the quantizer its shards are encoded
    with, as a forward's build does."""
    try:
        slots = _weight_slots(module)
    except NotImplementedError:
        return
    for attr, index in slots:
        p = getattr(module, attr, None)
        if isinstance(p, QuantizedTensor) and p.quantizer is None:
            p.set_quantizer(built["weight"][index])
    for index, mine in module.held_weight_quantizers().items():
        want = built["weight"][index]
        if _describe_format(mine) != _describe_format(want) or repr(mine.settings()) != repr(want.settings()):
            attr = next(a for a, i in slots if i == index)
            raise ValueError(
                f"{module._who()}: the weight '{attr}' is held quantized as {_describe_format(mine)} "
                f"{mine.settings()}, but the active recipe's weight quantizer is {_describe_format(want)} "
                f"{want.settings()}. Run the model under the recipe given to quantized_model_init.")
        mine.role = want.role
        built["weight"][index] = mine
