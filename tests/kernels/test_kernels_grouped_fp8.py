"""Grouped per-tensor scaling kernels (hybridfp/kernels/moe/triton_grouped_fp8.py), through
``quantize_grouped``'s ``encode_group_scaled(kernel=True)``: every expert's FP8 current-scaling
copies (rowwise, and its own transpose as the columnwise copy) and every expert's 1D NVFP4
rowwise copy (its per-tensor amax expanded to its rows through ``triton_nvfp4``'s row-scaled
path) equal, bit for bit, that expert's own ``reference_encode``; zero-size experts, counts that
are not multiples of 4 / 16 / 32 / 128, NaN / inf inputs, E4M3 and E5M2, power-of-two scales and
amax epsilon. Interpreter on tiny shapes (CPU); compiled at the MoE shape with ``-m gpu``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from quantize_kernel_cases import (DTYPES, assert_storage_bitwise, assert_tensor_bitwise, edge_tensor,  # noqa: E402
                                   gpu, gpu_input, interpreter_only)

from hybridfp.kernels._common import poisoned_outputs  # noqa: E402
from hybridfp.kernels.moe.triton_grouped_fp8 import group_amax  # noqa: E402
from hybridfp.quantizers import Float8CurrentScalingQuantizer, NVFP4Quantizer  # noqa: E402
from hybridfp.quantizers.backends import select_quantize_kernel  # noqa: E402
from hybridfp.moe.quantize import encode_group_scaled  # noqa: E402
from hybridfp.moe.quantize_scaled import padded_ld  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = {
    "e4m3": dict(fp8_dtype=E4M3),
    "e5m2_pow2": dict(fp8_dtype=E5M2, force_pow_2_scales=True),
    "e4m3_eps": dict(fp8_dtype=E4M3, amax_epsilon=4.0),
}
#: an empty expert first and last, one-row experts, counts not multiples of 4 / 16 / 32
SPLITS = [0, 3, 1, 37, 0, 18, 5, 0]


def grouped_input(splits, cols: int, dtype: torch.dtype, *, specials: bool = True) -> torch.Tensor:
    """Edge values, each expert at its own magnitude (2**-6 .. 2**6), so per-expert scales differ."""
    x = edge_tensor((sum(splits), cols), torch.float32, seed=cols, specials=specials)
    mag = torch.cat([torch.full((m, 1), 2.0 ** (3 * (e % 5) - 6)) for e, m in enumerate(splits)])
    return (x * mag).to(dtype)


def check_grouped(q, x: torch.Tensor, splits, rowwise: bool, columnwise: bool, what: str) -> None:
    """Kernel result per expert == that expert's own reference_encode, bitwise (on CUDA through
    the default selection, which must pick the kernels)."""
    if x.is_cuda:
        assert select_quantize_kernel(q, x, rowwise, columnwise) is not None
    with poisoned_outputs(0x7F):
        got = encode_group_scaled(q, x, splits, rowwise, columnwise, kernel=None if x.is_cuda else True).parts()
    for e, (part, xe) in enumerate(zip(got, torch.split(x, splits))):
        want = q.copy().reference_encode(xe, rowwise, columnwise)
        assert_storage_bitwise(part, want, f"{what} expert {e} ({xe.shape[0]} rows)")
        if columnwise:  # its own transpose: a 16-byte aligned column slice of the joined
            # [C, Σ padded m] matrix whose rows continue with zero codes up to a multiple of 16
            # (the cuBLAS / Triton wgrad reads it padded, no copy)
            col = part.payload("columnwise")["data"]
            m, ld = xe.shape[0], padded_ld(xe.shape[0])
            width = sum(padded_ld(s) for s in splits)
            assert col.shape == (x.shape[1], m) and col.stride() == (width, 1) and col.data_ptr() % 16 == 0
            assert part.columnwise_zero_tail
            tail = col.as_strided((x.shape[1], ld), (width, 1))[:, m:]
            assert not tail.view(torch.uint8).any(), f"{what} expert {e}: nonzero row tail"


@interpreter_only
@pytest.mark.parametrize("cols", [40, 129])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", FP8)
def test_grouped_fp8_current_kernel_bitwise(config, dtype, cols):
    x = grouped_input(SPLITS, cols, dtype)
    q = Float8CurrentScalingQuantizer(**FP8[config])
    check_grouped(q, x, SPLITS, True, True, config)
    check_grouped(q, x, SPLITS, False, True, f"{config} columnwise only")
    check_grouped(q, x, SPLITS, True, False, f"{config} rowwise only")
    # groups longer than a tile (32 rows): tiles wholly inside one group and tiles across
    # group boundaries
    long = [70, 0, 45, 96, 3]
    check_grouped(q, grouped_input(long, cols, dtype), long, True, True, f"{config} long groups")


@interpreter_only
def test_grouped_fp8_nan_expert_gets_scale_one():
    """A NaN in one expert makes only that expert's scale 1 (numerics §2.1); the others keep theirs."""
    splits = [5, 6, 7]
    x = grouped_input(splits, 33, torch.bfloat16, specials=False)
    x[7, 3] = float("nan")
    x[14, 0] = float("inf")
    got = encode_group_scaled(Float8CurrentScalingQuantizer(), x, splits, True, True, kernel=True).parts()
    sinv = torch.stack([p.payload("rowwise")["scale_inv"] for p in got])
    assert sinv[1] == 1 and sinv[2] == 1 and sinv[0] != 1
    check_grouped(Float8CurrentScalingQuantizer(), x, splits, True, True, "nan/inf experts")


@interpreter_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cols", [40, 64])
def test_grouped_nvfp4_rows_kernel_bitwise(dtype, cols):
    """An expert's per-tensor amax on each of its rows (row-scaled kernel path) gives that
    expert's own per-tensor NVFP4 bits; the amax handed out is the expert's own."""
    x = grouped_input(SPLITS, cols, dtype)
    check_grouped(NVFP4Quantizer(), x, SPLITS, True, False, "nvfp4")


@interpreter_only
def test_group_amax_kernel():
    splits = [0, 70, 1, 0, 65, 3]  # tiles of 64 rows: one group, several groups, a group over tiles
    x = grouped_input(splits, 200, torch.float32)
    group = torch.repeat_interleave(torch.arange(len(splits), dtype=torch.int32), torch.tensor(splits))
    got = group_amax(x, group, len(splits))
    want = torch.stack([xe.abs().amax() if xe.numel() else torch.zeros(()) for xe in torch.split(x, splits)])
    assert_tensor_bitwise(got, want.float(), "group amax")
    # finite data, then one NaN in each group of the boundary tile (rows 64..127: groups 1, 2, 4)
    # in turn: it reaches that group only, whether the group begins, lies inside or ends the tile
    x = torch.randn(sum(splits), 200, generator=torch.Generator().manual_seed(0))
    clean = group_amax(x, group, len(splits))
    assert torch.isfinite(clean).all()
    for row, nan_group in ((66, 1), (70, 2), (100, 4)):
        xn = x.clone()
        xn[row, row % 200] = float("nan")
        got = group_amax(xn, group, len(splits))
        others = [g for g in range(len(splits)) if g != nan_group]
        assert torch.isnan(got[nan_group]), (row, nan_group)
        assert_tensor_bitwise(got[others], clean[others], f"group amax beside a NaN in group {nan_group}")


@gpu
@pytest.mark.parametrize("config", ["e4m3", "e5m2_pow2"])
def test_grouped_fp8_current_gpu_bitwise(config):
    """The MoE shape: hidden 4096, 64 experts with uneven counts (some empty), outputs poisoned;
    ``quantize_grouped``'s default on CUDA picks the kernels."""
    g = torch.Generator().manual_seed(0)
    splits = torch.randint(0, 513, (64,), generator=g).tolist()
    splits[1] = splits[40] = 0
    x = gpu_input((sum(splits), 4096), torch.bfloat16, specials=True)
    check_grouped(Float8CurrentScalingQuantizer(**FP8[config]), x, splits, True, True, config)
    # stacked expert weights [64 * 1408, 4096] and their transposes
    w = gpu_input((64 * 1408, 4096), torch.bfloat16)
    check_grouped(Float8CurrentScalingQuantizer(**FP8[config]), w, [1408] * 64, True, True, f"{config} weights")


@gpu
def test_grouped_nvfp4_rows_gpu_bitwise():
    g = torch.Generator().manual_seed(1)
    splits = torch.randint(0, 513, (64,), generator=g).tolist()
    splits[3] = 0
    x = gpu_input((sum(splits), 4096), torch.bfloat16, specials=True)
    check_grouped(NVFP4Quantizer(), x, splits, True, False, "nvfp4")
    w = gpu_input((64 * 1408, 4096), torch.bfloat16)
    check_grouped(NVFP4Quantizer(), w, [1408] * 64, True, False, "nvfp4 weights")



def _layout(splits, cols, lds, shift=0):
    """Column blocks [cols, ld_e] end to end from element ``shift`` (no alignment padding)."""
    offs, at = [], shift
    for ld in lds:
        offs.append(at)
        at += cols * ld
    return offs, at


#: (splits, cols, row strides, first offset, block) that quantize_grouped never passes: strides
#: equal to the rows (odd: bytes, not words), to the rows rounded up to 4, offsets that are not
#: multiples of 4, 16-row tiles whose last tile ends exactly at ld, one group, 130 groups (past
#: one pass of the scale loop) and very uneven groups (a single long group among empty ones).
DIRECT = {
    "ld=m": ([5, 0, 7, 70, 3], 33, lambda m: m, 0, (64, 128)),
    "ld=round4": ([5, 0, 7, 70, 3], 33, lambda m: -(-m // 4) * 4, 0, (64, 128)),
    "odd offsets": ([15, 31, 16, 1, 49], 40, lambda m: -(-m // 16) * 16, 2, (16, 32)),
    "tiles end at ld": ([15, 31, 16, 1, 49], 40, lambda m: -(-m // 16) * 16, 0, (16, 32)),
    "one group": ([37], 40, lambda m: 48, 0, (64, 128)),
    "130 groups": ([(e * 7) % 5 for e in range(130)], 24, lambda m: -(-m // 16) * 16, 0, (16, 32)),
    "uneven": ([0] * 9 + [200] + [0] * 5 + [1], 24, lambda m: -(-m // 16) * 16, 0, (64, 128)),
}


@interpreter_only
@pytest.mark.parametrize("rowwise", [True, False])
@pytest.mark.parametrize("case", DIRECT)
def test_grouped_fp8_quantize_layouts(case, rowwise):
    """``quantize`` called directly with column layouts ``quantize_grouped`` does not use: every
    group's rowwise rows and its transpose at its offset and row stride equal that group's own
    FP8 current-scaling encode bitwise, its row tail up to ld holds zero codes, and the bytes
    outside every block keep the poison (nothing written past a block)."""
    from hybridfp.kernels.moe.triton_grouped_fp8 import quantize
    splits, cols, ld_of, shift, block = DIRECT[case]
    lds = [ld_of(m) for m in splits]
    offs, numel = _layout(splits, cols, lds, shift)
    x = grouped_input(splits, cols, torch.bfloat16)
    xs = torch.split(x, splits)
    amax = torch.stack([xe.float().abs().amax() if xe.numel() else torch.zeros(()) for xe in xs])
    q = Float8CurrentScalingQuantizer()
    with poisoned_outputs(0x7F):
        rd, cd, sinv = quantize(x, amax, splits, q.dtype, rowwise=rowwise, columnwise=True,
                                col_offsets=offs, col_lds=lds, col_numel=numel + 3, block=block)
    written = torch.zeros(numel + 3, dtype=torch.bool)
    start = 0
    for e, (xe, m, ld, o) in enumerate(zip(xs, splits, lds, offs)):
        want = q.copy().reference_encode(xe, True, True)
        assert_tensor_bitwise(sinv[e], want.payload("rowwise")["scale_inv"].float().reshape(()), f"{case} {e} scale_inv")
        if rowwise:
            assert_tensor_bitwise(rd[start:start + m], want.payload("rowwise")["data"], f"{case} {e} rowwise")
        col = cd.view(torch.uint8).as_strided((cols, ld), (ld, 1), o)
        assert_tensor_bitwise(col[:, :m], want.payload("columnwise")["data"].view(torch.uint8), f"{case} {e} col")
        assert not col[:, m:].any(), f"{case} expert {e}: nonzero row tail"
        written.as_strided((cols, ld), (ld, 1), o).fill_(True)
        start += m
    assert (cd.view(torch.uint8)[~written] == 0x7F).all(), f"{case}: bytes outside the blocks written"


@interpreter_only
def test_grouped_fp8_quantize_refuses_bad_layouts():
    from hybridfp.kernels.moe.triton_grouped_fp8 import quantize
    splits = [5, 7]
    x = grouped_input(splits, 16, torch.bfloat16)
    amax = torch.ones(2)
    lds = [16, 16]
    offs, numel = _layout(splits, 16, lds)
    with pytest.raises(ValueError, match="one entry per group"):
        quantize(x, amax, splits, E4M3, col_offsets=offs[:1], col_lds=lds, col_numel=numel)
    with pytest.raises(ValueError, match="overruns"):
        quantize(x, amax, splits, E4M3, col_offsets=offs, col_lds=lds, col_numel=numel - 1)
    with pytest.raises(ValueError, match="round-up to 16"):
        quantize(x, amax, splits, E4M3, col_offsets=offs, col_lds=[4, 16], col_numel=numel)
    with pytest.raises(ValueError, match="one per group"):
        quantize(x, amax[:1], splits, E4M3, col_offsets=offs, col_lds=lds, col_numel=numel)
