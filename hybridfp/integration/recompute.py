"""``hybridfp.checkpoint``: a thin alias of ``torch.utils.checkpoint.checkpoint``.

hybridfp modules recompute under torch's own checkpoint, in both modes, with the quantization
of the forward they replay (its autocast region, policy and quantizer state; torch restores the
RNG state, so stochastic rounding draws the same numbers): each module call inside a
checkpointed forward records what its recomputation needs (``hybridfp/nn/recompute.py``). This
alias only defaults ``use_reentrant`` to False (torch's recommended mode); Hugging Face's
``gradient_checkpointing_enable()`` and ``torch.utils.checkpoint`` work as they are.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.utils.checkpoint as torch_checkpoint


def checkpoint(function: Callable[..., Any], *args: Any, use_reentrant: bool = False, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=use_reentrant, **kwargs)``.

    Parameters
    ----------
    function:
        The forward to checkpoint.
    *args:
        Its arguments.
    use_reentrant:
        torch's mode (default False here; both recompute hybridfp modules bitwise).
    **kwargs:
        Passed to ``torch.utils.checkpoint.checkpoint`` (e.g. ``preserve_rng_state``).

    Returns
    -------
    Any
        ``function(*args)``'s result, its activations recomputed in backward.

    Raises
    ------
    RuntimeError
        In backward, when the recomputation calls other hybridfp modules than the forward did
        (the function must be deterministic in the modules it runs).

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> lin = hf.Linear(32, 32)
    >>> x = torch.randn(4, 32, requires_grad=True)
    >>> with hf.autocast(recipe=hf.MXFP8BlockScaling()):
    ...     y = hf.checkpoint(lin, x)         # the same as torch.utils.checkpoint.checkpoint
    >>> y.sum().backward()                    # lin's forward is recomputed, quantized
    >>> x.grad.shape
    torch.Size([4, 32])
    """
    return torch_checkpoint.checkpoint(function, *args, use_reentrant=use_reentrant, **kwargs)
