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

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from hybridfp.formats import fp8_block  # noqa: E402
from hybridfp.kernels import triton_fp8_block  # noqa: E402
from hybridfp.kernels._common import poisoned_outputs  # noqa: E402
from hybridfp.kernels._common_encode import current_scale, fp8_params  # noqa: E402
from hybridfp.kernels.triton_fp8_block import block_inv, block_scale  # noqa: E402
from hybridfp.quantizers import Float8BlockQuantizer, HybridQuantizer, fast  # noqa: E402
from hybridfp import policy  # noqa: E402

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
    monkeypatch.setattr(fast, "device_ok", lambda x: True)
    x = edge_tensor((40, 140), torch.bfloat16, seed=8)
    q = HybridQuantizer(Float8BlockQuantizer(block_scaling_dim=2), Float8BlockQuantizer(block_scaling_dim=1),
                        "rowwise_dequantized")
    got = q.quantize(x)
    with policy(quantize_kernels=False):
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



def _check_1d(x: torch.Tensor, block: int, dtype=E4M3, pow2: bool = True, eps: float = 0.0,
              rowwise: bool = True, columnwise: bool = True, **kw) -> None:
    """``triton_fp8_block.quantize`` (1D, ``kw``: method / chunk / row_slice / pack) against
    ``formats.fp8_block.quantize_1d`` of x and of x.t(): bytes and scale bits."""
    row, col = triton_fp8_block.quantize(x, dtype, block_size=block, power_2_scale=pow2, eps=eps,
                                         rowwise=rowwise, columnwise=columnwise, **kw)
    opts = dict(block=block, power_2_scale=pow2, eps=eps)
    if rowwise:
        d, s = fp8_block.quantize_1d(x, dtype, **opts)
        assert torch.equal(row[0].view(torch.uint8), d.view(torch.uint8)), "rowwise data"
        assert torch.equal(row[1].view(torch.int32), s.view(torch.int32)), "rowwise scale_inv"
    else:
        assert row is None
    if columnwise:
        dc, sc = fp8_block.quantize_1d(x.t(), dtype, **opts)
        assert torch.equal(col[0].view(torch.uint8), dc.contiguous().view(torch.uint8)), "columnwise data"
        assert torch.equal(col[1].view(torch.int32), sc.contiguous().view(torch.int32)), "columnwise scale_inv"
    else:
        assert col is None


#: (shape, block): interior-only tiles (the EVEN path: R and C multiples of the block), partial
#: edge tiles, R not a multiple of 4 (byte stores instead of words), odd C, one row.
NATURAL_SHAPES = [((64, 96), 32), ((128, 64), 64), ((70, 100), 32), ((66, 40), 32), ((40, 37), 32),
                  ((1, 33), 32), ((96, 64), 32)]


#: Every shape in BF16; FP16 / FP32 on two of them (the interpreter takes ~10 s a case and the
#: input dtype only changes the load, which the other kernels' tests cover at every shape).
NATURAL_CASES = ([(shape, block, torch.bfloat16) for shape, block in NATURAL_SHAPES]
                 + [((66, 40), 32, torch.float16), ((96, 64), 32, torch.float32)])


@interpreter_only
@pytest.mark.parametrize("shape,block,dtype", NATURAL_CASES, ids=str)
def test_fp8_block_1d_natural(shape, block, dtype):
    """The "natural" 1D kernel (column amaxes from the rowwise pass, columnwise copy from natural
    slices): EVEN and edge tiles, words and bytes, NaN / ±inf, an all-zero block, FP32 / BF16 /
    FP16, a transposed (strided) view for the last shape."""
    x = edge_tensor(shape, dtype, seed=shape[1], specials=True)
    if shape == (96, 64):
        x = edge_tensor((64, 96), dtype, seed=3, specials=True).t()
    x[:min(32, shape[0]), :32] = 0.0
    _check_1d(x, block, method="natural")
    _check_1d(x, block, E5M2, pow2=False, eps=0.5, method="natural", chunk=8, row_slice=8)


@interpreter_only
@pytest.mark.parametrize("shape,block", [((64, 96), 32)], ids=str)
@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True)])
def test_fp8_block_1d_natural_one_direction(shape, block, rowwise, columnwise):
    x = edge_tensor(shape, torch.bfloat16, seed=5, specials=True)
    _check_1d(x, block, rowwise=rowwise, columnwise=columnwise, method="natural")
    _check_1d(x, block, rowwise=rowwise, columnwise=columnwise, method="natural", pack=False, chunk=4)


@interpreter_only
def test_fp8_block_1d_methods_agree():
    """method="slices" (transposed column sub-tiles read twice) still gives the same bytes."""
    x = edge_tensor((70, 100), torch.bfloat16, seed=9, specials=True)
    _check_1d(x, 32, method="slices")
    _check_1d(x, 32, method="natural", chunk=32, row_slice=32)


@triton.jit
def _scale_kernel(a_ptr, out_ptr, eps, N, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
    """Per amax: current_scale, block_scale, IEEE 1 / current_scale, block_inv
    (power-of-two)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    a = tl.load(a_ptr + offs, mask=m, other=0.0)
    want = current_scale(a, eps, FP8_MAX, True)
    got = block_scale(a, eps, FP8_MAX, True)
    tl.store(out_ptr + offs * 4, want, mask=m)
    tl.store(out_ptr + offs * 4 + 1, got, mask=m)
    tl.store(out_ptr + offs * 4 + 2, tl.math.div_rn(tl.full(want.shape, 1.0, tl.float32), want), mask=m)
    tl.store(out_ptr + offs * 4 + 3, block_inv(got, True), mask=m)


@interpreter_only
@pytest.mark.parametrize("fmax_dtype", [E4M3, E5M2], ids=str)
def test_block_scale_matches_current_scale(fmax_dtype):
    """``block_scale`` / ``block_inv`` (power-of-two scales by exponent arithmetic, exact
    reciprocal) equal ``_common_encode.current_scale`` (with its finite-decode lower bound) and the IEEE ``1 / scale`` bit for bit: every biased
    exponent with mantissas at and around FP8_MAX's, subnormals, 0, inf, NaN, several eps."""
    fmax = fp8_params(fmax_dtype)[2]
    fbits = torch.tensor(fmax, dtype=torch.float32).view(torch.int32).item() & 0x7FFFFF
    mants = torch.tensor([0, 1, 2, fbits - 1, fbits, fbits + 1, 0x400000, 0x7FFFFE, 0x7FFFFF], dtype=torch.int32)
    exps = torch.arange(0, 256, dtype=torch.int32)
    bits = ((exps[:, None] << 23) | mants[None, :]).reshape(-1)
    bits = torch.cat([bits, torch.randint(0, 0x7F800000, (2000,), generator=torch.Generator().manual_seed(1),
                                          dtype=torch.int32)])
    a = bits.view(torch.float32)
    for eps in [0.0, 1e-40, 0.5, 4.0, 3e38]:
        out = torch.empty(a.numel() * 4, dtype=torch.float32)
        _scale_kernel[(triton.cdiv(a.numel(), 256),)](a, out, eps, a.numel(), FP8_MAX=fmax, BLOCK=256)
        o = out.view(-1, 4).view(torch.int32)
        assert torch.equal(o[:, 0], o[:, 1]), f"scale, eps={eps}"
        assert torch.equal(o[:, 2], o[:, 3]), f"scale_inv, eps={eps}"


#: 1D configurations the GPU test runs (method, num_warps, chunk, row_slice).
#: (None: the defaults, "natural" 128 / 32 rows on 4 warps.)
GPU_1D_CONFIGS = [(None, None, None, None), ("natural", 4, 32, 16), ("natural", 2, 32, 16), ("natural", 1, 16, 8),
                  ("natural", 4, 64, 32), ("natural", 8, 128, 32), ("natural", 4, 64, 64),
                  ("natural", 8, 64, 32), ("natural", 8, 128, 64), ("slices", 4, None, 16)]


@gpu
@pytest.mark.parametrize("config", GPU_1D_CONFIGS, ids=str)
@pytest.mark.parametrize("shape", [(4096, 4096), (4113, 1000), (1000, 4114)], ids=str)
def test_fp8_block_gpu_1d_configs(config, shape):
    """Each 1D configuration at an interior-only shape (the EVEN path) and at awkward ones (edge
    tiles, R % 4 != 0: byte stores), outputs poisoned, each direction alone too, and contiguous
    FP32; E5M2 with non-power-of-two scales, FP16 and column-major FP32 input at the first shape."""
    method, nw, chunk, rw = config
    kw = dict(method=method, num_warps=nw, chunk=chunk, row_slice=rw)
    x = gpu_input(shape, torch.bfloat16, specials=True)
    with poisoned_outputs(0x7F):
        for rowwise, columnwise in [(True, True), (True, False), (False, True)]:
            _check_1d(x, 128, rowwise=rowwise, columnwise=columnwise, **kw)
        _check_1d(x.float(), 128, **kw)  # contiguous FP32: the packed natural path miscompiled there
        if shape == (4096, 4096):
            _check_1d(x.half(), 128, E5M2, pow2=False, eps=2.0**-20, **kw)
            _check_1d(x.float().t(), 128, **kw)
