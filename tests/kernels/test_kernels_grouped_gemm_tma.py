"""The TMA rows kernel of the grouped GEMM (``triton_grouped_gemm.grouped_rows(kernel="tma")``).

It computes what the pointer kernel computes (the same K tiles in the same order, the same
``_epilogue``), so, as for that kernel (test_kernels_grouped_gemm.py): FP32 outputs within
FP32-accumulation error of an FP64 reference (relative ≤ 1e-6 at these sizes), a 16-bit output
its FP32 output rounded once (bitwise). Under the interpreter both kernels reduce the same
tiles, but each ``tl.dot`` is a numpy matmul whose summation order follows the CPU's BLAS kernel
and the operands' layouts (the TMA kernel's B tile is transposed, the pointer kernel's is not),
so the two agree bitwise only where every sum is exact: the bitwise comparison with the pointer
kernel, there to catch a tile read from the wrong place, runs on exact-sum operands
(``exact_sum_values``; on the GPU only the bound is claimed). CPU: tiny shapes with empty, one-row and odd-sized experts, K and N
not multiples of the block; GPU (``-m gpu``): the MoE shapes' structure at every ``TMA_CONFIGS``
entry, outputs poisoned.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from quantize_kernel_cases import exact_sum_values, gpu, interpreter_only

from hybridfp.kernels.moe import triton_grouped_gemm as tg
from hybridfp.kernels._common import poisoned_outputs

#: the pointer kernel's tiny tile and the same tile for the TMA kernel, 3 persistent programs
TINY = (16, 16, 16, 4, 1)
TMA_TINY = tg.TmaConfig(bm=16, bn=16, bk=16, warps=4, stages=1, programs=3)
#: (splits, K, N): empty experts first, last and between; a one-row expert; K and N partial
#: blocks (K stays a multiple of 8: a 16-byte row stride, what TMA needs)
CASES = [([0, 19, 45, 1, 33], 40, 24), ([1, 0, 0, 7], 24, 40), ([33, 1, 0], 8, 16), ([5], 16, 9)]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert torch.isfinite(got).all()
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-300)).item()


def _operands(splits: list[int], k: int, n: int, scaled: bool, bias: bool, seed: int = 0):
    """A and the stacked B as BF16 values whose sums are exact in FP32 in any order (the
    kernels compared bitwise sum them in different orders); FP32 epilogue factors."""
    g = torch.Generator().manual_seed(seed)
    e, m = len(splits), sum(splits)
    a = exact_sum_values((m, k), torch.bfloat16, g, k)
    b = exact_sum_values((e, n, k), torch.bfloat16, g, k)
    sa = torch.rand(m, generator=g) + 0.5 if scaled else None
    sb = torch.rand(e, n, generator=g) + 0.5 if scaled else None
    bs = torch.randn(e, n, generator=g) if bias else None
    return a, b, sa, sb, bs


def _reference(a, b, splits, sa, sb, bias) -> torch.Tensor:
    """FP64 per expert: the exact sums, then the epilogue."""
    out, r = [], 0
    for i, m in enumerate(splits):
        v = a[r:r + m].double() @ b[i].double().t()
        if sa is not None:
            v = v * sa[r:r + m, None].double()
        if sb is not None:
            v = v * sb[i][None, :].double()
        if bias is not None:
            v = v + bias[i].double()
        out.append(v)
        r += m
    return torch.cat(out)


@interpreter_only
@pytest.mark.parametrize("scaled,bias", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("splits,k,n", CASES, ids=[f"{len(s)}e-k{k}-n{n}" for s, k, n in CASES])
def test_tma_rows_exact_and_equal_to_pointer_kernel(splits, k, n, scaled, bias):
    a, b, sa, sb, bs = _operands(splits, k, n, scaled, bias)
    kw = dict(scale_a=sa, scale_b=sb, bias=bs)
    with poisoned_outputs():  # a row or column left unwritten would show
        out32 = tg.grouped_rows(a, b, splits, out_dtype=torch.float32, kernel="tma", tma=TMA_TINY, **kw)
        assert _rel(out32, _reference(a, b, splits, sa, sb, bs)) < 1e-6
        ptr32 = tg.grouped_rows(a, b, splits, out_dtype=torch.float32, kernel="pointer", tile=TINY, **kw)
        assert torch.equal(out32, ptr32)
        for dt in (torch.bfloat16, torch.float16):
            got = tg.grouped_rows(a, b, splits, out_dtype=dt, kernel="tma", tma=TMA_TINY, **kw)
            assert torch.equal(got, out32.to(dt)), dt


@interpreter_only
@pytest.mark.parametrize("cfg", [dict(programs=1), dict(programs=2, group_m=1), dict(programs=64),
                                 dict(group_m=2, flatten=True),
                                 dict(bm=32, bn=16, bk=32)], ids=str)
def test_tma_schedules_cover_every_tile_once(cfg):
    """Persistent programs (1, fewer than the tiles, more asked than there are tiles: clamped on
    the host) and swizzle groups only reorder the work: with outputs poisoned, the same bits as
    the pointer kernel at the same tile (a tile never run would show; one run twice stores the
    same bits). ``flatten`` only takes effect when compiled for the GPU (the GPU test covers it)."""
    splits, k, n = [0, 19, 45, 1, 33], 64, 40  # 9 row tiles x 3 column tiles of 16
    a, b, sa, sb, bs = _operands(splits, k, n, True, True, seed=1)
    tma = dataclasses.replace(TMA_TINY, **cfg)
    with poisoned_outputs():
        got = tg.grouped_rows(a, b, splits, scale_a=sa, scale_b=sb, bias=bs, kernel="tma", tma=tma)
        want = tg.grouped_rows(a, b, splits, scale_a=sa, scale_b=sb, bias=bs, kernel="pointer",
                               tile=(tma.bm, tma.bn, tma.bk, 4, 1))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@interpreter_only
def test_tma_reads_strided_operands():
    """A with a padded row stride (a column slice) and B a slice of a wider stacked buffer
    (row stride > K, experts still one [E * N, K] matrix): TMA takes the strides as they are."""
    splits, k, n = [3, 0, 20], 24, 16
    a_wide = torch.randn(sum(splits), 40).bfloat16()
    b_wide = torch.randn(len(splits), n, 32).bfloat16()
    a, b = a_wide[:, :k], b_wide[:, :, :k]
    assert tg.tma_applies(a, b) and not a.is_contiguous() and not b.is_contiguous()
    got = tg.grouped_rows(a, b, splits, out_dtype=torch.float32, kernel="tma", tma=TMA_TINY)
    assert _rel(got, _reference(a, b, splits, None, None, None)) < 1e-6


def test_kernel_choice_is_explicit():
    """Where TMA cannot read the operands (row strides or bases not 16-byte aligned, experts not
    one matrix, stride-0 rows), asking for it is an error that names the fallback, unless nothing
    is read (an empty output); None on the CPU is the pointer kernel; unknown names, and a
    pointer tile given to the TMA kernel, are errors."""
    a, b = torch.zeros(6, 36, dtype=torch.bfloat16), torch.zeros(2, 8, 36, dtype=torch.bfloat16)
    assert not tg.tma_applies(a, b)  # 72-byte rows: not 16-byte aligned
    with pytest.raises(ValueError, match="kernel='pointer'"):
        tg.grouped_rows(a, b, [2, 4], kernel="tma")
    a32, wide = torch.zeros(6, 32, dtype=torch.bfloat16), torch.zeros(2, 12, 32, dtype=torch.bfloat16)
    assert not tg.tma_applies(a32, wide[:, :8])  # experts not one [E * N, K] matrix
    assert tg.tma_applies(a32, wide[:1, :8])  # one expert: nothing to stack
    assert tg.tma_applies(a32, wide) and tg._rows_kernel(None, a32, wide) == "pointer"  # CPU
    with pytest.raises(ValueError, match="kernel must be"):
        tg.grouped_rows(a, b, [2, 4], kernel="cutlass")
    raw = torch.zeros(6 * 32 + 1, dtype=torch.bfloat16)
    assert not tg.tma_applies(raw[1:].view(6, 32), wide)  # base 2 bytes off 16-byte alignment
    assert not tg.tma_applies(torch.zeros(1, 32, dtype=torch.bfloat16).expand(6, 32), wide)  # stride-0 rows
    empty_b = torch.zeros(2, 0, 36, dtype=torch.bfloat16)
    assert tg.grouped_rows(a, empty_b, [2, 4], kernel="tma").shape == (6, 0)  # nothing read: not refused
    with pytest.raises(ValueError, match="configure the pointer kernel"):
        tg.grouped_rows(a32, wide, [2, 4], kernel="tma", tile=TINY)


# ---------------------------------------------------------------------------- GPU
#: (splits, K, N) on the GPU: the last expert ends inside a row tile (TMA's zero fill past M), K
#: not a multiple of BK (zero fill in K) and N not a multiple of 128 or 256 (partial column
#: tiles, B rows read from the next expert)
GPU_CASES = [([0, 517, 2048, 1, 1999, 640, 3000, 1024], 2048, 1408),
             ([0, 517, 2048, 1, 1999, 640, 3000, 1000], 2040, 1400)]


def _gpu_operands(splits: list[int], k: int, n: int, seed: int, k_pad: int = 0):
    """Fresh random operands on the GPU; ``k_pad`` > 0: A and B slices of buffers ``k_pad``
    columns wider (row strides > K)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    e, m = len(splits), sum(splits)
    a = torch.randn(m, k + k_pad, generator=g, device="cuda").bfloat16()[:, :k]
    b = torch.randn(e, n, k + k_pad, generator=g, device="cuda").bfloat16()[:, :, :k]
    sa = torch.rand(m, generator=g, device="cuda") + 0.5
    sb = torch.rand(e, n, generator=g, device="cuda") + 0.5
    bias = torch.randn(e, n, generator=g, device="cuda")
    return a, b, sa, sb, bias


@gpu
@pytest.mark.parametrize("case", range(len(GPU_CASES)))
@pytest.mark.parametrize("name", list(tg.TMA_CONFIGS))
def test_gpu_tma_rows_vs_fp64(name, case):
    """8 experts (one empty, a one-row one, odd sizes): every benchmarked config against an FP64
    reference, the BF16 output its FP32 output rounded once, and within FP32-accumulation error
    of the pointer kernel. The FP32 output at this config only where its shared memory fits (a
    skip otherwise: FP32 outputs take ``TMA_F32_CONFIGS``, tested below)."""
    splits, k, n = GPU_CASES[case]
    seed = int(torch.randint(0, 2**31, (1,)))
    a, b, sa, sb, bias = _gpu_operands(splits, k, n, seed)
    cfg = tg.TMA_CONFIGS[name]
    kw = dict(scale_a=sa, scale_b=sb, bias=bias, kernel="tma", tma=cfg)
    with poisoned_outputs():
        out16 = tg.grouped_rows(a, b, splits, **kw)
        ref = _reference(a, b, splits, sa, sb, bias)
        assert _rel(out16.float(), ref) < 2 ** -8, f"seed {seed}"
        try:
            out32 = tg.grouped_rows(a, b, splits, out_dtype=torch.float32, **kw)
        except Exception as err:  # noqa: BLE001 - out of shared memory: the BF16 check above stands
            if "shared memory" not in str(err).lower() and "OutOfResources" not in type(err).__name__:
                raise
            pytest.skip(f"{name}: an FP32 output exceeds the shared memory ({type(err).__name__})")
        assert _rel(out32, ref) < 1e-5, f"seed {seed}"
        assert torch.equal(out16, out32.to(torch.bfloat16)), f"seed {seed}"
        ptr32 = tg.grouped_rows(a, b, splits, scale_a=sa, scale_b=sb, bias=bias, out_dtype=torch.float32,
                                kernel="pointer")
        assert _rel(out32, ptr32) < 1e-5, f"seed {seed}"


@gpu
@pytest.mark.parametrize("name", list(tg.TMA_F32_CONFIGS))
def test_gpu_tma_f32_configs_vs_fp64(name):
    """Every FP32-output config launches (its shared memory fits: the BF16 default's does not)
    and is within FP32-accumulation error of FP64; the default for FP32 is one of them."""
    assert tg.default_tma_config(torch.float32) in tg.TMA_F32_CONFIGS.values()
    splits, k, n = GPU_CASES[1]
    seed = int(torch.randint(0, 2**31, (1,)))
    a, b, sa, sb, bias = _gpu_operands(splits, k, n, seed)
    with poisoned_outputs():
        out32 = tg.grouped_rows(a, b, splits, scale_a=sa, scale_b=sb, bias=bias, out_dtype=torch.float32,
                                kernel="tma", tma=tg.TMA_F32_CONFIGS[name])
    assert _rel(out32, _reference(a, b, splits, sa, sb, bias)) < 1e-5, f"seed {seed}"


@gpu
def test_gpu_default_choice_strided_and_fallback():
    """``kernel=None`` on the GPU: strided operands TMA can read (row strides > K) take the TMA
    kernel, operands it cannot (K % 8 != 0: rows not 16-byte aligned) the pointer kernel; both
    within FP32-accumulation error of FP64."""
    splits = [0, 517, 2048, 1, 1999, 640, 3000, 1000]
    seed = int(torch.randint(0, 2**31, (1,)))
    for k, n, pad, want in ((2040, 1400, 24, "tma"), (2044, 1400, 0, "pointer")):
        a, b, sa, sb, bias = _gpu_operands(splits, k, n, seed, k_pad=pad)
        assert tg._rows_kernel(None, a, b) == want, (k, pad)
        with poisoned_outputs():
            out32 = tg.grouped_rows(a, b, splits, scale_a=sa, scale_b=sb, bias=bias, out_dtype=torch.float32)
        assert _rel(out32, _reference(a, b, splits, sa, sb, bias)) < 1e-5, f"seed {seed}, {want}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_default_config_follows_the_output_dtype(monkeypatch, dtype):
    """``tma=None`` launches ``default_tma_config(out_dtype)``: the FP32-output config (its
    epilogue's shared memory) for FP32, the BF16 default otherwise."""
    want = tg.TMA_F32_CONFIG if dtype == torch.float32 else tg.TMA_CONFIG
    assert tg.default_tma_config(dtype) == want
    seen = []
    monkeypatch.setattr(tg, "_launch_tma", lambda a, b, out, plan, sa, sb, bias, cfg: seen.append(cfg) or out)
    a, b = torch.zeros(6, 32, dtype=torch.bfloat16), torch.zeros(2, 8, 32, dtype=torch.bfloat16)
    tg.grouped_rows(a, b, [2, 4], kernel="tma", out_dtype=dtype)
    assert seen == [want]


def test_sass_count_specs_match_the_configs():
    """``bench/tools/sass_count.py`` spells the TMA configs out (it imports no hybridfp code at import
    time); its copies must be the configs the kernels run."""
    from bench.tools import sass_count

    def spec(cfg: tg.TmaConfig) -> tuple:
        return (cfg.bm, cfg.bn, cfg.bk, cfg.warps, cfg.stages, cfg.flatten, cfg.group_m)
    assert sass_count._TMA_SPECS == {k: spec(v) for k, v in tg.TMA_CONFIGS.items()}
    assert sass_count._TMA_F32_SPECS == {k: spec(v) for k, v in tg.TMA_F32_CONFIGS.items()}
