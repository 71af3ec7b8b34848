"""Every optimizer step, seen with the parameters it stepped: process-wide optimizer step hooks.

Caches of values computed from parameters (quantized weights, quantized weight shards, FSDP2's
gathered weights) must know when a step wrote them. A fused step (``torch._fused_adam_``, any
device) and a foreach step on a DTensor write below autograd and move no version counter, but
every ``torch.optim.Optimizer`` runs the global step hooks, whatever its implementation.
torch's optimizers skip a parameter without a gradient, so only those with one count as stepped
(a frozen weight keeps its cached copy). Which ones have a gradient is read by the global
pre-hook, before the step: an optimizer's own post-hooks run before the global ones, and a
common one frees the gradients (``zero_grad`` right after the step).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Sequence

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

#: called with the parameters each optimizer step went over (those with a gradient at its start)
_LISTENERS: list[Callable[[Sequence[torch.Tensor]], None]] = []
_HOOKS: list[RemovableHandle] = []
_LOCK = threading.Lock()
#: id(optimizer) -> its parameters with a gradient, from its step's start to its end
_STEPPING: dict[int, list[torch.Tensor]] = {}


def on_stepped_parameters(fn: Callable[[Sequence[torch.Tensor]], None]) -> None:
    """Have ``fn(params)`` called after every optimizer step with the parameters of the
    optimizer's groups that had a gradient when the step began. Registered once however often
    this is called.

    Parameters
    ----------
    fn:
        Called once per step with all its parameters (one call, however many there are): cheap
        for parameters it does not manage.
    """
    if fn in _LISTENERS:  # the common case, every call after the first: no lock
        return
    with _LOCK:
        if fn not in _LISTENERS:
            _LISTENERS.append(fn)
        if not _HOOKS:
            _HOOKS.append(register_optimizer_step_pre_hook(_before_step))
            _HOOKS.append(register_optimizer_step_post_hook(_after_step))


def _with_grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The global step pre-hook: notes the parameters the step will go over."""
    _STEPPING[id(optimizer)] = _with_grads(optimizer)


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The global step post-hook: each listener sees the stepped parameters."""
    stepped: Optional[list[torch.Tensor]] = _STEPPING.pop(id(optimizer), None)
    if stepped is None:  # the hooks were registered during this step
        stepped = _with_grads(optimizer)
    for fn in _LISTENERS:
        fn(stepped)


def moved_versions(params: Sequence[torch.Tensor]) -> None:
    """A listener (:func:`on_stepped_parameters`): moves the version counter of each stepped
    parameter, so caches keyed on it (``nn/weight_cache.py``) see a fused step, which moves
    none. A foreach or for-loop step moved it already; moving it once more is harmless. An
    inference tensor has no counter to move.

    Parameters
    ----------
    params:
        The parameters one optimizer step went over.
    """
    if params:
        torch.autograd.graph.increment_version([p for p in params if not p.is_inference()])
