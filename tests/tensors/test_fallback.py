"""Ops without a quantized implementation: dequantize, run in high precision, warn once per op;
in-place ops re-quantize their result into the tensor."""

from __future__ import annotations

import warnings

import pytest
import torch

import hybridfp
from hybridfp import QuantizedTensor
from tensor_cases import (assert_bitwise, assert_same_payloads, case_params, data_ptrs, make_input,
                          quantize)

W = make_input((64, 16), seed=9)
OPS = {  # name the warning must give -> op
    "mm": lambda t: torch.matmul(t, W),
    "add": lambda t: t + 1,
    "t": lambda t: t.t(),
    "mul": lambda t: t * t,
    "cat": lambda t: torch.cat([t, t]),
    "sum": lambda t: t.sum(dim=0),
}


def _fallback_warnings(rec) -> list[str]:
    return [str(w.message) for w in rec if str(w.message).startswith("hybridfp: aten.")]


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("case", case_params())
def test_op_dequantizes_and_warns_once(case, op):
    t = quantize(case, make_input((32, 64)))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        first = OPS[op](t)
        second = OPS[op](t)
    msgs = _fallback_warnings(rec)
    assert len(msgs) == 1, msgs
    assert msgs[0].startswith(f"hybridfp: aten.{op} has no quantized implementation")
    assert "dequantized" in msgs[0]
    want = OPS[op](t.dequantize())  # the more precise copy, in the nominal dtype
    for got in (first, second):
        assert type(got) is torch.Tensor
        assert_bitwise(got, want)


def test_each_op_warns_once_and_a_reset_warns_again():
    t = hybridfp.MXFP8Quantizer()(make_input((32, 64)))
    with pytest.warns(UserWarning, match=r"aten\.add has no quantized"):
        t + 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t + 2  # add: already reported
    with pytest.warns(UserWarning, match=r"aten\.sub has no quantized"):
        t - 1  # another op: reported
    hybridfp.tensors.dispatch._WARNED.clear()
    with pytest.warns(UserWarning, match=r"aten\.add has no quantized"):
        t + 1


def test_matmul_of_a_3d_tensor_views_natively_then_falls_back_once():
    t = hybridfp.MXFP8Quantizer()(make_input((2, 16, 64)))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        y = t @ W
    assert _fallback_warnings(rec) == [
        "hybridfp: aten.mm has no quantized implementation; the QuantizedTensor operands are "
        "dequantized and the op runs in high precision."]
    assert_bitwise(y, t.dequantize() @ W)


INPLACE = {
    "add_": lambda t: t.add_(1.0),
    "mul_": lambda t: t.mul_(2.0),
    "sub_": lambda t: t.sub_(make_input((2, 16, 64), seed=4)),
}


@pytest.mark.parametrize("op", list(INPLACE))
@pytest.mark.parametrize("case", case_params())
def test_inplace_op_requantizes_into_the_tensor(case, op):
    t = quantize(case, make_input((2, 16, 64)))
    ptrs = data_ptrs(t)
    hp = t.dequantize()
    want = INPLACE[op](hp.clone())
    with pytest.warns(UserWarning, match=rf"aten\.{op} has no quantized"):
        out = INPLACE[op](t)
    assert out is t and type(t) is QuantizedTensor
    assert data_ptrs(t) == ptrs and t.directions() == case.directions
    assert_same_payloads(t, quantize(case, want))


def test_inplace_op_without_quantizer_is_a_clear_error():
    t = hybridfp.MXFP8Quantizer()(make_input((8, 32)))
    orphan = QuantizedTensor(t.qstorage.map_tensors(torch.clone))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="has no quantizer.*set_quantizer"):
            orphan.mul_(2.0)


def test_high_precision_inplace_with_a_quantized_operand():
    """hp.add_(qt): the quantized operand is dequantized; hp stays a plain tensor."""
    t = hybridfp.NVFP4Quantizer()(make_input((16, 32)))
    hp = make_input((16, 32), seed=3)
    want = hp + t.dequantize()
    with pytest.warns(UserWarning, match=r"aten\.add_"):
        out = hp.add_(t)
    assert out is hp and type(hp) is torch.Tensor
    assert_bitwise(hp, want)


@pytest.mark.parametrize("case", case_params(["fp8_current", "nvfp4", "hybrid_nvfp4_mxfp8"]))
def test_fallback_with_two_quantized_operands(case):
    a = quantize(case, make_input((32, 64), seed=1))
    b = quantize(case, make_input((64, 32), seed=2))
    with pytest.warns(UserWarning, match=r"aten\.mm"):
        y = a @ b
    assert_bitwise(y, a.dequantize() @ b.dequantize())
