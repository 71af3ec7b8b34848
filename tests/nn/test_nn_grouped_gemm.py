"""GroupedLinear through ``grouped_gemm``: with the grouped BF16 path switched on on the CPU
(``torch._grouped_mm`` replaced by its exact emulation ``reference_grouped_mm``), a training
step equals the per-expert loop (the CPU default) bitwise — output, input grad, weight and
bias grads — and each GEMM takes the path its formats allow."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from nn_cases import assert_bitwise, make_module

from hybridfp import CustomRecipe, GroupedLinear, autocast
from hybridfp import factories
from hybridfp.moe import gemm as grouped
from hybridfp.moe import grouped_linear_function
from hybridfp.moe.gemm import GROUPED_BF16, PATH_COUNTS, PER_EXPERT, reference_grouped_mm

IN, OUT = 64, 32
ALIGNED, ODD = [0, 16, 32], [0, 19, 29]


@pytest.fixture
def grouped_on_cpu(monkeypatch):
    """The grouped BF16 path on the CPU, with the exact emulation as the grouped matmul."""
    monkeypatch.setattr(grouped, "_grouped_mm_device", lambda device: True)
    monkeypatch.setattr(grouped, "torch_grouped_mm", reference_grouped_mm)


def module(bias: bool = False, params_dtype: torch.dtype = torch.bfloat16) -> GroupedLinear:
    return make_module("grouped", in_features=IN, out_features=OUT, bias=bias, params_dtype=params_dtype)


def step(m: GroupedLinear, splits: list[int], factory, dtype: torch.dtype = torch.bfloat16):
    """One step on seeded data; returns (y, dx, {name: grad}, paths taken)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(sum(splits), IN, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(sum(splits), OUT, generator=g).to(dtype)
    m.zero_grad(set_to_none=True)
    torch.manual_seed(11)
    before = Counter(PATH_COUNTS)
    with autocast(recipe=CustomRecipe(qfactory=factory)):
        y = m(x, splits)
    y.backward(dy)
    paths = Counter(PATH_COUNTS) - before
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    return y.detach(), x.grad, grads, paths


FACTORIES = {
    "mxfp8": (factories.mxfp8, {"fprop": GROUPED_BF16, "dgrad": GROUPED_BF16, "wgrad": GROUPED_BF16}),
    "high_precision": (factories.high_precision,
                       {"fprop": GROUPED_BF16, "dgrad": GROUPED_BF16, "wgrad": GROUPED_BF16}),
    "fp8_block": (factories.float8_block_scaling,  # no cuBLAS on the CPU: pow2 block decodes
                  {"fprop": GROUPED_BF16, "dgrad": GROUPED_BF16, "wgrad": GROUPED_BF16}),
    "high_precision_fwd_mxfp8_bwd": (factories.high_precision_fwd_mxfp8_bwd,
                                     {"fprop": GROUPED_BF16, "dgrad": GROUPED_BF16, "wgrad": GROUPED_BF16}),
    # Composer 2: fprop has NVFP4 S_dec epilogue factors (per row for x): per expert.
    "nvfp4_row_scaled_fwd_mxfp8_bwd": (factories.nvfp4_row_scaled_fwd_mxfp8_bwd,
                                       {"fprop": PER_EXPERT, "dgrad": GROUPED_BF16, "wgrad": GROUPED_BF16}),
    "current_scaling": (factories.current_scaling,
                        {"fprop": PER_EXPERT, "dgrad": PER_EXPERT, "wgrad": PER_EXPERT}),
    "nvfp4": (factories.nvfp4, {"fprop": PER_EXPERT, "dgrad": PER_EXPERT, "wgrad": PER_EXPERT}),
}


@pytest.mark.parametrize("name", list(FACTORIES))
def test_grouped_step_equals_per_expert_loop(name, grouped_on_cpu, monkeypatch):
    factory, want_paths = FACTORIES[name]
    base = module()
    got = step(base, ALIGNED, factory)
    assert got[3] == Counter({(g, p): 1 for g, p in want_paths.items()}), got[3]
    monkeypatch.undo()  # the CPU default: gemm() per expert
    want = step(base, ALIGNED, factory)
    assert set(want[3]) == {(g, PER_EXPERT) for g in want_paths}
    assert_bitwise(got[0], want[0], f"{name} output")
    assert_bitwise(got[1], want[1], f"{name} input grad")
    assert sorted(got[2]) == sorted(want[2]) == [f"weight{i}" for i in range(3)]
    for n in want[2]:
        assert_bitwise(got[2][n], want[2][n], f"{name} {n}.grad")


def test_uneven_splits_and_bias(grouped_on_cpu, monkeypatch):
    """A bias keeps fprop per expert (added in FP32 before the rounding); bias grads are the
    same; wgrad pads the odd reductions (within one BF16 ulp, see tests/gemm)."""
    base = module(bias=True)
    got = step(base, ODD, factories.mxfp8)
    assert got[3][("fprop", PER_EXPERT)] == 1 and got[3][("wgrad", GROUPED_BF16)] == 1
    monkeypatch.undo()
    want = step(base, ODD, factories.mxfp8)
    assert_bitwise(got[0], want[0], "output")
    assert_bitwise(got[1], want[1], "input grad")
    for n, w in want[2].items():
        if n.startswith("bias"):
            assert_bitwise(got[2][n], w, n)
        else:
            ulp = torch.exp2(torch.floor(torch.log2(w.float().abs().clamp_min(1e-30))) - 7)
            assert ((got[2][n].float() - w.float()).abs() <= ulp).all(), n
    assert torch.equal(got[2]["weight0"], torch.zeros(OUT, IN, dtype=torch.bfloat16))  # empty expert


def test_fp32_params_wgrad_per_expert(grouped_on_cpu):
    """dW in FP32 parameters' dtype needs the FP32 accumulator: wgrad runs per expert."""
    got = step(module(params_dtype=torch.float32), ALIGNED, factories.mxfp8)
    assert got[3][("wgrad", PER_EXPERT)] == 1 and got[3][("dgrad", GROUPED_BF16)] == 1
    assert all(g.dtype == torch.float32 for g in got[2].values())


@pytest.mark.parametrize("splits", [[0, 48, 0], [48, 0, 0], [0, 0, 0]])
def test_zero_size_experts(splits, grouped_on_cpu):
    """Empty experts: no rows out, zero weight grads; all-empty inputs work too."""
    m = module()
    y, dx, grads, paths = step(m, splits, factories.mxfp8)
    assert y.shape == (sum(splits), OUT) and dx.shape == (sum(splits), IN)
    for i, rows in enumerate(splits):
        if rows == 0:
            assert torch.equal(grads[f"weight{i}"], torch.zeros(OUT, IN, dtype=torch.bfloat16))


def test_inference_matches_per_expert(grouped_on_cpu, monkeypatch):
    """No grad: fprop alone, on the grouped path, equals the per-expert loop."""
    m = module()
    x = torch.randn(48, IN).bfloat16()

    def forward() -> torch.Tensor:
        with torch.no_grad(), autocast(recipe=CustomRecipe(qfactory=factories.mxfp8)):
            return m(x, ALIGNED)
    before = Counter(PATH_COUNTS)
    got = forward()
    assert Counter(PATH_COUNTS) - before == Counter({("fprop", GROUPED_BF16): 1})
    monkeypatch.undo()
    assert_bitwise(got, forward(), "output")


def _quantize_each(quantizers, x, splits, plans=None):
    """The per-expert loop ``quantize_grouped`` replaces: each expert's own ``quantize``."""
    return [None if q is None else q.quantize(xe) for q, xe in zip(quantizers, torch.split(x, splits))]


AWKWARD = [0, 19, 45, 1, 33]  # an empty expert, counts not multiples of 16 / 32 / 128


@pytest.mark.parametrize("grouped_mm", [False, True], ids=["per_expert_gemm", "grouped_bf16"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("name", sorted({**factories.BASE, **factories.ZOO}))
def test_grouped_quantize_equals_per_expert_quantize(name, bias, grouped_mm, monkeypatch):
    """A training step with the experts' inputs and gradients quantized by ``quantize_grouped``
    (shared row-local encodings) equals the step quantizing each expert on its own, bitwise:
    output, input grad and every parameter grad, with the CPU's per-expert GEMMs or the
    grouped BF16 path (which then reads the shared encodings without a copy)."""
    factory = {**factories.BASE, **factories.ZOO}[name]
    if grouped_mm:
        monkeypatch.setattr(grouped, "_grouped_mm_device", lambda device: True)
        monkeypatch.setattr(grouped, "torch_grouped_mm", reference_grouped_mm)
    torch.manual_seed(1)
    m = GroupedLinear(len(AWKWARD), IN, OUT, bias=bias, params_dtype=torch.bfloat16)
    fresh = copy.deepcopy(m)  # delayed scaling's state moves after a step
    got = step(m, AWKWARD, factory)
    monkeypatch.setattr(grouped_linear_function, "quantize_grouped", _quantize_each)
    want = step(fresh, AWKWARD, factory)
    assert got[3] == want[3]
    assert_bitwise(got[0], want[0], f"{name} output")
    assert_bitwise(got[1], want[1], f"{name} input grad")
    assert sorted(got[2]) == sorted(want[2])
    for n in want[2]:
        assert_bitwise(got[2][n], want[2][n], f"{name} {n}.grad")


def test_save_original_input_requantizes_per_expert(monkeypatch):
    """save_original_input: wgrad re-quantizes each expert's saved x (columnwise only), and the
    step still equals the per-expert quantize loop."""
    torch.manual_seed(1)
    m = GroupedLinear(len(AWKWARD), IN, OUT, bias=False, params_dtype=torch.bfloat16, save_original_input=True)
    fresh = copy.deepcopy(m)
    got = step(m, AWKWARD, factories.mxfp8)
    monkeypatch.setattr(grouped_linear_function, "quantize_grouped", _quantize_each)
    want = step(fresh, AWKWARD, factories.mxfp8)
    for a, b, what in ((got[0], want[0], "output"), (got[1], want[1], "input grad")):
        assert_bitwise(a, b, what)
    for n in want[2]:
        assert_bitwise(got[2][n], want[2][n], n)


def test_backward_with_create_graph():
    """Under create_graph=True backward runs with grad enabled and dy may require grad (a layer
    with parameters follows); the grouped quantization of dy must still run (as Linear's)."""
    torch.manual_seed(0)
    m = GroupedLinear(2, 32, 16, params_dtype=torch.bfloat16)
    head = torch.nn.Linear(16, 1, dtype=torch.bfloat16)
    x = torch.randn(32, 32, dtype=torch.bfloat16, requires_grad=True)
    grads = []
    for create_graph in (False, True):
        with autocast(recipe=CustomRecipe(qfactory=factories.mxfp8)):
            loss = head(torch.tanh(m(x, [16, 16]))).sum()
        (g,) = torch.autograd.grad(loss, x, create_graph=create_graph)
        grads.append(g.detach())
    assert torch.equal(grads[0], grads[1])
