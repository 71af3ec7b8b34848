"""``backward_override="dequantized"`` on BF16 modules: backward multiplies exactly what the
forward multiplied. The forward's rowwise copies are decoded in FP32 where their values do not
fit BF16 (FP8 current scaling: code × a non-power-of-two scale; NVFP4: code × block scale ×
global scale), so dgrad / wgrad equal ``(dy.float() @ decode_fp32(copy)).to(bf16)`` bit for
bit; MXFP8 decodes fit BF16 and keep the BF16 path bit for bit (``F.linear`` in BF16, as
before). Linear, LayerNormMLP and GroupedLinear share the path (``backward_gemms``).

Also: GroupedLinear names ``offsets`` (not ``m_splits``) when the offsets have the wrong
length; ``gemm`` refuses a non-floating ``out_dtype``."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import hybridfp as hf
from hybridfp.gemm import gemm
from hybridfp.nn.layernorm_mlp import activate
from hybridfp.tensors import ROWWISE

BF16 = torch.bfloat16
RECIPES = {
    "fp8_current": lambda: hf.Float8CurrentScaling(backward_override="dequantized"),
    "nvfp4": lambda: hf.NVFP4BlockScaling(backward_override="dequantized"),
    "mxfp8": lambda: hf.MXFP8BlockScaling(backward_override="dequantized"),
}
NOT_BF16 = ("fp8_current", "nvfp4")  # decodes that BF16 cannot hold


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _decode32(module: torch.nn.Module, slot: str, index: int, t: torch.Tensor) -> torch.Tensor:
    """The forward's rowwise copy of ``t`` (a copy of the module's own quantizer: the forward
    quantizers of these recipes are deterministic), decoded in FP32."""
    q = module._quantizers[slot][index].copy()
    q.set_usage(rowwise=True, columnwise=False)
    return q.quantize(t.detach()).dequantize(direction=ROWWISE, dtype=torch.float32)


def _exact(dy: torch.Tensor, op32: torch.Tensor) -> torch.Tensor:
    """dy · op computed in FP32 (BF16 dy is exact in FP32), one cast to BF16."""
    return (dy.float() @ op32).to(BF16)


def _check(name: str, dy: torch.Tensor, op32: torch.Tensor, got: torch.Tensor) -> None:
    """``got`` is dy · op: exactly in FP32 for the non-BF16 decodes; for MXFP8 the BF16 decode
    (which equals the FP32 one) multiplied by F.linear in BF16, as the BF16 path always did."""
    if name in NOT_BF16:
        assert (op32.to(BF16).float() != op32).any(), "the case must exercise a decode BF16 cannot hold"
        ref = _exact(dy, op32)
    else:
        assert torch.equal(op32.to(BF16).float(), op32)
        ref = F.linear(dy, op32.to(BF16).t())
    assert got.dtype == BF16
    assert torch.equal(got, ref), f"{name}: {(got != ref).float().mean():.1%} differ, max " \
                                  f"{(got.float() - ref.float()).abs().max():.3g}"


@pytest.mark.parametrize("name", RECIPES)
def test_linear_dequantized_is_exact(name):
    torch.manual_seed(0)
    m = hf.Linear(256, 128, params_dtype=BF16, bias=False, name="lin")
    x = torch.randn(64, 256, dtype=BF16, requires_grad=True)
    with hf.autocast(recipe=RECIPES[name]()):
        y = m(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    _check(name, dy, _decode32(m, "weight", 0, m.weight), x.grad)                 # dgrad
    _check(name, dy.t().contiguous(), _decode32(m, "input", 0, x), m.weight.grad)  # wgrad


@pytest.mark.parametrize("name", RECIPES)
def test_grouped_linear_dequantized_is_exact(name):
    torch.manual_seed(0)
    splits = [32, 0, 64]
    g = hf.GroupedLinear(3, 128, 64, params_dtype=BF16, bias=False, name="experts")
    x = torch.randn(sum(splits), 128, dtype=BF16, requires_grad=True)
    with hf.autocast(recipe=RECIPES[name]()):
        y = g(x, splits)
    dy = torch.randn_like(y)
    y.backward(dy)
    for e, (xe, dye, dxe) in enumerate(zip(torch.split(x, splits), torch.split(dy, splits),
                                           torch.split(x.grad, splits))):
        w = getattr(g, f"weight{e}")
        if splits[e]:
            _check(name, dye, _decode32(g, "weight", e, w), dxe)
            _check(name, dye.t().contiguous(), _decode32(g, "input", e, xe), w.grad)
        else:
            assert not w.grad.any()


@pytest.mark.parametrize("name", RECIPES)
def test_layernorm_mlp_dequantized_is_exact(name):
    """fc2's wgrad is exact against the activation's FP32 decode; the rest of the backward
    equals the composed modules' (LayerNormLinear, activation, Linear) bit for bit."""
    torch.manual_seed(0)
    H, FF = 128, 192
    m = hf.LayerNormMLP(H, FF, params_dtype=BF16, name="mlp")
    fc1 = hf.LayerNormLinear(H, FF, params_dtype=BF16, name="mlp.fc1")
    fc2 = hf.Linear(FF, H, params_dtype=BF16, name="mlp.fc2")
    with torch.no_grad():
        fc1.weight.copy_(m.fc1_weight)
        fc1.bias.copy_(m.fc1_bias)
        fc2.weight.copy_(m.fc2_weight)
        fc2.bias.copy_(m.fc2_bias)
        m.layer_norm_weight.uniform_(0.5, 1.5)
        fc1.layer_norm_weight.copy_(m.layer_norm_weight)
    x = torch.randn(48, H, dtype=BF16)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    recipe = RECIPES[name]()
    with hf.autocast(recipe=recipe):
        ya = m(xa)
        act = activate("gelu", fc1(xb))
        yb = fc2(act)
    assert torch.equal(ya, yb)
    dy = torch.randn_like(ya)
    ya.backward(dy)
    yb.backward(dy)
    _check(name, dy.t().contiguous(), _decode32(m, "input", 1, act), m.fc2_weight.grad)
    for a, b in [(xa.grad, xb.grad), (m.fc1_weight.grad, fc1.weight.grad),
                 (m.fc2_weight.grad, fc2.weight.grad), (m.layer_norm_weight.grad, fc1.layer_norm_weight.grad)]:
        assert torch.equal(a, b)


@pytest.mark.parametrize("offsets", [torch.tensor([4, 10]), torch.tensor([], dtype=torch.int64)])
def test_grouped_offsets_wrong_length_names_offsets(offsets):
    g = hf.GroupedLinear(3, 16, 8)
    x = torch.randn(int(offsets[-1]) if len(offsets) else 0, 16)
    with pytest.raises(ValueError, match=r"offsets has \d+ entries; it needs one per expert \(3\)"):
        g(x, offsets=offsets)
    with pytest.raises(ValueError, match=r"m_splits has 2 entries"):  # the m_splits caller's word
        g(torch.randn(10, 16), [4, 6])


@pytest.mark.parametrize("out_dtype", [torch.int32, torch.int64, torch.bool, torch.complex64, "float32"])
def test_gemm_refuses_non_floating_out_dtype(out_dtype):
    a, b = torch.randn(4, 32), torch.randn(8, 32)
    with pytest.raises(TypeError, match=r"out_dtype must be a floating dtype \(torch.float32, torch.bfloat16"):
        gemm(a, b, out_dtype=out_dtype)
    q = hf.MXFP8Quantizer()
    with pytest.raises(TypeError, match="out_dtype"):
        gemm(q(a), q(b), out_dtype=out_dtype)
    assert gemm(a, b, out_dtype=torch.float64).dtype == torch.float64  # floating dtypes still serve
