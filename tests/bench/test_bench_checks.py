"""The benchmarks' checks: error bounds from the element formats, a wrong result failing the run,
a missing baseline failing it by name, and CPU smoke runs (``common.DEVICE = "cpu"``, tiny sizes)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from bench import bench_gemm_pairs, common


def test_error_bound_follows_mantissa_widths():
    e4m3, e2m1, bf16 = (common.error_bound(f, f, 1, 0) for f in ("e4m3", "e2m1", "bf16"))
    assert bf16 < e4m3 < e2m1 < 1.0  # a zero or wrongly scaled result (error >= 1) never passes
    assert e4m3 == pytest.approx(2 * (2 * (2 ** -4) ** 2 / 3) ** 0.5 + 2 ** -7)
    assert common.error_bound("e4m3", "e5m2", 1, 2) > common.error_bound("e4m3", "e4m3", 1, 2)
    with pytest.raises(ValueError, match="'e3m3'"):
        common.unit_roundoff("e3m3")


def test_rel_error_and_check_error():
    ref = torch.randn(64, 64)
    assert common.rel_error(ref, ref) == 0.0
    assert common.rel_error(torch.zeros_like(ref), ref) == pytest.approx(1.0)
    assert common.rel_error(torch.zeros(3), torch.zeros(3)) == 0.0
    common.check_error("ok", 0.01, 0.1)
    with pytest.raises(common.AccuracyError, match="MLP y"):
        common.check_error("MLP y", 0.2, 0.1)
    with pytest.raises(common.AccuracyError, match="nan"):
        common.check_error("MLP dx", float("nan"), 0.1)
    with pytest.raises(ValueError, match="shape"):
        common.rel_error(torch.zeros(2, 3), torch.zeros(3, 2))


@pytest.fixture
def tiny_pairs(monkeypatch):
    monkeypatch.setattr(common, "DEVICE", "cpu")
    monkeypatch.setattr(bench_gemm_pairs, "QUICK_SHAPES", {"TN": [("64^3", 64, 64, 64)], "NT": [("64^3", 64, 64, 64)]})
    monkeypatch.setattr(bench_gemm_pairs, "DECODES", bench_gemm_pairs.DECODES[:1])
    monkeypatch.setattr(bench_gemm_pairs, "TILES", bench_gemm_pairs.TILES[:1])
    monkeypatch.setattr(bench_gemm_pairs, "QUICK_DECODE_N", 64)


def test_gemm_pairs_quick_smoke(tiny_pairs, tmp_path):
    torch.manual_seed(0)
    out = tmp_path / "pairs.json"
    bench_gemm_pairs.main(["--quick", "--rounds", "2", "--samples", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["protocol"]["reportable"] is False and result["failures"] == []
    rows = result["rows"]
    assert {r["pair"] for r in rows} == {p[0] for p in bench_gemm_pairs.PAIRS}
    for r in rows:
        assert 0 <= r["rel_err"] <= r["err_bound"]
        for key in ("cold_vs_randn", "cold_vs_decoded", "warm_vs_randn", "warm_vs_decoded"):
            assert len(r[key]["rounds"]) == 2 and r[key]["low"] <= r[key]["ratio"] <= r[key]["high"]
    assert "NOT REPORTABLE" in result["markdown"]


def test_gemm_pairs_wrong_output_fails_the_run(tiny_pairs, tmp_path, monkeypatch):
    real = bench_gemm_pairs.gemm
    monkeypatch.setattr(bench_gemm_pairs, "gemm", lambda A, B, layout: 2 * real(A, B, layout))
    monkeypatch.setattr(bench_gemm_pairs, "PAIRS", bench_gemm_pairs.PAIRS[:1])
    out = tmp_path / "pairs.json"
    with pytest.raises(SystemExit, match="MXFP8 x MXFP8 TN 64\\^3: output \\(cold\\): relative error"):
        bench_gemm_pairs.main(["--quick", "--rounds", "1", "--samples", "1", "--out", str(out)])
    assert json.loads(out.read_text())["failures"]  # the JSON still says what failed


def test_gemm_pairs_wrong_warm_output_fails_the_run(tiny_pairs, tmp_path, monkeypatch):
    """The warm path (weight decodes cached) is checked on its own output too."""
    import hybridfp
    real = bench_gemm_pairs.gemm
    monkeypatch.setattr(bench_gemm_pairs, "gemm", lambda A, B, layout: (
        2 if hybridfp.current_policy().cache_weight_decodes else 1) * real(A, B, layout))
    monkeypatch.setattr(bench_gemm_pairs, "PAIRS", bench_gemm_pairs.PAIRS[:1])
    with pytest.raises(SystemExit, match="MXFP8 x MXFP8 TN 64\\^3: output \\(warm\\): relative error"):
        bench_gemm_pairs.main(["--quick", "--rounds", "1", "--samples", "1", "--out", str(tmp_path / "p.json")])


@pytest.fixture
def tiny_mlp(monkeypatch):
    from bench import bench_mlp
    monkeypatch.setattr(common, "DEVICE", "cpu")
    monkeypatch.setattr(bench_mlp, "QUICK_DIMS", (128, 256, 128))
    keep = ("hybridfp FP8 current", "hybridfp NVFP4 fwd / MXFP8 bwd")
    monkeypatch.setattr(bench_mlp, "RECIPES", [r for r in bench_mlp.RECIPES if r[0] in keep])
    return bench_mlp


def _mlp_args(out, *extra):
    return ["--quick", "--mlp-only", "--rounds", "1", "--samples", "1", "--out", str(out), *extra]


def test_mlp_quick_smoke_checks_y_dx_dw(tiny_mlp, tmp_path):
    out = tmp_path / "mlp.json"
    tiny_mlp.main(_mlp_args(out, "--no-compile"))
    result = json.loads(out.read_text())
    assert result["failures"] == [] and result["skipped"] and result["protocol"]["reportable"] is False
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) >= {"BF16 eager", "hybridfp FP8 current", "hybridfp FP8 current + fused SwiGLU",
                         "hybridfp NVFP4 fwd / MXFP8 bwd"}
    for r in rows.values():
        for t in ("y", "dx", "dW"):
            assert 0 <= r[f"err_{t}"] <= r[f"bound_{t}"], (r["variant"], t)
        if not r["baseline"]:
            assert len(r["vs BF16 eager"]["rounds"]) == 1
    assert rows["BF16 eager"]["bound_y"] < rows["hybridfp FP8 current"]["bound_y"] \
        < rows["hybridfp NVFP4 fwd / MXFP8 bwd"]["bound_y"]


def test_mlp_wrong_candidate_fails_the_run(tiny_mlp, tmp_path, monkeypatch):
    real = tiny_mlp.hybridfp_linear

    def broken(i, o):  # a layer whose output is 1.5x too large
        m = real(i, o)
        m.register_forward_hook(lambda mod, inp, out: out * 1.5)
        return m
    monkeypatch.setattr(tiny_mlp, "hybridfp_linear", broken)
    monkeypatch.setattr(tiny_mlp, "RECIPES", tiny_mlp.RECIPES[:1])
    monkeypatch.setattr(tiny_mlp, "FUSED_RECIPES", ())
    out = tmp_path / "mlp.json"
    with pytest.raises(SystemExit, match="hybridfp FP8 current: y: relative error"):
        tiny_mlp.main(_mlp_args(out, "--no-compile"))
    assert json.loads(out.read_text())["failures"]


def test_mlp_missing_torchao_fails_by_name(tiny_mlp, tmp_path, monkeypatch):
    monkeypatch.setattr(tiny_mlp, "torchao_status", lambda: (None, "unavailable (ModuleNotFoundError)"))
    with pytest.raises(SystemExit, match="baseline torchao float8 missing.*--no-torchao"):
        tiny_mlp.main(_mlp_args(tmp_path / "mlp.json"))


def test_mlp_baseline_past_deadline_fails_by_name(tiny_mlp, tmp_path):
    out = tmp_path / "mlp.json"
    with pytest.raises(SystemExit, match="baseline 'BF16 eager' not run: --deadline-s passed"):
        tiny_mlp.main(_mlp_args(out, "--no-torchao", "--deadline-s", "-1"))
    assert "--no-torchao" in json.loads(out.read_text())["skipped"][0]


def test_gemm_rows_below_target_are_marked():
    from bench import bench_gemm
    assert bench_gemm.marked({"ratio": 0.955, "low": 0.95, "high": 0.96}).endswith("below 0.97 target**")
    assert "target" not in bench_gemm.marked({"ratio": 0.99, "low": 0.98, "high": 1.0})


def test_gemm_output_differing_from_raw_is_a_failure_by_shape_and_kind():
    from bench import bench_gemm
    rows = [{"shape": "4096^3 fprop", "tensorwise_equal_to_raw": True, "tensorwise_fast_equal_to_raw": False,
             "block_equal_to_raw": True},
            {"shape": "llama3-8b up dgrad", "tensorwise_equal_to_raw": True, "block_equal_to_raw": False}]
    assert bench_gemm.mismatches(rows) == [
        "gemm 4096^3 fprop: hybridfp.gemm tensorwise_fast differs from raw torch._scaled_mm on the same stored operands",
        "gemm llama3-8b up dgrad: hybridfp.gemm block differs from raw torch._scaled_mm on the same stored operands"]
    assert bench_gemm.mismatches([{**rows[1], "block_equal_to_raw": True}]) == []


def _mlp_case(bench_mlp):
    """A tiny MLP, its hybridfp twin, x, dy and the FP32 reference (``bench_model``'s set-up)."""
    d, h, tokens = bench_mlp.QUICK_DIMS
    torch.manual_seed(0)
    make = lambda lin: bench_mlp.MLP(lin, d, h)  # noqa: E731
    x = torch.randn(tokens, d, dtype=torch.bfloat16, requires_grad=True)
    base = make(bench_mlp.torch_linear)
    with torch.no_grad():
        dy = torch.randn_like(base(x))
    hf = make(bench_mlp.hybridfp_linear)
    hf.load_state_dict(base.state_dict())
    return hf, x, dy, bench_mlp.fp32_reference(make, base, x, dy)


def _without_up_branch_of_dx(model):
    """``model`` whose dx misses the up projection's branch (forward and every dW unchanged)."""
    twin = model.with_act(model.act)
    twin.forward = lambda x: twin.down(twin.act(twin.gate(x), twin.up(x.detach())))
    return twin


def _scaled(model, scale):
    twin = model.with_act(model.act)
    twin.forward = lambda x: model.forward(x) * scale
    return twin


def test_mlp_check_catches_a_dropped_branch_and_a_wrong_scale_for_every_recipe(monkeypatch):
    from bench import bench_mlp
    monkeypatch.setattr(common, "DEVICE", "cpu")
    monkeypatch.setattr(bench_mlp, "QUICK_DIMS", (128, 256, 128))
    hf, x, dy, ref = _mlp_case(bench_mlp)
    params = list(hf.parameters())
    import hybridfp
    for name, recipe in bench_mlp.RECIPES:  # NVFP4 (2D weights, RHT, SR) included
        ctx = lambda r=recipe(): hybridfp.autocast(recipe=r)  # noqa: E731
        for model, what in ((hf, None), (_without_up_branch_of_dx(hf), "dx: "), (_scaled(hf, 1.5), "y: ")):
            y = bench_mlp.make_step(model, params, ctx, x, dy)()
            if what is None:
                out = bench_mlp.check_step("MLP", "MLP", name, y, x, params, ref)
                assert all(abs(out[f"gain_{t}"] - 1) < 0.03 for t in ("y", "dx", "dW")), (name, out)
            else:
                with pytest.raises(common.AccuracyError, match=re.escape(f"{name}: {what}gain")):
                    bench_mlp.check_step("MLP", "MLP", name, y, x, params, ref)


def test_fp32_reference_runs_with_ieee_fp32_products(monkeypatch):
    from bench import bench_mlp
    monkeypatch.setattr(common, "DEVICE", "cpu")
    seen = []

    class Spy(torch.nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.lin = lin(8, 8)

        def forward(self, x):
            seen.append((torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision))
            return self.lin(x)
    base = Spy(bench_mlp.torch_linear)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    bench_mlp.fp32_reference(Spy, base, x, torch.randn(4, 8, dtype=torch.bfloat16))
    assert seen == [("ieee", "ieee")]


def test_common_docstring_examples_run():
    import doctest
    result = doctest.testmod(common, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_mlp_rows_past_the_deadline_are_named_and_fail_unless_optional(tiny_mlp, tmp_path, monkeypatch):
    import types
    clock = {"t": 0.0}
    monkeypatch.setattr(tiny_mlp, "time", types.SimpleNamespace(monotonic=lambda: clock["t"]))
    real = tiny_mlp.bench_ms

    def bench_ms(step, **k):  # each row's diagnostic timing takes one second of the fake clock
        clock["t"] += 1
        return real(step, **k)
    monkeypatch.setattr(tiny_mlp, "bench_ms", bench_ms)
    monkeypatch.setattr(tiny_mlp, "RECIPES", tiny_mlp.RECIPES[:1])  # FP8 current, then its fused row
    out = tmp_path / "mlp.json"
    # baseline, recipe, BF16 + fused SwiGLU run (each a second); the recipe's fused row is left
    tiny_mlp.main(_mlp_args(out, "--no-compile", "--deadline-s", "2.5"))
    result = json.loads(out.read_text())
    fused = "hybridfp FP8 current + fused SwiGLU"
    assert result["failures"] == [] and result["not_run"] == [f"{result['rows'][0]['model']}: {fused} (optional)"]
    clock["t"] = 0.0
    with pytest.raises(SystemExit, match="hybridfp FP8 current: not run \\(--deadline-s passed\\)"):
        tiny_mlp.main(_mlp_args(out, "--no-compile", "--deadline-s", "0.5"))  # only the baseline runs


def test_mlp_times_every_recipe_before_its_optional_variants(monkeypatch):
    """Under --deadline-s the rows left are the optional ones (fused SwiGLU, codes, compiled),
    never a recipe's own row: the targets are measured first."""
    from bench import bench_mlp
    monkeypatch.setattr(common, "DEVICE", "cpu")
    monkeypatch.setattr(bench_mlp, "QUICK_DIMS", (128, 256, 128))
    hf, _, _, _ = _mlp_case(bench_mlp)
    base = bench_mlp.MLP(bench_mlp.torch_linear, *bench_mlp.QUICK_DIMS[:2])
    fake_compile = lambda m, **kw: m  # noqa: E731 - the order only, nothing is compiled
    monkeypatch.setattr(torch, "compile", fake_compile)
    variants, n_baselines = bench_mlp.plan_variants(base, hf, compiled=True, torchao=None, fuse=lambda m: m)
    names = [v[0] for v in variants]
    recipes = [name for name, _ in bench_mlp.RECIPES]
    assert names[:n_baselines] == [bench_mlp.BASELINE_EAGER, bench_mlp.BASELINE_COMPILED]
    assert names[n_baselines:n_baselines + len(recipes)] == recipes
    optional = names[n_baselines + len(recipes):]
    assert optional and not set(optional) & set(recipes)
    assert "BF16 eager + hybridfp fused SwiGLU" in optional and any(n.endswith("(compiled)") for n in optional)


def test_mlp_targets_are_each_recipes_own_and_its_variants_share_them():
    from bench import bench_mlp, mlp_targets
    assert {name for name, _ in bench_mlp.RECIPES} == set(mlp_targets.TARGETS)
    target_of = mlp_targets.target_of
    assert target_of("hybridfp FP8 current") == 1.70
    assert target_of("hybridfp FP8 current, fprop fast accumulation (compiled)") == 1.70
    assert target_of("hybridfp FP8 block + fused SwiGLU") == 1.45
    assert target_of("hybridfp MXFP8 [codes, decoded per GEMM]") == 1.05
    assert target_of("hybridfp NVFP4 (2D weights, RHT, SR)") == 0.95
    assert target_of("BF16 torch.compile") is None
    row = {"variant": "hybridfp MXFP8", "vs BF16 eager": {"ratio": 1.02, "low": 1.0, "high": 1.03}}
    assert bench_mlp.below_target(row)  # above the old blanket 1.00x, below MXFP8's 1.05x
    row = {"variant": "hybridfp NVFP4 (2D weights, RHT, SR)", "vs BF16 eager": {"ratio": 0.96, "low": 0.95, "high": 0.97}}
    assert not bench_mlp.below_target(row)


def test_target_tables_import_no_torch():
    """``python -m bench`` reads the targets for its headlines without importing torch."""
    import subprocess
    import sys
    code = ("import sys, bench.mlp_targets, bench.moe_targets; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:3]; "
            "assert bench.mlp_targets.target_of('hybridfp MXFP8 (compiled)') == 1.05")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=__import__("pathlib").Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr


def test_every_fp8_mlp_row_is_paired_with_torchao():
    """FP8 rows against torchao tensorwise (its fastest float8); block scalings also against
    rowwise; MX / NVFP4 rows against none (the docstring's examples run too)."""
    import doctest

    from bench import bench_mlp
    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(bench_mlp.torchao_baselines, globs=vars(bench_mlp)):
        runner.run(test)
    assert runner.summarize(verbose=False) == (0, 2)  # (failed, attempted)
    fp8 = [n for n, _ in bench_mlp.RECIPES if "FP8" in n.replace("MXFP8", "")]
    assert fp8 and all(bench_mlp.TORCHAO_TENSORWISE in bench_mlp.torchao_baselines(n) for n in fp8)
    assert bench_mlp.TORCHAO_ROWWISE in bench_mlp.torchao_baselines("hybridfp FP8 block")
    assert bench_mlp.torchao_baselines(bench_mlp.TORCHAO_TENSORWISE) == ()
    assert bench_mlp.torchao_baselines("hybridfp NVFP4 fwd / MXFP8 bwd") == ()


def test_mlp_headline_names_each_torchao_ratio():
    from bench.__main__ import _mlp
    ratio = {"ratio": 1.5, "low": 1.4, "high": 1.6, "rounds": [1.5] * 10}
    row = {"model": "Llama-3-8B MLP", "variant": "hybridfp FP8 block", "vs BF16 eager": ratio,
           "vs torchao float8 tensorwise (compiled)": {**ratio, "ratio": 0.9, "low": 0.8, "high": 1.0},
           "vs torchao float8 rowwise (compiled)": {**ratio, "ratio": 1.2, "low": 1.1, "high": 1.3}}
    (_, value), = _mlp({"rows": [row]})
    assert "torchao float8 rowwise" in value and "torchao float8 tensorwise" in value, value
    assert value.index("1.200") < value.index("torchao float8 rowwise") < value.index("0.900"), value


def test_mlp_variants_times_only_the_selected_candidates_and_records_it(tiny_mlp, tmp_path):
    out = tmp_path / "mlp.json"
    tiny_mlp.main(_mlp_args(out, "--no-compile", "--variants", "fused SwiGLU|no such row"))
    result = json.loads(out.read_text())
    assert [r["variant"] for r in result["rows"]] == [
        "BF16 eager", "BF16 eager + hybridfp fused SwiGLU", "hybridfp FP8 current + fused SwiGLU",
        "hybridfp NVFP4 fwd / MXFP8 bwd + fused SwiGLU"]
    assert result["failures"] == [] and result["not_run"] == []
    assert any("--variants 'fused SwiGLU|no such row'" in s for s in result["skipped"])


def test_mlp_variants_matching_nothing_is_refused_before_running(tiny_mlp, tmp_path, capsys):
    with pytest.raises(SystemExit):
        tiny_mlp.main(_mlp_args(tmp_path / "mlp.json", "--variants", "FP9"))
    err = capsys.readouterr().err
    assert "--variants 'FP9' matches no candidate" in err and "hybridfp FP8 current (compiled)" in err
    assert not (tmp_path / "mlp.json").exists()
