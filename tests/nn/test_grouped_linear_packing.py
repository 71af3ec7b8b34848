"""GroupedLinear's packed expert weights (``pack_weights``): one buffer, separate Parameters.

The packing exists so the grouped weight quantization reads the experts in place instead of
stacking them every step; it must change nothing else: the same values and init, bitwise the
same outputs and gradients as unpacked experts, separate version counters (changing one expert
re-quantizes that expert only), and it survives dtype / device moves."""

from __future__ import annotations

import pytest
import torch

import hybridfp
from hybridfp.recipes import Float8CurrentScaling, MXFP8BlockScaling
from nn_cases import train_side_by_side


def _pair(num: int = 3, k: int = 64, n: int = 32, bias: bool = True):
    """A packed and an unpacked GroupedLinear with equal parameters."""
    torch.manual_seed(0)
    packed = hybridfp.GroupedLinear(num, k, n, bias=bias, name="packed")
    torch.manual_seed(0)
    plain = hybridfp.GroupedLinear(num, k, n, bias=bias, name="plain", pack_weights=False)
    return packed, plain


def test_packed_by_default_and_same_init():
    packed, plain = _pair()
    assert packed.packed_buffer() is not None
    assert plain.packed_buffer() is None
    for a, b in zip(packed.weights(), plain.weights()):
        assert torch.equal(a, b) and isinstance(a, torch.nn.Parameter)
    assert list(dict(packed.named_parameters())) == list(dict(plain.named_parameters()))


def test_packed_versions_are_per_expert():
    """An in-place change to one expert bumps only its version counter, so the weight cache
    re-quantizes that expert alone (the reason the packing sets ``.data`` rather than making
    Parameters from views, which would share one counter)."""
    packed, _ = _pair()
    before = [w._version for w in packed.weights()]
    with torch.no_grad():
        packed.weight1.add_(1.0)
    after = [w._version for w in packed.weights()]
    assert after[1] == before[1] + 1 and after[0] == before[0] and after[2] == before[2]
    assert packed.packed_buffer() is not None  # in place: still one buffer


def test_packing_survives_moves():
    packed, _ = _pair()
    ref = [w.detach().clone() for w in packed.weights()]
    packed.to(torch.float64)
    assert packed.packed_buffer() is not None
    assert all(w.dtype == torch.float64 and torch.equal(w, r.double()) for w, r in zip(packed.weights(), ref))
    packed.float()
    assert packed.packed_buffer() is not None
    assert all(torch.equal(w, r) for w, r in zip(packed.weights(), ref))


def test_unpackable_weights_left_alone():
    """Weights of different dtypes, or tensor subclasses (DTensor shards, quantized parameters:
    their storage is someone else's), set from outside, are not packed, also after a move."""
    packed, _ = _pair()
    packed.weight0.data = packed.weight0.data.double()
    packed._pack()
    assert packed.packed_buffer() is None

    class Shard(torch.Tensor):
        pass

    other, _ = _pair()
    other.weight0 = torch.nn.Parameter(other.weight0.detach().clone().as_subclass(Shard))
    other.float()
    assert type(other.weight0.data) is Shard and other.packed_buffer() is None


@pytest.mark.parametrize("recipe", [MXFP8BlockScaling, Float8CurrentScaling], ids=lambda r: r.__name__)
def test_packed_bitwise_equal_to_unpacked(recipe):
    """Forward output, input gradient and every weight / bias gradient equal bit for bit, over
    two optimizer steps (the second re-quantizes the packed weights after an in-place update)."""
    packed, plain = _pair()
    splits = [5, 0, 11]
    torch.manual_seed(1)
    x = torch.randn(sum(splits), 64)
    dy = torch.randn(sum(splits), 32)
    def forward(m, xi, step):
        with hybridfp.autocast(recipe=recipe()):
            return m(xi, splits)

    for (y0, g0, p0), (y1, g1, p1) in train_side_by_side((packed, plain), x, dy, forward,
                                                          lambda m: [p.grad for p in m.parameters()]):
        assert torch.equal(y0, y1) and torch.equal(g0, g1)
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(p0, p1))
    assert packed.packed_buffer() is not None  # the optimizer updated in place


def test_packed_weights_not_stacked_per_step(monkeypatch):
    """The grouped weight quantization views the packed buffer: no ``torch.stack`` of the
    weights in a step (the copy the packing removes)."""
    packed, _ = _pair(num=4, k=64, n=64, bias=False)
    ptrs = {w.data_ptr() for w in packed.weights()}
    stacked_weights = []
    real_stack = torch.stack

    def counting_stack(tensors, *args, **kw):
        ts = list(tensors)
        if ts and all(torch.is_tensor(t) for t in ts) and {t.data_ptr() for t in ts} == ptrs:
            stacked_weights.append(len(ts))
        return real_stack(ts, *args, **kw)

    monkeypatch.setattr(torch, "stack", counting_stack)
    x = torch.randn(40, 64, requires_grad=True)
    with hybridfp.autocast(recipe=MXFP8BlockScaling()):
        packed(x, [10, 10, 10, 10]).sum().backward()
    assert stacked_weights == []
    plain = hybridfp.GroupedLinear(4, 64, 64, bias=False, pack_weights=False)
    ptrs = {w.data_ptr() for w in plain.weights()}
    with hybridfp.autocast(recipe=MXFP8BlockScaling()):
        plain(x, [10, 10, 10, 10]).sum().backward()
    assert stacked_weights == [4]  # the unpacked experts are stacked: the check can see it
