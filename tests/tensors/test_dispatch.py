"""__torch_dispatch__ handlers that keep the tensor quantized: detach, clone, _to_copy, copy_,
new_zeros / new_empty / empty_like / zeros_like, zero_."""

from __future__ import annotations

import warnings

import pytest
import torch

import hybridfp
from hybridfp import QuantizedTensor
from hybridfp.tensors import COLUMNWISE, ROWWISE, MissingDirectionError
from tensor_cases import (BY_NAME, assert_bitwise, assert_same_payloads, case_params, data_ptrs,
                          expected_nbytes, make_input, quantize)

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SHAPE = (2, 40, 64)


@pytest.fixture
def no_fallback_warning():
    """Handled ops must not dequantize: any fallback warning fails the test."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="hybridfp: aten")
        yield


@pytest.mark.usefixtures("no_fallback_warning")
@pytest.mark.parametrize("case", case_params())
def test_detach_shares_payload(case):
    x = make_input(SHAPE).requires_grad_()
    t = quantize(case, x)
    d = t.detach()
    assert type(d) is QuantizedTensor and not d.requires_grad and d.quantizer is t.quantizer
    assert data_ptrs(d) == data_ptrs(t)
    assert_same_payloads(d, t)
    assert d.directions() == t.directions()


@pytest.mark.usefixtures("no_fallback_warning")
@pytest.mark.parametrize("case", case_params())
def test_clone_is_independent(case):
    t = quantize(case, make_input(SHAPE))
    before = {d: t.dequantize(direction=d) for d in t.directions()}
    c = t.clone()
    assert type(c) is QuantizedTensor and c.quantizer is t.quantizer
    assert_same_payloads(c, t)
    assert not set(data_ptrs(c)) & set(data_ptrs(t))
    assert c.quantized_nbytes() == t.quantized_nbytes()
    for x in c.qstorage.tensors():  # writing the clone leaves the original alone
        x.zero_()
    for d, v in before.items():
        assert_bitwise(t.dequantize(direction=d), v)


@pytest.mark.usefixtures("no_fallback_warning")
@pytest.mark.parametrize("case", case_params())
def test_to_dtype_changes_only_the_nominal_dtype(case):
    t = quantize(case, make_input(SHAPE))
    for dtype in (torch.bfloat16, torch.float16):
        for y in (t.to(dtype), t.to(dtype=dtype)):
            assert type(y) is QuantizedTensor and y.dtype == dtype and y.shape == t.shape
            assert y.directions() == t.directions()
            for d in t.directions():  # same payload, bit for bit
                for name, tensor in t.qstorage.payloads[d].items():
                    assert_bitwise(y.qstorage.payloads[d][name], tensor)
                assert_bitwise(y.dequantize(direction=d), t.dequantize(direction=d).to(dtype))
    assert_bitwise(t.bfloat16().float().dequantize(), t.dequantize())


@pytest.mark.usefixtures("no_fallback_warning")
def test_to_same_device_and_dtype_is_a_no_op():
    t = hybridfp.MXFP8Quantizer()(make_input(SHAPE))
    assert t.cpu() is t and t.to("cpu") is t and t.to(torch.float32) is t
    assert not t.is_pinned()


@pytest.mark.parametrize("case", case_params(["mxfp8", "nvfp4"]))
def test_to_non_float_dtype_dequantizes(case):
    t = quantize(case, make_input((4, 32)))
    with pytest.warns(UserWarning, match="aten._to_copy"):
        y = t.to(torch.float64)
    assert type(y) is torch.Tensor
    assert_bitwise(y, t.dequantize().double())


@CUDA
@pytest.mark.parametrize("case", case_params())
def test_cuda_round_trip_and_pinned_memory(case):
    t = quantize(case, make_input(SHAPE))
    g = t.cuda()
    assert type(g) is QuantizedTensor and g.device.type == "cuda"
    assert all(x.device.type == "cuda" for x in g.qstorage.tensors())
    assert_same_payloads(g.cpu(), t)
    for d in t.directions():
        assert_bitwise(g.dequantize(direction=d).cpu(), t.dequantize(direction=d))
    assert g.quantized_nbytes() == t.quantized_nbytes()
    p = t.pin_memory()
    assert type(p) is QuantizedTensor and p.is_pinned() and not t.is_pinned()
    assert_same_payloads(p, t)
    back = g.to("cpu", non_blocking=True)
    torch.cuda.synchronize()
    assert_same_payloads(back, t)
    z = t.new_zeros(SHAPE, device="cuda")
    assert z.device.type == "cuda" and torch.equal(z.dequantize().cpu(), torch.zeros(SHAPE))


# ---------------------------------------------------------------------- copy_
@pytest.mark.usefixtures("no_fallback_warning")
@pytest.mark.parametrize("case", case_params())
def test_copy_same_format_in_place(case):
    dst = quantize(case, make_input(SHAPE, seed=1))
    src = quantize(case, make_input(SHAPE, seed=2))
    ptrs = data_ptrs(dst)
    out = dst.copy_(src)
    assert out is dst and data_ptrs(dst) == ptrs
    assert_same_payloads(dst, src)
    assert not set(ptrs) & set(data_ptrs(src))


@pytest.mark.parametrize("case", case_params())
def test_copy_high_precision_requantizes_in_place(case):
    """Through the quantizer, into the existing buffers (what an optimizer step or load does)."""
    dst = quantize(case, make_input(SHAPE, seed=1))
    x = make_input(SHAPE, seed=2)
    ptrs = data_ptrs(dst)
    dst.copy_(x)
    assert data_ptrs(dst) == ptrs
    assert_same_payloads(dst, quantize(case, x))


def _versions(t: QuantizedTensor) -> list[int]:
    return [x._version for x in t.qstorage.tensors()]


@pytest.mark.parametrize("write", ["copy_quantized", "copy_high_precision", "zero_", "fill_"])
@pytest.mark.parametrize("case", case_params())
def test_an_in_place_write_bumps_every_payloads_version(case, write):
    """Caches keyed on a payload's version (the GEMMs' BF16 decodes) must see a write made inside
    ``__torch_dispatch__``, where torch itself bumps no payload's version counter."""
    dst = quantize(case, make_input(SHAPE, seed=1))
    before = _versions(dst)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fill_ dequantizes (the fallback) by design
        if write == "copy_quantized":
            dst.copy_(quantize(case, make_input(SHAPE, seed=2)))
        elif write == "copy_high_precision":
            dst.copy_(make_input(SHAPE, seed=2))
        elif write == "zero_":
            dst.zero_()
        else:
            dst.fill_(0.5)
    assert all(b > a for a, b in zip(before, _versions(dst))), (before, _versions(dst))


@pytest.mark.parametrize("src_case", case_params(["nvfp4", "fp8_block_1d", "identity",
                                                   "hybrid_nvfp4_mxfp8"]))
@pytest.mark.parametrize("dst_case", case_params(["mxfp8", "hybrid_mxfp8_identity_rowdq",
                                                   "identity"]))
def test_copy_other_format_requantizes_its_value(dst_case, src_case):
    if dst_case.name == src_case.name:
        pytest.skip("same format: copied, not re-quantized")
    dst = quantize(dst_case, make_input(SHAPE, seed=1))
    src = quantize(src_case, make_input(SHAPE, seed=2))
    ptrs = data_ptrs(dst)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a cross-format copy is not a fallback
        dst.copy_(src)
    assert data_ptrs(dst) == ptrs
    assert_same_payloads(dst, quantize(dst_case, src.dequantize()))


def test_copy_from_a_tensor_missing_a_copy_is_refused():
    """The source lacks the columnwise copy the destination holds: copying would re-quantize
    it from the rowwise value, so it is refused; re-quantizing the value is explicit."""
    dst = hybridfp.MXFP8Quantizer()(make_input(SHAPE, seed=1))
    src = hybridfp.MXFP8Quantizer(columnwise=False)(make_input(SHAPE, seed=2))
    with pytest.raises(MissingDirectionError, match="holds only its rowwise copy"):
        dst.copy_(src)
    dst.copy_(src.dequantize())
    assert dst.directions() == (ROWWISE, COLUMNWISE)
    assert_same_payloads(dst, hybridfp.MXFP8Quantizer()(src.dequantize()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", case_params())
def test_high_precision_destination_dequantizes(case, dtype):
    t = quantize(case, make_input(SHAPE))
    hp = torch.empty(SHAPE, dtype=dtype)
    ptr = hp.data_ptr()
    hp.copy_(t)
    assert hp.data_ptr() == ptr and type(hp) is torch.Tensor
    assert_bitwise(hp, t.dequantize(dtype))


def test_copy_errors():
    t = hybridfp.MXFP8Quantizer()(make_input((4, 32)))
    with pytest.raises(ValueError, match=r"copy_ shape mismatch: \(8, 32\)"):
        t.copy_(make_input((8, 32)))
    orphan = QuantizedTensor(t.qstorage.map_tensors(torch.clone))  # e.g. loaded from disk
    with pytest.raises(RuntimeError, match="no quantizer.*set_quantizer"):
        orphan.copy_(make_input((4, 32)))
    orphan.copy_(t)  # the same format needs no quantizer
    assert_same_payloads(orphan, t)
    orphan.set_quantizer(hybridfp.MXFP8Quantizer())
    x = make_input((4, 32), seed=3)
    orphan.copy_(x)
    assert_same_payloads(orphan, hybridfp.MXFP8Quantizer()(x))


# ---------------------------------------------------------------------- factories, zero_
FACTORIES = {
    "new_zeros": lambda t, s: t.new_zeros(s),
    "new_empty": lambda t, s: t.new_empty(s),
    "zeros_like": lambda t, s: torch.zeros_like(t),
    "empty_like": lambda t, s: torch.empty_like(t),
}


@pytest.mark.usefixtures("no_fallback_warning")
@pytest.mark.parametrize("factory", list(FACTORIES))
@pytest.mark.parametrize("case", case_params())
def test_factories_make_quantized_tensors(case, factory):
    like = (2, 80, 288)  # >= 2 blocks each way for every format: no aliased transposes
    t = quantize(case, make_input(like))
    shape = like if factory.endswith("like") else (3, 80, 288)
    y = FACTORIES[factory](t, shape)
    assert type(y) is QuantizedTensor and tuple(y.shape) == shape and y.dtype == t.dtype
    s, ys = t.qstorage, y.qstorage
    assert type(ys) is type(s) and ys.meta == s.meta and y.directions() == t.directions()
    assert y.quantizer is t.quantizer
    rows = shape[0] * shape[1]
    assert y.quantized_nbytes() == expected_nbytes(case, rows, 288, case.directions)
    assert not set(data_ptrs(y)) & set(data_ptrs(t))
    if "zeros" in factory:
        for d in y.directions():
            assert torch.equal(y.dequantize(direction=d), torch.zeros(shape))
    y.copy_(make_input(shape, seed=5))  # usable as a destination
    assert_same_payloads(y, quantize(case, make_input(shape, seed=5)))


@pytest.mark.usefixtures("no_fallback_warning")
def test_factory_dtype_argument():
    t = hybridfp.NVFP4Quantizer()(make_input((16, 32)))
    y = t.new_zeros((16, 32), dtype=torch.bfloat16)
    assert type(y) is QuantizedTensor and y.dtype == torch.bfloat16
    assert_bitwise(y.dequantize(), torch.zeros(16, 32, dtype=torch.bfloat16))
    z = torch.zeros_like(t, dtype=torch.float16)
    assert type(z) is QuantizedTensor and z.dtype == torch.float16
    i = t.new_zeros((3,), dtype=torch.int64)  # not a float: a plain tensor
    assert type(i) is torch.Tensor and torch.equal(i, torch.zeros(3, dtype=torch.int64))


@pytest.mark.usefixtures("no_fallback_warning")
@pytest.mark.parametrize("case", case_params())
def test_zero_in_place(case):
    t = quantize(case, make_input(SHAPE))
    ptrs = data_ptrs(t)
    assert t.zero_() is t
    assert data_ptrs(t) == ptrs
    for d in t.directions():
        assert torch.equal(t.dequantize(direction=d), torch.zeros(SHAPE))


def test_identity_quantize_aliases_and_clone_does_not():
    """Identity is a passthrough (no copy); clone gives it its own memory."""
    x = make_input((8, 16))
    t = BY_NAME["identity"].make()(x)
    assert t.qstorage.tensors()[0].data_ptr() == x.data_ptr()
    c = t.clone()
    assert c.qstorage.tensors()[0].data_ptr() != x.data_ptr()
    assert_bitwise(c.dequantize(), x)
