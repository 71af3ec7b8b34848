"""GroupedLinear with quantized primary weights (``quantized_model_init``): each expert's weight
is a QuantizedTensor parameter; FP32 masters train it bitwise as FP32 weights train the same
layer (the GEMMs read the same quantizer's encoding of the same FP32 value, per expert, on the
same per-expert GEMM path on the CPU), export gives high-precision tensors, and the state dict
round trip is bitwise."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn

import hybridfp as hfp

from master_cases import RECIPES, quantized_weights

STEPS = 3
E, D, H, ROWS = 3, 64, 32, 32
SPLITS = [0, 19, ROWS - 19]  # an empty expert and sizes that are not multiples of 16 / 32

def _sr_inputs(role: hfp.QuantizerRole) -> hfp.quantizers.Quantizer:
    """NVFP4 with stochastic rounding on inputs and gradients: the experts quantize one by one."""
    return hfp.quantizers.NVFP4Quantizer(stochastic_rounding=role.tensor_type != "weight")


RECIPES = {**RECIPES, "nvfp4_sr_inputs": lambda: hfp.CustomRecipe(qfactory=_sr_inputs)}
CASES = ("fp8_current", "mxfp8", "nvfp4", "hybrid_per_gemm", "nvfp4_sr_inputs")


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class Experts(nn.Module):
    """fc1 -> relu -> fc2, both GroupedLinear (one of them without bias)."""

    def __init__(self, pack_weights: bool = True) -> None:
        super().__init__()
        self.fc1 = hfp.GroupedLinear(E, D, H, name="fc1", pack_weights=pack_weights)
        self.fc2 = hfp.GroupedLinear(E, H, D, bias=False, name="fc2", pack_weights=pack_weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x, SPLITS)), SPLITS)


def build(recipe: hfp.Recipe, quantized: bool, **kw) -> Experts:
    torch.manual_seed(0)
    with hfp.quantized_model_init(enabled=quantized, recipe=recipe, preserve_high_precision_init_val=True):
        return Experts(**kw)


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(ROWS, D, generator=g) for _ in range(n)]


def train(model: nn.Module, opt, recipe: hfp.Recipe, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    torch.manual_seed(5)  # stochastic rounding draws its seeds from torch's generator
    losses = []
    for x in xs:
        with hfp.autocast(recipe=recipe):
            loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


EXPERT_WEIGHTS = {f"fc{j}.weight{i}" for j in (1, 2) for i in range(E)}


@pytest.mark.parametrize("pack_weights", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("name", CASES)
def test_grouped_master_weights_train_bitwise_as_fp32_weights(name, pack_weights):
    recipe_hp, recipe_q = RECIPES[name](), RECIPES[name]()
    hp = build(recipe_hp, quantized=False, pack_weights=pack_weights)
    q = build(recipe_q, quantized=True, pack_weights=pack_weights)
    assert set(quantized_weights(q)) == EXPERT_WEIGHTS
    assert all(type(p) is nn.Parameter for n, p in q.named_parameters() if "bias" in n)
    opt_hp = torch.optim.AdamW(hp.parameters(), lr=1e-2, weight_decay=0.1)
    opt_q = hfp.MasterWeightOptimizer(torch.optim.AdamW, q.parameters(), lr=1e-2, weight_decay=0.1)
    xs = batches(STEPS)
    for i, (a, b) in enumerate(zip(train(hp, opt_hp, recipe_hp, xs), train(q, opt_q, recipe_q, xs))):
        assert torch.equal(a, b), f"{name}: loss of step {i} differs: {a.item()} vs {b.item()}"
    hp_params = dict(hp.named_parameters())
    for n, p in q.named_parameters():
        master = opt_q.master_of(p)
        assert torch.equal(master if master is not None else p, hp_params[n]), n
    x = batches(STEPS + 1)[-1]
    torch.manual_seed(7)  # the same draws for stochastic rounding in both forwards
    with torch.no_grad(), hfp.autocast(recipe=recipe_hp):
        y_hp = hp(x)
    torch.manual_seed(7)
    with torch.no_grad(), hfp.autocast(recipe=recipe_q):
        y_q = q(x)
    assert torch.equal(y_hp, y_q)


def test_delayed_scaling_held_expert_weights_train_bitwise():
    """DelayedScaling: each expert's held weight adopts its own amax history (one per expert)."""
    recipe_hp, recipe_q = RECIPES["delayed"](), RECIPES["delayed"]()
    hp, q = build(recipe_hp, quantized=False), build(recipe_q, quantized=True)
    opt_hp = torch.optim.AdamW(hp.parameters(), lr=1e-2)
    opt_q = hfp.MasterWeightOptimizer(torch.optim.AdamW, q.parameters(), lr=1e-2)
    xs = batches(STEPS)
    assert [l.item() for l in train(hp, opt_hp, recipe_hp, xs)] == [l.item() for l in train(q, opt_q, recipe_q, xs)]
    # one more forward: the FP32-weight run records the last weights' amaxes there, the
    # quantized run recorded them when re-quantizing; both commit them at the region end
    x = batches(STEPS + 1)[-1]
    with torch.no_grad(), hfp.autocast(recipe=recipe_hp):
        y_hp = hp(x)
    with torch.no_grad(), hfp.autocast(recipe=recipe_q):
        y_q = q(x)
    assert torch.equal(y_hp, y_q)
    for a, b in ((hp.fc1, q.fc1), (hp.fc2, q.fc2)):
        sa, sb = a.get_extra_state()["quantizers"], b.get_extra_state()["quantizers"]
        for k in sa:
            for f, v in sa[k]["state"].items():
                w = sb[k]["state"][f]
                assert (torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w), (k, f)
    assert all(q.fc1._quantizers["weight"][i] is q.fc1.weights()[i].quantizer for i in range(E))


def test_forward_and_backward_read_the_held_copies_without_requantizing(monkeypatch):
    recipe = hfp.MXFP8BlockScaling()
    q = build(recipe, quantized=True)
    calls = []
    import hybridfp.moe.grouped_weights as gw
    monkeypatch.setattr(gw, "quantize_weights_grouped", lambda *a, **k: calls.append("grouped") or [])
    for p in quantized_weights(q).values():
        orig = p.quantizer.quantize
        monkeypatch.setattr(p.quantizer, "quantize", lambda x, orig=orig: calls.append(1) or orig(x))
    x = batches(1)[0].requires_grad_()
    with hfp.autocast(recipe=recipe):
        q(x).sum().backward()
    assert calls == []
    for n, p in quantized_weights(q).items():
        assert type(p.grad) is torch.Tensor and p.grad.dtype == torch.float32 and p.grad.shape == p.shape, n
    assert x.grad is not None


def test_the_high_precision_packed_buffer_is_released():
    """pack_weights' [E, N, K] FP32 buffer is not kept once the experts' weights are quantized."""
    q = build(hfp.MXFP8BlockScaling(), quantized=True)
    assert q.fc1._packed is None and q.fc2._packed is None


def test_single_parameter_refuses_quantized_model_init():
    with hfp.quantized_model_init(recipe=hfp.MXFP8BlockScaling()):
        with pytest.raises(NotImplementedError, match=r"single_parameter=True.*single_parameter=False"):
            hfp.GroupedLinear(2, 32, 32, single_parameter=True)


def test_export_gives_high_precision_weights_for_a_plain_grouped_linear():
    recipe = hfp.NVFP4BlockScaling()
    q = build(recipe, quantized=True)
    sd = hfp.export_state_dict(q, dtype=torch.float32)
    assert all(type(v) is torch.Tensor for v in sd.values())
    assert set(sd) == EXPERT_WEIGHTS | {f"fc1.bias{i}" for i in range(E)}
    for i in range(E):
        assert torch.equal(sd[f"fc1.weight{i}"], getattr(q.fc1, f"weight{i}").dequantize(torch.float32))
    plain = build(recipe, quantized=False)
    plain.load_state_dict(sd)
    # outside autocast the layer runs F.linear per expert on the (exported) weights
    x = batches(1)[0]
    want = torch.cat([torch.nn.functional.linear(xi, sd[f"fc1.weight{i}"], sd[f"fc1.bias{i}"])
                      for i, xi in enumerate(torch.split(x, SPLITS))])
    assert torch.equal(plain.fc1(x, SPLITS), want)
    # the single_parameter layout takes the exported per-expert keys too
    with torch.no_grad():
        one = hfp.GroupedLinear(E, D, H, name="fc1", single_parameter=True)
    one.load_state_dict({k[4:]: v for k, v in sd.items() if k.startswith("fc1.")})
    assert torch.equal(one.weight[1], sd["fc1.weight1"])


@pytest.mark.parametrize("name", ("fp8_current", "nvfp4"))
def test_state_dict_round_trip_is_bitwise(name):
    recipe = RECIPES[name]()
    a = build(recipe, quantized=True)
    opt = hfp.MasterWeightOptimizer(torch.optim.AdamW, a.parameters(), lr=1e-2)
    train(a, opt, recipe, batches(1))
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    torch.manual_seed(9)
    with hfp.quantized_model_init(recipe=RECIPES[name]()):
        b = Experts()
    b.load_state_dict(loaded)
    for n, p in quantized_weights(a).items():
        pb = dict(b.named_parameters())[n]
        assert isinstance(pb, hfp.QuantizedTensor)
        assert all(torch.equal(s, t) for s, t in zip(p.qstorage.tensors(), pb.qstorage.tensors())), n
    x = batches(2)[-1]
    with torch.no_grad(), hfp.autocast(recipe=recipe):
        ya = a(x)
    with torch.no_grad(), hfp.autocast(recipe=recipe):
        yb = b(x)
    assert torch.equal(ya, yb)
