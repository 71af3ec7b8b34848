"""Triton FP8 block-scaling kernels (hybridfp/kernels/triton_fp8_block.py) vs the reference,
bitwise: 1D (1x128 rowwise + 128x1 columnwise, transposed) and 2D (128x128) from one read.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from quantize_kernel_cases import (DTYPES, EMPTY_SHAPES, GPU_SHAPES, assert_storage_bitwise,  # noqa: E402
                                   check_against_reference, check_gpu, edge_tensor, gpu, gpu_input,
                                   interpreter_only)

from hybridfp.formats import fp8_block  # noqa: E402
from hybridfp.kernels import triton_fp8_block  # noqa: E402
from hybridfp.kernels._common import poisoned_outputs  # noqa: E402
from hybridfp.quantizers import Float8BlockQuantizer, HybridQuantizer, fast  # noqa: E402
from hybridfp.quantizers.backends import kernels_enabled  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CONFIGS = {
    "1d": dict(block_scaling_dim=1),
    "2d": dict(block_scaling_dim=2),
    "1d_e5m2_nopow2": dict(fp8_dtype=E5M2, block_scaling_dim=1, force_pow_2_scales=False),
    "2d_eps": dict(block_scaling_dim=2, amax_epsilon=4.0, force_pow_2_scales=False),
}
# 130 rows / 260 columns: more than one 128-block in a direction, with partial blocks.
SHAPES = [(3, 40), (33, 50), (130, 40), (20, 260), (2, 5, 36)]


@interpreter_only
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", CONFIGS)
def test_fp8_block_kernel_bitwise(config, dtype, shape):
    x = edge_tensor(shape, dtype, seed=shape[0], specials=True)
    check_against_reference(Float8BlockQuantizer(**CONFIGS[config]), x, what=config)


@interpreter_only
@pytest.mark.parametrize("config", ["1d", "2d"])
@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True)])
def test_fp8_block_kernel_one_direction(config, rowwise, columnwise):
    check_against_reference(Float8BlockQuantizer(**CONFIGS[config]), edge_tensor((40, 130), torch.bfloat16),
                            rowwise, columnwise)


@interpreter_only
@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=str)
@pytest.mark.parametrize("config", ["1d", "2d"])
def test_fp8_block_kernel_empty(config, shape):
    check_against_reference(Float8BlockQuantizer(**CONFIGS[config]), torch.empty(shape))


@interpreter_only
@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("pow2", [True, False])
def test_fp8_block_kernel_small_blocks(block_dim, pow2):
    """32-wide blocks walked in 16-column chunks: many blocks and programs at a tiny shape,
    on a transposed view (strided input), with all-zero blocks (scale 1)."""
    x = edge_tensor((100, 70), torch.float32, seed=6, specials=True).t()
    x[:32, :32] = 0.0
    row, col = triton_fp8_block.quantize(x, E4M3, block_dim=block_dim, block_size=32, chunk=16,
                                         power_2_scale=pow2, eps=0.5)
    opts = dict(block=32, power_2_scale=pow2, eps=0.5)
    quant = fp8_block.quantize_2d if block_dim == 2 else fp8_block.quantize_1d
    d, s = quant(x, E4M3, **opts)
    dc, sc = (d.t(), s.t()) if block_dim == 2 else fp8_block.quantize_1d(x.t(), E4M3, **opts)
    assert torch.equal(row[0].view(torch.uint8), d.view(torch.uint8))
    assert torch.equal(row[1].view(torch.int32), s.view(torch.int32))
    assert torch.equal(col[0].view(torch.uint8), dc.contiguous().view(torch.uint8))
    assert torch.equal(col[1].view(torch.int32), sc.contiguous().view(torch.int32))


@interpreter_only
@pytest.mark.parametrize("chunk,row_slice,pack", [(32, 8, True), (64, 32, False)])
def test_fp8_block_1d_passes(chunk, row_slice, pack):
    """1D with other column-pass / row-slice widths and the byte store: same bytes as the
    reference (a 64-wide block, partial blocks, a transposed view)."""
    x = edge_tensor((150, 68), torch.bfloat16, seed=7, specials=True).t()
    row, col = triton_fp8_block.quantize(x, E4M3, block_size=64, chunk=chunk, row_slice=row_slice, pack=pack)
    d, s = fp8_block.quantize_1d(x, E4M3, block=64)
    dc, sc = fp8_block.quantize_1d(x.t(), E4M3, block=64)
    assert torch.equal(row[0].view(torch.uint8), d.view(torch.uint8)) and torch.equal(row[1], s)
    assert torch.equal(col[0].view(torch.uint8), dc.view(torch.uint8)) and torch.equal(col[1], sc)


@interpreter_only
def test_fp8_block_dispatch_hybrid(monkeypatch):
    monkeypatch.setattr(fast, "_device_ok", lambda x: True)
    x = edge_tensor((40, 140), torch.bfloat16, seed=8)
    q = HybridQuantizer(Float8BlockQuantizer(block_scaling_dim=2), Float8BlockQuantizer(block_scaling_dim=1),
                        "rowwise_dequantized")
    got = q.quantize(x)
    with kernels_enabled(False):
        want = q.quantize(x)
    for d in ("rowwise", "columnwise"):
        assert_storage_bitwise(got.qstorage.part(d), want.qstorage.part(d), d)


@gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("config", ["1d", "2d"])
def test_fp8_block_gpu_bitwise(config, shape):
    check_gpu(Float8BlockQuantizer(**CONFIGS[config]), gpu_input(shape, torch.bfloat16, specials=True))


@gpu
@pytest.mark.parametrize("config", ["1d_e5m2_nopow2", "2d_eps"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_fp8_block_gpu_options(config, dtype):
    check_gpu(Float8BlockQuantizer(**CONFIGS[config]), gpu_input((4096, 4096), dtype))


@gpu
@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True)])
def test_fp8_block_gpu_one_direction(rowwise, columnwise):
    check_gpu(Float8BlockQuantizer(block_scaling_dim=1), gpu_input((4096, 4096), torch.bfloat16),
              rowwise, columnwise)


def _check_tile_method(x: torch.Tensor, block_dim: int, block: int, pow2: bool, eps: float, pack: bool,
                       rowwise: bool = True, columnwise: bool = True, dtype=E4M3) -> None:
    """``method="tile"`` (whole tile in registers) against ``formats.fp8_block``, bytes and
    scale bits."""
    row, col = triton_fp8_block.quantize(x, dtype, block_dim=block_dim, block_size=block, power_2_scale=pow2,
                                         eps=eps, pack=pack, rowwise=rowwise, columnwise=columnwise,
                                         method="tile")
    opts = dict(block=block, power_2_scale=pow2, eps=eps)
    if block_dim == 2:
        d, s = fp8_block.quantize_2d(x, dtype, **opts)
        dc, sc = d.t(), s.t()
    else:
        d, s = fp8_block.quantize_1d(x, dtype, **opts)
        dc, sc = fp8_block.quantize_1d(x.t(), dtype, **opts)
    if rowwise:
        assert torch.equal(row[0].view(torch.uint8), d.view(torch.uint8)), "rowwise data"
        assert torch.equal(row[1].view(torch.int32), s.view(torch.int32)), "rowwise scale_inv"
    else:
        assert row is None
    if columnwise:
        assert torch.equal(col[0].view(torch.uint8), dc.contiguous().view(torch.uint8)), "columnwise data"
        assert torch.equal(col[1].view(torch.int32), sc.contiguous().view(torch.int32)), "columnwise scale_inv"
    else:
        assert col is None


@interpreter_only
@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,pack,transposed", [((100, 70), True, True), ((33, 50), False, False),
                                                   ((64, 96), True, False)], ids=str)
def test_fp8_block_tile_method(block_dim, dtype, shape, pack, transposed):
    """The whole-tile kernel: 32-blocks, partial blocks, strided input, specials, all-zero block."""
    x = edge_tensor(shape, dtype, seed=shape[0], specials=True)
    x = x.t() if transposed else x
    x[:32, :32] = 0.0
    _check_tile_method(x, block_dim, 32, True, 0.0, pack)
    _check_tile_method(x, block_dim, 32, False, 0.5, pack, dtype=E5M2)
    _check_tile_method(x, block_dim, 32, True, 0.0, pack, rowwise=False)
    _check_tile_method(x, block_dim, 32, True, 0.0, pack, columnwise=False)


@gpu
@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("shape", GPU_SHAPES + [(4113, 1000), (1000, 4113)], ids=str)
def test_fp8_block_gpu_tile_method(block_dim, shape):
    """The whole-tile kernel at real and awkward shapes (128-blocks), each direction alone too."""
    x = gpu_input(shape, torch.bfloat16, specials=True)
    with poisoned_outputs(0x7F):
        for rowwise, columnwise in [(True, True), (True, False), (False, True)]:
            _check_tile_method(x, block_dim, 128, True, 0.0, True, rowwise, columnwise)

