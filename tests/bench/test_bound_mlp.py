"""bench.bound_mlp: the Llama-3-8B MLP's quantized elements, the bytes each premise moves per
element, the bound's arithmetic and table, the GEMM classifier, the CLI without CUDA and its
registration in ``python -m bench``."""

import doctest
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from bench import bench_mlp, bound_mlp, common

ROOT = Path(__file__).resolve().parents[2]
T, D, H = 16384, 4096, 14336


def test_llama_elements_quantized_a_step():
    e = bound_mlp.quantized_elements(T, D, H)
    assert e == {"input": 16384 * (4096 + 14336),  # x once (gate and up share it), the SwiGLU output
                 "weight": 3 * 4096 * 14336,  # gate, up, down
                 "grad": 16384 * (4096 + 2 * 14336)}  # dy, the gradients into gate and up
    assert sum(e.values()) == 1_015_021_568


@pytest.mark.parametrize("recipe, fused, decode, expected", [
    # FP8 current: amax read 2 + cast read 2 + one FP8 write (the column copy is the same codes)
    ("hybridfp FP8 current", False, "bf16", {"input": 5, "weight": 5, "grad": 5}),
    ("hybridfp FP8 current", True, "bf16", {"input": 3, "weight": 3, "grad": 3}),
    ("hybridfp FP8 current, fprop fast accumulation", False, "bf16", {"input": 5, "weight": 5, "grad": 5}),
    # FP8 block: one read, a row and a column copy (1x128 blocks differ per direction); 128x128
    # weight tiles: the column copy is the row copy's codes transposed, written once
    ("hybridfp FP8 block", False, "bf16", {"input": 4, "weight": 3, "grad": 4}),
    ("hybridfp FP8 block", True, "bf16", {"input": 4, "weight": 3, "grad": 4}),
    # hybrid: FP8 current fprop copy (with its amax pass) + FP8 block backward copy
    ("hybridfp hybrid FP8-current fwd / FP8-block bwd", False, "bf16", {"input": 6, "weight": 6, "grad": 4}),
    ("hybridfp hybrid FP8-current fwd / FP8-block bwd", True, "bf16", {"input": 4, "weight": 4, "grad": 4}),
    # MXFP8 on Hopper: two BF16 decodes; or two FP8 code copies decoded for free by the GEMM
    ("hybridfp MXFP8", False, "bf16", {"input": 6, "weight": 6, "grad": 6}),
    ("hybridfp MXFP8", True, "codes", {"input": 4, "weight": 4, "grad": 4}),
    # NVFP4 fwd / MXFP8 bwd: NVFP4's per-tensor scale needs an amax where its copy is made
    ("hybridfp NVFP4 fwd / MXFP8 bwd", False, "bf16", {"input": 8, "weight": 8, "grad": 6}),
    ("hybridfp NVFP4 fwd / MXFP8 bwd", True, "bf16", {"input": 6, "weight": 6, "grad": 6}),
    ("hybridfp NVFP4 fwd / MXFP8 bwd", False, "codes", {"input": 5.5, "weight": 5.5, "grad": 4}),
    # full NVFP4: 16x16 weight tiles (one copy), 1D activations and gradients (two)
    ("hybridfp NVFP4 (2D weights, RHT, SR)", False, "bf16", {"input": 8, "weight": 6, "grad": 8}),
    ("hybridfp NVFP4 (2D weights, RHT, SR)", True, "codes", {"input": 3, "weight": 2.5, "grad": 3}),
])
def test_bytes_per_element_per_premise(recipe, fused, decode, expected):
    assert bound_mlp.role_bytes(recipe, bound_mlp.Premises(fused_amax=fused), decode) == expected


def test_every_bench_mlp_recipe_has_copies_and_a_target():
    names = [n for n, _ in bench_mlp.RECIPES]
    assert list(bound_mlp.RECIPE_GEMMS) == names and set(bound_mlp.TARGETS) == set(names)
    assert bound_mlp.TARGETS["hybridfp FP8 current"] == 1.70 and bound_mlp.TARGETS["hybridfp MXFP8"] == 1.05
    with pytest.raises(ValueError, match="recipe 'hybridfp FP16'.*RECIPE_GEMMS"):
        bound_mlp.role_bytes("hybridfp FP16", bound_mlp.Premises(), "bf16")
    with pytest.raises(ValueError, match="decode must be one of"):
        bound_mlp.role_bytes("hybridfp MXFP8", bound_mlp.Premises(), "fp8")


def _measured(**over):
    recipes = {n: (9.0 + i, 5.0 + i / 2) for i, (n, _) in enumerate(bench_mlp.RECIPES)}
    kw = dict(tokens=64, hidden=32, intermediate=96, bf16_step_ms=10.0, bf16_gemm_ms=8.0, recipes=recipes,
              copy_GBps=0.5)
    kw.update(over)
    return bound_mlp.Measured(**kw)


@pytest.mark.parametrize("fused", [False, True])
def test_bound_is_baseline_over_shared_rest_plus_gemms_plus_floor(fused):
    m, p = _measured(), bound_mlp.Premises(fused_amax=fused)
    rows = bound_mlp.bound_rows(m, p)
    elems = bound_mlp.quantized_elements(64, 32, 96)
    two_floors = {"hybridfp MXFP8", "hybridfp NVFP4 fwd / MXFP8 bwd", "hybridfp NVFP4 (2D weights, RHT, SR)"}
    assert [r["recipe"] for r in rows] == [n for n, _ in bench_mlp.RECIPES for _ in range(2 if n in two_floors else 1)]
    for r in rows:
        step_ms, gemm_ms = m.recipes[r["recipe"]]
        decode = "codes" if "codes" in r["floor"] else "bf16"
        nbytes = sum(elems[k] * b for k, b in bound_mlp.role_bytes(r["recipe"], p, decode).items())
        quantize = nbytes / 0.5 / 1e6
        assert r["bytes_per_element"] == pytest.approx(nbytes / sum(elems.values()), rel=1e-12)
        assert r["gemm_ms"] == gemm_ms and r["quantize_ms"] == pytest.approx(quantize, rel=1e-12)
        assert r["step_ms"] == pytest.approx(2.0 + gemm_ms + quantize, rel=1e-12)
        assert r["bound"] == pytest.approx(10.0 / (2.0 + gemm_ms + quantize), rel=1e-12)
        assert r["measured"] == 10.0 / step_ms and r["target"] == bound_mlp.TARGETS[r["recipe"]]
    fp8 = rows[0]
    assert fp8["bytes_per_element"] == (3 if fused else 5)
    assert ("fused into the producer" in fp8["floor"]) == fused
    text = bound_mlp.report(m, p)
    for head in ("floor", "bytes / element", "GEMMs ms", "quantize ms", "step ms", "bound x BF16", "target",
                 "measured device-time x BF16"):
        assert head in text
    assert "shared rest S" in text and "64 tokens" in text
    assert text.count("\n| hybridfp ") == len(rows)


def test_report_names_a_recipe_that_was_not_measured():
    recipes = dict(_measured().recipes)
    del recipes["hybridfp MXFP8"]
    with pytest.raises(ValueError, match="no measured step for 'hybridfp MXFP8'"):
        bound_mlp.bound_rows(_measured(recipes=recipes), bound_mlp.Premises())


def test_gemm_classifier_on_synthetic_and_cpu_profiles():
    ops = {"aten::mm": 3.0, "aten::_scaled_mm": 2.0, "aten::addmm": 0.5, "aten::matmul": 0.0, "aten::mul": 1.0,
           "aten::silu_backward": 0.7, "sm90_xmma_gemm_bf16bf16_bf16f32": 3.0, "triton_per_amax": 0.2}
    assert bound_mlp.gemm_ms(ops) == 5.5  # kernels' own names are not ops: counted through their op once
    # the profiler names nn.Linear's forward and backward GEMMs as gemm_ms expects
    model = bench_mlp.MLP(lambda i, o: nn.Linear(i, o, bias=False), 16, 32)
    x = torch.randn(8, 16, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x).sum().backward()
    cpu = {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()}
    assert "aten::mm" in cpu and 0 < bound_mlp.gemm_ms(cpu) < sum(cpu.values())
    assert [e.count for e in prof.key_averages() if e.key == "aten::mm"] == [9]  # 3 fprop, 3 dgrad, 3 wgrad


def test_cli_without_cuda_says_so_and_checks_tokens(monkeypatch, capsys):
    env = {"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "bench.bound_mlp", "--fused-amax"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "needs a CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr
    monkeypatch.setattr(common, "DEVICE", "cpu")
    with pytest.raises(SystemExit):
        bound_mlp.main(["--tokens", "0"])
    assert "--tokens must be >= 1" in capsys.readouterr().err
    assert doctest.testmod(bound_mlp).failed == 0


def test_registered_in_bench_list(capsys):
    from bench.__main__ import BENCHMARKS, main
    assert BENCHMARKS["bound_mlp"].module == "bench.bound_mlp"
    assert main(["--list"]) == 0
    assert any(line.split()[0] == "bound_mlp" for line in capsys.readouterr().out.splitlines() if line.strip())
    rows = BENCHMARKS["bound_mlp"].headline({"bounds": [
        {"recipe": "hybridfp MXFP8", "floor": "BF16 decodes", "bound": 1.2, "target": 1.05, "measured": 0.98}]})
    assert rows == [("hybridfp MXFP8: BF16 decodes", "bound 1.200x (target 1.05x, device time now 0.980x)")]


def _cpu_profile(step):
    """bound_moe._profile's answer from one step's CPU profile (self CPU ms stand for device ms),
    calling the step's ``reset()`` before the profiled step as ``_profile`` does."""
    step()
    step.reset()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    ops = {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()}
    return sum(ops.values()), ops


def test_measure_profiles_the_baseline_and_every_recipe_on_the_cpu(monkeypatch):
    monkeypatch.setattr(common, "DEVICE", "cpu")
    monkeypatch.setattr(bound_mlp, "_profile", _cpu_profile)
    # CPU times of BF16 and emulated GEMMs say nothing of tensor cores: the share check is the GPU's
    checked = []
    monkeypatch.setattr(bound_mlp, "check_gemm_share", lambda *a: checked.append(a[0]))
    monkeypatch.setattr(bound_mlp, "check_baseline", lambda *a: checked.append("BF16"))
    m = bound_mlp.measure(128, 128, 256)
    assert checked == ["BF16"] + [n for n, _ in bench_mlp.RECIPES]  # every profile's GEMM time is checked
    assert (m.tokens, m.hidden, m.intermediate) == (128, 128, 256) and m.copy_GBps > 0
    assert 0 < m.bf16_gemm_ms < m.bf16_step_ms
    assert list(m.recipes) == [n for n, _ in bench_mlp.RECIPES]
    assert all(0 < gemm < step for step, gemm in m.recipes.values()), m.recipes
    assert all(r["bound"] > 0 for r in bound_mlp.bound_rows(m, bound_mlp.Premises()))


def test_gemm_classifier_names_torchs_scaled_mm():
    a = torch.randn(16, 32).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    assert "aten::_scaled_mm" in {e.key for e in prof.key_averages()} and "aten::_scaled_mm" in bound_mlp.GEMM_OPS


def test_a_recipe_whose_gemms_the_profiler_did_not_name_fails_by_name():
    bound_mlp.check_gemm_share("hybridfp MXFP8", 4.0, 9.0, {"aten::mm": 4.0})  # 0.44 of BF16's: plausible
    with pytest.raises(RuntimeError, match=r"'hybridfp MXFP8'.*GEMM op outside GEMM_OPS.*aten::new_gemm 8.00 ms"):
        bound_mlp.check_gemm_share("hybridfp MXFP8", 1.0, 9.0, {"aten::mm": 1.0, "aten::new_gemm": 8.0})


def test_a_baseline_profile_without_device_time_or_named_gemms_fails_by_name():
    bound_mlp.check_baseline(25.0, 24.0, {"aten::mm": 24.0})
    with pytest.raises(RuntimeError, match="no device time"):
        bound_mlp.check_baseline(0.0, 0.0, {"aten::mm": 0.0})
    with pytest.raises(RuntimeError, match=r"GEMMs took 1.000 of its 25.000.*aten::new_mm 23.00 ms"):
        bound_mlp.check_baseline(25.0, 1.0, {"aten::mm": 1.0, "aten::new_mm": 23.0})
