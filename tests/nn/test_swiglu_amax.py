"""The fused SwiGLU records the amax of what it writes (h forward, dg / du backward) beside those
tensors (``hybridfp.tensors.known_amax``), and FP8 current scaling uses it instead of its own
amax pass: the amax bitwise ``_common.global_amax``'s, the quantized tensors bitwise the
reference's, and (GPU) an MLP step bitwise the step without the recording, with three amax
passes fewer."""

from __future__ import annotations

import copy
import os

import torch

if not torch.cuda.is_available():  # the kernels run in Triton's interpreter without CUDA
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import triton.language.standard  # noqa: E402
from nn_cases import GatedMLP  # noqa: E402

import hybridfp  # noqa: E402
from hybridfp import Float8CurrentScaling, Float8CurrentScalingQuantizer, autocast  # noqa: E402
from hybridfp.kernels import _common, triton_swiglu  # noqa: E402
from hybridfp.kernels._common import poisoned_outputs  # noqa: E402
from hybridfp.quantizers import fast  # noqa: E402
from hybridfp import policy  # noqa: E402
from hybridfp.tensors import known_amax  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),  # inf / NaN edge inputs
              pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")]
INTERPRET = (os.environ.get("TRITON_INTERPRET") == "1"
             and type(triton.language.standard.cdiv).__name__ == "InterpretedFunction")
interpreter_only = pytest.mark.skipif(not INTERPRET, reason="CPU kernel tests need TRITON_INTERPRET=1")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
swiglu_module = __import__("hybridfp.nn.swiglu", fromlist=["swiglu"])


def _inputs(shape, dtype, device="cpu", specials=False):
    g = torch.Generator().manual_seed(shape[0] * 31 + shape[1])
    t = [(torch.randn(shape, generator=g) * 4).to(dtype) for _ in range(3)]
    if specials:
        t[0][0, 0], t[1][-1, -1], t[2][shape[0] // 2, 1] = float("inf"), -float("inf"), float("nan")
    return [x.to(device) for x in t]


def _bits(a: torch.Tensor) -> int:
    return int(a.view(torch.int32))


def _check_kernel_amaxes(shape, dtype, device, specials=False):
    g, u, dh = _inputs(shape, dtype, device, specials)
    buf = triton_swiglu.amax_buffer(g, 1)
    h = triton_swiglu.swiglu_forward(g, u, amax_out=buf)
    assert torch.equal(h, triton_swiglu.swiglu_forward(g, u)) or specials  # NaN != NaN
    assert _bits(buf[0]) == _bits(_common.global_amax(h)), "h"
    buf2 = triton_swiglu.amax_buffer(g, 2)
    dg, du = triton_swiglu.swiglu_backward(dh, g, u, amax_out=buf2)
    assert _bits(buf2[0]) == _bits(_common.global_amax(dg)), "dg"
    assert _bits(buf2[1]) == _bits(_common.global_amax(du)), "du"


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1, 5), (9, 40), (20, 3000)], ids=str)
def test_kernel_amax_is_global_amax_bitwise(shape, dtype):
    """Rows not a multiple of the 8 rows per program, columns not of the block, several programs."""
    _check_kernel_amaxes(shape, dtype, "cpu")


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_kernel_amax_nan_and_inf(dtype):
    _check_kernel_amaxes((12, 64), dtype, "cpu", specials=True)
    g = torch.full((4, 8), 1e38).to(dtype)  # FP16 h overflows to inf: the STORED values' amax
    buf = triton_swiglu.amax_buffer(g, 1)
    h = triton_swiglu.swiglu_forward(g, g, amax_out=buf)
    assert _bits(buf[0]) == _bits(_common.global_amax(h))


@interpreter_only
def test_kernels_refuse_a_wrong_amax_buffer():
    g = torch.randn(4, 8)
    with pytest.raises(ValueError, match="amax_out must be amax_buffer"):
        triton_swiglu.swiglu_forward(g, g, amax_out=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="amax_out must be amax_buffer"):
        triton_swiglu.swiglu_backward(g, g, g, amax_out=torch.zeros(2))


def test_known_amax_follows_views_and_versions():
    x = torch.randn(6, 8)
    a = torch.tensor(3.0)
    known_amax.remember(x, a)
    assert known_amax.recall(x.view(2, 3, 8)) is a and known_amax.recall(x.reshape(48)) is a
    assert known_amax.recall(x[1:]) is None and known_amax.recall(x.t()) is None
    assert known_amax.recall(x.clone()) is None
    x.view(48)[0] = 1.0  # an in-place write through a view bumps the shared version
    assert known_amax.recall(x) is None
    with pytest.raises(ValueError, match="float32 tensor of shape \\(\\)"):
        known_amax.remember(x, torch.tensor([1.0]))


def test_known_amax_per_row_group_is_found_under_its_splits_only():
    x = torch.randn(6, 8)
    a = torch.tensor([1.0, 2.0, 3.0])
    known_amax.remember(x, a, [1, 2, 3])
    assert known_amax.recall(x, (1, 2, 3)) is a and known_amax.recall(x.view(3, 2, 8), [1, 2, 3]) is a
    assert known_amax.recall(x.view(12, 4), [1, 2, 3]) is None  # other rows: another grouping
    assert known_amax.recall(x, [1, 2, 3]) is a
    assert known_amax.recall(x) is None and known_amax.recall(x, [3, 2, 1]) is None
    known_amax.remember(x, torch.tensor(5.0))  # a per-tensor record beside it
    assert known_amax.recall(x, [1, 2, 3]) is a and float(known_amax.recall(x)) == 5.0
    x.add_(1)
    assert known_amax.recall(x, [1, 2, 3]) is None
    with pytest.raises(ValueError, match="shape \\(3,\\)"):
        known_amax.remember(x, torch.tensor(1.0), [1, 2, 3])
    with pytest.raises(ValueError, match="do not cover the rows"):
        known_amax.remember(x, torch.zeros(2), [1, 2])


@interpreter_only
def test_swiglu_records_where_a_module_reads_it(monkeypatch):
    """Only inside an autocast region where a module with a quantizer that reads recorded
    amaxes (FP8 current scaling) ran: not outside autocast, not before such a module ran, not
    under MXFP8 (which never reads one), not after a GroupedLinear alone."""
    monkeypatch.setattr(swiglu_module, "_uses_kernels", lambda g: True)
    g, u, dh = (t.requires_grad_() for t in _inputs((10, 48), torch.bfloat16))
    lin = hybridfp.Linear(48, 8, bias=False, params_dtype=torch.bfloat16)
    assert known_amax.recall(hybridfp.swiglu(g, u)) is None
    with autocast(recipe=Float8CurrentScaling()):
        assert known_amax.recall(hybridfp.swiglu(g, u)) is None  # no module ran yet
    with autocast(recipe=hybridfp.MXFP8BlockScaling()):
        lin(g)
        assert known_amax.recall(hybridfp.swiglu(g, u)) is None
    experts = hybridfp.GroupedLinear(2, 48, 8, bias=False, params_dtype=torch.bfloat16)
    with autocast(recipe=Float8CurrentScaling()):
        experts(g, [4, 6])  # grouped FP8 scales come from a segmented amax: it reads no record
        assert known_amax.recall(hybridfp.swiglu(g, u)) is None
        lin(g)
        h = hybridfp.swiglu(g, u)
    assert _bits(known_amax.recall(h)) == _bits(_common.global_amax(h.detach()))
    h.backward(dh)
    for t in (g.grad, u.grad):
        assert _bits(known_amax.recall(t)) == _bits(_common.global_amax(t))


@interpreter_only
def test_one_tensor_swiglu_records_the_whole_gradients_amax(monkeypatch):
    """``swiglu(gate_up)``: h's amax, and the amax of its gradient as the one [M, 2F] tensor the
    next quantizer reads (the max of dg's and du's), bitwise ``global_amax``'s; with a NaN in
    one half the canonical NaN; not recorded outside such a region."""
    monkeypatch.setattr(swiglu_module, "_uses_kernels", lambda g: True)
    lin = hybridfp.Linear(48, 8, bias=False, params_dtype=torch.bfloat16)
    for specials in (False, True):
        g, u, dh = _inputs((10, 48), torch.bfloat16, specials=specials)
        gu = torch.cat([g, u], dim=1).requires_grad_()
        with autocast(recipe=Float8CurrentScaling()):
            lin(g)
            h = hybridfp.swiglu(gu)
        assert _bits(known_amax.recall(h)) == _bits(_common.global_amax(h.detach()))
        h.backward(dh)
        assert _bits(known_amax.recall(gu.grad)) == _bits(_common.global_amax(gu.grad)), specials
    gu = torch.cat([g, u], dim=1).requires_grad_()
    h = hybridfp.swiglu(gu)
    h.backward(dh)
    assert known_amax.recall(h) is None and known_amax.recall(gu.grad) is None

@interpreter_only
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_current_uses_the_known_amax(fp8, monkeypatch):
    """The quantizer takes the recorded amax (its own amax pass is not run) and its result is
    the reference's, bitwise; a stale record (in-place write) is not used."""
    monkeypatch.setattr(fast, "device_ok", lambda x: True)
    g, u, _ = _inputs((24, 64), torch.bfloat16)
    buf = triton_swiglu.amax_buffer(g, 1)
    h = triton_swiglu.swiglu_forward(g, u, amax_out=buf)
    known_amax.remember(h, buf[0].view(torch.float32))
    q = Float8CurrentScalingQuantizer(fp8)
    with policy(quantize_kernels=False):
        want = q.quantize(h).qstorage
    calls = []
    orig = _common.global_amax
    monkeypatch.setattr(_common, "global_amax", lambda x, **kw: calls.append(1) or orig(x, **kw))
    got = q.quantize(h.view(4, 6, 64)).qstorage
    assert calls == []
    for d in ("rowwise", "columnwise"):
        for name, t in want.payload(d).items():
            a, b = got.payload(d)[name].reshape(-1), t.reshape(-1)
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (d, name)
    h.mul_(2)
    q.quantize(h)
    assert calls == [1]


@interpreter_only
def test_fused_hybrid_fp8_current_block_uses_the_known_amax(monkeypatch):
    """Hybrid(row=FP8 current, col=FP8 block 1D), the fused kernel of the hybrid recipe, takes the
    recorded amax too (its rowwise scale is the FP8-current one), bitwise the reference."""
    from hybridfp import Float8BlockQuantizer, HybridQuantizer
    monkeypatch.setattr(fast, "device_ok", lambda x: True)
    g, u, _ = _inputs((24, 256), torch.bfloat16)
    buf = triton_swiglu.amax_buffer(g, 1)
    h = triton_swiglu.swiglu_forward(g, u, amax_out=buf)
    known_amax.remember(h, buf[0].view(torch.float32))
    q = HybridQuantizer(Float8CurrentScalingQuantizer(), Float8BlockQuantizer(torch.float8_e5m2, block_scaling_dim=1))
    with policy(quantize_kernels=False):
        want = q.quantize(h).qstorage
    calls = []
    orig = _common.global_amax
    monkeypatch.setattr(_common, "global_amax", lambda x, **kw: calls.append(1) or orig(x, **kw))
    got = q.quantize(h).qstorage
    assert calls == []
    for d in ("rowwise", "columnwise"):
        for name, t in want.part(d).payload(d).items():
            a, b = got.part(d).payload(d)[name].reshape(-1), t.reshape(-1)
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (d, name)
    h.mul_(2)
    q.quantize(h)
    assert calls == [1]  # the kernel path ran (its own amax pass, the record being stale)


@gpu
@needs_cuda
@pytest.mark.parametrize("rows", [4096, 1000])
def test_gpu_mlp_step_bitwise_with_three_amax_passes_fewer(rows, monkeypatch):
    torch.manual_seed(0)
    base = GatedMLP(1024, 2816)
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    calls: list[int] = []
    orig = _common.global_amax
    monkeypatch.setattr(_common, "global_amax", lambda t, **kw: calls.append(1) or orig(t, **kw))
    results, counts = [], []
    for record in (True, False):
        if not record:
            monkeypatch.setattr(known_amax, "recall", lambda t: None)
        m = copy.deepcopy(base)
        xi = x.clone().requires_grad_()
        calls.clear()
        with poisoned_outputs(), autocast(recipe=Float8CurrentScaling()):
            y = m(xi)
        y.backward(dy)
        results.append((y, xi.grad, [p.grad for p in m.parameters()]))
        counts.append(len(calls))
    (y1, dx1, g1), (y0, dx0, g0) = results
    assert torch.equal(y1, y0) and torch.equal(dx1, dx0)
    assert all(torch.equal(a, b) for a, b in zip(g1, g0))
    assert counts[0] == counts[1] - 3, counts  # h, d-gate, d-up


@interpreter_only
def test_layernorm_mlp_quantizes_fc1s_gradient_without_its_own_amax_pass(monkeypatch):
    """LayerNormMLP's SwiGLU takes fc1's output as one tensor, so the gradient fc1's backward
    quantizes is one recorded tensor: one amax pass fewer a step than through the two-tensor form
    (whose dg, du are concatenated into a tensor with no record), and the same gradients bit for bit."""
    from hybridfp.nn import layernorm_mlp
    monkeypatch.setattr(swiglu_module, "_uses_kernels", lambda g: True)
    monkeypatch.setattr(fast, "device_ok", lambda x: True)
    torch.manual_seed(0)
    mlp = hybridfp.LayerNormMLP(64, 32, activation="swiglu", normalization="RMSNorm", bias=False,
                                params_dtype=torch.bfloat16)
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    dy = torch.randn(16, 64, dtype=torch.bfloat16)
    calls: list[int] = []
    orig = _common.global_amax
    monkeypatch.setattr(_common, "global_amax", lambda t, **kw: calls.append(1) or orig(t, **kw))

    def step() -> tuple[int, list[torch.Tensor]]:
        calls.clear()
        xi = x.clone().requires_grad_()
        with autocast(recipe=Float8CurrentScaling()):
            mlp(xi).backward(dy)
        grads = [xi.grad] + [p.grad.clone() for p in mlp.parameters()]
        mlp.zero_grad(set_to_none=True)
        return len(calls), grads
    step()  # the first region builds the quantizers (the SwiGLU records from then on)
    one, grads_one = step()
    two_tensor = lambda activation, y: hybridfp.swiglu(*y.chunk(2, dim=-1))  # noqa: E731
    monkeypatch.setattr(layernorm_mlp, "activate", two_tensor)
    two, grads_two = step()
    assert one == two - 1 and one > 0, (one, two)
    assert all(torch.equal(a, b) for a, b in zip(grads_one, grads_two))


def _segment_reference(x: torch.Tensor, splits: list[int]) -> torch.Tensor:
    """Each row group's amax as FP8 current scaling's grouped encode computes it off the kernels."""
    from hybridfp.moe import quantize_scaled
    return quantize_scaled._segment_amax(x, torch.tensor(splits))


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("specials", [False, True])
def test_kernel_group_amaxes_are_the_segmented_amaxes_bitwise(dtype, specials):
    """Per row group (an empty group included: 0), forward max|h| and backward max over dg and du,
    bitwise the grouped encode's own segmented amax; NaN the canonical NaN."""
    from hybridfp.utils.device import row_groups
    g, u, dh = _inputs((12, 40), dtype, specials=specials)
    splits = [3, 0, 5, 4]
    groups = row_groups(splits, "cpu")
    buf = triton_swiglu.amax_buffer(g, 4)
    h = triton_swiglu.swiglu_forward(g, u, amax_out=buf, row_groups=groups)
    want = _segment_reference(h, splits)
    assert torch.equal(buf.view(torch.float32).isnan(), want.isnan())
    assert buf[~want.isnan()].tolist() == want[~want.isnan()].view(torch.int32).tolist()
    assert int(buf[1]) == 0
    buf2 = triton_swiglu.amax_buffer(g, 4)
    dgu = torch.empty(12, 80, dtype=dtype)
    triton_swiglu.swiglu_backward(dh, g, u, amax_out=buf2, out=(dgu[:, :40], dgu[:, 40:]), row_groups=groups)
    want2 = _segment_reference(dgu, splits)
    nan = want2.isnan()
    assert torch.equal(buf2.view(torch.float32).isnan(), nan) and (buf2[nan] == 0x7FC00000).all()
    assert buf2[~nan].tolist() == want2[~nan].view(torch.int32).tolist()
    assert nan.any() == specials  # dh's NaN reaches dg and du
    with pytest.raises(ValueError, match="row_groups must be int32 \\[12\\]"):
        triton_swiglu.swiglu_forward(g, u, amax_out=buf, row_groups=groups[:5])
    with pytest.raises(ValueError, match="without amax_out"):
        triton_swiglu.swiglu_forward(g, u, row_groups=groups)


def _experts_step(monkeypatch, with_splits: bool) -> tuple[int, list[torch.Tensor]]:
    """fc2(swiglu(fc1(x))) of two GroupedLinear under FP8 current, the SwiGLU on its kernels
    (forced on CPU tensors): (per-expert amax passes of the second region, its gradients)."""
    from hybridfp.moe import quantize_scaled
    monkeypatch.setattr(swiglu_module, "_uses_kernels", lambda g: True)
    calls: list[int] = []
    orig = quantize_scaled._segment_amax
    monkeypatch.setattr(quantize_scaled, "_segment_amax", lambda x, c: calls.append(1) or orig(x, c))
    torch.manual_seed(0)
    kw = dict(bias=False, params_dtype=torch.bfloat16)
    fc1, fc2 = hybridfp.GroupedLinear(3, 32, 2 * 48, **kw), hybridfp.GroupedLinear(3, 48, 32, **kw)
    splits = [5, 0, 11]
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    dy = torch.randn(16, 32, dtype=torch.bfloat16)
    for _ in range(2):  # the first region builds the quantizers
        calls.clear()
        xi = x.clone().requires_grad_()
        with autocast(recipe=Float8CurrentScaling()):
            h = fc1(xi, splits)
            a = hybridfp.swiglu(h, splits=splits) if with_splits else hybridfp.swiglu(h)
            y = fc2(a, splits)
        y.backward(dy)
        grads = [y.detach(), xi.grad] + [w.grad.clone() for w in (*fc1.weights(), *fc2.weights())]
        for w in (*fc1.weights(), *fc2.weights()):
            w.grad = None
    return len(calls), grads


@interpreter_only
def test_grouped_linear_takes_the_experts_amaxes_the_swiglu_recorded(monkeypatch):
    """With the row groups the SwiGLU records each expert's amax of h and of fc1's gradient, and
    the GroupedLinears skip their segmented amax pass over those two tensors: the same outputs
    and gradients bit for bit."""
    with_groups, got = _experts_step(monkeypatch, True)
    without, want = _experts_step(monkeypatch, False)
    assert with_groups == without - 2 and with_groups > 0, (with_groups, without)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_swiglu_splits_errors():
    gu = torch.randn(6, 8)
    with pytest.raises(ValueError, match="adding up to the rows"):
        hybridfp.swiglu(gu, splits=[2, 3])
    with pytest.raises(ValueError, match="adding up to the rows"):
        hybridfp.swiglu(gu.view(2, 3, 8), splits=[6])
    with pytest.raises(ValueError, match="one-tensor form"):
        hybridfp.swiglu(gu[:, :4], gu[:, 4:], splits=[6])
    assert torch.equal(hybridfp.swiglu(gu, splits=[2, 4]), hybridfp.swiglu(gu))


@gpu
@needs_cuda
def test_gpu_experts_take_the_recorded_amaxes_bitwise(monkeypatch):
    """On CUDA (the grouped FP8 kernels): two per-expert amax passes fewer a step with the SwiGLU
    given the experts' rows, and the same outputs and gradients bit for bit."""
    from hybridfp.kernels.moe import triton_grouped_fp8
    calls: list[int] = []
    orig = triton_grouped_fp8.group_amax
    monkeypatch.setattr(triton_grouped_fp8, "group_amax", lambda *a, **kw: calls.append(1) or orig(*a, **kw))
    torch.manual_seed(0)
    kw = dict(bias=False, params_dtype=torch.bfloat16, device="cuda")
    fc1, fc2 = hybridfp.GroupedLinear(4, 256, 2 * 512, **kw), hybridfp.GroupedLinear(4, 512, 256, **kw)
    splits = [300, 0, 517, 207]
    x = torch.randn(1024, 256, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(1024, 256, dtype=torch.bfloat16, device="cuda")
    results: dict[bool, list] = {}
    for with_splits in (True, False, True):
        for _ in range(2):
            calls.clear()
            xi = x.clone().requires_grad_()
            with autocast(recipe=Float8CurrentScaling()):
                h = fc1(xi, splits)
                y = fc2(hybridfp.swiglu(h, splits=splits) if with_splits else hybridfp.swiglu(h), splits)
            y.backward(dy)
            grads = [y.detach(), xi.grad] + [w.grad.clone() for w in (*fc1.weights(), *fc2.weights())]
            for w in (*fc1.weights(), *fc2.weights()):
                w.grad = None
        results.setdefault(with_splits, []).append((len(calls), grads))
    (n_without, want), = results[False]
    for n_with, got in results[True]:  # before and after a step without the records
        assert n_with == n_without - 2, (n_with, n_without)
        assert all(torch.equal(a, b) for a, b in zip(got, want))



def test_an_amax_reduction_leaves_the_experts_recorded_amaxes_their_own(monkeypatch):
    """The amax all-reduce works in place: the grouped encode reduces a copy of the recorded
    per-expert amaxes, so the record stays x's own (a second reader gets x's amax)."""
    from hybridfp.moe import quantize_scaled
    monkeypatch.setattr(quantize_scaled, "all_reduce_amax", lambda amax, group: amax.mul_(4))  # a "remote" max
    x = torch.randn(10, 16, dtype=torch.bfloat16)
    splits = [4, 6]
    own = quantize_scaled._segment_amax(x, torch.tensor(splits))
    known_amax.remember(x, own.clone(), splits)
    q = Float8CurrentScalingQuantizer(amax_reduction_group=object(), with_amax_reduction=True)
    quantize_scaled.encode_group_scaled(q, x, splits, True, False, kernel=False)
    assert torch.equal(known_amax.recall(x, splits), own)
