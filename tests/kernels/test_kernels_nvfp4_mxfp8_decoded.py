"""The fused NVFP4 -> MXFP8 hybrid kernel writing either copy as its BF16 decode
(``triton_hybrid_nvfp4.quantize(decoded=...)``, a hybrid's ``hold_decoded``: Composer-2's
experts, NVFP4-forward / MXFP8-backward layers) vs the reference encode converted by
``with_decoded``, bitwise; the grouped weights' pass (``grouped_scaled.nvfp4_mxfp8_groups``) too.

CPU: interpreter, awkward shapes, edge values with NaN / inf, per-tensor and row-scaled amax,
both columnwise sources, every subset of decoded copies. GPU (``-m gpu``): real shapes.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from quantize_kernel_cases import (GPU_SHAPES, assert_storage_bitwise, edge_tensor, gpu, gpu_input,  # noqa: E402
                                   interpreter_only, run_kernel)

from hybridfp.kernels._common import poisoned_outputs  # noqa: E402
from hybridfp.quantizers import HybridQuantizer, MXFP8Quantizer, NVFP4Quantizer, fast  # noqa: E402
from hybridfp.quantizers.backends import ReferenceQuantizeWarning  # noqa: E402
from hybridfp.moe.quantize_scaled import nvfp4_mxfp8_groups  # noqa: E402
from hybridfp.tensors import (COLUMNWISE, ROWWISE, DecodedMXFP8Storage, DecodedNVFP4Storage,  # noqa: E402
                              MXFP8Storage, NVFP4Storage)

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

SUBSETS = [(ROWWISE,), (COLUMNWISE,), (ROWWISE, COLUMNWISE)]
SOURCES = ["rowwise_dequantized", "original"]


def _hybrid(source: str, row_scaled: bool, held) -> HybridQuantizer:
    q = HybridQuantizer(NVFP4Quantizer(row_scaled_nvfp4=row_scaled), MXFP8Quantizer(), source)
    q.hold_decoded = held
    return q


def check(q: HybridQuantizer, x: torch.Tensor, rowwise: bool = True, columnwise: bool = True, what: str = ""):
    """The kernel's hybrid equals the reference's with ``hold_decoded`` converted, part by part."""
    want = q.reference_encode(x, rowwise, columnwise).with_decoded(q.hold_decoded)
    got = run_kernel(q, x, rowwise, columnwise)
    for d in want.directions():
        gp, wp = got.part(d), want.part(d)
        decoded = d in q.hold_decoded
        assert type(gp) is type(wp) is ({ROWWISE: DecodedNVFP4Storage, COLUMNWISE: DecodedMXFP8Storage}[d] if decoded
                                        else {ROWWISE: NVFP4Storage, COLUMNWISE: MXFP8Storage}[d])
        assert_storage_bitwise(gp, wp, f"{what} {d}")
    return got


@interpreter_only
@pytest.mark.parametrize("held", SUBSETS, ids="+".join)
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("row_scaled", [False, True], ids=["global", "row_scaled"])
@pytest.mark.parametrize("shape", [(64, 96), (40, 160), (100, 48)], ids=str)
def test_hybrid_decoded_bitwise(shape, row_scaled, source, held):
    x = edge_tensor(shape, torch.bfloat16, seed=shape[0] + shape[1], specials=True)
    check(_hybrid(source, row_scaled, held), x, what=f"{shape} {source} {held}")


@interpreter_only
@pytest.mark.parametrize("row_scaled", [False, True], ids=["global", "row_scaled"])
def test_hybrid_decoded_one_copy_asked(row_scaled):
    """A rowwise-only request held decoded (the NVFP4 kernel alone writes codes) and a columnwise-
    only request from the rowwise value (the rowwise copy computed in registers, not stored)."""
    x = edge_tensor((64, 64), torch.bfloat16, seed=9, specials=True)
    got = check(_hybrid("rowwise_dequantized", row_scaled, (ROWWISE, COLUMNWISE)), x, True, False)
    assert got.directions() == (ROWWISE,)
    got = check(_hybrid("rowwise_dequantized", row_scaled, (ROWWISE, COLUMNWISE)), x, False, True)
    assert got.directions() == (COLUMNWISE,)


@interpreter_only
@pytest.mark.parametrize("held", SUBSETS, ids="+".join)
def test_grouped_weights_decoded(held):
    """Composer-2's weights: every expert's NVFP4 rows (its own amax) and the padded groups' MXFP8
    columns from one fused pass, decoded, equal each expert's reference encode converted."""
    splits, starts = [32, 0, 64, 32], [0, 32, 32, 96]
    padded = edge_tensor((128, 64), torch.bfloat16, seed=4)
    hq = _hybrid("rowwise_dequantized", False, held)
    got = nvfp4_mxfp8_groups(hq, padded, splits, starts)
    for e, (m, s) in enumerate(zip(splits, starts)):
        ref = hq.reference_encode(padded[s:s + m], True, False).with_decoded(hq.hold_decoded).part(ROWWISE)
        assert_storage_bitwise(got.rows()[e], ref, f"expert {e} rows")
    src = torch.zeros(padded.shape)  # each expert's rowwise value (its own amax), zero padding rows
    for m, s in zip(splits, starts):
        src[s:s + m] = hq.rowwise_quantizer.reference_encode(padded[s:s + m], True, False).dequantize(
            torch.float32, ROWWISE)
    ref_cols = hq.columnwise_quantizer.reference_encode(src, False, True)
    if COLUMNWISE in held:
        ref_cols = ref_cols.with_decoded(frozenset({COLUMNWISE}))
    cols = got.cols
    assert type(cols) is type(ref_cols)
    for name, t in ref_cols.payload(COLUMNWISE).items():
        assert torch.equal(cols.payload(COLUMNWISE)[name].view(torch.uint8), t.view(torch.uint8))


def test_hybrid_decodable():
    q = HybridQuantizer(NVFP4Quantizer(), MXFP8Quantizer(), "rowwise_dequantized")
    assert q.decodable(frozenset({ROWWISE})) == {ROWWISE}
    for rq, cq in ((NVFP4Quantizer(stochastic_rounding=True), MXFP8Quantizer()),
                   (NVFP4Quantizer(with_2d_quantization=True), MXFP8Quantizer()),
                   (MXFP8Quantizer(), NVFP4Quantizer(with_rht=True))):
        hq = HybridQuantizer(rq, cq)
        assert hq.decodable(frozenset({ROWWISE, COLUMNWISE})) == frozenset()
        with pytest.raises(ValueError, match="cannot hold"):
            hq.hold_decoded = (ROWWISE,)


@gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("held", SUBSETS, ids="+".join)
@pytest.mark.parametrize("row_scaled", [False, True], ids=["global", "row_scaled"])
def test_hybrid_decoded_gpu(shape, held, row_scaled):
    x = gpu_input(shape, torch.bfloat16, specials=True)
    q = _hybrid("rowwise_dequantized", row_scaled, held)
    want = q.reference_encode(x, True, True).with_decoded(q.hold_decoded)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReferenceQuantizeWarning)
        with poisoned_outputs(0x7F):
            got = q.encode(x, True, True)
    torch.cuda.synchronize()
    assert fast.HYBRID_KERNEL.supports(q, x, True, True)
    for d in (ROWWISE, COLUMNWISE):
        assert type(got.part(d)) is type(want.part(d))
        assert_storage_bitwise(got.part(d), want.part(d), f"{shape} {held} {d}")
