"""The one-sided RHT backend (``bf16_split_rht``: ``gemm/split_bf16.py`` + ``bf16_tensorcore.run_split``):
an NVFP4 copy with the RHT on its reduction dim against a copy without, computed as up to
three BF16 GEMMs of the RHT side's inverse-transformed FP32 values split into hi + mid + lo.

CPU: ``run_split`` itself (reference BF16 decode + ``bf16_mm_fp32``'s IEEE FP32 matmul of the
BF16 parts: the same code path as CUDA but for the GEMM call) for MXFP8, FP8 per-tensor, BF16
Identity and NVFP4 (no RHT) against NVFP4-RHT, in NN (RHT on B: a weight's columnwise copy)
and NT (wgrad; RHT on either side), awkward shapes, bias, accumulate_into, BF16 / FP32 out;
the split asserted exact; registry wiring; the emulation fallback for values the split cannot
hold. GPU (``-m gpu``): through ``gemm`` at 4096^3 and a Llama-3-8B-like wgrad shape.

Tolerance (REL_TOL = 1e-5 on ||out - ref|| / ||ref||, ref: FP64 GEMM of the FP64-dequantized
operands, the RHT undone in FP64 with R built from numerics §2.5): every product of two BF16 values
is exact in FP32, so the only errors are the FP32 additions — k <= 256 per part GEMM, at most
two more to combine the parts, two epilogue roundings (global scales): worst case ~(k + 4) u
of Σ|a||b| with u = 2**-24 (1.6e-5 at k = 256), typical (random signs) ~sqrt(k) u ~ 1e-6.
For these random-sign operands 1e-5 on the norm sits well above the typical error and 1-2
orders below any format's quantization error (a wrong copy, a dropped scale, a skipped
inverse transform or a lost split part would show far above it). A BF16 output adds one
rounding (2**-9 relative per element): 2**-8.
"""

from __future__ import annotations

import os
import warnings
from typing import Callable

import pytest
import torch

import hybridfp
from gemm_operands import REL_TOL, fresh_reports, gpu, ref_operand, rel_err  # noqa: F401 (autouse fixture)

from hybridfp import (Float8CurrentScalingQuantizer, IdentityQuantizer, MXFP8Quantizer, NVFP4Quantizer,
                      Quantizer)
from hybridfp.gemm import BACKENDS, EmulatedGemmWarning, bf16_tensorcore, emulate, gemm, report_emulated, select
from hybridfp.gemm import split_bf16
from hybridfp.gemm.backends import _to_original_domain
from hybridfp.gemm.bf16_decode import decode_bf16
from hybridfp.gemm.bf16_tensorcore import pair_supported, run_split, split_pair_supported
from hybridfp.gemm.gemm import LAYOUTS, operand_storage
from hybridfp.tensors import COLUMNWISE, ROWWISE

Maker = Callable[[], Quantizer]
#: the non-RHT side: name -> quantizer
PLAIN: dict[str, Maker] = {
    "mxfp8": MXFP8Quantizer,
    "fp8_e4m3": lambda: Float8CurrentScalingQuantizer(torch.float8_e4m3fn),
    "identity_bf16": lambda: IdentityQuantizer(torch.bfloat16),
    "nvfp4_1d": NVFP4Quantizer,
}
RHT = "nvfp4_rht"
MAKERS: dict[str, Maker] = {**PLAIN, RHT: lambda: NVFP4Quantizer(with_rht=True)}
#: (layout, A format, B format): an RHT copy is always a columnwise one (numerics §2.5), so the
#: pair occurs in NN (B = a weight's columnwise copy) and NT (wgrad, either side); never TN.
PAIRS = ([("NN", p, RHT) for p in PLAIN] + [("NT", p, RHT) for p in PLAIN] + [("NT", RHT, p) for p in PLAIN])
#: (m, n, k): k not a multiple of 16 nor 128 (the RHT copy pads k to 16), m or n = 1
SHAPES = [(33, 20, 70), (1, 24, 200), (17, 1, 130), (48, 40, 256)]


def _source(rows: int, cols: int, g: torch.Generator, device: str) -> torch.Tensor:
    """Random FP32 with row and column magnitudes spread over 2**-3 .. 2**3 (so block scales
    differ and a misplaced scale shows)."""
    rs = torch.exp2(torch.randint(-3, 4, (rows, 1), generator=g, device=device).float())
    cs = torch.exp2(torch.randint(-3, 4, (1, cols), generator=g, device=device).float())
    return torch.randn(rows, cols, generator=g, device=device) * rs * cs


def operands(layout: str, fa: str, fb: str, m: int, n: int, k: int, *, seed: int, device: str = "cpu"):
    """Quantized A, B whose ``layout`` copies are [m, k] and [n, k] (only those copies made)."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for fmt, d, r in ((fa, LAYOUTS[layout][0], m), (fb, LAYOUTS[layout][1], n)):
        q = MAKERS[fmt]()
        q.set_usage(rowwise=d == ROWWISE, columnwise=d == COLUMNWISE)
        out.append(q(_source(r, k, g, device) if d == ROWWISE else _source(k, r, g, device)))
    return out


def _storages(layout: str, a: torch.Tensor, b: torch.Tensor):
    da, db = LAYOUTS[layout]
    return operand_storage(a, da, "A"), operand_storage(b, db, "B")


def _reference(layout: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """FP64 GEMM of the FP64-dequantized copies, the RHT side inverse-transformed in FP64."""
    da, db = LAYOUTS[layout]
    return ref_operand(a, da) @ ref_operand(b, db).t()


def _emulated(layout: str, sa, sb, **kw) -> torch.Tensor:
    da, db = LAYOUTS[layout]
    return emulate(sa.gemm_operand(da), sb.gemm_operand(db), kw.pop("out_dtype", torch.float32), **kw)


def _rht_side(layout: str, sa, sb):
    """(storage, direction) of the RHT copy."""
    da, db = LAYOUTS[layout]
    return (sa, da) if sa.gemm_operand(da).rht else (sb, db)


CASES = [(layout, fa, fb, shape) for layout, fa, fb in PAIRS for shape in SHAPES]
ERRORS: dict[str, float] = {}  # case -> relative error, kept for the record (printed with -s)


@pytest.mark.parametrize("layout, fmt_a, fmt_b, shape", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{'x'.join(map(str, c[3]))}" for c in CASES])
def test_split_gemm_is_exact_up_to_fp32_accumulation(layout, fmt_a, fmt_b, shape):
    m, n, k = shape
    a, b = operands(layout, fmt_a, fmt_b, m, n, k, seed=m * 7919 + n * 31 + k)
    sa, sb = _storages(layout, a, b)
    da, db = LAYOUTS[layout]
    assert split_pair_supported(sa.format_key(da), sb.format_key(db))
    assert not pair_supported(sa.format_key(da), sb.format_key(db))

    # The split values are emulate's (bitwise), and the split is exact; lo is all zero for an
    # NVFP4-RHT copy (<= 12 significant bits after the inverse transform; split_bf16's doc).
    s, d = _rht_side(layout, sa, sb)
    v = split_bf16.original_domain_values(decode_bf16(s, d))
    assert torch.equal(v, _to_original_domain(s.gemm_operand(d)))
    hi, mid, lo = split_bf16.split3(v)
    assert torch.equal(hi.float() + mid.float() + lo.float(), v)
    assert not lo.any()

    ref = _reference(layout, a, b)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EmulatedGemmWarning)  # no fallback taken
        out = run_split(sa, sb, layout, out_dtype=torch.float32)
        out16 = run_split(sa, sb, layout, out_dtype=torch.bfloat16)
    assert out.dtype == torch.float32 and tuple(out.shape) == (m, n)
    err = rel_err(out, ref)
    ERRORS[f"{layout} {fmt_a} x {fmt_b} {shape}"] = err
    print(f"rel err {layout} {fmt_a} x {fmt_b} {shape}: {err:.2e}")
    assert err < REL_TOL
    assert rel_err(out, _emulated(layout, sa, sb).double()) < REL_TOL
    assert out16.dtype == torch.bfloat16 and rel_err(out16, ref) < 2.0**-8


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout, fmt_a, fmt_b", [("NT", "mxfp8", RHT), ("NT", RHT, "fp8_e4m3"),
                                                  ("NN", "nvfp4_1d", RHT)])
def test_bias_and_accumulate_into(layout, fmt_a, fmt_b, out_dtype):
    """Global scales (FP8 scale_inv, NVFP4 S_dec), a BF16 bias and accumulate_into go through
    emulate's epilogue (bounds as in the module doc; the FP32 accumulate_into subtraction of
    its start value adds one rounding of |start| ~ |ref| per element)."""
    m, n, k = 24, 40, 90
    a, b = operands(layout, fmt_a, fmt_b, m, n, k, seed=5)
    sa, sb = _storages(layout, a, b)
    ref = _reference(layout, a, b)
    bias = torch.randn(n).to(torch.bfloat16)
    out = run_split(sa, sb, layout, out_dtype=out_dtype, bias=bias)
    tol = REL_TOL if out_dtype == torch.float32 else 2.0**-8
    assert out.dtype == out_dtype and rel_err(out, ref + bias.double()) < tol
    into = torch.randn(m, n) * ref.abs().mean().float()
    start = into.clone()
    got = run_split(sa, sb, layout, accumulate_into=into, bias=bias)
    assert got is into
    assert rel_err(into - start - bias.float(), ref) < REL_TOL


def test_registry_selects_the_split_backend_on_cuda(monkeypatch):
    """With CUDA allowed, a one-sided RHT pair goes to bf16_split_rht (not the emulated-pair
    report), both-or-neither RHT pairs stay on bf16_tensorcore; on the CPU it is emulated."""
    monkeypatch.setattr(bf16_tensorcore, "_device_ok", lambda device: True)
    assert "bf16_split_rht" in {b.name for b in BACKENDS}
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    dy, x = operands("NT", "mxfp8", RHT, 8, 16, 32, seed=1)
    key_a, key_b = (operand_storage(t, COLUMNWISE, w).format_key(COLUMNWISE) for t, w in ((dy, "A"), (x, "B")))
    assert select(key_a, key_b, "NT", cuda).name == "bf16_split_rht"
    assert select(key_b, key_a, "NT", cuda).name == "bf16_split_rht"
    assert select(key_b, key_b, "NT", cuda).name == "bf16_tensorcore"
    with warnings.catch_warnings():
        warnings.simplefilter("error", EmulatedGemmWarning)
        assert report_emulated("wgrad", "test", key_a, key_b, "NT", cuda) is False
    monkeypatch.setattr(bf16_tensorcore, "_device_ok", lambda device: False)
    assert select(key_a, key_b, "NT", cpu) is None


@pytest.mark.parametrize("layout, fmt_a, fmt_b", [("NT", "mxfp8", RHT), ("NN", "identity_bf16", RHT)])
def test_gemm_dispatches_to_run_split(layout, fmt_a, fmt_b, monkeypatch, set_policy):
    """``gemm`` with the backend allowed on the device (here: the CPU) runs ``run_split``,
    silently, and matches the FP64 reference — the body of the GPU test, at a small shape."""
    monkeypatch.setattr(bf16_tensorcore, "_device_ok", lambda device: True)
    set_policy(split_unverified_on_cuda=frozenset())
    _check_through_gemm(layout, fmt_a, fmt_b, (40, 56, 72), "cpu", seed=3)


def test_unverified_plain_side_not_taken(monkeypatch, set_policy):
    """A plain-side format the policy's split_unverified_on_cuda lists (empty: every plain-side format
    passes its GPU test) stays on the reported emulation where the split backend is allowed,
    the others do not."""
    monkeypatch.setattr(bf16_tensorcore, "_device_ok", lambda device: True)
    assert hybridfp.current_policy().split_unverified_on_cuda == frozenset()
    set_policy(split_unverified_on_cuda=frozenset({"Identity"}))
    for fa, want in (("identity_bf16", None), ("mxfp8", "bf16_split_rht")):
        a, b = operands("NN", fa, RHT, 8, 16, 32, seed=1, device="cpu")
        sa, sb = _storages("NN", a, b)
        da, db = LAYOUTS["NN"]
        got = select(sa.format_key(da), sb.format_key(db), "NN", sa.device)
        assert (got.name if got is not None else None) == want, fa


def test_split3_exact_in_normal_range_not_for_tiny_values():
    """hi + mid + lo == v for random FP32 values over a wide normal range; at a 1e-38 scale
    lo would need bits under BF16's subnormal grid (2**-133), and the check says so."""
    g = torch.Generator().manual_seed(0)
    v = torch.randn(64, 64, generator=g) * torch.exp2(torch.randint(-100, 100, (64, 64), generator=g).float())
    parts = split_bf16.exact_parts(v)
    assert parts is not None and len(parts) == 3  # random FP32 values need all three
    assert torch.equal(sum(p.float() for p in split_bf16.split3(v)), v)
    assert split_bf16.exact_parts(torch.randn(64, 64, generator=g) * 1e-38) is None
    assert split_bf16.exact_parts(torch.tensor([[1.0, float("inf")]])) is None
    assert split_bf16.exact_parts(torch.tensor([[1.0, float("nan")]])) is None
    assert len(split_bf16.exact_parts(torch.tensor([[1.0, -0.0, 3.0]]))) == 1  # zero parts skipped


def test_tiny_values_take_the_reported_emulation(monkeypatch):
    """RHT values at a ~1e-38 scale cannot be split exactly: that call runs emulate (bitwise
    its result) and says why, once. NVFP4 decoded values never get that small (block scales
    keep them >= 2**-13, the global scale goes to the epilogue), so the tiny values are made
    by scaling the split's input by 2**-130 (exact in FP32; |v| ~ 1e-40 .. 1e-38, their low
    bits below 2**-133): had the split path run on them, the result would be ~2**-130 of
    emulate's."""
    real = split_bf16._to_original_domain
    monkeypatch.setattr(split_bf16, "_to_original_domain", lambda op: real(op) * 2.0**-130)
    a, b = operands("NT", "mxfp8", RHT, 16, 24, 48, seed=2)
    sa, sb = _storages("NT", a, b)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out1 = run_split(sa, sb, "NT", out_dtype=torch.float32)
        out2 = run_split(sa, sb, "NT", out_dtype=torch.float32)
    msgs = [str(w.message) for w in caught if issubclass(w.category, EmulatedGemmWarning)]
    assert len(msgs) == 1, msgs
    assert msgs[0].startswith("hybridfp: wgrad (MXFP8") and "NVFP4(rht=True)" in msgs[0]
    assert split_bf16.INEXACT in msgs[0] and "B: " in msgs[0] and "emulation" in msgs[0]
    want = _emulated("NT", sa, sb)
    assert torch.equal(out1, want) and torch.equal(out2, want)


def test_nan_in_the_rht_operand_takes_the_reported_emulation():
    """A NaN in the source (e.g. an overflowed gradient) decodes to NaN values, which do not
    split: emulate runs and its result (NaNs included) is returned."""
    g = torch.Generator().manual_seed(4)
    dy = MXFP8Quantizer()(_source(48, 16, g, "cpu"))
    src = _source(48, 24, g, "cpu")
    src[5, 3] = float("nan")
    x = NVFP4Quantizer(with_rht=True)(src)
    sa, sb = _storages("NT", dy, x)
    with pytest.warns(EmulatedGemmWarning, match="non-finite"):
        out = run_split(sa, sb, "NT", out_dtype=torch.float32)
    want = _emulated("NT", sa, sb)
    assert out.isnan().any()
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)


def test_fp32_values_on_the_plain_side_take_the_reported_emulation():
    """An Identity copy held in FP32 does not decode into BF16 (a format key cannot show it):
    run_split hands the GEMM to emulate, reported once, as ``run`` does."""
    g = torch.Generator().manual_seed(7)
    dy = IdentityQuantizer()(_source(48, 16, g, "cpu"))
    x = NVFP4Quantizer(with_rht=True)(_source(48, 24, g, "cpu"))
    sa, sb = _storages("NT", dy, x)
    with pytest.warns(EmulatedGemmWarning, match="A: float32 values"):
        out = run_split(sa, sb, "NT", out_dtype=torch.float32)
    assert torch.equal(out, _emulated("NT", sa, sb))


def test_split_gemm_refuses_pairs_it_does_not_take():
    a, b = operands("NT", "mxfp8", RHT, 8, 8, 32, seed=6)
    sa, sb = _storages("NT", a, b)
    oa, ob = decode_bf16(sa, COLUMNWISE), decode_bf16(sb, COLUMNWISE)
    with pytest.raises(ValueError, match="one-sided"):
        split_bf16.split_gemm(ob, ob, bf16_tensorcore.bf16_mm_fp32)
    with pytest.raises(ValueError, match="BF16-decoded"):
        split_bf16.split_gemm(type(oa)(oa.values.float(), oa.scale, oa.k), ob, bf16_tensorcore.bf16_mm_fp32)


# ---------------------------------------------------------------------------- through gemm()
def _check_through_gemm(layout: str, fa: str, fb: str, shape: tuple[int, int, int], device: str,
                        seed: int) -> None:
    """``gemm`` selects bf16_split_rht, reports nothing, and matches the FP64 reference and
    emulate (FP32 out), in BF16 out, and with bias + accumulate_into."""
    m, n, k = shape
    a, b = operands(layout, fa, fb, m, n, k, seed=seed, device=device)
    sa, sb = _storages(layout, a, b)
    da, db = LAYOUTS[layout]
    backend = select(sa.format_key(da), sb.format_key(db), layout, sa.device)
    assert backend is not None and backend.name == "bf16_split_rht"
    ref = _reference(layout, a, b)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EmulatedGemmWarning)
        out = gemm(a, b, layout, out_dtype=torch.float32)
        out16 = gemm(a, b, layout)
        bias = torch.randn(n, device=device)
        into = torch.randn(m, n, device=device) * ref.abs().mean().float()
        start = into.clone()
        gemm(a, b, layout, accumulate_into=into, bias=bias)
    tol = max(REL_TOL, 2 * _tensor_core_error(layout, a, b))
    err = rel_err(out, ref)
    print(f"rel err {layout} {fa} x {fb} {shape} on {device}: {err:.2e} (bound {tol:.2e})")
    assert err < tol
    assert rel_err(out, _emulated(layout, sa, sb).double()) < tol
    assert out16.dtype == torch.bfloat16 and rel_err(out16, ref) < 2.0**-8
    assert rel_err(into - start - bias, ref) < tol


def _tensor_core_error(layout: str, a: torch.Tensor, b: torch.Tensor) -> float:
    """The relative error of one plain cuBLAS BF16 GEMM (FP32 output) of the two operands
    rounded to BF16, against the FP64 product of those same BF16 values: the accumulation
    error the tensor cores themselves add at this shape (0 off CUDA, where the BF16 GEMM is an
    IEEE FP32 matmul). Hopper's MMA accumulation is not IEEE FP32 (it aligns the products
    before adding and drops low bits), and it loses more with full 8-bit BF16 significands on
    both sides (BF16 Identity x the split parts: 1.6e-5 measured at k = 14336) than with a
    4-bit MXFP8 / NVFP4 side, whose products have fewer bits to drop. The split GEMM adds two
    or three such GEMMs, hence twice this error as its bound."""
    if a.device.type != "cuda":
        return 0.0
    da, db = LAYOUTS[layout]
    x, y = ref_operand(a, da).to(torch.bfloat16), ref_operand(b, db).to(torch.bfloat16)
    return rel_err(bf16_tensorcore.bf16_mm_fp32(x, y), x.double() @ y.double().t())


#: (layout, A, B, (m, n, k)): 4096^3, and a Llama-3-8B MLP-like wgrad [8192, 4096] over k = 14336.
GPU_CASES = [("NT", "mxfp8", RHT, (4096, 4096, 4096)), ("NT", RHT, "mxfp8", (4096, 4096, 4096)),
             ("NT", "fp8_e4m3", RHT, (4096, 4096, 4096)), ("NN", "nvfp4_1d", RHT, (4096, 4096, 4096)),
             ("NT", "mxfp8", RHT, (8192, 4096, 14336)), ("NT", "identity_bf16", RHT, (8192, 4096, 14336))]


@gpu
@pytest.mark.parametrize("layout, fmt_a, fmt_b, shape", GPU_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{'x'.join(map(str, c[3]))}" for c in GPU_CASES])
def test_gpu_split_rht_through_gemm(layout, fmt_a, fmt_b, shape, monkeypatch, set_policy):
    """Fresh random operands (seeded from os.urandom) quantized on the GPU; cuBLAS BF16 GEMMs
    of exact products with FP32 accumulation. Bound 1e-5 at k up to 14336 (typical
    random-sign FP32 accumulation error ~ u sqrt(k / 6) ~ 3e-6 even for a sequential sum), or
    twice a plain BF16 tensor-core GEMM's own error at the shape if larger
    (:func:`_tensor_core_error`: Hopper's accumulation is not IEEE FP32). Pairs in
    the policy's split_unverified_on_cuda are forced onto the backend here: this test is what clears them."""
    set_policy(split_unverified_on_cuda=frozenset())
    _check_through_gemm(layout, fmt_a, fmt_b, shape, "cuda", seed=int.from_bytes(os.urandom(4), "little"))
