"""Storages: payload layout and values, true byte footprint, usage, tensors()/with_tensors()."""

from __future__ import annotations

import pytest
import torch

import hybridfp
from hybridfp.tensors import (COLUMNWISE, ROWWISE, Float8Storage, MissingDirectionError,
                              MXFP8Storage, NVFP4Storage)
from hybridfp.tensors.storage import STORAGE_REGISTRY
from tensor_cases import (BY_NAME, CASES, as2d, assert_bitwise, case_params, data_ptrs,
                          expected_nbytes, layout, make_input, quantize)

TWO_COPY = case_params([c.name for c in CASES if c.col is not None])


@pytest.mark.parametrize("shape", [(70, 200), (2, 3, 40)], ids=str)
@pytest.mark.parametrize("case", case_params())
def test_payload_matches_formats(case, shape):
    """Each copy holds exactly the formats layer's encoding, in the documented layout."""
    x = make_input(shape)
    t = quantize(case, x)
    x2 = as2d(x)
    assert t.directions() == case.directions
    for d in case.directions:
        payload = t.qstorage.payloads[d]
        want = case.payload(d, x2)
        lay = layout(case.key(d), d, *x2.shape)
        assert sorted(payload) == sorted(want) == sorted(lay)
        for name, tensor in payload.items():
            assert (tuple(tensor.shape), tensor.dtype) == lay[name][:2], (d, name)
            assert_bitwise(tensor, want[name])


def test_nvfp4_256x256_footprint_numbers():
    """The byte counts written out: data + scales + global amax, nothing else."""
    x = make_input((256, 256))
    row = hybridfp.NVFP4Quantizer(columnwise=False)(x)
    assert row.quantized_nbytes() == 256 * 128 + 256 * 16 + 4 == 36868
    both = hybridfp.NVFP4Quantizer()(x)  # one global amax shared by both copies
    assert both.quantized_nbytes() == 2 * (256 * 128 + 256 * 16) + 4 == 73732
    rht = hybridfp.NVFP4Quantizer(with_rht=True)(x)  # post-RHT amax is a second scalar
    assert rht.quantized_nbytes() == 2 * (256 * 128 + 256 * 16) + 8
    mx = hybridfp.MXFP8Quantizer(columnwise=False)(x)
    assert mx.quantized_nbytes() == 256 * 256 + 256 * 8 == 67584
    fp8 = hybridfp.Float8CurrentScalingQuantizer()(x)
    assert fp8.quantized_nbytes() == 2 * 256 * 256 + 4
    blk1 = hybridfp.Float8BlockQuantizer(block_scaling_dim=1)(x)
    assert blk1.quantized_nbytes() == 2 * 256 * 256 + 2 * (256 * 2 * 4)
    blk2 = hybridfp.Float8BlockQuantizer(block_scaling_dim=2)(x)
    assert blk2.quantized_nbytes() == 2 * 256 * 256 + 2 * (2 * 2 * 4)
    ident = hybridfp.IdentityQuantizer()(x)  # one tensor serves both directions
    assert ident.quantized_nbytes() == 256 * 256 * 4
    hyb = hybridfp.HybridQuantizer(hybridfp.NVFP4Quantizer(), hybridfp.MXFP8Quantizer())(x)
    assert hyb.quantized_nbytes() == 36868 + 256 * 256 + 256 * 8


@pytest.mark.parametrize("usage", ["both", "rowwise", "columnwise"])
@pytest.mark.parametrize("shape", [(256, 384), (300, 260)], ids=str)
@pytest.mark.parametrize("case", case_params())
def test_nbytes_exact(case, shape, usage):
    if usage == "columnwise" and case.col is None:
        pytest.skip("row-scaled NVFP4 has no columnwise copy")
    dirs = {"both": case.directions, "rowwise": (ROWWISE,), "columnwise": (COLUMNWISE,)}[usage]
    t = quantize(case, make_input(shape), rowwise=ROWWISE in dirs, columnwise=COLUMNWISE in dirs)
    assert t.directions() == dirs
    assert t.quantized_nbytes() == expected_nbytes(case, *shape, dirs)


@pytest.mark.parametrize("shape", [(1, 64), (64, 1), (1, 1), (3, 130), (2, 3, 40)], ids=str)
@pytest.mark.parametrize("case", case_params())
def test_nbytes_with_aliasing_copies(case, shape):
    """Where the transposed copy of a 1-row tensor is the same memory, it is counted once,
    and clone / detach keep it so (the footprint does not change when the tensor is copied)."""
    t = quantize(case, make_input(shape))
    rows, cols = as2d(make_input(shape)).shape
    want = expected_nbytes(case, rows, cols, case.directions)
    assert t.quantized_nbytes() == want
    assert t.clone().quantized_nbytes() == want
    assert t.detach().quantized_nbytes() == want
    assert t.qstorage.map_tensors(torch.clone).nbytes() == want


@pytest.mark.parametrize("case", case_params())
def test_tensors_lists_every_payload_tensor_once(case):
    t = quantize(case, make_input((64, 96)))
    listed = t.qstorage.tensors()
    assert len({id(x) for x in listed}) == len(listed)
    held = {id(x) for d in t.directions() for x in t.qstorage.payloads[d].values()}
    assert {id(x) for x in listed} == held


@pytest.mark.parametrize("case", case_params())
def test_with_tensors_round_trip(case):
    """The hook FSDP2 / offload / recompute use: list the tensors, replace them, rebuild."""
    t = quantize(case, make_input((64, 96)))
    s = t.qstorage
    new = s.with_tensors([x.clone() for x in s.tensors()])
    assert type(new) is type(s) and new.shape == s.shape and new.meta == s.meta
    assert new.directions() == s.directions() and new.label == s.label
    assert not set(p for p in (x.data_ptr() for x in new.tensors())) & set(data_ptrs(t))
    for d in s.directions():
        assert sorted(new.payloads[d]) == sorted(s.payloads[d])
        for name in s.payloads[d]:
            assert_bitwise(new.payloads[d][name], s.payloads[d][name])
        assert_bitwise(new.dequantize(direction=d), s.dequantize(direction=d))
    # sharing between the copies survives (e.g. one FP8 scale_inv for both directions)
    if len(s.directions()) == 2:
        for name in set(s.payloads[ROWWISE]) & set(s.payloads[COLUMNWISE]):
            same = s.payloads[ROWWISE][name] is s.payloads[COLUMNWISE][name]
            assert (new.payloads[ROWWISE][name] is new.payloads[COLUMNWISE][name]) == same
    with pytest.raises(ValueError, match="payload tensor"):
        s.with_tensors(s.tensors()[:-1])
    with pytest.raises(ValueError, match="payload tensor"):
        s.with_tensors(s.tensors() + [s.tensors()[0]])


@pytest.mark.parametrize("case", case_params())
def test_map_tensors(case):
    t = quantize(case, make_input((160, 288)))  # >= 2 tiles each way: no aliased copies
    s = t.qstorage
    calls = []
    same = s.map_tensors(lambda x: calls.append(x) or x)
    assert len(calls) == len(s.tensors())  # once per distinct tensor
    assert [id(x) for x in same.tensors()] == [id(x) for x in s.tensors()]
    zero = s.map_tensors(torch.zeros_like)  # all-zero payloads decode to 0 in every format
    for d in s.directions():
        # == rather than bitwise: the inverse RHT turns some zeros into -0.0
        assert torch.equal(zero.dequantize(direction=d), torch.zeros(160, 288))
        assert_bitwise(s.dequantize(direction=d), t.dequantize(direction=d))  # source untouched


def test_map_tensors_keeps_aliased_copies_aliased():
    """FP8 per-tensor [1, N]: the columnwise copy (a contiguous transpose) is the rowwise memory."""
    t = hybridfp.Float8CurrentScalingQuantizer()(make_input((1, 64)))
    s = t.qstorage
    assert s.payloads[ROWWISE]["data"].data_ptr() == s.payloads[COLUMNWISE]["data"].data_ptr()
    c = s.map_tensors(torch.clone)
    assert c.payloads[ROWWISE]["data"].data_ptr() == c.payloads[COLUMNWISE]["data"].data_ptr()
    assert c.payloads[ROWWISE]["data"].data_ptr() != s.payloads[ROWWISE]["data"].data_ptr()
    assert tuple(c.payloads[COLUMNWISE]["data"].shape) == (64, 1)
    assert c.nbytes() == s.nbytes() == 64 + 4


@pytest.mark.parametrize("keep", [ROWWISE, COLUMNWISE])
@pytest.mark.parametrize("case", TWO_COPY)
def test_update_usage_drops_a_copy(case, keep):
    x = make_input((64, 96))
    t = quantize(case, x)
    before = t.dequantize(direction=keep)
    drop = COLUMNWISE if keep == ROWWISE else ROWWISE
    t.update_usage(**{f"{drop}_usage": False})
    assert t.directions() == (keep,)
    assert not t.has_direction(drop)
    assert t.quantized_nbytes() == expected_nbytes(case, 64, 96, (keep,))
    assert_bitwise(t.dequantize(direction=keep), before)
    assert_bitwise(t.dequantize(), before)  # the only copy left is the default
    t.update_usage(**{f"{keep}_usage": True})  # keeping a held copy is a no-op
    assert t.directions() == (keep,)
    with pytest.raises(MissingDirectionError, match=f"Cannot add a {drop} copy"):
        t.update_usage(**{f"{drop}_usage": True})
    with pytest.raises(ValueError, match="no copy at all"):
        t.update_usage(**{f"{keep}_usage": False})
    assert t.directions() == (keep,)


@pytest.mark.parametrize("case", case_params())
def test_update_usage_cannot_drop_everything(case):
    t = quantize(case, make_input((32, 32)))
    with pytest.raises(ValueError, match="no copy at all"):
        t.update_usage(rowwise_usage=False, columnwise_usage=False)
    assert t.directions() == case.directions


@pytest.mark.parametrize("missing", [ROWWISE, COLUMNWISE])
@pytest.mark.parametrize("case", case_params())
def test_missing_direction_error_names_direction_and_role(case, missing):
    if missing == ROWWISE and case.col is None:
        pytest.skip("row-scaled NVFP4 has only the rowwise copy")
    q = case.make(rowwise=missing != ROWWISE, columnwise=missing != COLUMNWISE)
    q.role = "linear.input"
    t = q(make_input((32, 48)))
    assert t.directions() == tuple(d for d in (ROWWISE, COLUMNWISE) if d != missing)
    for ask in (lambda: t.dequantize(direction=missing), lambda: t.qstorage.decode(missing)):
        with pytest.raises(MissingDirectionError) as err:
            ask()
        msg = str(err.value)
        assert f"no {missing} copy" in msg and "linear.input" in msg and f"{missing}_usage=True" in msg
    assert issubclass(MissingDirectionError, RuntimeError)


@pytest.mark.parametrize("case", case_params(["mxfp8", "identity", "hybrid_nvfp4_mxfp8"]))
def test_unknown_direction_name(case):
    t = quantize(case, make_input((32, 32)))
    with pytest.raises(ValueError, match="'rowwise' or 'columnwise'"):
        t.dequantize(direction="both")
    with pytest.raises(ValueError, match="'rowwise' or 'columnwise'"):
        t.has_direction("row")


def test_storage_construction_errors():
    with pytest.raises(ValueError, match="at least one of rowwise / columnwise"):
        MXFP8Storage((4, 32), torch.float32, None, None)
    with pytest.raises(TypeError, match=r"unknown options \['block'\]"):
        MXFP8Storage((4, 32), torch.float32, {"data": torch.zeros(4, 32)}, None, block=16)
    assert {"Float8Storage", "Float8BlockStorage", "MXFP8Storage", "NVFP4Storage", "IdentityStorage",
            "HybridStorage"} <= set(STORAGE_REGISTRY)
    assert STORAGE_REGISTRY["NVFP4Storage"] is NVFP4Storage


def test_hybrid_parts_hold_only_their_direction():
    s = hybridfp.MXFP8Quantizer()(make_input((32, 32))).qstorage  # holds both copies
    with pytest.raises(ValueError, match="must hold only its rowwise copy"):
        hybridfp.tensors.HybridStorage((32, 32), torch.float32, s, None)


def test_describe_and_repr_name_format_shape_role():
    q = hybridfp.Float8CurrentScalingQuantizer(columnwise=False)
    q.role = "linear.weight"
    t = q(make_input((2, 3, 16)))
    assert isinstance(t.qstorage, Float8Storage)
    assert t.qstorage.describe() == "FP8 per-tensor tensor of shape (2, 3, 16) (role: linear.weight)"
    assert repr(t) == ("QuantizedTensor(FP8 per-tensor tensor of shape (2, 3, 16) (role: linear.weight), "
                       "holds=['rowwise'], dtype=torch.float32, device=cpu)")
    h = BY_NAME["hybrid_nvfp4_mxfp8"].make()
    h.role = "linear.grad_output"
    assert h(make_input((32, 32))).qstorage.describe() == (
        "Hybrid[NVFP4/MXFP8] tensor of shape (32, 32) (role: linear.grad_output)")


@pytest.mark.parametrize("drop", [None, COLUMNWISE])
@pytest.mark.parametrize("case", case_params())
def test_skeleton_of_placeholders_rebuilds_the_storage(case, drop):
    """Saving for backward: keep the tensors apart, a skeleton built with None in their place,
    and rebuild later. The skeleton remembers which copies share a tensor."""
    t = quantize(case, make_input((64, 96)))
    if drop and len(t.directions()) == 2:
        t.update_usage(columnwise_usage=False)
    s = t.qstorage
    tensors = s.tensors()
    skeleton = s.with_tensors([None] * len(tensors))
    assert all(x is None for x in skeleton.tensors()) and len(skeleton.tensors()) == len(tensors)
    rebuilt = skeleton.with_tensors(tensors)
    assert [id(x) for x in rebuilt.tensors()] == [id(x) for x in tensors]
    assert rebuilt.directions() == s.directions() and rebuilt.nbytes() == s.nbytes()
    for d in s.directions():
        assert {n: id(x) for n, x in rebuilt.payloads[d].items()} == {
            n: id(x) for n, x in s.payloads[d].items()}
        assert_bitwise(rebuilt.dequantize(direction=d), s.dequantize(direction=d))
