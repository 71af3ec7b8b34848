"""``hybridfp.convert`` on a plain model, parameter / input dtypes, and optimizers."""

from __future__ import annotations

import copy

import pytest
import torch
from nn_cases import FORMATS, MODULES, call, make_data, make_module, run_step
from torch import nn

import hybridfp
from hybridfp import Linear, MXFP8BlockScaling, QuantizerRole, autocast

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")  # CPU: expected


def _mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64, bias=False))
    return nn.Sequential(nn.LayerNorm(64), block, nn.Linear(64, 32)).to(dtype)


# ---------------------------------------------------------------- convert
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_convert_keeps_parameters_and_matches_nn_linear(dtype):
    model = _mlp(dtype)
    reference = copy.deepcopy(model)
    params = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built before the conversion
    hybridfp.convert(model)
    converted = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    assert sorted(converted) == ["1.0", "1.2", "2"]
    assert all(m.name == n for n, m in converted.items())
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert model[1][2].bias is None and model[1][0].weight.dtype == dtype
    # The very same Parameter objects (an optimizer built before still trains the model).
    assert dict(model.named_parameters()).keys() == params.keys()
    assert all(p is params[n] for n, p in model.named_parameters())
    # Outside autocast: exactly nn.Linear.
    x = torch.randn(48, 64, dtype=dtype)
    assert torch.equal(model(x), reference(x))
    xr = x.clone().requires_grad_()
    model(xr).square().sum().backward()
    reference(x.clone().requires_grad_()).square().sum().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
    before = model[2].weight.detach().clone()
    opt.step()
    assert not torch.equal(model[2].weight, before)


def test_convert_roles_are_qualified_names():
    model = hybridfp.convert(_mlp())
    with autocast(recipe=MXFP8BlockScaling()):
        model(torch.randn(48, 64))
    for name, m in model.named_modules():
        if isinstance(m, Linear):
            roles = m.quantizer_roles()
            assert roles == {t: [QuantizerRole("linear", t, name)] for t in ("input", "weight", "grad_output")}
            assert str(roles["weight"][0]) == f"{name}.weight"


def test_convert_filter_and_set_names():
    model = hybridfp.convert(_mlp(), recipe_filter=lambda name, m: m.out_features != 32)
    assert type(model[2]) is nn.Linear and isinstance(model[1][0], Linear)
    model.add_module("head", Linear(32, 8))  # added unnamed: set_names fills the name in
    assert model.head.name == ""
    hybridfp.set_names(model)
    assert model.head.name == "head" and model[1][0].name == "1.0"


# ---------------------------------------------------------------- dtypes and optimizers
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("x_dtype", DTYPES, ids=["x_fp32", "x_bf16"])
@pytest.mark.parametrize("params_dtype", DTYPES, ids=["p_fp32", "p_bf16"])
@pytest.mark.parametrize("kind", MODULES)
def test_dtypes(kind, params_dtype, x_dtype):
    m = make_module(kind, params_dtype=params_dtype)
    assert all(p.dtype == params_dtype for p in m.parameters())
    x, dy = make_data(x_dtype, seed=8)
    got = run_step(m, x, dy, FORMATS["nvfp4"]())
    assert got.y.dtype == x_dtype and got.dx.dtype == x_dtype
    assert got.grads.keys() == dict(m.named_parameters()).keys()
    for n, g in got.grads.items():
        assert g.dtype == params_dtype, n
        assert torch.isfinite(g).all(), n
    # Close to the FP32 module (BF16 rounding and NVFP4 error are both far below 50%).
    ref = run_step(copy.deepcopy(m).float(), x.float(), dy.float(), None)
    rel = (got.y.float() - ref.y).norm() / ref.y.norm()
    assert rel < 0.25


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.AdamW], ids=["sgd", "adamw"])
@pytest.mark.parametrize("params_dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", MODULES)
def test_optimizers_step(kind, params_dtype, optimizer):
    m = make_module(kind, params_dtype=params_dtype)
    opt = optimizer(m.parameters(), lr=1e-2)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    x, dy = make_data(params_dtype, seed=9)
    for fmt in ("mxfp8", "nvfp4"):  # two steps, two formats: the weight cache follows the steps
        opt.zero_grad()
        with autocast(recipe=FORMATS[fmt]()):
            y = call(m, x.clone().requires_grad_())
        y.backward(dy)
        opt.step()
    for n, p in m.named_parameters():
        assert p.dtype == params_dtype and torch.isfinite(p).all(), n
        if kind == "grouped" and n in ("weight0", "bias0"):
            assert not p.grad.any(), n  # expert 0 gets no rows: zero gradients, not None
            continue
        assert not torch.equal(p, before[n]), f"{n} did not change"


@pytest.mark.parametrize("kind", ["linear", "layernorm"])
def test_leading_dimensions_are_kept(kind):
    m = make_module(kind)
    x, dy = make_data(seed=10)
    x3, dy3 = x.reshape(4, 12, 64), dy.reshape(4, 12, 32)
    xr = x3.clone().requires_grad_()
    with autocast(recipe=MXFP8BlockScaling()):
        y = m(xr)
    y.backward(dy3)
    assert y.shape == (4, 12, 32) and xr.grad.shape == (4, 12, 64)
    flat = run_step(copy.deepcopy(m), x, dy, MXFP8BlockScaling())
    assert torch.equal(y.detach().reshape(48, 32), flat.y)
    assert torch.equal(xr.grad.reshape(48, 64), flat.dx)
