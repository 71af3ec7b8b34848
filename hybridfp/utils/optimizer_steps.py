"""Every optimizer step, seen per stepped parameter: one process-wide optimizer step post-hook.

Caches of values computed from parameters (quantized weight shards, FSDP2's gathered weights)
must know when a step wrote them. A foreach or fused step writes a DTensor below autograd and
moves no version counter, but every ``torch.optim.Optimizer`` runs the global step post-hooks,
whatever its implementation. torch's optimizers skip a parameter without a gradient, so only
those with one count as stepped (a frozen weight keeps its cached copy).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

#: called with each parameter an optimizer step went over (its gradient set)
_LISTENERS: list[Callable[[torch.Tensor], None]] = []
_HOOK: Optional[RemovableHandle] = None
_LOCK = threading.Lock()


def on_stepped_parameter(fn: Callable[[torch.Tensor], None]) -> None:
    """Have ``fn(p)`` called after every optimizer step, for each parameter ``p`` of the
    optimizer's groups that has a gradient. Registered once however often this is called.

    Parameters
    ----------
    fn:
        Cheap for a parameter it does not manage (it runs per parameter per step).
    """
    global _HOOK
    with _LOCK:
        if fn not in _LISTENERS:
            _LISTENERS.append(fn)
        if _HOOK is None:
            _HOOK = register_optimizer_step_post_hook(_after_step)


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The optimizer step post-hook: each listener sees each stepped parameter."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                for fn in _LISTENERS:
                    fn(p)
