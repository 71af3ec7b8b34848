"""The statistics of a convergence study: Student-t intervals for a recipe's gap to BF16, paired
by seed or Welch, the seed spread a target can resolve, the seeds it needs, the verdict, and for a
baseline trained more than once at a seed the mean of its runs and their run-to-run floor.

Pure Python (no torch, no scipy): the report runs wherever its metrics files are.

    >>> from bench.convergence_stats import paired_gap
    >>> g = paired_gap({0: 1.01, 1: 1.02, 2: 1.00}, {0: 1.0, 1: 1.0, 2: 1.0})
    >>> round(g.gap_pct, 6), g.n
    (1.0, 3)
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

#: The two-sided confidence level of every interval the study reports.
CONFIDENCE = 0.95

def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
            last = d * c
        if abs(last - 1.0) < 1e-15:
            break
    return h


def _betai(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    ln = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(ln) * _betacf(a, b, x) / a
    return 1.0 - math.exp(ln) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """Student-t distribution function with ``df`` (> 0, real) degrees of freedom."""
    tail = 0.5 * _betai(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """Student-t quantile (bisection on :func:`t_cdf`), 0 < p < 1.

    Parameters
    ----------
    p : the probability.
    df : degrees of freedom (> 0; Welch's are not integers).

    Returns
    -------
    float : t with P(T <= t) = p.

    Raises
    ------
    ValueError : p outside (0, 1) or df <= 0.

    Example
    -------
    >>> round(t_quantile(0.975, 2), 4)
    4.3027
    """
    if not 0.0 < p < 1.0 or not df > 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0; got p={p}, df={df}.")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class Gap:
    """A recipe's gap to BF16 in percent: the estimate, its interval and how it was computed."""

    gap_pct: float
    lo: Optional[float]
    hi: Optional[float]
    method: str          # "paired (n seeds)", "Welch", or why there is no interval
    n: int
    #: paired: the standard deviation of the per-seed gaps in % (None with one seed, or Welch)
    sd: Optional[float] = None


def gap_pct(loss: float, base: float) -> float:
    """One seed's gap in percent: ``100 (loss - base) / base``.

    Parameters
    ----------
    loss, base : the recipe's and the baseline's validation loss at one seed (and step).

    Returns
    -------
    float : the relative difference in percent.

    Example
    -------
    >>> round(gap_pct(1.01, 1.0), 6)
    1.0
    """
    return 100.0 * (loss - base) / base


def paired_gap(recipe: dict[int, float], base: dict[int, float], confidence: float = CONFIDENCE) -> Gap:
    """Gap over the seeds both runs have: the t interval of the per-seed relative differences.

    Parameters
    ----------
    recipe, base : seed -> final validation loss.
    confidence : two-sided confidence level.

    Returns
    -------
    Gap : lo / hi None with fewer than two shared seeds.

    Raises
    ------
    ValueError : no shared seed.

    Example
    -------
    >>> g = paired_gap({0: 1.01, 1: 1.02, 2: 1.03}, {0: 1.0, 1: 1.0, 2: 1.0})
    >>> round(g.gap_pct, 3), round(g.lo, 3), round(g.hi, 3)
    (2.0, -0.484, 4.484)
    """
    seeds = sorted(set(recipe) & set(base))
    if not seeds:
        raise ValueError("paired_gap: the recipe and the baseline share no seed.")
    d = [gap_pct(recipe[s], base[s]) for s in seeds]
    mean = statistics.fmean(d)
    if len(d) < 2:
        return Gap(mean, None, None, "one shared seed: no interval", 1)
    sd = statistics.stdev(d)
    half = t_quantile(0.5 + confidence / 2, len(d) - 1) * sd / math.sqrt(len(d))
    return Gap(mean, mean - half, mean + half, f"paired ({len(d)} seeds)", len(d), sd)


def replicate_means(runs: dict[int, Sequence[float]]) -> dict[int, float]:
    """Per seed, the mean of the baseline's runs of that seed (one run: its own loss): what each
    recipe is paired against when the baseline was trained more than once at a seed.

    Parameters
    ----------
    runs : seed -> the losses of the baseline's runs at that seed (one or more each).

    Returns
    -------
    dict : seed -> mean loss, by seed.

    Raises
    ------
    ValueError : a seed with no run.

    Example
    -------
    >>> {s: round(m, 6) for s, m in replicate_means({0: [1.0, 1.02], 1: [0.9]}).items()}
    {0: 1.01, 1: 0.9}
    """
    empty = sorted(s for s, losses in runs.items() if not losses)
    if empty:
        raise ValueError(f"replicate_means: no run at seed(s) {empty}.")
    return {s: statistics.fmean(runs[s]) for s in sorted(runs)}


def replicate_floor(runs: dict[int, Sequence[float]], confidence: float = CONFIDENCE) -> Optional[Gap]:
    """The run-to-run floor from the baseline's replicates: over the seeds with two or more runs,
    ``d_s = 100 (L_2,s - L_1,s) / L_1,s`` of each seed's second run against its first (in the
    order given), with :func:`paired_gap`'s mean, interval and standard deviation. The standard
    deviation is that of the difference of two runs of one recipe and seed, the figure
    ``bench.convergence_replicates`` measures; runs after a seed's second enter its mean
    (:func:`replicate_means`), not the floor, so the figure keeps that meaning at any run count.

    Parameters
    ----------
    runs : seed -> the losses of the baseline's runs at that seed, in the order of their files.
    confidence : two-sided confidence level.

    Returns
    -------
    Gap or None : None where no seed has two runs; ``sd`` None with only one such seed.

    Example
    -------
    >>> g = replicate_floor({0: [1.0, 1.01], 1: [1.0, 0.99, 1.5], 2: [1.0, 1.0], 3: [2.0]})
    >>> round(g.gap_pct, 6), round(g.sd, 6), g.n
    (0.0, 1.0, 3)
    """
    two = {s: losses for s, losses in runs.items() if len(losses) >= 2}
    if not two:
        return None
    return paired_gap({s: losses[1] for s, losses in two.items()}, {s: losses[0] for s, losses in two.items()},
                      confidence)


def welch_gap(recipe: Sequence[float], base: Sequence[float], confidence: float = CONFIDENCE) -> Gap:
    """Gap of the means relative to the baseline mean, with Welch's t interval.

    Parameters
    ----------
    recipe, base : final validation losses (two or more each for an interval).
    confidence : two-sided confidence level.

    Returns
    -------
    Gap : lo / hi None when either side has one value.

    Example
    -------
    >>> g = welch_gap([1.02, 1.03, 1.04], [1.0, 1.01, 1.02])
    >>> round(g.gap_pct, 3), round(g.lo, 3), round(g.hi, 3)
    (1.98, -0.264, 4.225)
    """
    mr, mb = statistics.fmean(recipe), statistics.fmean(base)
    gap = 100.0 * (mr - mb) / mb
    if len(recipe) < 2 or len(base) < 2:
        return Gap(gap, None, None, "one seed on a side: no interval", min(len(recipe), len(base)))
    vr, vb = statistics.variance(recipe) / len(recipe), statistics.variance(base) / len(base)
    se = math.sqrt(vr + vb)
    if se == 0.0:
        return Gap(gap, gap, gap, "Welch", min(len(recipe), len(base)))
    df = se**4 / (vr**2 / (len(recipe) - 1) + vb**2 / (len(base) - 1))
    half = 100.0 * t_quantile(0.5 + confidence / 2, df) * se / mb
    return Gap(gap, gap - half, gap + half, "Welch", min(len(recipe), len(base)))


def resolvable_sd(target_pct: float, n: int, confidence: float = CONFIDENCE) -> float:
    """The largest standard deviation of the per-seed gaps (in %) with which ``n`` paired seeds
    can still *meet* a ``+-target_pct`` % target: the interval's half width
    ``t(0.975, n-1) sd / sqrt(n)`` must fit in the target even when the mean gap is zero.

    Parameters
    ----------
    target_pct : the target in %.
    n : paired seeds.
    confidence : two-sided confidence level.

    Returns
    -------
    float : the standard deviation in %.

    Raises
    ------
    ValueError : fewer than two seeds (no interval).

    Example
    -------
    >>> round(resolvable_sd(0.25, 3), 3), round(resolvable_sd(0.25, 10), 3)
    (0.101, 0.349)
    """
    if n < 2:
        raise ValueError(f"resolvable_sd: an interval needs at least two seeds; got n={n}.")
    return target_pct * math.sqrt(n) / t_quantile(0.5 + confidence / 2, n - 1)


#: the most seeds :func:`seeds_to_meet` looks for
SEEDS_LIMIT = 1000


def seeds_to_meet(sd: float, target_pct: float, confidence: float = CONFIDENCE, gap_pct: float = 0.0) -> Optional[int]:
    """The fewest paired seeds with which a recipe whose true gap is ``gap_pct`` (default zero)
    meets a ``+-target_pct`` % target, if its per-seed gaps keep the standard deviation ``sd``:
    the first n with ``t(n-1) sd / sqrt(n) <= target - |gap|`` (:func:`resolvable_sd` turned
    around). A planning figure: a few seeds' standard deviation is itself uncertain, and so is
    the mean gap it is asked at.

    Parameters
    ----------
    sd : the per-seed gaps' standard deviation in %.
    target_pct : the target in %.
    confidence : two-sided confidence level.
    gap_pct : the true gap assumed, in % (a gap at or beyond the target is never met).

    Returns
    -------
    int or None : None where no count up to ``SEEDS_LIMIT`` does.

    Raises
    ------
    ValueError : a negative ``sd`` or a non-positive target.

    Example
    -------
    >>> seeds_to_meet(0.1, 0.25), seeds_to_meet(0.67, 0.25), seeds_to_meet(1.11, 1.0), seeds_to_meet(30.0, 0.25)
    (3, 31, 8, None)
    >>> seeds_to_meet(0.67, 0.25, gap_pct=-0.1), seeds_to_meet(0.67, 0.25, gap_pct=0.25)
    (80, None)
    """
    if sd < 0 or target_pct <= 0:
        raise ValueError(f"seeds_to_meet: sd must be >= 0 and the target > 0; got sd={sd}, target={target_pct}.")
    room = target_pct - abs(gap_pct)
    if room <= 0:
        return None
    for n in range(2, SEEDS_LIMIT + 1):
        if t_quantile(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n) <= room:
            return n
    return None


def verdict(lo: Optional[float], hi: Optional[float], target: Optional[float]) -> str:
    """``met`` / ``missed`` / ``unresolved`` for a gap interval against a target of ``+-target`` %
    (``""`` without a target).

    Example
    -------
    >>> verdict(-0.1, 0.2, 0.25), verdict(0.3, 0.9, 0.25), verdict(0.1, 0.4, 0.25)
    ('met', 'missed', 'unresolved')
    """
    if target is None:
        return ""
    if lo is None or hi is None:
        return "unresolved"
    if -target <= lo and hi <= target:
        return "met"
    if hi < -target or lo > target:
        return "missed"
    return "unresolved"


__all__ = ["CONFIDENCE", "Gap", "SEEDS_LIMIT", "gap_pct", "paired_gap", "replicate_floor", "replicate_means",
           "resolvable_sd", "seeds_to_meet", "t_cdf", "t_quantile", "verdict", "welch_gap"]
