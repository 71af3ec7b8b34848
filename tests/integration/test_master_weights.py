"""Quantized primary weights with FP32 masters train bitwise as FP32 weights do: the weight
each GEMM reads is the same quantizer's encoding of the same FP32 value, and the optimizer runs
on the same FP32 values in the same order. A plain torch optimizer refuses quantized parameters."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

import hybridfp as hfp

from master_cases import RECIPES, batches, build, quantized_weights, step

STEPS = 3


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.parametrize("name", list(RECIPES))
def test_master_weights_train_bitwise_as_fp32_weights(name):
    recipe_hp, recipe_q = RECIPES[name](), RECIPES[name]()
    hp, q = build(recipe_hp, quantized=False), build(recipe_q, quantized=True)
    assert set(quantized_weights(q)) == {"qkv.weight", "mlp.fc1_weight", "mlp.fc2_weight", "out.weight"}
    opt_hp = torch.optim.AdamW(hp.parameters(), lr=1e-2, weight_decay=0.1)
    opt_q = hfp.MasterWeightOptimizer(torch.optim.AdamW, q.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for model, opt, recipe in ((hp, opt_hp, recipe_hp), (q, opt_q, recipe_q)):
        torch.manual_seed(5)  # stochastic rounding draws its seeds from torch's generator
        losses.append([step(model, opt, recipe, x) for x in batches(STEPS)])
    for i, (a, b) in enumerate(zip(*losses)):
        assert torch.equal(a, b), f"{name}: loss of step {i} differs: {a.item()} vs {b.item()}"
    hp_params = dict(hp.named_parameters())
    for n, p in q.named_parameters():
        master = opt_q.master_of(p)
        assert torch.equal(master if master is not None else p, hp_params[n]), n
    # one more forward: the FP32-weight run records the last weight's amax there, the quantized
    # run recorded it when re-quantizing; both commit it at the region end
    x = batches(STEPS + 1)[-1]
    with torch.no_grad(), hfp.autocast(recipe=recipe_hp):
        y_hp = hp(x)
    with torch.no_grad(), hfp.autocast(recipe=recipe_q):
        y_q = q(x)
    assert torch.equal(y_hp, y_q)
    # quantizer state (delayed scaling's history) moved as in the FP32-weight run
    for (n, a), b in zip(hp.named_modules(), q.modules()):
        if isinstance(a, hfp.nn.QuantizedModule):
            sa, sb = a.get_extra_state(), b.get_extra_state()
            for k in sa["quantizers"]:
                for f, v in sa["quantizers"][k]["state"].items():
                    w = sb["quantizers"][k]["state"][f]
                    assert (torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w), (n, k, f)


def test_forward_reads_the_parameter_without_requantizing(monkeypatch):
    recipe = hfp.MXFP8BlockScaling()
    q = build(recipe, quantized=True)
    calls = []
    for p in quantized_weights(q).values():
        orig = p.quantizer.quantize
        monkeypatch.setattr(p.quantizer, "quantize", lambda x, orig=orig: calls.append(1) or orig(x))
    x = batches(1)[0].requires_grad_()
    with hfp.autocast(recipe=recipe):
        q(x).sum().backward()
    assert calls == []
    assert all(type(p.grad) is torch.Tensor and p.grad.dtype == torch.float32 for p in quantized_weights(q).values())


def test_high_precision_init_val_is_kept_and_cleared():
    q = build(hfp.NVFP4BlockScaling(), quantized=True)
    hp = build(hfp.NVFP4BlockScaling(), quantized=False)
    assert torch.equal(q.out.weight.get_high_precision_init_val(), hp.out.weight.detach())
    q.out.weight.clear_high_precision_init_val()
    assert q.out.weight.get_high_precision_init_val() is None
    with hfp.quantized_model_init(recipe=hfp.MXFP8BlockScaling()):
        lin = hfp.Linear(32, 32)
    assert lin.weight.get_high_precision_init_val() is None


@pytest.mark.parametrize("variant", [{"foreach": False}, {"foreach": True}, {"fused": True}, {}])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("opt_class", [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD])
def test_plain_optimizer_refuses_quantized_parameters(opt_class, variant, weight_decay):
    recipe = hfp.MXFP8BlockScaling()
    q = build(recipe, quantized=True)
    before = {n: [t.clone() for t in p.qstorage.tensors()] for n, p in quantized_weights(q).items()}
    kw = {"momentum": 0.9} if opt_class is torch.optim.SGD else {}
    opt = opt_class(q.parameters(), lr=1e-2, weight_decay=weight_decay, **variant, **kw)
    with hfp.autocast(recipe=recipe):
        q(batches(1)[0]).square().mean().backward()
    with pytest.raises(RuntimeError, match=r"in-place aten\.\w+ on .*(weight|state).*MasterWeightOptimizer"):
        opt.step()
    for n, p in quantized_weights(q).items():  # nothing written
        assert all(torch.equal(a, b) for a, b in zip(p.qstorage.tensors(), before[n])), n


def test_quantize_master_weights_checks_its_arguments():
    q = build(hfp.MXFP8BlockScaling(), quantized=True)
    with pytest.raises(ValueError, match="2 model parameters but 1 master"):
        hfp.quantize_master_weights([q.out.weight, q.out.bias], [None])
    with pytest.raises(ValueError, match="master 0 has shape"):
        hfp.quantize_master_weights([q.out.weight], [torch.zeros(3)])


def test_single_parameter_grouped_linear_refuses_quantized_model_init():
    with hfp.quantized_model_init(recipe=hfp.MXFP8BlockScaling()):
        with pytest.raises(NotImplementedError, match="quantized_model_init.*single_parameter=True"):
            hfp.GroupedLinear(2, 32, 32, single_parameter=True)


def test_another_weight_format_at_forward_is_a_clear_error():
    q = build(hfp.MXFP8BlockScaling(), quantized=True)
    with pytest.raises(ValueError, match="held quantized as .*MXFP8.*recipe given to quantized_model_init"):
        with hfp.autocast(recipe=hfp.Float8CurrentScaling()):
            q(batches(1)[0])


@pytest.mark.parametrize("recipe, weight_bytes", [
    (hfp.MXFP8BlockScaling, 2 * (1 + 1 / 32)),       # two FP8 copies, an E8M0 scale per 32
    (hfp.Float8CurrentScaling, 2 + 4 / 4096),         # two FP8 copies, one FP32 scale_inv
    # weights in 16x16 blocks: two E2M1 copies, an E4M3 scale per 256 each, one FP32 amax
    (hfp.NVFP4BlockScaling, 2 * (0.5 + 1 / 256) + 4 / 4096),
])
def test_memory_per_parameter_counts_the_real_buffers(recipe, weight_bytes):
    r = recipe()
    with hfp.quantized_model_init(recipe=r):
        lin = hfp.Linear(64, 64, bias=False)
    opt = hfp.MasterWeightOptimizer(torch.optim.AdamW, lin.parameters(), lr=1e-3)
    step(lin, opt, r, torch.randn(4, 64))
    m = hfp.memory_per_parameter(lin, opt)
    assert m["quantized_weight"] == m["weights"] == pytest.approx(weight_bytes)
    assert (m["masters"], m["optimizer_state"], m["bf16_total"]) == (4.0, 8.0, 14.0)
    assert m["total"] == pytest.approx(weight_bytes + 12.0)


def test_initialising_a_quantized_weight_again_follows_it():
    """nn.init after quantized_model_init (a model's own init scheme): the weight, its kept
    initial value and delayed scaling's pending amax are those of the new value."""
    r = hfp.DelayedScaling(amax_history_len=4)
    with hfp.quantized_model_init(recipe=r, preserve_high_precision_init_val=True):
        lin = hfp.Linear(64, 64)
    torch.manual_seed(3)
    torch.nn.init.normal_(lin.weight, std=0.02)
    torch.manual_seed(3)
    want = torch.nn.init.normal_(torch.empty(64, 64), std=0.02)
    assert torch.equal(lin.weight.get_high_precision_init_val(), want)
    assert lin.weight.quantizer.amax_history[0] == want.abs().max()


@pytest.mark.parametrize("name", ["fp8_current", "mxfp8", "nvfp4"])
def test_loading_the_optimizer_state_requantizes_the_weights(name):
    """The weights take the loaded masters' values at load, not at the next step: a forward in
    between (an evaluation after resuming) reads the loaded weights."""
    recipe = RECIPES[name]()
    a = build(recipe, quantized=True)
    opt_a = hfp.MasterWeightOptimizer(torch.optim.AdamW, a.parameters(), lr=1e-2)
    for x in batches(2):
        step(a, opt_a, recipe, x)
    b = build(RECIPES[name](), quantized=True)  # its initial weights, not a's
    opt_b = hfp.MasterWeightOptimizer(torch.optim.AdamW, b.parameters(), lr=1e-2)
    opt_b.load_state_dict(opt_a.state_dict())  # the model's own state dict not loaded
    for n, p in quantized_weights(a).items():
        pb = quantized_weights(b)[n]
        assert all(torch.equal(s, t) for s, t in zip(p.qstorage.tensors(), pb.qstorage.tensors())), n


def _payloads(model) -> dict[str, list[torch.Tensor]]:
    return {n: [t.clone() for t in p.qstorage.tensors()] for n, p in quantized_weights(model).items()}


def _same_payloads(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        len(a[n]) == len(b[n]) and all(torch.equal(s.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)) for s, t in zip(a[n], b[n]))
        for n in a)


def test_a_forward_between_the_model_and_optimizer_loads_keeps_training_bitwise():
    """Delayed scaling: a forward after the model's state dict is loaded moves the weights'
    scale; the optimizer's load then keeps the weights that already hold their saved encoding
    (re-encoding them with the moved scale made the next step differ from the run saved)."""
    recipe = RECIPES["delayed"]()
    a = build(recipe, quantized=True)
    opt_a = hfp.MasterWeightOptimizer(torch.optim.AdamW, a.parameters(), lr=1e-2)
    xs = batches(3)
    for x in xs[:2]:
        step(a, opt_a, recipe, x)
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "optimizer": opt_a.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model_state, opt_state = saved["model"], saved["optimizer"]
    recipe_b = RECIPES["delayed"]()
    b = build(RECIPES["delayed"](), quantized=True)
    b.load_state_dict(model_state)
    opt_b = hfp.MasterWeightOptimizer(torch.optim.AdamW, b.parameters(), lr=1e-2)
    for model, r in ((a, recipe), (b, recipe_b)):
        with torch.no_grad(), hfp.autocast(recipe=r):
            model(xs[2])  # an evaluation: the weight quantizers' scales move
    loaded = _payloads(b)
    opt_b.load_state_dict(opt_state)
    assert _same_payloads(_payloads(b), loaded)
    losses = [step(a, opt_a, recipe, xs[2]), step(b, opt_b, recipe_b, xs[2])]
    assert torch.equal(*losses)
    assert _same_payloads(_payloads(a), _payloads(b))


def test_a_dict_without_digests_reencodes_every_weight():
    """An optimizer dict saved without weight digests loads and re-encodes every quantized
    weight from its master."""
    recipe = RECIPES["mxfp8"]()
    a = build(recipe, quantized=True)
    opt_a = hfp.MasterWeightOptimizer(torch.optim.AdamW, a.parameters(), lr=1e-2)
    for x in batches(2):
        step(a, opt_a, recipe, x)
    state = opt_a.state_dict()
    assert len(state.pop("weight_digests")) == len(state["master_params"])
    b = build(RECIPES["mxfp8"](), quantized=True)
    opt_b = hfp.MasterWeightOptimizer(torch.optim.AdamW, b.parameters(), lr=1e-2)
    opt_b.load_state_dict(state)
    assert _same_payloads(_payloads(a), _payloads(b))


def test_a_digest_list_of_another_length_is_refused():
    recipe = hfp.MXFP8BlockScaling()
    opt = hfp.MasterWeightOptimizer(torch.optim.AdamW, build(recipe, quantized=True).parameters(), lr=1e-2)
    state = opt.state_dict()
    state["weight_digests"] = state["weight_digests"][:-1]
    with pytest.raises(ValueError, match="weight digests for"):
        opt.load_state_dict(state)


def test_a_refused_dict_leaves_the_model_as_it_was():
    """A dict the wrapped optimizer refuses (another parameter-group layout) raises before any
    master or weight is written."""
    recipe = RECIPES["mxfp8"]()
    a = build(recipe, quantized=True)
    opt_a = hfp.MasterWeightOptimizer(torch.optim.AdamW, a.parameters(), lr=1e-2)
    for x in batches(2):
        step(a, opt_a, recipe, x)
    b = build(RECIPES["mxfp8"](), quantized=True)
    params = list(b.parameters())
    opt_b = hfp.MasterWeightOptimizer(torch.optim.AdamW, [{"params": params[:1]}, {"params": params[1:]}], lr=1e-2)
    before = _payloads(b)
    masters = [None if m is None else m.detach().clone() for m in opt_b.master_params]
    with pytest.raises(ValueError, match="parameter groups"):
        opt_b.load_state_dict(opt_a.state_dict())
    assert _same_payloads(_payloads(b), before)
    assert all(m is None or torch.equal(m, n) for m, n in zip(opt_b.master_params, masters))


def test_a_loaded_master_of_another_shape_is_named():
    recipe = hfp.MXFP8BlockScaling()
    opt = hfp.MasterWeightOptimizer(torch.optim.AdamW, build(recipe, quantized=True).parameters(), lr=1e-2)
    state = opt.state_dict()
    i = next(i for i, m in enumerate(state["master_params"]) if m is not None)
    state["master_params"][i] = state["master_params"][i][:1]  # broadcastable: copy_ alone would accept it
    with pytest.raises(ValueError, match=f"saved master {i} has shape"):
        opt.load_state_dict(state)


@pytest.mark.parametrize("source", ["quantized", "high_precision"])
def test_masters_start_from_a_loaded_checkpoint_not_the_kept_initial_value(source):
    """Build, load a checkpoint, then build the optimizer: the masters start at the loaded
    weights even where an initial value was kept, and a step of zero learning rate keeps them."""
    recipe = hfp.MXFP8BlockScaling()
    trained = build(recipe, quantized=True)
    opt = hfp.MasterWeightOptimizer(torch.optim.AdamW, trained.parameters(), lr=1e-2)
    for x in batches(2):
        step(trained, opt, recipe, x)
    model = build(hfp.MXFP8BlockScaling(), quantized=True)
    with torch.no_grad():
        for n, p in quantized_weights(model).items():
            w = quantized_weights(trained)[n]
            p.copy_(w if source == "quantized" else w.dequantize())
    opt = hfp.MasterWeightOptimizer(torch.optim.SGD, model.parameters(), lr=0.0)
    for n, p in quantized_weights(model).items():
        assert torch.equal(opt.master_of(p), quantized_weights(trained)[n].dequantize(torch.float32)), n
    step(model, opt, recipe, batches(1)[0])
    for n, p in quantized_weights(model).items():
        assert torch.equal(p.dequantize(), quantized_weights(trained)[n].dequantize()), n
