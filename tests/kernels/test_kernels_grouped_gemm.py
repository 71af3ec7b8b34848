"""The Triton grouped GEMM with a per-expert FP32 epilogue (kernels/moe/triton_grouped_gemm.py) and
``grouped_gemm``'s path through it (moe/gemm_triton.py).

Exactness (numerics §1): equal to the per-expert exact GEMM up to the FP32 accumulation order, so
FP32 outputs are compared at FP32-accumulation level (relative error ≤ 1e-6 at these sizes)
and a 16-bit output must be its FP32 output rounded once (bitwise). CPU: the interpreter on
tiny shapes with empty and odd-sized experts; GPU (``-m gpu``): MoE shapes against an FP64
GEMM of the dequantized operands, outputs poisoned — passing them is what adds "cuda" to
the policy's ``grouped_triton_devices`` (empty: opt-in, see moe/gemm_triton.py).
"""

from __future__ import annotations

import pytest
import torch
from quantize_kernel_cases import gpu, interpreter_only, moe_step

import hybridfp
from hybridfp.gemm import gemm
from hybridfp.moe import grouped_gemm
from hybridfp.moe.gemm import GROUPED_TRITON, PATH_COUNTS, grouped_path
from hybridfp.gemm.gemm import LAYOUTS, operand_storage
from hybridfp.kernels.moe import triton_grouped_gemm as tg
from hybridfp.kernels._common import poisoned_outputs

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SPLITS = [0, 19, 45, 1, 33]
TINY = (16, 16, 16, 4, 1)
#: format name -> quantizer maker (the pairs this path exists for, and two without a factor)
MAKERS = {
    "nvfp4_1d": lambda: hybridfp.NVFP4Quantizer(),
    "nvfp4_rht": lambda: hybridfp.NVFP4Quantizer(with_rht=True),
    "nvfp4_2d": lambda: hybridfp.NVFP4Quantizer(with_2d_quantization=True),
    "fp8_e4m3": lambda: hybridfp.Float8CurrentScalingQuantizer(E4M3),
    "mxfp8": lambda: hybridfp.MXFP8Quantizer(E4M3),
    "identity": lambda: hybridfp.IdentityQuantizer(),
}
OPERANDS = {"TN": ("x", "w"), "NN": ("dy", "w"), "NT": ("dy", "x")}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert torch.isfinite(got).all()
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-300)).item()


def _experts(fmt: str, splits: list[int], k: int, n: int, device: str = "cpu", seed: int = 0):
    """Per-expert quantized x [m_e, k], w [n, k], dy [m_e, n], each expert at its own scale."""
    g = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, list[torch.Tensor]] = {"x": [], "w": [], "dy": []}
    for e, m in enumerate(splits):
        mag = 2.0 ** (e % 5 - 2)
        for name, shape, s in (("x", (m, k), mag), ("w", (n, k), 1 / mag), ("dy", (m, n), mag)):
            src = torch.randn(*shape, generator=g, device=device) * s
            # Identity keeps its input's dtype: BF16, so that its copies decode exactly into BF16
            out[name].append(MAKERS[fmt]()(src.bfloat16() if fmt == "identity" else src))
    return out


def _per_expert(a, b, layout, **kw):
    outs = [gemm(x, y, layout, **kw) for x, y in zip(a, b)]
    return outs if layout == "NT" else torch.cat(outs)


# ---------------------------------------------------------------------------- kernel, CPU
@interpreter_only
@pytest.mark.parametrize("scaled", [False, True])
def test_rows_kernel_fp32_and_one_rounding(scaled):
    torch.manual_seed(0)
    e, k, n = len(SPLITS), 40, 24
    a, b = torch.randn(sum(SPLITS), k).bfloat16(), torch.randn(e, n, k).bfloat16()
    sa = torch.rand(sum(SPLITS)) + 0.5 if scaled else None
    sb = torch.rand(e, n) + 0.5 if scaled else None
    bias = torch.randn(e, n) if scaled else None
    out32 = tg.grouped_rows(a, b, SPLITS, scale_a=sa, scale_b=sb, bias=bias, out_dtype=torch.float32, tile=TINY)
    ref, r = [], 0
    for i, m in enumerate(SPLITS):
        v = a[r:r + m].double() @ b[i].double().t()
        if scaled:
            v = v * (sa[r:r + m, None] * sb[i][None, :]).double() + bias[i].double()
        ref.append(v)
        r += m
    assert _rel(out32, torch.cat(ref)) < 1e-6
    for dt in (torch.bfloat16, torch.float16):
        got = tg.grouped_rows(a, b, SPLITS, scale_a=sa, scale_b=sb, bias=bias, out_dtype=dt, tile=TINY)
        assert torch.equal(got, out32.to(dt)), dt


@interpreter_only
def test_swizzle_covers_every_tile_once():
    """The L2 swizzle (``group_m``) only reorders programs: with outputs poisoned, every group
    size (1, one that leaves a short last group, more than the row tiles) gives the same bits in
    both arrangements (a tile run twice or never would show)."""
    torch.manual_seed(2)
    e, k, n = len(SPLITS), 40, 40  # 9 row tiles and 3 column tiles of TINY
    a, b = torch.randn(sum(SPLITS), k).bfloat16(), torch.randn(e, n, k).bfloat16()
    ar, br = torch.randn(n, sum(SPLITS)).bfloat16(), torch.randn(n + 8, sum(SPLITS)).bfloat16()
    with poisoned_outputs():
        rows = [tg.grouped_rows(a, b, SPLITS, tile=TINY, group_m=g) for g in (1, 2, 4, 16)]
        red = [tg.grouped_reduction(ar, br, SPLITS, tile=TINY, group_m=g) for g in (1, 2, 4, 16)]
    want = torch.cat([a[r - m:r].float() @ b[i].float().t()
                      for i, (m, r) in enumerate(zip(SPLITS, torch.tensor(SPLITS).cumsum(0).tolist()))])
    assert _rel(rows[0].float(), want) < 2 ** -8
    for got in rows[1:]:
        assert torch.equal(got.view(torch.int16), rows[0].view(torch.int16))
    for got in red[1:]:
        assert torch.equal(got.view(torch.int16), red[0].view(torch.int16))


@interpreter_only
def test_reduction_kernel_with_empty_experts():
    torch.manual_seed(1)
    e, m, n = len(SPLITS), 24, 20
    a, b = torch.randn(m, sum(SPLITS)).bfloat16(), torch.randn(n, sum(SPLITS)).bfloat16()
    sa, sb = torch.rand(e, m) + 0.5, torch.rand(e, n) + 0.5
    out = tg.grouped_reduction(a, b, SPLITS, scale_a=sa, scale_b=sb, out_dtype=torch.float32, tile=TINY)
    r = 0
    for i, k in enumerate(SPLITS):
        want = (a[:, r:r + k].double() @ b[:, r:r + k].double().t()) * (sa[i][:, None] * sb[i][None, :]).double()
        if k == 0:
            assert torch.equal(out[i], torch.zeros(m, n))
        else:
            assert _rel(out[i], want) < 1e-6
        r += k


def test_kernel_rejects_bad_shapes():
    a, b = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(2, 3, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="do not fit"):
        tg.grouped_rows(a, b, [1, 2])
    with pytest.raises(ValueError, match="scale_b"):
        tg.grouped_rows(a, b, [1, 3], scale_b=torch.ones(3))
    with pytest.raises(ValueError, match="BF16"):
        tg.grouped_reduction(a.float(), a.float(), [4, 4])
    # negative counts summing right would make the programs' expert lookup read and write
    # outside the operands (its tile prefix sums must not decrease)
    with pytest.raises(ValueError, match="none negative"):
        tg.grouped_rows(a, b, [-16, 20])
    with pytest.raises(ValueError, match="none negative"):
        tg.grouped_reduction(a, a, [-8, 16])


# ---------------------------------------------------------------------------- grouped_gemm, CPU
@interpreter_only
@pytest.mark.parametrize("layout", list(OPERANDS))
@pytest.mark.parametrize("fmt", list(MAKERS))
def test_grouped_triton_path_equals_per_expert(fmt, layout):
    """FP32 outputs: the per-expert exact GEMMs up to accumulation order; BF16: one rounding
    of the same FP32 values (so at most one BF16 ulp from the per-expert result)."""
    q = _experts(fmt, SPLITS, 48, 32)
    a, b = q[OPERANDS[layout][0]], q[OPERANDS[layout][1]]
    before = PATH_COUNTS.copy()
    got = grouped_gemm(a, b, layout, out_dtype=torch.float32, use_triton=True)
    # dgrad of an all-RHT quantizer pairs dy's plain rowwise copy with W's RHT columnwise copy:
    # a one-sided RHT (no exact BF16 product), which the path hands back to the per-expert loop
    path = "per_expert" if (fmt, layout) == ("nvfp4_rht", "NN") else GROUPED_TRITON
    if fmt == "fp8_e4m3":  # per-tensor FP8 pairs take the FP8 grouped kernel (test_kernels_grouped_fp8_gemm.py)
        path = "grouped_fp8_triton"
    assert (PATH_COUNTS - before) == {(("fprop", "dgrad", "wgrad")[list(OPERANDS).index(layout)], path): 1}
    want = _per_expert(a, b, layout, out_dtype=torch.float32)
    pairs = zip(got, want) if layout == "NT" else [(got, want)]
    for g, w in pairs:
        assert g.shape == w.shape and (w.numel() == 0 or _rel(g, w) < 1e-6)
    got16 = grouped_gemm(a, b, layout, use_triton=True)
    for g16, g32 in (zip(got16, got) if layout == "NT" else [(got16, got)]):
        assert torch.equal(g16, g32.to(torch.bfloat16))


@interpreter_only
def test_row_scaled_fprop_and_bias():
    """Row-scaled NVFP4 x (per-row global scales) with biases: the row scales and the bias
    land in the FP32 epilogue; FP16 output."""
    g = torch.Generator().manual_seed(3)
    q = hybridfp.NVFP4Quantizer(row_scaled_nvfp4=True)
    q.set_usage(rowwise=True, columnwise=False)  # forward-only format
    xs = [q(torch.randn(m, 32, generator=g) * (e + 1)) for e, m in enumerate(SPLITS)]
    ws = [hybridfp.NVFP4Quantizer()(torch.randn(24, 32, generator=g)) for _ in SPLITS]
    biases = [torch.randn(24, generator=g) for _ in SPLITS]
    got = grouped_gemm(xs, ws, "TN", out_dtype=torch.float32, biases=biases, use_triton=True)
    want = torch.cat([gemm(x, w, "TN", out_dtype=torch.float32, bias=b) for x, w, b in zip(xs, ws, biases)])
    assert _rel(got, want) < 1e-6
    mixed = [None] + biases[1:]
    sa = [operand_storage(x, "rowwise", "A") for x in xs]
    sb = [operand_storage(w, "rowwise", "B") for w in ws]
    assert grouped_path(sa, sb, "TN", torch.float32, True, use_triton=True)[0] == GROUPED_TRITON
    # a missing bias would need +0.0 added (turning -0.0 into +0.0): per expert instead
    before = PATH_COUNTS.copy()
    grouped_gemm(xs, ws, "TN", out_dtype=torch.float32, biases=mixed, use_triton=True)
    assert (PATH_COUNTS - before) == {("fprop", "per_expert"): 1}


def test_not_taken_by_default_anywhere_yet():
    """The policy's grouped_triton_devices is empty: the path is verified on an H200 but slower
    than per expert there."""
    q = _experts("nvfp4_1d", [3, 5], 32, 16)
    sa = [operand_storage(x, "rowwise", "A") for x in q["x"]]
    sb = [operand_storage(w, "rowwise", "B") for w in q["w"]]
    assert grouped_path(sa, sb, "TN", torch.bfloat16, False)[0] == "per_expert"


def test_default_on_cuda_from_many_experts():
    """The default: on CUDA from the policy's many_experts on, never on the CPU by count alone; a
    caller's use_triton wins either way."""
    from hybridfp.moe import gemm_triton as grouped_triton
    many = hybridfp.current_policy().many_experts
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert grouped_triton.enabled(cuda, None, many) == grouped_triton.HAVE_TRITON
    assert not grouped_triton.enabled(cuda, None, many - 1)
    assert not grouped_triton.enabled(cpu, None, 10 * many)
    assert not grouped_triton.enabled(cuda, False, 10 * many)
    assert grouped_triton.enabled(cpu, True, 1)


def test_default_on_cuda_only_below_the_policy_size_limit(set_policy):
    """With the experts' mean GEMM size given, the CUDA default also needs it below the
    policy's grouped_triton_max_flops; a listed device or a caller's use_triton ignores it."""
    from hybridfp.moe import gemm_triton as grouped_triton
    pol = hybridfp.current_policy()
    many, limit = pol.many_experts, pol.grouped_triton_max_flops
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    have = grouped_triton.HAVE_TRITON
    assert grouped_triton.enabled(cuda, None, many, 0.5 * limit) == have
    assert not grouped_triton.enabled(cuda, None, many, limit)
    assert not grouped_triton.enabled(cuda, None, many - 1, 0.5 * limit)
    assert grouped_triton.enabled(cuda, True, many, 10 * limit)
    set_policy(grouped_triton_devices={"cuda"})
    assert grouped_triton.enabled(cuda, None, 1, 10 * limit) == have
    assert not grouped_triton.enabled(cpu, None, many, 0.5 * limit)


# ---------------------------------------------------------------------------- GPU
GPU_CASES = [("nvfp4_1d", "TN"), ("nvfp4_2d", "NN"), ("nvfp4_rht", "NT"), ("mxfp8", "TN"), ("mxfp8", "NT")]


@gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt,layout", GPU_CASES, ids=["-".join(c) for c in GPU_CASES])
def test_gpu_grouped_triton_vs_fp64(fmt, layout, out_dtype):
    """8 experts (one empty, odd sizes), hidden 2048, ffn 1408: fresh random inputs, poisoned
    outputs, FP64 GEMM of the dequantized operands as the reference."""
    splits = [0, 517, 2048, 1, 1999, 640, 3000, 1024]
    q = _experts(fmt, splits, 2048, 1408, device="cuda", seed=int(torch.randint(0, 2**31, (1,))))
    a, b = q[OPERANDS[layout][0]], q[OPERANDS[layout][1]]
    with poisoned_outputs():
        got = grouped_gemm(a, b, layout, out_dtype=out_dtype, use_triton=True)
    da, db = LAYOUTS[layout]
    tol = 1e-5 if out_dtype == torch.float32 else 2 ** -8
    for i, (x, y) in enumerate(zip(a, b)):
        oa = operand_storage(x, da, "A").gemm_operand(da)
        ob = operand_storage(y, db, "B").gemm_operand(db)
        ref = oa.values.double() @ ob.values.double().t()
        for s, shape in ((oa.scale, (-1, 1)), (ob.scale, (1, -1))):
            if s is not None:
                ref = ref * s.double().reshape(shape)
        g = got[i] if layout == "NT" else got[sum(splits[:i]):sum(splits[:i + 1])]
        if ref.numel() and ref.norm() > 0:
            assert _rel(g, ref) < tol, (i, _rel(g, ref))


@interpreter_only
def test_kernel_alignment_promise_only_when_true(monkeypatch):
    """``KALIGN`` (the ``tl.multiple_of`` promise on every reduction bound, which the compiled
    kernel's vector loads rely on and the interpreter cannot check) is the largest of 8 / 4 /
    2 / 1 dividing every bound: K for fprop / dgrad, every expert's start for wgrad."""
    seen = []
    real = tg._grouped_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(kw["KALIGN"])
                experts = args[9]  # meta: E + 1 tile prefix sums, then (r0, r1, k0, k1) per expert
                meta = args[6].cpu()
                fields = meta[experts + 1:].reshape(experts, 4)
                with_programs = meta[1:experts + 1] > meta[:experts]
                assert bool((fields[with_programs, 2:] % kw["KALIGN"] == 0).all())  # the promise, where read
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(tg, "_grouped_kernel", Spy())
    a8, b8 = torch.randn(12, 40).bfloat16(), torch.randn(2, 8, 40).bfloat16()
    tg.grouped_rows(a8, b8, [5, 7], tile=TINY)
    tg.grouped_rows(a8[:, :36], b8[:, :, :36], [5, 7], tile=TINY)
    tg.grouped_rows(a8[:, :35], b8[:, :, :35], [5, 7], tile=TINY)
    tg.grouped_reduction(torch.randn(4, 48).bfloat16(), torch.randn(6, 48).bfloat16(), [16, 0, 32], tile=TINY)
    tg.grouped_reduction(torch.randn(4, 48).bfloat16(), torch.randn(6, 48).bfloat16(), [18, 30], tile=TINY)
    tg.grouped_reduction(torch.randn(4, 48).bfloat16(), torch.randn(6, 48).bfloat16(), [17, 31], tile=TINY)
    tg.grouped_reduction(torch.randn(4, 48).bfloat16(), torch.randn(6, 48).bfloat16(), [0, 17, 0, 31], tile=TINY)
    assert seen == [8, 4, 1, 8, 2, 1, 1]


def _composer2_operands(splits: list[int], k: int, n: int, device: str):
    """Composer-2's fprop operands as GroupedLinear makes them: x by ``quantize_grouped`` with
    the hybrid (row-scaled NVFP4 rows read at the padded groups' starts, MXFP8 columns derived),
    the weights stacked by ``quantize_weights_grouped`` (NVFP4 with a global amax per expert);
    and the same per expert, quantized one by one."""
    from hybridfp.moe.quantize import quantize_grouped
    from hybridfp.moe.quantize_weights import quantize_weights_grouped
    rd = "rowwise_dequantized"
    xq = [hybridfp.HybridQuantizer(hybridfp.NVFP4Quantizer(row_scaled_nvfp4=True), hybridfp.MXFP8Quantizer(), rd)
          for _ in splits]
    wq = [hybridfp.HybridQuantizer(hybridfp.NVFP4Quantizer(), hybridfp.MXFP8Quantizer(), rd) for _ in splits]
    g = torch.Generator(device=device).manual_seed(5)
    x = torch.randn(sum(splits), k, generator=g, device=device).bfloat16()
    buf = torch.stack([torch.randn(n, k, generator=g, device=device) * 2.0 ** (e % 5 - 2)
                       for e in range(len(splits))]).bfloat16()  # packed, as GroupedLinear keeps them
    ws = list(buf)
    X, W = quantize_grouped(xq, x, splits), quantize_weights_grouped(wq, ws)
    each_x = [q.quantize(xe) for q, xe in zip(xq, torch.split(x, splits))]
    each_w = [q.quantize(w) for q, w in zip(wq, ws)]
    return X, W, each_x, each_w


def _check_fprop_decodes_once(device: str, monkeypatch) -> None:
    from hybridfp.gemm import bf16_decode
    from hybridfp.moe import gemm_triton as grouped_triton
    splits, k, n = ([0, 19, 45, 1, 33], 64, 48) if device == "cpu" else ([0, 517, 33, 1024, 1, 250, 96, 700], 4096, 1408)
    X, W, each_x, each_w = _composer2_operands(splits, k, n, device)
    decodes = []
    real = grouped_triton.decode_bf16
    monkeypatch.setattr(grouped_triton, "decode_bf16", lambda s, d, **kw: decodes.append(s.rows) or real(s, d, **kw))
    real_joined = grouped_triton.decode_bf16_joined
    monkeypatch.setattr(grouped_triton, "decode_bf16_joined",
                        lambda s, parts, d, **kw: decodes.append(s.rows) or real_joined(s, parts, d, **kw))
    bf16_decode.clear_decode_cache()
    got = grouped_gemm(X, W, "TN", use_triton=True)
    assert len(decodes) == 2, decodes  # x's span and the weights, once each
    decodes.clear()
    bf16_decode.clear_decode_cache()
    want = grouped_gemm(each_x, each_w, "TN", use_triton=True)
    assert len(decodes) == 2 * len(splits)  # every expert's x and weight on their own
    assert torch.equal(got, want)


@interpreter_only
def test_grouped_fprop_decodes_shared_encodings_once(monkeypatch):
    """Composer-2's grouped fprop on the Triton path decodes x's rows (a padded encode read at
    the groups' starts: ``padded_row_span``) and the stacked weights (per-expert global scales:
    their row-scaled joined copy) in one call each, not per expert, and equals bitwise the same path on
    the per-expert quantizations (the same values and scales reach the same kernel)."""
    _check_fprop_decodes_once("cpu", monkeypatch)


@gpu
def test_grouped_fprop_decodes_shared_encodings_once_gpu(monkeypatch):
    """The same at the MoE benchmark's expert shape on the GPU."""
    _check_fprop_decodes_once("cuda", monkeypatch)


# ---------------------------------------------------------------------------- joined copies, CPU
@interpreter_only
@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # empty experts' amax 0
@pytest.mark.parametrize("limit, fprop", [(2.1e5, "grouped_triton"), (2.0e5, "per_expert")])
def test_size_limit_decides_fprop_alike_on_joined_copies_and_expert_lists(limit, fprop, monkeypatch, set_policy):
    """The CUDA default's size limit (``grouped_triton_max_flops``), evaluated here on the CPU:
    Composer-2's fprop (an epilogue factor) has experts of 2 x 24.5 x 64 x 64 = 200704 FLOPs on
    average (the mean over the non-empty experts), so a limit just above takes the Triton
    grouped GEMM and one just below the per-expert loop, on the joined copies and on the
    experts' lists alike; dgrad / wgrad (path 1) are not affected."""
    from hybridfp import GroupedLinear, factories
    from hybridfp.moe import gemm as grouped, gemm_triton
    from hybridfp.quantizers import fast as qfast
    monkeypatch.setattr(qfast, "device_ok", lambda *a: True)  # the kernel routes, interpreted
    monkeypatch.setattr(grouped, "_grouped_mm_device", lambda device: True)  # path 1 on the CPU
    cuda_rule = gemm_triton.enabled
    monkeypatch.setattr(gemm_triton, "enabled", lambda device, use_triton, experts=1, flops=None:
                        cuda_rule(torch.device("cuda"), use_triton, experts, flops))
    set_policy(many_experts=1, grouped_triton_max_flops=limit)
    splits, hidden, out = [0, 19, 45, 1, 33], 64, 64
    for lane in ("joined copies", "expert lists"):
        torch.manual_seed(1)
        m = GroupedLinear(len(splits), hidden, out, bias=False, params_dtype=torch.bfloat16)
        with monkeypatch.context() as mp:
            if lane == "expert lists":
                mp.setattr(grouped, "_run_joined", lambda *a: None)
            before = PATH_COUNTS.copy()
            moe_step(m, splits, factories.nvfp4_row_scaled_fwd_mxfp8_bwd)
            assert (PATH_COUNTS - before) == {("fprop", fprop): 1, ("dgrad", "grouped_bf16"): 1,
                                              ("wgrad", "grouped_bf16"): 1}, lane


@interpreter_only
@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # empty experts' amax 0
def test_composer2_step_on_joined_copies(monkeypatch, set_policy):
    """Composer-2 (row-scaled NVFP4 x, NVFP4 weights with each expert's global amax, MXFP8
    backward): x and the stacked weights come as joined copies (the weights' rows one row-scaled
    NVFP4 storage: ``moe.assemble.scaled_hybrid_group``), so fprop runs the Triton
    grouped GEMM on them (``grouped_triton.run_joined``) and dgrad / wgrad the grouped BF16 path,
    no per-expert tensor built; bitwise the step whose GEMMs take the per-expert lists (the
    same kernels on the same decoded operands)."""
    import copy

    from hybridfp import GroupedLinear, factories
    from hybridfp.moe import gemm as grouped
    from hybridfp.quantizers import fast as qfast
    from hybridfp.moe import assemble as qgrouped
    monkeypatch.setattr(qfast, "device_ok", lambda *a: True)  # the kernel routes, interpreted
    monkeypatch.setattr(grouped, "_grouped_mm_device", lambda device: True)  # path 1 on the CPU
    set_policy(grouped_triton_devices={"cpu"})
    built: list[str] = []
    for name in ("_cut_hybrids", "_cut_scaled_hybrids", "_cut_experts"):
        real = getattr(qgrouped, name)
        monkeypatch.setattr(qgrouped, name, lambda *a, _n=name, _r=real: built.append(_n) or _r(*a))
    from hybridfp.moe import quantize_scaled as grouped_scaled
    real_rows = grouped_scaled.expert_nvfp4_rows  # the per-expert NVFP4 rows: built only on access
    monkeypatch.setattr(grouped_scaled, "expert_nvfp4_rows", lambda *a: built.append("rows") or real_rows(*a))
    splits, hidden, out = [0, 19, 45, 1, 33], 64, 64

    def step(m):
        return moe_step(m, splits, factories.nvfp4_row_scaled_fwd_mxfp8_bwd)

    torch.manual_seed(1)
    m = GroupedLinear(len(splits), hidden, out, bias=False, params_dtype=torch.bfloat16)
    fresh = copy.deepcopy(m)
    before = PATH_COUNTS.copy()
    got = step(m)
    assert (PATH_COUNTS - before) == {("fprop", "grouped_triton"): 1, ("dgrad", "grouped_bf16"): 1,
                                      ("wgrad", "grouped_bf16"): 1}
    assert built == [], built
    with monkeypatch.context() as mp:
        mp.setattr(grouped, "_run_joined", lambda *a: None)  # the per-expert-list code
        before = PATH_COUNTS.copy()
        want = step(fresh)
        assert (PATH_COUNTS - before) == {("fprop", "grouped_triton"): 1, ("dgrad", "grouped_bf16"): 1,
                                          ("wgrad", "grouped_bf16"): 1}
    assert built, "the reference step builds the per-expert tensors"
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), i
