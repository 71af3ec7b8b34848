"""The Triton FP8 grouped GEMM (kernels/moe/triton_grouped_fp8_gemm.py) and ``grouped_gemm``'s path
through it (moe/gemm_fp8.py).

CPU (interpreter): the codes' exact values summed in FP32, so an FP32 output is the FP64
product of the decoded operands at FP32-accumulation level (relative error ≤ 1e-6 at these
sizes) and a 16-bit output is the FP32 one rounded once (bitwise). GPU (``-m gpu``): the FP8 MMA
with FP32 promotion every 128 products (numerics §1's Hopper exception), bounded like the cuBLAS
FP8 paths (tests/gemm/test_gemm_grouped.py), at MoE shapes, fresh inputs, poisoned outputs.
"""

from __future__ import annotations

import pytest
import torch
from quantize_kernel_cases import gpu, interpreter_only, moe_step

import hybridfp
from hybridfp.gemm import gemm
from hybridfp.moe import grouped_gemm
from hybridfp.moe.gemm import GROUPED_FP8_TRITON, PATH_COUNTS, grouped_path
from hybridfp.gemm.gemm import LAYOUTS, operand_storage
from hybridfp.kernels.moe import triton_grouped_fp8_gemm as tk
from hybridfp.kernels._common import poisoned_outputs

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SPLITS = [0, 19, 45, 1, 33]
TINY = (16, 16, 32, 4, 1)
OPERANDS = {"TN": ("x", "w"), "NN": ("dy", "w"), "NT": ("dy", "x")}
GEMM = {"TN": "fprop", "NN": "dgrad", "NT": "wgrad"}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert torch.isfinite(got).all()
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-300)).item()


def _codes(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator, device: str = "cpu") -> torch.Tensor:
    """Finite FP8 values of every magnitude the format holds (no NaN / inf codes)."""
    x = torch.randn(*shape, generator=g, device=device) * torch.exp2(torch.randint(-6, 7, shape, generator=g,
                                                                                   device=device).float())
    return x.clamp(-400, 400).to(dtype)


def _reference(a, b, ks, sa, sb, bias=None):
    out = []
    for e, (x, y, k) in enumerate(zip(a, b, ks)):
        v = (x[:, :k].double() @ y[:, :k].double().t()) * (sa[e].double() * sb[e].double())
        out.append(v if bias is None else v + bias[e].double())
    return out


# ---------------------------------------------------------------------------- kernel, CPU
@interpreter_only
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2), (E5M2, E5M2)])
def test_rows_grouped_with_bias_every_dtype_pair(dtypes):
    """fprop / dgrad shape: A the experts' rows of one buffer, B stacked weights; empty and
    one-row experts; FP32 output at FP32 accumulation, BF16 / FP16 its one rounding."""
    g = torch.Generator().manual_seed(0)
    e, k, n = len(SPLITS), 64, 24
    whole = _codes((sum(SPLITS), k), dtypes[0], g)
    w = _codes((e, n, k), dtypes[1], g)
    a = list(torch.split(whole, SPLITS))
    b = list(w.unbind(0))
    sa, sb = torch.rand(e, generator=g) + 0.25, torch.rand(e, generator=g) * 1e-3
    bias = torch.randn(e, n, generator=g)
    starts = [sum(SPLITS[:i]) for i in range(e)]
    out32 = tk.grouped_fp8(a, b, [k] * e, sa, sb, torch.empty(sum(SPLITS), n), starts, bias=bias, tile=TINY)
    assert _rel(out32, torch.cat(_reference(a, b, [k] * e, sa, sb, bias))) < 1e-6
    for dt in (torch.bfloat16, torch.float16):
        with poisoned_outputs():
            got = tk.grouped_fp8(a, b, [k] * e, sa, sb, torch.empty(sum(SPLITS), n, dtype=dt), starts,
                                 bias=bias, tile=TINY)
        assert torch.equal(got, out32.to(dt)), dt


@interpreter_only
def test_reduction_grouped_in_separate_buffers():
    """wgrad shape: every expert's operands in their own allocations (offsets across buffers),
    reductions of every length incl. 0 and non-multiples of 16, a strided view; [E·M, N] out."""
    g = torch.Generator().manual_seed(1)
    m, n = 20, 24
    ks = [0, 19, 45, 1, 33]
    a = [_codes((m, k + 16), E5M2, g)[:, :k] for k in ks]  # row stride k + 16 > k
    b = [_codes((n, k), E4M3, g) for k in ks]
    sa, sb = torch.rand(len(ks), generator=g) + 0.5, torch.rand(len(ks), generator=g) + 0.5
    with poisoned_outputs():
        out = tk.grouped_fp8(a, b, ks, sa, sb, torch.empty(len(ks) * m, n), [e * m for e in range(len(ks))],
                             tile=TINY)
    ref = _reference(a, b, ks, sa, sb)
    for e, k in enumerate(ks):
        got = out[e * m:(e + 1) * m]
        if k == 0:
            assert torch.equal(got, torch.zeros(m, n))
        else:
            assert _rel(got, ref[e]) < 1e-6, e


@interpreter_only
def test_swizzle_groups_cover_every_tile_once():
    """The L2 swizzle only reorders programs: poisoned outputs, same bits for every group size."""
    g = torch.Generator().manual_seed(2)
    k, n = 32, 40  # 3 column tiles of TINY; 9 row tiles
    a = list(torch.split(_codes((sum(SPLITS), k), E4M3, g), SPLITS))
    b = [_codes((n, k), E4M3, g) for _ in SPLITS]
    ones = torch.ones(len(SPLITS))
    starts = [sum(SPLITS[:i]) for i in range(len(SPLITS))]
    with poisoned_outputs():
        outs = [tk.grouped_fp8(a, b, [k] * len(a), ones, ones, torch.empty(sum(SPLITS), n), starts, tile=TINY,
                               group_m=gm) for gm in (1, 2, 4, 16)]
    assert _rel(outs[0], torch.cat(_reference(a, b, [k] * len(a), ones, ones))) < 1e-6
    for got in outs[1:]:
        assert torch.equal(got, outs[0])


def _nan_case(device: str, m: int, k: int, n: int):
    """Two experts, E5M2 A with a NaN code in expert 1's row 3 and an inf code in its row 5."""
    g = torch.Generator(device=device).manual_seed(7)
    whole = _codes((2 * m, k), E5M2, g, device)
    bits = whole.view(torch.uint8)
    bits[m + 3, k // 2] = 0x7F  # NaN
    bits[m + 5, 1] = 0x7C  # +inf
    a = list(torch.split(whole, [m, m]))
    b = [_codes((n, k), E4M3, g, device) for _ in range(2)]
    ones = torch.ones(2, device=device)
    return a, b, ones


def _check_nan_rows(out: torch.Tensor, m: int) -> None:
    bad = ~torch.isfinite(out.float())
    assert bad[m + 3].all() and torch.isnan(out[m + 3].float()).all()  # NaN x anything
    assert bad[m + 5].all()  # inf x finite nonzero: inf or NaN (both signs summed), never finite
    assert bad.sum(1).count_nonzero() == 2  # no other row touched


@interpreter_only
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's NaN matmul
def test_nan_and_inf_codes_propagate():
    a, b, ones = _nan_case("cpu", 16, 64, 24)
    out = tk.grouped_fp8(a, b, [64, 64], ones, ones, torch.empty(32, 24, dtype=torch.bfloat16), [0, 16], tile=TINY)
    _check_nan_rows(out, 16)


def test_kernel_rejects_bad_operands():
    x, w = torch.zeros(4, 32, dtype=E4M3), torch.zeros(8, 32, dtype=E4M3)
    ones = torch.ones(1)
    with pytest.raises(ValueError, match=r"A\[0\] must be a 2D E4M3 / E5M2"):
        tk.grouped_fp8([x.float()], [w], [32], ones, ones, torch.empty(4, 8), [0])
    with pytest.raises(ValueError, match=r"B\[0\] must have unit column stride"):
        tk.grouped_fp8([x], [w.t()[:8]], [4], ones, ones, torch.empty(4, 4), [0])
    with pytest.raises(ValueError, match="scale_a must be contiguous FP32"):
        tk.grouped_fp8([x], [w], [32], torch.ones(2), ones, torch.empty(4, 8), [0])
    with pytest.raises(ValueError, match="do not fit"):
        tk.grouped_fp8([x], [w], [32], ones, ones, torch.empty(4, 8), [1])
    with pytest.raises(ValueError, match="same FP8 dtype"):
        tk.grouped_fp8([x, x.view(torch.uint8).view(E5M2)], [w, w], [32, 32], torch.ones(2), torch.ones(2),
                       torch.empty(8, 8), [0, 4])


@interpreter_only
def test_joined_bases_equal_views_and_check_every_extent():
    """``grouped_fp8_at`` (operands as places in two joined bases; per-expert arguments as lists,
    CPU tensors or one int for all) gives the bits ``gemm_fp8`` gives on the same operands as
    views; an expert whose rows, offsets or strides leave its base, or whose output rows leave
    ``out``, is named in the error."""
    g = torch.Generator().manual_seed(4)
    e, k, n = len(SPLITS), 48, 24
    a_base = _codes((sum(SPLITS), k), E5M2, g)
    b_base = _codes((e * n, k), E4M3, g)
    sa, sb = torch.rand(e, generator=g) + 0.5, torch.rand(e, generator=g) + 0.5
    starts = [sum(SPLITS[:i]) for i in range(e)]
    want = tk.grouped_fp8(list(torch.split(a_base, SPLITS)), list(b_base.view(e, n, k).unbind(0)), [k] * e, sa, sb,
                          torch.empty(sum(SPLITS), n), starts, tile=TINY)
    with poisoned_outputs():
        got = tk.grouped_fp8_at(a_base, b_base, SPLITS, torch.tensor(starts) * k, k, torch.arange(e) * (n * k), k, k,
                                sa, sb, torch.empty(sum(SPLITS), n), starts, tile=TINY)
    assert torch.equal(got, want)
    args = dict(base_a=a_base, base_b=b_base, ms=SPLITS, a_offs=[s * k for s in starts], a_lds=k,
                b_offs=[i * n * k for i in range(e)], b_lds=k, ks=k, scale_a=sa, scale_b=sb,
                out=torch.empty(sum(SPLITS), n), out_rows=starts, tile=TINY)
    a_offs, b_offs = args["a_offs"], args["b_offs"]
    for change, match in ((dict(b_offs=b_offs[:-1] + [b_offs[-1] + 1]), r"expert 4's B \(24 rows of 48 from element 4609"),
                          (dict(b_lds=[k, k, k, k - 1, k]), r"expert 3's B \(24 rows of 48 .* row stride 47\)"),
                          (dict(a_lds=[k, k, k - 1, k, k]), r"expert 2's A \(45 rows of 48 .* row stride 47\)"),
                          # the last row of expert 4 would end one element past base_a
                          (dict(a_offs=a_offs[:-1] + [a_offs[-1] + 1]), r"expert 4's A \(33 rows of 48 from element 3121"),
                          (dict(a_lds=[k, k, k, k, k + 1]), r"expert 4's A \(33 rows of 48 .* row stride 49\)"),
                          (dict(out_rows=starts[:-1] + [starts[-1] + 1]), "expert 4's 33 result rows from row 66"),
                          (dict(ks=[k] * 4), r"ks needs one value per expert \(5\)"),
                          # negative or huge values: rejected before any arithmetic that could wrap
                          (dict(a_offs=a_offs[:2] + [-k] + a_offs[3:]), r"a_offs\[2\] is -48"),
                          (dict(b_offs=[-1] + b_offs[1:]), r"b_offs\[0\] is -1"),
                          (dict(out_rows=[-1] + starts[1:]), r"out_rows\[0\] is -1"),
                          (dict(ms=[0, 19, 45, -1, 34]), r"ms\[3\] is -1"),
                          (dict(out_rows=starts[:-1] + [2 ** 63 - 1]), r"out_rows\[4\] is 9223372036854775807"),
                          (dict(a_lds=[k, k, 2 ** 62, k, k]), r"a_lds\[2\] is 4611686018427387904"),
                          # outside int64 altogether: the same error, not numpy's OverflowError
                          (dict(b_offs=b_offs[:3] + [2 ** 64] + b_offs[4:]), r"b_offs\[3\] is 18446744073709551616"),
                          (dict(ms=[0, 19, -(2 ** 70), 45, 34]), r"ms\[2\] is -1180591620717411303424")):
        with pytest.raises(ValueError, match=match):
            tk.grouped_fp8_at(**{**args, **change})
    # a stride whose product with the rows would wrap int64 is caught by the division form
    with pytest.raises(ValueError, match=r"expert 2's A \(45 rows of 48 .* row stride 281474976710656\)"):
        tk.grouped_fp8_at(**{**args, "a_lds": [k, k, 2 ** 48, k, k]})
    # an empty expert (SPLITS[0] = 0) may point anywhere: it reads nothing
    tk.grouped_fp8_at(**{**args, "a_offs": [10 ** 9] + args["a_offs"][1:]})


@interpreter_only
def test_alignment_promise_is_the_largest_that_holds(monkeypatch):
    """``ALIGN`` (the ``tl.multiple_of`` promise on offsets, strides and K, which the compiled
    kernel's 16-byte loads rely on and the interpreter cannot check) divides every field of every
    expert that reads, and is the largest power of two <= 16 that does."""
    seen = []
    real = tk._kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                experts = args[9]
                fields = args[6].cpu()[experts + 1:].reshape(experts, 7)[:, :5]
                rows = fields[fields[:, 4] > 0]  # experts that read
                assert bool((rows % kw["ALIGN"] == 0).all())
                assert kw["ALIGN"] == 16 or bool((rows % (2 * kw["ALIGN"]) != 0).any())
                seen.append(kw["ALIGN"])
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(tk, "_kernel", Spy())
    g = torch.Generator().manual_seed(5)
    base_a, base_b = _codes((4096,), E4M3, g), _codes((4096,), E4M3, g)
    ones = torch.ones(2)
    for offs, k, want in (([0, 32], 16, 16), ([8, 40], 16, 8), ([8, 12], 16, 4), ([0, 16], 12, 4), ([0, 16], 6, 2),
                          ([1, 16], 16, 1)):
        tk.grouped_fp8_at(base_a, base_b, [3, 2], offs, 64, [0, 640], 64, k, ones, ones,
                          torch.empty(5, 8), [0, 3], tile=TINY)
        assert seen[-1] == want, (offs, k, seen[-1])


# ---------------------------------------------------------------------------- grouped_gemm, CPU
def _experts(splits, k, n, dy_dtype, seed=0):
    """Per-expert FP8 current-scaled x, w (E4M3) and dy (``dy_dtype``), each at its own scale."""
    g = torch.Generator().manual_seed(seed)
    out = {"x": [], "w": [], "dy": []}
    for e, m in enumerate(splits):
        mag = 2.0 ** (e % 5 - 2)
        for name, shape, s, dt in (("x", (m, k), mag, E4M3), ("w", (n, k), 1 / mag, E4M3), ("dy", (m, n), mag, dy_dtype)):
            out[name].append(hybridfp.Float8CurrentScalingQuantizer(dt)(torch.randn(*shape, generator=g) * s))
    return out


@interpreter_only
@pytest.mark.parametrize("layout", list(OPERANDS))
@pytest.mark.parametrize("dy_dtype", [E4M3, E5M2])
def test_grouped_gemm_takes_the_fp8_path_and_equals_per_expert(layout, dy_dtype):
    q = _experts(SPLITS, 48, 32, dy_dtype)
    a, b = q[OPERANDS[layout][0]], q[OPERANDS[layout][1]]
    before = PATH_COUNTS.copy()
    got = grouped_gemm(a, b, layout, out_dtype=torch.float32, use_triton=True)
    assert (PATH_COUNTS - before) == {(GEMM[layout], GROUPED_FP8_TRITON): 1}
    want = [gemm(x, y, layout, out_dtype=torch.float32) for x, y in zip(a, b)]  # exact emulation on the CPU
    pairs = zip(got, want) if layout == "NT" else [(got, torch.cat(want))]
    for g_, w_ in pairs:
        assert g_.shape == w_.shape and (w_.norm() == 0 and g_.norm() == 0 or _rel(g_, w_) < 1e-6)
    got16 = grouped_gemm(a, b, layout, use_triton=True)
    for g16, g32 in (zip(got16, got) if layout == "NT" else [(got16, got)]):
        assert torch.equal(g16, g32.to(torch.bfloat16))


@interpreter_only
def test_grouped_quantized_experts_and_fprop_bias():
    """The experts of one grouped quantization (rows of one buffer, columnwise copies in
    zero-padded blocks: wgrad reads 16-aligned reductions) and per-expert biases."""
    from hybridfp.moe.quantize import quantize_grouped
    g = torch.Generator().manual_seed(4)
    k, n = 48, 32
    qs = [hybridfp.Float8CurrentScalingQuantizer(E4M3) for _ in SPLITS]
    x = quantize_grouped(qs, torch.randn(sum(SPLITS), k, generator=g), SPLITS)
    dqs = [hybridfp.Float8CurrentScalingQuantizer(E5M2) for _ in SPLITS]
    dy = quantize_grouped(dqs, torch.randn(sum(SPLITS), n, generator=g), SPLITS)
    w = [hybridfp.Float8CurrentScalingQuantizer(E4M3)(torch.randn(n, k, generator=g)) for _ in SPLITS]
    biases = [torch.randn(n, generator=g) for _ in SPLITS]
    got = grouped_gemm(x, w, "TN", out_dtype=torch.float32, biases=biases, use_triton=True)
    want = torch.cat([gemm(a, b, "TN", out_dtype=torch.float32, bias=c) for a, b, c in zip(x, w, biases)])
    assert _rel(got, want) < 1e-6
    before = PATH_COUNTS.copy()
    dw = grouped_gemm(dy, x, "NT", out_dtype=torch.float32, use_triton=True)
    assert (PATH_COUNTS - before) == {("wgrad", GROUPED_FP8_TRITON): 1}
    for e, (a, b) in enumerate(zip(dy, x)):
        ref = gemm(a, b, "NT", out_dtype=torch.float32)
        assert torch.equal(dw[e], ref) if SPLITS[e] == 0 else _rel(dw[e], ref) < 1e-6


def test_path_needs_triton_and_small_experts():
    """Not on the CPU by default; big experts stay on cuBLAS per expert (on CUDA)."""
    q = _experts([3, 5], 32, 16, E5M2)
    sa = [operand_storage(t, "rowwise", "A") for t in q["dy"]]
    sb = [operand_storage(t, "columnwise", "B") for t in q["w"]]
    assert grouped_path(sa, sb, "NN", torch.bfloat16, False)[0] == "per_expert"
    assert grouped_path(sa, sb, "NN", torch.bfloat16, False, use_triton=True)[0] == GROUPED_FP8_TRITON
    assert grouped_path(sa, sb, "NN", torch.bfloat16, False, use_triton=True, ms=[10 ** 9, 10 ** 9])[0] == "per_expert"


# ---------------------------------------------------------------------------- GPU
def _fp64(t: torch.Tensor, direction: str) -> torch.Tensor:
    """The stored copy's values times its scale_inv, in FP64 ([m, k] as the GEMM reads it)."""
    op = operand_storage(t, direction, "ref").gemm_operand(direction)
    return op.values.double() * op.scale.double()


#: Bound on rel_err(out) - rel_err(bf16(ref)): see tests/gemm/test_gemm_grouped.py's GPU_EXCESS;
#: the FP8 MMA paths measured ~5e-6 there; 1e-4 as for cuBLAS's.
GPU_EXCESS = 1e-4
GPU_SPLITS = [1536, 0, 640, 2048, 1001, 1511, 256, 1200] * 8  # 64 experts, one empty per 8


@gpu
def test_nan_and_inf_codes_propagate_cuda():
    """The FP8 MMA propagates NaN / inf codes as the exact sums do (no row but theirs)."""
    a, b, ones = _nan_case("cuda", 300, 512, 256)
    with poisoned_outputs():
        out = tk.grouped_fp8(a, b, [512, 512], ones, ones, torch.empty(600, 256, dtype=torch.bfloat16, device="cuda"),
                             [0, 300])
    _check_nan_rows(out, 300)


@gpu
@pytest.mark.parametrize("layout", list(OPERANDS))
@pytest.mark.parametrize("ffn", [1408, 4096])
def test_moe_shapes_vs_fp64_cuda(layout, ffn):
    """64 FP8-current experts (E5M2 gradients) on a CUDA GPU against the FP64 GEMM of the
    dequantized copies; the grouped GEMM takes this path by default."""
    import os

    from hybridfp.moe.quantize import quantize_grouped
    g = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    hidden, splits = 4096, GPU_SPLITS
    mags = torch.tensor([2.0 ** (e % 4 - 2) for e in range(len(splits))], device="cuda")
    row_mag = mags.repeat_interleave(torch.tensor(splits, device="cuda"))[:, None]
    x = quantize_grouped([hybridfp.Float8CurrentScalingQuantizer(E4M3) for _ in splits],
                         torch.randn(sum(splits), hidden, device="cuda", generator=g) * row_mag, splits)
    dy = quantize_grouped([hybridfp.Float8CurrentScalingQuantizer(E5M2) for _ in splits],
                          torch.randn(sum(splits), ffn, device="cuda", generator=g) * 1e-3 * row_mag, splits)
    w = [hybridfp.Float8CurrentScalingQuantizer(E4M3)(torch.randn(ffn, hidden, device="cuda", generator=g) * 0.02 / mags[e])
         for e in range(len(splits))]
    ops = {"x": list(x), "dy": list(dy), "w": w}
    wa, wb = OPERANDS[layout]
    before = PATH_COUNTS.copy()
    with poisoned_outputs():
        out = grouped_gemm(ops[wa], ops[wb], layout)
    want_path = "grouped_fp8_rowwise" if layout == "TN" else GROUPED_FP8_TRITON
    assert (PATH_COUNTS - before) == {(GEMM[layout], want_path): 1}
    da, db = LAYOUTS[layout]
    # Frobenius norms summed expert by expert: the whole FP64 reference of the wgrad at ffn 4096
    # (64 x 4096 x 4096) is 8.6 GB, several copies of it more than a GPU shared by test workers has
    sums = torch.zeros(3, dtype=torch.float64, device="cuda")  # |out - ref|^2, |bf16(ref) - ref|^2, |ref|^2
    row = 0
    for e, (p, q_) in enumerate(zip(ops[wa], ops[wb])):
        ref = _fp64(p, da) @ _fp64(q_, db).t()
        got = out[e] if layout == "NT" else out[row:row + ref.shape[0]]
        row += ref.shape[0]
        sums += torch.stack([(got.double() - ref).square().sum(), (ref.bfloat16().double() - ref).square().sum(),
                             ref.square().sum()])
    if layout != "NT":
        assert row == out.shape[0]
    err_sq, ideal_sq, ref_sq = sums.tolist()
    err, ideal = (err_sq / ref_sq) ** 0.5, (ideal_sq / ref_sq) ** 0.5
    print(f"\n{layout} ffn={ffn}: rel err {err:.4e}, BF16 rounding alone {ideal:.4e}, excess {err - ideal:.2e}")
    assert err - ideal <= GPU_EXCESS
    if layout == "NT":
        assert torch.equal(out[1], torch.zeros_like(out[1]))  # the empty expert


# ---------------------------------------------------------------------------- joined copies, CPU
@interpreter_only
@pytest.mark.parametrize("out_features", [48, 40], ids=["N=48", "N=40"])
def test_fp8_step_on_joined_copies(out_features, monkeypatch, set_policy):
    """FP8 current scaling (E4M3 x and W, E5M2 dy): x, dy and the stacked weights come as joined
    copies with per-expert scales (``moe.assemble._scaled_group``); with the Triton paths
    on (as on CUDA from 16 experts; forced here, in the interpreter) all three GEMMs run on them
    (``grouped_fp8.run_joined``) and no per-expert tensor is built. Against the same step on the
    per-expert lists (the exact emulation per expert on the CPU): FP32 weight gradients at FP32
    accumulation level (relative 1e-6), the FP32 output and input gradient too. N=40: the
    weights' columnwise blocks are padded to 48 (dgrad reads 40 of each)."""
    import copy

    from hybridfp import GroupedLinear, factories
    from hybridfp.moe import assemble as qgrouped
    splits, hidden = [0, 19, 45, 1, 33, 16], 32
    built: list[int] = []
    real_cut = qgrouped._cut_scaled
    monkeypatch.setattr(qgrouped, "_cut_scaled", lambda *a: built.append(len(a[1])) or real_cut(*a))

    def step(m):
        return moe_step(m, splits, factories.current_scaling, torch.float32)

    torch.manual_seed(1)
    m = GroupedLinear(len(splits), hidden, out_features, bias=False, params_dtype=torch.float32)
    fresh = copy.deepcopy(m)
    set_policy(grouped_triton_devices={"cpu"})
    before = PATH_COUNTS.copy()
    got = step(m)
    assert (PATH_COUNTS - before) == {(g, GROUPED_FP8_TRITON): 1 for g in ("fprop", "dgrad", "wgrad")}
    assert built == [], built
    set_policy(grouped_triton_devices=frozenset())
    want = step(fresh)
    assert built, "the reference step runs on the per-expert tensors"
    for i, (a, b) in enumerate(zip(got, want)):
        if b.norm() == 0:  # an expert without tokens
            assert torch.equal(a, b), i
        else:
            assert _rel(a, b) < 1e-6, (i, _rel(a, b))


@interpreter_only
def test_joined_copies_take_the_triton_crossover_of_expert_lists(monkeypatch, set_policy):
    """Joined FP8 copies decide fprop / dgrad by the same crossover as the experts' lists
    (``per_expert_fp8_triton_flops``: the same Triton kernel competes with cuBLAS per expert);
    wgrad keeps the general one. With the Triton crossover at 0 and the general one at its
    default, fprop and dgrad run per expert and wgrad on the joined copies."""
    from hybridfp import GroupedLinear, factories
    splits, hidden = [0, 19, 45, 1, 33, 16], 32
    torch.manual_seed(1)
    m = GroupedLinear(len(splits), hidden, 48, bias=False, params_dtype=torch.float32)
    set_policy(grouped_triton_devices={"cpu"}, per_expert_fp8_triton_flops=0.0)
    before = PATH_COUNTS.copy()
    moe_step(m, splits, factories.current_scaling, torch.float32)
    assert (PATH_COUNTS - before) == {("fprop", "per_expert"): 1, ("dgrad", "per_expert"): 1,
                                      ("wgrad", GROUPED_FP8_TRITON): 1}
