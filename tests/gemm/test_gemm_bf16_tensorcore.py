"""The BF16 tensor-core backend (``hybridfp.gemm.bf16_tensorcore``): exact GEMMs of pairs whose
copies block-decode exactly into BF16 (numerics §1), its pair table, its routing of the cases a
format key cannot show to the exact emulation (reported once), the epilogue (global /
per-row scales, bias, accumulate_into, output dtypes) and the weight-decode cache.

CPU: ``run`` itself (reference decode + the CPU form of ``bf16_gemm``: an IEEE FP32 matmul of
the BF16 values), every pair x layout of tests/gemm/gemm_operands.py. GPU (``-m gpu``):
through ``hybridfp.gemm.gemm`` on CUDA (Triton decode + cuBLAS BF16 + Triton epilogue) against
an FP64 GEMM of the dequantized operands.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import hybridfp
from gemm_operands import (FORMATS, LAYOUT_OPERANDS, REL_TOL, fresh_reports, gpu, has_copy,  # noqa: F401
                           operand, reference, rel_err)

from hybridfp import Float8BlockQuantizer, IdentityQuantizer, MXFP8Quantizer
from hybridfp.gemm import BACKENDS, EmulatedGemmWarning, bf16_decode, bf16_tensorcore, emulate, fast, gemm, select
from hybridfp.gemm.bf16_tensorcore import bf16_gemm, pair_supported, run
from hybridfp.gemm.gemm import LAYOUTS, operand_storage
from hybridfp import policy
from hybridfp.tensors import COLUMNWISE, ROWWISE

#: gemm_operands' formats but two that hold the same storages as others ("fp8_delayed": FP8
#: per-tensor E4M3 like "fp8_e4m3"; "plain": FP32 values like "identity_fp32"), for CPU time.
NAMES = [n for n in FORMATS if n not in ("fp8_delayed", "plain")]
#: format names whose copies decode exactly into BF16 (all but FP32 values)
BF16_EXACT = {n for n in NAMES if n != "identity_fp32"}


def _storages(layout: str, a: torch.Tensor, b: torch.Tensor):
    da, db = LAYOUTS[layout]
    return operand_storage(a, da, "A"), operand_storage(b, db, "B")


def _emulated(layout: str, sa, sb, **kw) -> torch.Tensor:
    da, db = LAYOUTS[layout]
    return emulate(sa.gemm_operand(da), sb.gemm_operand(db), kw.pop("out_dtype", torch.float32), **kw)


CASES = [(layout, fa, fb) for layout, (_, da, _, db) in LAYOUT_OPERANDS.items()
         for fa in NAMES for fb in NAMES if has_copy(fa, da) and has_copy(fb, db)]


@pytest.mark.parametrize("layout, fmt_a, fmt_b", CASES, ids=["-".join(c) for c in CASES])
def test_pair_runs_exactly_or_is_left_to_emulation(layout, fmt_a, fmt_b):
    """A pair the backend claims gives emulate's result (itself checked against an FP64 GEMM
    in test_gemm_pairs.py): both multiply the same exact values with FP32 accumulation and
    may differ only in the order of the K <= 56 FP32 additions, whose worst-case relative
    error (~K * 2**-24 = 3.3e-6 of sum |a||b|, see gemm_operands.py) stays under
    REL_TOL = 1e-5. Pairs it does not claim are exactly the one-sided RHT ones (those go to
    bf16_split_rht, see test_gemm_split_rht.py)."""
    wa, da, wb, db = LAYOUT_OPERANDS[layout]
    a, b = operand(fmt_a, wa), operand(fmt_b, wb)
    sa, sb = _storages(layout, a, b)
    claimed = pair_supported(sa.format_key(da), sb.format_key(db))
    one_sided_rht = (fmt_a == "nvfp4_rht" and da == COLUMNWISE) != (fmt_b == "nvfp4_rht" and db == COLUMNWISE)
    assert claimed == (not one_sided_rht)
    if not claimed:
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run(sa, sb, layout, out_dtype=torch.float32)
    emulated = [w for w in caught if issubclass(w.category, EmulatedGemmWarning)]
    # Only FP32 values (Identity in FP32, plain FP32 tensors) leave the BF16 path.
    assert bool(emulated) == (fmt_a not in BF16_EXACT or fmt_b not in BF16_EXACT)
    assert out.dtype == torch.float32
    assert rel_err(out, _emulated(layout, sa, sb).double()) < REL_TOL


def test_non_pow2_block_scales_and_unknown_formats_are_not_claimed():
    x = torch.randn(8, 256)
    q = Float8BlockQuantizer(block_scaling_dim=1, force_pow_2_scales=False)(x).qstorage
    mx = MXFP8Quantizer()(x).qstorage
    assert not pair_supported(q.format_key(ROWWISE), mx.format_key(ROWWISE))
    assert pair_supported(mx.format_key(ROWWISE), mx.format_key(ROWWISE))
    assert not pair_supported(("Other", ()), mx.format_key(ROWWISE))
    assert not pair_supported("garbage", mx.format_key(ROWWISE))


def test_cublas_fp8_backends_keep_their_pairs(monkeypatch):
    """With every backend allowed on the device, FP8 per-tensor and FP8 block pairs go to
    cuBLAS FP8 (registered later: precedence), the rest of the family to bf16_tensorcore."""
    monkeypatch.setattr(fast, "_device_ok", lambda device, kind: True)
    monkeypatch.setattr(bf16_tensorcore, "_device_ok", lambda device: True)
    assert {b.name for b in BACKENDS} >= {"bf16_tensorcore", "cublas_fp8_tensorwise", "cublas_fp8_block"}
    cuda = torch.device("cuda")

    def chosen(fa, wa, da, fb, wb, db, layout="TN"):
        sa = operand_storage(operand(fa, wa), da, "A")
        sb = operand_storage(operand(fb, wb), db, "B")
        b = select(sa.format_key(da), sb.format_key(db), layout, cuda)
        return None if b is None else b.name

    assert chosen("fp8_e4m3", "x", ROWWISE, "fp8_e4m3", "w", ROWWISE) == "cublas_fp8_tensorwise"
    assert chosen("fp8_block_1d", "x", ROWWISE, "fp8_block_2d", "w", ROWWISE) == "cublas_fp8_block"
    # cuBLAS has no E5M2 x E5M2 kernel: the exact BF16 path takes it.
    assert chosen("fp8_e5m2", "x", ROWWISE, "fp8_e5m2", "w", ROWWISE) == "bf16_tensorcore"
    assert chosen("mxfp8_1d", "x", ROWWISE, "nvfp4_2d", "w", ROWWISE) == "bf16_tensorcore"
    assert chosen("identity_bf16", "x", ROWWISE, "identity_fp32", "w", ROWWISE) == "bf16_tensorcore"
    assert chosen("nvfp4_rht", "dy", COLUMNWISE, "nvfp4_rht", "x", COLUMNWISE, "NT") == "bf16_tensorcore"
    # one-sided RHT: the split backend registered next to this one (test_gemm_split_rht.py)
    assert chosen("nvfp4_rht", "dy", COLUMNWISE, "mxfp8_1d", "x", COLUMNWISE, "NT") == "bf16_split_rht"


def test_fp32_values_run_emulated_and_are_reported_once_per_reason():
    a, b = operand("identity_fp32", "x"), operand("mxfp8_1d", "w")
    sa, sb = _storages("TN", a, b)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out1 = run(sa, sb, "TN", out_dtype=torch.float32)
        out2 = run(sa, sb, "TN", out_dtype=torch.float32)
        run(sb, sa, "TN", out_dtype=torch.float32)  # the other side: another reason
    msgs = [str(w.message) for w in caught if issubclass(w.category, EmulatedGemmWarning)]
    assert len(msgs) == 2
    assert msgs[0].startswith("hybridfp: fprop (Identity x MXFP8") and "A: float32 values" in msgs[0]
    assert "B: float32 values" in msgs[1]
    assert torch.equal(out1, _emulated("TN", sa, sb)) and torch.equal(out1, out2)


@pytest.mark.parametrize("fmt_a, fmt_b", [("nvfp4_row_scaled", "mxfp8_1d"), ("mxfp8_1d", "nvfp4_row_scaled"),
                                          ("nvfp4_1d", "nvfp4_2d"), ("fp8_e4m3", "mxfp8_2d")])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_epilogue_scales_bias_and_accumulate(fmt_a, fmt_b, out_dtype):
    """Per-row (row-scaled NVFP4 as A: output rows; as B: output columns) and per-tensor
    scales, a BF16 bias, an output dtype and accumulate_into, as emulate computes them (bound
    as in the pair test; the output cast adds one rounding on each side, compared in FP32 at
    twice the output dtype's unit roundoff)."""
    a, b = operand(fmt_a, "x"), operand(fmt_b, "x" if fmt_b == "nvfp4_row_scaled" else "w")
    sa, sb = _storages("TN", a, b)
    n = sb.rows
    bias = torch.randn(n).to(torch.bfloat16)
    out = run(sa, sb, "TN", out_dtype=out_dtype, bias=bias)
    want = _emulated("TN", sa, sb, out_dtype=torch.float32, bias=bias)
    tol = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: REL_TOL}[out_dtype]
    assert out.dtype == out_dtype and rel_err(out, want.double()) < tol
    into = torch.randn(sa.rows, n)
    start = into.clone()
    got = run(sa, sb, "TN", accumulate_into=into)
    assert got is into
    assert rel_err(into - start, _emulated("TN", sa, sb).double()) < REL_TOL


def test_bf16_gemm_refuses_mismatched_operands():
    a = bf16_decode.decode_bf16(operand_storage(operand("mxfp8_1d", "x"), ROWWISE, "A"), ROWWISE)
    b = bf16_decode.decode_bf16(operand_storage(operand("nvfp4_rht", "x"), COLUMNWISE, "B"), COLUMNWISE)
    with pytest.raises(ValueError, match="reduction"):
        bf16_gemm(a, b)


def test_weight_operand_decode_is_cached_for_fprop_and_dgrad():
    x, w = MXFP8Quantizer()(torch.randn(16, 64)), MXFP8Quantizer()(torch.randn(32, 64))
    bf16_decode.clear_decode_cache()
    sx, sw = _storages("TN", x, w)
    run(sx, sw, "TN")
    cached = set(map(id, bf16_decode._CACHE.keys()))
    assert cached == {id(sw.payload(ROWWISE)["data"])}  # B (the weight) only
    with hybridfp.policy(cache_weight_decodes=False):
        bf16_decode.clear_decode_cache()
        run(sx, sw, "TN")
        assert len(bf16_decode._CACHE) == 0


# ---------------------------------------------------------------------------- GPU
GPU_M, GPU_N, GPU_K = 1000, 520, 1000  # K not a multiple of 128 (nor of 32 after NVFP4 RHT padding)
GPU_PAIRS = [  # layout, A format, B format
    ("TN", "mxfp8_1d", "mxfp8_2d"),
    ("TN", "nvfp4_1d", "nvfp4_2d"),
    ("NT", "nvfp4_rht", "nvfp4_rht"),
    ("TN", "nvfp4_row_scaled", "mxfp8_1d"),
    ("NN", "nvfp4_1d", "mxfp8_1d"),
    ("NT", "mxfp8_1d", "nvfp4_1d"),
    ("TN", "fp8_e4m3", "mxfp8_1d"),
    ("NN", "fp8_block_1d", "nvfp4_1d"),
    ("NN", "fp8_e5m2", "fp8_e5m2"),
    ("TN", "identity_bf16", "mxfp8_2d"),
    ("TN", "identity_bf16", "identity_bf16"),
]


def _gpu_operands(layout: str, fa: str, fb: str):
    """Fresh random operands (never zeros, magnitude spread per row), quantized on the GPU by
    the PyTorch reference (the CUDA quantize kernels are tested elsewhere), whose
    ``layout`` copies are [m, k] and [n, k]."""
    g = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    shapes = {"x": (GPU_M, GPU_K), "w": (GPU_N, GPU_K), "dy": (GPU_M, GPU_N)}
    wa, _, wb, _ = LAYOUT_OPERANDS[layout]
    out = []
    for fmt, which in ((fa, wa), (fb, wb)):
        r, c = shapes[which]
        t = torch.randn(r, c, generator=g, device="cuda")
        t *= torch.exp2(torch.randint(-3, 4, (r, 1), generator=g, device="cuda").float())
        t = t.to(torch.bfloat16).float()
        make = FORMATS[fmt]
        q = make(t)
        if fmt == "nvfp4_row_scaled":
            q.set_usage(rowwise=True, columnwise=False)
        with policy(quantize_kernels=False):  # the reference, run by PyTorch on the GPU
            out.append(q(t))
    return out


@gpu
@pytest.mark.parametrize("layout, fmt_a, fmt_b", GPU_PAIRS, ids=["-".join(p) for p in GPU_PAIRS])
def test_gpu_gemm_selects_backend_and_is_exact(layout, fmt_a, fmt_b):
    """cuBLAS BF16 accumulates the exact BF16 products in FP32 over K = 1000 terms (plus, for
    scaled formats, two FP32 epilogue roundings): worst case ~K * 2**-24 = 6e-5 of sum |a||b|,
    typical (random signs) ~sqrt(K) * 2**-24 = 2e-6; 1e-5 on the norm sits between, orders of
    magnitude below any format's quantization error. A BF16 output adds one rounding (2**-9)."""
    a, b = _gpu_operands(layout, fmt_a, fmt_b)
    da, db = LAYOUTS[layout]
    sa, sb = _storages(layout, a, b)
    backend = select(sa.format_key(da), sb.format_key(db), layout, sa.device)
    assert backend is not None
    want_name = "cublas_fp8_tensorwise" if fmt_a == fmt_b == "fp8_e4m3" else "bf16_tensorcore"
    assert backend.name == want_name
    ref = reference(a, da, b, db)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EmulatedGemmWarning)
        out = gemm(a, b, layout, out_dtype=torch.float32)
        out16 = gemm(a, b, layout)
    assert rel_err(out, ref) < 1e-5
    assert out16.dtype == torch.bfloat16 and rel_err(out16, ref) < 2.0**-8
    bias = torch.randn(out.shape[1], device="cuda")
    into = torch.randn(*out.shape, device="cuda")
    start = into.clone()
    gemm(a, b, layout, accumulate_into=into, bias=bias)
    assert rel_err(into - start - bias, ref) < 1e-5
    # writes_out: the backend writes into rows of a larger buffer (the grouped per-expert path's
    # joined output) and returns them, bit for bit the fresh result; the rows around stay poisoned
    for dtype, fresh in ((torch.bfloat16, out16), (torch.float32, out)):
        buf = torch.full((out.shape[0] + 32, out.shape[1]), float("nan"), dtype=dtype, device="cuda")
        dst = buf[16:16 + out.shape[0]]
        assert backend.run(sa, sb, layout, out_dtype=dtype, out=dst) is dst
        # gemm() runs two Identity copies held in the output dtype as torch's own op, not this
        # backend: compare the backend with its own fresh result
        assert torch.equal(dst, backend.run(sa, sb, layout, out_dtype=dtype))
        assert bool(buf[:16].isnan().all()) and bool(buf[16 + out.shape[0]:].isnan().all())
        # a row stride != n: the epilogue writes it, or cuBLAS's fresh result is copied by gemm()
        wide = torch.full((out.shape[0], out.shape[1] + 8), float("nan"), dtype=dtype, device="cuda")
        assert gemm(a, b, layout, out_dtype=dtype, out=wide[:, :out.shape[1]]) is not None
        assert torch.equal(wide[:, :out.shape[1]], fresh) and bool(wide[:, out.shape[1]:].isnan().all())


@gpu
def test_gpu_fp32_values_route_to_emulation():
    x = IdentityQuantizer()(torch.randn(64, 96, device="cuda"))
    w = MXFP8Quantizer()(torch.randn(32, 96)).to("cuda")
    with pytest.warns(EmulatedGemmWarning, match="float32 values"):
        out = gemm(x, w, "TN", out_dtype=torch.float32)
    sx, sw = _storages("TN", x, w)
    assert torch.equal(out, _emulated("TN", sx, sw))


@gpu
def test_gpu_weight_decode_cache_hits():
    x, w = _gpu_operands("TN", "mxfp8_1d", "nvfp4_2d")
    bf16_decode.clear_decode_cache()
    first = gemm(x, w, "TN")
    assert len(bf16_decode._CACHE) == 1
    (entry,) = bf16_decode._CACHE.values()
    values = entry[ROWWISE][1].values
    assert torch.equal(gemm(x, w, "TN"), first)
    (entry,) = bf16_decode._CACHE.values()
    assert entry[ROWWISE][1].values is values
