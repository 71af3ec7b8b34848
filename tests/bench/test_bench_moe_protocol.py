"""bench_moe under the paired protocol: three BF16 baselines, micro-batches with a routing that
changes every step (the same for both sides), error bounds against an FP32 reference that fail
the run loudly, and bound_moe's arithmetic under its premises.

Runs the benchmark's layer on the CPU at a tiny shape (``bench.common.DEVICE = "cpu"``;
``torch.compile`` with the ``eager`` backend, no C++ compiler)."""

from __future__ import annotations

import doctest
import json
import time

import pytest
import torch

import hybridfp
from bench import bench_moe, bound_moe, common, moe_layer
from bench.__main__ import _moe
from hybridfp.moe import grouped_weights
from bench.protocol import Protocol

FAST = ["--quick", "--micro-batches", "2", "--rounds", "2", "--samples", "1", "--compile-backend", "eager"]
#: the failure cases: one micro-batch, one round
FASTER = ["--quick", "--micro-batches", "1", "--rounds", "1", "--samples", "1", "--compile-backend", "eager"]


def test_every_ratio_is_paired_against_each_baseline_and_the_fastest(tiny, tmp_path, monkeypatch):
    calls = []
    real = bench_moe.paired_ratio

    def recording(baseline, candidate, protocol):
        calls.append(protocol)
        return real(baseline, candidate, protocol)

    monkeypatch.setattr(bench_moe, "paired_ratio", recording)
    out = tmp_path / "moe.json"
    recipe = "hybridfp BF16 (high_precision)"  # the cheapest recipe on the CPU; MXFP8 runs in the routing test
    single = recipe + bench_moe.SINGLE_PARAM_SUFFIX
    bench_moe.main(FAST + ["--variants", f"{recipe}|{single}", "--out", str(out)])
    result = json.loads(out.read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == set(bench_moe.BASELINES) | {recipe, single}
    # two baseline pairs (per-expert and compiled against grouped), three for the recipe's row,
    # one for the variant row (against the fastest baseline)
    assert len(calls) == 6 and all(p == Protocol(rounds=2, samples=1, warmup=1) for p in calls)
    row = rows[recipe]
    assert row["micro_batches"] == 2 and "error" not in row and row["breaches"] == []
    assert set(row["x_bf16"]) == set(bench_moe.BASELINES)
    for pr in row["x_bf16"].values():
        assert len(pr["rounds"]) == 2 and pr["low"] <= pr["ratio"] <= pr["high"] and "clocks" in pr
    fastest = row["fastest_bf16"]
    baseline_ms = {b: rows[b]["ms"] for b in bench_moe.BASELINES}
    assert fastest == min(baseline_ms, key=baseline_ms.get)  # the least ms of this run
    assert row["x_fastest_bf16"] == row["x_bf16"][fastest]
    assert rows[single]["x_bf16"].keys() == {fastest} and rows[single]["fastest_bf16"] == fastest
    assert set(row["rel_err"]) == {"out", "dx", "dw1", "dw2"}
    assert all(0 < v < row["bounds"][k.rstrip("12")] for k, v in row["rel_err"].items())
    for b in bench_moe.BASELINES:  # the baselines are checked against the FP32 reference too
        assert rows[b]["breaches"] == [] and rows[b]["bounds"] == bench_moe.error_bounds("BF16 grouped")
    assert rows[bench_moe.BF16_COMPILED]["x_bf16"].keys() == {bench_moe.BF16_GROUPED}
    assert "fastest BF16" in result["markdown"] and "2 micro-batches a step" in result["markdown"]
    headline = dict(_moe(result))  # python -m bench's line per row: the ratio against the fastest, named
    assert headline[f"4 experts, ffn 32: {recipe}"].endswith(f"vs {fastest}")
    assert not any(b in name for name in headline for b in bench_moe.BASELINES)


def _scaled_forward(scale):
    real = moe_layer.HybridMoE.forward

    def forward(self, x, offset=None):
        return real(self, x, offset) * scale
    return forward


def test_a_candidate_beyond_its_error_bound_fails_the_run(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(moe_layer.HybridMoE, "forward", _scaled_forward(1.1))  # 10 % off: out, dx and dW
    out = tmp_path / "moe.json"
    with pytest.raises(SystemExit) as exc:
        bench_moe.main(FASTER + ["--variants", "hybridfp BF16 (high_precision)", "--out", str(out)])
    msg = str(exc.value.code)
    bound = common.error_bound("bf16", "bf16", *bench_moe.DEPTHS["out"])
    assert "hybridfp BF16 (high_precision): out relative error" in msg and f"> bound {bound:.4g}" in msg
    assert "dw1 relative error" in msg
    row = next(r for r in json.loads(out.read_text())["rows"] if r["variant"] == "hybridfp BF16 (high_precision)")
    assert row["breaches"] and 0.09 < row["rel_err"]["out"] < 0.11  # the table is still written
    assert "x_bf16" not in row  # a wrong row is not timed
    assert dict(_moe(json.loads(out.read_text())))["4 experts, ffn 32: hybridfp BF16 (high_precision)"].startswith(
        "FAILED: hybridfp BF16 (high_precision): out relative error")


def test_a_failing_candidate_fails_the_run_naming_it(tiny, monkeypatch):
    def broken(self, x, offset=None):
        raise RuntimeError("kernel missing")
    monkeypatch.setattr(moe_layer.HybridMoE, "forward", broken)
    with pytest.raises(SystemExit) as exc:
        bench_moe.main(FASTER + ["--variants", "hybridfp MXFP8"])
    assert "hybridfp MXFP8: RuntimeError: kernel missing" in str(exc.value.code)


@pytest.mark.parametrize("where", ["compile", "first call", "per-expert"])
def test_a_missing_baseline_is_an_error_naming_it(tiny, monkeypatch, where):
    if where == "compile":
        def no_compile(model, backend):
            raise RuntimeError("no compiler")
        monkeypatch.setattr(torch, "compile", no_compile)
        name = bench_moe.BF16_COMPILED
    elif where == "first call":
        class Broken(torch.nn.Module):
            def forward(self, x, offset=None):
                raise RuntimeError("graph failed")
        monkeypatch.setattr(torch, "compile", lambda model, backend: Broken())
        name = bench_moe.BF16_COMPILED
    else:
        real = moe_layer.BF16MoE.forward

        def forward(self, x, offset=None):
            if self.gemm == "per_expert" and self.w1.dtype == torch.bfloat16:  # not the FP32 reference
                raise RuntimeError("cuBLAS missing")
            return real(self, x, offset)
        monkeypatch.setattr(moe_layer.BF16MoE, "forward", forward)
        name = bench_moe.BF16_PER_EXPERT
    with pytest.raises(SystemExit) as exc:
        bench_moe.main(FASTER + ["--variants", "hybridfp MXFP8"])
    assert f"the baseline '{name}'" in str(exc.value.code)


def test_routing_changes_every_micro_batch_and_is_the_same_for_both_sides(monkeypatch):
    monkeypatch.setattr(common, "DEVICE", "cpu")
    seen: list[tuple[str, tuple]] = []
    side = ["?"]

    class Recording(moe_layer.Routing):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            seen.append((side[0], tuple(self.order.tolist())))

    monkeypatch.setattr(moe_layer, "Routing", Recording)
    base, hf, x, dy = moe_layer.moe_layer(4, 32, 64, 64)
    schedule = moe_layer.RoutingSchedule(64, 4, 2, steps=3)
    recipe = hybridfp.MXFP8BlockScaling()
    b = moe_layer.Step(base, x, dy, None, 2, schedule)
    c = moe_layer.Step(hf, x, dy, lambda: hybridfp.autocast(recipe=recipe), 2, schedule)

    def tagged(name, step):
        def run():
            side[0] = name
            return step()
        return run

    b.calls = c.calls = 5  # left anywhere by earlier calls: pair() restarts both schedules
    bench_moe.pair((tagged("b", b), b), (tagged("c", c), c), Protocol(rounds=2, samples=1, warmup=1, flush_l2=False))
    base_seq = [r for s, r in seen if s == "b"]
    cand_seq = [r for s, r in seen if s == "c"]
    assert len(base_seq) == len(cand_seq) == 2 * (1 + 2 * 1)  # micro-batches x (warm-up + rounds x samples)
    assert base_seq == cand_seq  # the i-th call of each side routes the same
    assert base.w1.grad is None and hf.fc1.weight0.grad is None and x.grad is None  # released after the pair
    assert len(set(base_seq)) == 6  # a new routing every micro-batch of the 3-step schedule
    seen.clear()
    side[0] = "ref"
    ref = bench_moe.reference_result(base, x, dy, 2, schedule)
    assert [r for _, r in seen] == base_seq[:2]  # the FP32 reference routes as the schedule's first step
    assert ref["out"].dtype == torch.float32 and ref["dw1"].shape == base.w1.shape
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"  # a reduced-precision setting is overridden ...
    try:
        again = bench_moe.reference_result(base, x, dy, 2, schedule)
        assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"  # ... and restored
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = "none"
    assert torch.equal(again["out"], ref["out"]) and torch.equal(again["dw2"], ref["dw2"])


def test_routing_loads_are_uneven_and_move(monkeypatch):
    monkeypatch.setattr(common, "DEVICE", "cpu")
    torch.manual_seed(0)
    x, router = torch.randn(4096, 64), torch.randn(8, 64) * 64 ** -0.5
    uneven = moe_layer.RoutingSchedule(4096, 8, 2, steps=4)
    flat = moe_layer.RoutingSchedule(4096, 8, 2, steps=4, skew=0.0)
    assert uneven.imbalance(x, router) > 1.3 > 1.15 > flat.imbalance(x, router)
    busiest = {moe_layer.Routing(x, router, 2, off).counts.argmax().item() for step in uneven.offsets for off in step}
    assert len(busiest) > 1  # the busy experts change from micro-batch to micro-batch
    with pytest.raises(ValueError, match="skew"):
        moe_layer.RoutingSchedule(16, 4, 1, skew=-1.0)
    with pytest.raises(ValueError, match="routing schedule has 2 micro-batches"):
        moe_layer.Step(torch.nn.Identity(), x, x, None, 3, uneven)


def test_error_bounds_follow_each_formats():
    mx = bench_moe.error_bounds("hybridfp MXFP8 [one weight Parameter]")
    assert mx == {t: common.error_bound("e4m3", "e4m3", *d) for t, d in bench_moe.DEPTHS.items()}
    assert bench_moe.error_bounds(bench_moe.BF16_COMPILED)["out"] < 0.02 < mx["out"]
    assert mx["out"] < bench_moe.error_bounds("hybridfp Composer-2 (NVFP4 row-scaled fwd / MXFP8 bwd)")["out"]
    with pytest.raises(ValueError, match="no element formats stated for 'hybridfp NVFP4'"):
        bench_moe.error_bounds("hybridfp NVFP4")
    assert bench_moe.breaches("hybridfp MXFP8", {"out": float("nan"), "dx": 0.01}) == [
        f"hybridfp MXFP8: out relative error nan > bound {mx['out']:.4g}"]


def _measured():
    return bound_moe.Measured(experts=8, ffn=64, tokens=128, hidden=32, bf16_step_ms=10.0, bf16_gemm_ms=8.0,
                              bf16_per_expert_ms=11.0, bf16_compiled_ms=10.5, mxfp8_step_ms=12.0,
                              mxfp8_gemm_ms=7.5, fp8_step_ms=9.0, copy_GBps=2.0)


W = 8 * (2 * 64 * 32 + 32 * 64)  # both layers' weights
A = 128 * 2 * ((32 + 64) + (32 + 2 * 64))  # a micro-batch's x, SwiGLU out and the two output gradients


@pytest.mark.parametrize("cast, fused, weights, fp8_bytes", [
    ("step", False, W, 5), ("micro-batch", False, 4 * W, 5), ("step", True, W, 3), ("micro-batch", True, 4 * W, 3)])
def test_bound_moe_premises(cast, fused, weights, fp8_bytes):
    M, p = _measured(), bound_moe.Premises(micro_batches=4, weight_cast=cast, fused_amax=fused)
    assert bound_moe.quantized_elements(M, p) == (weights, 4 * A)
    rows = bound_moe.bound_rows(M, p)
    assert [r["bytes_per_element"] for r in rows] == [fp8_bytes, 6, 4]  # fused amax: FP8 current only
    assert ("fused into the producer" in rows[0]["floor"]) == fused
    for r, gemm in zip(rows, (8.0 / 2, 7.5, 7.5)):
        quantize = (weights + 4 * A) * r["bytes_per_element"] / 2.0 / 1e6
        assert r["quantize_ms"] == pytest.approx(quantize, rel=1e-12)
        assert r["bound"] == pytest.approx(10.0 / (2.0 + gemm + quantize), rel=1e-12)
    assert rows[0]["measured"] == 10.0 / 9.0 and rows[1]["measured"] == 10.0 / 12.0
    text = bound_moe.report(M, p)
    assert f"weights cast once a {cast}" in text and "4 micro-batches a step" in text


def test_bound_moe_refuses_bad_premises(monkeypatch, capsys):
    with pytest.raises(ValueError, match="weight_cast must be one of"):
        bound_moe.Premises(weight_cast="layer")
    with pytest.raises(ValueError, match="micro_batches must be >= 1"):
        bound_moe.Premises(micro_batches=0)
    monkeypatch.setattr(common, "DEVICE", "cpu")
    with pytest.raises(SystemExit):
        bound_moe.main(["--micro-batches", "0"])
    assert "micro_batches must be >= 1" in capsys.readouterr().err
    assert doctest.testmod(bound_moe).failed == 0


def test_quantized_primary_weights_are_encoded_once_a_step_within_the_bound(monkeypatch):
    monkeypatch.setattr(common, "DEVICE", "cpu")
    encodes, grouped = [], []
    real_encode = hybridfp.quantize_master_weights
    monkeypatch.setattr(hybridfp, "quantize_master_weights", lambda ps, ms: (encodes.append(len(ps)), real_encode(ps, ms)))
    real_grouped = grouped_weights.quantize_weights_grouped
    monkeypatch.setattr(grouped_weights, "quantize_weights_grouped", lambda *a, **k: (grouped.append(1), real_grouped(*a, **k))[1])
    base, _, x, dy = moe_layer.moe_layer(4, 32, 64, 64)
    recipe = hybridfp.MXFP8BlockScaling()
    model = moe_layer.PrimaryWeightsMoE(base, recipe)
    assert all(type(w).__name__ == "QuantizedTensor" for w in model.quantized_weights())
    from hybridfp.moe.primary_group import stacked_view
    # each layer's masters one [E, N, K] buffer, as MasterWeightOptimizer lays them out
    assert stacked_view(model.masters[:4]) is not None and stacked_view(model.masters[4:]) is not None
    schedule = moe_layer.RoutingSchedule(64, 4, 2, steps=2)
    step = moe_layer.Step(model, x, dy, lambda: hybridfp.autocast(recipe=recipe), 2, schedule)
    ref = bench_moe.reference_result(base, x, dy, 2, schedule)
    encodes.clear()
    errors = bench_moe.relative_errors(step, step, ref)
    assert encodes == [8] and grouped == []  # 4 experts x 2 layers re-encoded once for 2 micro-batches
    name = "hybridfp MXFP8" + bench_moe.PRIMARY_SUFFIX
    assert bench_moe.breaches(name, errors) == [] and errors["out"] > 0.01  # MXFP8's error, not BF16's
    with torch.no_grad():
        for m in model.masters:
            m.mul_(1.5)  # masters that do not match the reference's weights: beyond the bound
    assert bench_moe.breaches(name, bench_moe.relative_errors(step, step, ref))


def test_a_scaled_candidate_fails_by_its_gain_for_every_recipe(monkeypatch):
    monkeypatch.setattr(common, "DEVICE", "cpu")
    base, hf, x, dy = moe_layer.moe_layer(4, 32, 64, 64)
    schedule = moe_layer.RoutingSchedule(64, 4, 1, steps=1)
    ref = bench_moe.reference_result(base, x, dy, 1, schedule)
    real = moe_layer.HybridMoE.forward
    for name, recipe in bench_moe.RECIPES:  # Composer-2's NVFP4 included: 10 % is within its error bound
        r = recipe()
        step = moe_layer.Step(hf, x, dy, lambda: hybridfp.autocast(recipe=r), 1, schedule)
        gains: dict = {}
        assert bench_moe.breaches(name, bench_moe.relative_errors(step, step, ref, gains), gains) == []
        assert set(gains) == {"out", "dx", "dw1", "dw2"} and all(abs(g - 1) < 0.03 for g in gains.values())
        monkeypatch.setattr(moe_layer.HybridMoE, "forward", _scaled_forward(1.1))
        gains = {}
        found = bench_moe.breaches(name, bench_moe.relative_errors(step, step, ref, gains), gains)
        monkeypatch.setattr(moe_layer.HybridMoE, "forward", real)
        assert any(f"{name}: out gain 1.0" in b or f"{name}: out gain 1.1" in b for b in found), (name, found)


def test_gradients_released_after_each_row_and_single_layer_built_only_when_run(tiny, monkeypatch):
    steps, singles = [], []
    real_init, real_hybrid = moe_layer.Step.__init__, moe_layer.HybridMoE.__init__

    def init(self, model, *a, **k):
        for s in steps:  # every row timed before keeps no gradient resident (the FP32 reference's are its result)
            if s.x.dtype == torch.float32:
                continue
            assert s.x.grad is None and all(p.grad is None for p in s.model.parameters()), type(s.model)
        real_init(self, model, *a, **k)
        steps.append(self)

    def hybrid(self, base, pack_weights=True, single_parameter=False):
        singles.append(single_parameter)
        real_hybrid(self, base, pack_weights, single_parameter)
    monkeypatch.setattr(moe_layer.Step, "__init__", init)
    monkeypatch.setattr(moe_layer.HybridMoE, "__init__", hybrid)
    bench_moe.main(FASTER + ["--variants", "hybridfp BF16 (high_precision)"])
    assert singles == [False]  # no one-Parameter layer: none of its rows runs


def test_fastest_bf16_takes_the_median_of_the_grouped_times(tiny, monkeypatch, tmp_path):
    from bench.protocol import PairedRatio
    # grouped measured at 1.0 and 3.0 ms in its two pairs (median 2.0), per-expert 1.9, compiled 2.5
    fake = {bench_moe.BF16_PER_EXPERT: (1.0, 1.9), bench_moe.BF16_COMPILED: (3.0, 2.5)}

    def pair(baseline, candidate, protocol):
        model = candidate[1].model
        name = (bench_moe.BF16_COMPILED if hasattr(model, "_orig_mod") else
                bench_moe.BF16_PER_EXPERT if getattr(model, "gemm", None) == "per_expert" else None)
        b, c = fake.get(name, (2.0, 2.0))
        return PairedRatio(b / c, b / c, b / c, b, c, ((b, c),), {})
    monkeypatch.setattr(bench_moe, "pair", pair)
    out = tmp_path / "moe.json"
    bench_moe.main(FASTER + ["--variants", "hybridfp BF16 (high_precision)", "--out", str(out)])
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows[bench_moe.BF16_GROUPED]["ms"] == 2.0
    assert rows["hybridfp BF16 (high_precision)"]["fastest_bf16"] == bench_moe.BF16_PER_EXPERT


def test_fp8_tma_configs_are_passed_not_a_module_switch():
    assert not hasattr(bench_moe, "FP8_TMA")
    seen = []

    def step():
        pol = hybridfp.current_policy()
        seen.append((pol.grouped_fp8_tma_rows, pol.grouped_fp8_tma_wgrad))
    tma = ("128x128x128 w8 st4", "128x128x128 w8 st4 flat")
    bench_moe.wrap("hybridfp FP8 current" + bench_moe.FP8_TMA_SUFFIX, step, fp8_tma=tma)()
    bench_moe.wrap("hybridfp FP8 current" + bench_moe.FP8_TMA_SUFFIX, step)()
    assert seen == [tma, (None, None)]


def test_deadline_names_the_rows_not_run_and_checkpoints_every_row(tiny, monkeypatch, tmp_path):
    import types
    clock = {"t": 0.0}
    monkeypatch.setattr(bench_moe, "time", types.SimpleNamespace(monotonic=lambda: clock["t"],
                                                                 perf_counter=time.perf_counter))
    real_host, written, clocks = bench_moe.host_ms, [], []
    out = tmp_path / "moe.json"

    def host(step, model, **kw):  # each row's host timing takes one second of the fake clock
        clock["t"] += 1
        written.append(len(json.loads(out.read_text())["rows"]) if out.exists() else 0)
        clocks.append(getattr(model, "sync", None))
        return real_host(step, model, **kw)
    monkeypatch.setattr(bench_moe, "host_ms", host)
    recipe = "hybridfp BF16 (high_precision)"
    single = recipe + bench_moe.SINGLE_PARAM_SUFFIX
    args = FASTER + ["--variants", f"{recipe}|{single}", "--out", str(out)]
    bench_moe.main(args + ["--deadline-s", "3.5"])  # the three baselines and the recipe: an optional row left
    result = json.loads(out.read_text())
    assert written == [0, 1, 2, 3]  # the JSON holds every finished row before the next starts
    # each row's host time reads its own layer's routing-sync clock (compiled BF16's through its wrapper)
    assert len({id(c) for c in clocks}) == 4 and all(isinstance(c, moe_layer.SyncClock) for c in clocks)
    rows = {r["variant"]: r for r in result["rows"]}
    timed = [r for r in result["rows"] if "not_run" not in r]
    assert all(0 <= r["sync_wait_ms"] <= r["host_ms"] for r in timed) and "of it at syncs" in result["markdown"]
    assert "x_fastest_bf16" in rows[recipe] and rows[single]["not_run"] == "--deadline-s passed"
    assert result["not_run"] == [f"4 experts, ffn 32: {single} (optional)"] and "not run" in result["markdown"]
    clock["t"] = 0.0
    with pytest.raises(SystemExit) as exc:  # a recipe row past the deadline fails the run, loudly
        bench_moe.main(args + ["--deadline-s", "2.5"])
    assert f"{recipe}: not run (--deadline-s passed)" in str(exc.value.code)
    clock["t"] = 0.0
    with pytest.raises(SystemExit) as exc:
        bench_moe.main(args + ["--deadline-s", "1.5"])
    assert f"baseline '{bench_moe.BF16_COMPILED}'" in str(exc.value.code) and "--deadline-s" in str(exc.value.code)


def test_moe_times_the_rows_with_a_target_first():
    """After the baselines a deadline reaches the targeted recipes before the others."""
    from bench import bench_moe, moe_targets
    names = [n for n, _ in bench_moe.RECIPES]
    targeted = {n for targets in moe_targets.TARGETS.values() for n in targets}
    with_target = [n for n in names if n in targeted]
    assert with_target and names[:len(with_target)] == with_target, names


def test_variants_naming_no_row_is_refused_before_any_timing(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_moe, "paired_ratio", lambda *a, **k: pytest.fail("timed a row"))
    out = tmp_path / "moe.json"
    with pytest.raises(SystemExit) as stop:
        bench_moe.main(FASTER + ["--variants", "hybridfp MXFP8|hybridfp FP9", "--out", str(out)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "no row named 'hybridfp FP9' (the A/B rows need --ab)" in err
    assert "hybridfp FP8 current" + bench_moe.PRIMARY_SUFFIX in err  # the rows it could have named
    assert not out.exists()


def test_the_compiled_primary_weight_row_compiles_the_eager_rows_layer(tiny, tmp_path, monkeypatch):
    """The "[compiled]" row runs the quantized-primary-weight layer of the eager row (one layer,
    one set of masters) under torch.compile, checked against the FP32 reference as every row."""
    built, compiled = [], []
    real_init, real_compile = moe_layer.PrimaryWeightsMoE.__init__, torch.compile

    def init(self, *a, **k):
        built.append(self)
        real_init(self, *a, **k)

    def recording_compile(model, **k):
        compiled.append((model, k.get("backend")))
        return real_compile(model, **k)
    monkeypatch.setattr(moe_layer.PrimaryWeightsMoE, "__init__", init)
    monkeypatch.setattr(torch, "compile", recording_compile)
    eager = "hybridfp FP8 current" + bench_moe.PRIMARY_SUFFIX
    name = eager + bench_moe.COMPILED_SUFFIX
    out = tmp_path / "moe.json"
    bench_moe.main(FASTER + ["--variants", f"{eager}|{name}", "--out", str(out)])
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert len(built) == 1 and [m for m, _ in compiled if m is built[0]] == [built[0]]
    assert all(backend == "eager" for _, backend in compiled)
    row = rows[name]
    assert "error" not in row and row["breaches"] == [] and row["target"] == rows[eager]["target"]
    assert row["rel_err"]["out"] > 0.01 and row["x_fastest_bf16"]["ratio"] > 0  # FP8's error: quantized, timed
