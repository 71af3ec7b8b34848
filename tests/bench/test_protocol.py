"""bench.protocol: the paired-ratio statistics, on synthetic timings (an injected timer)."""

from __future__ import annotations

import json
import random

import pytest

from bench import common
from bench.protocol import PairedRatio, Protocol, median_interval, paired_ratio


def _noisy_timer(seed: int, base_ms: float, cand_ms: float, drift: float = 0.0):
    """A timer whose baseline calls take ``base_ms`` and candidate calls ``cand_ms``, both scaled
    by a clock that drifts by ``drift`` per call and by 5 % multiplicative noise."""
    rng = random.Random(seed)
    clock = {"t": 1.0}

    def timer(fn, n, flush):
        out = []
        for _ in range(n):
            clock["t"] *= 1 + drift
            out.append((base_ms if fn() == "b" else cand_ms) * clock["t"] * rng.lognormvariate(0, 0.05))
        return out
    return timer


def test_interval_contains_the_true_ratio():
    hits = 0
    for seed in range(40):
        r = paired_ratio(lambda: "b", lambda: "c", Protocol(rounds=10, samples=3, warmup=0),
                         timer=_noisy_timer(seed, 1.25, 1.0), sampler=dict)
        assert r.low <= r.ratio <= r.high
        hits += r.low <= 1.25 <= r.high
    assert hits >= 34  # coverage 97.9 % for 10 rounds: 40 runs miss at most a few times


def test_drifting_clock_cancels_in_the_paired_ratio():
    # the clock slows by 40 % over the run; both sides see it in every round
    r = paired_ratio(lambda: "b", lambda: "c", Protocol(rounds=10, samples=10, warmup=0),
                     timer=_noisy_timer(0, 2.0, 1.0, drift=0.002), sampler=dict)
    assert r.low <= 2.0 <= r.high
    assert abs(r.ratio - 2.0) < 0.1


def test_rounds_alternate_which_side_runs_first():
    calls = []

    def timer(fn, n, flush):
        return [fn() for _ in range(n)]

    def side(name, ms):
        def fn():
            calls.append(name)
            return ms
        return fn

    r = paired_ratio(side("A", 2.0), side("B", 1.0), Protocol(rounds=4, samples=2, warmup=1), timer=timer,
                     sampler=dict)
    assert calls == ["A", "B"] + ["A", "A", "B", "B"] + ["B", "B", "A", "A"] + ["A", "A", "B", "B"] + ["B", "B", "A", "A"]
    assert r.rounds == ((2.0, 1.0),) * 4 and r.ratio == 2.0


def test_flush_flag_reaches_the_timer():
    seen = []

    def timer(fn, n, flush):
        seen.append(flush)
        return [1.0] * n

    paired_ratio(lambda: None, lambda: None, Protocol(rounds=2, samples=1, flush_l2=False), timer=timer, sampler=dict)
    assert seen == [False] * 4


def test_ratio_is_median_of_round_ratios_not_ratio_of_medians():
    # timer results in call order; round 1 runs the candidate first
    rounds = iter([10.0, 10.0, 1.0, 0.5, 3.0, 1.0])

    def timer(fn, n, flush):
        return [next(rounds)]

    r = paired_ratio(lambda: None, lambda: None, Protocol(rounds=3, samples=1, warmup=0), timer=timer, sampler=dict)
    assert r.rounds == ((10.0, 10.0), (0.5, 1.0), (3.0, 1.0))
    assert r.ratio == 1.0  # ratios 1, 0.5, 3
    assert r.baseline_ms == 3.0 and r.candidate_ms == 1.0  # 3 / 1 would have said 3x


def test_median_interval_order_statistics():
    xs = [float(i) for i in range(1, 11)]
    low, high, cov = median_interval(xs)
    assert (low, high) == (2.0, 9.0) and cov == pytest.approx(1 - 2 * 11 / 1024)
    low, high, cov = median_interval(xs[:5])  # too few for 95 %: the whole range, coverage stated
    assert (low, high) == (1.0, 5.0) and cov == pytest.approx(1 - 2 / 32)
    for n in range(6, 40):
        assert median_interval([float(i) for i in range(n)])[2] >= 0.95
    with pytest.raises(ValueError, match="no values"):
        median_interval([])


def test_clocks_summarised_and_as_dict_json_able():
    readings = iter([{"sm_mhz": 1980.0, "power_w": 500.0}, {"sm_mhz": 1700.0, "power_w": 700.0},
                     {"sm_mhz": 1800.0, "power_w": 690.0}])
    r = paired_ratio(lambda: None, lambda: None, Protocol(rounds=2, samples=1, warmup=0),
                     timer=lambda fn, n, f: [1.0] * n, sampler=lambda: next(readings))
    assert r.clocks == {"power_w_min": 500.0, "power_w_median": 690.0, "power_w_max": 700.0,
                        "sm_mhz_min": 1700.0, "sm_mhz_median": 1800.0, "sm_mhz_max": 1980.0}
    d = json.loads(json.dumps(r.as_dict()))
    assert d["ratio"] == 1.0 and d["rounds"] == [[1.0, 1.0], [1.0, 1.0]] and d["clocks"]["sm_mhz_max"] == 1980.0
    assert isinstance(r, PairedRatio)


def test_cpu_path_times_real_calls(monkeypatch):
    monkeypatch.setattr(common, "DEVICE", "cpu")
    r = paired_ratio(lambda: sum(range(20000)), lambda: None, Protocol(rounds=2, samples=2, warmup=1))
    assert r.ratio > 1 and r.clocks == {}


def test_bad_protocol_and_broken_timer_are_refused():
    with pytest.raises(ValueError, match="rounds"):
        Protocol(rounds=0)
    assert Protocol().reportable and not Protocol(rounds=3).reportable
    with pytest.raises(ValueError, match="timer is broken"):
        paired_ratio(lambda: None, lambda: None, Protocol(rounds=1, samples=1, warmup=0),
                     timer=lambda fn, n, f: [0.0] * n, sampler=dict)


def test_docstring_examples_run():
    import doctest

    from bench import protocol
    result = doctest.testmod(protocol, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
