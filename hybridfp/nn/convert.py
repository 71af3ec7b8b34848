"""``convert``: swap a model's ``nn.Linear`` layers for hybridfp ``Linear``, in place."""

from __future__ import annotations

from typing import Callable, Optional

from torch import nn

from .base import QuantizedModule
from .linear import Linear


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


def convert(model: nn.Module, module_filter: Optional[Callable[[str, nn.Module], bool]] = None, *,
            recipe_filter: Optional[Callable[[str, nn.Module], bool]] = None) -> nn.Module:
    """Replace ``nn.Linear`` submodules (those ``module_filter(name, module)`` accepts; all by
    default) with ``hybridfp.nn.Linear`` sharing the same weight and bias Parameters, so an
    optimizer built before the conversion keeps working.

    Only modules of exactly ``nn.Linear``'s type are replaced (not subclasses). Every hybridfp
    module then gets its qualified name (:func:`set_names`). This is the building block of
    ``hybridfp.convert`` (``hybridfp.integration.transformers_convert``), which also converts
    MoE experts, keeps the output projection in high precision and reports what stays behind;
    this one converts every ``nn.Linear`` the filter accepts and says nothing.

    Parameters
    ----------
    model:
        The model, converted in place.
    module_filter:
        ``(qualified_name, module) -> bool``: which ``nn.Linear`` layers to convert; None:
        all of them.
    recipe_filter:
        The former name of ``module_filter`` (the same argument).

    Returns
    -------
    nn.Module
        ``model``.

    Raises
    ------
    TypeError
        Both ``module_filter`` and ``recipe_filter`` given.

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
    for name, m in list(model.named_modules()):
        for child_name, child in list(m.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is not nn.Linear or (module_filter is not None and not module_filter(full, child)):
                continue
            new = Linear(child.in_features, child.out_features, bias=child.bias is not None,
                         params_dtype=child.weight.dtype, device="meta", name=full)
            new.weight, new.bias = child.weight, child.bias  # the same Parameters, not copies
            new.train(child.training)
            setattr(m, child_name, new)
    return set_names(model)
