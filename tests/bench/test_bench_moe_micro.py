"""bench_moe's micro-batch step: weights quantized once per step, gradients accumulated.

Runs the benchmark's layer on the CPU at a tiny shape (``bench.common.DEVICE = "cpu"``)."""

from __future__ import annotations

import torch

import hybridfp
from bench import bench_moe, common
from hybridfp.moe import grouped_weights


def _layer(monkeypatch):
    monkeypatch.setattr(common, "DEVICE", "cpu")
    torch.manual_seed(0)
    base = bench_moe.BF16MoE(4, 64, 32)
    x = torch.randn(48, 64, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(48, 64, dtype=torch.bfloat16)
    return base, bench_moe.HybridMoE(base), x, dy


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
    bench_moe.make_step(model, x, dy, ctx, micro_batches=1)()
    once = [p.grad.clone() for p in (model.fc1.weight0, model.fc2.weight3, model.router)]
    n_once = len(calls)
    assert n_once == 2  # fc1 and fc2: all experts quantized together, once each
    calls.clear()
    bench_moe.make_step(model, x, dy, ctx, micro_batches=3)()
    # the later micro-batches hit the weight caches: still one quantization per layer
    assert len(calls) == n_once
    for g1, p in zip(once, (model.fc1.weight0, model.fc2.weight3, model.router)):
        # three identical passes: every gradient is the single pass's, accumulated three times
        torch.testing.assert_close(p.grad.float(), 3 * g1.float(), rtol=2e-2, atol=1e-6)


def test_paired_rows_time_each_variant_beside_its_own_baseline(monkeypatch):
    """``--paired``: every row but the baselines gets a paired ratio, each timed alternately with
    the baseline of its own micro-batch count (the timings faked: 2 ms baseline, 4 ms variant)."""
    monkeypatch.setattr(common, "DEVICE", "cpu")
    pairs = []

    def fake_pair(a, b, rounds=3):
        pairs.append((a, b, rounds))
        return 2.0, 4.0

    monkeypatch.setattr(bench_moe, "bench_pair", fake_pair)
    rows = bench_moe.bench_config(4, 32, 48, 64, only=["hybridfp MXFP8"], micro_batches=2, paired=True)
    by_name = {r["variant"]: r for r in rows}
    assert set(by_name) == {"BF16 grouped", "hybridfp MXFP8", "BF16 grouped [2 micro-batches a weight update]",
                            "hybridfp MXFP8 [2 micro-batches a weight update]"}
    assert all("error" not in r for r in rows)
    assert by_name["hybridfp MXFP8"]["paired_x_bf16_grouped"] == 0.5
    assert "paired_x_bf16_grouped" not in by_name["BF16 grouped"]
    assert len(pairs) == 2 and all(r == bench_moe.PAIR_ROUNDS for _, _, r in pairs)
    assert pairs[0][0] is not pairs[1][0]  # the 1- and the 2-micro-batch baselines
