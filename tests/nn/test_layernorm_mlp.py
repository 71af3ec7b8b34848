"""``LayerNormMLP``: norm + fc1 + activation + fc2 in one module, bitwise the composed
``LayerNormLinear(fc1) -> activation -> Linear(fc2)`` (the same operations in the same order,
so the comparison is bitwise: tests/README.md)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from nn_cases import FORMATS, CountingFactory, assert_bitwise, sgd_step

import hybridfp as hf

HIDDEN, FFN, ROWS = 64, 96, 40
GATED = ("swiglu", "geglu", "reglu", "sreglu", "qgeglu")
#: The activations, written out with torch's ops (TE's definitions; "gelu" is the tanh form).
ACT = {
    "gelu": lambda t: F.gelu(t, approximate="tanh"),
    "relu": F.relu,
    "srelu": lambda t: F.relu(t) * F.relu(t),
    "qgelu": lambda t: t * torch.sigmoid(1.702 * t),
    "silu": F.silu,
}
ACT.update({"geglu": ACT["gelu"], "reglu": F.relu, "sreglu": ACT["srelu"], "qgeglu": ACT["qgelu"]})


def _apply(act: str, y: torch.Tensor) -> torch.Tensor:
    if act == "swiglu":
        return hf.SwiGLU()(y)
    if act in GATED:
        a, b = y.chunk(2, dim=-1)
        return ACT[act](a) * b
    return ACT[act](y)


class Composed(torch.nn.Module):
    """The reference: LayerNormLinear(fc1) -> activation -> Linear(fc2), named as the MLP's sets."""

    def __init__(self, mlp: hf.LayerNormMLP, activation: str) -> None:
        super().__init__()
        fc1_out = mlp.fc1_weight.shape[0]
        self.fc1 = hf.LayerNormLinear(HIDDEN, fc1_out, mlp.fc1_bias is not None,
                                      normalization=mlp.normalization, eps=mlp.eps, name="mlp.fc1")
        self.fc2 = hf.Linear(FFN, HIDDEN, mlp.fc2_bias is not None, name="mlp.fc2")
        self.activation = activation
        with torch.no_grad():
            self.fc1.layer_norm_weight.copy_(mlp.layer_norm_weight)
            if mlp.layer_norm_bias is not None:
                self.fc1.layer_norm_bias.copy_(mlp.layer_norm_bias)
            self.fc1.weight.copy_(mlp.fc1_weight)
            self.fc2.weight.copy_(mlp.fc2_weight)
            if mlp.fc1_bias is not None:
                self.fc1.bias.copy_(mlp.fc1_bias)
                self.fc2.bias.copy_(mlp.fc2_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(_apply(self.activation, self.fc1(x)))

    def grads(self) -> dict[str, torch.Tensor]:
        """Gradients under the MLP's parameter names."""
        names = {"fc1.layer_norm_weight": "layer_norm_weight", "fc1.layer_norm_bias": "layer_norm_bias",
                 "fc1.weight": "fc1_weight", "fc1.bias": "fc1_bias", "fc2.weight": "fc2_weight",
                 "fc2.bias": "fc2_bias"}
        return {names[n]: p.grad.clone() for n, p in self.named_parameters() if p.grad is not None}


def _mlp(normalization: str = "LayerNorm", activation: str = "gelu", bias: bool = True, **kw) -> hf.LayerNormMLP:
    torch.manual_seed(0)
    m = hf.LayerNormMLP(HIDDEN, FFN, bias, normalization=normalization, activation=activation,
                        eps=1e-5, name="mlp", **kw)
    with torch.no_grad():
        m.layer_norm_weight.uniform_(0.5, 1.5)
        if m.layer_norm_bias is not None:
            m.layer_norm_bias.uniform_(-0.2, 0.2)
    return m


def _step(model, x, dy, recipe, seed):
    xx = x.clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # stochastic rounding draws its seeds from torch's generator
    if recipe is None:
        y = model(xx)
    else:
        with hf.autocast(recipe=recipe):
            y = model(xx)
    y.backward(dy)
    grads = (model.grads() if isinstance(model, Composed)
             else {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return y.detach(), xx.grad, grads


def _check_parity(mlp, ref, recipe, steps=2, dtype=torch.float32):
    g = torch.Generator().manual_seed(5)
    for step in range(steps):
        x = (torch.randn(ROWS, HIDDEN, generator=g) * (1 + step)).to(dtype)
        dy = torch.randn(ROWS, HIDDEN, generator=g).to(dtype)
        got, want = _step(mlp, x, dy, recipe, 100 + step), _step(ref, x, dy, recipe, 100 + step)
        assert_bitwise(got[0], want[0], f"step {step} output")
        assert_bitwise(got[1], want[1], f"step {step} input grad")
        assert sorted(got[2]) == sorted(n for n, p in mlp.named_parameters())  # every parameter
        for n in want[2]:
            assert_bitwise(got[2][n], want[2][n], f"step {step} {n}.grad")
        sgd_step(mlp)
        sgd_step(ref)


@pytest.mark.parametrize("fmt", [None, *FORMATS])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_bitwise_the_composed_modules_under_every_builtin_recipe(fmt, normalization, activation):
    mlp = _mlp(normalization, activation)
    recipe = None if fmt is None else FORMATS[fmt]()
    _check_parity(mlp, Composed(mlp, activation), recipe)


@pytest.mark.parametrize("activation", ["relu", "srelu", "qgelu", "silu", *GATED])
def test_every_activation(activation):
    mlp = _mlp("RMSNorm", activation)
    assert mlp.fc1_weight.shape == ((2 * FFN if activation in GATED else FFN), HIDDEN)
    _check_parity(mlp, Composed(mlp, activation), hf.Float8CurrentScaling(), steps=1)


def test_bf16_activations_no_bias():
    mlp = _mlp("LayerNorm", "swiglu", bias=False)
    _check_parity(mlp, Composed(mlp, "swiglu"), hf.MXFP8BlockScaling(), steps=1, dtype=torch.bfloat16)


@pytest.mark.parametrize("mode", ["high_precision", "dequantized"])
def test_backward_override(mode):
    mlp = _mlp("LayerNorm", "swiglu")
    _check_parity(mlp, Composed(mlp, "swiglu"), hf.NVFP4BlockScaling(backward_override=mode), steps=1)


def _roles_factory(role):
    """fc1 in MXFP8, fc2 in FP8 current scaling: the two GEMM sets get their own quantizers."""
    if role.name.endswith("fc1"):
        return hf.MXFP8Quantizer()
    return hf.Float8CurrentScalingQuantizer()


def test_quantizer_roles_name_the_two_gemm_sets():
    mlp = _mlp()
    assert mlp.quantizer_roles() == {}
    recipe = hf.CustomRecipe(_roles_factory)
    with hf.autocast(recipe=recipe):
        mlp(torch.randn(4, HIDDEN))
    roles = mlp.quantizer_roles()
    assert sorted(roles) == ["grad_output", "input", "weight"]
    for slot, (r1, r2) in roles.items():
        assert (r1, r2) == (hf.QuantizerRole("linear", slot, "mlp.fc1"), hf.QuantizerRole("linear", slot, "mlp.fc2"))
    assert [q.format_name for q in mlp._quantizers["weight"]] == ["mxfp8", "fp8_current"]
    _check_parity(mlp, Composed(mlp, "gelu"), recipe, steps=1)


def test_unnamed_module_roles():
    m = hf.LayerNormMLP(HIDDEN, FFN)
    with hf.autocast(recipe=hf.MXFP8BlockScaling()):
        m(torch.randn(2, HIDDEN))
    assert [r.name for r in m.quantizer_roles()["input"]] == ["fc1", "fc2"]


def test_each_input_quantized_once():
    mlp = _mlp(activation="swiglu")
    counter = CountingFactory(hf.factories.mxfp8)
    with hf.autocast(recipe=hf.CustomRecipe(counter)):
        y = mlp(torch.randn(ROWS, HIDDEN, requires_grad=True))
    assert counter.count("input") == 2 and counter.count("weight") == 2  # norm output, activation
    y.sum().backward()
    assert counter.count("grad_output") == 2


def test_parameter_names():
    names = [n for n, _ in _mlp().named_parameters()]
    assert names == ["layer_norm_weight", "layer_norm_bias", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"]
    rms = _mlp("RMSNorm", bias=False)
    assert [n for n, _ in rms.named_parameters()] == ["layer_norm_weight", "fc1_weight", "fc2_weight"]
    assert rms.layer_norm_bias is None and rms.fc1_bias is None and rms.fc2_bias is None
    sw = _mlp(activation="swiglu")
    assert sw.fc1_weight.shape == (2 * FFN, HIDDEN) and sw.fc2_weight.shape == (HIDDEN, FFN)


def test_checkpoint_recomputes_bitwise():
    mlp = _mlp(activation="swiglu")
    recipe = hf.NVFP4BlockScaling()
    x, dy = torch.randn(ROWS, HIDDEN), torch.randn(ROWS, HIDDEN)
    want = _step(mlp, x, dy, recipe, 7)
    xx = x.clone().requires_grad_()
    mlp.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    with hf.autocast(recipe=recipe):
        y = hf.checkpoint(mlp, xx)
    y.backward(dy)
    assert_bitwise(y.detach(), want[0], "output")
    assert_bitwise(xx.grad, want[1], "input grad")
    for n, p in mlp.named_parameters():
        assert_bitwise(p.grad, want[2][n], f"{n}.grad")


def test_extra_state_saves_and_loads():
    recipe = hf.DelayedScaling(amax_history_len=4)
    a = _mlp()
    x = torch.randn(ROWS, HIDDEN)
    for _ in range(2):
        with hf.autocast(recipe=recipe):
            a(x).sum().backward()
    sd = a.state_dict()
    assert sorted(sd["_extra_state"]["quantizers"]) == [f"{s}.{i}" for s in ("grad_output", "input", "weight")
                                                       for i in (0, 1)]
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    b = hf.LayerNormMLP(HIDDEN, FFN, name="mlp")
    b.load_state_dict(torch.load(buf, weights_only=True))
    with hf.autocast(recipe=recipe):
        ya = a(x)
    with hf.autocast(recipe=recipe):
        yb = b(x)
    assert_bitwise(yb, ya, "output after load")
    for k in ("input.1", "weight.0"):
        sa, sb = (m.get_extra_state()["quantizers"][k]["state"] for m in (a, b))
        assert torch.equal(sa["scale"], sb["scale"]) and torch.equal(sa["amax_history"], sb["amax_history"])


def test_convert_leaves_it_alone_and_names_it():
    model = torch.nn.Sequential(_mlp(), torch.nn.Linear(HIDDEN, 8))
    model[0].name = ""
    mlp = model[0]
    hf.convert(model)
    assert model[0] is mlp and isinstance(model[1], hf.Linear)
    assert mlp.name == "0" and [n for n, _ in mlp.named_parameters()][2] == "fc1_weight"
    with hf.autocast(recipe=hf.MXFP8BlockScaling()):
        model(torch.randn(2, HIDDEN))
    assert [r.name for r in mlp.quantizer_roles()["weight"]] == ["0.fc1", "0.fc2"]


@pytest.mark.parametrize("kw, match", [
    ({"activation": "tanh"}, "activation='tanh'"),
    ({"normalization": "BatchNorm"}, "normalization='BatchNorm'"),
])
def test_bad_options_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        hf.LayerNormMLP(HIDDEN, FFN, **kw)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match=f"LayerNormMLP mlp.*in_features={HIDDEN}"):
        _mlp()(torch.randn(2, HIDDEN + 1))


def test_is_first_microbatch_reuses_both_weights():
    mlp = _mlp()
    x = torch.randn(4, HIDDEN)
    with hf.autocast(recipe=hf.MXFP8BlockScaling()):
        y1 = mlp(x, is_first_microbatch=True)
    with hf.autocast(recipe=hf.MXFP8BlockScaling()):
        y2 = mlp(x, is_first_microbatch=False)
    assert_bitwise(y2, y1, "output")
    assert sorted(mlp._wcache) == [0, 1]
