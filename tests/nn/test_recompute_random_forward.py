"""A checkpointed module whose forward quantizers round stochastically is refused by name: its
recomputation would not draw the forward's numbers (a cached weight skips its draw, a
quantizer's own generator is not restored), so its gradients would silently belong to another
forward. Stochastic rounding of gradients (NVFP4's recipe) stays allowed."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import hybridfp as hf
from hybridfp.quantizers import NVFP4Quantizer


def _sr_input(role):
    return NVFP4Quantizer(stochastic_rounding=role is not None and role.tensor_type == "input")


@pytest.mark.parametrize("reentrant", [False, True])
def test_stochastic_forward_rounding_under_checkpoint_is_refused_by_name(reentrant):
    m = hf.Linear(64, 64, name="proj")
    x = torch.randn(16, 64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with hf.autocast(recipe=hf.CustomRecipe(qfactory=_sr_input)):
            with pytest.raises(NotImplementedError, match="Linear proj: its input quantizer .* rounds stochastically"):
                checkpoint(m, x, use_reentrant=reentrant)
            m(x)  # without checkpoint: allowed


def test_stochastic_gradient_rounding_under_checkpoint_stays_bitwise():
    torch.manual_seed(0)
    m = hf.Linear(64, 64)
    x0, dy = torch.randn(16, 64), torch.randn(16, 64)
    grads = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for ckpt in (False, True):
            x = x0.clone().requires_grad_()
            torch.manual_seed(7)
            with hf.autocast(recipe=hf.NVFP4BlockScaling()):
                y = checkpoint(m, x, use_reentrant=False) if ckpt else m(x)
            y.backward(dy)
            grads.append((x.grad, m.weight.grad.clone()))
            m.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(*grads))
