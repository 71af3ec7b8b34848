"""torch.save / torch.load(weights_only=True) of QuantizedTensors and state_dicts holding them."""

from __future__ import annotations

import io

import pytest
import torch

import hybridfp
from hybridfp import QuantizedTensor
from hybridfp.tensors import COLUMNWISE, ROWWISE, HybridStorage
from tensor_cases import (CASES, assert_bitwise, assert_same_payloads, case_params, make_input,
                          quantize)


def round_trip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def assert_same_tensor(loaded: QuantizedTensor, t: QuantizedTensor) -> None:
    """Type, shape, nominal dtype, role label, copies held, payload bits, footprint, values."""
    assert type(loaded) is QuantizedTensor
    assert loaded.shape == t.shape and loaded.dtype == t.dtype
    assert loaded.qstorage.label == t.qstorage.label
    assert_same_payloads(loaded, t)
    if isinstance(t.qstorage, HybridStorage):
        for d in t.directions():
            a, b = loaded.qstorage.part(d), t.qstorage.part(d)
            assert type(a) is type(b) and a.meta == b.meta and a.directions() == (d,)
    assert loaded.quantized_nbytes() == t.quantized_nbytes()
    for d in t.directions():
        assert_bitwise(loaded.dequantize(direction=d), t.dequantize(direction=d))


@pytest.mark.parametrize("usage", ["both", "rowwise", "columnwise"])
@pytest.mark.parametrize("case", case_params())
def test_quantized_tensor_round_trip(case, usage):
    if usage == "columnwise" and case.col is None:
        pytest.skip("row-scaled NVFP4 has no columnwise copy")
    q = case.make(rowwise=usage != "columnwise", columnwise=usage != "rowwise" and case.col is not None)
    q.role = "linear.weight"
    t = q(make_input((2, 48, 64)))
    loaded = round_trip(t)
    assert_same_tensor(loaded, t)
    assert loaded.quantizer is None  # quantizers are not pickled: weights_only stays possible
    assert loaded.directions() == t.directions()


@pytest.mark.parametrize("case", case_params())
def test_sharing_between_copies_survives(case):
    """A tensor both copies hold (FP8 scale_inv, NVFP4 amax, Identity data) loads as one."""
    t = quantize(case, make_input((64, 96)))
    loaded = round_trip(t)
    if len(t.directions()) == 2:
        for name in set(t.qstorage.payloads[ROWWISE]) & set(t.qstorage.payloads[COLUMNWISE]):
            shared = t.qstorage.payloads[ROWWISE][name] is t.qstorage.payloads[COLUMNWISE][name]
            got = loaded.qstorage.payloads[ROWWISE][name] is loaded.qstorage.payloads[COLUMNWISE][name]
            assert got == shared, name
    assert len(loaded.qstorage.tensors()) == len(t.qstorage.tensors())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_nominal_dtype_and_requires_grad_survive(dtype):
    t = hybridfp.MXFP8Quantizer()(make_input((32, 64), dtype))
    loaded = round_trip(t)
    assert loaded.dtype == dtype and not loaded.requires_grad
    assert_same_tensor(loaded, t)
    p = torch.nn.Parameter(t)
    lp = round_trip(p)
    assert lp.requires_grad and isinstance(lp, torch.nn.Parameter) and type(lp) is QuantizedTensor
    assert_same_tensor(lp, t)


@pytest.mark.parametrize("case", case_params())
def test_state_dict_round_trip(case):
    m = torch.nn.Linear(64, 32)
    m.weight = torch.nn.Parameter(quantize(case, make_input((32, 64), seed=1)))
    m.register_buffer("stat", torch.arange(4.0))
    sd = round_trip(m.state_dict())
    assert sorted(sd) == ["bias", "stat", "weight"]
    assert type(sd["bias"]) is torch.Tensor and type(sd["stat"]) is torch.Tensor
    assert_bitwise(sd["bias"], m.bias.detach())
    assert_same_tensor(sd["weight"], m.weight.detach())

    fresh = torch.nn.Linear(64, 32)  # a module with a quantized weight of the same format
    fresh.weight = torch.nn.Parameter(quantize(case, make_input((32, 64), seed=7)))
    fresh.register_buffer("stat", torch.zeros(4))
    fresh.load_state_dict(sd)
    assert_same_payloads(fresh.weight, m.weight)
    assert fresh.weight.quantizer is not None  # kept its own quantizer


def test_many_formats_in_one_file():
    ts = {c.name: quantize(c, make_input((32, 64), seed=i)) for i, c in enumerate(CASES)}
    loaded = round_trip(ts)
    for name, t in ts.items():
        assert_same_tensor(loaded[name], t)


def test_views_and_slices_round_trip():
    t = hybridfp.NVFP4Quantizer(with_rht=True)(make_input((64, 48)))
    piece = t[16:48]
    loaded = round_trip(piece)
    for d in t.directions():
        assert_bitwise(loaded.dequantize(direction=d), t.dequantize(direction=d)[16:48])
    v = round_trip(hybridfp.MXFP8Quantizer()(make_input((4, 8, 32))).view(32, 32))
    assert tuple(v.shape) == (32, 32)


def test_loaded_tensor_can_be_given_a_quantizer():
    x = make_input((32, 64))
    loaded = round_trip(hybridfp.MXFP8Quantizer()(x))
    with pytest.raises(RuntimeError, match="set_quantizer"):
        loaded.copy_(x)
    loaded.set_quantizer(hybridfp.MXFP8Quantizer())
    x2 = make_input((32, 64), seed=5)
    loaded.copy_(x2)
    assert_same_payloads(loaded, hybridfp.MXFP8Quantizer()(x2))
