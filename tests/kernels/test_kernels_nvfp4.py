"""Triton NVFP4 kernels (hybridfp/kernels/triton_nvfp4.py) vs the reference, bitwise: 1D with
and without the RHT on the columnwise copy (post- and pre-RHT amax), row-scaled, 2D, and
stochastic rounding (the kernels take the reference's per-direction torch.rand draws).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from quantize_kernel_cases import (DTYPES, EMPTY_SHAPES, GPU_SHAPES, SHAPES, assert_storage_bitwise,  # noqa: E402
                                   check_against_reference, check_gpu, edge_tensor, gpu, gpu_input,
                                   interpreter_only, kernel_sr_stream, run_kernel)

from hybridfp.formats import nvfp4, rht  # noqa: E402
from hybridfp.formats.common import amax_nan, blocks_1d, expand_blocks_1d  # noqa: E402
from hybridfp.kernels import triton_nvfp4, triton_nvfp4_tile, triton_sr  # noqa: E402
from hybridfp.quantizers import HybridQuantizer, MXFP8Quantizer, NVFP4Quantizer, fast  # noqa: E402
from hybridfp.quantizers import nvfp4 as nvfp4_quantizers  # noqa: E402
from hybridfp import policy  # noqa: E402
from hybridfp.quantizers.backends import select_quantize_kernel  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

CONFIGS = {
    "1d": dict(),
    "rht": dict(with_rht=True),
    "rht_pre_amax": dict(with_rht=True, with_post_rht_amax=False),
    "2d": dict(with_2d_quantization=True),
    "sr": dict(stochastic_rounding=True),
    "sr_rht": dict(stochastic_rounding=True, with_rht=True),
    "sr_2d": dict(stochastic_rounding=True, with_2d_quantization=True),
}
NVFP4_SHAPES = SHAPES + [(17, 3)]


@interpreter_only
@pytest.mark.parametrize("shape", NVFP4_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", CONFIGS)
def test_nvfp4_kernel_bitwise(config, dtype, shape):
    x = edge_tensor(shape, dtype, seed=shape[-1] + 1, specials=True)
    check_against_reference(NVFP4Quantizer(**CONFIGS[config]), x, what=config)


@interpreter_only
@pytest.mark.parametrize("shape", NVFP4_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nvfp4_row_scaled_kernel_bitwise(dtype, shape):
    x = edge_tensor(shape, dtype, seed=shape[0], specials=True)
    check_against_reference(NVFP4Quantizer(row_scaled_nvfp4=True, columnwise=False), x, True, False)


@interpreter_only
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True)])
def test_nvfp4_kernel_one_direction(config, rowwise, columnwise):
    check_against_reference(NVFP4Quantizer(**CONFIGS[config]), edge_tensor((40, 72), torch.bfloat16, seed=2),
                            rowwise, columnwise)


@interpreter_only
@pytest.mark.parametrize("fill", [0.0, 1e-30, 3e38])
def test_nvfp4_kernel_extreme_amax(fill):
    """Zero tensor (S_enc = 1), a tiny and a huge global amax (block scales underflow to 0 and
    S_enc clamps): still bitwise."""
    x = edge_tensor((32, 48), torch.float32, seed=4) * (fill if fill else 0.0)
    x[3, 5] = fill
    for cfg in CONFIGS.values():
        check_against_reference(NVFP4Quantizer(**cfg), x)


def _row_scale_amaxes(device: str) -> torch.Tensor:
    """Row amaxes that take every branch of the global scale rule: 0, subnormal, tiny (S_enc
    clamps to FP32_MAX), ordinary, huge (S_enc rounds to a subnormal or 0), inf, NaN."""
    special = torch.tensor([0.0, 1e-45, 1e-40, 1e-30, 7.3e-36, 1.0, 2688.0, 448.0 * 6, 3e38, 3.4028234663852886e38,
                            float("inf"), float("nan")])
    rand = torch.randn(1037, generator=torch.Generator().manual_seed(3)).abs() * torch.exp2(
        torch.randint(-60, 60, (1037,), generator=torch.Generator().manual_seed(4)).float())
    return torch.cat([special, rand]).to(device)


def _check_row_scales(device: str) -> None:
    """``triton_nvfp4_tile.row_scales``: each row's (S_enc, S_dec), bitwise ``formats.nvfp4``'s
    global encode / decode scales (the fused NVFP4 + MXFP8 kernel loads them instead of dividing);
    an empty vector gives an empty [0, 2]."""
    amax = _row_scale_amaxes(device)
    got = triton_nvfp4_tile.row_scales(amax)
    want = torch.stack([nvfp4.global_encode_scale(amax), nvfp4.global_decode_scale(amax)], dim=1)
    assert got.shape == (amax.numel(), 2)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert triton_nvfp4_tile.row_scales(amax[:0]).shape == (0, 2)


@interpreter_only
def test_row_scales_match_formats():
    _check_row_scales("cpu")


@gpu
def test_row_scales_match_formats_gpu():
    _check_row_scales("cuda")


@interpreter_only
@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=str)
@pytest.mark.parametrize("config", CONFIGS)
def test_nvfp4_kernel_empty(config, shape):
    check_against_reference(NVFP4Quantizer(**CONFIGS[config]), torch.empty(shape, dtype=torch.bfloat16))


@interpreter_only
@pytest.mark.parametrize("block,warps", [((2, 256), 4), ((1, 512), 4), ((4, 64), 8)], ids=str)
def test_nvfp4_amaxes_tiles(block, warps):
    """The amax pass at wider tiles (vector loads of the post-RHT slices): the same global,
    per-row and post-RHT amaxes as the reference (partial tiles)."""
    x = edge_tensor((300, 70), torch.float32, seed=12).clamp(-1e4, 1e4).to(torch.bfloat16)
    g, per_row, post = triton_nvfp4.amaxes(x, amax=True, row_amax=True, rht_amax=True, block=block,
                                           num_warps=warps)
    assert torch.equal(g, x.float().abs().amax()) and torch.equal(per_row, x.float().abs().amax(1))
    assert torch.equal(post, rht.apply_rht(x.t(), torch.bfloat16).float().abs().amax())


@interpreter_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nvfp4_kernel_small_tiles(dtype):
    """One 16-row tile x 32 columns per program on a transposed (strided) 100x70 view: many
    programs, partial tiles in both directions, the RHT tail (100 -> 112) spanning programs.
    Finite values only (no inf - inf NaN blocks: exact comparisons below)."""
    x = edge_tensor((70, 100), torch.float32, seed=11).clamp(-1e4, 1e4).to(dtype).t()
    g, per_row, post = triton_nvfp4.amaxes(x, amax=True, row_amax=True, rht_amax=True, block=(1, 32))
    xt = rht.apply_rht(x.t(), dtype)
    assert torch.equal(post, xt.float().abs().amax()) and torch.equal(per_row, x.float().abs().amax(1))
    for use_rht, camax in ((False, g), (True, post)):
        row, col = triton_nvfp4.quantize_1d(x, per_row, camax, rht=use_rht, block=(1, 32))
        d, s = nvfp4.quantize_1d(x, per_row)
        dc, sc = nvfp4.quantize_1d(xt if use_rht else x.t(), camax)
        assert torch.equal(row[0], d) and torch.equal(row[1].view(torch.uint8), s.view(torch.uint8))
        assert torch.equal(col[0], dc) and torch.equal(col[1].view(torch.uint8), sc.view(torch.uint8))
    row, col = triton_nvfp4.quantize_2d(x, g, block=(1, 32))
    d, s = nvfp4.quantize_2d(x, g)
    assert torch.equal(row[0], d) and torch.equal(row[1].view(torch.uint8), s.view(torch.uint8))
    assert torch.equal(col[0], nvfp4.pack_fp4(nvfp4.unpack_fp4(d, 70).t().contiguous()))


@interpreter_only
def test_nvfp4_kernel_selection():
    """Row-scaled columnwise (an error the reference raises) is declined; CPU tensors are never
    selected by the registry."""
    x = torch.ones(16, 32)
    assert not fast.NVFP4_KERNEL.supports(NVFP4Quantizer(row_scaled_nvfp4=True, columnwise=False), x, True, True)
    assert select_quantize_kernel(NVFP4Quantizer(), x, True, True) is None


@interpreter_only
def test_nvfp4_kernel_sr_seed():
    """Stochastic rounding: without a seed the kernel draws one from the quantizer's generator
    exactly as the reference does (same bits with the reference fed the kernels' stream);
    another seed gives other codes."""
    x = torch.randn(40, 48, generator=torch.Generator().manual_seed(13))
    for cfg in ("sr", "sr_rht", "sr_2d"):
        q = NVFP4Quantizer(**CONFIGS[cfg], generator=torch.Generator().manual_seed(5))
        ref = NVFP4Quantizer(**CONFIGS[cfg], generator=torch.Generator().manual_seed(5))
        with kernel_sr_stream():
            want = ref.reference_encode(x, True, True)
        assert_storage_bitwise(run_kernel(q, x), want, cfg)
        a, b = run_kernel(q, x, seed=1), run_kernel(q, x, seed=2)
        assert not torch.equal(a.payload("rowwise")["data"], b.payload("rowwise")["data"])


def test_sr_stream_known_answer():
    """The Philox of the SR stream is standard Philox4x32-10 (Random123's known-answer vector
    for counter 0, key 0), and the kernels' key is the reference generator's seed."""
    z = torch.zeros(1, dtype=torch.int64)
    assert [int(v) for v in triton_sr.philox_torch(z, z.clone(), 0)] == [
        0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    q = NVFP4Quantizer(stochastic_rounding=True)
    assert q._sr(2**62 - 3, 1, torch.device("cpu"))["generator"].initial_seed() == triton_sr.stream_key(2**62 - 3, 1)


@interpreter_only
@pytest.mark.parametrize("cfg", ["sr", "sr_rht"])
def test_nvfp4_sr_copies_independent(cfg):
    """Same seed, same bits whichever other copy is made (rowwise alone, columnwise alone, both),
    so a hybrid of two identical children equals the plain quantizer."""
    x = edge_tensor((48, 64), torch.bfloat16, seed=9)
    q = NVFP4Quantizer(**CONFIGS[cfg])
    both = run_kernel(q, x, True, True, seed=77)
    assert_storage_bitwise(run_kernel(q, x, True, False, seed=77), _only(both, "rowwise"), "rowwise alone")
    assert_storage_bitwise(run_kernel(q, x, False, True, seed=77), _only(both, "columnwise"), "columnwise alone")
    assert_storage_bitwise(run_kernel(q, x, True, True, seed=77), both, "again")


def _only(storage, direction):
    """``storage`` restricted to one direction's copy."""
    keep = {d: storage.payload(d) if d == direction else None for d in ("rowwise", "columnwise")}
    return type(storage)(storage.shape, storage.dtype, keep["rowwise"], keep["columnwise"], **storage.meta)


def _scaled(copy_in: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(clamp(x * encode, -6, 6), FP32 block scale S_dec_b per element) of a copy's input, in the
    reference's arithmetic: the values stochastic rounding rounds, and their decode unit."""
    s_enc = nvfp4.global_encode_scale(amax)
    s_dec = torch.div(torch.ones_like(s_enc), s_enc)
    sdb = nvfp4.block_decode_scale(amax_nan(blocks_1d(copy_in.float(), 16), dim=-1), s_enc)
    cols = copy_in.shape[1]
    enc = expand_blocks_1d(nvfp4.block_encode_scale(sdb, s_dec), 16, cols)
    return (copy_in.float() * enc).clamp(-6, 6), expand_blocks_1d(sdb.float(), 16, cols)


@interpreter_only
@pytest.mark.parametrize("cfg", ["sr", "sr_rht"])
def test_nvfp4_sr_neighbours_and_unbiased(cfg):
    """Distribution of the kernels' stochastic rounding, per copy: every code is the floor or
    the ceiling of its scaled value on the E2M1 grid (the reference with draws 1 and 0), and
    over N = 1024 independent roundings of the same 64 values (a row / column repeated: each
    repetition has its own counters) the mean decoded value is within 4.5 sigma of the scaled
    value (sigma = (hi - lo) sqrt(p (1 - p) / N) per element, p its exact round-up
    probability; a fixed seed, so the test cannot flake)."""
    n = 1024
    v = edge_tensor((1, 64), torch.float32, seed=3).clamp(-50, 50)
    q = NVFP4Quantizer(**CONFIGS[cfg])
    for direction, x in (("rowwise", v.expand(n, 64).contiguous()),
                         ("columnwise", v.t().expand(64, n).contiguous())):
        payload = run_kernel(q, x, direction == "rowwise", direction == "columnwise", seed=2024).payload(direction)
        copy_in = x if direction == "rowwise" else x.t()
        if q.with_rht and direction == "columnwise":
            copy_in = rht.apply_rht(copy_in, torch.float32)
        cols = copy_in.shape[1]
        ones, zeros = torch.ones(copy_in.shape), torch.zeros(copy_in.shape)
        lo = nvfp4.unpack_fp4(nvfp4.quantize_1d(copy_in, payload["amax"], stochastic_rounding=True, rand=ones)[0], cols)
        hi = nvfp4.unpack_fp4(nvfp4.quantize_1d(copy_in, payload["amax"], stochastic_rounding=True, rand=zeros)[0], cols)
        got = nvfp4.unpack_fp4(payload["data"], cols)
        assert bool(((got == lo) | (got == hi)).all()), f"{cfg} {direction}: a code is not a neighbour"
        target, unit = _scaled(copy_in, payload["amax"])
        d_lo, d_hi = nvfp4.decode_e2m1(lo), nvfp4.decode_e2m1(hi)
        p = torch.where(d_hi != d_lo, (target - d_lo) / (d_hi - d_lo), torch.zeros_like(target))
        mean = (nvfp4.decode_e2m1(got) * unit).mean(0)
        sigma = ((d_hi - d_lo).abs() * unit * torch.sqrt(p * (1 - p)))[0] / n**0.5
        err = (mean - (target * unit)[0]).abs()
        assert bool((err <= 4.5 * sigma + 1e-6 * err.new_ones(()).mul((target * unit)[0].abs())).all()), (
            f"{cfg} {direction}: max |mean - value| / sigma = {float((err / sigma.clamp_min(1e-30)).max()):.2f}")
        assert int(((p[0] > 0.05) & (p[0] < 0.95)).sum()) > 8, "too few elements rounded at random"


@interpreter_only
def test_nvfp4_kernel_amax_reduction(monkeypatch):
    """The kernel path reduces the same amaxes as the reference (a stand-in all-reduce that
    sees a 3x larger amax elsewhere; patched where each path imported it by name)."""
    fake = lambda amax, group: amax * 3  # noqa: E731
    monkeypatch.setattr(nvfp4_quantizers, "all_reduce_amax", fake)  # reference path
    monkeypatch.setattr(fast, "all_reduce_amax", fake)  # kernel path
    for cfg in CONFIGS.values():
        q = NVFP4Quantizer(**cfg, with_amax_reduction=True, amax_reduction_group=object())
        check_against_reference(q, edge_tensor((33, 40), torch.bfloat16, seed=5))


@interpreter_only
def test_nvfp4_dispatch_hybrids(monkeypatch):
    """MXFP8 forward / NVFP4 RHT backward, and NVFP4 double quantization (rowwise_dequantized),
    through quantize() with the kernels vs the reference path."""
    monkeypatch.setattr(fast, "device_ok", lambda x: True)
    x = edge_tensor((48, 64), torch.bfloat16, seed=12)
    for q in (HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(with_rht=True)),
              HybridQuantizer(NVFP4Quantizer(), NVFP4Quantizer(), "rowwise_dequantized"),
              HybridQuantizer(NVFP4Quantizer(row_scaled_nvfp4=True, columnwise=False), MXFP8Quantizer(),
                              "rowwise_dequantized")):
        got = q.quantize(x)
        with policy(quantize_kernels=False):
            want = q.quantize(x)
        for d in ("rowwise", "columnwise"):
            assert_storage_bitwise(got.qstorage.part(d), want.qstorage.part(d), f"{q!r} {d}")


@gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("config", ["1d", "rht", "2d"])
def test_nvfp4_gpu_bitwise(config, shape):
    check_gpu(NVFP4Quantizer(**CONFIGS[config]), gpu_input(shape, torch.bfloat16, specials=True))


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_nvfp4_gpu_rht_dtypes(dtype):
    check_gpu(NVFP4Quantizer(with_rht=True), gpu_input((4096, 4096), dtype, specials=True))
    check_gpu(NVFP4Quantizer(with_rht=True, with_post_rht_amax=False), gpu_input((4096, 4096), dtype), False, True)


@gpu
@pytest.mark.parametrize("config", ["sr_rht", "sr_2d"])
def test_nvfp4_gpu_sr(config):
    check_gpu(NVFP4Quantizer(**CONFIGS[config]), gpu_input((16384, 4096), torch.bfloat16, specials=True))
    check_gpu(NVFP4Quantizer(**CONFIGS[config]), gpu_input((4096, 4096), torch.float32), False, True)


@gpu
def test_nvfp4_gpu_row_scaled_and_directions():
    x = gpu_input((4096, 4096), torch.bfloat16)
    check_gpu(NVFP4Quantizer(row_scaled_nvfp4=True, columnwise=False), x, True, False)
    check_gpu(NVFP4Quantizer(with_rht=True), x, False, True)
    check_gpu(NVFP4Quantizer(), x, True, False)


@gpu
@pytest.mark.parametrize("config", ["sr", "sr_rht"])
def test_nvfp4_gpu_sr_twin_hybrid_and_reproducible(config):
    """On CUDA (registered kernels): the same seed gives the same bits on a second call, and a
    hybrid of two identical SR children equals the plain quantizer copy for copy."""
    x = gpu_input((4096, 4096), torch.bfloat16)
    plain = NVFP4Quantizer(**CONFIGS[config])
    hybrid = HybridQuantizer(NVFP4Quantizer(**CONFIGS[config]), NVFP4Quantizer(**CONFIGS[config]))
    want = plain.encode(x, True, True, 4321)
    assert_storage_bitwise(plain.encode(x, True, True, 4321), want, "second call")
    got = hybrid.encode(x, True, True, 4321)
    for d in ("rowwise", "columnwise"):
        assert_storage_bitwise(got.part(d), _only(want, d), f"hybrid {d}")


# ------------------------------------------------- the stochastic-rounding E2M1 code, elementwise
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _code_sr_probe(v_ptr, u_ptr, out_ptr, N, HW: tl.constexpr, BLOCK_N: tl.constexpr):
    i = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = i < N
    code = triton_nvfp4_tile._code_sr(tl.load(v_ptr + i, mask=m, other=0.0), tl.load(u_ptr + i, mask=m, other=0), HW)
    tl.store(out_ptr + i, code, mask=m)


def _sr_threshold_cases() -> tuple[torch.Tensor, torch.Tensor]:
    """(v FP32, u int32) pairs on and around every stochastic-rounding threshold: for each draw
    u, |v| = u 2**-17 and 0.5 + u 2**-17 (the decisions below 1) and lo + u 2**-16 step for
    every grid interval above, each +- a few ulps; grid values, 0, subnormals, 1 - ulp, 6 + ulp,
    inf, huge; both signs; plus random magnitudes in [0, 7)."""
    gen = torch.Generator().manual_seed(7)
    draws = [0, 1, 2, 3, 0x3FFF, 0x7FFF, 0x8000, 0x8001, 0xBFFF, 0xFFFE, 0xFFFF]
    draws += torch.randint(0, 2**16, (40,), generator=gen).tolist()
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    vs, us = [], []
    for u in draws:
        r = u * 2.0**-16
        centres = [r * 0.5, 0.5 + r * 0.5] + [lo + r * (hi - lo) for lo, hi in zip(grid[2:], grid[3:])]
        centres += grid + [1e-45, 1e-40, 2.0**-126, 2.0**-24, 6.0, 1e30, float("inf")]
        c = torch.tensor(centres, dtype=torch.float32)
        bits = c.view(torch.int32)
        near = torch.cat([(bits + k).view(torch.float32) for k in range(-3, 4)] + [(bits - 1000).view(torch.float32)])
        near = torch.cat([near[near >= 0], torch.rand(60, generator=gen) * 7])
        for sign in (1.0, -1.0):
            vs.append(near * sign)
            us.append(torch.full(near.shape, u, dtype=torch.int32))
    return torch.cat(vs), torch.cat(us)


def _code_sr_check(hw: bool, device: str) -> None:
    v, u = _sr_threshold_cases()
    v, u = v.to(device), u.to(device)
    got = torch.empty(v.shape, dtype=torch.int32, device=device)
    _code_sr_probe[(triton.cdiv(v.numel(), 1024),)](v, u, got, v.numel(), HW=hw, BLOCK_N=1024)
    want = nvfp4.encode_e2m1(v.clamp(-6.0, 6.0), u.float() * 2.0**-16)
    bad = got.to(torch.uint8) != want
    assert not bool(bad.any()), (v[bad][:8], u[bad][:8])


@interpreter_only
def test_code_sr_thresholds():
    """``_code_sr`` (the interpreter's emulated round-up add) equals ``encode_e2m1`` with the
    same draws on and around every decision threshold."""
    _code_sr_check(False, "cpu")


@gpu
def test_code_sr_thresholds_gpu():
    """The same on the GPU, where the round-up add is ``add.rp.f32``."""
    _code_sr_check(True, "cuda")


@interpreter_only
@pytest.mark.parametrize("block,warps", [((2, 128), 4), ((1, 256), 4), ((2, 256), 4), ((1, 128), 2)], ids=str)
@pytest.mark.parametrize("shape", [(40, 200), (37, 131), (16, 8)], ids=str)
def test_nvfp4_rht_sr_wide_tiles(block, warps, shape):
    """RHT + stochastic rounding at wider cast tiles (several columns per thread: vector slice
    loads, the draws computed in the slices' layout): R not a multiple of 16 (the RHT tail), C
    not a multiple of 8 / 16, partial tiles, NaN / inf blocks; both copies equal the reference
    fed the kernel's Philox draws, bit for bit."""
    from quantize_kernel_cases import _assert_nvfp4_data_relaxed
    x = edge_tensor(shape, torch.bfloat16, seed=shape[1], specials=True)
    g, per_row, post = triton_nvfp4.amaxes(x, amax=True, row_amax=False, rht_amax=True, block=(2, 256),
                                           num_warps=4)
    seed = 1234
    row, col = triton_nvfp4.quantize_1d(x, g, post, rht=True, seed=seed, block=block, num_warps=warps)
    xt = rht.apply_rht(x.t(), torch.bfloat16)
    for got, src, amax, direction in ((row, x, g, 0), (col, xt, post, 1)):
        rand = triton_sr.reference_draws(triton_sr.stream_key(seed, direction), tuple(src.shape))
        d, s = nvfp4.quantize_1d(src, amax, stochastic_rounding=True, rand=rand)
        assert torch.equal(got[1].view(torch.uint8), s.view(torch.uint8)), direction
        # NaN blocks: the interpreter's NaN sign bits may differ (quantize_kernel_cases docstring)
        _assert_nvfp4_data_relaxed(got[0], d, s, src.shape[1], False, f"direction {direction}")
