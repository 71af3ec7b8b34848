"""Device-time profiles of several steps at the GPU's steady power state, in rounds.

A bound built from one profile per step, each after two warm-up steps, measures every step as
the GPU runs it fresh. The paired ratios it is compared with run for seconds on end, where an
H100 sits at its power cap and a BF16 GEMM slows (its operands draw more power than FP8's):
the two are measured in different regimes. Here the GPU is first heated by running the first
step (the baseline) for ``heat_s`` seconds; then each round profiles every step once, each
right after ``warm_s`` seconds of its own calls (the GPU idles while the host processes the
previous profile, so each profile re-heats first), the steps' order reversed every other round
so neither always follows the other (as ``protocol.paired_ratio`` alternates its sides). The
GPU's SM clock, power and temperature are read while each step's warm-up runs, the GPU busy
(never during a profile's processing on the host, when it idles). Each ratio a round gives is
then summarized by :func:`median_of_rounds`.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Optional

import torch

from bench import common
from bench.common import md_table
from bench.protocol import (POLL_S, ClockPoller, Protocol, Sampler, clock_spread, device_sampler, median_interval,
                            summarize_clocks)

#: ``profile(step, warmup)``: (device ms of one step after ``warmup`` calls, op name -> self
#: device ms), as ``bound_moe._profile``
Profiler = Callable[[Callable[[], Any], int], tuple[float, dict[str, float]]]
#: rounds from which a figure may be reported (``protocol.Protocol``'s rounds: 10 give the
#: median's interval from the 2nd to the 9th order statistic, 97.9 % coverage)
REPORTABLE_ROUNDS = Protocol.rounds


@dataclass(frozen=True)
class AtCap:
    """How steps are profiled at the GPU's steady power state.

    Parameters
    ----------
    rounds:
        Profiles of each step, one a round (``REPORTABLE_ROUNDS``, 10: the protocol's count;
        fewer give a smoke run's figures, and under 6 no order-statistic interval of the
        median reaches 95 % coverage).
    warm_s:
        Seconds of a step's own calls right before its profiled one (at least one call), so
        the GPU runs that step's kernels at the clock they settle to.
    heat_s:
        Seconds the first step (the baseline) runs before the first round.

    Raises
    ------
    ValueError
        ``rounds`` < 1, ``warm_s`` or ``heat_s`` < 0, naming the option (``--rounds``, ...).
    """

    rounds: int = REPORTABLE_ROUNDS
    warm_s: float = 1.0
    heat_s: float = 15.0

    def __post_init__(self) -> None:
        for name, low in (("rounds", 1), ("warm_s", 0), ("heat_s", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(self, name)}")

    @property
    def reportable(self) -> bool:
        """Whether figures measured so may be reported (>= ``REPORTABLE_ROUNDS`` rounds)."""
        return self.rounds >= REPORTABLE_ROUNDS

    def record(self) -> dict[str, Any]:
        """Its fields and ``reportable``, for a results JSON."""
        return {**asdict(self), "reportable": self.reportable}


@dataclass(frozen=True)
class Profiles:
    """Each step's profiles, by the name given to :func:`profile_rounds`.

    Parameters
    ----------
    rounds:
        Name -> one (device ms, op name -> self device ms) a round, in round order.
    clocks:
        Name -> the SM clock / power / temperature readings taken while its warm-ups ran,
        summarized (``protocol.summarize_clocks``); empty without a sampler.
    """

    rounds: dict[str, list[tuple[float, dict[str, float]]]]
    clocks: dict[str, dict[str, float]]


def _device_synchronize() -> None:
    """Wait for the device (``torch.cuda.synchronize``) when the benchmarks run on CUDA."""
    if common.DEVICE == "cuda":
        torch.cuda.synchronize()


def _run_for(step: Callable[[], Any], seconds: float, synchronize: Callable[[], None],
             clock: Callable[[], float]) -> None:
    """``step`` called (each call synchronized, so the time is the GPU's, not the host's queue)
    until ``seconds`` have passed, at least once."""
    start = clock()
    while True:
        step()
        synchronize()
        if clock() - start >= seconds:
            return


def profile_rounds(steps: dict[str, Callable[[], Any]], at_cap: AtCap, profile: Profiler, *,
                   synchronize: Callable[[], None] = _device_synchronize, sampler: Optional[Sampler] = None,
                   poll_s: float = POLL_S, clock: Callable[[], float] = time.perf_counter) -> Profiles:
    """Profile every step of ``steps`` ``at_cap.rounds`` times at the GPU's steady power state
    (module docstring).

    Parameters
    ----------
    steps:
        Name -> a step (a callable taking no argument); the first is the baseline that heats
        the GPU. A step with a ``release()`` method (``bench.moe_layer.Step``) has it called
        after its profile, so the steps' gradients are not all held at once.
    at_cap:
        Rounds, warm-up and heating time.
    profile:
        ``profile(step, warmup)`` -> (device ms, ops) of one step; called with ``warmup`` 0,
        the warm-up being this function's.
    synchronize:
        Waits for the device (default: ``torch.cuda.synchronize`` on CUDA, nothing on the CPU).
    sampler, poll_s:
        One clock reading, and the seconds between two (default: ``protocol.device_sampler``,
        none on the CPU).
    clock:
        Seconds, for the heating and warm-up times (tests pass a fake one).

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
    if at_cap.heat_s > 0:  # the baseline heats the GPU to its steady state
        _run_for(steps[names[0]], at_cap.heat_s, synchronize, clock)
    out: dict[str, list[tuple[float, dict[str, float]]]] = {n: [] for n in names}
    readings: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for r in range(at_cap.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            step = steps[name]
            if sampler is None:
                _run_for(step, at_cap.warm_s, synchronize, clock)
            else:
                start = clock()
                step()  # enqueued, not waited for: the poller's first reading finds the GPU running it
                with ClockPoller(sampler, poll_s) as poller:  # read only while this step's kernels run
                    _run_for(step, at_cap.warm_s - (clock() - start), synchronize, clock)
                readings[name] += poller.readings
            out[name].append(profile(step, 0))
            release = getattr(step, "release", None)
            if release is not None:
                release()
    return Profiles(out, {n: summarize_clocks(readings[n]) for n in names})


def median_of_rounds(key: str, values: list[float]) -> dict[str, Any]:
    """One ratio measured once a round, summarized: ``key`` (the median of the rounds),
    ``<key>_interval`` (its order-statistic interval), ``<key>_coverage`` (that interval's
    coverage: below 0.95 under 6 rounds) and ``<key>_rounds`` (the values).

    Raises
    ------
    ValueError
        No values.

    Example
    -------
    >>> median_of_rounds("bound", [1.0, 3.0, 2.0])["bound"], median_of_rounds("bound", [1.0, 3.0, 2.0])["bound_interval"]
    (2.0, (1.0, 3.0))
    """
    lo, hi, coverage = median_interval(values)
    return {key: statistics.median(values), f"{key}_interval": (lo, hi), f"{key}_coverage": coverage,
            f"{key}_rounds": list(values)}


def add_arguments(p: argparse.ArgumentParser, defaults: AtCap) -> None:
    """``--at-cap``, ``--warm-s`` and ``--heat-s`` on a benchmark's parser (``--rounds`` is
    ``common.parser``'s); read them back with :func:`from_arguments`.

    Parameters
    ----------
    p:
        The benchmark's parser (``common.parser``: it has ``--rounds``, ``--samples``, ``--quick``).
    defaults:
        The benchmark's ``AtCap``, named in the help.
    """
    p.add_argument("--at-cap", action="store_true", help="measure at the GPU's steady power state, as the paired "
                   f"ratios run: --rounds rounds (default {defaults.rounds}) of profiles after heating the GPU "
                   "(bench/profile_rounds.py)")
    p.add_argument("--warm-s", type=float, default=None, help="with --at-cap: seconds of a step's own calls right "
                   f"before its profiled one (default {defaults.warm_s:g})")
    p.add_argument("--heat-s", type=float, default=None, help="with --at-cap: seconds of baseline steps before "
                   f"the first round (default {defaults.heat_s:g})")


#: ``--quick --at-cap``: a smoke run's few short rounds (its figures are not reportable)
QUICK = {"rounds": 3, "warm_s": 0.2, "heat_s": 1.0}


def from_arguments(p: argparse.ArgumentParser, args: argparse.Namespace, defaults: AtCap) -> Optional[AtCap]:
    """The ``AtCap`` the arguments ask for.

    Parameters
    ----------
    p, args:
        The parser given to :func:`add_arguments` and what it parsed.
    defaults:
        The benchmark's ``AtCap``: an option left out takes its value (``QUICK``'s under
        ``--quick``; an option given wins over both).

    Returns
    -------
    AtCap or None
        None without ``--at-cap``.

    Raises
    ------
    SystemExit
        Through ``p.error``: ``--rounds`` / ``--warm-s`` / ``--heat-s`` without ``--at-cap``,
        ``--samples`` (no profile takes it), or a value ``AtCap`` refuses, each named.
    """
    given = {k: v for k, v in (("rounds", args.rounds), ("warm_s", args.warm_s), ("heat_s", args.heat_s))
             if v is not None}
    if getattr(args, "samples", None) is not None:
        p.error("--samples applies to paired timings; a profile takes none: leave it out")
    if not args.at_cap:
        if given:
            p.error(f"{', '.join('--' + k.replace('_', '-') for k in given)}: with --at-cap only; add it or leave "
                    "them out")
        return None
    if getattr(args, "quick", False):
        given = {**QUICK, **given}
    try:
        return replace(defaults, **given)
    except ValueError as e:
        p.error(str(e))
        raise  # p.error exits; for type checkers


def with_interval(row: dict[str, Any], key: str) -> str:
    """``row[key]`` as text, with " [low, high]" where the row has ``<key>_interval``, and the
    interval's coverage where it is below 95 % (too few rounds).

    Parameters
    ----------
    row:
        A bound row (``bound_mlp.bound_rows`` / ``bound_moe.bound_rows``).
    key:
        One of its ratios (``bound``, ``measured``, ...).

    Returns
    -------
    str

    Example
    -------
    >>> with_interval({"bound": 1.2, "bound_interval": (1.1, 1.3), "bound_coverage": 0.75}, "bound")
    '1.200 [1.100, 1.300] (75 %)'
    """
    lo_hi = row.get(f"{key}_interval")
    text = f"{row[key]:.3f}" + (f" [{lo_hi[0]:.3f}, {lo_hi[1]:.3f}]" if lo_hi else "")
    coverage = row.get(f"{key}_coverage")
    return text + (f" ({coverage * 100:.0f} %)" if coverage is not None and coverage < 0.95 else "")


def clock_table(clocks: dict[str, dict[str, float]]) -> str:
    """Each step's SM clock, power and temperature (``Profiles.clocks``) as a Markdown table.

    Parameters
    ----------
    clocks:
        Step name -> its clock summary (``protocol.summarize_clocks``).

    Returns
    -------
    str
        The table; "" for no steps.
    """
    if not clocks:
        return ""
    spread = functools.partial(clock_spread, missing="-")
    return md_table(["step", "SM MHz median [min, max]", "power W median [min, max]", "temperature C median [min, max]"],
                    [[name, spread(c, "sm_mhz"), spread(c, "power_w"), spread(c, "temp_c")]
                     for name, c in clocks.items()])


def describe(at_cap: Optional[dict[str, Any]], baseline: str) -> str:
    """How a bound's device times were measured, for its table's header.

    Parameters
    ----------
    at_cap:
        ``AtCap``'s fields, or None (one profile a step).
    baseline:
        The step that heated the GPU.

    Returns
    -------
    str
    """
    if at_cap is None:
        return "device ms of one step, torch.profiler"
    smoke = "" if at_cap.get("reportable", True) else f"; under {REPORTABLE_ROUNDS} rounds: not reportable"
    return (f"device ms, torch.profiler, at the power cap: {at_cap['rounds']} rounds after {at_cap['heat_s']:g} s "
            f"of {baseline} steps, each profile after {at_cap['warm_s']:g} s of its own step; the ms columns are "
            f"medians of the rounds' times, each ratio the median of the rounds' ratios with its interval{smoke}")
