"""bench.profile_rounds: the GPU heated by the baseline, every step profiled once a round after
its own warm steps, the order reversed every other round, clocks read per step; and
bound_mlp's bound taken per round at the power cap (median and interval of the rounds)."""

import time

import pytest

from bench import bench_mlp, bound_mlp, bound_moe, common
from bench import profile_rounds as bench_profile_rounds
from bench.profile_rounds import AtCap, profile_rounds


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_heats_with_the_baseline_then_profiles_each_step_once_a_round_in_alternating_order(monkeypatch):
    monkeypatch.setattr(common, "DEVICE", "cpu")  # no clock sampler
    clock, calls, log, syncs = FakeClock(), [], [], []

    def step(name):
        def run():
            calls.append(name)
            clock.t += 0.5  # each step takes half a second of the fake clock
        return run

    def profile(s, warmup):
        assert warmup == 0  # the warm-up is profile_rounds' own
        s()
        log.append(calls[-1])
        return float(len(log)), {"aten::mm": 1.0}

    got = profile_rounds({"base": step("base"), "a": step("a"), "b": step("b")}, AtCap(rounds=3, warm_s=1.0, heat_s=2.0),
                         profile, synchronize=lambda: syncs.append(1), clock=clock)
    assert calls[:4] == ["base"] * 4  # 2 s of heating at 0.5 s a step
    assert calls[4:7] == ["base"] * 3  # 1 s of its own calls, then the profiled one
    assert log == ["base", "a", "b", "b", "a", "base", "base", "a", "b"]  # reversed every other round
    assert len(syncs) == 4 + 9 * 2  # every heating and warm-up call synchronized, not the profiled ones
    assert {k: [ms for ms, _ in v] for k, v in got.rounds.items()} == {"base": [1.0, 6.0, 7.0], "a": [2.0, 5.0, 8.0],
                                                                        "b": [3.0, 4.0, 9.0]}
    assert got.clocks == {"base": {}, "a": {}, "b": {}}  # no sampler on the CPU


def test_a_step_warms_at_least_once_and_is_released_after_its_profile(monkeypatch):
    monkeypatch.setattr(common, "DEVICE", "cpu")  # no clock sampler
    events = []

    class Step:
        def __call__(self):
            events.append("call")

        def release(self):
            events.append("release")
    profile_rounds({"base": Step()}, AtCap(rounds=2, warm_s=0.0, heat_s=0.0),
                   lambda s, w: (s(), (1.0, {}))[1], synchronize=lambda: None)
    assert events == ["call", "call", "release"] * 2


def test_clocks_are_read_during_the_warm_up_only():
    readings, busy = iter(range(1000, 100000)), {"warm": False}

    def sampler():
        return {"sm_mhz": float(next(readings))} if busy["warm"] else {"idle": 1.0}

    def step():
        busy["warm"] = True
        time.sleep(0.003)

    def profile(s, w):
        busy["warm"] = False  # a profile and its processing: the poller must be off by now
        time.sleep(0.01)
        return 1.0, {}
    got = profile_rounds({"base": step, "a": step}, AtCap(rounds=2, warm_s=0.02, heat_s=0),
                         profile, synchronize=lambda: None, sampler=sampler, poll_s=0.001)
    for name in ("base", "a"):
        c = got.clocks[name]
        assert 1000 <= c["sm_mhz_min"] <= c["sm_mhz_median"] <= c["sm_mhz_max"]
        assert "idle_min" not in c  # no reading while a profile is processed


@pytest.mark.parametrize("kw, name", [({"rounds": 0}, "--rounds"), ({"warm_s": -1.0}, "--warm-s"),
                                      ({"heat_s": -1.0}, "--heat-s")])
def test_at_cap_options_are_checked_by_name(kw, name):
    with pytest.raises(ValueError, match=f"{name} must be"):
        AtCap(**kw)


def test_ten_rounds_are_reportable():
    assert AtCap().reportable and AtCap().record()["reportable"] and not AtCap(rounds=9).reportable


def test_no_steps_is_refused():
    with pytest.raises(ValueError, match="no steps"):
        profile_rounds({}, AtCap(), lambda s, w: (1.0, {}), synchronize=lambda: None)


def _rounds_measured(base_rounds, recipe_rounds):
    names = [n for n, _ in bench_mlp.RECIPES]
    rounds = {bound_mlp.BF16: base_rounds, **{n: recipe_rounds for n in names}}
    med = lambda rs: tuple(sorted(v)[len(v) // 2] for v in zip(*rs))  # noqa: E731 (odd counts: the median)
    return bound_mlp.Measured(tokens=64, hidden=32, intermediate=96, bf16_step_ms=med(base_rounds)[0],
                              bf16_gemm_ms=med(base_rounds)[1], recipes={n: med(recipe_rounds) for n in names},
                              copy_GBps=0.5, rounds=rounds, at_cap={"rounds": len(base_rounds), "warm_s": 1.0,
                                                                    "heat_s": 0.0})


def test_the_bound_at_the_cap_is_the_median_of_each_rounds_bound():
    base = [(10.0, 8.0), (12.0, 10.0), (11.0, 9.0)]  # the BF16 step slows in round 2 (the cap), its rest stays 2
    mine = [(9.0, 5.0), (8.0, 5.0), (9.5, 5.5)]
    m = _rounds_measured(base, mine)
    rows = bound_mlp.bound_rows(m, bound_mlp.Premises())
    fp8 = rows[0]
    q = fp8["quantize_ms"]
    per_round = [b / (2.0 + g + q) for (b, _), (_, g) in zip(base, mine)]
    assert fp8["bound_rounds"] == pytest.approx(per_round, rel=1e-12)
    assert fp8["bound"] == pytest.approx(sorted(per_round)[1], rel=1e-12)
    assert fp8["bound_interval"] == pytest.approx((min(per_round), max(per_round)), rel=1e-12)  # 3 rounds: [min, max]
    measured = [b / s for (b, _), (s, _) in zip(base, mine)]
    assert fp8["measured"] == pytest.approx(sorted(measured)[1], rel=1e-12)
    # the median of the rounds' ratios, not the ratio of the median steps (11 / 9)
    assert fp8["measured"] != pytest.approx(m.bf16_step_ms / m.recipes[fp8["recipe"]][0])
    text = bound_mlp.report(m, bound_mlp.Premises())
    assert "at the power cap: 3 rounds" in text and f"{fp8['bound']:.3f} [" in text and "(75 %)" in text


def test_rounds_must_pair_up():
    m = _rounds_measured([(10.0, 8.0), (11.0, 9.0)], [(9.0, 5.0), (9.5, 5.0)])
    short = dict(m.rounds, **{"hybridfp MXFP8": [(9.0, 5.0)]})
    m2 = bound_mlp.Measured(**{**m.__dict__, "rounds": short})
    with pytest.raises(ValueError, match="2 rounds of 'BF16 eager' but 1 of 'hybridfp MXFP8'"):
        bound_mlp.bound_rows(m2, bound_mlp.Premises())


def test_every_round_of_every_profile_is_checked(monkeypatch):
    ops = {"aten::mm": 8.0, "aten::mul": 2.0}
    fine = {bound_mlp.BF16: [(10.0, ops), (10.0, ops)], "hybridfp MXFP8": [(9.0, {"aten::mm": 5.0})] * 2}
    assert bound_mlp.split_rounds(fine)["hybridfp MXFP8"] == [(9.0, 5.0), (9.0, 5.0)]
    bad = dict(fine, **{"hybridfp MXFP8": [(9.0, {"aten::mm": 5.0}), (9.0, {"aten::mm": 1.0, "aten::new": 4.0})]})
    with pytest.raises(RuntimeError, match="'hybridfp MXFP8'.*GEMM op outside GEMM_OPS"):
        bound_mlp.split_rounds(bad)
    with pytest.raises(RuntimeError, match="no device time"):
        bound_mlp.split_rounds({bound_mlp.BF16: [(10.0, ops), (0.0, {})]})
    with pytest.raises(ValueError, match="no profile of the baseline"):
        bound_mlp.split_rounds({"hybridfp MXFP8": [(9.0, ops)]})


def test_measure_at_the_cap_on_the_cpu(monkeypatch):
    """The whole path with CPU profiles standing for device ones: every step profiled each round."""
    from tests.bench.test_bound_mlp import _cpu_profile

    monkeypatch.setattr(common, "DEVICE", "cpu")
    seen = []

    def profile(step, warmup=2):
        seen.append(warmup)
        return _cpu_profile(step)
    monkeypatch.setattr(bound_mlp, "_profile", profile)
    monkeypatch.setattr(bound_mlp, "check_gemm_share", lambda *a: None)
    monkeypatch.setattr(bound_mlp, "check_baseline", lambda *a: None)
    m = bound_mlp.measure(64, 64, 128, AtCap(rounds=2, warm_s=0.0, heat_s=0.0))
    assert seen == [0] * (2 * (1 + len(bench_mlp.RECIPES)))
    assert set(m.rounds) == {bound_mlp.BF16, *(n for n, _ in bench_mlp.RECIPES)}
    assert all(len(v) == 2 for v in m.rounds.values()) and m.at_cap == {"rounds": 2, "warm_s": 0.0, "heat_s": 0.0,
                                                                          "reportable": False}
    rows = bound_mlp.bound_rows(m, bound_mlp.Premises())
    assert all(len(r["bound_rounds"]) == 2 and r["bound_interval"][0] <= r["bound"] <= r["bound_interval"][1]
               for r in rows)


def test_cli_options_of_the_cap_need_it(monkeypatch, capsys):
    monkeypatch.setattr(common, "DEVICE", "cpu")
    for main in (bound_mlp.main, bound_moe.main):
        for argv, msg in ((["--rounds", "5"], "--rounds: with --at-cap only"),
                          (["--heat-s", "3", "--warm-s", "2"], "--warm-s, --heat-s: with --at-cap only"),
                          (["--at-cap", "--rounds", "0"], "--rounds must be >= 1"),
                          (["--at-cap", "--samples", "3"], "--samples applies to paired timings")):
            with pytest.raises(SystemExit):
                main(argv)
            assert msg in capsys.readouterr().err, (main, argv)


def test_runner_names_the_bound_at_the_cap_and_shows_its_intervals():
    from bench.__main__ import BENCHMARKS
    b = BENCHMARKS["bound_mlp_at_cap"]
    assert b.module == "bench.bound_mlp" and "--at-cap" in b.args and not b.default
    rows = b.headline({"bounds": [{"recipe": "hybridfp MXFP8", "floor": "BF16 decodes", "bound": 1.2,
                                   "bound_interval": [1.15, 1.25], "target": 1.05, "measured": 0.98,
                                   "measured_interval": [0.97, 0.99]}]})
    assert rows == [("hybridfp MXFP8: BF16 decodes",
                     "bound 1.200x [1.150, 1.250] (target 1.05x, device time now 0.980x [0.970, 0.990])")]


def _moe_step_name(step) -> str:
    """Which of bound_moe's five steps ``step`` is (the layer, or the recipe its autocast takes)."""
    if step.ctx is not None:
        recipe = step.ctx().kwds["recipe"]
        return "MXFP8" if "MXFP8" in type(recipe).__name__ else "FP8 current"
    if hasattr(step.model, "_orig_mod"):
        return "BF16 compiled"
    return {"grouped": "BF16 grouped", "per_expert": "BF16 per-expert"}[step.model.gemm]


def test_bound_moe_at_the_cap_profiles_every_layer_each_round(monkeypatch):
    monkeypatch.setattr(common, "DEVICE", "cpu")
    monkeypatch.setattr(common, "copy_bandwidth", lambda: {"GBps": 100.0})
    base_ms = {"BF16 grouped": 10.0, "BF16 per-expert": 11.0, "BF16 compiled": 9.5, "MXFP8": 12.0, "FP8 current": 8.0}
    seen = []

    def profile(step, warmup=2):
        name = _moe_step_name(step)
        seen.append((name, warmup))
        r = sum(1 for n, _ in seen if n == name)  # this step's round, 1-based
        ms = base_ms[name] * (1 + 0.1 * r)  # every step slower each round (heating), in proportion
        return ms, {"aten::_grouped_mm": ms / 2}
    monkeypatch.setattr(bound_moe, "_profile", profile)
    m = bound_moe.measure(4, 2, compile_backend="eager", ffn=32, tokens=64, hidden=64,
                          at_cap=AtCap(rounds=3, warm_s=0.0, heat_s=0.0))
    assert [n for n, _ in seen[:5]] == list(base_ms) and [n for n, _ in seen[5:10]] == list(base_ms)[::-1]
    assert len(seen) == 15 and {w for _, w in seen} == {0}
    assert len(m.rounds) == 3 and m.at_cap == {"rounds": 3, "warm_s": 0.0, "heat_s": 0.0, "reportable": False}
    assert m.bf16_step_ms == pytest.approx(10.0 * 1.2) and m.fp8_step_ms == pytest.approx(8.0 * 1.2)  # medians
    rows = bound_moe.bound_rows(m, bound_moe.Premises())
    for r in rows:
        assert r["fastest_bf16"] == "BF16 compiled"
        fp8 = r["floor"].startswith("FP8")
        # every step slowed alike, so each round's measured ratio is the same
        assert r["measured_fastest"] == pytest.approx(9.5 / (8.0 if fp8 else 12.0), rel=1e-12)
        assert r["measured_interval"] == pytest.approx((10.0 / (8.0 if fp8 else 12.0),) * 2, rel=1e-12)
        assert r["bound_interval"][0] <= r["bound"] <= r["bound_interval"][1]
        assert len(r["bound_rounds"]) == 3
    text = bound_moe.report(m, bound_moe.Premises())
    assert "at the power cap: 3 rounds" in text and f"{rows[0]['bound']:.3f} [" in text
    assert "under 10 rounds: not reportable" in text


def test_bound_moe_rounds_are_the_medians_of_each_rounds_ratio():
    fields = dict(bf16_gemm_ms=8.0, bf16_per_expert_ms=11.0, bf16_compiled_ms=9.0, mxfp8_step_ms=12.0,
                  mxfp8_gemm_ms=7.5)
    rounds = [dict(fields, bf16_step_ms=10.0, fp8_step_ms=9.0), dict(fields, bf16_step_ms=10.0, fp8_step_ms=7.0),
              dict(fields, bf16_step_ms=13.0, fp8_step_ms=9.5)]
    med = {k: sorted(r[k] for r in rounds)[1] for k in bound_moe.STEP_FIELDS}
    m = bound_moe.Measured(experts=64, ffn=1408, tokens=128, hidden=32, **med, copy_GBps=2000.0, rounds=rounds)
    fp8 = bound_moe.bound_rows(m, bound_moe.Premises())[0]
    measured = sorted(r["bf16_step_ms"] / r["fp8_step_ms"] for r in rounds)
    assert fp8["measured"] == pytest.approx(measured[1], rel=1e-12)  # 10 / 7 ... 13 / 9.5: median 13 / 9.5
    assert fp8["measured"] != pytest.approx(med["bf16_step_ms"] / med["fp8_step_ms"])
    single = [bound_moe.bound_rows(bound_moe.Measured(experts=64, ffn=1408, tokens=128, hidden=32, **r,
                                                      copy_GBps=2000.0), bound_moe.Premises())[0]["bound"]
              for r in rounds]
    assert fp8["bound"] == pytest.approx(sorted(single)[1], rel=1e-12)
    assert fp8["bound_interval"] == pytest.approx((min(single), max(single)), rel=1e-12)


def test_bound_moe_ratios_against_the_fastest_by_median_in_every_round():
    """Per-expert is fastest in one round, compiled by its median: every round's ratios against
    the fastest take compiled's time of that round, and BF16 grouped's ratios its own round's."""
    rounds = [dict(bf16_step_ms=10.0, bf16_gemm_ms=8.0, bf16_per_expert_ms=11.0, bf16_compiled_ms=9.0,
                   mxfp8_step_ms=12.0, mxfp8_gemm_ms=7.5, fp8_step_ms=9.0),
              dict(bf16_step_ms=12.0, bf16_gemm_ms=9.0, bf16_per_expert_ms=8.0, bf16_compiled_ms=9.6,
                   mxfp8_step_ms=12.5, mxfp8_gemm_ms=7.0, fp8_step_ms=8.0),
              dict(bf16_step_ms=11.0, bf16_gemm_ms=8.5, bf16_per_expert_ms=11.5, bf16_compiled_ms=9.3,
                   mxfp8_step_ms=11.0, mxfp8_gemm_ms=7.2, fp8_step_ms=8.5)]
    med = {k: sorted(r[k] for r in rounds)[1] for k in bound_moe.STEP_FIELDS}
    m = bound_moe.Measured(experts=64, ffn=1408, tokens=128, hidden=32, **med, copy_GBps=2000.0, rounds=rounds)
    p = bound_moe.Premises()
    rows = bound_moe.bound_rows(m, p)
    weights, acts = bound_moe.quantized_elements(m, p)
    for j, row in enumerate(rows):
        assert row["fastest_bf16"] == "BF16 compiled"  # by median (9.3 < per-expert's 11.0), not round 2's 8.0
        fp8 = row["floor"].startswith("FP8")
        steps = []
        for r in rounds:
            gemm = r["bf16_gemm_ms"] / 2 if fp8 else r["mxfp8_gemm_ms"]
            quantize = (weights + acts) * row["bytes_per_element"] / 2000.0 / 1e6
            steps.append(r["bf16_step_ms"] - r["bf16_gemm_ms"] + gemm + quantize)
        recipe = "fp8_step_ms" if fp8 else "mxfp8_step_ms"
        expect = {"bound": [r["bf16_step_ms"] / t for r, t in zip(rounds, steps)],
                  "bound_fastest": [r["bf16_compiled_ms"] / t for r, t in zip(rounds, steps)],
                  "measured": [r["bf16_step_ms"] / r[recipe] for r in rounds],
                  "measured_fastest": [r["bf16_compiled_ms"] / r[recipe] for r in rounds]}
        for key, values in expect.items():
            assert row[f"{key}_rounds"] == pytest.approx(values, rel=1e-12), (j, key)
            assert row[key] == pytest.approx(sorted(values)[1], rel=1e-12), (j, key)
            assert row[f"{key}_coverage"] == pytest.approx(0.75)  # 3 rounds: [min, max]


def test_bound_mlp_each_round_takes_its_own_shared_rest():
    base = [(10.0, 8.0), (12.0, 9.0), (11.0, 9.5)]  # the rest: 2.0, 3.0, 1.5
    mine = [(9.0, 5.0), (8.0, 5.0), (9.5, 5.5)]
    m = _rounds_measured(base, mine)
    fp8 = bound_mlp.bound_rows(m, bound_mlp.Premises())[0]
    q = fp8["quantize_ms"]
    per_round = [b / (b - bg + g + q) for (b, bg), (_, g) in zip(base, mine)]
    assert fp8["bound_rounds"] == pytest.approx(per_round, rel=1e-12)
    assert fp8["measured_rounds"] == pytest.approx([b / s for (b, _), (s, _) in zip(base, mine)], rel=1e-12)


@pytest.mark.parametrize("argv, expect", [
    (["--at-cap"], AtCap()),
    (["--at-cap", "--quick"], AtCap(**bench_profile_rounds.QUICK)),
    (["--at-cap", "--quick", "--rounds", "10"], AtCap(**{**bench_profile_rounds.QUICK, "rounds": 10})),
    (["--at-cap", "--heat-s", "0", "--warm-s", "2.5"], AtCap(heat_s=0.0, warm_s=2.5)),
    (["--quick"], None), ([], None)])
def test_options_of_the_cap_read_back(argv, expect):
    p = common.parser("t")
    bench_profile_rounds.add_arguments(p, AtCap())
    assert bench_profile_rounds.from_arguments(p, p.parse_args(argv), AtCap()) == expect
