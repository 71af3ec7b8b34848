"""bench.protocol: the paired-ratio statistics, on synthetic timings (an injected timer)."""

from __future__ import annotations

import itertools
import json
import random
import time

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
    from bench.protocol import summarize_clocks
    assert summarize_clocks([{"sm_mhz": 1980.0, "power_w": 500.0}, {"sm_mhz": 1700.0, "power_w": 700.0},
                       {"sm_mhz": 1800.0, "power_w": 690.0}, {}]) == {
        "power_w_min": 500.0, "power_w_median": 690.0, "power_w_max": 700.0,
        "sm_mhz_min": 1700.0, "sm_mhz_median": 1800.0, "sm_mhz_max": 1980.0}
    readings = itertools.cycle([{"sm_mhz": 1980.0}, {"sm_mhz": 1700.0}])
    r = paired_ratio(lambda: time.sleep(0.01) or 1.0, lambda: time.sleep(0.01) or 1.0,
                     Protocol(rounds=2, samples=2, warmup=0), timer=lambda fn, n, f: [fn() for _ in range(n)],
                     sampler=lambda: next(readings), poll_s=0.002)
    assert r.clocks["sm_mhz_min"] == 1700.0 and r.clocks["sm_mhz_max"] == 1980.0
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


def test_clocks_are_read_while_the_timed_calls_run():
    busy = {"on": False}
    seen: list[bool] = []

    def side():  # one timed call: 10 ms of "GPU work"
        busy["on"] = True
        time.sleep(0.01)
        busy["on"] = False
        return 1.0

    def sampler():
        seen.append(busy["on"])
        return {"sm_mhz": 1500.0 + 400.0 * busy["on"]}

    r = paired_ratio(side, side, Protocol(rounds=3, samples=4, warmup=1),
                     timer=lambda fn, n, f: [fn() for _ in range(n)], sampler=sampler, poll_s=0.002)
    assert sum(seen) >= 2 * 3  # readings taken during each side's calls of every round ...
    assert r.clocks["sm_mhz_max"] == 1900.0  # ... and reported: the clock under load, not at rest
    n = len(seen)
    time.sleep(0.02)
    assert len(seen) == n  # no reading once the timing is over


def test_a_broken_sampler_is_an_error_naming_it():
    def sampler():
        raise RuntimeError("NVML gone")
    with pytest.raises(RuntimeError, match="clock sampler failed.*NVML gone"):
        paired_ratio(lambda: None, lambda: None, Protocol(rounds=1, samples=1, warmup=0),
                     timer=lambda fn, n, f: [1.0] * n, sampler=sampler)


def test_gpu_clocks_name_the_device_by_its_uuid(monkeypatch):
    from bench import protocol
    import types
    monkeypatch.setattr(common, "DEVICE", "cuda")
    monkeypatch.setattr(protocol.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(protocol, "_nvml_reading", lambda: None)  # NVML not there: nvidia-smi
    monkeypatch.setattr(protocol.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(protocol.torch.cuda, "get_device_properties",
                        lambda d: types.SimpleNamespace(uuid="5f3c-77", pci_domain_id=0, pci_bus_id=0x1b, pci_device_id=0))
    monkeypatch.setattr(protocol.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    calls = []

    def run(cmd, **k):
        calls.append(cmd)
        return types.SimpleNamespace(stdout="1980, 1980, 650.5, 700.00, [N/A]\n")
    monkeypatch.setattr(protocol.subprocess, "run", run)
    assert protocol.gpu_clocks() == {"sm_mhz": 1980.0, "sm_max_mhz": 1980.0, "power_w": 650.5, "power_limit_w": 700.0}
    assert calls[0][-2:] == ["-i", "GPU-5f3c-77"]  # the board torch uses, whatever CUDA_VISIBLE_DEVICES says
