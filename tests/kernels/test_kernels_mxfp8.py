"""Triton MXFP8 quantize kernels (hybridfp/kernels/triton_mxfp8.py) vs the reference, bitwise.

CPU: interpreter, tiny awkward shapes, edge values (FP8 grid points, midpoints and their
neighbours, subnormals, ±max, NaN, ±inf), both rules and element types, 1D and 2D, each
direction alone. GPU (``-m gpu``): 4096x4096 and 16384x4096 inputs through the registry.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from quantize_kernel_cases import (DTYPES, EMPTY_SHAPES, GPU_SHAPES, SHAPES, assert_storage_bitwise,  # noqa: E402
                                   check_against_reference, check_gpu, edge_tensor, gpu, gpu_input,
                                   interpreter_only, run_kernel)

from hybridfp.formats import mxfp8  # noqa: E402
from hybridfp.kernels import triton_mxfp8  # noqa: E402
from hybridfp.quantizers import HybridQuantizer, MXFP8Quantizer, fast  # noqa: E402
from hybridfp import policy  # noqa: E402
from hybridfp.quantizers.backends import select_quantize_kernel  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CONFIGS = {
    "1d_e4m3_rceil": dict(fp8_dtype=E4M3),
    "1d_e5m2_floor": dict(fp8_dtype=E5M2, scale_rule="floor"),
    "2d_e4m3_floor": dict(fp8_dtype=E4M3, scale_rule="floor", with_2d_quantization=True),
    "2d_e5m2_rceil": dict(fp8_dtype=E5M2, with_2d_quantization=True),
}


@interpreter_only
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", CONFIGS)
def test_mxfp8_kernel_bitwise(config, dtype, shape):
    x = edge_tensor(shape, dtype, seed=len(shape) + shape[-1], specials=True)
    check_against_reference(MXFP8Quantizer(**CONFIGS[config]), x, what=config)


@interpreter_only
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True)])
def test_mxfp8_kernel_one_direction(config, rowwise, columnwise):
    x = edge_tensor((33, 70), torch.bfloat16, seed=3)
    check_against_reference(MXFP8Quantizer(**CONFIGS[config]), x, rowwise, columnwise)


@interpreter_only
@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=str)
def test_mxfp8_kernel_empty(shape):
    check_against_reference(MXFP8Quantizer(), torch.empty(shape, dtype=torch.bfloat16))


@interpreter_only
@pytest.mark.parametrize("block_2d", [False, True])
def test_mxfp8_kernel_zeros_and_tiles(block_2d):
    """All-zero blocks (smallest scale, zero data) and several programs in each direction:
    a 32x32 tile on a 96x160 input with a transposed (non-contiguous) view."""
    x = edge_tensor((160, 96), torch.float32, seed=5).t()
    x[:40, :50] = 0.0
    row, col = triton_mxfp8.quantize(x, E4M3, block_2d=block_2d, block=(32, 32))
    q2 = mxfp8.quantize_2d if block_2d else mxfp8.quantize_1d
    d, s = q2(x, E4M3)
    assert torch.equal(row[0].view(torch.uint8), d.view(torch.uint8)) and torch.equal(row[1], s)
    dc, sc = (d.t(), s.t()) if block_2d else mxfp8.quantize_1d(x.t(), E4M3)
    assert torch.equal(col[0].view(torch.uint8), dc.contiguous().view(torch.uint8))
    assert torch.equal(col[1], sc.contiguous())


@interpreter_only
def test_mxfp8_dispatch_and_hybrid(monkeypatch):
    """With the device check opened to CPU tensors, quantize() (and a hybrid's children, with
    rowwise_dequantized) goes through the kernel and equals the reference path."""
    monkeypatch.setattr(fast, "device_ok", lambda x: True)
    x = edge_tensor((40, 64), torch.bfloat16, seed=7)
    hybrid = HybridQuantizer(MXFP8Quantizer(), MXFP8Quantizer(E5M2, scale_rule="floor"),
                             "rowwise_dequantized")
    assert select_quantize_kernel(hybrid.rowwise_quantizer, x, True, False) is fast.MXFP8_KERNEL
    got = hybrid.quantize(x)
    with policy(quantize_kernels=False):
        want = hybrid.quantize(x)
    for d in ("rowwise", "columnwise"):
        assert_storage_bitwise(got.qstorage.part(d), want.qstorage.part(d), d)


@interpreter_only
def test_mxfp8_not_selected_on_cpu():
    """The registry only picks the Triton kernels for CUDA tensors."""
    assert select_quantize_kernel(MXFP8Quantizer(), torch.zeros(4, 32), True, True) is None
    assert run_kernel(MXFP8Quantizer(), torch.ones(2, 32)).has("columnwise")


@gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("config", CONFIGS)
def test_mxfp8_gpu_bitwise(config, shape):
    check_gpu(MXFP8Quantizer(**CONFIGS[config]), gpu_input(shape, torch.bfloat16, specials=True))


@gpu
@pytest.mark.parametrize("tile", [((128, 64), 2), ((32, 128), 4), ((64, 64), 2)], ids=str)
@pytest.mark.parametrize("shape", [(4096, 4096), (1000, 4160)], ids=str)
def test_mxfp8_gpu_tiles(shape, tile):
    """The 1D kernel at tiles other than the default (``block`` is public; none is faster
    than the default on an NVIDIA H200), both copies and each alone, bitwise
    the reference, outputs poisoned."""
    from hybridfp.kernels._common import poisoned_outputs
    x = gpu_input(shape, torch.bfloat16, specials=True)
    want_row, want_col = mxfp8.quantize_1d(x, E4M3), mxfp8.quantize_1d(x.t(), E4M3)
    for rowwise, columnwise in ((True, True), (True, False), (False, True)):
        with poisoned_outputs():
            row, col = triton_mxfp8.quantize(x, E4M3, block=tile[0], num_warps=tile[1], rowwise=rowwise,
                                             columnwise=columnwise)
        for got, want, d in ((row, want_row, "row"), (col, want_col, "col")):
            if got is not None:
                assert torch.equal(got[0].view(torch.uint8), want[0].contiguous().view(torch.uint8)), f"{tile} {d}"
                assert torch.equal(got[1], want[1].contiguous()), f"{tile} {d} scales"


@interpreter_only
@pytest.mark.parametrize("wide", [1, 2])
def test_mxfp8_wide_stores(wide):
    x = torch.randn(96, 200).to(torch.bfloat16)
    x[3, 5], x[17, 0] = float("nan"), float("inf")
    _check_wide_stores(x, wide)


def test_mxfp8_wide_stores_refuses_unknown_width():
    with pytest.raises(ValueError, match="wide_stores=3"):
        triton_mxfp8.quantize(torch.ones(32, 32, dtype=torch.bfloat16), E4M3, wide_stores=3)


@gpu
@pytest.mark.parametrize("wide", [1, 2])
@pytest.mark.parametrize("shape", [(4096, 4096), (1000, 4160), (2080, 4160)], ids=str)
def test_mxfp8_gpu_wide_stores(shape, wide):
    _check_wide_stores(gpu_input(shape, torch.bfloat16, specials=True), wide)


def _check_wide_stores(x: torch.Tensor, wide: int) -> None:
    """The "slices" columnwise copy with wide stores (``wide_stores``: codes two threads wide per
    column; 2: also both blocks' scale bytes in one store) writes the reference's bytes: both
    copies, columnwise alone, a row map of padded groups; outputs poisoned."""
    from hybridfp.kernels._common import poisoned_outputs
    want_row, want_col = mxfp8.quantize_1d(x, E4M3), mxfp8.quantize_1d(x.t(), E4M3)
    for rowwise in (True, False):
        with poisoned_outputs():
            row, col = triton_mxfp8.quantize(x, E4M3, rowwise=rowwise, wide_stores=wide, method="slices")
        got = ([row] if rowwise else []) + [col]
        want = ([want_row] if rowwise else []) + [want_col]
        for (gd, gs), (wd, ws) in zip(got, want):
            assert torch.equal(gd.view(torch.uint8), wd.view(torch.uint8)) and torch.equal(gs, ws)
    # row maps (the grouped copies' zero-padded groups) of 7 and 8 padding rows: byte and packed
    # word stores; equal to the default stores' bytes
    for pad in (7, 8):
        rmap = torch.arange(-pad, x.shape[0], dtype=torch.int32, device=x.device)
        rmap[rmap < 0] = -1
        base = triton_mxfp8.quantize(x, E4M3, row_map=rmap, wide_stores=0, method="slices")
        with poisoned_outputs():
            wide_out = triton_mxfp8.quantize(x, E4M3, row_map=rmap, wide_stores=wide, method="slices")
        for a, b in zip(base, wide_out):
            assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("rowwise,columnwise", [(True, True), (True, False), (False, True)])
def test_mxfp8_gpu_dtypes_directions(dtype, rowwise, columnwise):
    check_gpu(MXFP8Quantizer(), gpu_input((4096, 4096), dtype), rowwise, columnwise)


@interpreter_only
@pytest.mark.parametrize("block_2d", [False, True])
def test_mxfp8_kernel_int32_packed_columnwise(block_2d):
    """The int32-packed transposed store (``pack=True``, the default, R % 4 == 0) writes the
    same bytes as the byte store, partial tiles and several warps' columns included."""
    for shape, block in [((64, 96), (64, 64)), ((96, 160), (32, 32)), ((100, 40), (64, 64)),
                         ((68, 300), (64, 256))]:
        x = edge_tensor(shape, torch.bfloat16, seed=shape[0], specials=True)
        a = triton_mxfp8.quantize(x, E4M3, block_2d=block_2d, block=block, rowwise=False, pack=False)[1]
        b = triton_mxfp8.quantize(x, E4M3, block_2d=block_2d, block=block, rowwise=False, pack=True)[1]
        assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])

