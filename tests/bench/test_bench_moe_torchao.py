"""bench_moe's torchao float8 baseline (``bench.moe_torchao``): run by name only, a baseline that
fails the run by name when torchao or an sm90 GPU is missing, token groups padded to torchao's
FP8 alignment without changing the routing, the hybridfp FP8 rows paired against it, and (where
torchao is installed) a conversion that targets exactly the experts' weights.

On the CPU (``bench.common.DEVICE = "cpu"``, tiny shapes, ``torch.compile``'s ``eager`` backend).
torchao's FP8 grouped GEMM has no CPU kernel: where it would run, these tests put a BF16
``torch._grouped_mm`` in its place that checks the operands as its CUDA kernel needs them."""

from __future__ import annotations

import functools
import json
import sys

import pytest
import torch

from bench import bench_moe, common, moe_layer, moe_rows, moe_torchao
from bench.__main__ import BENCHMARKS, MOE_TORCHAO_ROWS, _moe
from bench.moe_torchao import ALIGN, TORCHAO_EAGER_ROW, TORCHAO_ROW

FP8 = "hybridfp FP8 current"
FAST = ["--quick", "--micro-batches", "2", "--rounds", "2", "--samples", "1", "--compile-backend", "eager"]


def reference_fill(counts: torch.Tensor, experts: int, ranks: int, length: int, align: int):
    """generate_permute_indices' contract on one rank, written plainly: each expert's rows in order,
    its group rounded up to ``align`` rows (an empty expert given ``align``), -1 elsewhere."""
    assert ranks == 1
    sizes = [max(c, align) + (-max(c, align)) % align for c in counts.tolist()]
    index = torch.full((length,), -1, dtype=torch.int32)
    start = source = 0
    for c, s in zip(counts.tolist(), sizes):
        index[start:start + c] = torch.arange(source, source + c, dtype=torch.int32)
        start, source = start + s, source + c
    ends = torch.tensor(sizes).cumsum(0).to(torch.int32)
    return index, torch.tensor(sizes, dtype=torch.int32), ends


def _recording_grouped_mm(monkeypatch, seen: list):
    """``torch._grouped_mm`` recording each call's group sizes (``offs``) and B's layout."""
    real = torch._grouped_mm

    def grouped_mm(a, b, offs=None, **kw):
        if offs is not None and a.dim() == 2 and b.dim() == 3:
            seen.append((torch.diff(offs, prepend=offs.new_zeros(1)).tolist(), b.shape, b.stride(), offs.dtype))
        return real(a, b, offs=offs, **kw)
    monkeypatch.setattr(torch, "_grouped_mm", grouped_mm)


def _run(model, x, dy, schedule):
    """One 2-micro-batch step of ``model``: (outputs, dx, dW1, dW2), gradients released after."""
    step = moe_layer.Step(model, x, dy, None, 2, schedule)
    out = torch.cat([y.detach() for y in step()])
    grads = [g.clone() for g in getattr(model, "_orig_mod", model).expert_grads()]
    result = (out, x.grad.clone(), *grads)
    step.release()
    return result


def _close(got, want):
    for g, w in zip(got, want):
        assert torch.allclose(g.float(), w.float(), rtol=1e-2, atol=1e-3), (g - w).abs().max()


def test_the_torchao_rows_run_by_name_only(tiny):
    base, hf, _, _ = moe_layer.moe_layer(4, 32, 64, 64)
    default = [v[0] for v in moe_rows.variants_of(base, hf, None, False, "eager")]
    assert not set(moe_torchao.TORCHAO_ROWS) & set(default)  # the default moe / moe_64 runs do not grow
    named = [v[0] for v in moe_rows.variants_of(base, hf, [FP8, TORCHAO_ROW], False, "eager")]
    assert named == [*bench_moe.BASELINES, TORCHAO_ROW, FP8]  # torchao right after the BF16 baselines
    assert moe_torchao.selected(None) == [] and moe_torchao.selected([TORCHAO_EAGER_ROW, FP8]) == [TORCHAO_EAGER_ROW]
    assert not moe_rows.optional(TORCHAO_ROW) and moe_rows.is_baseline(TORCHAO_EAGER_ROW)
    with pytest.raises(moe_rows.UnknownRowError, match="by name only: torchao float8 rowwise"):
        moe_rows.variants_of(base, hf, ["torchao float8"], False, "eager")


def test_the_torchao_benchmarks_select_the_rows_they_need():
    assert MOE_TORCHAO_ROWS.split("|") == [TORCHAO_ROW, moe_rows.RECIPES[0][0]]
    for name, experts in (("moe_torchao", "8"), ("moe_64_torchao", "64")):
        b = BENCHMARKS[name]
        assert b.module == "bench.bench_moe" and not b.default and b.deadline_flag == "--deadline-s"
        assert b.args == ("--experts", experts, "--fastest-only", "--variants", MOE_TORCHAO_ROWS)
    assert BENCHMARKS["moe"].args == ("--experts", "8") and BENCHMARKS["moe_64"].args == ("--experts", "64")


def test_the_fp8_rows_are_paired_with_torchao_and_checked_by_its_formats():
    assert moe_torchao.paired_with_torchao(FP8) and moe_torchao.paired_with_torchao(FP8 + " [one weight Parameter]")
    for name in ("hybridfp MXFP8", "hybridfp Composer-2 (NVFP4 row-scaled fwd / MXFP8 bwd)",
                 "hybridfp BF16 (high_precision)", TORCHAO_ROW, bench_moe.BF16_GROUPED):
        assert not moe_torchao.paired_with_torchao(name)
    e4m3 = {t: common.error_bound("e4m3", "e4m3", *d) for t, d in bench_moe.DEPTHS.items()}
    assert bench_moe.error_bounds(TORCHAO_ROW) == bench_moe.error_bounds(TORCHAO_EAGER_ROW) == e4m3


def test_a_missing_torchao_fails_the_run_naming_the_row_and_what_to_do(tiny, monkeypatch):
    for name in [m for m in sys.modules if m.startswith("torchao.")] + ["torchao"]:
        monkeypatch.setitem(sys.modules, name, None)  # import torchao (and any of its modules) raises
    with pytest.raises(SystemExit) as exc:
        bench_moe.main(FAST + ["--variants", f"{TORCHAO_ROW}|{FP8}"])
    msg = str(exc.value.code)
    assert f"the baseline '{TORCHAO_ROW}' cannot run" in msg
    assert "torchao.prototype.moe_training" in msg and "pip install torchao==0.17.0" in msg


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_no_cuda_gpu_fails_the_torchao_row_naming_it(tiny, monkeypatch, device):
    monkeypatch.setattr(moe_torchao, "_torchao", lambda rows: (None, None, None, None))  # importable
    monkeypatch.setattr(common, "DEVICE", device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        bench_moe.main(FAST + ["--variants", TORCHAO_EAGER_ROW])
    msg = str(exc.value.code)
    assert f"the baseline '{TORCHAO_EAGER_ROW}' cannot run" in msg and "sm90" in msg and "H100" in msg


def test_padded_routing_aligns_every_group_and_routes_as_the_layer(tiny, monkeypatch):
    base, _, x, dy = moe_layer.moe_layer(4, 32, 64, 64)
    schedule = moe_layer.RoutingSchedule(64, 4, 2)
    want = _run(base.sharing("grouped"), x, dy, schedule)
    padded = base.sharing("grouped", kind=moe_torchao.TorchaoMoE)
    padded.fill = reference_fill
    seen: list = []
    _recording_grouped_mm(monkeypatch, seen)
    _close(_run(padded, x, dy, schedule), want)  # padding rows add nothing: y, dx, dW as unpadded
    counts = [moe_layer.Routing(x, base.router, 2, off).counts.tolist() for off in schedule(0)]
    assert any(c % ALIGN for cs in counts for c in cs)  # the skewed routing needs the padding
    assert len(seen) == 4  # fc1 and fc2 of both micro-batches
    for sizes, shape, stride, dtype in seen:
        assert all(s % ALIGN == 0 for s in sizes) and dtype == torch.int32
        assert stride[1] == 1  # B passed as the [E, K, N] transposed view of [E, N, K]: column-major
    r = moe_torchao.PaddedRouting(x, base.router, 2, schedule(0)[0], reference_fill)
    plain = moe_layer.Routing(x, base.router, 2, schedule(0)[0])
    real = r.token < x.shape[0]
    assert torch.equal(r.token[real], plain.token) and torch.equal(r.weight[real], plain.weight)
    assert not r.permute(x)[~real].any()  # the padding rows are zeros


def test_fp8_rows_are_paired_against_the_torchao_row(tiny, monkeypatch, tmp_path):
    calls = []
    real = bench_moe.paired_ratio
    monkeypatch.setattr(bench_moe, "paired_ratio", lambda b, c, p: calls.append(p) or real(b, c, p))
    monkeypatch.setattr(moe_torchao, "require", lambda rows: "stand-in")
    # torchao's layer with a BF16 stand-in for its GEMMs: the pairing and checks, not torchao's kernels
    monkeypatch.setattr(moe_torchao, "build", lambda name, base, backend: base.sharing("grouped"))
    out = tmp_path / "moe.json"
    bench_moe.main(FAST + ["--fastest-only", "--variants", f"{TORCHAO_ROW}|{FP8}", "--out", str(out)])
    result = json.loads(out.read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    fastest = rows[FP8]["fastest_bf16"]
    # per-expert and compiled vs grouped; torchao vs the fastest; FP8 vs the fastest and vs torchao
    assert len(calls) == 5
    assert rows[TORCHAO_ROW]["x_bf16"].keys() == {fastest} and "x_torchao" not in rows[TORCHAO_ROW]
    assert rows[TORCHAO_ROW]["breaches"] == [] and not rows[TORCHAO_ROW]["baseline"]
    assert rows[FP8]["x_bf16"].keys() == {fastest} and rows[FP8]["x_torchao"].keys() == {TORCHAO_ROW}
    assert result["env"]["torchao"] == "stand-in" and "x torchao" in result["markdown"]
    headline = dict(_moe(result))
    assert headline[f"4 experts, ffn 32: {FP8}"].endswith(f"vs {TORCHAO_ROW}")
    assert headline[f"4 experts, ffn 32: {TORCHAO_ROW}"].endswith(f"vs {fastest}")


def test_a_failing_torchao_row_is_a_missing_baseline(tiny, monkeypatch):
    class Broken(torch.nn.Module):
        def forward(self, x, offset=None):
            raise RuntimeError("no sm90 kernel")
    monkeypatch.setattr(moe_torchao, "require", lambda rows: "stand-in")
    monkeypatch.setattr(moe_torchao, "build", lambda name, base, backend: Broken())
    with pytest.raises(SystemExit) as exc:
        bench_moe.main(FAST + ["--variants", f"{TORCHAO_ROW}|{FP8}"])
    msg = str(exc.value.code)
    assert f"the baseline '{TORCHAO_ROW}'" in msg and "no sm90 kernel" in msg


@pytest.fixture
def torchao_on_cpu(monkeypatch):
    """torchao's prototype with its CPU index kernel and, for its FP8 grouped GEMM (no CPU
    kernel), a BF16 ``torch._grouped_mm`` that checks its operands as the CUDA kernel needs them:
    A row-major, B column-major, every group a multiple of 16 rows (its weight gradient's rule)."""
    pytest.importorskip("torchao")
    tensor = pytest.importorskip("torchao.prototype.moe_training.tensor")
    kernels = pytest.importorskip("torchao.prototype.moe_training.ep.kernels")
    seen: list = []

    def fp8_grouped_mm(a, b_t, config, offs=None):
        sizes = torch.diff(offs, prepend=offs.new_zeros(1))
        assert a.stride(-1) == 1 and b_t.stride(-2) == 1 and offs.dtype == torch.int32
        # checked on the tensors, not in Python: a graph break here would cut the weights'
        # gradients off under torch.compile
        torch._assert_async((sizes % ALIGN == 0).all())
        seen.append((tuple(b_t.shape), config))
        return torch._grouped_mm(a, b_t, offs=offs)
    monkeypatch.setattr(tensor, "_quantize_then_scaled_grouped_mm", fp8_grouped_mm)
    monkeypatch.setattr(kernels, "generate_permute_indices",
                        functools.partial(kernels.generate_permute_indices, use_cpu=True))
    return seen


def test_torchaos_padding_order_is_the_one_the_cpu_tests_assume(tiny, torchao_on_cpu):
    from torchao.prototype.moe_training.ep.kernels import generate_permute_indices
    x, router = torch.randn(64, 64), torch.randn(4, 64)
    for off in moe_layer.RoutingSchedule(64, 4, 2)(0):
        counts = moe_layer.Routing(x, router, 2, off).counts.to(torch.int32)
        length = 128 + 4 * ALIGN
        for mine, theirs in zip(reference_fill(counts, 4, 1, length, ALIGN),
                                generate_permute_indices(counts, 4, 1, length, ALIGN)):
            assert torch.equal(mine, theirs.to(mine.dtype))


def test_the_conversion_targets_exactly_the_expert_weights(tiny, torchao_on_cpu):
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.prototype.moe_training.tensor import Float8TrainingWeightWrapperTensor
    base, _, x, dy = moe_layer.moe_layer(4, 32, 64, 64)
    layer = moe_torchao.torchao_layer(base)
    converted = {n for n, p in layer.named_parameters() if isinstance(p, Float8TrainingWeightWrapperTensor)}
    assert converted == set(moe_torchao.EXPERT_WEIGHTS) == {"w1", "w2"}
    assert layer.router is base.router  # the router stays as it is
    assert not any(isinstance(p, Float8TrainingWeightWrapperTensor) for p in base.parameters())
    for w in moe_torchao.EXPERT_WEIGHTS:
        config = getattr(layer, w).config
        assert config == Float8TrainingOpConfig() and config.float8_dtype == torch.float8_e4m3fn
        assert not config.pad_token_groups_for_grouped_mm  # the routing pads instead
    schedule = moe_layer.RoutingSchedule(64, 4, 2)
    want = _run(base.sharing("grouped"), x, dy, schedule)
    _close(_run(layer, x, dy, schedule), want)
    assert [s for s, _ in torchao_on_cpu] == [(4, 64, 64), (4, 32, 64)] * 2  # w1ᵀ, w2ᵀ: [E, K, N], each micro-batch
    torchao_on_cpu.clear()
    _close(_run(moe_torchao.build(TORCHAO_ROW, base, "eager"), x, dy, schedule), want)
    assert {s for s, _ in torchao_on_cpu} == {(4, 64, 64), (4, 32, 64)}  # compiled: the same GEMMs


def test_without_the_padding_torchaos_fp8_gemm_gets_misaligned_groups(tiny, torchao_on_cpu, monkeypatch):
    base, _, x, dy = moe_layer.moe_layer(4, 32, 64, 64)
    monkeypatch.setattr(moe_torchao, "ALIGN", 1)  # the routing's own counts
    with pytest.raises(RuntimeError, match="single nonzero value, but got zero"):  # the alignment check
        _run(moe_torchao.torchao_layer(base), x, dy, moe_layer.RoutingSchedule(64, 4, 2))


def test_the_torchao_rows_run_end_to_end(tiny, torchao_on_cpu, monkeypatch, tmp_path):
    monkeypatch.setattr(moe_torchao, "require", lambda rows: "0.17.0 on the CPU")
    out = tmp_path / "moe.json"
    bench_moe.main(FAST + ["--fastest-only", "--variants", f"{TORCHAO_ROW}|{TORCHAO_EAGER_ROW}|{FP8}",
                           "--out", str(out)])
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    for name in (TORCHAO_ROW, TORCHAO_EAGER_ROW):
        assert rows[name]["breaches"] == [] and rows[name]["bounds"] == bench_moe.error_bounds(name)
    assert rows[FP8]["x_torchao"].keys() == {TORCHAO_ROW, TORCHAO_EAGER_ROW}
    assert torchao_on_cpu  # torchao's grouped GEMM took the experts' GEMMs


def test_the_compiled_row_is_traced_at_fixed_shapes(tiny, torchao_on_cpu, monkeypatch):
    """The layer runs the forward the compiled BF16 baseline traced first at the unpadded row count:
    without ``dynamic=False`` automatic dynamic shapes would trace torchao's at a symbolic one."""
    seen: dict = {}
    monkeypatch.setattr(moe_torchao.torch, "compile", lambda layer, **kw: seen.update(kw) or layer)
    base, *_ = moe_layer.moe_layer(4, 32, 64, 64)
    moe_torchao.build(TORCHAO_ROW, base, "eager")
    assert seen == {"backend": "eager", "dynamic": False}
