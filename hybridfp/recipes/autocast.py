"""``autocast``: the region in which hybridfp modules run their GEMMs quantized.

Inside ``with autocast(recipe=...)`` every hybridfp module builds (or reuses) the quantizers
of the active recipe and quantizes its GEMM operands; outside, it runs in high precision.
When the region ends, stateful quantizers (delayed scaling) of the modules that ran in it
finish their step: amax all-reduced over ``amax_reduction_group`` if given, scale updated,
history rolled. Gradient quantizers used in a backward pass finish at the next region's end,
so every quantization uses the scale of the previous update (SPEC §2.2).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Optional

from .recipes import Float8CurrentScaling, Recipe


@dataclass
class AutocastState:
    """The active region: its recipe, amax reduction group and the modules that ran."""

    recipe: Recipe
    amax_reduction_group: Optional[Any] = None
    modules: list[Any] = field(default_factory=list)
    #: True while an activation-checkpoint recomputation replays a forward of this region.
    replay: bool = False
    #: True once a module that ran here has a quantizer that uses recorded amaxes
    #: (``Quantizer.reads_known_amax``): the fused SwiGLU records them only then.
    reads_known_amax: bool = False
    #: Per-region memos of the modules (e.g. the input quantization several Linears share),
    #: dropped when the region ends so nothing they hold outlives it.
    scratch: dict = field(default_factory=dict)

    def key(self) -> tuple:
        """What a module's quantizers depend on: recipe configuration and reduction group."""
        return (self.recipe.key(), id(self.amax_reduction_group))

    def note_module(self, module: Any) -> None:
        """Remember a module that ran, to finish its stateful quantizers at the region's end."""
        if not any(m is module for m in self.modules):
            self.modules.append(module)


_STACK: list[Optional[AutocastState]] = []


def current_autocast() -> Optional[AutocastState]:
    """The innermost enabled region, or None (high precision)."""
    return _STACK[-1] if _STACK else None


def default_recipe() -> Recipe:
    """The recipe used when ``autocast`` is given none: FP8 current scaling (E4M3/E5M2)."""
    return Float8CurrentScaling()


@contextmanager
def autocast(enabled: bool = True, recipe: Optional[Recipe] = None,
             amax_reduction_group: Optional[Any] = None) -> Iterator[Optional[AutocastState]]:
    """Run hybridfp modules with quantized GEMMs from ``recipe`` (or in high precision if
    ``enabled`` is False). ``amax_reduction_group``: a process group over which per-tensor
    amaxes are all-reduced (data/tensor parallel ranks must agree on scales)."""
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"autocast(recipe=...) needs a hybridfp Recipe (e.g. CustomRecipe(qfactory=f)); "
                        f"got {type(recipe).__name__}.")
    if recipe is None:
        recipe = default_recipe()
    state = AutocastState(recipe, amax_reduction_group) if enabled else None
    _STACK.append(state)
    try:
        yield state
    finally:
        _STACK.pop()
        if state is not None:
            state.scratch.clear()
            for module in state.modules:
                module.finish_step(amax_reduction_group)


@contextmanager
def replay_region(state: Optional[AutocastState]) -> Iterator[None]:
    """Re-enter a finished region to recompute one of its forwards (activation
    checkpointing): same recipe and quantizers, no step end (stateful quantizers are not
    finished twice)."""
    _STACK.append(None if state is None else replace(state, modules=[], replay=True, scratch={}))
    try:
        yield
    finally:
        _STACK.pop()
