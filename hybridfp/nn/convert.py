"""``convert``: swap a model's ``nn.Linear`` layers for hybridfp ``Linear``, in place."""

from __future__ import annotations

import weakref
from typing import Callable, NamedTuple, Optional

from torch import nn

from .base import QuantizedModule
from .linear import Linear

#: ``nn.Module``'s hook dictionaries a replaced ``nn.Linear`` hands to its ``Linear`` (the same
#: dict objects: the handles ``register_*_hook`` returned still remove them).
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_pre_hooks",
               "_backward_hooks", "_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")


def set_names(model: nn.Module) -> nn.Module:
    """Give every hybridfp module without a name its qualified name in ``model``.

    Names appear in every quantizer role and error message; modules named already keep theirs.

    Parameters
    ----------
    model:
        Any ``nn.Module`` tree.

    Returns
    -------
    nn.Module
        ``model`` (named in place).

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> model = torch.nn.Sequential(hf.Linear(8, 8), torch.nn.ReLU(), hf.Linear(8, 8))
    >>> [m.name for m in hf.set_names(model) if isinstance(m, hf.Linear)]
    ['0', '2']
    """
    for name, m in model.named_modules():
        if isinstance(m, QuantizedModule) and not m.name:
            m.name = name
    return model


class _Target(NamedTuple):
    """An ``nn.Linear`` to replace: ``parent.<child_name>`` (parent None: the model itself)."""

    parent: Optional[nn.Module]
    child_name: str
    name: str
    linear: nn.Linear


def _refuse_what_would_be_dropped(name: str, m: nn.Linear) -> None:
    """A clear error, before anything changes, for an ``nn.Linear`` whose replacement would
    silently lose something: an accelerate hook or another per-instance ``forward``, a legacy
    (non-full) backward hook, Parameters other than weight / bias, buffers or submodules."""
    who = f"convert: nn.Linear {name or '(the model itself)'}"
    leave_out = "or leave this module out (module_filter)"
    if "_hf_hook" in m.__dict__ or "forward" in m.__dict__:
        what = "an accelerate hook (_hf_hook)" if "_hf_hook" in m.__dict__ else "a per-instance forward"
        raise ValueError(f"{who} has {what}, which the new hybridfp.Linear would not run. Remove it first "
                         "(accelerate: accelerate.hooks.remove_hook_from_module(model, recurse=True)), "
                         f"convert, and attach it again (accelerate.dispatch_model), {leave_out}.")
    if m._backward_hooks and m._is_full_backward_hook is False:
        raise ValueError(f"{who} has a backward hook registered with register_backward_hook, whose "
                         "gradients depend on the module's last autograd node and would change; use "
                         f"register_full_backward_hook, {leave_out}.")
    extra = sorted(set(m._parameters) - {"weight", "bias"}) + sorted(m._buffers) + sorted(m._modules)
    if extra or not isinstance(m.weight, nn.Parameter):
        raise ValueError(f"{who} holds {extra or 'a weight that is not a Parameter'} (weight_norm, "
                         "spectral_norm or state added to it), which the new hybridfp.Linear would not "
                         f"keep; remove it before convert, {leave_out}.")


def _linear_targets(model: nn.Module, module_filter: Optional[Callable[[str, nn.Module], bool]] = None
                   ) -> list[_Target]:
    """The ``nn.Linear`` modules :func:`convert` replaces, decided before anything changes.

    Parameters
    ----------
    model:
        The model (the model itself too, where it is an ``nn.Linear``).
    module_filter:
        ``(qualified_name, module) -> bool``, called on ``nn.Linear`` modules only; None: all.

    Returns
    -------
    list
        ``(parent, child_name, qualified_name, linear)`` per replacement (parent None for the
        model itself), in ``named_modules`` order.

    Raises
    ------
    ValueError
        An accepted ``nn.Linear`` whose replacement would drop something (an accelerate hook, a
        legacy backward hook, extra Parameters, buffers or submodules); the message names it.
    """
    def accept(name: str, m: nn.Module) -> bool:
        return type(m) is nn.Linear and (module_filter is None or bool(module_filter(name, m)))

    targets: list[_Target] = []
    if accept("", model):
        targets.append(_Target(None, "", "", model))
    else:
        for name, m in list(model.named_modules()):
            for child_name, child in list(m.named_children()):
                full = f"{name}.{child_name}" if name else child_name
                if accept(full, child):
                    targets.append(_Target(m, child_name, full, child))
    for t in targets:
        _refuse_what_would_be_dropped(t.name, t.linear)
    return targets


def _replacement(name: str, child: nn.Linear) -> Linear:
    """A ``Linear`` holding ``child``'s Parameters, training mode and hooks."""
    new = Linear(child.in_features, child.out_features, bias=child.bias is not None,
                 params_dtype=child.weight.dtype, device="meta", name=name)
    new.weight, new.bias = child.weight, child.bias  # the same Parameters, not copies
    new.train(child.training)
    # the hooks themselves, in their dicts: they now receive the new module, and their handles
    # still remove them
    for attr in _HOOK_DICTS:
        hooks, own = getattr(child, attr), getattr(new, attr)
        hooks.update(own)
        object.__setattr__(new, attr, hooks)
        for hook in hooks.values():
            # register_load_state_dict_pre_hook keeps its module by a weak reference (torch's
            # _WrappedHook): point it at the new module, the old one may be gone
            ref = getattr(hook, "module", None) if getattr(hook, "with_module", False) else None
            if isinstance(ref, weakref.ReferenceType) and ref() is child:
                hook.module = weakref.ref(new)
    new._is_full_backward_hook = child._is_full_backward_hook
    return new


def _replace_linears(model: nn.Module, targets: list[_Target]) -> nn.Module:
    """Replace the :func:`_linear_targets` of ``model``.

    Parameters
    ----------
    model:
        The model the targets were found in.
    targets:
        From :func:`_linear_targets`.

    Returns
    -------
    nn.Module
        ``model``, or the new ``Linear`` where the target is the model itself.
    """
    done: dict[int, Linear] = {}  # one replacement per module, however many places hold it
    for t in targets:
        new = done.get(id(t.linear))
        if new is None:
            new = done[id(t.linear)] = _replacement(t.name, t.linear)
        if t.parent is None:
            model = new
        else:
            setattr(t.parent, t.child_name, new)
    return model


def convert(model: nn.Module, module_filter: Optional[Callable[[str, nn.Module], bool]] = None, *,
            recipe_filter: Optional[Callable[[str, nn.Module], bool]] = None) -> nn.Module:
    """Replace ``nn.Linear`` submodules (those ``module_filter(name, module)`` accepts; all by
    default) with ``hybridfp.nn.Linear`` sharing the same weight and bias Parameters, so an
    optimizer built before the conversion keeps working.

    Only modules of exactly ``nn.Linear``'s type are replaced (not subclasses); a model that is
    itself an ``nn.Linear`` is replaced too: use the returned module. The filter is called on
    ``nn.Linear`` modules only, all of them before any is replaced (a filter that raises leaves
    the model as it was). The forward (pre-)hooks, full backward (pre-)hooks and state-dict
    hooks registered on a replaced layer move to its ``Linear`` (they receive it as their
    ``module`` argument; their handles still remove them). Every hybridfp module then gets its
    qualified name (:func:`set_names`). This is the building block of ``hybridfp.convert``
    (``hybridfp.integration.transformers_convert``), which also converts MoE experts, keeps the
    output projection in high precision and reports what stays behind; this one converts every
    ``nn.Linear`` the filter accepts and says nothing.

    Parameters
    ----------
    model:
        The model, converted in place.
    module_filter:
        ``(qualified_name, module) -> bool``: which ``nn.Linear`` layers to convert; None:
        all of them. The model itself, where it is an ``nn.Linear``, has the name "".
    recipe_filter:
        The former name of ``module_filter`` (the same argument).

    Returns
    -------
    nn.Module
        ``model``; where ``model`` is itself an accepted ``nn.Linear``, its new ``Linear``.

    Raises
    ------
    TypeError
        Both ``module_filter`` and ``recipe_filter`` given.
    ValueError
        An ``nn.Linear`` the filter accepts whose replacement would drop something the new
        module cannot keep: an accelerate hook (``_hf_hook``) or another per-instance
        ``forward``, a backward hook from ``register_backward_hook`` (use
        ``register_full_backward_hook``), Parameters other than weight and bias (weight_norm),
        buffers or submodules. Nothing is converted then.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    >>> w = model[0].weight
    >>> hf.nn.convert(model, module_filter=lambda name, m: name != "2")
    Sequential(
      (0): Linear(in_features=8, out_features=16, bias=True)
      (1): GELU(approximate='none')
      (2): Linear(in_features=16, out_features=4, bias=True)
    )
    >>> type(model[0]).__module__, type(model[2]).__module__, model[0].weight is w
    ('hybridfp.nn.linear', 'torch.nn.modules.linear', True)
    """
    if recipe_filter is not None:
        if module_filter is not None:
            raise TypeError("convert: pass module_filter only (recipe_filter is its former name), not both.")
        module_filter = recipe_filter
    model = _replace_linears(model, _linear_targets(model, module_filter))
    return set_names(model)
