"""GroupedLinear's per-expert host work: the grouped quantization of x, dy and the weights
(``quantize_grouped`` / ``quantize_weights_grouped``) and the per-expert emulation on jointly
decoded operands give, bit for bit, the step of the fully per-expert loop (each expert's own
``quantize`` and ``gemm()``); and the aten ops a step dispatches grow with the number of
experts by no more than a stated bound per recipe (so the speedup cannot silently regress)."""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import replace

import pytest
import torch
from nn_cases import assert_bitwise

from bench.bench_moe_overhead import RECIPES, ops_per_step
import hybridfp
from hybridfp import CustomRecipe, GroupedLinear, autocast
from hybridfp import factories
from hybridfp.moe import gemm as grouped
from hybridfp.moe import grouped_linear_function, grouped_weights
from hybridfp.quantizers import Float8CurrentScalingQuantizer, MXFP8Quantizer

IN = 64
AWKWARD = [0, 19, 45, 1, 33]  # an empty expert, counts not multiples of 16 / 32 / 128
FACTORIES = {**factories.BASE, **factories.ZOO}


def _quantize_each(quantizers, x, splits, plans=None):
    return [None if q is None else q.quantize(xe) for q, xe in zip(quantizers, torch.split(x, list(splits)))]


def _quantize_weights_each(quantizers, weights, plans=None, stacked=None):
    return [q.quantize(w.detach()) for q, w in zip(quantizers, weights)]


def per_expert_gemms(monkeypatch) -> None:
    """No Triton grouped GEMM by expert count (its CUDA default from the policy's many_experts on):
    its accumulation order differs from the per-expert GEMMs', so bitwise comparisons with
    the per-expert loop keep the pairs it would take on their per-expert GEMMs."""
    # the thread's policy, undone with the other patches (as tests/conftest.py's set_policy)
    monkeypatch.setattr(hybridfp.config._CURRENT, "policy", replace(hybridfp.current_policy(), many_experts=1 << 30))


def per_expert_loop(monkeypatch) -> None:
    """The reference: every quantization and every GEMM per expert (``gemm()``)."""
    per_expert_gemms(monkeypatch)
    monkeypatch.setattr(grouped_linear_function, "quantize_grouped", _quantize_each)
    monkeypatch.setattr(grouped_weights, "quantize_weights_grouped", _quantize_weights_each)
    monkeypatch.setattr(grouped, "_emulated_operands", lambda *a: None)
    monkeypatch.setattr(grouped, "_common_backend", lambda sa, sb, layout: None)


def step(m: GroupedLinear, splits: list[int], factory, out: int):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(sum(splits), IN, generator=g).bfloat16().requires_grad_()
    dy = torch.randn(sum(splits), out, generator=g).bfloat16()
    torch.manual_seed(11)
    with autocast(recipe=CustomRecipe(qfactory=factory)):
        y = m(x, splits)
    y.backward(dy)
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    return y.detach(), x.grad, grads


@pytest.mark.parametrize("out", [128, 48], ids=["N=128", "N=48"])  # whole / partial 32- and 128-row blocks
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_step_equals_per_expert_loop(name, bias, out, monkeypatch):
    torch.manual_seed(1)
    m = GroupedLinear(len(AWKWARD), IN, out, bias=bias, params_dtype=torch.bfloat16)
    fresh = copy.deepcopy(m)  # delayed scaling's state moves after a step
    got = step(m, AWKWARD, FACTORIES[name], out)
    per_expert_loop(monkeypatch)
    want = step(fresh, AWKWARD, FACTORIES[name], out)
    assert_bitwise(got[0], want[0], f"{name} output")
    assert_bitwise(got[1], want[1], f"{name} input grad")
    assert sorted(got[2]) == sorted(want[2])
    for n in want[2]:
        assert_bitwise(got[2][n], want[2][n], f"{name} {n}.grad")


@pytest.mark.parametrize("splits", [[0, 0, 0], [64, 0, 0], [32, 32, 64]])
def test_zero_and_aligned_groups(splits, monkeypatch):
    """All-empty, one expert only, and groups that need no padding."""
    torch.manual_seed(2)
    m = GroupedLinear(3, IN, 64, bias=False, params_dtype=torch.bfloat16)
    fresh = copy.deepcopy(m)
    for name in ("mxfp8", "float8_block_scaling", "nvfp4_row_scaled_fwd_mxfp8_bwd"):
        got = step(m, splits, FACTORIES[name], 64)
        with monkeypatch.context() as mp:
            per_expert_loop(mp)
            want = step(fresh, splits, FACTORIES[name], 64)
        for a, b in zip(got[:2], want[:2]):
            assert_bitwise(a, b, name)
        for n in want[2]:
            assert_bitwise(got[2][n], want[2][n], f"{name} {n}")
        m.zero_grad(set_to_none=True)
        fresh.zero_grad(set_to_none=True)


def test_weights_quantized_once_per_change(monkeypatch):
    """The grouped weight quantization keeps ``quantized_weight``'s cache: a second forward
    re-quantizes nothing; changing one weight re-quantizes that expert only."""
    calls: list[int] = []
    real = grouped_weights.quantize_weights_grouped

    def spy(qs, ws, plans=None, **k):
        calls.append(len(ws))
        return real(qs, ws, plans, **k)
    monkeypatch.setattr(grouped_weights, "quantize_weights_grouped", spy)
    m = GroupedLinear(4, IN, 64, bias=False, params_dtype=torch.bfloat16)
    x = torch.randn(40, IN).bfloat16()
    recipe = CustomRecipe(qfactory=factories.mxfp8)
    with torch.no_grad(), autocast(recipe=recipe):
        first = m(x, [10, 10, 10, 10])
        m(x, [10, 10, 10, 10])
        m.weight2.mul_(2)
        changed = m(x, [10, 10, 10, 10])
    assert calls == [4, 1]
    assert torch.equal(first[:20], changed[:20]) and not torch.equal(first[20:30], changed[20:30])


#: Aten ops per extra expert in one forward + backward step on the CPU (bench_moe_overhead's
#: shape; E=8 vs E=32), with per-tensor scales grouped (one segmented amax and one cast for all
#: experts: FP8 current, NVFP4 1D rows) and shared columnwise copies handed out as views:
#: bf16 23, mxfp8 73, fp8 current 31, fp8 block 65, composer-2 142. What is left is mostly the
#: CPU's per-expert exact emulation of the three GEMMs (~7-12 ops per expert and GEMM, decoding
#: the copies that are not joined). Composer-2's input is one hybrid encode of the zero-padded
#: groups (the fused NVFP4 -> MXFP8 kernel on CUDA instead of a PyTorch FP32 dequantize of the
#: rows), so its rowwise copies sit at padded starts and the CPU emulation decodes them per
#: expert (on CUDA its row-scaled fprop runs per expert, decoding per expert, either way). The
#: bounds leave ~10%. Counted by ``python -m bench.bench_moe_overhead``.
OPS_PER_EXPERT = {"bf16 (high_precision)": 26, "mxfp8": 81, "fp8 current": 35, "fp8 block": 72,
                  "composer-2": 155}


@pytest.mark.parametrize("name", list(RECIPES))
def test_ops_per_expert_bounded(name):
    small, large = ops_per_step(RECIPES[name](), 8), ops_per_step(RECIPES[name](), 32)
    per_expert = (large - small) / 24
    assert per_expert <= OPS_PER_EXPERT[name], f"{name}: {per_expert:.1f} ops per expert"


def test_grouped_quantization_shares_encodings(monkeypatch):
    """MXFP8: one encode call per shared copy per step, whatever the number of experts:
    x (rowwise + padded columnwise), the stacked weights (both copies), dy (rowwise + columnwise)."""
    counts: Counter = Counter()
    real = MXFP8Quantizer.encode

    def spy(self, x, rowwise, columnwise, seed=None):
        counts[(rowwise, columnwise)] += 1
        return real(self, x, rowwise, columnwise, seed)
    monkeypatch.setattr(MXFP8Quantizer, "encode", spy)
    for experts in (4, 16):
        counts.clear()
        ops_per_step(RECIPES["mxfp8"](), experts)
        # two steps (warm-up + counted): x row, x col, W both, dy row, dy col per step
        assert counts == Counter({(True, False): 4, (False, True): 4, (True, True): 2}), (experts, counts)


def test_fp8_current_scales_computed_for_all_experts(monkeypatch):
    """FP8 current scaling: no per-expert encode at all (x, dy and the stacked weights each get
    one segmented amax and one cast), whatever the number of experts."""
    calls: Counter = Counter()
    real = Float8CurrentScalingQuantizer.encode

    def spy(self, x, rowwise, columnwise, seed=None):
        calls[(rowwise, columnwise)] += 1
        return real(self, x, rowwise, columnwise, seed)
    monkeypatch.setattr(Float8CurrentScalingQuantizer, "encode", spy)
    for experts in (4, 16):
        ops_per_step(RECIPES["fp8 current"](), experts)
        assert not calls, (experts, calls)


#: The same on the GPU's paths (grouped BF16 / FP8 GEMMs, cuBLAS FP8 backends; matmuls stubbed:
#: ``python -m bench.bench_moe_overhead --cuda-paths --stub-cublas``), the host work an H200 step
#: pays per expert: bf16 9.0, mxfp8 1.0, fp8 current 15.8, fp8 block 84.9, composer-2 53.0
#: (per-expert backend calls without gemm()'s checks, one split per payload, one padding pass for
#: the BF16 wgrad, scale vectors in three ops). fp8 block and composer-2 decode / emulate per
#: expert on the CPU where the GPU runs cuBLAS or kernels. Bounds leave ~10%.
OPS_PER_EXPERT_GPU_PATHS = {"bf16 (high_precision)": 10, "mxfp8": 2, "fp8 current": 17.5, "fp8 block": 94,
                            "composer-2": 59}


@pytest.mark.parametrize("name", list(RECIPES))
def test_ops_per_expert_bounded_on_gpu_paths(name, monkeypatch):
    from bench.bench_moe_overhead import stub_cublas
    monkeypatch.setattr(grouped, "_grouped_mm_device", lambda device: True)
    stub_cublas(monkeypatch.setattr)
    small, large = ops_per_step(RECIPES[name](), 8), ops_per_step(RECIPES[name](), 32)
    per_expert = (large - small) / 24
    assert per_expert <= OPS_PER_EXPERT_GPU_PATHS[name], f"{name}: {per_expert:.1f} ops per expert"


#: Python function calls per expert a step on the GPU's paths (``python -m bench.bench_moe_overhead
#: --cuda-paths --stub-cublas --stub-grouped-mm --stub-kernels``: quantize kernels taken as on
#: CUDA, every launch a no-op): the host's per-expert Python work, counted deterministically
#: (wall-clock times on a CPU are too noisy), as (experts from, to) -> bound. From 8 to 32
#: experts (across ``many_experts``: 8 take the per-expert GEMMs) counted bf16 14, mxfp8 13, fp8
#: current -44.3, fp8 block 416 (per-expert cuBLAS block GEMMs), composer-2 -25.4 (negative: their
#: GEMMs move to the Triton grouped kernels from 16 experts on); from 32 to 64 (all on the grouped
#: paths but fp8 block) bf16 14, mxfp8 13, fp8 current 10, fp8 block 409, composer-2 21. What keeps
#: them low: plans remembered per module with their derivation facts, C-level plan keys and
#: hybrid checks, LinearContexts and their randomness reused, per-expert checks as list
#: comprehensions (a generator is a Python frame per element), storages' ``directions()`` without a
#: call per direction, the weights read from the Parameter table, the experts' usage flags set in
#: one call (``set_usages``). Bounds leave ~15 % (a few calls
#: for the near-zero and negative ones).
CALLS_PER_EXPERT_GPU_PATHS = {
    (8, 32): {"bf16 (high_precision)": 16, "mxfp8": 15, "fp8 current": 3, "fp8 block": 480, "composer-2": 3},
    (32, 64): {"bf16 (high_precision)": 16, "mxfp8": 15, "fp8 current": 12, "fp8 block": 470, "composer-2": 24},
}


@pytest.mark.parametrize("experts", list(CALLS_PER_EXPERT_GPU_PATHS), ids=lambda e: f"{e[0]}-{e[1]}")
@pytest.mark.parametrize("name", list(RECIPES))
def test_python_calls_per_expert_bounded_on_gpu_paths(name, experts, monkeypatch):
    from bench.bench_moe_overhead import python_calls_per_step, stub_gpu_paths
    stub_gpu_paths(monkeypatch.setattr)
    with hybridfp.policy(decoded_copies="always"):  # the copies the GPU's quantize kernels write
        small = python_calls_per_step(RECIPES[name](), experts[0])
        large = python_calls_per_step(RECIPES[name](), experts[1])
    per_expert = (large - small) / (experts[1] - experts[0])
    bound = CALLS_PER_EXPERT_GPU_PATHS[experts][name]
    assert per_expert <= bound, f"{name}, {experts[0]} to {experts[1]} experts: {per_expert:.1f} Python calls per expert"
