"""bench_quantize, bench_quantize_kernels, bench_grouped_gemm and bench_offload on the one
protocol: every ratio a ``paired_ratio`` against its named baseline, every output checked, a
missing baseline failing the run by name. CPU smoke runs (``common.DEVICE = "cpu"``, tiny sizes,
Triton under the interpreter) where a benchmark can run there, fakes for the GPU-only pieces."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from bench import bench_grouped_gemm, bench_offload, bench_quantize, bench_quantize_kernels, common
from bench.protocol import Protocol
from hybridfp.quantizers import MXFP8Quantizer, NVFP4Quantizer
from triton.runtime.errors import OutOfResources

FAST = ["--rounds", "2", "--samples", "1"]
PROTO = Protocol(rounds=2, samples=1, warmup=0)


@pytest.fixture
def cpu(monkeypatch):
    monkeypatch.setattr(common, "DEVICE", "cpu")


# ------------------------------------------------------------------ common helpers

def test_copy_step_moves_the_bytes_it_is_given(cpu):
    assert common.copy_step(100)().numel() == 50  # 50 read + 50 written
    with pytest.raises(ValueError, match="nbytes"):
        common.copy_step(1)


def test_driver_and_power_limit_from_nvidia_smi(monkeypatch):
    from bench import protocol
    monkeypatch.setattr(protocol, "smi_device", lambda: "GPU-1234")
    asked = []

    def smi(answer):
        def run(cmd, **kw):
            asked.append(cmd)
            return SimpleNamespace(stdout=answer)
        return run
    got = common.driver_and_power_limit(smi("580.159.03, 700.00\n"))
    assert got == {"driver": "580.159.03", "power_limit_w": 700.0}
    assert asked[0][-2:] == ["-i", "GPU-1234"] and "driver_version,enforced.power.limit" in asked[0][1]
    assert common.driver_and_power_limit(smi("580.159.03, [N/A]\n")) == {"driver": "580.159.03", "power_limit_w": None}
    assert common.driver_and_power_limit(smi("")) == {"driver": None, "power_limit_w": None}

    def absent(cmd, **kw):
        raise FileNotFoundError("nvidia-smi")
    assert common.driver_and_power_limit(absent) == {"driver": None, "power_limit_w": None}


def test_require_baseline_names_the_baseline_that_fails():
    def broken():
        raise RuntimeError("no cuBLAS")
    with pytest.raises(common.MissingBaselineError, match=r"grouped_gemm fc1: baseline 'cuBLAS' failed: RuntimeError"):
        common.require_baseline("grouped_gemm fc1", "cuBLAS", lambda: broken)


def test_quantize_error_bound_is_the_rounding_chain():
    assert common.quantize_error_bound("e4m3") == pytest.approx(2 * 2 ** -4 / 3 ** 0.5 + 2 ** -7)
    assert common.quantize_error_bound("e2m1", "e2m1") == pytest.approx(common.error_bound("e2m1", "e2m1", 1, 0))
    assert common.quantize_error_bound() == common.BF16_SLACK


# ------------------------------------------------------------------ quantize output checks

def _x() -> torch.Tensor:
    return torch.randn(64, 128, generator=torch.Generator().manual_seed(0)).bfloat16()


def test_check_encode_passes_the_reference_and_names_a_wrong_code(monkeypatch):
    q = MXFP8Quantizer()
    st = bench_quantize_kernels.check_encode("mxfp8 row+col", q, _x(), True, True)
    assert st.directions() == ("rowwise", "columnwise")
    real = MXFP8Quantizer.encode

    def one_bit_off(self, x, rowwise, columnwise, seed=None):
        s = real(self, x, rowwise, columnwise, seed)
        data = s.payload("columnwise")["data"]
        data.view(torch.uint8).view(-1)[7] ^= 1
        return s
    monkeypatch.setattr(MXFP8Quantizer, "encode", one_bit_off)
    with pytest.raises(common.AccuracyError, match=r"mxfp8 row\+col: columnwise\[data\] differs .* bit for bit"):
        bench_quantize_kernels.check_encode("mxfp8 row+col", q, _x(), True, True)


def test_check_encode_stochastic_rounding_within_the_format_bound(monkeypatch):
    q = NVFP4Quantizer(with_rht=True, stochastic_rounding=True)
    x = _x()
    bench_quantize_kernels.check_encode("nvfp4 sr", q, x, True, True)
    assert bench_quantize_kernels.element_formats(q, "columnwise") == ("e2m1",)
    real = NVFP4Quantizer.encode

    def other_stream(self, x, rowwise, columnwise, seed=None):  # another seed: other draws, still fine
        return real(self, x, rowwise, columnwise, 99)
    monkeypatch.setattr(NVFP4Quantizer, "encode", other_stream)
    bench_quantize_kernels.check_encode("nvfp4 sr", q, x, True, True)

    def wrong(self, x, rowwise, columnwise, seed=None):  # twice the input: far beyond the bound
        return real(self, 2 * x, rowwise, columnwise, seed)
    monkeypatch.setattr(NVFP4Quantizer, "encode", wrong)
    with pytest.raises(common.AccuracyError, match=r"nvfp4 sr: rowwise decode .* e2m1"):
        bench_quantize_kernels.check_encode("nvfp4 sr", q, x, True, True)


def test_element_formats_of_a_hybrid_rowwise_dequantized_copy():
    hq = bench_quantize.QUANTIZERS[[n for n, _ in bench_quantize.QUANTIZERS].index(
        "Hybrid NVFP4 / MXFP8 (rowwise_dequantized)")][1]()
    assert bench_quantize_kernels.element_formats(hq, "rowwise") == ("e2m1",)
    assert bench_quantize_kernels.element_formats(hq, "columnwise") == ("e2m1", "e4m3")


# ------------------------------------------------------------------ bench_quantize

@pytest.fixture
def tiny_quantize(cpu, monkeypatch):
    monkeypatch.setattr(bench_quantize, "QUICK_SHAPE", (64, 128))


def test_quantize_smoke_every_row_paired_against_a_copy(tiny_quantize, tmp_path):
    out = tmp_path / "q.json"
    bench_quantize.main(["--quick", *FAST, "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["failures"] == [] and result["protocol"]["reportable"] is False
    rows = result["rows"]
    assert len(rows) == 3 * len(bench_quantize.QUANTIZERS) - len(bench_quantize.SKIP)
    for r in rows:
        assert "error" not in r, r
        p = r["vs_copy"]
        assert len(p["rounds"]) == 2 and p["low"] <= p["ratio"] <= p["high"] and r["x_copy"] == p["ratio"]
    assert "NOT REPORTABLE" in result["markdown"] and "x copy [interval]" in result["markdown"]


def test_quantize_wrong_output_fails_the_run_by_name(tiny_quantize, monkeypatch, tmp_path):
    monkeypatch.setattr(bench_quantize, "QUANTIZERS", [q for q in bench_quantize.QUANTIZERS if q[0] == "MXFP8"])
    real = MXFP8Quantizer.encode
    monkeypatch.setattr(MXFP8Quantizer, "encode", lambda self, x, r, c, seed=None: real(self, -x, r, c, seed))
    with pytest.raises(SystemExit, match=r"quantize MXFP8 row: rowwise\[data\] differs"):
        bench_quantize.main(["--quick", *FAST, "--out", str(tmp_path / "q.json")])
    assert len(json.loads((tmp_path / "q.json").read_text())["failures"]) == 3


def test_quantize_row_that_raises_fails_the_run_by_name(tiny_quantize, monkeypatch, tmp_path):
    """Every listed copy of every format is to run: an exception in one row is no skipped row."""
    monkeypatch.setattr(bench_quantize, "QUANTIZERS", [q for q in bench_quantize.QUANTIZERS if q[0] == "MXFP8"])

    def broken(self, x, r, c, seed=None):
        raise RuntimeError("no kernel for this layout")
    monkeypatch.setattr(MXFP8Quantizer, "encode", broken)
    with pytest.raises(SystemExit, match=r"quantize MXFP8 row: RuntimeError: no kernel for this layout"):
        bench_quantize.main(["--quick", *FAST, "--out", str(tmp_path / "q.json")])
    result = json.loads((tmp_path / "q.json").read_text())
    assert len(result["failures"]) == 3 and all("error" in r for r in result["rows"])


def test_quantize_missing_copy_baseline_fails_by_name(tiny_quantize, monkeypatch, tmp_path):
    monkeypatch.setattr(bench_quantize, "QUANTIZERS", bench_quantize.QUANTIZERS[:1])

    def no_copy(nbytes):
        raise RuntimeError("out of memory")
    monkeypatch.setattr(bench_quantize, "copy_step", no_copy)
    with pytest.raises(SystemExit, match=r"baseline 'copy of \d+ bytes' failed: RuntimeError: out of memory"):
        bench_quantize.main(["--quick", *FAST])


# ------------------------------------------------------------------ bench_quantize_kernels

def test_quantize_kernels_smoke_copy_separate_and_single_ratios(cpu, tmp_path):
    out = tmp_path / "qk.json"
    bench_quantize_kernels.main(["--shape", "64", "128", *FAST, "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["failures"] == []
    rows = {r["case"]: r for r in result["rows"]}
    assert set(rows) == {c[0] for c in bench_quantize_kernels.CASES + bench_quantize_kernels.HYBRID_CASES}
    for r in rows.values():
        assert r["min_pct"] == pytest.approx(100 * r["vs_copy"]["ratio"])
        assert r["moved_pct"] == pytest.approx(r["min_pct"] * r["bytes_moved"] / r["bytes_min"])
    for name, *_, singles in bench_quantize_kernels.HYBRID_CASES:
        r = rows[name]
        assert r["slower_single"] in singles and len(r["vs_separate"]["rounds"]) == 2
        assert r["vs_max_single"] == pytest.approx(1 / r["vs_slower_single"]["ratio"])


def test_quantize_kernels_missing_single_format_baseline_fails_by_name(cpu, monkeypatch):
    monkeypatch.setattr(bench_quantize_kernels, "CASES", [c for c in bench_quantize_kernels.CASES
                                                          if c[0] in ("fp8 current row",)])
    monkeypatch.setattr(bench_quantize_kernels, "HYBRID_CASES", bench_quantize_kernels.HYBRID_CASES[:1])
    with pytest.raises(SystemExit, match=r"hybrid fp8 current row \+ fp8 block col: baseline single-format "
                                         r"case\(s\) \['fp8 block 1x128 col'\] not measured"):
        bench_quantize_kernels.main(["--shape", "32", "128", *FAST])


# ------------------------------------------------------------------ bench_grouped_gemm

def _blocks(splits, k=32, n=16, scaled=False):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(sum(splits), k, generator=g).bfloat16()
    b = torch.randn(len(splits), n, k, generator=g).bfloat16()
    sa, sb = (torch.rand(sum(splits), generator=g) + 0.5, torch.rand(len(splits), n, generator=g) + 0.5) \
        if scaled else (None, None)
    return a, b, sa, sb, bench_grouped_gemm.bf16_blocks(a, b, splits, sa, sb)


def test_grouped_rel_error_expert_by_expert():
    splits = [5, 0, 3]
    a, b, sa, sb, blocks = _blocks(splits, scaled=True)
    exact = torch.cat([(a[r:r + m].float() @ b[e].float().t()) * sa[r:r + m, None] * sb[e]
                       for e, (r, m) in enumerate(zip([0, 5, 5], splits))])
    assert bench_grouped_gemm.grouped_rel_error(exact.bfloat16(), blocks) < bench_grouped_gemm.OUTPUT_BOUND
    assert bench_grouped_gemm.grouped_rel_error([exact[:5], exact[5:]], blocks) == 0.0  # per-expert list
    swapped = torch.cat([exact[5:], exact[:5]])  # experts' rows in the wrong place
    with pytest.raises(common.AccuracyError, match="fc1 fprop: tma x"):
        bench_grouped_gemm.check_grouped("fc1 fprop: tma x", swapped, blocks)
    with pytest.raises(common.AccuracyError, match="7 rows"):
        bench_grouped_gemm.grouped_rel_error(exact[:7], blocks)


def test_measure_pairs_every_variant_with_every_baseline_and_checks_outputs(cpu):
    splits = [5, 0, 3]
    a, b, _, _, blocks = _blocks(splits)
    right = lambda: torch.cat([a[:5] @ b[0].t(), a[5:] @ b[2].t()])  # noqa: E731
    failures: list[str] = []

    def no_fit():
        raise OutOfResources(300000, 232448, "shared memory")

    def broken():
        raise RuntimeError("illegal memory access")
    rows = bench_grouped_gemm.measure(
        "bf16", "tiny", 1e6, {"vs_grouped_mm": ("base A", (right, blocks)), "vs_cublas": ("base B", (right, blocks))},
        {"good": (right, blocks), "wrong": (lambda: 2 * right(), blocks), "big": (no_fit, blocks),
         "broken": (broken, blocks)}, PROTO, failures)
    by = {r["variant"]: r for r in rows}
    assert by["base A"]["baseline"] == "vs_grouped_mm" and by["base A"]["ms"] > 0
    good = by["good"]
    for key in ("vs_grouped_mm", "vs_cublas"):
        assert len(good[key]["rounds"]) == 2 and good[key + "_text"].startswith(f"{good[key]['ratio']:.3f} [")
    assert "bf16 tiny: wrong" in by["wrong"]["error"]
    # a tile config that does not fit is reported, not a failure; any other exception fails the run
    assert by["big"]["error"].startswith("OutOfResources") and by["big"]["does_not_fit"]
    assert by["broken"]["error"] == "RuntimeError: illegal memory access" and "does_not_fit" not in by["broken"]
    assert failures == [by["wrong"]["error"], "grouped_gemm bf16 tiny: broken: RuntimeError: illegal memory access"]

    def missing():
        raise RuntimeError("torch._grouped_mm not built")
    with pytest.raises(common.MissingBaselineError, match=r"grouped_gemm bf16 tiny: baseline 'base A' failed"):
        bench_grouped_gemm.measure("bf16", "tiny", 1e6, {"vs_grouped_mm": ("base A", (missing, blocks))},
                                   {"good": (right, blocks)}, PROTO, [])
    with pytest.raises(common.AccuracyError, match="baseline base A"):
        bench_grouped_gemm.measure("bf16", "tiny", 1e6, {"vs_grouped_mm": ("base A", (lambda: -right(), blocks))},
                                   {"good": (right, blocks)}, PROTO, [])


def test_grouped_gemm_cpu_smoke_bf16_pointer_and_fp8(cpu, monkeypatch):
    monkeypatch.setattr(bench_grouped_gemm, "BF16_SHAPES", [("tiny", [5, 0, 1, 10], 32, 16)])
    failures: list[str] = []
    rows = bench_grouped_gemm.bf16_pointer_tiles([((16, 16, 16, 4, 2), 1)], PROTO, failures)
    assert [r["variant"] for r in rows] == ["torch._grouped_mm (no epilogue)", "pointer (16, 16, 16, 4, 2) g1"]
    assert rows[1]["rel_err"] <= bench_grouped_gemm.OUTPUT_BOUND and len(rows[1]["vs_grouped_mm"]["rounds"]) == 2
    monkeypatch.setattr(bench_grouped_gemm, "HIDDEN", 32)
    monkeypatch.setattr(bench_grouped_gemm, "FFN", 16)
    monkeypatch.setattr(bench_grouped_gemm, "ROWS", 100)
    monkeypatch.setattr(bench_grouped_gemm, "EXPERTS", 3)
    rows = bench_grouped_gemm.fp8([((16, 16, 32, 4, 2), 1, 32)], PROTO, failures, only="fc2 wgrad")
    ptr = rows[-1]
    assert [r.get("baseline") for r in rows[:3]] == ["vs_cublas", "vs_grouped_mm", "vs_grouped_mm_decoded"]
    assert ptr["rel_err"] <= bench_grouped_gemm.OUTPUT_BOUND
    assert {"vs_cublas", "vs_grouped_mm", "vs_grouped_mm_decoded"} <= set(ptr)
    assert failures == [] and not any(r.get("library_default") for r in rows)  # no TMA config swept


def test_grouped_gemm_marks_the_library_default_config(cpu, monkeypatch):
    """The TMA rows the library runs (the policy's FP8 configs, rows vs wgrad; BF16's TMA_CONFIG)
    are marked, and only they."""
    from hybridfp import current_policy
    from hybridfp.kernels.moe import triton_grouped_gemm as tg
    from hybridfp.kernels.moe.triton_grouped_fp8_tma import CONFIGS
    pol = current_policy()
    assert {pol.grouped_fp8_tma_rows, pol.grouped_fp8_tma_wgrad} <= set(CONFIGS)  # fp8() names "tma <config>"
    rows = [{"variant": f"tma {pol.grouped_fp8_tma_rows}"}, {"variant": f"tma {pol.grouped_fp8_tma_wgrad}"},
            {"variant": "pointer x"}]
    marked = bench_grouped_gemm.mark_library_default(rows, {f"tma {pol.grouped_fp8_tma_wgrad}"})
    assert [r.get("library_default", False) for r in marked] == [False, True, False]
    default = [bench_grouped_gemm._bf16_tma_name(c, cfg) for c, cfg in tg.TMA_CONFIGS.items() if cfg == tg.TMA_CONFIG]
    assert len(default) == 1  # one name a config: the headline finds one row
    assert [c for c, cfg in tg.TMA_F32_CONFIGS.items() if cfg == tg.TMA_F32_CONFIG] != []  # the FP32 sweep's


# ------------------------------------------------------------------ bench_offload

class _Fake:
    """A tiny CPU model standing in for the offloaded layers: ``run("on")`` may perturb a gradient or the output."""

    def __init__(self, perturb: bool = False, broken_off: bool = False, perturb_output: bool = False) -> None:
        self.lin = torch.nn.Linear(8, 8)
        self.x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
        self.perturb, self.broken_off, self.perturb_output = perturb, broken_off, perturb_output
        self.stats = SimpleNamespace(offloaded_bytes=0, late_reloads=0)

    def run(self, label: str) -> torch.Tensor:
        if label == "off" and self.broken_off:
            raise RuntimeError("layer failed")
        self.lin.zero_grad(set_to_none=True)
        y = self.lin(self.x)
        y.square().mean().backward()
        if label == "on":
            self.stats.offloaded_bytes += 1024
            if self.perturb:
                self.lin.bias.grad[0] += 1e-3
            if self.perturb_output:
                y = y + 1e-3
        return y

    def row(self) -> dict:
        return bench_offload.offload_row(
            "MXFP8", self.run, lambda: [self.lin.weight.grad, self.lin.bias.grad], ["fc.weight", "fc.bias"],
            self.memory, self.stats, PROTO)

    def memory(self, label: str) -> dict:
        self.run(label)
        return {"peak_gib": 2.0 if label == "off" else 1.5, "after_forward_gib": 1.0}


def test_offload_row_paired_against_the_step_without_offload(cpu):
    row = _Fake().row()
    p = row["vs_no_offload"]
    assert len(p["rounds"]) == 2 and row["step_cost"] == pytest.approx(1 / p["ratio"])
    assert row["ms_off"] == p["baseline_ms"] and row["peak_saved_gib"] == 0.5
    assert row["offloaded_gib_per_step"] == 1024 / 2 ** 30 and row["bitwise"] is True


def test_offload_gradients_differing_or_missing_baseline_fail_by_name(cpu):
    with pytest.raises(common.AccuracyError, match="offload MXFP8: gradient of fc.bias with offload differs"):
        _Fake(perturb=True).row()
    with pytest.raises(common.AccuracyError, match="offload MXFP8: the forward output with offload differs"):
        _Fake(perturb_output=True).row()
    with pytest.raises(common.MissingBaselineError, match="offload MXFP8: baseline 'the step without offload' failed"):
        _Fake(broken_off=True).row()


# ------------------------------------------------------------------ headlines

def _p(ratio):
    return {"ratio": ratio, "low": ratio - 0.01, "high": ratio + 0.01, "rounds": [], "clocks": {}}


def test_headlines_show_paired_ratios():
    from bench.__main__ import _grouped_gemm, _offload, _quantize, _quantize_kernels
    q = dict(_quantize({"rows": [{"quantizer": "MXFP8", "directions": "row+col", "path": "mxfp8", "vs_copy": _p(0.8)},
                                 {"quantizer": "MXFP8", "directions": "row", "vs_copy": _p(0.9)}]}))
    assert q == {"MXFP8 row+col (mxfp8) / copy of the same bytes": "0.800x [0.790, 0.810]"}
    qk = dict(_quantize_kernels({"rows": [
        {"case": "mxfp8 row+col", "vs_copy": _p(0.7)},
        {"case": "hybrid x", "slower_single": "nvfp4 row", "vs_copy": _p(0.5), "vs_slower_single": _p(0.85)}]}))
    assert qk["mxfp8 row+col: copy of the same bytes / encode"] == "0.700x [0.690, 0.710]"
    assert qk["hybrid x: slower single (nvfp4 row) / fused"].endswith("BELOW 0.91x TARGET")
    rows = [
        {"part": "fp8", "gemm": "fc1 fprop", "variant": "BF16 torch._grouped_mm", "baseline": "vs_grouped_mm", "ms": 1.0},
        {"part": "fp8", "gemm": "fc1 fprop", "variant": "tma a", "vs_grouped_mm": _p(1.2), "library_default": True},
        {"part": "fp8", "gemm": "fc1 fprop", "variant": "pointer b", "vs_grouped_mm": _p(1.4)},
        {"part": "fp8", "gemm": "fc1 fprop", "variant": "tma c", "error": "no fit"}]
    # the library's own config is the figure; the sweep's fastest only beside it
    assert dict(_grouped_gemm({"rows": rows})) == {
        "fp8 fc1 fprop: library default Triton (tma a) / torch._grouped_mm":
        "1.200x [1.190, 1.210] (fastest config of the sweep pointer b: 1.400x [1.390, 1.410])"}
    rows[1]["vs_grouped_mm_decoded"] = _p(1.1)
    assert dict(_grouped_gemm({"rows": rows}))["fp8 fc1 fprop: library default Triton (tma a) / torch._grouped_mm"] == (
        "1.200x [1.190, 1.210]; 1.100x [1.090, 1.110] on the FP8 values "
        "(fastest config of the sweep pointer b: 1.400x [1.390, 1.410])")
    rows[1].pop("library_default")
    assert dict(_grouped_gemm({"rows": rows})) == {"fp8 fc1 fprop: Triton / torch._grouped_mm": (
        "library default not measured; fastest config of the sweep pointer b: 1.400x [1.390, 1.410]")}
    off = dict(_offload({"rows": [{"recipe": "MXFP8", "peak_gib_off": 2.0, "peak_gib_on": 1.5,
                                   "vs_no_offload": _p(0.95)}, {"recipe": "FP8 current", "error": "gradient differs"}]}))
    assert off["CPU offload, MXFP8: peak GiB off / on, without / with offload"] == "2.00 / 1.50, 0.950x [0.940, 0.960]"
    assert off["CPU offload, FP8 current: peak GiB off / on, without / with offload"].startswith("FAILED")
