"""The fused MXFP8-B TMA rows kernel (``triton_grouped_gemm_mx.grouped_rows_mxfp8b``, a prototype).

Property, interpreter and GPU alike: at the same ``TmaConfig`` its output equals, bit for bit,
``triton_grouped_gemm.grouped_rows(kernel="tma")`` on B decoded in memory by the reference
(``formats.mxfp8.dequantize_1d(codes, scales).to(bfloat16)``): the same tiles reduced in the
same order from the same BF16 values. Compared as raw bits (NaN outputs included). CPU: tiny
shapes with empty, one-row and odd-sized experts, K a multiple of 32 but not of BK, N not a
multiple of BN, scales / bias on and off, FP32 / BF16 / FP16 outputs, E8M0 extremes (bytes 0..10
whose products fall under BF16's normal range, 253 / 254 whose products overflow, 0xFF = NaN)
and NaN codes. GPU (``-m gpu``): the MoE shapes' structure at every ``MX_CONFIGS`` entry,
bitwise.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from quantize_kernel_cases import gpu, interpreter_only

from hybridfp.formats import mxfp8
from hybridfp.kernels import triton_grouped_gemm as tg
from hybridfp.kernels import triton_grouped_gemm_mx as tgm
from hybridfp.kernels._common import poisoned_outputs
from hybridfp.kernels.triton_decode import e8m0_f32

#: BK 32 and 64 (K = 96 / 160: a multiple of 32, not of 64), 3 persistent programs
TINY32 = tg.TmaConfig(bm=16, bn=16, bk=32, warps=4, stages=1, programs=3)
TINY64 = dataclasses.replace(TINY32, bk=64)
#: each BK in both interpreter tests (CI time: the interpreter runs ~1 s a case)
CONFIGS = [TINY32, TINY64]
CONFIG_IDS = ["bk32", "bk64"]
EXTREME_CONFIGS = [TINY64, TINY32]
EXTREME_IDS = ["bk64", "bk32"]
#: (splits, K, N): empty experts first, last and between; a one-row expert; N not a multiple of 16
CASES = [([0, 19, 45, 1, 33], 96, 24), ([1, 0, 0, 7], 32, 40), ([33, 1, 0], 64, 16), ([5], 160, 9)]
#: E8M0 bytes placed on a few blocks by the "extremes" operands: tiny (products under BF16's
#: normal range: rounded twice by the reference), huge (products overflow to inf) and NaN
TINY_BYTES = (0, 1, 2, 3, 5, 8, 10)
HUGE_BYTES = (253, 254, 255)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


def _codes(g: torch.Generator, shape: tuple[int, ...], device: str, nan_codes: bool) -> torch.Tensor:
    c = torch.randint(0, 256, shape, generator=g, device=device, dtype=torch.int32)
    if not nan_codes:
        c = torch.where((c & 0x7F) == 0x7F, c - 1, c)  # 0x7F / 0xFF are E4M3 NaNs
    return c.to(torch.uint8)


def _mx_operands(splits: list[int], k: int, n: int, seed: int, *, scaled: bool, bias: bool, extremes: bool,
                 device: str = "cpu"):
    """A (BF16), B's MXFP8 codes (uint8 E4M3) and E8M0 bytes, epilogue factors. ``extremes``:
    tiny E8M0 bytes on every 3rd block, a huge / NaN byte on one block of every 7th row, NaN codes."""
    g = torch.Generator(device=device).manual_seed(seed)
    e, m = len(splits), sum(splits)
    a = torch.randn(m, k, generator=g, device=device).bfloat16()
    codes = _codes(g, (e, n, k), device, nan_codes=extremes)
    scales = torch.randint(118, 136, (e, n, k // 32), generator=g, device=device, dtype=torch.int32)
    if extremes:
        flat = scales.view(e * n, k // 32)
        tiny = torch.tensor(TINY_BYTES, device=device, dtype=torch.int32)
        pick = torch.randint(0, len(TINY_BYTES), flat.shape, generator=g, device=device)
        blocks = torch.arange(flat.numel(), device=device).view(flat.shape)
        flat.copy_(torch.where(blocks % 3 == 1, tiny[pick], flat))
        rows = torch.arange(0, e * n, 7, device=device)
        huge = torch.tensor(HUGE_BYTES, device=device, dtype=torch.int32)[torch.arange(len(rows), device=device) % 3]
        flat[rows, (rows // 7) % (k // 32)] = huge
    scales = scales.to(torch.uint8)
    sa = torch.rand(m, generator=g, device=device) + 0.5 if scaled else None
    sb = torch.rand(e, n, generator=g, device=device) + 0.5 if scaled else None
    bs = torch.randn(e, n, generator=g, device=device) if bias else None
    return a, codes, scales, sa, sb, bs


def reference_decode(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """B's BF16 copy as ``gemm.bf16_decode.reference_decode_bf16`` makes it (MXFP8Storage.gemm_operand
    rounded to BF16): ``dequantize_1d`` in FP32, one cast."""
    e, n, k = codes.shape
    f8 = codes.view(torch.float8_e4m3fn) if codes.dtype == torch.uint8 else codes
    return mxfp8.dequantize_1d(f8.reshape(e * n, k), scales.reshape(e * n, k // 32)).to(torch.bfloat16).view(e, n, k)


def _out_of_shared_memory(err: Exception) -> bool:
    return "shared memory" in str(err).lower() or "OutOfResources" in type(err).__name__


def two_pass_tma(a: torch.Tensor, w: torch.Tensor, splits: list[int], cfg: tg.TmaConfig, **kw) -> torch.Tensor:
    """``grouped_rows(kernel="tma")`` on the decode ``w`` at ``cfg``'s tiles; where its BF16 rings
    do not fit the shared memory (the fused kernel's B ring holds 1-byte codes: e.g. 128x256x128 s3),
    at fewer stages: the ring depth only pipelines the loads, the tiles and their K order stay."""
    for stages in range(cfg.stages, 0, -1):
        try:
            return tg.grouped_rows(a, w, splits, kernel="tma", tma=dataclasses.replace(cfg, stages=stages), **kw)
        except Exception as err:  # noqa: BLE001 - only running out of shared memory is retried
            if not _out_of_shared_memory(err) or stages == 1:
                raise
    raise AssertionError("unreachable")


def _both(a, codes, scales, splits, cfg, **kw):
    fused = tgm.grouped_rows_mxfp8b(a, codes, scales, splits, tma=cfg, **kw)
    two_pass = tg.grouped_rows(a, reference_decode(codes, scales), splits, kernel="tma", tma=cfg, **kw)
    return fused, two_pass


@interpreter_only
@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("scaled,bias", [(False, False), (True, True)])
@pytest.mark.parametrize("splits,k,n", CASES, ids=[f"{len(s)}e-k{k}-n{n}" for s, k, n in CASES])
def test_fused_equals_two_pass_bitwise(splits, k, n, scaled, bias, cfg):
    a, codes, scales, sa, sb, bs = _mx_operands(splits, k, n, 0, scaled=scaled, bias=bias, extremes=False)
    kw = dict(scale_a=sa, scale_b=sb, bias=bs)
    with poisoned_outputs():
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            fused, two_pass = _both(a, codes, scales, splits, cfg, out_dtype=dt, **kw)
            assert torch.equal(_bits(fused), _bits(two_pass)), dt
            if dt == torch.float32:  # (FP16 may overflow: values reach 448 * 2**8)
                assert torch.isfinite(fused).all()


@interpreter_only
@pytest.mark.parametrize("cfg", EXTREME_CONFIGS, ids=EXTREME_IDS)
@pytest.mark.parametrize("splits,k,n", CASES, ids=[f"{len(s)}e-k{k}-n{n}" for s, k, n in CASES])
def test_fused_extremes_bitwise(splits, k, n, cfg):
    """Tiny E8M0 bytes (decoded values BF16 subnormals or zero), huge ones (inf products), NaN
    scales and NaN codes: still the two-pass result bit for bit, NaN outputs included."""
    a, codes, scales, sa, sb, bs = _mx_operands(splits, k, n, 1, scaled=True, bias=True, extremes=True)
    w = reference_decode(codes, scales)
    wf = w.float()
    assert ((wf != 0) & (wf.abs() < 2.0**-126)).any(), "no BF16 subnormal in the decode: the case tests nothing"
    assert torch.isnan(wf).any() and torch.isinf(wf).any()
    with poisoned_outputs():
        for dt in (torch.float32, torch.bfloat16):
            fused, two_pass = _both(a, codes, scales, splits, cfg, out_dtype=dt, scale_a=sa, scale_b=sb, bias=bs)
            assert torch.equal(_bits(fused), _bits(two_pass)), dt
            if sum(splits) > 1:
                assert torch.isfinite(fused).any() and not torch.isfinite(fused).all(), dt


@interpreter_only
def test_fp8_dtypes_and_schedules():
    """float8_e4m3fn codes read as the uint8 ones; E5M2 codes against their own reference;
    schedules (1 program, more programs than tiles, swizzle groups) only reorder the work."""
    splits, k, n = [0, 19, 45, 1, 33], 96, 40
    a, codes, scales, sa, sb, bs = _mx_operands(splits, k, n, 2, scaled=True, bias=True, extremes=False)
    kw = dict(scale_a=sa, scale_b=sb, bias=bs)
    want = tg.grouped_rows(a, reference_decode(codes, scales), splits, kernel="tma", tma=TINY32, **kw)
    got = tgm.grouped_rows_mxfp8b(a, codes.view(torch.float8_e4m3fn), scales, splits, tma=TINY32, **kw)
    assert torch.equal(_bits(got), _bits(want))
    for cfg in (dict(programs=1), dict(programs=64, group_m=1), dict(group_m=2, flatten=True)):
        with poisoned_outputs():
            got = tgm.grouped_rows_mxfp8b(a, codes, scales, splits, tma=dataclasses.replace(TINY32, **cfg), **kw)
        assert torch.equal(_bits(got), _bits(want)), cfg
    c5 = codes.view(torch.float8_e5m2)
    w5 = mxfp8.dequantize_1d(c5.reshape(-1, k), scales.reshape(-1, k // 32)).to(torch.bfloat16).view(len(splits), n, k)
    want5 = tg.grouped_rows(a, w5, splits, kernel="tma", tma=TINY32, **kw)
    got5 = tgm.grouped_rows_mxfp8b(a, c5, scales, splits, tma=TINY32, **kw)
    assert torch.equal(_bits(got5), _bits(want5))


@interpreter_only
@pytest.mark.parametrize("tile", [dict(bm=32, bn=16), dict(bm=16, bn=32, bk=64)], ids=str)
def test_non_square_tiles(tile):
    """BM != BN (rows and columns of the tile cannot be confused), against the TMA kernel at the
    same tiles."""
    splits, k, n = [0, 19, 45, 1, 33], 96, 40
    a, codes, scales, sa, sb, bs = _mx_operands(splits, k, n, 3, scaled=True, bias=True, extremes=True)
    cfg = dataclasses.replace(TINY32, **tile)
    with poisoned_outputs():
        for dt in (torch.float32, torch.bfloat16):
            fused, two_pass = _both(a, codes, scales, splits, cfg, out_dtype=dt, scale_a=sa, scale_b=sb, bias=bs)
            assert torch.equal(_bits(fused), _bits(two_pass)), dt


@triton.jit
def _e8m0_values(e_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, e8m0_f32(tl.load(e_ptr + i).to(tl.int32)))


@interpreter_only
def test_e8m0_scale_values_all_bytes():
    """The power of two the GPU branch of the fused decode multiplies by (``triton_decode.e8m0_f32``;
    the interpreter tests above run the integer branch): every byte's FP32 bits equal
    ``formats.mxfp8.e8m0_to_float``'s, the subnormal 2**-127 and the NaN included."""
    e = torch.arange(256, dtype=torch.int32)
    out = torch.empty(256, dtype=torch.float32)
    _e8m0_values[(1,)](e, out, N=256)
    assert torch.equal(out.view(torch.int32), mxfp8.e8m0_to_float(e.to(torch.uint8)).view(torch.int32))


def test_refusals_name_the_tensor():
    a = torch.zeros(6, 64, dtype=torch.bfloat16)
    codes = torch.zeros(2, 8, 64, dtype=torch.uint8)
    scales = torch.zeros(2, 8, 2, dtype=torch.uint8)
    f = tgm.grouped_rows_mxfp8b
    with pytest.raises(ValueError, match="multiple of 32"):
        f(a[:, :48], codes[..., :48], scales[..., :1], [2, 4])
    with pytest.raises(ValueError, match="b_scales must be the E8M0 bytes"):
        f(a, codes, scales[..., :1], [2, 4])
    with pytest.raises(ValueError, match="b_scales must be the E8M0 bytes"):
        f(a, codes, scales.float(), [2, 4])
    with pytest.raises(ValueError, match="b_codes must be the MXFP8 rowwise codes"):
        f(a, codes.float(), scales, [2, 4])
    with pytest.raises(ValueError, match="a must be a BF16"):
        f(a.float(), codes, scales, [2, 4])
    with pytest.raises(ValueError, match="splits"):
        f(a, codes, scales, [2, 3])
    with pytest.raises(ValueError, match="bk = 48"):
        f(a, codes, scales, [2, 4], tma=dataclasses.replace(TINY32, bk=48))
    with pytest.raises(ValueError, match="bk = 96 must be a power of two"):
        f(a, codes, scales, [2, 4], tma=dataclasses.replace(TINY32, bk=96))
    with pytest.raises(ValueError, match="out_dtype"):
        f(a, codes, scales, [2, 4], out_dtype=torch.int32)
    with pytest.raises(ValueError, match="b_codes must be one"):
        f(a, torch.zeros(2, 12, 64, dtype=torch.uint8)[:, :8], scales, [2, 4])
    with pytest.raises(ValueError, match="a must have unit inner stride"):
        f(torch.zeros(64, 6, dtype=torch.bfloat16).t(), codes, scales, [2, 4])
    with pytest.raises(ValueError, match="scale_b"):
        f(a, codes, scales, [2, 4], scale_b=torch.ones(8))
    # empty outputs: nothing is read, so no layout is refused
    assert f(a[:0], codes, scales, [0, 0]).shape == (0, 8)
    assert f(a, torch.zeros(2, 0, 64, dtype=torch.uint8), torch.zeros(2, 0, 2, dtype=torch.uint8), [2, 4]).shape == (6, 0)


# ---------------------------------------------------------------------------- GPU
#: (splits, K, N): an empty and a one-row expert, the last expert ending inside a row tile, K a
#: multiple of 32 but not of 64 / 128 (TMA's zero fill in K), N not a multiple of 128 / 256
GPU_CASES = [([0, 517, 2048, 1, 1999, 640, 3000, 1024], 2048, 1408),
             ([0, 517, 2048, 1, 1999, 640, 3000, 1000], 2016, 1400)]


@gpu
@pytest.mark.parametrize("extremes", [False, True], ids=["plain", "extremes"])
@pytest.mark.parametrize("case", range(len(GPU_CASES)))
@pytest.mark.parametrize("name", list(tgm.MX_CONFIGS))
def test_gpu_fused_equals_two_pass(name, case, extremes):
    """Every MX_CONFIGS entry, BF16 and FP32 outputs (FP32 skipped where its shared memory does not
    fit), per-row / per-column scales and bias: the fused kernel's bits equal the TMA kernel's on
    the reference decode; the Triton decode kernel (the current two-pass path) gives that
    decode."""
    from hybridfp.kernels.triton_decode import decode_mxfp8
    splits, k, n = GPU_CASES[case]
    seed = int(torch.randint(0, 2**31, (1,)))
    a, codes, scales, sa, sb, bs = _mx_operands(splits, k, n, seed, scaled=True, bias=True, extremes=extremes,
                                                device="cuda")
    e = len(splits)
    w = reference_decode(codes, scales)
    kdec = decode_mxfp8(codes.view(torch.float8_e4m3fn).view(e * n, k), scales.view(e * n, k // 32)).view(e, n, k)
    assert torch.equal(_bits(kdec), _bits(w)), f"seed {seed}"
    cfg = tgm.MX_CONFIGS[name]
    kw = dict(scale_a=sa, scale_b=sb, bias=bs)
    with poisoned_outputs():
        fused = tgm.grouped_rows_mxfp8b(a, codes, scales, splits, tma=cfg, **kw)
        two_pass = two_pass_tma(a, w, splits, cfg, **kw)
        assert torch.equal(_bits(fused), _bits(two_pass)), f"seed {seed}"
        if not extremes:
            assert torch.isfinite(fused).all(), f"seed {seed}"
        try:
            fused32 = tgm.grouped_rows_mxfp8b(a, codes, scales, splits, tma=cfg, out_dtype=torch.float32, **kw)
        except Exception as err:  # noqa: BLE001 - out of shared memory: the BF16 check above stands
            if not _out_of_shared_memory(err):
                raise
            pytest.skip(f"{name}: an FP32 output exceeds the shared memory ({type(err).__name__})")
        two_pass32 = two_pass_tma(a, w, splits, cfg, out_dtype=torch.float32, **kw)
        assert torch.equal(_bits(fused32), _bits(two_pass32)), f"seed {seed}"

