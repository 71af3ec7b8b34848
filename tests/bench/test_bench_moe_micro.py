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


def test_each_micro_batch_reads_its_counts_through_the_layers_sync_clock(monkeypatch):
    base, model, x, dy = _layer(monkeypatch)
    reads = []

    class Counting(moe_layer.SyncClock):
        def counts(self, counts):
            reads.append(counts.clone())
            return super().counts(counts)

    model.sync = Counting()
    moe_layer.make_step(model, x, dy, lambda: hybridfp.autocast(recipe=hybridfp.MXFP8BlockScaling()),
                        micro_batches=3)()
    assert len(reads) == 3 and all(int(c.sum()) == 48 * moe_layer.TOP_K for c in reads)  # one sync a micro-batch
    assert model.sync.seconds > 0
    per_expert = base.sharing("per_expert")
    assert per_expert.sync is not base.sync and base.reference().sync is not base.sync  # a clock each
    per_expert(x.detach())
    base(x.detach())
    assert per_expert.sync.seconds > 0 and base.sync.seconds == 0  # the grouped layer never syncs


def test_host_ms_splits_the_hosts_own_work_from_its_waits_at_the_syncs(monkeypatch):
    import time

    from bench.bench_moe import host_ms
    monkeypatch.setattr(common, "DEVICE", "cpu")

    class SlowCounts:  # stands for counts whose .tolist() waits ``s`` seconds for the GPU
        def __init__(self, s):
            self.s = s

        def tolist(self):
            time.sleep(self.s)
            return [1, 2]

    class Model:
        sync = moe_layer.SyncClock()

    # (wait, own work) in seconds per call: hosts of 40, 80 and 120 ms; the median call (80 ms)
    # waited 5 ms, unlike the first call (30) or the median of the waits alone (30)
    calls = iter([(0.0, 0.0), (0.03, 0.01), (0.005, 0.075), (0.1, 0.02)])

    def step():
        wait, own = next(calls)
        Model.sync.counts(SlowCounts(wait))
        time.sleep(own)  # the host's own work

    host, waited = host_ms(step, Model(), warmup=1, reps=3)
    assert 5 <= waited < 20 and host - waited >= 75 and 80 <= host < 115, (host, waited)
    calls = iter([(0.01, 0.0)])
    assert host_ms(step, object(), warmup=0, reps=1)[1] == 0.0  # a layer without a clock never waits
