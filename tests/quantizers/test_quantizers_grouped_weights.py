"""``quantize_weights_grouped``: an MoE layer's [N, K] expert weights quantized from one stacked
[E*N, K] tensor equal, bit for bit, each expert's own ``quantize`` — every payload tensor of
every copy, for every factory's weight role, with N a whole number of 32- / 128-row blocks or
not (then the columnwise groups are zero-padded) and K not a multiple of 32 or 128."""

from __future__ import annotations

import pytest
import torch
from test_quantizers_grouped import FACTORIES, assert_same_storage, build

from hybridfp.moe.quantize_weights import quantize_weights_grouped

K = 72


def weights(n: int, experts: int = 4) -> list[torch.Tensor]:
    """Experts at magnitudes 2**-6, 1, 2**6, ...: per-expert scales differ."""
    g = torch.Generator().manual_seed(9)
    return [(torch.randn(n, K, generator=g) * 2.0 ** (6 * ((e % 3) - 1))).bfloat16() for e in range(experts)]


@pytest.mark.parametrize("columnwise", [True, False])
@pytest.mark.parametrize("n", [128, 48, 40])
@pytest.mark.parametrize("name", list(FACTORIES))
def test_stacked_weights_equal_per_expert_quantize(name, n, columnwise):
    ws = weights(n)
    usage = [(True, columnwise)] * len(ws)
    torch.manual_seed(7)
    got = quantize_weights_grouped(build(FACTORIES[name], "weight", usage), ws)
    torch.manual_seed(7)
    want = [q.quantize(w) for q, w in zip(build(FACTORIES[name], "weight", usage), ws)]
    assert len(got) == len(want)
    for e, (g, w) in enumerate(zip(got, want)):
        assert_same_storage(g.qstorage, w.qstorage, f"{name} N={n} expert {e}")


def test_mismatched_shapes_are_refused():
    ws = weights(32)
    ws[1] = ws[1][:16]
    with pytest.raises(ValueError, match="one shape"):
        quantize_weights_grouped(build(FACTORIES["mxfp8"], "weight", [(True, True)] * 4), ws)


def test_weights_in_one_buffer_are_not_stacked_by_a_copy(monkeypatch):
    """Experts' weights handed with the buffer they are views of (``stacked=``: the caller states
    its layout) are read as that buffer (no ``torch.stack`` copy); the result still equals each
    expert's own quantize bitwise."""
    buf = torch.randn(4, 64, 96).bfloat16()
    weights = list(buf.unbind(0))
    stacks = []
    real = torch.stack
    monkeypatch.setattr(torch, "stack", lambda *a, **k: stacks.append(1) or real(*a, **k))
    got = quantize_weights_grouped(build(FACTORIES["mxfp8"], "weight", [(True, True)] * 4), weights, stacked=buf)
    monkeypatch.undo()
    assert stacks == []
    for e, (g, w) in enumerate(zip(got, weights)):
        want = build(FACTORIES["mxfp8"], "weight", [(True, True)] * 4)[0].quantize(w)
        assert_same_storage(g.qstorage, want.qstorage, f"expert {e}")
    # separate tensors are stacked by one copy, with the same result
    monkeypatch.setattr(torch, "stack", lambda *a, **k: stacks.append(1) or real(*a, **k))
    quantize_weights_grouped(build(FACTORIES["mxfp8"], "weight", [(True, True)] * 4), [w.clone() for w in weights])
    assert stacks == [1]


@pytest.mark.parametrize("adjacent", [False, True])
def test_large_per_tensor_scaled_weights_are_quantized_per_expert(monkeypatch, set_policy, adjacent):
    """FP8 current scaling shares launches, not encodings: experts above
    the policy's ``stack_scaled_max_numel`` elements are quantized one by one (no stacking copy) unless they
    already are one buffer (handed as ``stacked=``); below it they are stacked. Every way equals each expert's quantize."""
    from hybridfp.moe import quantize_weights as qg
    name = "current_scaling"
    ws, buf = weights(48), None
    if adjacent:
        buf = torch.stack(ws)
        ws = list(buf.unbind(0))
    usage = [(True, True)] * len(ws)
    want = [q.quantize(w) for q, w in zip(build(FACTORIES[name], "weight", usage), ws)]
    for limit, stacked in ((ws[0].numel() - 1, adjacent), (ws[0].numel(), True)):
        set_policy(stack_scaled_max_numel=limit)
        calls = []
        real = qg.quantize_grouped
        monkeypatch.setattr(qg, "quantize_grouped", lambda *a: calls.append(1) or real(*a))
        got = quantize_weights_grouped(build(FACTORIES[name], "weight", usage), ws, stacked=buf)
        monkeypatch.setattr(qg, "quantize_grouped", real)
        assert (calls == [1]) == stacked, (limit, adjacent)
        for e, (g, w) in enumerate(zip(got, want)):
            assert_same_storage(g.qstorage, w.qstorage, f"limit {limit} expert {e}")
