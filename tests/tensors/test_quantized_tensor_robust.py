"""QuantizedTensor ops that must give the right value or a clear error, never a silent wrong one.

- ``as_strided`` reads the tensor as the dense row-major value its wrapper reports (contiguous
  strides, storage offset 0), whichever copy it holds (a columnwise copy decodes transposed)
  and whatever slice it is (an Identity row slice is a view into a larger tensor).
- ``new_zeros`` / ``new_empty`` / ``empty_like`` / ``zeros_like`` keep an Identity copy's held
  dtype (the quantizer's cast), so a later ``copy_`` neither rounds nor widens silently.
- ``detach()`` and ``nn.Parameter(t)`` keep the subclass, its storage and its quantizer.
- ``copy_`` between tensors of one format where the source lacks a copy the destination holds
  is refused (it would re-quantize that copy from the other copy's value).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import hybridfp
from hybridfp import QuantizedTensor
from hybridfp.tensors import COLUMNWISE, ROWWISE, MissingDirectionError
from tensor_cases import assert_same_payloads, case_params, make_input

SHAPE = (64, 96)
E4M3 = torch.float8_e4m3fn


def dense(t: QuantizedTensor) -> torch.Tensor:
    """The value the wrapper stands for, in its own row-major memory."""
    return t.dequantize().contiguous().clone()


def held_dtypes(t: QuantizedTensor) -> dict[str, torch.dtype]:
    """Direction -> dtype of the 'data' payload holding it."""
    s = t.qstorage
    return {d: s.part(d).payloads[d]["data"].dtype for d in s.directions()}


# ---------------------------------------------------------------------------- as_strided
@pytest.fixture(autouse=True)
def quiet_fallback():
    """as_strided has no quantized form: it dequantizes, and says so once (not the claim here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="hybridfp: aten.as_strided")
        yield


@pytest.mark.parametrize("usage", ["both", "columnwise"])
@pytest.mark.parametrize("case", case_params())
def test_as_strided_reads_the_row_major_value(case, usage):
    if usage == "columnwise" and case.col is None:
        pytest.skip("row-scaled NVFP4 has no columnwise copy")
    t = case.make(rowwise=usage == "both")(make_input(SHAPE))
    want = dense(t)
    rows, cols = SHAPE
    assert torch.equal(t.as_strided(SHAPE, (cols, 1)), want)
    assert torch.equal(t.as_strided((cols, rows), (1, cols)), want.t())  # a transposed view
    assert torch.equal(t.as_strided((3, 5), (cols, 2), 7), want.as_strided((3, 5), (cols, 2), 7))


@pytest.mark.parametrize("case", case_params())
def test_as_strided_with_a_storage_offset_on_a_row_slice(case):
    """A slice's wrapper has its own storage (offset 0): offsets count from its first row."""
    t = case.make()(make_input((256, 96)))
    s = t[128:256]
    want = dense(s)
    assert s.storage_offset() == 0
    got = s.as_strided((16, 96), (96, 1), 40 * 96)
    assert torch.equal(got, want[40:56])
    assert torch.equal(s.as_strided(s.shape, s.stride(), s.storage_offset()), want)


def test_as_strided_outside_the_tensor_is_a_clear_error():
    s = hybridfp.IdentityQuantizer()(make_input((256, 96)))[128:256]
    with pytest.raises(ValueError, match=r"as_strided.*outside.*128 x 96|12288 elements"):
        s.as_strided((16, 96), (96, 1), 120 * 96)  # rows 120..136 of a 128-row slice


# ---------------------------------------------------------------------------- Identity dtypes
FACTORIES = {
    "new_zeros": lambda t: t.new_zeros(t.shape),
    "new_empty": lambda t: t.new_empty(t.shape),
    "zeros_like": lambda t: torch.zeros_like(t),
    "empty_like": lambda t: torch.empty_like(t),
}


def precise_values() -> torch.Tensor:
    """FP32 values with bits below BF16's precision (a BF16 rounding would change them)."""
    x = make_input(SHAPE, seed=3)
    assert not torch.equal(x.bfloat16().float(), x)
    return x


@pytest.mark.parametrize("factory", list(FACTORIES))
def test_factories_keep_an_fp32_identity_payload(factory):
    t = hybridfp.IdentityQuantizer(dtype=torch.float32)(make_input(SHAPE).bfloat16())
    assert t.dtype == torch.bfloat16 and held_dtypes(t) == {ROWWISE: torch.float32, COLUMNWISE: torch.float32}
    y = FACTORIES[factory](t)
    assert y.dtype == torch.bfloat16
    assert held_dtypes(y) == {ROWWISE: torch.float32, COLUMNWISE: torch.float32}
    x = precise_values()
    y.copy_(hybridfp.IdentityQuantizer(dtype=torch.float32)(x))
    assert torch.equal(y.dequantize(torch.float32), x)  # not rounded through BF16


@pytest.mark.parametrize("factory", list(FACTORIES))
def test_factories_keep_an_fp32_identity_part_of_a_hybrid(factory):
    q = hybridfp.HybridQuantizer(hybridfp.MXFP8Quantizer(), hybridfp.IdentityQuantizer(dtype=torch.float32))
    t = q(make_input(SHAPE).bfloat16())
    assert held_dtypes(t) == {ROWWISE: E4M3, COLUMNWISE: torch.float32}
    y = FACTORIES[factory](t)
    assert held_dtypes(y) == {ROWWISE: E4M3, COLUMNWISE: torch.float32}
    src = q(precise_values())
    y.copy_(src)
    assert_same_payloads(y, src)


@pytest.mark.parametrize("factory", list(FACTORIES))
def test_factories_keep_a_bf16_identity_payload(factory):
    """IdentityQuantizer(dtype=bfloat16) holds BF16 whatever made the tensor; a copy_ into a
    tensor made like it rounds to BF16 through the quantizer, as quantizing does."""
    q = hybridfp.IdentityQuantizer(dtype=torch.bfloat16)
    t = q(make_input(SHAPE))
    y = FACTORIES[factory](t)
    assert held_dtypes(y) == {ROWWISE: torch.bfloat16, COLUMNWISE: torch.bfloat16}
    x = precise_values()
    y.copy_(hybridfp.IdentityQuantizer()(x))  # an FP32 Identity source: re-quantized, cast
    assert held_dtypes(y) == {ROWWISE: torch.bfloat16, COLUMNWISE: torch.bfloat16}
    assert torch.equal(y.dequantize(torch.float32), x.bfloat16().float())


def test_identity_cast_applies_on_every_path():
    """The held dtype is the quantizer's ``dtype``; the nominal dtype stays the source's (as
    for every format: what dequantize() returns by default)."""
    q = hybridfp.IdentityQuantizer(dtype=torch.bfloat16)
    x = make_input(SHAPE)
    both = {ROWWISE: torch.bfloat16, COLUMNWISE: torch.bfloat16}
    assert held_dtypes(q(x)) == both and q(x).dtype == torch.float32
    assert held_dtypes(q(x.clone().requires_grad_())) == both
    assert held_dtypes(q.make_empty(SHAPE)) == both
    h = hybridfp.HybridQuantizer(hybridfp.MXFP8Quantizer(), hybridfp.IdentityQuantizer(dtype=torch.bfloat16))
    assert held_dtypes(h(x))[COLUMNWISE] == torch.bfloat16


# ---------------------------------------------------------------------------- detach, Parameter
@pytest.mark.parametrize("case", case_params())
def test_detach_and_parameter_keep_the_subclass(case):
    q = case.make()
    t = q(make_input(SHAPE).requires_grad_())
    d = t.detach()
    assert type(d) is QuantizedTensor and not d.requires_grad and d.quantizer is q
    assert_same_payloads(d, t)
    p = torch.nn.Parameter(q(make_input(SHAPE)))
    assert type(p) is QuantizedTensor and isinstance(p, torch.nn.Parameter) and p.requires_grad
    assert p.quantizer is q and p.is_leaf
    frozen = torch.nn.Parameter(q(make_input(SHAPE)), requires_grad=False)
    assert type(frozen) is QuantizedTensor and not frozen.requires_grad


# ---------------------------------------------------------------------------- copy_ with copies missing
def mxfp8_nvfp4(rowwise: bool = True, columnwise: bool = True) -> hybridfp.HybridQuantizer:
    q = hybridfp.HybridQuantizer(hybridfp.NVFP4Quantizer(), hybridfp.MXFP8Quantizer())
    q.set_usage(rowwise=rowwise, columnwise=columnwise)
    return q


@pytest.mark.parametrize("make", [
    lambda **u: mxfp8_nvfp4(**u),
    lambda **u: hybridfp.MXFP8Quantizer(**u),
    lambda **u: hybridfp.HybridQuantizer(hybridfp.MXFP8Quantizer(), hybridfp.MXFP8Quantizer(**u)),
], ids=["hybrid", "mxfp8", "twin_hybrid"])
@pytest.mark.parametrize("src_holds", ["rowwise", "columnwise"])
def test_copy_from_a_tensor_missing_a_copy_is_refused(make, src_holds):
    q_src = make()
    q_src.set_usage(rowwise=src_holds == ROWWISE, columnwise=src_holds == COLUMNWISE)
    dst = make()(make_input(SHAPE, seed=1))
    before = [x.clone() for x in dst.qstorage.tensors()]
    src = q_src(make_input(SHAPE, seed=2))
    missing = COLUMNWISE if src_holds == ROWWISE else ROWWISE
    with pytest.raises(MissingDirectionError, match=rf"holds only its {src_holds} copy.*{missing}.*"
                                                    r"set_usage.*update_usage.*dequantize"):
        dst.copy_(src)
    assert all(torch.equal(a, b) for a, b in zip(dst.qstorage.tensors(), before))  # untouched


def test_copy_from_a_tensor_holding_more_copies_is_fine():
    src = mxfp8_nvfp4()(make_input(SHAPE, seed=2))
    dst = mxfp8_nvfp4(columnwise=False)(make_input(SHAPE, seed=1))
    dst.copy_(src)
    assert dst.directions() == (ROWWISE,)
    assert torch.equal(dst.dequantize(direction=ROWWISE), src.dequantize(direction=ROWWISE))


def test_identity_copies_are_one_tensor_so_either_serves():
    dst = hybridfp.IdentityQuantizer()(make_input(SHAPE, seed=1))
    src = hybridfp.IdentityQuantizer(columnwise=False)(make_input(SHAPE, seed=2))
    dst.copy_(src)
    assert torch.equal(dst.dequantize(direction=COLUMNWISE), src.dequantize())
