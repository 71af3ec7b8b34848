"""``swiglu`` / ``SwiGLU`` and the fused Triton kernels (hybridfp/kernels/triton_swiglu.py).

The torch path (CPU) is bitwise eager ``F.silu(g) * u`` and its autograd backward. The kernels
mirror eager's FP32 formulas and rounding points, but their exponential is not torch's (numpy's
under the interpreter vs SLEEF in torch on the CPU; on CUDA both call libdevice's ``expf``, so
there the results are expected bitwise, but only the bounds are asserted). Verified bounds, in
ulps of the output dtype at the eager value:

* ``s = silu(g)`` (the kernel's rounded silu, read as ``h`` with ``u = 1``): BF16 / FP16 within
  1 ulp; FP32 within 16 ulp. Both sides compute ``g / (1 + exp(-g))`` with the same IEEE ops and
  no cancellation (1 + exp(-g) adds positives), so exps a few FP32 ulps apart move the FP32
  silu by a few ulps (measured <= 4) and its one rounding to BF16 / FP16 by at most 1 ulp.
* ``h = round(s * u)`` and ``du = round(dh * s)``: bitwise torch's mul of the kernel's own ``s``
  (checked), hence within 2 ulp of eager for BF16 / FP16 (``s`` 1 ulp off moves the exact
  product by less than 2 ulps of the result; measured: BF16 0, FP16 2 in ~200 of 1e6 elements)
  and 32 ulp for FP32 (measured <= 5).
* ``dg = round(ds * sig * (1 + g * (1 - sig)))`` with ``ds = round(dh * u)`` bitwise eager's:
  within 1 ulp + 2**-20 * |ds| * sig(g) * (1 + |g|). The second term is 16 FP32 ulps of the
  magnitudes the FP32 factor is computed from: near silu's minimum (g ~ -1.278) the factor
  1 + g * (1 - sig) cancels, so a few-ulp difference in sig is many ulps of dg there (FP32
  inputs: measured 85737 ulps at a g within 1e-4 of the root); everywhere else it is below 1
  ulp of BF16 / FP16.

NaN positions must agree (bits are not compared: torch's NaN bits differ by device); infinities
must be equal.
"""

from __future__ import annotations

import importlib
import os

import torch

# The kernels run in Triton's interpreter without CUDA; the variable must be set before Triton
# is imported (as tests/kernels/conftest.py does for the kernel tests).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language.standard  # noqa: E402

import hybridfp  # noqa: E402
from hybridfp.kernels import triton_swiglu  # noqa: E402
from hybridfp.kernels._common import poisoned_outputs  # noqa: E402
from hybridfp.nn import SwiGLU, swiglu  # noqa: E402

#: ``hybridfp.nn.swiglu`` the module (the package attribute of that name is the function).
swiglu_module = importlib.import_module("hybridfp.nn.swiglu")

HAS_CUDA = torch.cuda.is_available()
INTERPRET = (os.environ.get("TRITON_INTERPRET") == "1"
             and type(triton.language.standard.cdiv).__name__ == "InterpretedFunction")
interpreter_only = pytest.mark.skipif(
    not INTERPRET, reason="CPU kernel tests need Triton in interpreter mode (TRITON_INTERPRET=1 before "
    "triton is imported)")


def gpu(test):
    """Marks a test ``gpu`` and skips it without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")(test))


# NaN / inf / overflow inputs are deliberate; numpy (the interpreter) warns about them.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
#: Awkward tiny shapes: one element, one row, N not a multiple of any tile (2100 > MAX_BLOCK).
SHAPES = [(1, 1), (1, 37), (3, 40), (5, 2100), (7, 16)]
SILU_ULPS = {torch.bfloat16: 1, torch.float16: 1, torch.float32: 16}
PRODUCT_ULPS = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 32}
#: Weight of the cancellation term of dg's bound (module docstring).
DG_TERM = 2.0 ** -20
#: (fraction bits, smallest normal exponent) per dtype, for ulp().
GRID = {torch.bfloat16: (7, -126), torch.float16: (10, -14), torch.float32: (23, -126)}


# ---------------------------------------------------------------------------- helpers
def eager(g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(h, dg, du) of eager ``F.silu(g) * u`` with autograd."""
    g, u = g.detach().clone().requires_grad_(), u.detach().clone().requires_grad_()
    h = F.silu(g) * u
    h.backward(dh)
    return h.detach(), g.grad, u.grad


def ulp(r: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype``'s grid at |r| (FP64; subnormal spacing below the normal range)."""
    mant, emin = GRID[dtype]
    _, e = torch.frexp(r.double().abs())  # |r| = m * 2**e with m in [0.5, 1)
    return torch.exp2((torch.clamp(e - 1, min=emin) - mant).double())


def assert_within(out: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor, what: str) -> None:
    """|out - ref| <= tol where ref is finite; equal infinities; NaN at the same places."""
    o, r = out.double(), ref.double()
    assert out.dtype == ref.dtype and out.shape == ref.shape, what
    assert torch.equal(o.isnan(), r.isnan()), f"{what}: NaN positions differ"
    inf = r.isinf()
    assert torch.equal(o[inf], r[inf]), f"{what}: infinities differ"
    fin = r.isfinite()
    err = torch.where(fin, (o - r).abs(), torch.zeros_like(o))
    bad = fin & ~(err <= tol)
    if bad.any():
        i = bad.nonzero()[0].tolist()
        pytest.fail(f"{what}: {int(bad.sum())} of {r.numel()} elements outside the bound; e.g. at {i}: "
                    f"{o[tuple(i)].item()!r} vs eager {r[tuple(i)].item()!r} (tol {tol[tuple(i)].item()!r})")


def assert_bitwise(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Equal bits where not NaN, NaN at the same places."""
    nan = ref.isnan()
    assert torch.equal(out.isnan(), nan), f"{what}: NaN positions differ"
    o, r = out.float()[~nan], ref.float()[~nan]
    assert torch.equal(o.view(torch.int32), r.view(torch.int32)), \
        f"{what}: {int((o.view(torch.int32) != r.view(torch.int32)).sum())} elements differ"


def check_kernels(g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor, dg: torch.Tensor, du: torch.Tensor,
                  h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel outputs (h, dg, du) for inputs (g, u, dh) against eager torch within the bounds of
    the module docstring, and h / du bitwise torch's products with the kernel's own silu.
    Returns eager torch's (h, dg)."""
    dt = g.dtype
    rh, rdg, rdu = eager(g, u, dh)
    s = triton_swiglu.swiglu_forward(g, torch.ones(g.shape, dtype=dt, device=g.device))  # h at u = 1: silu
    assert_within(s, F.silu(g), SILU_ULPS[dt] * ulp(F.silu(g), dt), "silu")
    assert_bitwise(h, s * u, "h = s * u")
    assert_bitwise(du, dh * s, "du = dh * s")
    assert_within(h, rh, PRODUCT_ULPS[dt] * ulp(rh, dt), "h")
    assert_within(du, rdu, PRODUCT_ULPS[dt] * ulp(rdu, dt), "du")
    g64, ds64 = g.double(), (dh * u).double()
    term = DG_TERM * (ds64 * torch.sigmoid(g64)).abs() * (1 + g64.abs())
    assert_within(dg, rdg, ulp(rdg, dt) + torch.nan_to_num(term, nan=0.0), "dg")
    return rh, rdg


def inputs(shape: tuple[int, int], dtype: torch.dtype, seed: int = 0, device: str = "cpu",
           strided: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(g, u, dh): g spread over silu's range (|g| up to ~20), u and dh standard normal. With
    ``strided``, g and u are the halves of one [M, 2N] tensor (row stride 2N)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    m, n = shape
    g = torch.randn(m, n, generator=gen, device=device) * 4
    u = torch.randn(m, n, generator=gen, device=device)
    dh = torch.randn(m, n, generator=gen, device=device).to(dtype)
    if strided:
        gu = torch.cat([g, u], dim=1).to(dtype)
        return gu[:, :n], gu[:, n:], dh
    return g.to(dtype), u.to(dtype), dh


def edge_grid(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every combination of edge values for g, u and dh (zeros, silu's minimum, exp overflow,
    dtype extremes, subnormals, ±inf, NaN)."""
    fi = torch.finfo(dtype)
    gv = [0.0, -0.0, 1.0, -1.0, -1.2784645, -1.28125, 20.0, -20.0, 88.5, -88.5, 90.0, -90.0, 1e4, -1e4,
          fi.max, -fi.max, fi.tiny, -fi.tiny, fi.tiny / 4, float("inf"), float("-inf"), float("nan")]
    uv = [0.0, -0.0, 1.0, -3.5, fi.max, fi.tiny / 4, float("inf"), float("-inf"), float("nan")]
    g, u, dh = torch.meshgrid(torch.tensor(gv), torch.tensor(uv), torch.tensor(uv), indexing="ij")
    return tuple(t.reshape(len(gv), -1).to(dtype).contiguous() for t in (g, u, dh))


# ---------------------------------------------------------------------------- torch path (CPU)
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("shape", [(4, 33), (2, 3, 20), (7,), ()])
def test_function_is_eager_bitwise(dtype, shape):
    gen = torch.Generator().manual_seed(1)
    g, u, dh = (torch.randn(shape, generator=gen).mul(3).to(dtype) for _ in range(3))
    rh, rdg, rdu = eager(g, u, dh)
    g, u = g.clone().requires_grad_(), u.clone().requires_grad_()
    h = swiglu(g, u)
    h.backward(dh)
    for out, ref, what in ((h, rh, "h"), (g.grad, rdg, "dg"), (u.grad, rdu, "du")):
        assert out.shape == ref.shape and torch.equal(out, ref), what


def test_gradcheck_float64():
    gen = torch.Generator().manual_seed(2)
    g = (torch.randn(5, 7, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    u = torch.randn(5, 7, generator=gen, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(swiglu, (g, u))


def test_saves_only_g_and_u():
    g, u = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        swiglu(g, u)
    assert len(saved) == 2 and saved[0] is g and saved[1] is u


def test_grad_of_one_input_only():
    g, u = torch.randn(3, 5), torch.randn(3, 5, requires_grad=True)
    swiglu(g, u).sum().backward()
    assert g.grad is None and torch.equal(u.grad, F.silu(g))


def test_module_splits_one_input_into_gate_and_up():
    gu = torch.randn(2, 3, 16, requires_grad=True)
    h = SwiGLU()(gu)
    assert torch.equal(h, F.silu(gu[..., :8]) * gu[..., 8:])
    assert torch.equal(SwiGLU()(gu[..., :8], gu[..., 8:]), h)
    assert hybridfp.SwiGLU is SwiGLU and hybridfp.swiglu is swiglu


@pytest.mark.parametrize("g, u, match", [
    (torch.randn(3, 4), torch.randn(4, 3), "gate g has shape \\(3, 4\\) but up u has shape \\(4, 3\\)"),
    (torch.randn(3, 4), torch.randn(3, 4, dtype=torch.float64), "gate g is torch.float32 but up u is torch.float64"),
    (torch.randn(3, 4), torch.empty(3, 4, device="meta"), "gate g is on cpu but up u is on meta"),
    (torch.ones(3, 4, dtype=torch.int32), torch.ones(3, 4, dtype=torch.int32), "must be floating point"),
])
def test_errors_name_the_tensors(g, u, match):
    with pytest.raises((ValueError, TypeError), match=match):
        swiglu(g, u)


def test_module_one_input_needs_even_last_dim():
    with pytest.raises(ValueError, match="two halves"):
        SwiGLU()(torch.randn(2, 7))


# ---------------------------------------------------------------------------- kernels (interpreter)
@interpreter_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("strided", [False, True])
def test_kernels_match_eager(dtype, shape, strided):
    g, u, dh = inputs(shape, dtype, seed=shape[0] * 1000 + shape[1], strided=strided)
    with poisoned_outputs():
        h = triton_swiglu.swiglu_forward(g, u)
        dg, du = triton_swiglu.swiglu_backward(dh, g, u)
    check_kernels(g, u, dh, dg, du, h)


@interpreter_only
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_edge_values(dtype):
    g, u, dh = edge_grid(dtype)
    with poisoned_outputs():
        h = triton_swiglu.swiglu_forward(g, u)
        dg, du = triton_swiglu.swiglu_backward(dh, g, u)
    check_kernels(g, u, dh, dg, du, h)
    assert h.isnan().any() and dg.isnan().any() and h.isinf().any()  # the grid does reach them


@interpreter_only
@pytest.mark.parametrize("shape", [(0, 8), (4, 0), (0, 0)])
def test_kernels_empty(shape):
    g = torch.empty(shape, dtype=torch.bfloat16)
    assert triton_swiglu.swiglu_forward(g, g).shape == shape
    dg, du = triton_swiglu.swiglu_backward(g, g, g)
    assert dg.shape == du.shape == shape


@interpreter_only
def test_kernels_reject_what_they_cannot_read():
    g = torch.randn(4, 6)
    with pytest.raises(ValueError, match="unit inner stride"):
        triton_swiglu.swiglu_forward(g, torch.randn(6, 4).t())
    with pytest.raises(ValueError, match="2D"):
        triton_swiglu.swiglu_forward(g.view(2, 2, 6), g.view(2, 2, 6))
    with pytest.raises(ValueError, match="expected \\(4, 6\\) torch.float32"):
        triton_swiglu.swiglu_backward(g.half(), g, g)


@interpreter_only
@pytest.mark.parametrize("dtype", DTYPES)
def test_function_kernel_path(monkeypatch, dtype):
    """The autograd function on the kernel path (forced on CPU tensors): 3D halves of a fused
    projection read in place, a transposed (non-unit inner stride) input copied, grads wired."""
    monkeypatch.setattr(swiglu_module, "_uses_kernels", lambda g: True)
    gen = torch.Generator().manual_seed(3)
    gu = (torch.randn(2, 3, 2 * 37, generator=gen) * 4).to(dtype).requires_grad_()
    up_t = torch.randn(37, 6, generator=gen).to(dtype).requires_grad_()
    dh = torch.randn(2, 3, 37, generator=gen).to(dtype)
    g = gu[..., :37]
    u = up_t.t().reshape(2, 3, 37)  # a view with inner stride 6: the function copies it
    h = swiglu(g, u)
    h.backward(dh)
    g2, u2, dh2 = g.detach().reshape(6, 37), u.detach().reshape(6, 37), dh.reshape(6, 37)
    dg = gu.grad[..., :37].reshape(6, 37)
    assert torch.equal(gu.grad[..., 37:], torch.zeros_like(gu.grad[..., 37:]))
    du = up_t.grad.t().reshape(6, 37)
    check_kernels(g2, u2, dh2, dg, du, h.detach().reshape(6, 37))
    a, b = gu.detach()[..., :37], gu.detach()[..., 37:]
    assert torch.equal(swiglu(a.transpose(0, 1), b.transpose(0, 1)), swiglu(a, b).transpose(0, 1))


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("shape", [(4, 66), (2, 3, 40), (8,)])
def test_one_tensor_form_is_eager_bitwise(dtype, shape):
    """``swiglu(gate_up)`` / ``SwiGLU()(gate_up)`` off the kernels: eager torch's values and
    gradient bit for bit (the halves' gradients concatenated, as chunk's backward does)."""
    gen = torch.Generator().manual_seed(len(shape))
    gu = (torch.randn(shape, generator=gen) * 4).to(dtype)
    dh = torch.randn((*shape[:-1], shape[-1] // 2), generator=gen).to(dtype)
    ref = gu.clone().requires_grad_()
    g, u = ref.chunk(2, dim=-1)
    (F.silu(g) * u).backward(dh)
    for act in (swiglu, SwiGLU()):
        mine = gu.clone().requires_grad_()
        h = act(mine)
        h.backward(dh)
        assert torch.equal(h, F.silu(gu.chunk(2, -1)[0]) * gu.chunk(2, -1)[1])
        assert torch.equal(mine.grad, ref.grad)


def test_one_tensor_form_errors():
    with pytest.raises(ValueError, match="two halves"):
        swiglu(torch.randn(3, 5))
    with pytest.raises(ValueError, match="two halves"):
        swiglu(torch.tensor(1.0))
    with pytest.raises(TypeError, match="gate_up must be floating point"):
        swiglu(torch.ones(2, 4, dtype=torch.int32))


@interpreter_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 2 * 37), (2, 3, 2 * 40), (5, 2 * 2100)])
def test_one_tensor_form_kernel_path_is_the_two_tensor_forms(monkeypatch, dtype, shape):
    """On the kernel path (forced on CPU tensors) the one-tensor form gives the two-tensor form's
    output and gradients bit for bit, its gradient written straight into one tensor's halves."""
    monkeypatch.setattr(swiglu_module, "_uses_kernels", lambda g: True)
    gen = torch.Generator().manual_seed(shape[-1])
    gu = (torch.randn(shape, generator=gen) * 4).to(dtype)
    dh = torch.randn((*shape[:-1], shape[-1] // 2), generator=gen).to(dtype)
    two = gu.clone().requires_grad_()
    h2 = swiglu(*two.chunk(2, dim=-1))
    h2.backward(dh)
    one = gu.clone().requires_grad_()
    with poisoned_outputs():
        h1 = swiglu(one)
        h1.backward(dh)
    assert_bitwise(h1, h2.detach(), "h")
    assert_bitwise(one.grad, two.grad, "d(gate_up)")
    assert one.grad.is_contiguous() and one.grad.shape == gu.shape


@interpreter_only
def test_one_tensor_form_reads_a_transposed_input(monkeypatch):
    """A [2F, M] tensor's transpose (inner stride M) is copied first, as the module docstring says."""
    monkeypatch.setattr(swiglu_module, "_uses_kernels", lambda g: True)
    gu_t = torch.randn(2 * 9, 5).requires_grad_()
    h = swiglu(gu_t.t())
    h.backward(torch.ones(5, 9))
    ref = gu_t.detach().clone().requires_grad_()
    g, u = ref.t().chunk(2, dim=-1)
    (F.silu(g) * u).backward(torch.ones(5, 9))
    assert_within(h, (F.silu(g) * u).detach(), 16 * ulp(F.silu(g) * u, torch.float32), "h")
    assert gu_t.grad.shape == gu_t.shape and torch.isfinite(gu_t.grad).all()
    assert_bitwise(gu_t.grad, swiglu_grads_via_two_forms(gu_t.detach().t()).t(), "grad")


def test_one_tensor_forms_output_may_be_written_in_place():
    """Off the kernels the output is a tensor of its own, as eager ``F.silu(g) * u``'s is."""
    gu = torch.randn(3, 2, 16, requires_grad=True)
    h = swiglu(gu)
    h.mul_(2)
    h.sum().backward()
    g, u = gu.detach().chunk(2, dim=-1)
    ref = gu.detach().clone().requires_grad_()
    (2 * (F.silu(ref[..., :8]) * ref[..., 8:])).sum().backward()
    assert torch.equal(h.detach(), 2 * (F.silu(g) * u)) and torch.equal(gu.grad, ref.grad)


@interpreter_only
def test_one_tensor_forms_kernel_output_is_no_view(monkeypatch):
    monkeypatch.setattr(swiglu_module, "_uses_kernels", lambda g: True)
    gu = torch.randn(2, 3, 20, requires_grad=True)
    h = swiglu(gu)
    assert h._base is None and h.shape == (2, 3, 10)
    h.add_(1)  # allowed: not a view of a Function's output


@interpreter_only
def test_kernels_writing_into_out_make_its_records_stale():
    from hybridfp.tensors import known_amax
    g, u, dh = inputs((4, 24), torch.bfloat16, seed=9)
    h = torch.zeros(4, 24, dtype=torch.bfloat16)
    known_amax.remember(h, torch.tensor(0.0))
    triton_swiglu.swiglu_forward(g, u, out=h)
    assert known_amax.recall(h) is None and h.abs().max() > 0
    dgu = torch.zeros(4, 48, dtype=torch.bfloat16)
    known_amax.remember(dgu, torch.tensor(0.0))
    triton_swiglu.swiglu_backward(dh, g, u, out=(dgu[:, :24], dgu[:, 24:]))
    assert known_amax.recall(dgu) is None
    with pytest.raises(ValueError, match="out is \\(4, 23\\)"):
        triton_swiglu.swiglu_forward(g, u, out=h[:, :23])


def swiglu_grads_via_two_forms(gu: torch.Tensor) -> torch.Tensor:
    """d(sum of swiglu(g, u)) / d(gu) through the two-tensor form (the caller forces kernels)."""
    x = gu.detach().contiguous().requires_grad_()
    swiglu(*x.chunk(2, dim=-1)).sum().backward()
    return x.grad


@interpreter_only
def test_backward_kernel_writes_the_given_outputs():
    g, u, dh = inputs((4, 50), torch.bfloat16, seed=7)
    dgu = torch.full((4, 100), float("nan"), dtype=torch.bfloat16)
    dg, du = triton_swiglu.swiglu_backward(dh, g, u, out=(dgu[:, :50], dgu[:, 50:]))
    ref_dg, ref_du = triton_swiglu.swiglu_backward(dh, g, u)
    assert dg.data_ptr() == dgu.data_ptr() and du.data_ptr() == dgu[:, 50:].data_ptr()
    assert_bitwise(dgu[:, :50], ref_dg, "dg")
    assert_bitwise(dgu[:, 50:], ref_du, "du")
    with pytest.raises(ValueError, match="out\\[1\\] \\(du\\) is \\(4, 49\\)"):
        triton_swiglu.swiglu_backward(dh, g, u, out=(dgu[:, :50], dgu[:, 50:99]))
    with pytest.raises(ValueError, match="out\\[0\\] \\(dg\\) needs|unit inner stride"):
        triton_swiglu.swiglu_backward(dh, g, u, out=(torch.empty(50, 4, dtype=torch.bfloat16).t(), dgu[:, 50:]))


def _penalised_grads(g: torch.Tensor, u: torch.Tensor, act, loss_of) -> tuple[torch.Tensor, torch.Tensor]:
    """d/d(g, u) of the squared norm of d loss / d(g, u) (a gradient penalty)."""
    dg, du = torch.autograd.grad(loss_of(act(g, u)), (g, u), create_graph=True)
    return torch.autograd.grad(dg.square().sum() + du.square().sum(), (g, u))


@pytest.mark.parametrize("loss", ["squared", "linear"])
def test_double_backward_of_the_eager_ops_is_torchs(loss):
    """Off the kernels (CPU) the backward's ops are recorded: a gradient penalty through swiglu
    gets torch's second-order terms, also for a loss linear in h (whose incoming gradient is a
    constant: dg, du still depend on g and u). The graphs differ (silu recomputed in backward),
    so the terms reaching g add in another order: equal to float64 rounding."""
    loss_of = {"squared": lambda h: h.square().sum(), "linear": lambda h: (h * 0.5).sum()}[loss]
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(6, 10, generator=gen, dtype=torch.float64, requires_grad=True)
    u = torch.randn(6, 10, generator=gen, dtype=torch.float64, requires_grad=True)
    ours = _penalised_grads(g, u, swiglu, loss_of)
    ref = _penalised_grads(g, u, lambda a, b: F.silu(a) * b, loss_of)
    assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(ours, ref))
    assert all(a.abs().sum() > 0 for a in ours)


def test_double_backward_of_the_one_tensor_form_is_torchs():
    """The one-tensor form's eager backward is recorded too: a gradient penalty through
    ``swiglu(gate_up)`` gets torch's second-order terms (to float64 rounding)."""
    gen = torch.Generator().manual_seed(6)
    gu = torch.randn(6, 20, generator=gen, dtype=torch.float64, requires_grad=True)

    def penalised(act) -> torch.Tensor:
        (d,) = torch.autograd.grad(act(gu).square().sum(), gu, create_graph=True)
        return torch.autograd.grad(d.square().sum(), gu)[0]
    ours = penalised(swiglu)
    ref = penalised(lambda x: F.silu(x[:, :10]) * x[:, 10:])
    assert torch.allclose(ours, ref, rtol=1e-12, atol=1e-12) and ours.abs().sum() > 0

@interpreter_only
@pytest.mark.parametrize("loss", ["squared", "linear"])
def test_double_backward_through_the_kernels_raises(monkeypatch, loss):
    """The kernels' backward is not recorded: differentiating its results again raises, naming
    swiglu, also for a loss linear in h (where torch's once_differentiable would return the
    results as constants and the penalty's terms would drop silently); a create_graph=True pass
    whose gradients are not differentiated again still works."""
    monkeypatch.setattr(swiglu_module, "_uses_kernels", lambda g: True)
    loss_of = {"squared": lambda h: h.square().sum(), "linear": lambda h: (h * 0.5).sum()}[loss]
    g = torch.randn(4, 8, requires_grad=True)
    u = torch.randn(4, 8, requires_grad=True)
    dg, du = torch.autograd.grad(loss_of(swiglu(g, u)), (g, u), create_graph=True)
    ref_dg, ref_du = torch.autograd.grad(loss_of(F.silu(g) * u), (g, u))
    assert torch.allclose(dg, ref_dg, rtol=1e-5, atol=1e-6) and torch.allclose(du, ref_du, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="swiglu: double backward is not supported on CUDA.*F.silu"):
        (dg.square().sum() + du.square().sum()).backward()


# ---------------------------------------------------------------------------- GPU
def fresh(shape: tuple[int, int], dtype: torch.dtype, strided: bool = False):
    """Fresh random CUDA inputs (seeded from os.urandom: every run differs)."""
    return inputs(shape, dtype, seed=int.from_bytes(os.urandom(4), "little"), device="cuda", strided=strided)


@gpu
@pytest.mark.parametrize("dtype, shape, strided", [
    (torch.bfloat16, (16384, 14336), False),   # Llama-3-8B MLP
    (torch.bfloat16, (333, 14337), True),      # awkward: odd N, halves of one [M, 2N] tensor
    (torch.float16, (333, 4099), True),
    (torch.float32, (333, 4099), False),
])
def test_gpu_kernels_match_eager(dtype, shape, strided):
    g, u, dh = fresh(shape, dtype, strided)
    with poisoned_outputs():
        h = triton_swiglu.swiglu_forward(g, u)
        dg, du = triton_swiglu.swiglu_backward(dh, g, u)
    # the kernels ran on the whole tensors; the FP64 checks run on row blocks, so the Llama
    # shape's check holds ~2 GiB instead of ~20 beside the other test workers on the GPU
    differ = torch.zeros(2, dtype=torch.float64, device=g.device)
    for rows in row_blocks(g.shape[0], CHECK_ROWS):
        rh, rdg = check_kernels(g[rows], u[rows], dh[rows], dg[rows], du[rows], h[rows])
        differ += torch.stack([(h[rows] != rh).double().sum(), (dg[rows] != rdg).double().sum()])
    if dtype == torch.bfloat16:
        # Both sides call CUDA's expf, so equal bits are expected; a differing libdevice build
        # would flip a rounding in ~2**-14 of the elements (few-ulp FP32 differences).
        assert (differ / h.numel() < 1e-3).all(), differ.tolist()


#: rows of one block of the GPU checks (each block's FP64 copies: ~1/8 of the Llama shape's)
CHECK_ROWS = 2048


def row_blocks(m: int, rows: int) -> list[slice]:
    """Row slices of at most ``rows`` rows covering ``range(m)`` in order.

    >>> row_blocks(5, 2)
    [slice(0, 2, None), slice(2, 4, None), slice(4, 5, None)]
    """
    return [slice(i, min(i + rows, m)) for i in range(0, m, rows)]


def test_row_blocks_cover_every_row_once():
    for m, rows in ((5, 2), (4096, 2048), (333, 2048), (1, 1)):
        covered = [i for s in row_blocks(m, rows) for i in range(m)[s]]
        assert covered == list(range(m))


@interpreter_only
def test_checks_on_row_blocks_are_the_checks_of_the_whole():
    """A wrong element caught by the whole-tensor check is caught in its block (CPU)."""
    g, u, dh = inputs((7, 33), torch.float32, seed=3, strided=True)
    h = triton_swiglu.swiglu_forward(g, u)
    dg, du = triton_swiglu.swiglu_backward(dh, g, u)
    for rows in row_blocks(7, 3):
        check_kernels(g[rows], u[rows], dh[rows], dg[rows], du[rows], h[rows])
    h[5, 31] += 1.0
    with pytest.raises(AssertionError):
        for rows in row_blocks(7, 3):
            check_kernels(g[rows], u[rows], dh[rows], dg[rows], du[rows], h[rows])


@gpu
def test_gpu_function_and_dtype_error():
    g, u, dh = fresh((257, 2 * 1000 + 3), torch.bfloat16)
    g, u = g.requires_grad_(), u.requires_grad_()
    h = swiglu(g, u)
    h.backward(dh)
    with torch.no_grad():
        ref = triton_swiglu.swiglu_forward(g, u)
        rdg, rdu = triton_swiglu.swiglu_backward(dh, g, u)
    assert torch.equal(h, ref) and torch.equal(g.grad, rdg) and torch.equal(u.grad, rdu)
    with pytest.raises(TypeError, match="float32, bfloat16 and float16"):
        swiglu(g.detach().double(), u.detach().double())


@gpu
def test_gpu_one_tensor_form_is_the_two_tensor_forms():
    """On CUDA ``swiglu(gate_up)`` gives the two-tensor form's output and gradient bit for bit,
    the gradient one contiguous [M, 2F] tensor."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    gu = (torch.randn(513, 2 * 1411, generator=gen, device="cuda") * 4).to(torch.bfloat16)
    dh = torch.randn(513, 1411, generator=gen, device="cuda").to(torch.bfloat16)
    one, two = gu.clone().requires_grad_(), gu.clone().requires_grad_()
    h1 = swiglu(one)
    h1.backward(dh)
    h2 = swiglu(*two.chunk(2, dim=-1))
    h2.backward(dh)
    assert torch.equal(h1, h2) and torch.equal(one.grad, two.grad) and one.grad.is_contiguous()


def test_splits_trace_under_torch_compile_as_they_change():
    """``swiglu(h, splits=...)`` with a new routing every call traces with ``fullgraph=True``
    (the splits checks use no builtin Dynamo cannot trace with changing ints)."""
    f = torch.compile(lambda h, s: swiglu(h, splits=s), backend="aot_eager", fullgraph=True)
    for s in ([6, 10], [7, 9], [5, 11]):
        h = torch.randn(16, 8, requires_grad=True)
        out = f(h, s)
        out.sum().backward()
        assert torch.equal(out, F.silu(h.detach()[:, :4]) * h.detach()[:, 4:])
