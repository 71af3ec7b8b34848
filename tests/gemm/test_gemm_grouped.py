"""``grouped_gemm``: the experts' GEMMs of one layout in one grouped call equal the per-expert
``gemm`` loop (CPU, with the grouped matmul emulated exactly by ``reference_grouped_mm``), and
the FP64 GEMM of the dequantized operands at MoE shapes on the GPU.

CPU shapes: 4 experts, x_e [m_e, 64], W_e [48, 64], dy_e [m_e, 48], m = [0, 19, 29, 16] (an
empty expert; sizes that are not multiples of 8, 16 or 32) or the 8-aligned [0, 24, 32, 8].
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from gemm_operands import FORMATS as MAKERS
from gemm_operands import ref_operand

from hybridfp import Float8CurrentScalingQuantizer, NVFP4Quantizer
from hybridfp.gemm import gemm
from hybridfp.moe import grouped_gemm
from hybridfp.moe import gemm as grouped, gemm_bf16 as grouped_bf16
from hybridfp.moe.gemm import (GROUPED_BF16, GROUPED_FP8_ROWWISE, PATH_COUNTS, PER_EXPERT,
                                   reference_grouped_mm)

K, N = 64, 48
ODD, ALIGNED = [0, 19, 29, 16], [0, 24, 32, 8]
#: Formats whose pairs have an exact BF16 decode and no epilogue factor: the grouped BF16 path.
GROUPABLE = ["identity_bf16", "mxfp8_1d", "mxfp8_2d", "fp8_block_1d", "fp8_block_2d"]
#: Formats with an epilogue factor (per-tensor scale_inv, NVFP4 S_dec): per expert.
SCALED = ["fp8_e4m3", "fp8_e5m2", "nvfp4_1d", "nvfp4_2d", "nvfp4_rht"]
#: layout -> (A tensor, B tensor) per expert.
OPERANDS = {"TN": ("x", "w"), "NN": ("dy", "w"), "NT": ("dy", "x")}


class CountingMM:
    """``reference_grouped_mm`` that counts its calls (did the grouped path run?)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, mat_a: torch.Tensor, mat_b: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        self.calls += 1
        return reference_grouped_mm(mat_a, mat_b, sizes)


def sources(splits: list[int], seed: int = 0) -> dict[str, list[torch.Tensor]]:
    """Per-expert x, w, dy (FP32), each expert at its own magnitude (per-expert scales matter)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, list[torch.Tensor]] = {"x": [], "w": [], "dy": []}
    for e, m in enumerate(splits):
        mag = 2.0 ** (e - 2)
        out["x"].append(torch.randn(m, K, generator=g) * mag)
        out["w"].append(torch.randn(N, K, generator=g) / mag)
        out["dy"].append(torch.randn(m, N, generator=g) * mag)
    return out


def quantized(fmts: list[str], splits: list[int], seed: int = 0) -> dict[str, list[torch.Tensor]]:
    """``sources`` with expert e's tensors in format ``fmts[e]``."""
    src = sources(splits, seed)
    return {k: [MAKERS[f](t)(t) for f, t in zip(fmts, ts)] for k, ts in src.items()}


def per_expert(a: list[torch.Tensor], b: list[torch.Tensor], layout: str, **kw):
    outs = [gemm(x, y, layout, **kw) for x, y in zip(a, b)]
    return outs if layout == "NT" else torch.cat(outs)


def assert_same(got, want) -> None:
    for g, w in (zip(got, want) if isinstance(want, list) else [(got, want)]):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w)


# ---------------------------------------------------------------- the grouped BF16 path (CPU)
@pytest.mark.parametrize("layout", list(OPERANDS))
@pytest.mark.parametrize("fmt", GROUPABLE)
def test_grouped_bf16_path_equals_per_expert_gemm_bitwise(fmt, layout):
    """Same values, same FP32 emulation per expert: bitwise. wgrad's reduction is grouped, so
    the 8-aligned splits keep every expert's reduction unpadded (padding would change the
    emulation's summation order; see the next test)."""
    ops = quantized([fmt] * 4, ALIGNED)
    wa, wb = OPERANDS[layout]
    mm = CountingMM()
    got = grouped_gemm(ops[wa], ops[wb], layout, grouped_mm=mm)
    assert mm.calls == 1
    assert_same(got, per_expert(ops[wa], ops[wb], layout))


@pytest.mark.parametrize("layout", list(OPERANDS))
def test_grouped_bf16_path_with_uneven_splits(layout):
    """fprop/dgrad group rows (bitwise); wgrad pads each expert's reduction to a multiple of 8
    with zeros: the same exact products and FP32 sum in another order, so the BF16 results
    differ by at most one BF16 ulp (the FP32 reordering error, ~sqrt(29) * 2**-24 relative, is
    far below half a BF16 ulp, 2**-9; it can only flip a rounding at a midpoint)."""
    ops = quantized(["mxfp8_1d"] * 4, ODD)
    wa, wb = OPERANDS[layout]
    got = grouped_gemm(ops[wa], ops[wb], layout, grouped_mm=reference_grouped_mm)
    want = per_expert(ops[wa], ops[wb], layout)
    if layout != "NT":
        assert_same(got, want)
        return
    assert torch.equal(got[0], torch.zeros(N, K, dtype=torch.bfloat16))  # the empty expert
    for g, w in zip(got, want):
        ulp = torch.exp2(torch.floor(torch.log2(w.float().abs().clamp_min(1e-30))) - 7)
        assert ((g.float() - w.float()).abs() <= ulp).all()


def test_mixed_formats_across_experts_group():
    """Experts may use different (groupable) formats; each keeps its own scales."""
    fmts = ["mxfp8_1d", "identity_bf16", "fp8_block_1d", "mxfp8_2d"]
    ops = quantized(fmts, ALIGNED)
    for layout, (wa, wb) in OPERANDS.items():
        mm = CountingMM()
        got = grouped_gemm(ops[wa], ops[wb], layout, grouped_mm=mm)
        assert mm.calls == 1
        assert_same(got, per_expert(ops[wa], ops[wb], layout))


@pytest.mark.parametrize("layout", list(OPERANDS))
@pytest.mark.parametrize("fmt", SCALED)
def test_pairs_with_epilogue_factors_run_per_expert(fmt, layout):
    """torch._grouped_mm writes BF16 only, so a per-tensor factor applied after it would round
    twice: such pairs run per expert even when a grouped matmul is offered (bitwise equal)."""
    ops = quantized([fmt] * 4, ODD)
    wa, wb = OPERANDS[layout]
    mm = CountingMM()
    before = Counter(PATH_COUNTS)
    got = grouped_gemm(ops[wa], ops[wb], layout, grouped_mm=mm)
    assert mm.calls == 0
    assert (Counter(PATH_COUNTS) - before) == Counter({(grouped.GEMM_OF_LAYOUT[layout], PER_EXPERT): 1})
    assert_same(got, per_expert(ops[wa], ops[wb], layout))


def test_row_scaled_nvfp4_fprop_runs_per_expert():
    """Composer 2's fprop (row-scaled NVFP4 x NVFP4 1D): per-row and per-tensor S_dec factors."""
    src = sources(ODD)
    xs = [NVFP4Quantizer(row_scaled_nvfp4=True, columnwise=False)(t) for t in src["x"]]
    ws = [NVFP4Quantizer()(t) for t in src["w"]]
    mm = CountingMM()
    assert_same(grouped_gemm(xs, ws, "TN", grouped_mm=mm), per_expert(xs, ws, "TN"))
    assert mm.calls == 0


@pytest.mark.parametrize("fmt", GROUPABLE + SCALED)
@pytest.mark.parametrize("layout", list(OPERANDS))
def test_default_on_cpu_is_the_per_expert_loop(layout, fmt):
    ops = quantized([fmt] * 4, ODD)
    wa, wb = OPERANDS[layout]
    assert_same(grouped_gemm(ops[wa], ops[wb], layout), per_expert(ops[wa], ops[wb], layout))


def test_bias_fp32_output_and_plain_tensors():
    """A bias or an FP32 output keeps the per-expert path (both need the FP32 accumulator);
    plain tensors are operands too (used unquantized)."""
    src = sources(ODD)
    xs = [t.bfloat16() for t in src["x"]]
    ws = [t.bfloat16() for t in src["w"]]
    biases = [torch.randn(N) for _ in ODD]
    mm = CountingMM()
    got = grouped_gemm(xs, ws, "TN", biases=biases, grouped_mm=mm)
    assert_same(got, torch.cat([gemm(x, w, "TN", bias=b) for x, w, b in zip(xs, ws, biases)]))
    got32 = grouped_gemm(xs, ws, "TN", out_dtype=torch.float32, grouped_mm=mm)
    assert_same(got32, per_expert(xs, ws, "TN", out_dtype=torch.float32))
    assert mm.calls == 0
    assert_same(grouped_gemm(xs, ws, "TN", grouped_mm=mm), per_expert(xs, ws, "TN"))
    assert mm.calls == 1


def test_path_reasons():
    src = sources(ALIGNED)
    sa = [grouped.operand_storage(t, "rowwise", "A") for t in src["x"]]
    sb = [grouped.operand_storage(t, "rowwise", "B") for t in src["w"]]
    path, why = grouped.grouped_path(sa, sb, "TN", torch.bfloat16, False, forced=True)
    assert path == PER_EXPERT and "float32 values" in why  # FP32 plain tensors: no exact BF16
    path, why = grouped.grouped_path(sa, sb, "TN", torch.bfloat16, False)
    assert path == PER_EXPERT and "no grouped BF16 kernel on cpu" in why
    fp8 = [Float8CurrentScalingQuantizer(torch.float8_e4m3fn)(t) for t in src["x"]]
    sf = [t.qstorage.part("rowwise") for t in fp8]
    assert grouped.grouped_path(sf, sf, "TN", torch.bfloat16, False)[0] != GROUPED_FP8_ROWWISE  # CPU
    assert GROUPED_BF16 != GROUPED_FP8_ROWWISE


# ---------------------------------------------------------------- errors
def test_errors():
    ops = quantized(["mxfp8_1d"] * 4, ODD)
    with pytest.raises(ValueError, match="layout='TT' is unknown"):
        grouped_gemm(ops["x"], ops["w"], "TT")
    with pytest.raises(ValueError, match="one A and one B operand per expert"):
        grouped_gemm(ops["x"], ops["w"][:3], "TN")
    with pytest.raises(ValueError, match="one A and one B operand per expert"):
        grouped_gemm([], [], "TN")
    with pytest.raises(ValueError, match="biases are for fprop"):
        grouped_gemm(ops["dy"], ops["x"], "NT", biases=[None] * 4)
    with pytest.raises(ValueError, match=r"expert 0: reduction lengths differ \(48 vs 64"):
        grouped_gemm(ops["dy"], ops["w"], "TN")
    w_other = [torch.randn(N + 8, K) for _ in ODD]
    with pytest.raises(ValueError, match="every expert must have the same weight shape"):
        grouped_gemm(ops["x"], ops["w"][:2] + w_other[2:], "TN")
    with pytest.raises(TypeError, match="gemm operand A\\[0\\] must be a floating tensor"):
        grouped_gemm([torch.zeros(2, K, dtype=torch.int32)], ops["w"][:1], "TN")


def test_reference_grouped_mm_semantics():
    """2D x 3D groups rows, 2D x 2D groups the reduction (zeros for an empty group)."""
    g = torch.Generator().manual_seed(5)
    a = torch.randn(10, 16, generator=g).bfloat16()
    b = torch.randn(3, 8, 16, generator=g).bfloat16()
    sizes = [3, 0, 7]
    out = reference_grouped_mm(a, b.transpose(1, 2), sizes)
    want = torch.cat([(a[:3].float() @ b[0].float().t()), (a[3:].float() @ b[2].float().t())]).bfloat16()
    assert torch.equal(out, want)
    dy = torch.randn(10, 8, generator=g).bfloat16()
    w = reference_grouped_mm(dy.t().contiguous(), a, sizes)
    assert w.shape == (3, 8, 16) and torch.equal(w[1], torch.zeros(8, 16, dtype=torch.bfloat16))
    assert torch.equal(w[2], (dy[3:].float().t() @ a[3:].float()).bfloat16())


# ---------------------------------------------------------------- GPU: MoE shapes vs FP64
#: 8 experts, hidden 4096, 8192 routed rows: an empty expert and sizes that are not multiples
#: of 8 (wgrad's padded reduction), 16 or 32.
GPU_SPLITS = [1536, 0, 640, 2048, 1001, 1511, 256, 1200]
HIDDEN = 4096
#: (format, layout) -> the path the grouped GEMM must take on an H200.
GPU_CASES = {
    ("mxfp8_1d", "TN"): GROUPED_BF16, ("mxfp8_1d", "NN"): GROUPED_BF16, ("mxfp8_1d", "NT"): GROUPED_BF16,
    ("identity_bf16", "TN"): GROUPED_BF16, ("identity_bf16", "NN"): GROUPED_BF16,
    ("identity_bf16", "NT"): GROUPED_BF16,
    ("fp8_e4m3", "TN"): GROUPED_FP8_ROWWISE, ("fp8_e4m3", "NN"): GROUPED_FP8_ROWWISE,
    ("fp8_e4m3", "NT"): PER_EXPERT,
    ("nvfp4_row_scaled", "TN"): PER_EXPERT,
}
#: Bound on rel_err(out) - rel_err(bf16(ref)) (Frobenius, relative to ||ref||). Every path
#: rounds once to BF16, which alone costs ~2**-9 / sqrt(3) ~ 1.1e-3 (the "ideal" error). An
#: accumulation error delta (relative) flips a rounding with probability ~ 2 delta / ulp and
#: raises the squared error by ~ 4 delta**2 per element, so the excess over the ideal is
#: ~ 2 delta**2 / 1.1e-3: FP32 accumulation (delta ~ sqrt(K) 2**-24 <= 7e-6) gives < 1e-7;
#: 1e-5 catches delta >~ 7e-5 and any wrong scale or group. The FP8 MMA paths (numerics §1's
#: Hopper exception, no fast accumulation) measured an excess of 4.9e-6 on an H200 (1e-4
#: relative error per element, as cuBLAS block FP8): bounded at 1e-4 here.
GPU_EXCESS = {GROUPED_BF16: 1e-5, PER_EXPERT: 1e-5, GROUPED_FP8_ROWWISE: 1e-4}


def gpu_operands(fmt: str, ffn: int) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator(device="cuda").manual_seed(ffn)
    out: dict[str, list[torch.Tensor]] = {"x": [], "w": [], "dy": []}
    for e, m in enumerate(GPU_SPLITS):
        mag = 2.0 ** (e % 4 - 2)  # per-expert magnitudes: per-expert scales must be applied
        src = {"x": torch.randn(m, HIDDEN, device="cuda", generator=g) * mag,
               "w": torch.randn(ffn, HIDDEN, device="cuda", generator=g) * 0.02 / mag,
               "dy": torch.randn(m, ffn, device="cuda", generator=g) * 1e-3 * mag}
        for k, t in src.items():
            if fmt == "nvfp4_row_scaled" and k == "w":
                out[k].append(NVFP4Quantizer()(t))
            else:
                out[k].append(MAKERS[fmt](t)(t))
    return out


def fp64_reference(a: list[torch.Tensor], da: str, b: list[torch.Tensor], db: str, layout: str) -> torch.Tensor:
    """Per expert, the FP64 product of the dequantized copies (gemm_operands.ref_operand)."""
    parts = [ref_operand(x, da) @ ref_operand(y, db).t() for x, y in zip(a, b)]
    return torch.stack(parts) if layout == "NT" else torch.cat(parts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("ffn", [1408, 14336])
@pytest.mark.parametrize("fmt, layout", list(GPU_CASES), ids=["-".join(c) for c in GPU_CASES])
def test_grouped_gemm_moe_shapes_vs_fp64_cuda(fmt, layout, ffn):
    ops = gpu_operands(fmt, ffn)
    wa, wb = OPERANDS[layout]
    da, db = grouped.LAYOUTS[layout]
    before = Counter(PATH_COUNTS)
    out = grouped_gemm(ops[wa], ops[wb], layout)
    path = GPU_CASES[(fmt, layout)]
    assert Counter(PATH_COUNTS) - before == Counter({(grouped.GEMM_OF_LAYOUT[layout], path): 1})
    out = torch.stack(out) if layout == "NT" else out
    ref = fp64_reference(ops[wa], da, ops[wb], db, layout)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    err = ((out.double() - ref).norm() / ref.norm()).item()
    ideal = ((ref.bfloat16().double() - ref).norm() / ref.norm()).item()
    flips = (out != ref.bfloat16()).float().mean().item()
    print(f"\n{fmt} {layout} ffn={ffn} path={path}: rel err {err:.4e}, BF16 rounding alone "
          f"{ideal:.4e}, excess {err - ideal:.2e}, elements != bf16(ref): {flips:.2e}")
    assert err - ideal <= GPU_EXCESS[path]
    if layout == "NT":
        assert torch.equal(out[1], torch.zeros_like(out[1]))  # the empty expert


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_torch_grouped_mm_writes_its_input_dtype_only_cuda():
    """Why pairs with epilogue factors run per expert: no FP32 output from BF16 inputs."""
    a = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2, 128, 32, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([32, 64], device="cuda", dtype=torch.int32)
    with pytest.raises(RuntimeError):
        torch._grouped_mm(a, b, offs=offs, out_dtype=torch.float32)


# ---------------------------------------------------------------- shared row-local encodings
@pytest.mark.parametrize("layout", ["TN", "NN"])
@pytest.mark.parametrize("fmt", ["identity", "mxfp8", "fp8_block"])
def test_shared_rowwise_encoding_is_read_without_copy(fmt, layout):
    """A operands from ``quantize_grouped`` (row-slice views of one encoding, awkward splits
    with an empty expert) reach the grouped matmul as one decode of the whole encoding — for
    BF16 Identity, the input itself — and the result equals the per-expert loop bitwise."""
    from hybridfp import Float8BlockQuantizer, IdentityQuantizer, MXFP8Quantizer
    from hybridfp.moe.quantize import quantize_grouped

    make = {"identity": IdentityQuantizer, "mxfp8": MXFP8Quantizer,
            "fp8_block": lambda: Float8BlockQuantizer(block_scaling_dim=1)}[fmt]
    splits = [0, 19, 29, 16]
    src = sources(splits)
    a_name = OPERANDS[layout][0]
    a_src = torch.cat(src[a_name]).bfloat16()
    qs = [make() for _ in splits]
    for q in qs:
        q.set_usage(rowwise=True, columnwise=False)
    A = quantize_grouped(qs, a_src, splits)
    B = [make()(w.bfloat16()) for w in src["w"]]
    seen = []

    def mm(mat_a, mat_b, sizes):
        seen.append(mat_a)
        return reference_grouped_mm(mat_a, mat_b, sizes)
    got = grouped_gemm(A, B, layout, grouped_mm=mm)
    assert_same(got, per_expert(A, B, layout))
    assert len(seen) == 1 and seen[0].shape == a_src.shape
    if fmt == "identity":
        assert seen[0].data_ptr() == a_src.data_ptr()  # no copy at all


def test_lists_of_experts_are_never_joined(monkeypatch):
    """Separately quantized experts (a plain list) are never read as joined, even when their
    copies happen to be views of one buffer (slices of one quantization): each expert is
    decoded on its own; the joined decode needs a ``GroupedTensor`` that states its copy."""
    from hybridfp import MXFP8Quantizer
    from hybridfp.moe import gemm_bf16
    from hybridfp.moe.joined import joined_of

    splits = [32, 0, 48]
    src = sources(splits)
    whole = MXFP8Quantizer()(torch.cat(src["x"]).bfloat16())
    A = [whole[0:32], whole[32:32], whole[32:80]]  # row slices of one encoding
    B = [MXFP8Quantizer()(w.bfloat16()) for w in src["w"]]
    assert joined_of(A, "rowwise") is None
    joined = []
    real = gemm_bf16.decode_bf16_joined
    monkeypatch.setattr(gemm_bf16, "decode_bf16_joined", lambda *a, **k: joined.append(1) or real(*a, **k))
    got = grouped_gemm(A, B, "TN", grouped_mm=reference_grouped_mm)
    assert joined == [] and torch.equal(got, per_expert(A, B, "TN"))


# ---------------------------------------------------------------- joined weights and columnwise copies
@pytest.mark.parametrize("layout", list(OPERANDS))
def test_shared_encodings_reach_the_grouped_mm_as_one_decode(layout):
    """MoE operands as ``GroupedLinear`` makes them — x and dy by ``quantize_grouped`` (rowwise
    + zero-padded columnwise MXFP8, awkward splits with empty experts), the weights by
    ``quantize_weights_grouped`` (stacked) — reach the grouped matmul as one decode per operand:
    B of fprop / dgrad an [E, k, n] view of the stacked weights' decode (no stack copy), wgrad's
    A and B the padded columnwise buffers themselves ([n, Σ padded m]). fprop / dgrad equal the
    per-expert loop bitwise; wgrad sums each expert's padding zeros too, so (as in the uneven
    test above) it is within one BF16 ulp of it, and an empty expert's dW is zero."""
    from hybridfp import MXFP8Quantizer
    from hybridfp.moe.quantize import quantize_grouped
    from hybridfp.moe.quantize_weights import quantize_weights_grouped

    splits = [0, 19, 45, 0, 33]
    src = sources(splits)
    qs = [MXFP8Quantizer() for _ in splits]
    X = quantize_grouped(qs, torch.cat(src["x"]).bfloat16(), splits)
    DY = quantize_grouped([MXFP8Quantizer() for _ in splits], torch.cat(src["dy"]).bfloat16(), splits)
    W = quantize_weights_grouped([MXFP8Quantizer() for _ in splits], [w.bfloat16() for w in src["w"]])
    ops = {"x": X, "dy": DY, "w": W}
    wa, wb = OPERANDS[layout]
    seen = []

    def mm(mat_a, mat_b, sizes):
        seen.append((mat_a, mat_b, list(sizes)))
        return reference_grouped_mm(mat_a, mat_b, sizes)
    got = grouped_gemm(ops[wa], ops[wb], layout, grouped_mm=mm)
    want = per_expert(ops[wa], ops[wb], layout)
    (mat_a, mat_b, sizes), = seen
    if layout != "NT":
        assert_same(got, want)
        e, k, n = mat_b.shape
        assert (e, k, n) == ((len(splits), K, N) if layout == "TN" else (len(splits), N, K))
        assert mat_b.untyped_storage().nbytes() == e * k * n * 2  # one decode, viewed: no stack
        return
    padded = [-(-m // 32) * 32 for m in splits]
    assert tuple(mat_a.shape) == (N, sum(padded)) and tuple(mat_b.shape) == (sum(padded), K)
    assert sizes == padded
    for m, g, w in zip(splits, got, want):
        if m == 0:
            assert torch.equal(g, torch.zeros(N, K, dtype=torch.bfloat16))
        ulp = torch.exp2(torch.floor(torch.log2(w.float().abs().clamp_min(1e-30))) - 7)
        assert ((g.float() - w.float()).abs() <= ulp).all()


def test_joined_columns_are_the_padded_layout():
    """The joined columnwise copy ``quantize_grouped`` states is the zero-padded groups' (each
    group from a whole block); a BF16 Identity copy (the rows, read transposed) or a copy with
    per-expert scales is not read as padded columns."""
    from hybridfp import IdentityQuantizer, MXFP8Quantizer
    from hybridfp.moe.joined import joined_column_storage, joined_of
    from hybridfp.moe.quantize import quantize_grouped

    splits = [40, 24]
    got = quantize_grouped([MXFP8Quantizer() for _ in splits], torch.randn(64, K), splits)
    joined, starts = joined_column_storage(joined_of(got, "columnwise"), "columnwise")
    assert starts == [0, 64] and joined.rows == 96
    ident = quantize_grouped([IdentityQuantizer() for _ in splits], torch.randn(64, K).bfloat16(), splits)
    assert joined_column_storage(joined_of(ident, "columnwise"), "columnwise") is None


def test_stacked_weight_decode_is_cached_while_unchanged(monkeypatch):
    """fprop's B (the stacked weights' rowwise copies, one joined decode) is decoded once for
    repeated GEMMs on the same quantized weights (micro-batches), again after a weight changes."""
    from hybridfp import MXFP8Quantizer
    from hybridfp.gemm import bf16_decode
    from hybridfp.moe.quantize import quantize_grouped
    from hybridfp.moe.quantize_weights import quantize_weights_grouped

    splits = [16, 0, 40]
    src = sources(splits)
    X = quantize_grouped([MXFP8Quantizer() for _ in splits], torch.cat(src["x"]).bfloat16(), splits)
    W = quantize_weights_grouped([MXFP8Quantizer() for _ in splits], [w.bfloat16() for w in src["w"]])
    calls = []
    real = bf16_decode.decode_bf16
    monkeypatch.setattr(bf16_decode, "decode_bf16", lambda s, d, **k: calls.append(s.rows) or real(s, d, **k))
    first = grouped_gemm(X, W, "TN", grouped_mm=reference_grouped_mm)
    n_first = len(calls)
    again = grouped_gemm(X, W, "TN", grouped_mm=reference_grouped_mm)
    assert len(calls) == n_first + 1 and torch.equal(first, again)  # only x decoded again
    W[0].qstorage.payload("rowwise")["data"].view(torch.uint8)[0, 0] ^= 1  # an in-place change
    grouped_gemm(X, W, "TN", grouped_mm=reference_grouped_mm)
    assert len(calls) == n_first + 3


def test_all_empty_experts_are_not_joined():
    """Zero-width joins (every expert empty) are refused, not divided by."""
    from hybridfp import MXFP8Quantizer
    from hybridfp.moe.joined import joined_column_storage, joined_of
    from hybridfp.moe.quantize import quantize_grouped

    got = quantize_grouped([MXFP8Quantizer() for _ in range(3)], torch.zeros(0, 1), [0, 0, 0])
    assert joined_column_storage(joined_of(got, "columnwise"), "columnwise") is None


def test_fp8_rowwise_path_reads_adjacent_rows_without_a_copy(monkeypatch):
    """``torch._scaled_grouped_mm``'s operands for FP8 current scaling from ``quantize_grouped``
    (x: one cast pass, row slices) and ``quantize_weights_grouped`` (stacked weights) are views
    of those buffers, equal to the cat / stack they replace (the matmul emulated on the CPU)."""
    from hybridfp import Float8CurrentScalingQuantizer
    from hybridfp.moe import gemm as g
    from hybridfp.moe.quantize import quantize_grouped
    from hybridfp.moe.quantize_weights import quantize_weights_grouped

    splits = [16, 0, 48, 32]
    src = sources(splits)
    X = quantize_grouped([Float8CurrentScalingQuantizer() for _ in splits], torch.cat(src["x"]).bfloat16(), splits)
    W = quantize_weights_grouped([Float8CurrentScalingQuantizer() for _ in splits], [w.bfloat16() for w in src["w"]])
    seen = {}

    def fake(mat_a, mat_b, scale_a, scale_b, offs, out_dtype, use_fast_accum):
        seen.update(a=mat_a, b=mat_b, sa=scale_a, sb=scale_b)
        ends = offs.tolist()
        outs = [(mat_a[s:e].float() * scale_a[s:e, None]) @ (mat_b[i].float() * scale_b[i][None, :])
                for i, (s, e) in enumerate(zip([0] + ends[:-1], ends))]
        return torch.cat(outs).to(out_dtype)
    monkeypatch.setattr(g, "_fp8_rowwise_unsupported", lambda *a: None)
    monkeypatch.setattr(g, "select", lambda *a: g.fast.TENSORWISE_BACKEND)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", fake, raising=False)
    out = grouped_gemm(X, W, "TN")
    xa = [t.qstorage.payload("rowwise")["data"] for t in X]
    wb = [t.qstorage.payload("rowwise")["data"] for t in W]
    assert seen["a"].data_ptr() == xa[0].data_ptr() and seen["b"].data_ptr() == wb[0].data_ptr()
    assert torch.equal(seen["a"].view(torch.uint8), torch.cat([t.view(torch.uint8) for t in xa]))
    assert torch.equal(seen["b"].view(torch.uint8),
                       torch.stack([t.view(torch.uint8) for t in wb]).transpose(1, 2))
    assert out.shape == (sum(splits), N)
    # each row / column scaled by its expert's scale_inv
    want_sa = torch.cat([t.qstorage.payload("rowwise")["scale_inv"].float().reshape(1).expand(m)
                         for t, m in zip(X, splits)])
    want_sb = torch.stack([t.qstorage.payload("rowwise")["scale_inv"].float().reshape(1).expand(N) for t in W])
    assert torch.equal(seen["sa"], want_sa) and torch.equal(seen["sb"], want_sb)
    assert len(set(want_sa.tolist())) > 1  # per-expert scales differ, so a mix-up shows


def test_per_expert_fp8_choice_by_expert_size():
    """Per-tensor FP8 fprop / dgrad go per expert (cuBLAS) when the mean expert GEMM reaches
    the policy's ``per_expert_fp8_flops`` (measured crossover, H200), else grouped; empty experts do
    not count."""
    from hybridfp.moe.gemm import per_expert_fp8_faster
    assert per_expert_fp8_faster([4096] * 8, 28672, 4096)  # bench_moe, 8 experts (fc1)
    assert per_expert_fp8_faster([4096] * 8, 4096, 14336)  # fc2 / dgrad
    assert not per_expert_fp8_faster([512] * 64, 2816, 4096)  # 64 experts of ffn 1408
    assert not per_expert_fp8_faster(GPU_SPLITS, 14336, HIDDEN)  # the GPU path table's case
    assert per_expert_fp8_faster([0, 0, 8192, 0], 14336, 4096)  # empty experts are not averaged in
    assert not per_expert_fp8_faster([0, 0], 14336, 4096)


def test_per_expert_fp8_choice_against_triton_has_its_own_threshold(set_policy):
    """Against the Triton FP8 grouped GEMM the crossover is ``per_expert_fp8_triton_flops``:
    2 x 2048 x 7168 x 4096 = 1.2e11 FLOPs per expert is below the general 2.5e11 and above the
    Triton one (4.5e10); each threshold moves only its own answer."""
    from hybridfp.moe.gemm import per_expert_fp8_faster
    ms = [2048] * 32
    assert per_expert_fp8_faster(ms, 4096, 7168, triton=True)
    assert not per_expert_fp8_faster(ms, 4096, 7168)
    set_policy(per_expert_fp8_triton_flops=2.0e11)
    assert not per_expert_fp8_faster(ms, 4096, 7168, triton=True)
    set_policy(per_expert_fp8_flops=1.0e11)
    assert per_expert_fp8_faster(ms, 4096, 7168)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", ["TN", "NN"])
def test_large_fp8_experts_run_per_expert_cublas_cuda(layout, set_policy):
    """Experts at or above the policy's ``per_expert_fp8_flops`` (forced here) take cuBLAS per expert for
    per-tensor FP8 fprop / dgrad, within the FP8 MMA bound of the grouped path against FP64."""
    set_policy(per_expert_fp8_flops=0.0, per_expert_fp8_triton_flops=0.0)
    ops = gpu_operands("fp8_e4m3", 1408)
    wa, wb = OPERANDS[layout]
    da, db = grouped.LAYOUTS[layout]
    before = Counter(PATH_COUNTS)
    out = grouped_gemm(ops[wa], ops[wb], layout)
    assert Counter(PATH_COUNTS) - before == Counter({(grouped.GEMM_OF_LAYOUT[layout], PER_EXPERT): 1})
    ref = fp64_reference(ops[wa], da, ops[wb], db, layout)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    ideal = ((ref.bfloat16().double() - ref).norm() / ref.norm()).item()
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert err - ideal <= GPU_EXCESS[GROUPED_FP8_ROWWISE]


@pytest.mark.parametrize("writes_out", [True, False])
@pytest.mark.parametrize("layout", list(OPERANDS))
def test_one_backend_per_expert_runs_it_directly(layout, writes_out, monkeypatch):
    """Where every expert's pair selects one backend, each expert's GEMM is that backend's
    ``run`` on its storages (no per-expert ``gemm()`` bookkeeping): fprop / dgrad rows written
    into one result (through ``out`` when the backend writes there), wgrad one result per expert,
    a bias per expert — the same values as ``gemm()`` per expert (here a stand-in backend that
    runs the exact emulation)."""
    from hybridfp.gemm.backends import emulate
    calls = []

    class Standin:
        def __init__(self):
            self.writes_out = writes_out

        def run(self, sa, sb, lay, *, out_dtype, bias=None, out=None):
            da, db = grouped.LAYOUTS[lay]
            calls.append(out is not None)
            res = emulate(sa.gemm_operand(da), sb.gemm_operand(db), out_dtype, bias)
            return res if out is None else out.copy_(res)
    backend = Standin()
    monkeypatch.setattr(grouped, "select", lambda *a: backend)
    monkeypatch.setattr(grouped, "_emulated_operands", lambda *a: None)
    ops = quantized(["fp8_e4m3"] * 4, ODD)
    wa, wb = OPERANDS[layout]
    biases = [torch.randn(N) for _ in ODD] if layout == "TN" else None
    got = grouped._run_per_expert(ops[wa], ops[wb], layout, torch.bfloat16, biases,
                                  [grouped.operand_storage(t, grouped.LAYOUTS[layout][0], "A") for t in ops[wa]],
                                  [grouped.operand_storage(t, grouped.LAYOUTS[layout][1], "B") for t in ops[wb]])
    assert calls == [writes_out and layout != "NT"] * len(ODD)
    want = [gemm(x, y, layout, bias=(biases[e] if biases else None)) for e, (x, y) in enumerate(zip(ops[wa], ops[wb]))]
    assert_same(got, want if layout == "NT" else torch.cat(want))


def test_identity_wgrad_pads_adjacent_rows_in_one_pass(monkeypatch):
    """BF16 (Identity) x and dy from ``quantize_grouped`` are row blocks of one buffer: wgrad's
    operands are the whole buffers with each expert zero-padded to 8 rows by one
    ``pad_row_groups`` each (not a zero block and a concatenation per expert); the grouped
    result is within one BF16 ulp of the per-expert loop (the padding zeros add nothing, but a
    longer reduction may sum in another order), an empty expert's dW zero."""
    from hybridfp import IdentityQuantizer
    from hybridfp.moe.quantize import quantize_grouped

    splits = [0, 19, 45, 0, 33]
    src = sources(splits)
    X = quantize_grouped([IdentityQuantizer() for _ in splits], torch.cat(src["x"]).bfloat16(), splits)
    DY = quantize_grouped([IdentityQuantizer() for _ in splits], torch.cat(src["dy"]).bfloat16(), splits)
    pads = []
    real = grouped_bf16.pad_row_groups
    monkeypatch.setattr(grouped_bf16, "pad_row_groups", lambda *a: pads.append(a[1]) or real(*a))
    seen = []

    def mm(mat_a, mat_b, sizes):
        seen.append((mat_a.shape, mat_b.shape, list(sizes)))
        return reference_grouped_mm(mat_a, mat_b, sizes)
    got = grouped_gemm(DY, X, "NT", grouped_mm=mm)
    assert pads == [splits, splits]
    padded = [-(-m // 8) * 8 for m in splits]
    assert seen == [((N, sum(padded)), (sum(padded), K), padded)]
    want = per_expert(DY, X, "NT")
    for m, g, w in zip(splits, got, want):
        if m == 0:
            assert torch.equal(g, torch.zeros(N, K, dtype=torch.bfloat16))
        ulp = torch.exp2(torch.floor(torch.log2(w.float().abs().clamp_min(1e-30))) - 7)
        assert ((g.float() - w.float()).abs() <= ulp).all()
