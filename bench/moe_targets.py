"""The MoE benchmark's layer configs and the product's targets at each: the one table that
bench_moe (its rows), bound_moe (its bounds) and ``python -m bench`` (its headlines) read.

A target is the least ratio a recipe's MoE layer step (forward + backward, 4 micro-batches a
step, weights quantized once a step) is to reach against the FASTEST BF16 layer of the same run
(BF16 ``torch._grouped_mm``, cuBLAS per expert, ``torch.compile``): baseline ms / recipe ms, >1
is faster. A recipe without an entry (Composer-2, the BF16 recipe) has no stated target, and a
config not in the table (``--quick``'s small shapes) has none.

Plain Python (no torch): ``python -m bench`` reads it without importing the benchmarks.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping, Optional, Union

#: (experts, ffn) of the benchmark's layer (16384 tokens, hidden 4096), in the order they run
CONFIGS: tuple[tuple[int, int], ...] = ((8, 14336), (64, 1408))
FP8_CURRENT, MXFP8 = "hybridfp FP8 current", "hybridfp MXFP8"
#: per (experts, ffn): each recipe's least ratio against the fastest BF16 layer of the run
TARGETS: Mapping[tuple[int, int], Mapping[str, float]] = MappingProxyType({
    (8, 14336): MappingProxyType({FP8_CURRENT: 1.30, MXFP8: 0.95}),
    (64, 1408): MappingProxyType({FP8_CURRENT: 1.20, MXFP8: 0.95}),
})


def config_name(experts: int, ffn: int) -> str:
    """A config as bench_moe's rows name it ("8 experts, ffn 14336")."""
    return f"{experts} experts, ffn {ffn}"


def recipe_of(variant: str) -> str:
    """A row's recipe: its variant name without an A/B suffix (" [...]")."""
    return variant.split(" [")[0]


def target(config: Union[str, tuple[int, int]], variant: str) -> Optional[float]:
    """The target of ``variant`` (a recipe row or one of its A/B variants) at ``config``.

    Parameters
    ----------
    config:
        ``(experts, ffn)`` or a row's ``config`` text (:func:`config_name`).
    variant:
        The row's variant name; a suffix (" [one weight Parameter]") keeps its recipe's target.

    Returns
    -------
    The least ratio against the fastest BF16 of the run, or None where none is stated (a
    recipe or config without an entry).

    Example
    -------
    >>> target((64, 1408), "hybridfp FP8 current [one weight Parameter]")
    1.2
    >>> target("8 experts, ffn 14336", "hybridfp MXFP8"), target((8, 14336), "hybridfp BF16 (high_precision)")
    (0.95, None)
    """
    key = config if isinstance(config, tuple) else next(
        (c for c in TARGETS if config_name(*c) == config), None)
    return TARGETS.get(key, {}).get(recipe_of(variant)) if key is not None else None


def below(ratio: Optional[float], goal: Optional[float]) -> bool:
    """Whether ``ratio`` misses ``goal`` (a ratio at the target meets it; no ratio or no target: not below)."""
    return ratio is not None and goal is not None and ratio < goal
