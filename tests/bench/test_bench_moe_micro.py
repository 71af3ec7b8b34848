"""bench_moe's micro-batch step: weights quantized once per step, gradients accumulated.

Runs the benchmark's layer on the CPU at a tiny shape (``bench.common.DEVICE = "cpu"``)."""

from __future__ import annotations

import torch

import hybridfp
from bench import common, moe_layer
from hybridfp.moe import grouped_weights


def _layer(monkeypatch):
    monkeypatch.setattr(common, "DEVICE", "cpu")
    torch.manual_seed(0)
    base = moe_layer.BF16MoE(4, 64, 32)
    x = torch.randn(48, 64, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(48, 64, dtype=torch.bfloat16)
    return base, moe_layer.HybridMoE(base), x, dy


def test_micro_batches_quantize_weights_once_and_accumulate(monkeypatch):
    base, model, x, dy = _layer(monkeypatch)
    calls = []
    real = grouped_weights.quantize_weights_grouped

    def counting(qs, ws, plans=None, **k):
        calls.append(len(ws))
        return real(qs, ws, plans, **k)

    monkeypatch.setattr(grouped_weights, "quantize_weights_grouped", counting)
    recipe = hybridfp.MXFP8BlockScaling()
    ctx = lambda: hybridfp.autocast(recipe=recipe)  # noqa: E731
    moe_layer.make_step(model, x, dy, ctx, micro_batches=1)()
    once = [p.grad.clone() for p in (model.fc1.weight0, model.fc2.weight3, model.router)]
    n_once = len(calls)
    assert n_once == 2  # fc1 and fc2: all experts quantized together, once each
    calls.clear()
    moe_layer.make_step(model, x, dy, ctx, micro_batches=3)()
    # the later micro-batches hit the weight caches: still one quantization per layer
    assert len(calls) == n_once
    for g1, p in zip(once, (model.fc1.weight0, model.fc2.weight3, model.router)):
        # three identical passes: every gradient is the single pass's, accumulated three times
        torch.testing.assert_close(p.grad.float(), 3 * g1.float(), rtol=2e-2, atol=1e-6)
