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

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

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
