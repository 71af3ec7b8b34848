"""Every optimizer step, seen with the parameters it stepped: process-wide optimizer step hooks.

Caches of values computed from parameters (quantized weights, quantized weight shards, FSDP2's
gathered weights) must know when a step wrote them. A fused step (``torch._fused_adam_``, any
device) and a foreach step on a DTensor write below autograd and move no version counter, but
every ``torch.optim.Optimizer`` runs the global step hooks, whatever its implementation.
torch's optimizers skip a parameter without a gradient, so only those with one count as stepped
(a frozen weight keeps its cached copy): those with one when the step begins (read by the global
pre-hook: an optimizer's own post-hooks run before the global ones, and a common one frees the
gradients) and those with one when it ends (a ``step(closure)`` makes them inside the step).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Sequence

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

#: called with the parameters each optimizer step went over
_LISTENERS: list[Callable[[Sequence[torch.Tensor]], None]] = []
_HOOKS: list[RemovableHandle] = []
_LOCK = threading.Lock()
#: optimizer -> its parameters with a gradient when its current step began; weakly keyed, so an
#: entry a raising step leaves behind lives no longer than the optimizer (which holds them anyway)
_STEPPING: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list[torch.Tensor]]" = weakref.WeakKeyDictionary()


def on_stepped_parameters(fn: Callable[[Sequence[torch.Tensor]], None]) -> None:
    """Have ``fn(params)`` called after every optimizer step with the parameters of the
    optimizer's groups that had a gradient when the step began or when it ended. Registered
    once however often this is called.

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
            # eager even inside a compiled ``optimizer.step``: a traced hook would guard on the
            # number of parameters with a gradient and recompile when it changes (wrapped here,
            # not where defined: torch.compiler.disable imports Dynamo, which importing hybridfp
            # does not)
            _HOOKS.append(register_optimizer_step_pre_hook(torch.compiler.disable(_before_step)))
            _HOOKS.append(register_optimizer_step_post_hook(torch.compiler.disable(_after_step)))


def _with_grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The global step pre-hook: notes the parameters with a gradient as the step begins."""
    _STEPPING[optimizer] = _with_grads(optimizer)


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The global step post-hook: each listener sees the stepped parameters."""
    stepped = _STEPPING.pop(optimizer, [])
    seen = {id(p) for p in stepped}
    stepped += [p for p in _with_grads(optimizer) if id(p) not in seen]
    for fn in _LISTENERS:
        fn(stepped)
