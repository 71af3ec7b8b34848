"""Loading a saved QuantizedTensor checks every field before anything reads it.

A file is data, not code: ``torch.load(weights_only=True)`` rebuilds a QuantizedTensor from a
plain-data state (class name, header shape / dtype, format options, payload tensors per
direction). Each test writes a file whose state disagrees with itself in one field, loads it
the way users do, and expects a ValueError naming that field and what was expected — never a
tensor that a GEMM would then read with the payload's shape instead of the header's.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

import hybridfp
from hybridfp.gemm import gemm
from hybridfp.tensors.quantized_tensor import _rebuild_quantized_tensor
from tensor_cases import case_params, make_input, quantize

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")


class _Crafted:
    """Pickles as the call torch.load makes for a saved QuantizedTensor, with ``state``."""

    def __init__(self, state: object, requires_grad: object = False, is_param: object = False) -> None:
        self.args = (state, requires_grad, is_param)

    def __reduce_ex__(self, protocol: int):
        return (_rebuild_quantized_tensor, self.args)


def load_state(state: object, requires_grad: object = False, is_param: object = False):
    """torch.save a tensor whose saved state is ``state``, then load it weights_only."""
    buf = io.BytesIO()
    torch.save(_Crafted(state, requires_grad, is_param), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def state_of(t: hybridfp.QuantizedTensor) -> dict:
    """A deep copy of the state ``torch.save(t)`` writes."""
    return copy.deepcopy(t.qstorage.to_state())


def first_part(state: dict, direction: str = "rowwise") -> dict:
    """The state holding ``direction``'s payload (a hybrid's part, else the state itself)."""
    return state["parts"][direction] if "parts" in state else state


def mxfp8_weight() -> hybridfp.QuantizedTensor:
    return hybridfp.MXFP8Quantizer()(make_input((64, 64)))


# ---------------------------------------------------------------------------- the header
def test_header_shape_disagreeing_with_payload_is_refused_before_any_gemm():
    state = state_of(mxfp8_weight())
    state["shape"] = (32, 64)  # the payloads hold 64 rows
    with pytest.raises(ValueError, match=r"rowwise payload 'data' has shape \(64, 64\); expected \(32, 64\)"):
        w = load_state(state)
        gemm(torch.randn(4, 64), w)  # what a corrupt file would otherwise reach


@pytest.mark.parametrize("case", case_params())
def test_every_format_checks_its_payload_shapes_against_the_header(case):
    t = quantize(case, make_input((64, 96)))
    state = state_of(t)
    state["shape"] = (32, 96)
    if "parts" in state:  # a hybrid: header and parts both claim 32 rows
        for p in state["parts"].values():
            if p is not None:
                p["shape"] = (32, 96)
    with pytest.raises(ValueError, match=r"payload '\w+' has shape .*; expected"):
        load_state(state)


@pytest.mark.parametrize("case", case_params())
def test_every_format_still_loads_its_own_state(case):
    t = quantize(case, make_input((2, 48, 64)))
    loaded = load_state(state_of(t))
    assert loaded.shape == t.shape and loaded.directions() == t.directions()
    for d in t.directions():
        assert torch.equal(loaded.dequantize(direction=d), t.dequantize(direction=d))


@pytest.mark.parametrize("field, value, match", [
    ("shape", (64, -1), "shape"),
    ("shape", "64x64", "shape"),
    ("dtype", torch.int32, "dtype"),
    ("dtype", "float32", "dtype"),
    ("label", 3, "label"),
    ("cls", "NoSuchStorage", "NoSuchStorage"),
    ("cls", "QuantizedStorage", "QuantizedStorage"),
])
def test_header_fields_are_type_checked(field, value, match):
    state = state_of(mxfp8_weight())
    state[field] = value
    with pytest.raises(ValueError, match=match):
        load_state(state)


@pytest.mark.parametrize("missing", ["cls", "shape", "dtype", "label", "meta", "payloads"])
def test_missing_header_field(missing):
    state = state_of(mxfp8_weight())
    del state[missing]
    with pytest.raises(ValueError, match=missing):
        load_state(state)


def test_state_and_flags_must_be_plain_data():
    with pytest.raises(ValueError, match="state"):
        load_state(["not", "a", "dict"])
    with pytest.raises(ValueError, match="requires_grad"):
        load_state(state_of(mxfp8_weight()), requires_grad="yes")
    with pytest.raises(ValueError, match="is_param"):
        load_state(state_of(mxfp8_weight()), is_param=2)


# ---------------------------------------------------------------------------- payload tensors
def test_payload_dtype_is_checked():
    state = state_of(mxfp8_weight())
    state["payloads"]["rowwise"]["data"] = state["payloads"]["rowwise"]["data"].float()
    with pytest.raises(ValueError, match=r"rowwise payload 'data' has dtype torch.float32; expected torch.float8_e4m3fn"):
        load_state(state)


def test_scale_dtype_and_shape_are_checked():
    state = state_of(mxfp8_weight())
    state["payloads"]["columnwise"]["scale"] = state["payloads"]["columnwise"]["scale"].float()
    with pytest.raises(ValueError, match=r"columnwise payload 'scale' has dtype torch.float32; expected torch.uint8"):
        load_state(state)
    state = state_of(mxfp8_weight())
    state["payloads"]["rowwise"]["scale"] = torch.zeros(64, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"rowwise payload 'scale' has shape \(64, 3\); expected \(64, 2\)"):
        load_state(state)


def test_per_tensor_scale_shape_is_checked():
    t = hybridfp.Float8CurrentScalingQuantizer()(make_input((64, 64)))
    state = state_of(t)
    state["payloads"]["rowwise"]["scale_inv"] = torch.ones(64)
    with pytest.raises(ValueError, match=r"'scale_inv' has shape \(64,\); expected \(\)"):
        load_state(state)


def test_payload_names_are_checked():
    state = state_of(mxfp8_weight())
    del state["payloads"]["rowwise"]["scale"]
    with pytest.raises(ValueError, match=r"rowwise payload.*missing \['scale'\]"):
        load_state(state)
    state = state_of(mxfp8_weight())
    state["payloads"]["rowwise"]["extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"rowwise payload.*unexpected \['extra'\]"):
        load_state(state)


@pytest.mark.parametrize("bad", [[1, 2, 3], "data", None])
def test_payload_entries_must_be_plain_tensors(bad):
    state = state_of(mxfp8_weight())
    state["payloads"]["rowwise"]["data"] = bad
    with pytest.raises(ValueError, match=r"rowwise payload 'data' must be a torch.Tensor"):
        load_state(state)


def test_a_payload_cannot_be_a_quantized_tensor():
    inner = mxfp8_weight()
    state = state_of(mxfp8_weight())
    state["payloads"]["rowwise"]["data"] = inner  # rebuilt by the same allowed function
    with pytest.raises(ValueError, match=r"'data' must be a torch.Tensor.*QuantizedTensor"):
        load_state(state)


def test_directions_are_checked():
    state = state_of(mxfp8_weight())
    state["payloads"]["diagonal"] = state["payloads"].pop("columnwise")
    with pytest.raises(ValueError, match=r"directions.*'rowwise', 'columnwise'"):
        load_state(state)
    state = state_of(mxfp8_weight())
    state["payloads"] = {"rowwise": None, "columnwise": None}
    with pytest.raises(ValueError, match="at least one"):
        load_state(state)


# ---------------------------------------------------------------------------- format options
@pytest.mark.parametrize("option, value", [
    ("fp8_dtype", torch.float32),
    ("fp8_dtype", "e4m3"),
    ("block_2d", "yes"),
    ("block_2d", 1),
])
def test_format_options_take_known_values_only(option, value):
    state = state_of(mxfp8_weight())
    state["meta"][option] = value
    with pytest.raises(ValueError, match=option):
        load_state(state)


def test_unknown_format_option():
    state = state_of(mxfp8_weight())
    state["meta"]["swizzle"] = True
    with pytest.raises(ValueError, match="swizzle"):
        load_state(state)


def test_option_decides_the_expected_layout():
    """An E5M2 option over E4M3 data: the dtype check follows the loaded option."""
    state = state_of(hybridfp.Float8CurrentScalingQuantizer()(make_input((64, 64))))
    state["meta"]["fp8_dtype"] = torch.float8_e5m2
    with pytest.raises(ValueError, match=r"'data' has dtype torch.float8_e4m3fn; expected torch.float8_e5m2"):
        load_state(state)


def test_fp8_block_options():
    state = state_of(hybridfp.Float8BlockQuantizer(block_scaling_dim=1)(make_input((64, 64))))
    state["meta"]["block_dim"] = 3
    with pytest.raises(ValueError, match="block_dim"):
        load_state(state)
    state = state_of(hybridfp.Float8BlockQuantizer(block_scaling_dim=1)(make_input((64, 64))))
    state["meta"]["block"] = 0
    with pytest.raises(ValueError, match="block"):
        load_state(state)


def test_nvfp4_row_scaled_amax_shape_and_options():
    q = hybridfp.NVFP4Quantizer(row_scaled_nvfp4=True)
    q.set_usage(columnwise=False)
    state = state_of(q(make_input((64, 64))))
    state["payloads"]["rowwise"]["amax"] = torch.ones(())
    with pytest.raises(ValueError, match=r"'amax' has shape \(\); expected \(64,\)"):
        load_state(state)
    state = state_of(q(make_input((64, 64))))
    state["meta"]["block_2d"] = True
    with pytest.raises(ValueError, match="row_scaled"):
        load_state(state)


# ---------------------------------------------------------------------------- Identity, hybrid
def test_identity_payload_is_checked():
    t = hybridfp.IdentityQuantizer()(make_input((64, 64)))
    state = state_of(t)
    state["payloads"]["rowwise"]["data"] = torch.zeros(32, 64)
    state["payloads"]["columnwise"]["data"] = state["payloads"]["rowwise"]["data"]
    with pytest.raises(ValueError, match=r"'data' has shape \(32, 64\); expected \(64, 64\)"):
        load_state(state)
    state = state_of(t)
    state["payloads"]["rowwise"]["data"] = torch.zeros(64, 64, dtype=torch.int64)
    state["payloads"]["columnwise"]["data"] = state["payloads"]["rowwise"]["data"]
    with pytest.raises(ValueError, match=r"'data' has dtype torch.int64; expected one of"):
        load_state(state)


def test_identity_copies_must_be_one_tensor():
    """Both copies of an Identity tensor are one tensor; a file with two different ones would
    otherwise load with its columnwise tensor silently dropped."""
    state = state_of(hybridfp.IdentityQuantizer()(make_input((64, 64))))
    state["payloads"]["columnwise"]["data"] = torch.zeros(64, 64)
    with pytest.raises(ValueError, match="one tensor"):
        load_state(state)


def hybrid_state() -> dict:
    q = hybridfp.HybridQuantizer(hybridfp.NVFP4Quantizer(), hybridfp.MXFP8Quantizer())
    return state_of(q(make_input((64, 64))))


def test_hybrid_part_shape_must_match_the_header():
    state = hybrid_state()
    state["shape"] = (32, 64)
    with pytest.raises(ValueError, match=r"rowwise part has shape \(64, 64\); expected \(32, 64\)"):
        load_state(state)


def test_hybrid_part_must_hold_its_own_direction():
    state = hybrid_state()
    part = state["parts"]["rowwise"]
    part["payloads"]["columnwise"], part["payloads"]["rowwise"] = part["payloads"]["rowwise"], None
    with pytest.raises(ValueError, match="rowwise part"):
        load_state(state)


def test_hybrid_parts_are_single_format_storages():
    state = hybrid_state()
    state["parts"]["rowwise"] = hybrid_state()
    with pytest.raises(ValueError, match="HybridStorage"):
        load_state(state)
    state = hybrid_state()
    state["parts"]["diagonal"] = state["parts"].pop("columnwise")
    with pytest.raises(ValueError, match="parts"):
        load_state(state)


def test_hybrid_part_payload_is_checked():
    state = hybrid_state()
    first_part(state, "columnwise")["payloads"]["columnwise"]["scale"] = torch.zeros(1, 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"columnwise payload 'scale' has shape \(1, 1\)"):
        load_state(state)
