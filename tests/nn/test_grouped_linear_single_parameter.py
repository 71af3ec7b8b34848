"""GroupedLinear(single_parameter=True): one [E, N, K] weight Parameter (and one [E, N] bias).

It must change nothing but the parameters' layout: the same init for the same seed, bitwise the
same outputs and gradients as per-expert Parameters under every recipe (the stacked gradient is
the per-expert gradients stacked), the weight cache still reused between forwards and refreshed
after an in-place update, checkpoints loading across the two layouts, and one AccumulateGrad per
parameter instead of one per expert."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import hybridfp
from hybridfp import factories
from hybridfp.recipes import (CustomRecipe, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                              NVFP4BlockScaling)
from nn_cases import train_side_by_side

RECIPES = {
    "none": None,
    "high_precision": lambda: CustomRecipe(qfactory=factories.high_precision),
    "mxfp8": MXFP8BlockScaling,
    "fp8_current": Float8CurrentScaling,
    "fp8_block": Float8BlockScaling,
    "nvfp4": NVFP4BlockScaling,  # stochastic rounding: the experts quantize one by one
    "composer2": lambda: CustomRecipe(qfactory=factories.nvfp4_row_scaled_fwd_mxfp8_bwd),
}
SPLITS = [40, 0, 72, 16]


def _pair(bias: bool, num: int = 4, k: int = 64, n: int = 32, dtype=torch.float32):
    torch.manual_seed(0)
    single = hybridfp.GroupedLinear(num, k, n, bias=bias, params_dtype=dtype, single_parameter=True, name="single")
    torch.manual_seed(0)
    per_expert = hybridfp.GroupedLinear(num, k, n, bias=bias, params_dtype=dtype, name="per_expert")
    return single, per_expert


def _stacked_grads(m: hybridfp.GroupedLinear) -> list:
    if m.single_parameter:
        return [m.weight.grad] + ([m.bias.grad] if m.use_bias else [])
    ws = [w.grad for w in m.weights()]
    return [torch.stack(ws)] + ([torch.stack([b.grad for b in m.biases()])] if m.use_bias else [])


def test_same_init_and_layout():
    single, per_expert = _pair(bias=True)
    assert [n for n, _ in single.named_parameters()] == ["weight", "bias"]
    assert single.weight.shape == (4, 32, 64) and single.bias.shape == (4, 32)
    assert torch.equal(single.weight, torch.stack(per_expert.weights()))
    assert torch.equal(single.bias, torch.stack(per_expert.biases()))
    assert all(not w.requires_grad for w in single.weights())  # detached views
    assert single.weights()[2].data_ptr() == single.weight[2].data_ptr()
    assert "single_parameter=True" in repr(single)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name", list(RECIPES))
def test_bitwise_equal_to_per_expert_parameters(name, bias):
    """Output, input gradient, weight and bias gradients equal bit for bit over two SGD steps
    (the second re-quantizes the weights after the optimizer's in-place update)."""
    single, per_expert = _pair(bias)
    torch.manual_seed(1)
    x = torch.randn(sum(SPLITS), 64)
    dy = torch.randn(sum(SPLITS), 32)

    def forward(m, xi, step):
        torch.manual_seed(10 + step)  # the same random draws (stochastic rounding) for both
        if RECIPES[name] is None:
            return m(xi, SPLITS)
        with hybridfp.autocast(recipe=RECIPES[name]()):
            return m(xi, SPLITS)

    for (y0, g0, p0), (y1, g1, p1) in train_side_by_side((single, per_expert), x, dy, forward, _stacked_grads):
        assert torch.equal(y0, y1) and torch.equal(g0, g1)
        assert len(p0) == len(p1) and all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert torch.equal(single.weight, torch.stack(per_expert.weights()))


def test_one_accumulate_grad_per_parameter():
    single, per_expert = _pair(bias=True)
    x = torch.randn(sum(SPLITS), 64, requires_grad=True)
    for m, expected in ((single, 3), (per_expert, 9)):  # x's own included
        with hybridfp.autocast(recipe=MXFP8BlockScaling()):
            y = m(x, SPLITS)
        accumulates = [f for f, _ in y.grad_fn.next_functions if f is not None and "AccumulateGrad" in type(f).__name__]
        assert len(accumulates) == expected


def test_weight_cache_kept_between_forwards_and_refreshed_after_update(monkeypatch):
    """The experts' views stay the same objects, so a second forward reuses the quantized
    weights; an in-place update (one version counter) re-quantizes them."""
    from hybridfp.moe import grouped_weights

    calls = []
    real = grouped_weights.quantize_weights_grouped
    monkeypatch.setattr(grouped_weights, "quantize_weights_grouped", lambda *a, **k: calls.append(1) or real(*a, **k))
    single, _ = _pair(bias=False)
    x = torch.randn(sum(SPLITS), 64)
    with hybridfp.autocast(recipe=MXFP8BlockScaling()):
        y0 = single(x, SPLITS)
        assert single(x, SPLITS).equal(y0) and len(calls) == 1
        with torch.no_grad():
            single.weight.mul_(0.5)
        y1 = single(x, SPLITS)
    assert len(calls) == 2 and not torch.equal(y0, y1)


@pytest.mark.parametrize("name", ["high_precision", "fp8_current", "mxfp8"])
def test_weights_quantized_from_the_parameter_itself(name, monkeypatch):
    """The experts' weights are quantized from the one Parameter as the stack (no per-expert keys),
    as the per-expert module's from its packed buffer (each module hands its layout over:
    ``stacked=``), cached as one entry (in its region, or kept through
    is_first_microbatch) that a recipe change or an update invalidates; the result is what the per-expert Parameters give (bitwise)."""
    from hybridfp.moe import grouped_weights

    stacks = []
    real = grouped_weights.quantize_weights_grouped
    monkeypatch.setattr(grouped_weights, "quantize_weights_grouped",
                        lambda *a, **k: stacks.append(k.get("stacked")) or real(*a, **k))
    single, per_expert = _pair(bias=False)
    x = torch.randn(sum(SPLITS), 64)
    with hybridfp.autocast(recipe=RECIPES[name]()):
        y = single(x, SPLITS)
        assert single(x, SPLITS).equal(y)
        want = per_expert(x, SPLITS)
    assert torch.equal(y, want)
    assert len(stacks) == 2 and stacks[0] is not None and stacks[0].data_ptr() == single.weight.data_ptr()
    # the per-expert module hands over its packed buffer
    assert stacks[1] is not None and stacks[1].data_ptr() == per_expert.weight0.data_ptr()
    with hybridfp.autocast(recipe=RECIPES[name]()):
        single(x, SPLITS, is_first_microbatch=True)
    assert len(stacks) == 3
    with hybridfp.autocast(recipe=RECIPES[name]()):
        single(x, SPLITS, is_first_microbatch=False)
    assert len(stacks) == 3  # kept: nothing quantized
    with hybridfp.autocast(recipe=Float8BlockScaling()):  # another recipe: quantized anew
        single(x, SPLITS)
    assert len(stacks) == 4


def test_stacked_weights_must_be_the_views_stack():
    from hybridfp.moe.quantize_weights import quantize_weights_grouped
    w = torch.randn(4, 8, 16)
    qs = [hybridfp.MXFP8Quantizer() for _ in range(4)]
    with pytest.raises(ValueError, match=r"stacked must be the contiguous \[4, 8, 16\] tensor"):
        quantize_weights_grouped(qs, list(w.unbind(0)), stacked=w.transpose(1, 2).contiguous().transpose(1, 2))


def test_gradients_accumulate_over_micro_batches():
    single, per_expert = _pair(bias=True)
    xs = [torch.randn(sum(SPLITS), 64) for _ in range(2)]
    for m in (single, per_expert):
        with hybridfp.autocast(recipe=Float8CurrentScaling()):
            for x in xs:
                m(x, SPLITS).square().sum().backward()
    for a, b in zip(_stacked_grads(single), _stacked_grads(per_expert)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bias", [True, False])
def test_state_dict_loads_across_layouts(bias):
    single, per_expert = _pair(bias)
    with torch.no_grad():
        for p in per_expert.parameters():
            p.add_(torch.randn_like(p))
    single.load_state_dict(per_expert.state_dict())
    assert torch.equal(single.weight, torch.stack(per_expert.weights()))
    other = hybridfp.GroupedLinear(4, 64, 32, bias=bias, name="other")
    other.load_state_dict(single.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(other.weights(), per_expert.weights()))
    assert all(torch.equal(a, b) for a, b in zip(other.biases(), per_expert.biases()))
    # a wrong expert count is an error naming the key, not a silent reshape
    wrong = hybridfp.GroupedLinear(3, 64, 32, bias=bias, single_parameter=True)
    with pytest.raises(RuntimeError, match="weight"):
        wrong.load_state_dict(per_expert.state_dict())


def test_views_follow_moves_and_replaced_tensors():
    single, _ = _pair(bias=True)
    x = torch.randn(sum(SPLITS), 64)
    with hybridfp.autocast(recipe=MXFP8BlockScaling()):
        y = single(x, SPLITS)
    single.double()
    assert all(w.dtype == torch.float64 and w.data_ptr() == single.weight[i].data_ptr()
               for i, w in enumerate(single.weights()))
    single.float()
    with hybridfp.autocast(recipe=MXFP8BlockScaling()):
        assert torch.equal(single(x, SPLITS), y)
    single.weight = torch.nn.Parameter(single.weight.detach() * 2)
    assert single.weights()[1].data_ptr() == single.weight[1].data_ptr()
    with hybridfp.autocast(recipe=MXFP8BlockScaling()):
        assert not torch.equal(single(x, SPLITS), y)


def test_a_move_frees_the_old_tensor():
    """The per-expert views and the quantized weights cached under them belong to the old
    tensor: a move (``.double()``, ``.cpu()`` to offload) drops them, so nothing keeps it."""
    single, _ = _pair(bias=True)
    with hybridfp.autocast(recipe=MXFP8BlockScaling()):
        single(torch.randn(sum(SPLITS), 64), SPLITS)
    old = weakref.ref(single.weights()[0])
    single.double()
    gc.collect()
    assert old() is None and single.weights()[0].dtype == torch.float64


def test_quantized_weight_parameter_refused():
    single, _ = _pair(bias=False)
    q = hybridfp.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    single.weight = torch.nn.Parameter(q(single.weight.detach()))
    with pytest.raises(ValueError, match="single_parameter=True takes a high-precision weight"):
        with hybridfp.autocast(recipe=Float8CurrentScaling()):
            single(torch.randn(sum(SPLITS), 64), SPLITS)


def test_state_dict_experts_of_other_shapes_reported_by_key():
    single, _ = _pair(bias=False)
    sd = {f"weight{i}": torch.zeros(32, 64 if i != 2 else 63) for i in range(4)}
    with pytest.raises(RuntimeError, match="weight2"):
        single.load_state_dict(sd)


def test_assigned_per_expert_weights_keep_their_own_versions():
    """``load_state_dict(assign=True)`` of a stacked checkpoint into per-expert Parameters gives
    each expert its own tensor (an update to one re-quantizes that expert only), packed again."""
    single, per_expert = _pair(bias=True)
    per_expert.load_state_dict(single.state_dict(), assign=True)
    before = [w._version for w in per_expert.weights()]
    with torch.no_grad():
        per_expert.weight1.add_(1.0)
    after = [w._version for w in per_expert.weights()]
    assert after[1] == before[1] + 1 and after[0] == before[0] and after[2] == before[2]
    assert per_expert.packed_buffer() is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["high_precision", "mxfp8", "fp8_current", "composer2"])
def test_bitwise_equal_on_cuda_at_64_experts(name):
    """The CUDA paths of many experts (joined copies, grouped kernels, the joined wgrad whose
    buffer becomes the stacked gradient) give the single Parameter the same bits."""
    torch.manual_seed(0)
    single = hybridfp.GroupedLinear(64, 256, 128, bias=False, params_dtype=torch.bfloat16, device="cuda",
                                    single_parameter=True)
    torch.manual_seed(0)
    per_expert = hybridfp.GroupedLinear(64, 256, 128, bias=False, params_dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(1)
    splits = torch.randint(0, 97, (64,), generator=g).tolist()
    splits[3] = 0
    x = torch.randn(sum(splits), 256, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(sum(splits), 128, device="cuda", dtype=torch.bfloat16)
    results = []
    for m in (single, per_expert):
        xi = x.clone().requires_grad_(True)
        with hybridfp.autocast(recipe=RECIPES[name]()):
            y = m(xi, splits)
        y.backward(dy)
        results.append((y, xi.grad, _stacked_grads(m)[0]))
    (y0, g0, w0), (y1, g1, w1) = results
    assert torch.equal(y0, y1) and torch.equal(g0, g1) and torch.equal(w0, w1)
