"""The one measurement protocol behind every ratio a benchmark reports.

A ratio is paired: the baseline and the candidate are timed in alternating rounds (A, B then
B, A, ...), ``samples`` calls per side per round, each call timed on its own (CUDA events on
the GPU, the L2 flushed before each call as ``triton.testing.do_bench`` does; ``perf_counter``
on the CPU smoke path). Each round gives one ratio, baseline round median / candidate round
median; the reported ratio is the median of those per-round ratios, with a distribution-free
confidence interval from order statistics. The GPU's SM clock and power draw are sampled by a
background thread while the timed calls run (NVML through ``torch.cuda.clock_rate`` /
``power_draw``, else ``nvidia-smi`` on the board torch uses) and reported beside the ratio
(min / median / max), so a run throttled by the power cap is visible.

Example (with a fake timer: every baseline call 2 ms, every candidate call 1 ms)::

    >>> from bench.protocol import Protocol, paired_ratio
    >>> fake = lambda fn, n, flush: [fn() for _ in range(n)]
    >>> r = paired_ratio(lambda: 2.0, lambda: 1.0, Protocol(), timer=fake)
    >>> r.ratio, r.low, r.high
    (2.0, 2.0, 2.0)
"""

from __future__ import annotations

import math
import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from bench import common

#: ``timer(fn, n, flush_l2)``: milliseconds of each of ``n`` calls of ``fn``, in call order
Timer = Callable[[Callable[[], Any], int, bool], list[float]]
#: ``sampler()``: one reading of the GPU's clocks (``gpu_clocks``); ``{}`` when there is none
Sampler = Callable[[], dict[str, float]]
#: confidence level of the interval around the median ratio
LEVEL = 0.95
#: seconds between two clock readings while a side's timed calls run (NVML: a cheap call)
POLL_S = 0.05
#: ... when the readings come from nvidia-smi (a process each: fewer, not to load the host)
SMI_POLL_S = 0.5


@dataclass(frozen=True)
class Protocol:
    """How a paired ratio is measured.

    Parameters
    ----------
    rounds:
        A/B rounds; the ratio is the median of one ratio per round. A reported figure uses
        at least 10 (``reportable``): fewer rounds cannot give a 95 % interval.
    samples:
        Timed calls per side per round; the side's round time is their median (>= 10 for a
        reported figure).
    warmup:
        Untimed calls of each side before the first round (compilation, caches, autotuning).
    flush_l2:
        Clear the GPU's L2 before each timed call (as ``do_bench`` does), so no call finds
        the previous call's operands cached.

    Raises
    ------
    ValueError
        ``rounds`` or ``samples`` below 1 or ``warmup`` below 0.

    Example
    -------
    >>> Protocol(rounds=3, samples=2).reportable
    False
    """

    rounds: int = 10
    samples: int = 10
    warmup: int = 3
    flush_l2: bool = True

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.samples < 1 or self.warmup < 0:
            raise ValueError(f"Protocol: rounds ({self.rounds}) and samples ({self.samples}) must be >= 1 "
                             f"and warmup ({self.warmup}) >= 0")

    @property
    def reportable(self) -> bool:
        """Whether figures measured with it may be reported (>= 10 rounds and samples)."""
        return self.rounds >= 10 and self.samples >= 10


@dataclass(frozen=True)
class PairedRatio:
    """One paired measurement of a candidate against a baseline.

    Attributes
    ----------
    ratio:
        Median over rounds of (baseline ms / candidate ms); above 1 the candidate is faster.
    low, high:
        Distribution-free confidence interval of that median (order statistics of the per-round
        ratios; coverage ``median_interval`` gives, >= 95 % from 6 rounds on).
    baseline_ms, candidate_ms:
        Medians over rounds of each side's round median.
    rounds:
        Per round, (baseline ms, candidate ms): the round medians.
    clocks:
        SM clock MHz and power W sampled while the timed calls ran: ``sm_mhz_min`` / ``_median`` /
        ``_max``, ``power_w_min`` / ... (empty without a GPU).
    """

    ratio: float
    low: float
    high: float
    baseline_ms: float
    candidate_ms: float
    rounds: tuple[tuple[float, float], ...]
    clocks: dict[str, float] = field(default_factory=dict)

    @property
    def coverage(self) -> float:
        """Coverage probability of ``(low, high)`` for ``len(rounds)`` rounds."""
        return median_interval([r[0] / r[1] for r in self.rounds])[2]

    def as_dict(self) -> dict[str, Any]:
        """JSON-able fields (rounds as lists), plus the interval's ``coverage``.

        Example
        -------
        >>> import json
        >>> r = PairedRatio(1.0, 0.9, 1.1, 2.0, 2.0, ((2.0, 2.0),), {})
        >>> json.loads(json.dumps(r.as_dict()))["rounds"]
        [[2.0, 2.0]]
        """
        return {"ratio": self.ratio, "low": self.low, "high": self.high, "coverage": self.coverage,
                "baseline_ms": self.baseline_ms, "candidate_ms": self.candidate_ms,
                "rounds": [[float(b), float(c)] for b, c in self.rounds],
                "clocks": {k: float(v) for k, v in self.clocks.items()}}


def _binom_cdf_half(k: int, n: int) -> float:
    """P(X <= k) for X ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(0, k + 1)) / 2.0 ** n if k >= 0 else 0.0


def median_interval(values: list[float], level: float = LEVEL) -> tuple[float, float, float]:
    """(low, high, coverage): the order-statistic confidence interval of the median of ``values``.

    With the values sorted, x(1) <= ... <= x(n), the interval [x(j), x(n+1-j)] contains the true
    median with probability 1 - 2 P(B <= j-1), B ~ Binomial(n, 1/2), whatever the distribution
    (continuous, independent samples). ``j`` is the largest rank whose coverage is still
    >= ``level``; with fewer than 6 values no rank reaches 95 %, so the interval is [min, max]
    with its smaller coverage, which is returned (10 values: [x(2), x(9)], 97.9 %).

    Raises
    ------
    ValueError
        ``values`` empty.

    Example
    -------
    >>> median_interval([float(i) for i in range(1, 11)])[:2]
    (2.0, 9.0)
    """
    n = len(values)
    if n == 0:
        raise ValueError("median_interval: no values (a paired ratio needs at least one round)")
    xs = sorted(values)
    j = 1
    while j + 1 <= (n + 1) // 2 and 1 - 2 * _binom_cdf_half(j, n) >= level:
        j += 1
    return xs[j - 1], xs[n - j], 1 - 2 * _binom_cdf_half(j - 1, n)


_L2_FLUSH: dict[str, torch.Tensor] = {}  # one 256 MB buffer per device, cleared before each call


def time_calls(fn: Callable[[], Any], n: int, flush_l2: bool) -> list[float]:
    """Milliseconds of each of ``n`` calls of ``fn``: CUDA events around each call (the L2
    flushed before it when ``flush_l2``) with ``common.DEVICE == "cuda"``; ``perf_counter`` on
    the CPU."""
    if common.DEVICE == "cpu":
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    cache = _L2_FLUSH.get(common.DEVICE)
    if cache is None and flush_l2:  # larger than any L2 (H200: 60 MB), as do_bench's
        cache = _L2_FLUSH[common.DEVICE] = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device=common.DEVICE)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    torch.cuda.synchronize()
    for start, end in events:
        if flush_l2:
            cache.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def _nvml_reading() -> Optional[dict[str, float]]:
    """SM clock (MHz), power draw (W) and temperature (C) of torch's current device through NVML
    (``torch.cuda.clock_rate`` / ``power_draw`` / ``temperature``: they map the device through
    CUDA_VISIBLE_DEVICES); None when torch lacks them or pynvml is missing."""
    if not all(hasattr(torch.cuda, f) for f in ("clock_rate", "power_draw", "temperature")):
        return None
    try:
        return {"sm_mhz": float(torch.cuda.clock_rate()), "power_w": torch.cuda.power_draw() / 1000.0,
                "temp_c": float(torch.cuda.temperature())}
    except Exception:  # noqa: BLE001 - pynvml missing or a reading NVML lacks: nvidia-smi instead
        return None


def smi_device() -> str:
    """``nvidia-smi -i``'s name of torch's current device: its UUID (the index nvidia-smi counts
    ignores CUDA_VISIBLE_DEVICES), else its PCI bus id."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    uuid = str(getattr(props, "uuid", "") or "")
    if uuid:
        return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
    return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"


def gpu_clocks() -> dict[str, float]:
    """One reading of the GPU torch uses: SM clock (MHz), power draw (W) and temperature (C)
    through NVML (``_nvml_reading``), else from ``nvidia-smi`` (also the maximum SM clock and
    the power limit); ``{}`` without a GPU or without either."""
    if common.DEVICE == "cpu" or not torch.cuda.is_available():
        return {}
    reading = _nvml_reading()
    if reading is not None:
        return reading
    if shutil.which("nvidia-smi") is None:
        return {}
    keys = ("sm_mhz", "sm_max_mhz", "power_w", "power_limit_w", "temp_c")
    query = "clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits",
                              "-i", smi_device()], capture_output=True, text=True, timeout=10).stdout
        fields = [v.strip() for v in out.strip().splitlines()[0].split(",")]
    except (OSError, subprocess.SubprocessError, IndexError):
        return {}
    reading = {}
    for k, v in zip(keys, fields):
        try:
            reading[k] = float(v)
        except ValueError:  # "[N/A]" on some boards: leave the key out
            pass
    return reading


class ClockPoller:
    """Reads ``sampler`` in a background thread while its ``with`` block runs (a side's timed
    calls: the GPU busy): one reading at once, then one every ``interval_s``. Non-empty readings
    collect in ``readings``; a sampler that raises makes the block's exit raise, naming it.

    Example
    -------
    >>> poller = ClockPoller(lambda: {"sm_mhz": 1980.0}, interval_s=0.001)
    >>> with poller:
    ...     time.sleep(0.01)
    >>> poller.readings[0]
    {'sm_mhz': 1980.0}
    """

    def __init__(self, sampler: Sampler, interval_s: float = POLL_S) -> None:
        self.sampler, self.interval_s = sampler, interval_s
        self.readings: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None

    def _run(self) -> None:
        while True:
            try:
                reading = self.sampler()
            except Exception as e:  # noqa: BLE001 - re-raised in the timing thread at the block's exit
                self._error = e
                return
            if reading:
                self.readings.append(reading)
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> "ClockPoller":
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="bench-clock-poller", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._error is not None and exc[0] is None:
            raise RuntimeError(f"ClockPoller: the clock sampler failed: {type(self._error).__name__}: "
                               f"{self._error}") from self._error


def summarize_clocks(readings: list[dict[str, float]]) -> dict[str, float]:
    """min / median / max of each key of ``readings`` (``ClockPoller.readings``).

    Returns
    -------
    dict[str, float]
        ``<key>_min``, ``<key>_median``, ``<key>_max`` for every key a reading has (``sm_mhz``,
        ``power_w``, ...); empty for no readings.
    """
    out: dict[str, float] = {}
    for k in sorted({k for r in readings for k in r}):
        vs = [r[k] for r in readings if k in r]
        out.update({f"{k}_min": min(vs), f"{k}_median": statistics.median(vs), f"{k}_max": max(vs)})
    return out


def clock_spread(clocks: dict[str, float], key: str, missing: str = "") -> str:
    """``key``'s "median [min, max]" from a :func:`summarize_clocks` summary, or ``missing``.

    Example
    -------
    >>> clock_spread({"sm_mhz_min": 1155.0, "sm_mhz_median": 1425.0, "sm_mhz_max": 1815.0}, "sm_mhz")
    '1425 [1155, 1815]'
    """
    if f"{key}_median" not in clocks:
        return missing
    return f"{clocks[key + '_median']:.0f} [{clocks[key + '_min']:.0f}, {clocks[key + '_max']:.0f}]"


def device_sampler(poll_s: float = POLL_S) -> tuple[Optional[Sampler], float]:
    """The clock sampler of this process's device and the seconds between its readings.

    Returns
    -------
    tuple
        (``gpu_clocks``, ``poll_s``) on a GPU; ``poll_s`` raised to ``SMI_POLL_S`` where the
        readings come from nvidia-smi (a process each); (None, ``poll_s``) on the CPU.
    """
    if common.DEVICE == "cpu":
        return None, poll_s
    if _nvml_reading() is None:  # nvidia-smi it is (or nothing)
        return gpu_clocks, max(poll_s, SMI_POLL_S)
    return gpu_clocks, poll_s


def paired_ratio(baseline: Callable[[], Any], candidate: Callable[[], Any],
                 protocol: Protocol = Protocol(), *, timer: Optional[Timer] = None,
                 sampler: Optional[Sampler] = None, poll_s: float = POLL_S) -> PairedRatio:
    """Time ``candidate`` against ``baseline`` with ``protocol``.

    Each side is called ``warmup`` times (baseline first), then ``rounds`` rounds run; in even
    rounds the baseline's ``samples`` calls come first, in odd rounds the candidate's, so neither
    side always follows the other (a cache or clock state one side leaves behind lands on both).
    The GPU's clocks are read while each side's timed calls run (``ClockPoller``, every
    ``poll_s`` seconds), not between rounds, when the GPU idles.

    Parameters
    ----------
    baseline, candidate:
        Callables taking no argument (one step / one GEMM each).
    protocol:
        Rounds, samples, warm-up and L2 flushing.
    timer:
        ``timer(fn, n, flush_l2)`` -> ms of each call; default ``time_calls`` (CUDA events, or
        ``perf_counter`` on the CPU). Tests inject synthetic timings here.
    sampler:
        One clock reading (default ``gpu_clocks``; none on the CPU smoke path).
    poll_s:
        Seconds between two readings while the calls run.

    Returns
    -------
    PairedRatio
        Median ratio, its interval, each side's median ms, the round medians and the clocks.

    Example
    -------
    >>> fake = lambda fn, n, flush: [fn() for _ in range(n)]
    >>> paired_ratio(lambda: 3.0, lambda: 2.0, Protocol(rounds=2, samples=1), timer=fake).ratio
    1.5
    """
    timer = timer or time_calls
    if sampler is None:
        sampler, poll_s = device_sampler(poll_s)
    for _ in range(protocol.warmup):
        baseline()
    for _ in range(protocol.warmup):
        candidate()
    readings: list[dict[str, float]] = []
    rounds: list[tuple[float, float]] = []
    for i in range(protocol.rounds):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        med: dict[int, float] = {}
        for side in order:
            fn = (baseline, candidate)[side]
            if sampler is None:
                times = timer(fn, protocol.samples, protocol.flush_l2)
            else:
                with ClockPoller(sampler, poll_s) as poller:
                    times = timer(fn, protocol.samples, protocol.flush_l2)
                readings += poller.readings
            med[side] = statistics.median(times)
        rounds.append((med[0], med[1]))
    for b, c in rounds:
        if not (b > 0 and c > 0 and math.isfinite(b) and math.isfinite(c)):
            raise ValueError(f"paired_ratio: a round's time is not a positive finite ms (baseline {b}, "
                             f"candidate {c}); the timer is broken")
    ratios = [b / c for b, c in rounds]
    low, high, _ = median_interval(ratios)
    return PairedRatio(ratio=statistics.median(ratios), low=low, high=high,
                       baseline_ms=statistics.median(b for b, _ in rounds),
                       candidate_ms=statistics.median(c for _, c in rounds),
                       rounds=tuple(rounds), clocks=summarize_clocks(readings))
