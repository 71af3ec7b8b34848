"""``autocast``: the region in which hybridfp modules run their GEMMs quantized.

Inside ``with autocast(recipe=...)`` every hybridfp module builds (or reuses) the quantizers
of the active recipe and quantizes its GEMM operands; outside, it runs in high precision.
When the region ends, stateful quantizers (delayed scaling) of the modules that ran in it
finish their step: amax all-reduced over ``amax_reduction_group`` if given, scale updated,
history rolled. Gradient quantizers used in a backward pass finish at the next region's end,
so every quantization uses the scale of the previous update (numerics §2.2). A region whose body
raises commits nothing: the forward quantizers of the modules that ran in it discard the
amaxes recorded there (``discard_step``), so a failed step leaves the scales as they were.

Regions belong to the thread that entered them, as ``torch.autocast``'s do: each thread has
its own stack of regions, and a thread started inside a region starts outside any (high
precision). Autograd may run a backward pass on another thread; nothing in a backward pass
reads the region, except a ``torch.utils.checkpoint`` recomputation, which re-enters the
region of the forward it replays on the thread that recomputes (``replay_region``, from the
record each module call makes: ``hybridfp/nn/recompute.py``).
Code that runs a forward on worker threads it starts itself (``torch.nn.DataParallel``'s
replicas) must enter the region in those threads; use DDP / FSDP2 (one process per device).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Optional

from ..quantizers.base import reduce_pending_amaxes
from .recipes import Float8CurrentScaling, Recipe


@dataclass
class AutocastState:
    """The active region: its recipe, amax reduction group and the modules that ran."""

    recipe: Recipe
    amax_reduction_group: Optional[Any] = None
    modules: list[Any] = field(default_factory=list)
    #: True while an activation-checkpoint recomputation replays a forward of this region.
    replay: bool = False
    #: In a replay: the quantizers of the module call replayed, as its forward used them (slot ->
    #: list; stateful forward quantizers as copies of their state then), in place of the module's.
    replay_quantizers: Optional[dict] = None
    #: True once a module that ran here has a quantizer that uses recorded amaxes
    #: (``Quantizer.reads_known_amax``): the fused SwiGLU records them only then.
    reads_known_amax: bool = False
    #: The same for per-row-group amaxes (a ``GroupedLinear`` whose experts' FP8 current scales
    #: come from each expert's rows): the fused SwiGLU given the row groups records them only then.
    reads_known_group_amax: bool = False
    #: Per-region memos of the modules (e.g. the input quantization several Linears share),
    #: dropped when the region ends so nothing they hold outlives it.
    scratch: dict = field(default_factory=dict)
    #: This region's identity (a new object per ``autocast`` region, compared by ``is``):
    #: modules' cached quantized weights are valid only in the region whose token they hold.
    #: ``replay_region``'s ``dataclasses.replace`` copies it, so a checkpoint recomputation
    #: uses the quantized weights of the forward it replays.
    token: object = field(default_factory=object)

    def key(self) -> tuple:
        """What a module's quantizers depend on: recipe configuration and reduction group."""
        return (self.recipe.key(), id(self.amax_reduction_group))

    def note_module(self, module: Any) -> None:
        """Remember a module that ran, to finish its stateful quantizers at the region's end."""
        if not any(m is module for m in self.modules):
            self.modules.append(module)


class _ThreadRegions(threading.local):
    """Each thread's stack of regions (None for an ``enabled=False`` one): a new thread starts
    with an empty stack, whatever region the thread that started it is in."""

    def __init__(self) -> None:
        self.stack: list[Optional[AutocastState]] = []


_REGIONS = _ThreadRegions()


def _stack() -> list[Optional[AutocastState]]:
    """The calling thread's stack of regions."""
    return _REGIONS.stack


def current_autocast() -> Optional[AutocastState]:
    """The calling thread's innermost region, or None (high precision)."""
    stack = _stack()
    return stack[-1] if stack else None


def default_recipe() -> Recipe:
    """The recipe used when ``autocast`` is given none: FP8 current scaling (E4M3/E5M2).

    Returns
    -------
    Recipe
        A new ``Float8CurrentScaling()``.
    """
    return Float8CurrentScaling()


@contextmanager
def autocast(enabled: bool = True, recipe: Optional[Recipe] = None,
             amax_reduction_group: Optional[Any] = None) -> Iterator[Optional[AutocastState]]:
    """Run hybridfp modules with quantized GEMMs from ``recipe`` (or in high precision if
    ``enabled`` is False), in the calling thread.

    Parameters
    ----------
    enabled:
        False runs the region in high precision (e.g. inside an enabled region).
    recipe:
        The quantization recipe (default: :func:`default_recipe`).
    amax_reduction_group:
        A process group over which per-tensor amaxes are all-reduced (data/tensor parallel
        ranks must agree on scales).

    Returns
    -------
    contextmanager
        Yielding the region's :class:`AutocastState` (None when disabled). When the body
        finishes, the stateful quantizers of the modules that ran finish their step; when it
        raises, their forward quantizers discard what they recorded in the region instead.

    Raises
    ------
    TypeError
        If ``recipe`` is not a hybridfp Recipe (raised on entering the region).

    Example
    -------
    >>> import torch, hybridfp as hf
    >>> lin = hf.Linear(64, 32)
    >>> x = torch.randn(8, 64, requires_grad=True)
    >>> with hf.autocast(recipe=hf.MXFP8BlockScaling()):
    ...     y = lin(x)
    >>> y.sum().backward()            # the backward GEMMs run outside the region, quantized
    >>> x.grad.shape
    torch.Size([8, 64])
    """
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"autocast(recipe=...) needs a hybridfp Recipe (e.g. CustomRecipe(qfactory=f)); "
                        f"got {type(recipe).__name__}.")
    if recipe is None:
        recipe = default_recipe()
    state = AutocastState(recipe, amax_reduction_group) if enabled else None
    stack = _stack()
    stack.append(state)
    try:
        yield state
    except BaseException:
        _leave(stack, state)
        if state is not None:
            for module in state.modules:
                module.discard_step()
        raise
    _leave(stack, state)
    if state is not None:
        if amax_reduction_group is not None:  # one all-reduce for every quantizer of the region
            reduce_pending_amaxes([q for m in state.modules for q in m.stateful_quantizers()],
                                  amax_reduction_group)
        for module in state.modules:
            module.finish_step(None)


def _leave(stack: list[Optional[AutocastState]], state: Optional[AutocastState]) -> None:
    """Pop ``state`` (the innermost region of this thread) and drop its memos."""
    stack.pop()
    if state is not None:
        state.scratch.clear()


@contextmanager
def replay_region(state: Optional[AutocastState], *, quantizers: Optional[dict] = None,
                  scratch: Optional[dict] = None) -> Iterator[None]:
    """Re-enter a (possibly finished) region to recompute one of its forwards (activation
    checkpointing) on the calling thread: same recipe, token and memos' rules, no step end
    (stateful quantizers are not finished twice).

    Parameters
    ----------
    state:
        The forward's region (None: the forward ran outside any, in high precision).
    quantizers:
        The replayed module call's quantizers (``AutocastState.replay_quantizers``).
    scratch:
        The memo to use (shared by the replays of one recomputation; None: a fresh one).
    """
    stack = _stack()  # the recomputing thread's (autograd may recompute on its own thread)
    stack.append(None if state is None else replace(
        state, modules=[], replay=True, scratch={} if scratch is None else scratch,
        replay_quantizers=quantizers))
    try:
        yield
    finally:
        stack.pop()
