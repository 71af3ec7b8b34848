"""Error messages of the quantizers: each names what is wrong and what to change."""

from __future__ import annotations

import pytest
import torch
from quantizer_cases import CASES, ROWWISE_ONLY, make_input

from hybridfp import (Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer,
                      HybridQuantizer, IdentityQuantizer, MissingDirectionError, MXFP8Quantizer,
                      NVFP4Quantizer)
from hybridfp.tensors import COLUMNWISE, ROWWISE

NAMES = sorted(CASES)


# ---------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("name", NAMES)
def test_integer_input(name):
    with pytest.raises(TypeError, match=r"torch\.int32.*float32, bfloat16 or float16.*Cast it first"):
        CASES[name]()(torch.ones(4, 32, dtype=torch.int32))


@pytest.mark.parametrize("bad", [[1.0, 2.0], 3.0, None], ids=["list", "float", "None"])
def test_non_tensor_input(bad):
    with pytest.raises(TypeError, match="must be a torch.Tensor, got"):
        MXFP8Quantizer()(bad)


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4_rht", "identity"])
def test_already_quantized_input(name):
    q = CASES[name]()
    y = q(make_input((4, 32)))
    with pytest.raises(TypeError, match=r"already a QuantizedTensor.*dequantize\(\) it first"):
        q(y)
    with pytest.raises(TypeError, match="already a QuantizedTensor"):
        HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer())(y)


def test_fp8_dtype_input_is_rejected():
    with pytest.raises(TypeError, match="float8_e4m3fn.*Cast it first"):
        MXFP8Quantizer()(torch.ones(4, 32).to(torch.float8_e4m3fn))


def test_update_quantized_checks_shape_and_source():
    q = MXFP8Quantizer()
    dst = q(make_input((4, 32)))
    with pytest.raises(ValueError, match=r"source shape \(4, 64\) differs from destination"):
        q.update_quantized(make_input((4, 64)), dst)
    with pytest.raises(TypeError, match="Cast it first"):
        q.update_quantized(torch.ones(4, 32, dtype=torch.int64), dst)


# ---------------------------------------------------------------- usage and directions
@pytest.mark.parametrize("name", NAMES)
def test_both_usages_off(name):
    q = CASES[name]()
    q.set_usage(rowwise=False, columnwise=False)
    with pytest.raises(ValueError, match=r"rowwise_usage=False and columnwise_usage=False.*set_usage"):
        q(make_input((4, 32)))


def test_both_usages_off_hybrid_is_empty_and_reading_it_fails():
    """A hybrid returns an empty tensor (test_te_semantics.py); its value cannot be read."""
    h = HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(), rowwise=False, columnwise=False)
    y = h(make_input((4, 32)))
    assert y.directions() == ()
    with pytest.raises(MissingDirectionError, match="holds no copy.*set_usage"):
        y.dequantize()


@pytest.mark.parametrize("held,missing", [(ROWWISE, COLUMNWISE), (COLUMNWISE, ROWWISE)])
@pytest.mark.parametrize("hybrid", [False, True], ids=["plain", "hybrid"])
def test_missing_direction_names_direction_and_role(held, missing, hybrid):
    q = HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer()) if hybrid else MXFP8Quantizer()
    q.set_usage(rowwise=held == ROWWISE, columnwise=held == COLUMNWISE)
    q.role = "linear.fc1:grad_output"
    y = q(make_input((4, 32)))
    with pytest.raises(MissingDirectionError, match=rf"no {missing} copy.*linear\.fc1:grad_output|"
                                                    rf"linear\.fc1:grad_output.*no {missing} copy"):
        y.dequantize(direction=missing)
    with pytest.raises(MissingDirectionError, match=f"{missing}_usage=True"):
        y.qstorage.payload(missing)


# ---------------------------------------------------------------- hybrid construction
def test_hybrid_same_child_object_twice():
    q = MXFP8Quantizer()
    with pytest.raises(ValueError, match=r"same object.*q\.copy\(\)"):
        HybridQuantizer(q, q)


def test_hybrid_nested():
    inner = HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer())
    for args in ((inner, MXFP8Quantizer()), (MXFP8Quantizer(), inner)):
        with pytest.raises(TypeError, match="itself a HybridQuantizer; pass the plain quantizer"):
            HybridQuantizer(*args)


@pytest.mark.parametrize("bad", [None, "mxfp8", torch.float8_e4m3fn, MXFP8Quantizer],
                         ids=["None", "str", "dtype", "class"])
def test_hybrid_non_quantizer_child(bad):
    with pytest.raises(TypeError, match=r"columnwise_quantizer must be a Quantizer \(e\.g\. MXFP8Quantizer"):
        HybridQuantizer(MXFP8Quantizer(), bad)
    with pytest.raises(TypeError, match="rowwise_quantizer must be a Quantizer"):
        HybridQuantizer(bad, MXFP8Quantizer())


def test_hybrid_unknown_columnwise_source():
    with pytest.raises(ValueError, match=r"columnwise_source='rowwise'.*'original' or 'rowwise_dequantized'"):
        HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(), "rowwise")


# ---------------------------------------------------------------- unknown options
@pytest.mark.parametrize("make,match", [
    (lambda: MXFP8Quantizer(scale_rule="ceil"), r"scale_rule='ceil'.*'rceil' or 'floor'"),
    (lambda: Float8Quantizer(amax_compute_algo="mean"), r"amax_compute_algo='mean'.*'max' or 'most_recent'"),
    (lambda: Float8Quantizer(amax_history_len=0), r"amax_history_len=0 must be an integer >= 1"),
    (lambda: Float8BlockQuantizer(block_scaling_dim=3), r"block_scaling_dim=3.*use 1 .* or 2"),
    (lambda: Float8CurrentScalingQuantizer("e3m4"), r"fp8_dtype='e3m4'.*'e4m3' or 'e5m2'"),
    (lambda: Float8Quantizer(torch.bfloat16), r"not an FP8 element type.*float8_e4m3fn"),
    (lambda: MXFP8Quantizer("fp8"), r"'e4m3' or 'e5m2'"),
    (lambda: Float8BlockQuantizer("e2m1"), r"'e4m3' or 'e5m2'"),
    (lambda: Float8CurrentScalingQuantizer(amax_epsilon=-1.0), r"amax_epsilon=-1.0 must be a finite number >= 0"),
    (lambda: Float8BlockQuantizer(amax_epsilon=-1.0), r"amax_epsilon=-1.0 must be >= 0"),
    (lambda: IdentityQuantizer(torch.int8), r"IdentityQuantizer\(dtype=torch.int8\).*float32, bfloat16"),
    (lambda: IdentityQuantizer(torch.float8_e4m3fn), r"must be float32, bfloat16, float16 or None"),
], ids=["scale_rule", "amax_algo", "history_len", "block_dim", "fp8_str", "fp8_dtype", "mx_str",
        "block_str", "eps_current", "eps_block", "identity_int", "identity_fp8"])
def test_unknown_options(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ---------------------------------------------------------------- NVFP4 option combinations
@pytest.mark.parametrize("opt", ["with_rht", "with_2d_quantization", "stochastic_rounding"])
def test_row_scaled_not_combinable(opt):
    with pytest.raises(ValueError, match=rf"row_scaled_nvfp4=True cannot be combined with .*{opt}"):
        NVFP4Quantizer(row_scaled_nvfp4=True, columnwise=False, **{opt: True})


def test_rht_with_2d_rejected():
    with pytest.raises(ValueError, match="with_rht=True.*with_2d_quantization=True.*Choose one"):
        NVFP4Quantizer(with_rht=True, with_2d_quantization=True)


def test_row_scaled_with_amax_reduction_rejected():
    with pytest.raises(ValueError, match="with_amax_reduction has no meaning"):
        NVFP4Quantizer(row_scaled_nvfp4=True, with_amax_reduction=True)


ROW_SCALED_COL = r"row-scaled NVFP4.*no columnwise copy.*HybridQuantizer\(rowwise_quantizer=.*set_usage\(columnwise=False\)"


def test_row_scaled_columnwise_request():
    q = NVFP4Quantizer(row_scaled_nvfp4=True)  # columnwise usage left on
    q.role = "grouped_linear.experts:input"
    with pytest.raises(ValueError, match=ROW_SCALED_COL):
        q(make_input((4, 32)))
    with pytest.raises(ValueError, match=r"role: grouped_linear\.experts:input"):
        q(make_input((4, 32)))
    q.set_usage(rowwise=False)
    with pytest.raises(ValueError, match=ROW_SCALED_COL):
        q(make_input((4, 32)))


def test_row_scaled_make_empty_columnwise():
    with pytest.raises(ValueError, match=ROW_SCALED_COL):
        NVFP4Quantizer(row_scaled_nvfp4=True).make_empty((4, 32))
    q = NVFP4Quantizer(row_scaled_nvfp4=True, columnwise=False)
    assert q.make_empty((4, 32)).qstorage.payload(ROWWISE)["amax"].shape == (4,)


def test_row_scaled_as_hybrid_columnwise_child():
    # Caught when the hybrid is built, not at the first backward-only quantization.
    with pytest.raises(ValueError, match=r"columnwise_quantizer.*row-scaled NVFP4.*no columnwise copy"):
        HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(row_scaled_nvfp4=True, columnwise=False))


def test_row_scaled_as_hybrid_rowwise_child_is_fine():
    # The hybrid asks the child for its rowwise copy only, whatever the child's own flags.
    h = HybridQuantizer(NVFP4Quantizer(row_scaled_nvfp4=True), MXFP8Quantizer())
    assert h(make_input((4, 32))).directions() == (ROWWISE, COLUMNWISE)


@pytest.mark.parametrize("name", sorted(ROWWISE_ONLY))
def test_rowwise_only_cases_raise_when_asked_for_columnwise(name):
    q = CASES[name]()
    q.set_usage(columnwise=True)
    with pytest.raises(ValueError, match="no columnwise copy"):
        q(make_input((4, 32)))


def test_copy_shares_handles_not_state():
    """copy(): process groups and generators are shared handles; settings and state copied."""
    import hybridfp as hfp
    group, gen = object(), torch.Generator()
    q = hfp.Float8CurrentScalingQuantizer(with_amax_reduction=True, amax_reduction_group=group,
                                          amax_epsilon=0.5)
    c = q.copy()
    assert c is not q and c.amax_reduction_group is group and c.amax_epsilon == 0.5
    n = hfp.NVFP4Quantizer(stochastic_rounding=True, with_rht=True, generator=gen).copy()
    assert n.generator is gen and n.with_rht and n.stochastic_rounding
    d = hfp.Float8Quantizer()
    d.quantize(torch.full((2, 2), 3.0))
    d.update_scale()
    dc = d.copy()
    assert torch.equal(dc.scale, d.scale) and dc.scale is not d.scale
