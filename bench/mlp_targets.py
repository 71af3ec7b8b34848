"""The Llama-3-8B MLP benchmark's speed targets: the one table that bench_mlp (its rows),
bound_mlp (its bounds) and ``python -m bench`` (its headlines) read.

A target is the least ratio a recipe's MLP step (forward + backward, 16384 tokens, 4096 -> 14336
-> 4096) is to reach against BF16 eager in the same run: baseline ms / recipe ms, > 1 is faster.
A recipe's variants (fused SwiGLU, codes, compiled: its name followed by a suffix) share its
target; baselines and rows of no recipe have none.

Plain Python (no torch): ``python -m bench`` reads it without importing the benchmarks.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping, Optional

#: each bench_mlp recipe's least ratio against BF16 eager
TARGETS: Mapping[str, float] = MappingProxyType({
    "hybridfp FP8 current": 1.70, "hybridfp FP8 current, fprop fast accumulation": 1.70,
    "hybridfp FP8 block": 1.45, "hybridfp hybrid FP8-current fwd / FP8-block bwd": 1.50,
    "hybridfp MXFP8": 1.05, "hybridfp NVFP4 fwd / MXFP8 bwd": 1.00, "hybridfp NVFP4 (2D weights, RHT, SR)": 0.95,
})


def target_of(variant: str) -> Optional[float]:
    """The speed target (x BF16 eager) of a bench_mlp row.

    Parameters
    ----------
    variant:
        The row's name: a recipe's (a key of :data:`TARGETS`), optionally followed by a space
        and a variant's suffix, or a baseline's.

    Returns
    -------
    The recipe's target (the longest recipe name the row's name starts with), or None for a
    row of no recipe.

    Example
    -------
    >>> target_of("hybridfp FP8 block + fused SwiGLU"), target_of("BF16 torch.compile")
    (1.45, None)
    """
    base = max((name for name in TARGETS if variant == name or variant.startswith(name + " ")), key=len, default=None)
    return None if base is None else TARGETS[base]
