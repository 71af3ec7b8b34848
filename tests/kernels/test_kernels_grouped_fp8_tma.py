"""The TMA form of the grouped FP8 GEMM (kernels/moe/triton_grouped_fp8_tma.py): per-expert tensor
descriptors built on the device, a persistent grid.

CPU (interpreter): the codes' exact values summed in FP32 per K tile, as the pointer kernel
does. The interpreter's dots are numpy matmuls whose summation order follows the CPU's BLAS
kernel and the operands' layouts (which differ between the two kernels), so the bitwise checks
use codes whose sums are exact in FP32 in any order (``exact_sum_values``); an FP32 output is
the FP64 product at FP32-accumulation level. What the descriptors add is checked directly: no tile
reads past its expert (inf / NaN codes placed right after every expert's rows and reduction
leave every result finite), and the persistent programs cover every tile once (poisoned
outputs); a whole GroupedLinear step on random data takes it within the summation-order bound
of the pointer kernel. GPU (``-m gpu``): the 64-expert MoE shapes on the FP8 MMA, bitwise against the
pointer kernel at the same tile and against the FP64 product within the FP8 paths' bound.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from quantize_kernel_cases import exact_sum_values, gpu, interpreter_only, moe_step

from hybridfp.moe import gemm_fp8 as grouped_fp8
from hybridfp.moe.gemm import GROUPED_FP8_TRITON, PATH_COUNTS
from hybridfp.kernels.moe import triton_grouped_fp8_gemm as tk
from hybridfp.kernels.moe import triton_grouped_fp8_tma as tt
from hybridfp.kernels._common import poisoned_outputs

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SPLITS = [0, 19, 45, 1, 33]
#: the pointer kernel's tiny tile and the TMA kernel with the same BM / BN / BK (3 programs:
#: fewer than the tiles, so each program takes several)
TINY = (16, 16, 32, 4, 1)
TMA_TINY = tt.Fp8TmaConfig(bm=16, bn=16, bk=32, warps=4, stages=1, programs=3)
#: the same with the output written through a descriptor (bulk stores clipped at the expert's rows)
TMA_TINY_STORE = tt.Fp8TmaConfig(bm=16, bn=16, bk=32, warps=4, stages=1, programs=3, tma_store=True)


def _codes(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator, device: str = "cpu") -> torch.Tensor:
    """Finite FP8 values of many magnitudes (no NaN / inf codes)."""
    x = torch.randn(*shape, generator=g, device=device) * torch.exp2(
        torch.randint(-6, 7, shape, generator=g, device=device).float())
    return x.clamp(-400, 400).to(dtype)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert torch.isfinite(got).all()
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-300)).item()


@interpreter_only
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg", [TMA_TINY, TMA_TINY_STORE], ids=["pointer stores", "TMA stores"])
def test_rows_grouped_equals_pointer_kernel(dtypes, out_dtype, cfg):
    """fprop / dgrad: the experts' rows of one buffer, stacked weights, a bias; empty and
    one-row experts; N not a multiple of BN (40 over tiles of 16); bitwise the pointer kernel."""
    g = torch.Generator().manual_seed(0)
    e, k, n = len(SPLITS), 64, 40
    a = list(torch.split(exact_sum_values((sum(SPLITS), k), dtypes[0], g, k), SPLITS))
    b = list(exact_sum_values((e, n, k), dtypes[1], g, k).unbind(0))
    sa, sb = torch.rand(e, generator=g) + 0.25, torch.rand(e, generator=g) * 1e-3
    bias = torch.randn(e, n, generator=g)
    starts = [sum(SPLITS[:i]) for i in range(e)]
    want = tk.grouped_fp8(a, b, [k] * e, sa, sb, torch.empty(sum(SPLITS), n, dtype=out_dtype), starts, bias=bias,
                          tile=TINY)
    with poisoned_outputs():
        got = tk.grouped_fp8(a, b, [k] * e, sa, sb, torch.empty(sum(SPLITS), n, dtype=out_dtype), starts, bias=bias,
                             tma=cfg)
    assert torch.equal(got, want)
    ref = torch.cat([(x.double() @ y.double().t()) * (sa[i].double() * sb[i].double()) + bias[i].double()
                     for i, (x, y) in enumerate(zip(a, b))])
    if out_dtype == torch.float32:
        assert _rel(got, ref) < 1e-6


def _joined_wgrad(g: torch.Generator, ks: list[int], rows_a: int, rows_b: int, poison_tails: bool):
    """wgrad's joined column copies: per expert a block of ``ks[e]`` (a multiple of 16) token
    columns side by side in [rows, Σ ks] matrices. ``poison_tails``: each block's last 16
    columns hold +inf (A) / NaN (B) codes and the block's reduction stops before them, so a
    tile that read past its expert's reduction into them would make its result non-finite."""
    width = sum(ks)
    a = exact_sum_values((rows_a, width), E5M2, g, max(ks))
    b = exact_sum_values((rows_b, width), E4M3, g, max(ks))
    starts = np.cumsum([0] + ks[:-1]).tolist()
    used = list(ks)
    if poison_tails:
        for s, k in zip(starts, ks):
            if k:
                a.view(torch.uint8)[:, s + k - 16:s + k] = 0x7C  # +inf in E5M2
                b.view(torch.uint8)[:, s + k - 16:s + k] = 0x7F  # NaN in E4M3
        used = [max(k - 16, 0) for k in ks]
    return a, b, starts, used


@interpreter_only
@pytest.mark.parametrize("poison_tails", [False, True], ids=["plain", "inf-NaN past every reduction"])
@pytest.mark.parametrize("cfg", [TMA_TINY, TMA_TINY_STORE], ids=["pointer stores", "TMA stores"])
def test_reduction_grouped_reads_only_its_expert(poison_tails, cfg):
    """wgrad on joined copies (``grouped_fp8_at``): reductions that end inside a K tile (every
    BK-long tile of the last one would reach the next expert's block), a zero-length one; the
    result is the pointer kernel's, bitwise, and finite where the next block is inf / NaN."""
    g = torch.Generator().manual_seed(1)
    ks = [48, 0, 80, 16, 64]
    m, n = 20, 24
    a, b, starts, used = _joined_wgrad(g, ks, m, n, poison_tails)
    e = len(ks)
    sa, sb = torch.rand(e, generator=g) + 0.5, torch.rand(e, generator=g) + 0.5
    args = (a, b, m, starts, a.shape[1], starts, b.shape[1], used, sa, sb)
    rows = [i * m for i in range(e)]
    want = tk.grouped_fp8_at(*args, torch.empty(e * m, n), rows, tile=TINY)
    with poisoned_outputs():
        got = tk.grouped_fp8_at(*args, torch.empty(e * m, n), rows, tma=cfg)
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)
    for i, (s, k) in enumerate(zip(starts, used)):
        ref = (a[:, s:s + k].double() @ b[:, s:s + k].double().t()) * (sa[i].double() * sb[i].double())
        blk = got[i * m:(i + 1) * m]
        assert torch.equal(blk, torch.zeros(m, n)) if k == 0 else _rel(blk, ref) < 1e-6


@interpreter_only
@pytest.mark.parametrize("programs", [1, 2, 7, 1000])
def test_persistent_programs_cover_every_tile_once(programs):
    """Any number of persistent programs (one, fewer than the tiles, more: capped) and either
    loop form write every output element once: the same bits, poisoned outputs."""
    g = torch.Generator().manual_seed(2)
    k, n = 32, 40
    a = list(torch.split(exact_sum_values((sum(SPLITS), k), E4M3, g, k), SPLITS))
    b = [exact_sum_values((n, k), E4M3, g, k) for _ in SPLITS]
    ones = torch.ones(len(SPLITS))
    starts = [sum(SPLITS[:i]) for i in range(len(SPLITS))]
    want = tk.grouped_fp8(a, b, [k] * len(a), ones, ones, torch.empty(sum(SPLITS), n), starts, tile=TINY)
    for flatten, store in ((False, False), (True, False), (False, True)):
        cfg = tt.Fp8TmaConfig(bm=16, bn=16, bk=32, warps=4, stages=1, programs=programs, flatten=flatten,
                              tma_store=store)
        with poisoned_outputs():
            got = tk.grouped_fp8(a, b, [k] * len(a), ones, ones, torch.empty(sum(SPLITS), n), starts, tma=cfg)
        assert torch.equal(got, want), (flatten, store)


def test_tma_needs_16_byte_alignment():
    """An explicit TMA config on operands it cannot read is an error naming the alignment;
    ``prefer_tma`` runs the pointer kernel there (the same sums)."""
    g = torch.Generator().manual_seed(3)
    base_a, base_b = _codes((4096,), E4M3, g), _codes((4096,), E4M3, g)
    ones = torch.ones(2)
    args = (base_a, base_b, [3, 2], [8, 40], 64, [0, 640], 64, 16, ones, ones)
    with pytest.raises(ValueError, match=r"multiple of 16 bytes \(found 8\)"):
        tk.grouped_fp8_at(*args, torch.empty(5, 8), [0, 3], tma=TMA_TINY)
    assert not tt.applies(np.array([[8, 64, 0, 64, 16, 0, 3]]), 8, 8)
    assert tt.applies(np.array([[16, 64, 0, 64, 16, 0, 3]]), 8, 16)
    assert not tt.applies(np.array([[16, 64, 0, 64, 16, 0, 2 ** 31]]), 8, 16)
    # TMA stores need 16-byte output rows: N = 12 BF16 values are 24 bytes
    meta = np.array([[16, 64, 0, 64, 16, 0, 3]])
    assert tt.applies(meta, 12, 16, torch.empty(3, 12, dtype=torch.bfloat16), TMA_TINY)
    assert not tt.applies(meta, 12, 16, torch.empty(3, 12, dtype=torch.bfloat16), TMA_TINY_STORE)
    assert tt.applies(meta, 12, 16, torch.empty(3, 12), TMA_TINY_STORE)
    if os.environ.get("TRITON_INTERPRET") == "1":
        want = tk.grouped_fp8_at(*args, torch.empty(5, 8), [0, 3], tile=TINY)
        got = tk.grouped_fp8_at(*args, torch.empty(5, 8), [0, 3], tile=TINY, prefer_tma=TMA_TINY)
        assert torch.equal(got, want)


def _abs_codes(codes: torch.Tensor) -> torch.Tensor:
    """|codes| (the sign bit cleared: E4M3 and E5M2 alike)."""
    return (codes.view(torch.uint8) & 0x7F).view(codes.dtype)


def _gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u), u = 2**-24: a bound on the relative error of any
    FP32 summation order of n + 1 terms, relative to the sum of their magnitudes."""
    u = 2.0 ** -24
    return n * u / (1 - n * u)


@interpreter_only
def test_fp8_step_takes_the_tma_kernel(monkeypatch, set_policy):
    """A GroupedLinear FP8-current step on joined copies with the policy's ``grouped_fp8_tma_rows``
    / ``grouped_fp8_tma_wgrad`` set (the interpreter's tiny config stands in for the CUDA one): all three GEMMs
    launch the TMA kernel, each launch's output is the pointer kernel's on the same operands up to
    FP32 summation order, and the step's outputs are the pointer-kernel step's within that bound.

    Bound: the two kernels sum the same FP8 products of a reduction of at most ``k_max`` terms in
    FP32 in orders set by the CPU's BLAS kernel (the interpreter's numpy dots; the TMA kernel's B
    tile is transposed), each within gamma(k_max - 1) * sum|a b| of the exact sum; the epilogue's
    scale and the output rounding add a few u more. So |tma - pointer| <= 2 gamma(k_max + 2) M,
    M = the same kernel on |codes| and |scales| (itself an FP32 sum: M >= sum|a b| s (1 - gamma)).
    The operands are random (the step quantizes N(0, 1) draws), so this is no bitwise claim; a
    tile read from the wrong place or a wrong scale is far outside it."""
    from hybridfp import GroupedLinear, factories
    splits, hidden, out_features = [0, 19, 45, 1, 33, 16], 32, 48
    k_max = max(hidden, out_features, *(-(-m // 16) * 16 for m in splits))  # wgrad: 16-padded token blocks
    set_policy(grouped_triton_devices={"cpu"})
    real = tt.launch
    bounds: list[float] = []

    def launch_and_check(a, b, sa, sb, bias, out, meta, n, cfg, promote):
        got = real(a, b, sa, sb, bias, out, meta, n, cfg, promote)
        tile = (cfg.bm, cfg.bn, cfg.bk, cfg.warps, cfg.stages)
        want = tk._launch(a, b, sa, sb, bias, torch.empty_like(out), meta, n, tile, promote, cfg.group_m, 1)
        mag = tk._launch(_abs_codes(a), _abs_codes(b), sa.abs(), sb.abs(), None, torch.empty_like(out), meta, n,
                         tile, promote, cfg.group_m, 1)
        tol = 2 * _gamma(k_max + 2) / (1 - _gamma(k_max + 2)) * mag.double() + (bias.abs().double() * 2 ** -23
                                                                              if bias is not None else 0)
        assert torch.isfinite(got).all() and ((got.double() - want.double()).abs() <= tol).all()
        bounds.append(tol)
        return got

    monkeypatch.setattr(tk, "launch_tma", launch_and_check)

    def step():
        torch.manual_seed(1)
        m = GroupedLinear(len(splits), hidden, out_features, bias=False, params_dtype=torch.float32)
        return moe_step(m, splits, factories.current_scaling, torch.float32)

    want = step()
    assert not bounds
    # TMA configs with the pointer kernel's default tiles (the same K tiles)
    configs = {name: tt.Fp8TmaConfig(bm=t[0], bn=t[1], bk=t[2], programs=3)
               for name, t in (("rows", tk.TILE), ("wgrad", tk.WGRAD_TILE))}
    monkeypatch.setattr(grouped_fp8, "_tma", lambda name, device: None if name is None else configs[name])
    set_policy(grouped_fp8_tma_rows="rows", grouped_fp8_tma_wgrad="wgrad")
    before = PATH_COUNTS.copy()
    got = step()
    assert (PATH_COUNTS - before) == {(gm, GROUPED_FP8_TRITON): 1 for gm in ("fprop", "dgrad", "wgrad")}
    assert len(bounds) == 3
    # fprop -> y, dgrad -> x.grad, wgrad -> the experts' weight gradients (their rows, in order)
    tols = [bounds[0], bounds[1]] + list(torch.split(bounds[2], out_features))
    assert len(got) == len(want) == len(tols)
    for i, (a, b, tol) in enumerate(zip(got, want, tols)):
        assert a.shape == b.shape and ((a.double() - b.double()).abs() <= tol.reshape(a.shape)).all(), i


# ---------------------------------------------------------------------------- GPU
GPU_SPLITS = [1536, 0, 640, 2048, 1001, 1511, 256, 1200] * 8  # 64 experts, one empty per 8


@gpu
@pytest.mark.parametrize("name", list(tt.CONFIGS))
@pytest.mark.parametrize("gemm", ["fprop", "wgrad"])
def test_moe_shapes_equal_pointer_kernel_cuda(name, gemm):
    """At the 64-expert MoE's shapes (hidden 4096, ffn 1408) on a CUDA GPU: every config against
    the pointer kernel at its BM / BN / BK (same K tiles, same promotion: the same bits), and
    within the FP8 paths' bound of the FP64 product (rel. error excess over BF16 rounding 1e-4).
    wgrad: joined column copies with inf / NaN codes right past every expert's reduction."""
    cfg = tt.CONFIGS[name]
    g = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    e, hidden, ffn = len(GPU_SPLITS), 4096, 1408
    sa = torch.rand(e, device="cuda", generator=g) + 0.5
    sb = torch.rand(e, device="cuda", generator=g) * 1e-3
    if gemm == "fprop":
        x = _codes((sum(GPU_SPLITS), hidden), E4M3, g, "cuda")
        w = _codes((e * ffn, hidden), E4M3, g, "cuda")
        starts = np.cumsum([0] + GPU_SPLITS[:-1]).tolist()
        args = (x, w, GPU_SPLITS, [s * hidden for s in starts], hidden, [i * ffn * hidden for i in range(e)], hidden,
                hidden, sa, sb)
        rows, out_rows, parts = sum(GPU_SPLITS), starts, None
    else:
        # each expert's block: its tokens, zero codes to a multiple of 16 (its reduction, as the
        # grouped cast lays them out), then 16 poisoned columns no tile may read
        red = [-(-m // 16) * 16 for m in GPU_SPLITS]
        width = sum(red) + 16 * e
        a = _codes((ffn, width), E5M2, g, "cuda")
        b = _codes((hidden, width), E4M3, g, "cuda")
        starts = np.cumsum([0] + [r + 16 for r in red[:-1]]).tolist()
        for s, m, r in zip(starts, GPU_SPLITS, red):
            for t, bad in ((a, 0x7C), (b, 0x7F)):
                t.view(torch.uint8)[:, s + m:s + r] = 0
                t.view(torch.uint8)[:, s + r:s + r + 16] = bad
        args = (a, b, ffn, starts, width, starts, width, red, sa, sb)
        rows, out_rows = e * ffn, [i * ffn for i in range(e)]
        parts = [(a[:, s:s + m], b[:, s:s + m]) for s, m in zip(starts, GPU_SPLITS)]
    n = ffn if gemm == "fprop" else hidden
    with poisoned_outputs():
        got = tk.grouped_fp8_at(*args, torch.empty(rows, n, dtype=torch.bfloat16, device="cuda"), out_rows, tma=cfg)
    tile = (cfg.bm, cfg.bn, cfg.bk, cfg.warps, cfg.stages)
    want = tk.grouped_fp8_at(*args, torch.empty(rows, n, dtype=torch.bfloat16, device="cuda"), out_rows, tile=tile,
                             group_m=cfg.group_m, promote=min(tk.PROMOTE, cfg.bk))
    assert torch.isfinite(got.float()).all()
    assert torch.equal(got, want)
    if parts is None:
        xs = torch.split(x, GPU_SPLITS)
        parts = [(xs[i], w[i * ffn:(i + 1) * ffn]) for i in range(e)]
    ref = torch.cat([(p.double() @ q.double().t()) * (sa[i].double() * sb[i].double()) for i, (p, q) in enumerate(parts)])
    err = ((got.double() - ref).norm() / ref.norm()).item()
    ideal = ((ref.bfloat16().double() - ref).norm() / ref.norm()).item()
    assert err - ideal <= 1e-4, (err, ideal)
