"""QuantizedTensor through autograd (straight-through quantize) and as an nn.Parameter."""

from __future__ import annotations

import warnings

import pytest
import torch

import hybridfp
from hybridfp import QuantizedTensor
from tensor_cases import (assert_bitwise, assert_same_payloads, case_params, data_ptrs, make_input,
                          quantize)


@pytest.fixture(autouse=True)
def quiet_fallback():
    """The ops used on quantized tensors here dequantize by design (tested in test_fallback)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="hybridfp: aten")
        yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", case_params())
def test_quantize_is_straight_through(case, dtype):
    """y = q(x) carries a grad_fn; an op on y runs on dequantized values (fallback), and the
    gradient reaching x is exactly the upstream gradient of y."""
    x = make_input((2, 16, 64), dtype).requires_grad_()
    y = quantize(case, x)
    assert type(y) is QuantizedTensor and y.requires_grad and y.grad_fn is not None
    (y * 2).sum().backward()
    assert_bitwise(x.grad, torch.full_like(x, 2.0))
    x.grad = None
    w = make_input((2, 16, 64), dtype, seed=1).requires_grad_()
    y = quantize(case, x)
    (y * w).sum().backward()
    assert_bitwise(x.grad, w.detach())  # d(y*w)/dy = w, passed straight through
    assert_bitwise(w.grad, y.dequantize())  # d(y*w)/dw = the value y stands for


def test_dequantize_method_is_outside_autograd():
    """``dequantize()`` reads the payload directly: it returns a tensor without grad history,
    so a gradient must flow through ops on the QuantizedTensor itself (as above)."""
    x = make_input((16, 32)).requires_grad_()
    y = hybridfp.MXFP8Quantizer()(x)
    d = y.dequantize()
    assert not d.requires_grad and d.grad_fn is None
    assert_bitwise(d, hybridfp.MXFP8Quantizer()(x.detach()).dequantize())


def test_quantize_without_grad_has_no_history():
    x = make_input((16, 32)).requires_grad_()
    with torch.no_grad():
        y = hybridfp.NVFP4Quantizer()(x)
    assert not y.requires_grad and y.grad_fn is None
    with pytest.raises(TypeError, match="already a QuantizedTensor"):
        hybridfp.NVFP4Quantizer()(y)


@pytest.mark.parametrize("case", case_params())
def test_parameter_in_a_module(case):
    w = quantize(case, make_input((32, 64)))
    p = torch.nn.Parameter(w)
    assert type(p) is QuantizedTensor and isinstance(p, torch.nn.Parameter) and p.requires_grad
    assert data_ptrs(p) == data_ptrs(w) and p.quantizer is w.quantizer  # no copy
    m = torch.nn.Linear(64, 32, bias=False)
    m.weight = p
    assert [q for q in m.parameters()][0] is p
    assert dict(m.named_parameters())["weight"] is p
    sd = m.state_dict()
    assert type(sd["weight"]) is QuantizedTensor and not sd["weight"].requires_grad
    assert_same_payloads(sd["weight"], w)

    ref = torch.nn.Linear(64, 32, bias=False)  # the same weight, unquantized
    with torch.no_grad():
        ref.weight.copy_(w.dequantize())
    inp = make_input((4, 64), seed=1).requires_grad_()
    ref_inp = inp.detach().clone().requires_grad_()
    out, ref_out = m(inp), ref(ref_inp)
    assert_bitwise(out, ref_out)
    grad = make_input((4, 32), seed=2)
    out.backward(grad)
    ref_out.backward(grad)
    assert type(p.grad) is torch.Tensor and p.grad.shape == p.shape
    assert_bitwise(p.grad, ref.weight.grad)
    assert_bitwise(inp.grad, ref_inp.grad)
    m.requires_grad_(False)
    assert not p.requires_grad


@pytest.mark.parametrize("case", case_params())
def test_load_state_dict_copies_in_place(case):
    """Same format: payloads copied into the existing buffers. Plain weights: re-quantized."""
    m = torch.nn.Linear(64, 32, bias=False)
    m.weight = torch.nn.Parameter(quantize(case, make_input((32, 64), seed=1)))
    ptrs = data_ptrs(m.weight)
    src = quantize(case, make_input((32, 64), seed=2))
    m.load_state_dict({"weight": src})
    assert data_ptrs(m.weight) == ptrs and type(m.weight) is QuantizedTensor
    assert_same_payloads(m.weight, src)
    plain = make_input((32, 64), seed=3)
    m.load_state_dict({"weight": plain})
    assert data_ptrs(m.weight) == ptrs
    assert_same_payloads(m.weight, quantize(case, plain))


@pytest.mark.parametrize("case", case_params())
def test_sgd_step_on_a_quantized_parameter_is_refused(case):
    """An optimizer's in-place update of a quantized weight would round each step into the format:
    refused, pointing at FP32 master weights; the parameter's buffers are unchanged."""
    p = torch.nn.Parameter(quantize(case, make_input((16, 32), seed=1)))
    p.grad = make_input((16, 32), seed=2)
    before = [t.clone() for t in p.qstorage.tensors()]
    with pytest.raises(RuntimeError, match="in-place aten.add_ on parameter.*MasterWeightOptimizer"):
        torch.optim.SGD([p], lr=0.5, foreach=False).step()
    assert all(torch.equal(a, b) for a, b in zip(p.qstorage.tensors(), before))
