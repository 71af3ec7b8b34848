"""A compiled hybridfp module that ran quantized still runs in high precision outside
``hybridfp.autocast`` (README), with ``fullgraph=True`` and gradients enabled."""

from __future__ import annotations

import warnings

import pytest
import torch

import hybridfp as hf


@pytest.mark.parametrize("make", [lambda: hf.Linear(64, 32), lambda: hf.LayerNormMLP(64, 128)],
                         ids=["Linear", "LayerNormMLP"])
def test_high_precision_after_a_quantized_call_compiles_as_one_graph(make):
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = make()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    x = torch.randn(8, 64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU's emulated GEMMs say so
        with hf.autocast(recipe=hf.MXFP8BlockScaling()):
            compiled(x).sum().backward()
        for enabled in (None, False):  # no region; a disabled one
            x.grad = None
            if enabled is None:
                y = compiled(x)
            else:
                with hf.autocast(enabled=False):
                    y = compiled(x)
            y.sum().backward()
            x_ref = x.detach().clone().requires_grad_()
            with hf.autocast(enabled=False):
                m(x_ref).sum().backward()
            assert torch.equal(x.grad, x_ref.grad)
