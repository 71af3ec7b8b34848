"""Device-time profiles of several steps at the GPU's steady power state, in rounds.

A bound built from one profile per step, each after two warm-up steps, measures every step as
the GPU runs it fresh. The paired ratios it is compared with run for seconds on end, where an
H100 sits at its power cap and a BF16 GEMM slows (its operands draw more power than FP8's):
the two are measured in different regimes. Here the GPU is first heated by running the first
step (the baseline) for ``heat_s`` seconds; then each round profiles every step once, each
after ``warm_steps`` steps of its own, the steps' order reversed every other round so neither
always follows the other (as ``protocol.paired_ratio`` alternates its sides). The GPU's SM
clock and power are read while each step's warm and profiled calls run.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from bench.common import md_table
from bench.protocol import POLL_S, ClockPoller, Sampler, device_sampler, summarize_clocks

#: ``profile(step, warmup)``: (device ms of one step after ``warmup`` calls, op name -> self
#: device ms), as ``bound_moe._profile``
Profiler = Callable[[Callable[[], Any], int], tuple[float, dict[str, float]]]


@dataclass(frozen=True)
class AtCap:
    """How steps are profiled at the GPU's steady power state.

    Parameters
    ----------
    rounds:
        Profiles of each step, one a round (10: the paired protocol's rounds; the interval of
        a median over 10 values is its 2nd to 9th order statistic).
    warm_steps:
        Calls of a step right before its profiled one (the GPU runs that step's kernels at the
        clock they settle to).
    heat_s:
        Seconds the first step (the baseline) runs before the first round.

    Raises
    ------
    ValueError
        ``rounds`` < 1, ``warm_steps`` < 1 or ``heat_s`` < 0, naming the option.
    """

    rounds: int = 10
    warm_steps: int = 10
    heat_s: float = 15.0

    def __post_init__(self) -> None:
        for name, low in (("rounds", 1), ("warm_steps", 1), ("heat_s", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"AtCap: {name} must be >= {low}, got {getattr(self, name)}")


@dataclass(frozen=True)
class Profiles:
    """Each step's profiles, by the name given to :func:`profile_rounds`.

    Parameters
    ----------
    rounds:
        Name -> one (device ms, op name -> self device ms) a round, in round order.
    clocks:
        Name -> the SM clock / power readings taken while its calls ran, summarized
        (``protocol.summarize_clocks``); empty without a sampler.
    """

    rounds: dict[str, list[tuple[float, dict[str, float]]]]
    clocks: dict[str, dict[str, float]]


def profile_rounds(steps: dict[str, Callable[[], Any]], at_cap: AtCap, profile: Profiler, *,
                   synchronize: Callable[[], None], sampler: Optional[Sampler] = None,
                   poll_s: float = POLL_S, clock: Callable[[], float] = time.perf_counter) -> Profiles:
    """Profile every step of ``steps`` ``at_cap.rounds`` times at the GPU's steady power state
    (module docstring).

    Parameters
    ----------
    steps:
        Name -> a step (a callable taking no argument); the first is the baseline that heats
        the GPU.
    at_cap:
        Rounds, warm steps and heating time.
    profile:
        ``profile(step, warmup)`` -> (device ms, ops) of one step after ``warmup`` calls.
    synchronize:
        Waits for the device (``torch.cuda.synchronize``), after each heating step, so the
        heating time is the GPU's and not the host's queue.
    sampler, poll_s:
        One clock reading, and the seconds between two (default: ``protocol.device_sampler``,
        none on the CPU).
    clock:
        Seconds, for the heating time (tests pass a fake one).

    Returns
    -------
    Profiles
        Each step's profiles in round order and its clock summary.

    Raises
    ------
    ValueError
        No steps.
    """
    if not steps:
        raise ValueError("profile_rounds: no steps to profile")
    if sampler is None:
        sampler, poll_s = device_sampler(poll_s)
    names = list(steps)
    start = clock()
    while clock() - start < at_cap.heat_s:  # the baseline heats the GPU to its steady state
        steps[names[0]]()
        synchronize()
    out: dict[str, list[tuple[float, dict[str, float]]]] = {n: [] for n in names}
    readings: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for r in range(at_cap.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            if sampler is None:
                out[name].append(profile(steps[name], at_cap.warm_steps))
                continue
            with ClockPoller(sampler, poll_s) as poller:
                out[name].append(profile(steps[name], at_cap.warm_steps))
            readings[name] += poller.readings
    return Profiles(out, {n: summarize_clocks(readings[n]) for n in names})


def add_arguments(p: argparse.ArgumentParser, defaults: AtCap) -> None:
    """``--at-cap``, ``--warm-steps`` and ``--heat-s`` on a benchmark's parser (``--rounds`` is
    ``common.parser``'s); read them back with :func:`from_arguments`."""
    p.add_argument("--at-cap", action="store_true", help="measure at the GPU's steady power state, as the paired "
                   f"ratios run: --rounds rounds (default {defaults.rounds}) of profiles after heating the GPU "
                   "(bench/profile_rounds.py)")
    p.add_argument("--warm-steps", type=int, default=None, help="with --at-cap: steps run right before each "
                   f"profiled one (default {defaults.warm_steps})")
    p.add_argument("--heat-s", type=float, default=None, help="with --at-cap: seconds of baseline steps before "
                   f"the first round (default {defaults.heat_s:g})")


def from_arguments(p: argparse.ArgumentParser, args: argparse.Namespace, defaults: AtCap) -> Optional[AtCap]:
    """The ``AtCap`` the arguments ask for (``defaults`` where one is left out; a few short
    rounds under ``--quick``), None without ``--at-cap``. Exits through ``p.error`` for an
    option of the cap given without ``--at-cap``, ``--samples`` (no profile takes it), or a
    value ``AtCap`` refuses."""
    given = {k: v for k, v in (("rounds", args.rounds), ("warm_steps", args.warm_steps), ("heat_s", args.heat_s))
             if v is not None}
    if getattr(args, "samples", None) is not None:
        p.error("--samples applies to paired timings; a profile takes none: leave it out")
    if not args.at_cap:
        if given:
            p.error(f"{', '.join('--' + k.replace('_', '-') for k in given)}: with --at-cap only; add it or leave "
                    "them out")
        return None
    if getattr(args, "quick", False):  # a smoke run: a few short rounds
        given = {"rounds": 3, "warm_steps": 1, "heat_s": 1.0, **given}
    try:
        return replace(defaults, **given)
    except ValueError as e:
        p.error(str(e))
        raise  # p.error exits; for type checkers


def with_interval(row: dict[str, Any], key: str) -> str:
    """``row[key]`` as "1.234", with " [low, high]" where the row has ``<key>_interval``.

    Example
    -------
    >>> with_interval({"bound": 1.2, "bound_interval": (1.1, 1.3)}, "bound")
    '1.200 [1.100, 1.300]'
    """
    lo_hi = row.get(f"{key}_interval")
    return f"{row[key]:.3f}" + (f" [{lo_hi[0]:.3f}, {lo_hi[1]:.3f}]" if lo_hi else "")


def clock_table(clocks: dict[str, dict[str, float]]) -> str:
    """Each step's SM clock and power (``Profiles.clocks``) as a Markdown table; "" for none."""
    if not clocks:
        return ""

    def spread(c: dict[str, float], key: str) -> str:
        if f"{key}_median" not in c:
            return "-"
        return f"{c[key + '_median']:.0f} [{c[key + '_min']:.0f}, {c[key + '_max']:.0f}]"
    return md_table(["step", "SM MHz median [min, max]", "power W median [min, max]"],
                    [[name, spread(c, "sm_mhz"), spread(c, "power_w")] for name, c in clocks.items()])


def describe(at_cap: Optional[dict[str, Any]], baseline: str) -> str:
    """How a bound's device times were measured (``at_cap``: ``AtCap``'s fields, or None)."""
    if at_cap is None:
        return "device ms of one step, torch.profiler"
    return (f"device ms, torch.profiler, at the power cap: medians of {at_cap['rounds']} rounds after "
            f"{at_cap['heat_s']:g} s of {baseline} steps, each profile after {at_cap['warm_steps']} steps of its own")
