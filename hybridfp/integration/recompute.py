"""Activation checkpointing that recomputes hybridfp modules with the same quantization.

``torch.utils.checkpoint`` replays a forward during backward, outside the
``hybridfp.autocast`` region it first ran in, so hybridfp modules would recompute in high
precision (and modules refuse to, with a clear error). ``hybridfp.checkpoint`` re-enters the
original region and ``hybridfp.config`` policy for the replay: the same recipe, quantizers and
cached quantized weights, and torch's saved RNG state, so stochastic rounding draws the same
numbers and the recomputed activations are bitwise those of the forward.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator

import torch.utils.checkpoint as torch_checkpoint

from ..config import Policy, current_policy, use_policy
from ..recipes import current_autocast, replay_region


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)`` whose
    recomputation runs inside the autocast region active now (or none, if none is), under the
    policy active now.

    Parameters
    ----------
    function:
        The forward to checkpoint.
    *args:
        Its arguments.
    **kwargs:
        Passed to ``torch.utils.checkpoint.checkpoint`` (e.g. ``preserve_rng_state``);
        ``use_reentrant`` may only be False and ``context_fn`` is set here.

    Returns
    -------
    Any
        ``function(*args)``'s result, its activations recomputed in backward.

    Raises
    ------
    ValueError
        ``use_reentrant=True``, or a ``context_fn`` is given.
    RuntimeError
        In backward, when a module's stateful quantizers changed state since the forward
        (delayed scaling updated at the region's end): run backward inside the region or use
        a stateless recipe for checkpointed layers.

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> lin = hf.Linear(32, 32)
    >>> x = torch.randn(4, 32, requires_grad=True)
    >>> with hf.autocast(recipe=hf.MXFP8BlockScaling()):
    ...     y = hf.checkpoint(lin, x)
    >>> y.sum().backward()                    # lin's forward is recomputed, quantized
    >>> x.grad.shape
    torch.Size([4, 32])
    """
    if kwargs.pop("use_reentrant", False):
        raise ValueError("hybridfp.checkpoint supports only use_reentrant=False (torch's "
                         "recommended mode): the reentrant mode cannot re-enter the region.")
    if "context_fn" in kwargs:
        raise ValueError("hybridfp.checkpoint sets context_fn itself (to re-enter the autocast "
                         "region); wrap your own contexts inside `function` instead.")
    state, pol = current_autocast(), current_policy()
    return torch_checkpoint.checkpoint(
        function, *args, use_reentrant=False,
        context_fn=lambda: (nullcontext(), _replay(state, pol)), **kwargs)


@contextmanager
def _replay(state: Any, pol: Policy) -> Iterator[None]:
    """The recomputation's context: the forward's autocast region and policy (autograd may
    recompute on another thread, which starts with the default policy)."""
    with replay_region(state), use_policy(pol):
        yield
