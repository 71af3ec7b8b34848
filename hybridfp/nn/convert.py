"""``convert``: swap a model's ``nn.Linear`` layers for hybridfp ``Linear``, in place."""

from __future__ import annotations

from typing import Callable, Optional

from torch import nn

from .base import QuantizedModule
from .linear import Linear


def set_names(model: nn.Module) -> nn.Module:
    """Give every hybridfp module without a name its qualified name in ``model``."""
    for name, m in model.named_modules():
        if isinstance(m, QuantizedModule) and not m.name:
            m.name = name
    return model


def convert(model: nn.Module, recipe_filter: Optional[Callable[[str, nn.Module], bool]] = None) -> nn.Module:
    """Replace ``nn.Linear`` submodules (those ``recipe_filter(name, module)`` accepts; all by
    default) with ``hybridfp.nn.Linear`` sharing the same weight and bias Parameters, so an
    optimizer built before the conversion keeps working. Returns ``model``."""
    for name, m in list(model.named_modules()):
        for child_name, child in list(m.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is not nn.Linear or (recipe_filter is not None and not recipe_filter(full, child)):
                continue
            new = Linear(child.in_features, child.out_features, bias=child.bias is not None,
                         params_dtype=child.weight.dtype, device="meta", name=full)
            new.weight, new.bias = child.weight, child.bias  # the same Parameters, not copies
            new.train(child.training)
            setattr(m, child_name, new)
    return set_names(model)
