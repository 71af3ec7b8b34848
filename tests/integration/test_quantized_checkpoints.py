"""Checkpoints of models with quantized weights: state_dict through torch.save /
torch.load(weights_only=True) and torch.distributed.checkpoint, an export of plain tensors for
safetensors and for plain torch.nn models, and bitwise resume (k steps, save, load, N - k steps
== N steps) for every built-in recipe with FP32 masters."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import hybridfp as hfp
from master_cases import D, RECIPES, Model, batches, build, quantized_weights, step

N, K = 4, 2


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _same_model(a: nn.Module, b: nn.Module) -> None:
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        if isinstance(p, hfp.QuantizedTensor):
            assert type(q) is hfp.QuantizedTensor and p.directions() == q.directions(), n
            for x, y in zip(p.qstorage.tensors(), q.qstorage.tensors()):
                assert torch.equal(x, y), n
        else:
            assert torch.equal(p, q), n


def _trained(name: str, steps: int = 1):
    recipe = RECIPES[name]()
    model = build(recipe, quantized=True)
    opt = hfp.MasterWeightOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-2, weight_decay=0.1)
    torch.manual_seed(5)  # stochastic rounding draws its seeds from torch's generator
    for x in batches(steps):
        step(model, opt, recipe, x)
    return recipe, model, opt


def _fresh(recipe: hfp.Recipe) -> Model:
    """A model of other initial values (seed 7) with quantized weights: loading must replace them."""
    torch.manual_seed(7)
    with hfp.quantized_model_init(recipe=recipe):
        return Model()


@pytest.mark.parametrize("name", ["delayed", "mxfp8", "nvfp4"])
def test_state_dict_round_trip_weights_only(name):
    recipe, model, _ = _trained(name)
    sd = _roundtrip(model.state_dict())
    assert all(type(sd[k]) is hfp.QuantizedTensor for k in quantized_weights(model))
    other = _fresh(recipe)
    other.load_state_dict(sd)
    _same_model(model, other)
    x = batches(2)[1]
    with torch.no_grad(), hfp.autocast(recipe=recipe):
        want = model(x)
    with torch.no_grad(), hfp.autocast(recipe=RECIPES[name]()):
        got = other(x)
    assert torch.equal(want, got)


def test_distributed_checkpoint_round_trip(tmp_path):
    recipe, model, _ = _trained("delayed")
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path))
    other = _fresh(recipe)
    with torch.no_grad(), hfp.autocast(recipe=RECIPES["delayed"]()):  # DCP loads into built quantizers
        other(batches(1)[0])
    sd = other.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path))
    other.load_state_dict(sd)
    _same_model(model, other)
    assert torch.equal(model.out.get_extra_state()["quantizers"]["weight.0"]["state"]["amax_history"],
                       other.out.get_extra_state()["quantizers"]["weight.0"]["state"]["amax_history"])


def test_export_for_safetensors_and_plain_bf16_model(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    with hfp.quantized_model_init(recipe=hfp.NVFP4BlockScaling()):
        model = nn.Sequential(hfp.Linear(D, 2 * D), nn.GELU(), hfp.Linear(2 * D, D))
    with pytest.raises(Exception):  # what a user meets without the export
        safetensors.save_file(model.state_dict(), str(tmp_path / "raw.safetensors"))
    path = str(tmp_path / "model.safetensors")
    safetensors.save_file(hfp.export_state_dict(model, dtype=torch.bfloat16), path)
    loaded = safetensors.load_file(path)
    plain = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D)).to(torch.bfloat16)
    plain.load_state_dict(loaded)
    assert torch.equal(plain[0].weight, model[0].weight.dequantize(torch.bfloat16))
    assert torch.equal(plain[2].bias, model[2].bias.detach().to(torch.bfloat16))
    # the quantized state dict itself also loads into the plain model (dequantized on copy)
    fp32 = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
    fp32.load_state_dict({k: v for k, v in _roundtrip(model.state_dict()).items() if "extra_state" not in k})
    assert torch.equal(fp32[2].weight, model[2].weight.dequantize())


@pytest.mark.parametrize("name", list(RECIPES))
def test_resume_is_bitwise(name):
    _, straight, _ = _trained(name, N)
    recipe = RECIPES[name]()
    model = build(recipe, quantized=True)
    opt = hfp.MasterWeightOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-2, weight_decay=0.1)
    torch.manual_seed(5)  # stochastic rounding's seeds: from torch's generator, saved with the run
    xs = batches(N)
    for x in xs[:K]:
        step(model, opt, recipe, x)
    saved = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state()})
    recipe = RECIPES[name]()
    model = _fresh(recipe)
    opt = hfp.MasterWeightOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-2, weight_decay=0.1)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    torch.set_rng_state(saved["rng"])
    for x in xs[K:]:
        step(model, opt, recipe, x)
    _same_model(straight, model)


def _same_state(a, b, where: str = "") -> None:
    """Two state dicts (or their parts) hold the same values bitwise: quantized payloads,
    tensors, and the quantizers' extra state."""
    if isinstance(a, hfp.QuantizedTensor):
        assert type(b) is hfp.QuantizedTensor and a.directions() == b.directions(), where
        for x, y in zip(a.qstorage.tensors(), b.qstorage.tensors(), strict=True):
            assert torch.equal(x, y), where
    elif torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, sorted(a), sorted(b))
        for k in a:
            _same_state(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, (where, a, b)


def test_delayed_scaling_resume_re_encodes_with_the_loaded_scale():
    """Model then optimizer state loaded into a new model: the optimizer's load re-encodes each
    weight from its loaded master with the loaded delayed-scaling state (applied to the weight's
    own quantizer by the model's load, before any forward builds the module's quantizers), so
    the model is the saved one bitwise before any step, payloads and quantizer state, and
    training goes on bitwise."""
    recipe = RECIPES["delayed"]()
    model = build(recipe, quantized=True)
    opt = hfp.MasterWeightOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-2)
    xs = batches(4)
    for x in xs[:2]:
        step(model, opt, recipe, x)
    assert model.out.weight.quantizer.scale.item() != 1.0  # a fresh quantizer's scale would differ
    saved = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    other = _fresh(RECIPES["delayed"]())
    other_opt = hfp.MasterWeightOptimizer(torch.optim.AdamW, other.parameters(), lr=1e-2)
    other.load_state_dict(saved["model"])
    other_opt.load_state_dict(saved["opt"])
    _same_state(model.state_dict(), other.state_dict())
    want = [step(model, opt, recipe, x).item() for x in xs[2:]]
    got = [step(other, other_opt, recipe, x).item() for x in xs[2:]]
    assert got == want
    _same_state(model.state_dict(), other.state_dict())
