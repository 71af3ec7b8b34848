"""torch.compile of modules holding quantized weight parameters (``quantized_model_init``).

The forward op takes the held weight's payload tensors as inputs and rebuilds the
QuantizedTensor inside (hybridfp/nn/ops.py); the weight's gradient reaches the parameter's
``.grad`` as in eager (a plain tensor of the weight's nominal dtype). ``backend="aot_eager"``
runs each op as eager does, so bitwise equality is the right claim (tests/README.md).
"""

from __future__ import annotations

import copy

import pytest
import torch

import hybridfp as hf
from hybridfp import factories

RECIPES = {
    "current": hf.Float8CurrentScaling,
    "mxfp8": hf.MXFP8BlockScaling,
    "nvfp4": hf.NVFP4BlockScaling,
    "hybrid_mxfp8_nvfp4": lambda: hf.CustomRecipe(qfactory=factories.mxfp8_fwd_nvfp4_bwd),
    "delayed": lambda: hf.DelayedScaling(amax_history_len=4),
}
MODULES = {
    "Linear": lambda: hf.Linear(64, 32),
    "LayerNormLinear": lambda: hf.LayerNormLinear(64, 32),
    "LayerNormMLP": lambda: hf.LayerNormMLP(64, 128),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _make(module: str, recipe: str):
    torch.manual_seed(0)
    with hf.quantized_model_init(recipe=RECIPES[recipe](), preserve_high_precision_init_val=True):
        return MODULES[module]()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_one_graph_no_break(module: str) -> None:
    m = _make(module, "mxfp8")
    x = torch.randn(8, 64, requires_grad=True)
    with hf.autocast(recipe=hf.MXFP8BlockScaling()):
        explained = torch._dynamo.explain(m)(x)
    assert explained.graph_break_count == 0, [str(b.reason)[:300] for b in explained.break_reasons]
    assert explained.graph_count == 1


def _step(m, opt, x: torch.Tensor, recipe, seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)  # NVFP4 stochastic rounding draws its seeds from torch's generator
    x = x.clone().requires_grad_()
    with hf.autocast(recipe=recipe):
        y = m(x)
    (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
    grads = [p.grad.clone() for p in opt.model_params]
    opt.step()
    opt.zero_grad()
    return [y.detach(), x.grad] + grads


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("module", sorted(MODULES))
def test_fullgraph_bitwise_eager_with_master_steps(module: str, recipe: str) -> None:
    """Three steps with MasterWeightOptimizer between them: each compiled call reads the weight
    the master update wrote (no stale payload), and everything stays bitwise eager."""
    eager = _make(module, recipe)
    twin = copy.deepcopy(eager)
    opt_e = hf.MasterWeightOptimizer(torch.optim.AdamW, eager.parameters(), lr=1e-2)
    opt_c = hf.MasterWeightOptimizer(torch.optim.AdamW, twin.parameters(), lr=1e-2)
    compiled = torch.compile(twin, fullgraph=True, backend="aot_eager")
    outs = []
    for step in range(3):
        x = torch.randn(8, 64)
        a = _step(eager, opt_e, x, RECIPES[recipe](), 100 + step)
        b = _step(compiled, opt_c, x, RECIPES[recipe](), 100 + step)
        assert len(a) == len(b)
        for u, v in zip(a, b):
            assert type(u) is type(v) and u.dtype == v.dtype
            assert torch.equal(u, v)
        outs.append(b[0])
    assert not torch.equal(outs[0], outs[1])  # the master update changed the weight seen
    if recipe == "delayed":
        sa, sb = eager.get_extra_state()["quantizers"], twin.get_extra_state()["quantizers"]
        for k in sa:
            for name, t in sa[k]["state"].items():
                if isinstance(t, torch.Tensor):
                    assert torch.equal(t, sb[k]["state"][name]), (k, name)


def test_weight_grad_is_a_plain_tensor_and_hooks_run() -> None:
    """As in eager: ``weight.grad`` is a plain FP32 [N, K] tensor, accumulated over two
    backward passes, and the parameter's post-accumulate-grad hook runs (DDP relies on it)."""
    m = _make("Linear", "mxfp8")
    seen = []
    m.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    x = torch.randn(8, 64)
    for _ in range(2):
        with hf.autocast(recipe=hf.MXFP8BlockScaling()):
            y = compiled(x)
        y.sum().backward()
    assert type(m.weight.grad) is torch.Tensor and m.weight.grad.dtype == torch.float32
    assert m.weight.grad.shape == (32, 64)
    assert len(seen) == 2 and torch.equal(seen[1], 2 * seen[0])


def test_no_weight_grad_and_no_grad() -> None:
    """A frozen quantized weight gets no gradient; under no_grad nothing is saved."""
    m = _make("Linear", "current")
    m.weight.requires_grad_(False)
    ref = copy.deepcopy(m)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    x = torch.randn(8, 64, requires_grad=True)
    outs = []
    for mod in (ref, compiled):
        xx = x.detach().clone().requires_grad_()
        with hf.autocast(recipe=hf.Float8CurrentScaling()):
            y = mod(xx)
        y.sum().backward()
        outs.append((y.detach(), xx.grad))
    assert m.weight.grad is None
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    with torch.no_grad(), hf.autocast(recipe=hf.Float8CurrentScaling()):
        assert torch.equal(compiled(x), ref(x))
