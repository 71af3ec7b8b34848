"""``MasterWeightOptimizer`` used as torch optimizers are: a step with a closure (SGD, LBFGS),
``torch.amp.GradScaler`` (unscale, clip, step), ``model.named_parameters()``; and the kept
initial value of a weight (``preserve_high_precision_init_val``) never going stale once
hybridfp writes a master's value into the weight, so an optimizer built later starts where the
weight is.

The comparisons are bitwise only between runs of the same operations: the quantized weights
with FP32 masters against FP32 weights (the GEMMs read the same quantizer's encoding of the
same FP32 value) and, under GradScaler, gradients scaled by a power of two (exact)."""

from __future__ import annotations

import warnings

import pytest
import torch

import hybridfp as hfp

from master_cases import RECIPES, batches, build, quantized_weights, step

CASES = ("fp8_current", "mxfp8")
CLOSURE_CASES = ("delayed", *CASES)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _loss(model, recipe, x):
    with hfp.autocast(recipe=recipe):
        return model(x).square().mean()


def _closure(model, opt, recipe, x):
    """torch's closure: gradients cleared, forward, backward, the loss returned."""
    def closure():
        opt.zero_grad()
        loss = _loss(model, recipe, x)
        loss.backward()
        return loss
    return closure


def _values(model, opt=None):
    """Each parameter's FP32 value: a quantized one's master (``opt``'s), else the parameter."""
    out = {}
    for n, p in model.named_parameters():
        m = opt.master_of(p) if opt is not None else None
        out[n] = (m if m is not None else p).detach().clone()
    return out


def _payloads(p):
    return [t.clone() for t in p.qstorage.tensors()]


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# --- step(closure) -------------------------------------------------------------------------

@pytest.mark.parametrize("name", CLOSURE_CASES)
@pytest.mark.parametrize("opt_class, kw", [(torch.optim.SGD, {"lr": 0.5, "momentum": 0.9}),
                                           (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})])
def test_a_closure_step_moves_the_weights_as_a_step_without_closure(name, opt_class, kw):
    """The closure computes the gradients inside ``step``: the masters must take them then."""
    recipe_a, recipe_b = RECIPES[name](), RECIPES[name]()
    a, b = build(recipe_a, quantized=True), build(recipe_b, quantized=True)
    opt_a = hfp.MasterWeightOptimizer(opt_class, a.parameters(), **kw)
    opt_b = hfp.MasterWeightOptimizer(opt_class, b.parameters(), **kw)
    start = {n: _payloads(p) for n, p in quantized_weights(b).items()}
    for x in batches(2):
        want = step(a, opt_a, recipe_a, x)  # backward, then step()
        got = opt_b.step(_closure(b, opt_b, recipe_b, x))
        assert torch.equal(got.detach(), want)
    for n, v in _values(a, opt_a).items():
        assert torch.equal(_values(b, opt_b)[n], v), n
    for n, p in quantized_weights(a).items():
        assert _same(_payloads(quantized_weights(b)[n]), _payloads(p)), n
        assert not _same(_payloads(quantized_weights(b)[n]), start[n]), n  # the closure's steps moved it


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("line_search_fn", [None, "strong_wolfe"])
def test_lbfgs_trains_quantized_weights_as_fp32_weights(name, line_search_fn):
    """LBFGS evaluates the closure several times a step, moving the parameters in between: each
    evaluation must read weights re-encoded from the moved masters and hand the masters its
    gradients; then the run is the FP32-weight run's, bitwise."""
    recipe_hp, recipe_q = RECIPES[name](), RECIPES[name]()
    hp, q = build(recipe_hp, quantized=False), build(recipe_q, quantized=True)
    kw = {"lr": 0.5, "max_iter": 4, "history_size": 3, "line_search_fn": line_search_fn}
    opt_hp = torch.optim.LBFGS(hp.parameters(), **kw)
    opt_q = hfp.MasterWeightOptimizer(torch.optim.LBFGS, q.parameters(), **kw)
    start = _values(hp)
    for x in batches(2):
        want = opt_hp.step(_closure(hp, opt_hp, recipe_hp, x))
        got = opt_q.step(_closure(q, opt_q, recipe_q, x))
        assert torch.equal(got.detach(), want.detach())
    assert opt_q.optimizer.state[opt_q.optimizer.param_groups[0]["params"][0]]["func_evals"] > 2
    hp_values = _values(hp)
    assert any(not torch.equal(hp_values[n], v) for n, v in start.items())  # it trained
    for n, v in _values(q, opt_q).items():
        assert torch.equal(v, hp_values[n]), n
    # and the weights hold the encoding of the final masters, which a forward reads as the FP32 run's
    x = batches(3)[-1]
    with torch.no_grad():
        assert torch.equal(_loss(q, recipe_q, x), _loss(hp, recipe_hp, x))


# --- torch.amp.GradScaler ------------------------------------------------------------------

def _scaled_run(name, scale, clip, explicit_unscale=True, steps=2):
    recipe = RECIPES[name]()
    q = build(recipe, quantized=True)
    opt = hfp.MasterWeightOptimizer(torch.optim.SGD, q.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale or 1.0, enabled=scale is not None)
    for x in batches(steps):
        scaler.scale(_loss(q, recipe, x)).backward()
        opt.copy_model_grads_to_masters()
        if explicit_unscale:
            scaler.unscale_(opt)
        if clip:
            norm = torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], clip)
            assert norm > clip  # it clips
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return q, opt, scaler


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("clip, explicit_unscale", [(None, True), (None, False), (0.05, True)])
def test_grad_scaler_unscales_the_gradients_the_step_reads(name, clip, explicit_unscale):
    """Scaling the loss by a power of two scales every gradient exactly: with the gradients
    unscaled where the step reads them (the masters'), the run is the unscaled run, bitwise
    (clipping, which needs the unscaled gradients, after ``unscale_``)."""
    ref, ref_opt, _ = _scaled_run(name, None, clip)
    got, got_opt, scaler = _scaled_run(name, 1024.0, clip, explicit_unscale)
    assert scaler.get_scale() == 1024.0  # no step was skipped
    want = _values(ref, ref_opt)
    for n, v in _values(got, got_opt).items():
        assert torch.equal(v, want[n]), n
    for n, p in quantized_weights(ref).items():
        assert _same(_payloads(quantized_weights(got)[n]), _payloads(p)), n


def test_grad_scaler_skips_a_step_with_an_inf_in_a_quantized_weights_gradient():
    recipe = RECIPES["mxfp8"]()
    q = build(recipe, quantized=True)
    opt = hfp.MasterWeightOptimizer(torch.optim.SGD, q.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = _values(q, opt)
    payloads = {n: _payloads(p) for n, p in quantized_weights(q).items()}
    scaler.scale(_loss(q, recipe, batches(1)[0])).backward()
    q.out.weight.grad[0, 0] = float("inf")  # only the quantized weight's gradient overflows
    opt.copy_model_grads_to_masters()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 512.0
    for n, v in _values(q, opt).items():
        assert torch.equal(v, before[n]), n
    for n, p in quantized_weights(q).items():
        assert _same(_payloads(p), payloads[n]), n


def test_grad_scaler_without_copying_the_gradients_first_is_a_clear_error():
    """Without ``copy_model_grads_to_masters`` the scaler unscales the plain parameters'
    gradients alone: the step refuses instead of stepping the weights with scaled gradients."""
    recipe = RECIPES["mxfp8"]()
    q = build(recipe, quantized=True)
    opt = hfp.MasterWeightOptimizer(torch.optim.SGD, q.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    masters = _values(q, opt)
    scaler.scale(_loss(q, recipe, batches(1)[0])).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"GradScaler.*opt\.copy_model_grads_to_masters\(\)"):
        scaler.step(opt)
    for n, v in _values(q, opt).items():
        assert torch.equal(v, masters[n]), n


def test_step_copies_the_gradients_once_after_copy_model_grads_to_masters():
    """An explicit copy is the step's: changes made to the masters' gradients then (unscaling,
    clipping) are what the step reads, for any gradient dtype."""
    recipe = RECIPES["mxfp8"]()
    q = build(recipe, quantized=True)
    opt = hfp.MasterWeightOptimizer(torch.optim.SGD, q.parameters(), lr=1.0)
    w = q.out.weight
    _loss(q, recipe, batches(1)[0]).backward()
    opt.copy_model_grads_to_masters()
    m = opt.master_of(w)
    before = m.detach().clone()
    m.grad = torch.full_like(m, 0.25)  # a copy of another dtype would be a tensor of its own
    opt.step()
    assert torch.equal(m.detach(), before - 0.25)
    # the next step copies again
    _loss(q, recipe, batches(2)[1]).backward()
    opt.step()
    assert m.grad is not None and torch.equal(m.grad, w.grad.float())


# --- named parameters ----------------------------------------------------------------------

@pytest.mark.parametrize("grouped", [False, True])
def test_named_parameters_are_taken_as_torch_optimizers_take_them(grouped):
    recipe_a, recipe_b = RECIPES["mxfp8"](), RECIPES["mxfp8"]()
    a, b = build(recipe_a, quantized=True), build(recipe_b, quantized=True)
    opt_a = hfp.MasterWeightOptimizer(torch.optim.AdamW, a.parameters(), lr=1e-2)
    named = b.named_parameters()
    params = [{"params": named, "weight_decay": 0.1}] if grouped else named
    if grouped:
        opt_a = hfp.MasterWeightOptimizer(torch.optim.AdamW, [{"params": a.parameters(), "weight_decay": 0.1}],
                                          lr=1e-2)
    opt_b = hfp.MasterWeightOptimizer(torch.optim.AdamW, params, lr=1e-2)
    assert [m is not None for m in opt_b.master_params] == [m is not None for m in opt_a.master_params]
    assert sum(m is not None for m in opt_b.master_params) == len(quantized_weights(b)) == 4
    assert opt_b.param_groups[0]["param_names"] == [n for n, _ in b.named_parameters()]
    for x in batches(2):
        step(a, opt_a, recipe_a, x)
        step(b, opt_b, recipe_b, x)
    want = _values(a, opt_a)
    for n, v in _values(b, opt_b).items():
        assert torch.equal(v, want[n]), n
    assert all(p.grad is None for p in b.parameters())  # zero_grad reached the model
    assert opt_b.state_dict()["optimizer"]["param_groups"][0]["param_names"] == list(want)


def test_params_torch_refuses_are_refused_with_the_reason():
    with hfp.quantized_model_init(recipe=hfp.MXFP8BlockScaling()):
        lin = hfp.Linear(32, 32)
    with pytest.raises(TypeError, match="single .*Tensor.*pass \\[tensor\\]"):
        hfp.MasterWeightOptimizer(torch.optim.SGD, lin.weight, lr=0.1)
    with pytest.raises(TypeError, match="set.*pass a list"):
        hfp.MasterWeightOptimizer(torch.optim.SGD, [{"params": {lin.weight, lin.bias}}], lr=0.1)
    with pytest.raises(TypeError, match="tuple of 3 items.*\\(name, parameter\\)"):
        hfp.MasterWeightOptimizer(torch.optim.SGD, [("weight", lin.weight, 0)], lr=0.1)
    with pytest.raises(ValueError, match="with/without names"):  # torch's own check
        hfp.MasterWeightOptimizer(torch.optim.SGD, [("weight", lin.weight), lin.bias], lr=0.1)


# --- the kept initial value ----------------------------------------------------------------

def _kept_linear(recipe):
    torch.manual_seed(0)
    with hfp.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        return hfp.Linear(32, 32, bias=False)


@pytest.mark.parametrize("name", CASES)
def test_an_optimizer_built_after_quantize_master_weights_starts_at_the_value_written(name):
    """Pretrained FP32 values written with ``quantize_master_weights``: a later optimizer seeds
    its master with them, exactly, and a step of lr 0 leaves the weight as it is."""
    lin = _kept_linear(RECIPES[name]())
    pretrained = torch.randn(32, 32, generator=torch.Generator().manual_seed(7))
    hfp.quantize_master_weights([lin.weight], [pretrained])
    assert torch.equal(lin.weight.get_high_precision_init_val(), pretrained)
    written = _payloads(lin.weight)
    opt = hfp.MasterWeightOptimizer(torch.optim.SGD, lin.parameters(), lr=0.0)
    assert torch.equal(opt.master_of(lin.weight), pretrained)
    lin.weight.grad = torch.zeros(32, 32)
    opt.step()
    assert _same(_payloads(lin.weight), written)


def test_quantize_master_weights_of_joined_experts_keeps_their_values():
    torch.manual_seed(0)
    with hfp.quantized_model_init(recipe=hfp.MXFP8BlockScaling(), preserve_high_precision_init_val=True):
        gl = hfp.GroupedLinear(3, 32, 32, bias=False)
    assert gl._primary is not None  # the experts' joined encoding: re-encoded in one grouped call
    g = torch.Generator().manual_seed(7)
    values = [torch.randn(32, 32, generator=g) for _ in range(3)]
    params = list(gl.parameters())
    hfp.quantize_master_weights(params, values)
    opt = hfp.MasterWeightOptimizer(torch.optim.SGD, params, lr=0.0)
    for p, v in zip(params, values):
        assert torch.equal(p.get_high_precision_init_val(), v)
        assert torch.equal(opt.master_of(p), v)


def test_an_optimizer_built_after_training_starts_at_the_trained_weights():
    """After a step the master holds the weight's value: the kept initial value is freed, and an
    optimizer built later seeds from the trained weight, not from the initial value."""
    recipe = hfp.MXFP8BlockScaling()
    lin = _kept_linear(recipe)
    init = lin.weight.get_high_precision_init_val().clone()
    opt1 = hfp.MasterWeightOptimizer(torch.optim.SGD, lin.parameters(), lr=0.1)
    assert torch.equal(opt1.master_of(lin.weight), init)  # seeded exactly
    for x in batches(3):
        with hfp.autocast(recipe=recipe):
            lin(x[:, :32]).square().mean().backward()
        opt1.step()
        opt1.zero_grad()
    assert lin.weight.get_high_precision_init_val() is None
    trained = lin.weight.dequantize().clone()
    opt2 = hfp.MasterWeightOptimizer(torch.optim.SGD, lin.parameters(), lr=0.0)
    assert torch.equal(opt2.master_of(lin.weight), trained)
    lin.weight.grad = torch.zeros(32, 32)
    opt2.step()
    assert torch.equal(lin.weight.dequantize(), trained)


def test_loading_an_optimizer_state_keeps_the_loaded_masters_values():
    """A weight re-encoded from a loaded master, and one that already held its encoding (its
    state dict loaded first), keep the loaded master's value, not their initial one."""
    recipe = hfp.MXFP8BlockScaling()
    lin = _kept_linear(recipe)
    opt = hfp.MasterWeightOptimizer(torch.optim.SGD, lin.parameters(), lr=0.1)
    with hfp.autocast(recipe=recipe):
        lin(batches(1)[0][:, :32]).square().mean().backward()
    opt.step()
    saved_model, saved_opt = lin.state_dict(), opt.state_dict()
    master = opt.master_of(lin.weight).detach().clone()
    for model_first in (False, True):
        fresh = _kept_linear(recipe)
        opt2 = hfp.MasterWeightOptimizer(torch.optim.SGD, fresh.parameters(), lr=0.1)
        if model_first:
            fresh.load_state_dict(saved_model)
        opt2.load_state_dict(saved_opt)
        assert torch.equal(fresh.weight.get_high_precision_init_val(), master), model_first
        assert _same(_payloads(fresh.weight), _payloads(lin.weight)), model_first
