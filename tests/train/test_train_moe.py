"""The MoE layer: routing, sorted-token GroupedLinear experts (zero-size experts included),
forward/backward under every kind of recipe, and the GPT model around it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridfp import autocast
from hybridfp.train.model import GPT, PRESETS, GPTConfig
from hybridfp.train.moe import MoE, activation, load_balancing_loss, route
from hybridfp.train.recipes_by_name import parse_recipe

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")

CFG = GPTConfig(n_layer=1, n_head=2, n_embd=64, n_experts=4, top_k=2, moe_hidden=64, block_size=32)


def _moe_with_idle_experts(seed: int = 0) -> MoE:
    """Router weights that rank experts 0 > 1 > 2 > 3 for any positive input: with top-2,
    experts 2 and 3 get no tokens (m_splits [T, T, 0, 0])."""
    torch.manual_seed(seed)
    moe = MoE(CFG)
    with torch.no_grad():
        moe.router.weight.copy_(torch.tensor([1.0, 0.0, -1.0, -2.0]).view(4, 1).expand(4, 64) * 0.05)
    return moe


def _reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Dense computation of the MoE output: every expert on every token, then each token's
    top-k outputs gathered and gated (FP32, no grouping, no sorting)."""
    h = moe.norm(x.float()).reshape(-1, x.shape[-1])
    probs = moe.router(h).softmax(-1)
    gates, experts = probs.topk(moe.top_k, -1)
    gates = gates / gates.sum(-1, keepdim=True)
    every = torch.stack([F.linear(activation(F.linear(h, w1), moe.kind), w2)
                         for w1, w2 in zip(moe.fc1.weights(), moe.fc2.weights())])  # [E, T, C]
    picked = every[experts, torch.arange(h.shape[0]).unsqueeze(1)]                   # [T, k, C]
    return (gates.unsqueeze(-1) * picked).sum(1).view(x.shape)


def test_routing_sorts_tokens_by_expert():
    probs = torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.1, 0.4], [0.2, 0.3, 0.5]])
    gates, order, flat, m_splits = route(probs, 2)
    assert m_splits == [1, 2, 3] and sum(m_splits) == 6
    assert flat[order].tolist() == sorted(flat.tolist())
    assert torch.allclose(gates.sum(-1), torch.ones(3))
    # perfectly balanced routing gives the minimum aux loss, 1
    uniform = torch.full((8, 4), 0.25)
    assert load_balancing_loss(uniform, torch.arange(8) % 4).item() == pytest.approx(1.0)


def test_moe_matches_token_by_token_reference_in_high_precision():
    moe = _moe_with_idle_experts()
    x = torch.rand(2, 8, 64) + 0.1
    y = moe(x)
    assert moe.last_m_splits == [16, 16, 0, 0]
    torch.testing.assert_close(y, _reference(moe, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["bf16", "fp8", "fp8-delayed", "mxfp8", "nvfp4", "nvfp4-fwd-mxfp8-bwd",
                                  "mxfp8-fwd-nvfp4-bwd", "per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8"])
def test_moe_forward_backward_with_zero_size_experts(name):
    recipe = parse_recipe(name).recipe
    moe = _moe_with_idle_experts()
    x = (torch.rand(4, 16, 64) + 0.1).to(torch.bfloat16).requires_grad_()
    for _ in range(2):  # the first pass calibrates delayed scaling (its scales start at 1)
        moe.zero_grad()
        x.grad = None
        with autocast(recipe=recipe):
            y = moe(x)
        (y.float().square().mean() + moe.aux_loss).backward()
    assert moe.last_m_splits == [64, 64, 0, 0]
    assert y.shape == x.shape and y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    for i, (w1, w2) in enumerate(zip(moe.fc1.weights(), moe.fc2.weights())):
        for w in (w1, w2):
            g = torch.zeros_like(w) if w.grad is None else w.grad
            assert torch.isfinite(g).all()
            assert (g.abs().sum() > 0) == (i < 2), f"expert {i}: gradient only where tokens went"
    assert moe.router.weight.grad is not None  # the router learns through the gates and aux loss
    # the quantized output stays close to the high-precision one (same routing)
    ref = _reference(moe, x.detach().float())
    rel = (y.float() - ref).norm() / ref.norm()
    assert rel < 0.35, f"{name}: relative error {rel:.3f}"  # NVFP4 fwd ~0.1-0.2, FP8 ~0.05


def test_moe_model_trains_a_few_steps():
    cfg = PRESETS["test-moe"].model
    torch.manual_seed(0)
    model = GPT(cfg)
    recipe = parse_recipe("nvfp4-fwd-mxfp8-bwd").recipe
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(0, 256, (4, 32))
    losses = []
    for _ in range(6):
        with autocast(recipe=recipe):
            _, loss = model(x, x.roll(-1, 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    names = {m.name for m in model.modules() if hasattr(m, "quantizer_roles")}
    assert "blocks.0.mlp.fc1" in names and "blocks.1.attn.qkv" in names  # set_names ran
    roles = model.blocks[0].mlp.fc1.quantizer_roles()
    assert roles["input"][0].module_type == "grouped_linear" and roles["input"][0].name == "blocks.0.mlp.fc1"


def test_dense_model_high_precision_layers_are_not_quantized_by_default():
    model = GPT(PRESETS["test"].model)
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight is model.wte.weight
    q = GPT(GPTConfig(**{**PRESETS["test"].model.to_dict(), "quantize_lm_head": True}))
    assert type(q.lm_head).__name__ == "Linear" and q.lm_head.name == "lm_head"
