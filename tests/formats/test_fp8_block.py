"""Tests for FP8 block scaling, DeepSeek-V3 style (numerics §2.3)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridfp.formats.common import (
    FP32_MAX,
    blocks_1d,
    blocks_2d,
    ceil_div,
    expand_blocks_1d,
    expand_blocks_2d,
)
from hybridfp.formats.fp8_block import dequantize_1d, dequantize_2d, quantize_1d, quantize_2d
from hybridfp.formats.fp8_tensorwise import current_scale, dequantize, quantize

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [E4M3, E5M2]
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]
# Worst RNE error of one FP8 cast: half an ulp relative to |y| for normals
# (2^-(mantissa bits + 1)), half the smallest subnormal step below the normal range.
REL_HALF_ULP = {E4M3: 2.0**-4, E5M2: 2.0**-3}
SUB_HALF_STEP = {E4M3: 2.0**-10, E5M2: 2.0**-17}
SHAPES = [(1, 1), (3, 130), (257, 33), (129, 257), (128, 128), (0, 5), (5, 0), (0, 0)]


def bits32(t: torch.Tensor) -> list[int]:
    return t.float().contiguous().view(torch.int32).flatten().tolist()


def bits8(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.uint8).flatten().tolist()


def ref_scale(amax: float, dtype: torch.dtype, pow2: bool) -> float:
    """Block scale by the words of numerics §2.3, in scalar FP32 arithmetic (independent of the module)."""
    if amax == 0 or not math.isfinite(amax):
        return 1.0
    s = (torch.tensor(FP8_MAX[dtype]) / torch.tensor(amax)).item()  # FP32 IEEE division
    if math.isinf(s):
        s = FP32_MAX
    if pow2:
        s = 2.0 ** (math.frexp(s)[1] - 1)
    return s


def ref_quantize_blocks(x: torch.Tensor, dtype: torch.dtype, br: int, bc: int, pow2: bool):
    """Slice each br x bc block (no padding), scale it, cast; returns (data, scale_inv)."""
    rows, cols = x.shape
    nr, nc = ceil_div(rows, br), ceil_div(cols, bc)
    data = torch.empty(rows, cols, dtype=dtype)
    scale_inv = torch.empty(nr, nc)
    xf = x.float().cpu()
    for i in range(nr):
        for j in range(nc):
            blk = xf[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            s = ref_scale(blk.abs().max().item(), dtype, pow2)
            data[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (blk * s).clamp(
                -FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
            scale_inv[i, j] = 1.0 / torch.tensor(s)
    return data, scale_inv


def sqnr_db(x: torch.Tensor, d: torch.Tensor) -> float:
    return 10 * math.log10(x.pow(2).sum().item() / (x - d).pow(2).sum().item())


# ---------------------------------------------------------------- shapes and reference


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("kind", ["1d", "2d"])
@pytest.mark.parametrize("device", DEVICES)
def test_matches_blockwise_reference(shape, dtype, kind, device):
    g = torch.Generator().manual_seed(0)
    # Row and column magnitudes spread over 2^-12..2^12 so that blocks get different scales.
    x = torch.randn(shape, generator=g) * 2.0 ** torch.randint(-12, 13, shape, generator=g)
    qfn, dqfn, br = (quantize_1d, dequantize_1d, 1) if kind == "1d" else (quantize_2d, dequantize_2d, 128)
    data, scale_inv = qfn(x.to(device), dtype)
    nb = (shape[0], ceil_div(shape[1], 128)) if kind == "1d" else (
        ceil_div(shape[0], 128), ceil_div(shape[1], 128))
    assert data.shape == shape and data.dtype == dtype and data.device.type == device
    assert scale_inv.shape == nb and scale_inv.dtype == torch.float32
    assert scale_inv.device.type == device
    ref_data, ref_inv = ref_quantize_blocks(x, dtype, br, 128, pow2=True)
    assert bits8(data.cpu()) == bits8(ref_data)
    assert bits32(scale_inv.cpu()) == bits32(ref_inv)
    out = dqfn(data, scale_inv)
    assert out.shape == shape and out.device.type == device


@pytest.mark.parametrize("kind", ["1d", "2d"])
@pytest.mark.parametrize("dtype", FP8)
def test_non_pow2_scales_match_reference(kind, dtype):
    x = torch.randn(130, 300, generator=torch.Generator().manual_seed(1)) * 3.7
    qfn, br = (quantize_1d, 1) if kind == "1d" else (quantize_2d, 128)
    data, scale_inv = qfn(x, dtype, power_2_scale=False)
    ref_data, ref_inv = ref_quantize_blocks(x, dtype, br, 128, pow2=False)
    assert bits8(data) == bits8(ref_data) and bits32(scale_inv) == bits32(ref_inv)
    # Without rounding the scale down, every block's amax lands exactly on fp8_max.
    q = data.float().abs()
    tiles = blocks_1d(q, 128) if kind == "1d" else blocks_2d(q, 128, 128)
    assert tiles.amax(dim=-1).eq(FP8_MAX[dtype]).all()


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["1d", "2d"])
def test_half_inputs_equal_their_fp32_upcast(in_dtype, kind):
    x = (torch.randn(3, 260, generator=torch.Generator().manual_seed(2)) * 5).to(in_dtype)
    qfn = quantize_1d if kind == "1d" else quantize_2d
    d1, sc1 = qfn(x)
    d2, sc2 = qfn(x.float())
    assert bits8(d1) == bits8(d2) and bits32(sc1) == bits32(sc2)


# ---------------------------------------------------------------- hand-computed boundaries


def test_1d_block_boundaries_3x130():
    x = torch.zeros(3, 130)
    x[0, 5], x[0, 7] = 2.0, -0.5           # amax exactly 2: 448/2 = 224 -> 128
    # row 0, cols 128..129: a block of zeros -> scale 1
    x[1, 127] = 0.875                      # 448 / 0.875 = 512 exactly: amax hits 448
    x[1, 129] = -1.0                       # partial last block (2 columns): 256
    x[2, 0] = 225.0                        # 448/225 < 2 -> 1; 225 rounds down to 224
    x[2, 128] = torch.nextafter(torch.tensor(0.875), torch.tensor(1.0))  # 511.99.. -> 256
    data, scale_inv = quantize_1d(x)
    assert scale_inv.tolist() == [[1 / 128, 1.0], [1 / 512, 1 / 256], [1.0, 1 / 256]]
    q = data.float()
    assert q[0, 5].item() == 256.0 and q[0, 7].item() == -64.0
    assert q[0, 128:].tolist() == [0.0, 0.0]
    assert q[1, 127].item() == 448.0 and q[1, 129].item() == -256.0
    assert q[2, 0].item() == 224.0 and q[2, 128].item() == 224.0
    assert q.count_nonzero().item() == 6
    out = dequantize_1d(data, scale_inv)
    assert out[1].tolist()[127] == 0.875 and out[2, 0].item() == 224.0


def test_2d_tile_boundaries_130x130():
    x = torch.zeros(130, 130)
    x[127, 127] = 2.0     # tile (0, 0): 128
    x[0, 129] = 0.875     # tile (0, 1), 128 x 2: 512
    x[129, 0] = -448.0    # tile (1, 0), 2 x 128: 1
    # tile (1, 1), 2 x 2 of zeros: 1
    data, scale_inv = quantize_2d(x)
    assert scale_inv.tolist() == [[1 / 128, 1 / 512], [1.0, 1.0]]
    q = data.float()
    assert (q[127, 127].item(), q[0, 129].item(), q[129, 0].item()) == (256.0, 448.0, -448.0)
    assert q.count_nonzero().item() == 3
    assert bits32(dequantize_2d(data, scale_inv)) == bits32(x)  # all four values are exact


@pytest.mark.parametrize("dtype", FP8)
def test_block_of_one_element(dtype):
    x = torch.tensor([[3.0, -0.1, 0.0, 1e-30]])
    m = FP8_MAX[dtype]
    data, scale_inv = quantize_1d(x, dtype, block=1, power_2_scale=False)
    assert data.float().tolist() == [[m, -m, 0.0, m]]  # each element is its own block
    data, scale_inv = quantize_1d(x, dtype, block=1)
    assert scale_inv[0, 2].item() == 1.0 and data.float()[0, 2].item() == 0.0
    # Power-of-two scales put each nonzero element in (fp8_max / 2, fp8_max].
    q = data.float()[0, [0, 1, 3]].abs()
    assert ((q > m / 2) & (q <= m)).all()
    # Shifting by a power of two keeps the mantissa: in the normal range this equals a plain cast.
    assert bits32(dequantize_1d(data, scale_inv, block=1)[0, :2]) == bits32(
        torch.tensor([3.0, -0.1]).to(dtype).float()
    )


@pytest.mark.parametrize("dtype", FP8)
def test_nan_and_inf_blocks(dtype):
    m = FP8_MAX[dtype]
    x = torch.full((2, 256), 0.25)
    x[0, 3] = math.nan
    x[0, 4] = 1e6
    x[1, 200] = -math.inf
    data, scale_inv = quantize_1d(x, dtype)
    # Non-finite block amax -> scale 1 (numerics §2.1); the other blocks are unaffected.
    assert scale_inv[0, 0].item() == 1.0 and scale_inv[1, 1].item() == 1.0
    q = data.float()
    assert math.isnan(q[0, 3].item()) and q[0, 4].item() == m and q[0, 5].item() == 0.25
    assert q[1, 200].item() == -m and q[1, 201].item() == 0.25
    good = ref_scale(0.25, dtype, True)
    assert 1 / scale_inv[0, 1].item() == good and 1 / scale_inv[1, 0].item() == good
    assert torch.isnan(q).sum().item() == 1


def test_eps_on_zero_block():
    data, scale_inv = quantize_1d(torch.zeros(2, 130), eps=1e-3)
    assert scale_inv.flatten().tolist() == [2.0**-18] * 4  # pow2_floor(448 / 1e-3) = 2^18
    assert data.float().abs().sum().item() == 0.0
    data, scale_inv = quantize_2d(torch.full((4, 4), 1e-5), eps=1e-3, power_2_scale=False)
    assert bits32(scale_inv) == bits32(torch.tensor(1.0) / (torch.tensor(448.0) / torch.tensor(1e-3)))


def test_fp32_subnormal_block_uses_clamped_scale():
    # 448 / 2^-130 overflows -> FP32_MAX -> 2^127; 2^-140 * 2^127 = 2^-13 is below half the
    # smallest E4M3 subnormal (2^-9) and flushes to zero.
    x = torch.tensor([[2.0**-130, -(2.0**-131), 2.0**-140]])
    data, scale_inv = quantize_1d(x)
    assert bits32(scale_inv) == bits32(torch.tensor([[2.0**-127]]))
    assert data.float().tolist() == [[0.125, -0.0625, 0.0]]
    assert dequantize_1d(data, scale_inv).tolist() == [[2.0**-130, -(2.0**-131), 0.0]]
    data, scale_inv = quantize_1d(x, power_2_scale=False)
    assert bits32(scale_inv) == bits32(torch.tensor(1.0) / torch.tensor(FP32_MAX))


def test_requantize_doubles_scale_when_amax_rounds_down_to_half_max():
    # 225 * 1 rounds to 224 = 448 / 2, so the dequantized block asks for scale 2 next time.
    x = torch.tensor([[225.0, 3.0]])
    data, scale_inv = quantize_1d(x)
    deq = dequantize_1d(data, scale_inv)
    data2, scale_inv2 = quantize_1d(deq)
    assert (scale_inv.item(), scale_inv2.item()) == (1.0, 0.5)
    assert data.float().tolist() == [[224.0, 3.0]] and data2.float().tolist() == [[448.0, 6.0]]
    assert bits32(dequantize_1d(data2, scale_inv2)) == bits32(deq)


def test_dequantize_out_dtype_and_validation():
    data, scale_inv = quantize_1d(torch.randn(4, 200, generator=torch.Generator().manual_seed(3)))
    out = dequantize_1d(data, scale_inv, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert bits32(out.float()) == bits32(dequantize_1d(data, scale_inv).bfloat16().float())
    with pytest.raises(ValueError, match="block size"):
        dequantize_1d(data, scale_inv, block=32)
    with pytest.raises(ValueError, match="block size"):
        dequantize_2d(data, scale_inv)
    with pytest.raises(ValueError, match="2D"):
        quantize_1d(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="block"):
        quantize_2d(torch.zeros(2, 3), block=0)


# ---------------------------------------------------------------- directions


@pytest.mark.parametrize("shape", [(1, 1), (3, 130), (257, 33), (200, 300)])
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("device", DEVICES)
def test_2d_of_transpose_is_transpose_of_2d(shape, dtype, device):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(shape, generator=g) * 2.0 ** torch.randint(-8, 9, shape, generator=g)).to(device)
    d, s = quantize_2d(x, dtype)
    dt, st_ = quantize_2d(x.t(), dtype)
    assert bits8(dt) == bits8(d.t()) and bits32(st_) == bits32(s.t())


def test_1d_columnwise_uses_128x1_blocks():
    x = torch.randn(300, 5, generator=torch.Generator().manual_seed(5))
    x[:128, 0] *= 1000.0  # only the first 128x1 column block of column 0 is large
    d, s = quantize_1d(x.t())
    assert d.shape == (5, 300) and s.shape == (5, 3)
    assert s[0, 0].item() > 100 * s[0, 1].item()
    ref_data, ref_inv = ref_quantize_blocks(x, E4M3, 128, 1, pow2=True)
    assert bits8(d) == bits8(ref_data.t()) and bits32(s) == bits32(ref_inv.t())


# ---------------------------------------------------------------- accuracy and properties


@pytest.mark.parametrize("kind", ["1d", "2d"])
def test_sqnr_gaussian_and_outlier_rows(kind):
    g = torch.Generator().manual_seed(6)
    qfn, dqfn = (quantize_1d, dequantize_1d) if kind == "1d" else (quantize_2d, dequantize_2d)
    x = torch.randn(256, 512, generator=g)
    # E4M3's 3 mantissa bits give ~31.5 dB on N(0, 1), power-of-two scales included.
    assert 30.0 < sqnr_db(x, dqfn(*qfn(x))) < 33.0
    # Blocks adapt to magnitude: rows at 2^-24 keep ~31 dB under 1x128 and 128x128 blocks
    # when their blocks hold no large row; per-tensor scaling flushes them to zero (0 dB).
    x[128:] *= 2.0**-24
    blk = dqfn(*qfn(x))
    q, si = quantize(x, current_scale(x.abs().amax(), E4M3, power_2_scale=True), E4M3)
    tw = dequantize(q, si)
    assert sqnr_db(x[128:], blk[128:]) > 30.0
    assert sqnr_db(x[128:], tw[128:]) < 1.0


@st.composite
def block_inputs(draw):
    rows, cols = draw(st.integers(1, 6)), draw(st.integers(1, 300))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    lo = draw(st.integers(-60, 40))
    spread = draw(st.integers(0, 30))  # in-block dynamic range reaches the FP8 subnormals
    x = torch.randn(rows, cols, generator=g) * 2.0 ** torch.randint(lo, lo + spread + 1, (rows, cols), generator=g).float()
    x[torch.rand(rows, cols, generator=g) < 0.05] = 0.0
    return x


@settings(max_examples=60, deadline=None)
@given(x=block_inputs(), dtype=st.sampled_from(FP8), kind=st.sampled_from(["1d", "2d"]),
       pow2=st.booleans(), block=st.sampled_from([128, 32, 7]))
def test_property_error_bound_and_reference(x, dtype, kind, pow2, block):
    qfn, dqfn = (quantize_1d, dequantize_1d) if kind == "1d" else (quantize_2d, dequantize_2d)
    data, scale_inv = qfn(x, dtype, block=block, power_2_scale=pow2)
    br = 1 if kind == "1d" else block
    ref_data, ref_inv = ref_quantize_blocks(x, dtype, br, block, pow2)
    assert bits8(data) == bits8(ref_data) and bits32(scale_inv) == bits32(ref_inv)
    out = dqfn(data, scale_inv, block=block)
    rows, cols = x.shape
    inv = (expand_blocks_1d(scale_inv, block, cols) if kind == "1d"
           else expand_blocks_2d(scale_inv, block, block, rows, cols))
    # x*scale (rel. 2^-24) is rounded by at most half an FP8 ulp: REL_HALF_ULP * |y| for
    # normals, SUB_HALF_STEP below; times scale_inv (rel. 2^-24, plus 2^-149-sized steps if
    # FP32-subnormal). The scale never exceeds fp8_max / block_amax, so nothing saturates
    # beyond an FP32 rounding; 1 + 2^-20 covers the FP32 roundings.
    bound = (REL_HALF_ULP[dtype] * x.abs() + SUB_HALF_STEP[dtype] * inv) * (1 + 2.0**-20)
    assert ((out - x).abs() <= bound + 2.0**-147).all()
    if kind == "2d":
        dt, st_ = quantize_2d(x.t(), dtype, block=block, power_2_scale=pow2)
        assert bits8(dt) == bits8(data.t()) and bits32(st_) == bits32(scale_inv.t())


@settings(max_examples=60, deadline=None)
@given(x=block_inputs(), dtype=st.sampled_from(FP8), kind=st.sampled_from(["1d", "2d"]))
def test_property_idempotence(x, dtype, kind):
    qfn, dqfn = (quantize_1d, dequantize_1d) if kind == "1d" else (quantize_2d, dequantize_2d)
    data, scale_inv = qfn(x, dtype)
    deq = dqfn(data, scale_inv)
    data2, scale_inv2 = qfn(deq, dtype)
    # Power-of-two scales: re-quantizing the dequantized values gives them back exactly.
    assert bits32(dqfn(data2, scale_inv2)) == bits32(deq)
    # A block keeps its scale and bits, or (amax rounded down onto fp8_max / 2) doubles it.
    same = scale_inv2 == scale_inv
    assert (same | (scale_inv2 * 2 == scale_inv)).all()
    rows, cols = x.shape
    same_e = (expand_blocks_1d(same, 128, cols) if kind == "1d"
              else expand_blocks_2d(same, 128, 128, rows, cols))
    assert torch.equal(data2.view(torch.uint8)[same_e], data.view(torch.uint8)[same_e])
