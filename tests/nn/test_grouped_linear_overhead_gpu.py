"""On the GPU (quantize kernels, grouped GEMM paths): a GroupedLinear step with the grouped
quantization of x, dy and the stacked weights equals the per-expert loop bitwise, at the MoE
benchmark's expert shape (hidden 4096, ffn 1408: whole 32- and 128-row weight blocks) with
uneven token counts. Runs on a CUDA GPU (``pytest -m gpu``)."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from nn_cases import assert_bitwise
from test_grouped_linear_overhead import FACTORIES, per_expert_gemms, per_expert_loop

from hybridfp import CustomRecipe, GroupedLinear, autocast

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
HIDDEN, FFN = 4096, 1408
SPLITS = [0, 517, 33, 1024, 1, 250, 96, 700]


def cuda_step(m: GroupedLinear, factory, splits=SPLITS):
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(sum(splits), HIDDEN, generator=g, device="cuda").bfloat16().requires_grad_()
    dy = torch.randn(sum(splits), FFN, generator=g, device="cuda").bfloat16()
    torch.manual_seed(11)
    with autocast(recipe=CustomRecipe(qfactory=factory)):
        y = m(x, splits)
    y.backward(dy)
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["high_precision", "mxfp8", "current_scaling", "float8_block_scaling",
                                  "nvfp4_row_scaled_fwd_mxfp8_bwd"])
def test_step_equals_per_expert_loop_cuda(name, monkeypatch):
    torch.manual_seed(1)
    m = GroupedLinear(len(SPLITS), HIDDEN, FFN, bias=False, params_dtype=torch.bfloat16, device="cuda")
    fresh = copy.deepcopy(m)
    got = cuda_step(m, FACTORIES[name])
    per_expert_loop(monkeypatch)
    want = cuda_step(fresh, FACTORIES[name])
    assert_bitwise(got[0], want[0], f"{name} output")
    assert_bitwise(got[1], want[1], f"{name} input grad")
    for n in want[2]:
        assert_bitwise(got[2][n], want[2][n], f"{name} {n}.grad")


#: The MoE benchmark's layer: 64 experts, uneven counts (some empty, some not multiples of 16).
SPLITS64 = [0 if e in (1, 40) else (e * 37) % 301 + (e % 3) for e in range(64)]


@pytest.mark.parametrize("name", ["current_scaling", "nvfp4_row_scaled_fwd_mxfp8_bwd"])
def test_step_equals_per_expert_loop_64_experts(name, monkeypatch):
    """Per-expert per-tensor scales computed for all 64 experts at once (grouped FP8 current /
    NVFP4 kernels) give the per-expert loop's step bit for bit."""
    torch.manual_seed(1)
    m = GroupedLinear(64, HIDDEN, FFN, bias=False, params_dtype=torch.bfloat16, device="cuda")
    fresh = copy.deepcopy(m)
    per_expert_gemms(monkeypatch)  # the grouped quantization is under test here, not the GEMM path
    got = cuda_step(m, FACTORIES[name], SPLITS64)
    per_expert_loop(monkeypatch)
    want = cuda_step(fresh, FACTORIES[name], SPLITS64)
    assert_bitwise(got[0], want[0], f"{name} output")
    assert_bitwise(got[1], want[1], f"{name} input grad")
    for n in want[2]:
        assert_bitwise(got[2][n], want[2][n], f"{name} {n}.grad")


def test_64_experts_default_takes_triton_grouped_fprop(monkeypatch):
    """At 64 experts the default Composer-2 step runs its row-scaled NVFP4 fprop as one Triton
    grouped GEMM (the policy's many_experts). Against the per-expert loop: the output agrees
    to FP32 accumulation order (only the order of the K sum differs, then one BF16 rounding:
    relative norm error 1e-4, no difference above one BF16 ulp of the largest output), and the
    gradients, whose GEMMs do not read the output, are bitwise equal."""
    from hybridfp.moe.gemm import PATH_COUNTS
    torch.manual_seed(1)
    m = GroupedLinear(64, HIDDEN, FFN, bias=False, params_dtype=torch.bfloat16, device="cuda")
    fresh = copy.deepcopy(m)
    before = PATH_COUNTS.copy()
    got = cuda_step(m, FACTORIES["nvfp4_row_scaled_fwd_mxfp8_bwd"], SPLITS64)
    assert (PATH_COUNTS - before)[("fprop", "grouped_triton")] == 1
    per_expert_loop(monkeypatch)
    want = cuda_step(fresh, FACTORIES["nvfp4_row_scaled_fwd_mxfp8_bwd"], SPLITS64)
    err = ((got[0].float() - want[0].float()).norm() / want[0].float().norm()).item()
    assert err < 1e-4, f"Triton grouped fprop vs per expert: relative error {err:.3g}"
    worst = ((got[0].float() - want[0].float()).abs().max() / want[0].float().abs().max()).item()
    assert worst <= 2.0 ** -7, f"Triton grouped fprop vs per expert: max difference {worst:.3g} of max |y|"
    assert_bitwise(got[1], want[1], "input grad")
    for n in want[2]:
        assert_bitwise(got[2][n], want[2][n], f"{n}.grad")


@pytest.mark.parametrize("name", ["high_precision", "mxfp8"])
def test_64_experts_run_on_joined_copies(name, monkeypatch):
    """At 64 experts BF16 and MXFP8 steps run all three GEMMs on the experts' joined copies
    (``moe/gemm_joined.py``) without building a per-expert tensor, bitwise the step whose
    GEMMs take the per-expert lists (the same torch._grouped_mm path)."""
    from test_grouped_joined import ALL_GROUPED_BF16, count_cuts

    from hybridfp.moe import gemm as g
    torch.manual_seed(1)
    m = GroupedLinear(64, HIDDEN, FFN, bias=False, params_dtype=torch.bfloat16, device="cuda")
    fresh = copy.deepcopy(m)
    built = count_cuts(monkeypatch)
    g.PATH_COUNTS.clear()
    got = cuda_step(m, FACTORIES[name], SPLITS64)
    assert built == [] and dict(g.PATH_COUNTS) == ALL_GROUPED_BF16
    monkeypatch.setattr(g, "_run_joined", lambda *a: None)
    want = cuda_step(fresh, FACTORIES[name], SPLITS64)
    assert_bitwise(got[0], want[0], f"{name} output")
    assert_bitwise(got[1], want[1], f"{name} input grad")
    for n in want[2]:
        assert_bitwise(got[2][n], want[2][n], f"{name} {n}.grad")


def test_64_experts_fp8_on_joined_copies_and_triton_fp8_grouped(monkeypatch):
    """At 64 experts the FP8-current step holds x, dy and the stacked weights as joined copies
    with per-expert scales and runs all three GEMMs on them as one Triton FP8 grouped GEMM each
    (moe/gemm_fp8.py), building no per-expert tensor. Against the same step with per-expert
    cuBLAS GEMMs on the per-expert tensors: output and gradients differ only by the FP8 MMA's
    accumulation order (both promote to FP32 every K block): relative norm difference below
    1e-3 (a wrong scale, expert or block would be O(1); BF16 rounding flips alone give ~1e-4);
    an expert without tokens gets the same zero gradient."""
    from hybridfp.moe import gemm as g
    from hybridfp.moe import assemble as qg
    built: list[int] = []
    real_cut = qg._cut_scaled
    monkeypatch.setattr(qg, "_cut_scaled", lambda *a: built.append(len(a[1])) or real_cut(*a))
    torch.manual_seed(1)
    m = GroupedLinear(64, HIDDEN, FFN, bias=False, params_dtype=torch.bfloat16, device="cuda")
    fresh = copy.deepcopy(m)
    before = Counter(g.PATH_COUNTS)
    got = cuda_step(m, FACTORIES["current_scaling"], SPLITS64)
    paths = Counter(g.PATH_COUNTS) - before
    assert paths == Counter({(gemm, "grouped_fp8_triton"): 1 for gemm in ("fprop", "dgrad", "wgrad")}), paths
    assert built == [], built
    per_expert_gemms(monkeypatch)
    want = cuda_step(fresh, FACTORIES["current_scaling"], SPLITS64)
    pairs = [("output", got[0], want[0]), ("input grad", got[1], want[1])]
    pairs += [(f"{n}.grad", got[2][n], want[2][n]) for n in want[2]]
    for what, a, b in pairs:
        if b.float().norm() == 0:  # an expert without tokens: zero gradient on both paths
            assert_bitwise(a, b, what)
            continue
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        print(f"\n{what}: Triton FP8 grouped vs cuBLAS per expert, relative difference {err:.3g}")
        assert err < 1e-3, f"{what}: relative difference {err:.3g}"


#: Recipes whose GroupedLinear step should queue all its work without waiting for the GPU.
NO_SYNC = ["high_precision", "mxfp8", "current_scaling", "float8_block_scaling", "nvfp4_row_scaled_fwd_mxfp8_bwd"]


@pytest.mark.parametrize("experts", [8, 64])
@pytest.mark.parametrize("name", NO_SYNC)
def test_step_has_no_host_sync(name, experts):
    """With m_splits given as a list, a warmed-up forward + backward makes no host-device sync
    (``torch.cuda.set_sync_debug_mode("error")`` raises on any): every offset / split tensor is
    queued from pinned memory (``utils.device``). A sync drains the GPU's queue and leaves it
    idle while the host prepares the next launches (23 syncs in a MoE step cost ~8 % of its
    time on an NVIDIA H200)."""
    splits = SPLITS if experts == len(SPLITS) else SPLITS64
    torch.manual_seed(1)
    m = GroupedLinear(experts, HIDDEN, FFN, bias=False, params_dtype=torch.bfloat16, device="cuda")
    cuda_step(m, FACTORIES[name], splits)  # compiles kernels, fills caches
    x = torch.randn(sum(splits), HIDDEN, device="cuda").bfloat16().requires_grad_()
    dy = torch.randn(sum(splits), FFN, device="cuda").bfloat16()
    recipe = CustomRecipe(qfactory=FACTORIES[name])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with autocast(recipe=recipe):
            y = m(x, splits)
        y.backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(x.grad.float()).all()


def test_large_fp8_experts_step_equals_per_expert_loop(monkeypatch, set_policy):
    """FP8 current scaling with the large-expert choices forced (per-expert cuBLAS fprop, each
    weight quantized on its own instead of stacked): the per-expert loop's step bit for bit."""
    from hybridfp.moe import gemm as g
    from hybridfp.moe import quantize_weights as qg
    set_policy(per_expert_fp8_flops=0.0, per_expert_fp8_triton_flops=0.0, stack_scaled_max_numel=0)
    stacked = []
    real = qg._worth_stacking
    monkeypatch.setattr(qg, "_worth_stacking", lambda *a: stacked.append(real(*a)) or stacked[-1])
    torch.manual_seed(1)
    # separate expert tensors: packed ones (one buffer) take the grouped weight quantization,
    # which is as fast as per expert at this size on an H200 (the "[unpacked weights]" row of
    # ``python -m bench.bench_moe --experts 64``)
    m = GroupedLinear(len(SPLITS), HIDDEN, FFN, bias=False, params_dtype=torch.bfloat16, device="cuda",
                      pack_weights=False)
    fresh = copy.deepcopy(m)
    before = Counter(g.PATH_COUNTS)
    got = cuda_step(m, FACTORIES["current_scaling"])
    assert (Counter(g.PATH_COUNTS) - before)[("fprop", g.PER_EXPERT)] == 1
    assert stacked == [False]  # the weights were quantized one by one
    per_expert_loop(monkeypatch)
    want = cuda_step(fresh, FACTORIES["current_scaling"])
    assert_bitwise(got[0], want[0], "output")
    assert_bitwise(got[1], want[1], "input grad")
    for n in want[2]:
        assert_bitwise(got[2][n], want[2][n], f"{n}.grad")
