"""hybridfp.checkpoint (a thin alias of torch.utils.checkpoint.checkpoint, non-reentrant by
default) recomputes with the forward's quantization (bitwise equal gradients). torch's own
checkpoint in both modes: tests/integration/test_torch_checkpoint.py."""

import pytest
import torch
import torch.utils.checkpoint as tc
from torch import nn

import hybridfp as hfp
from hybridfp.factories import per_gemm


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(hfp.LayerNormLinear(32, 64, name="fc1"), nn.GELU(), hfp.Linear(64, 32, name="fc2"))


def _grads(recipe, use_checkpoint: bool, backward_inside: bool = False):
    model = _mlp()
    x = torch.randn(24, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.manual_seed(7)  # stochastic rounding draws
    with hfp.autocast(recipe=recipe):
        y = hfp.checkpoint(model, x) if use_checkpoint else model(x)
        loss = (y.float() ** 2).mean()
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    return [y.detach(), x.grad] + [p.grad for p in model.parameters()]


RECIPES = {
    "mxfp8": lambda: hfp.MXFP8BlockScaling(),
    "fp8_current": lambda: hfp.Float8CurrentScaling(),
    "nvfp4_full": lambda: hfp.NVFP4BlockScaling(),  # RHT + SR on gradients, 2D weights
    "hybrid": lambda: hfp.CustomRecipe(qfactory=per_gemm("nvfp4", "mxfp8", "fp8_block")),
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_checkpoint_is_bitwise_equal_to_no_checkpoint(name):
    want = _grads(RECIPES[name](), use_checkpoint=False)
    got = _grads(RECIPES[name](), use_checkpoint=True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_checkpoint_differs_from_high_precision_recompute():
    """The quantized recomputation matters: the gradients differ from a BF16/FP32 run."""
    quantized = _grads(RECIPES["mxfp8"](), use_checkpoint=True)
    model = _mlp()
    x = torch.randn(24, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    (model(x).float() ** 2).mean().backward()
    assert not torch.equal(quantized[1], x.grad)


def test_delayed_scaling_backward_inside_region_works():
    want = _grads(hfp.DelayedScaling(), use_checkpoint=False, backward_inside=True)
    got = _grads(hfp.DelayedScaling(), use_checkpoint=True, backward_inside=True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_delayed_scaling_backward_after_region_works():
    """The recomputation quantizes with the forward's scales, not those updated at the region's
    end (two steps: the second forward's scales are not the initial ones)."""
    want, got = [], []
    for out, use_checkpoint in ((want, False), (got, True)):
        model = _mlp()
        recipe = hfp.DelayedScaling(amax_history_len=4)
        for step in range(2):
            x = torch.randn(24, 32, generator=torch.Generator().manual_seed(step), requires_grad=True)
            with hfp.autocast(recipe=recipe):
                y = hfp.checkpoint(model, x) if use_checkpoint else model(x)
            (y.float() ** 2).mean().backward()
            out += [x.grad] + [p.grad.clone() for p in model.parameters()]
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_alias_is_torch_checkpoint_in_both_modes(use_reentrant):
    want = _grads(RECIPES["mxfp8"](), use_checkpoint=False)
    model = _mlp()
    x = torch.randn(24, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.manual_seed(7)
    with hfp.autocast(recipe=RECIPES["mxfp8"]()):
        y = hfp.checkpoint(model, x, use_reentrant=use_reentrant)
    (y.float() ** 2).mean().backward()
    for a, b in zip([y.detach(), x.grad] + [p.grad for p in model.parameters()], want):
        assert torch.equal(a, b)


def test_high_precision_model_still_checkpoints_with_torch():
    """Modules never run quantized keep working with torch's checkpoint."""
    model = _mlp()
    x = torch.randn(8, 32, requires_grad=True)
    tc.checkpoint(model, x, use_reentrant=False).sum().backward()
    assert x.grad is not None
