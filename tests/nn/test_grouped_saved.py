"""What a GroupedLinear step saves for backward (``moe/saved.py``): the experts' tensors
saved per slot as one tensor where they are views of one buffer, rebuilt in backward as the
same views. Checked: the rebuilt experts equal the forward's (class, options, flags, every
payload tensor's memory, shape and strides), saved-tensor hooks see plain tensors only and an
offload-style copy round trip gives bitwise the same step, and activation recompute
(``hybridfp.checkpoint``) is bitwise the plain step. Every case has an empty expert."""

from __future__ import annotations

import pytest
import torch
from nn_cases import FORMATS, assert_bitwise, make_data

import hybridfp
from hybridfp import CustomRecipe, factories
from hybridfp.moe import grouped_linear_function
from hybridfp.moe.saved import SavedExperts, SavedJoined, restore_experts, save_experts
from hybridfp.tensors import HybridStorage, QuantizedTensor

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")  # CPU: expected

RECIPES = {
    **{name: FORMATS[name] for name in ("fp8_delayed", "fp8_current", "fp8_block", "mxfp8", "nvfp4")},
    "bf16": lambda: CustomRecipe(qfactory=factories.high_precision),
    "composer2": lambda: CustomRecipe(qfactory=factories.nvfp4_row_scaled_fwd_mxfp8_bwd),
}
SPLITS = [0, 19, 23, 6]  # an empty expert first, sizes not multiples of 16 / 32 / 128


def _step(recipe_name: str, save_original_input: bool = False, hooks=None, checkpoint: bool = False):
    m = _module(save_original_input)
    x, dy = make_data(torch.bfloat16, rows=sum(SPLITS))
    x.requires_grad_()
    torch.manual_seed(3)
    with hybridfp.autocast(recipe=RECIPES[recipe_name]()):
        if hooks is not None:
            with torch.autograd.graph.saved_tensors_hooks(*hooks):
                y = m(x, SPLITS)
        elif checkpoint:
            y = hybridfp.checkpoint(m, x, SPLITS)
        else:
            y = m(x, SPLITS)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad for p in m.parameters()]


def _module(save_original_input: bool) -> hybridfp.GroupedLinear:
    torch.manual_seed(0)
    return hybridfp.GroupedLinear(len(SPLITS), 64, 32, bias=True, params_dtype=torch.bfloat16,
                                  save_original_input=save_original_input)


def _same_tensor(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert type(a) is torch.Tensor and type(b) is torch.Tensor, what
    assert (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device), what
    if a.numel():  # same memory, same layout: the same view
        assert (a.data_ptr(), a.stride()) == (b.data_ptr(), b.stride()), what


def _same_storage(a, b, what: str) -> None:
    assert type(a) is type(b) and a.shape == b.shape and a.dtype == b.dtype and a.label == b.label, what
    if isinstance(a, HybridStorage):
        for d in ("rowwise", "columnwise"):
            assert (a.parts[d] is None) == (b.parts[d] is None), what
            if a.parts[d] is not None:
                _same_storage(a.parts[d], b.parts[d], f"{what} {d}")
        return
    assert a.meta == b.meta and a.directions() == b.directions(), what
    assert (a.columnwise_zero_tail, a.is_dim0_slice) == (b.columnwise_zero_tail, b.is_dim0_slice), what
    for d in a.directions():
        pa, pb = a.payload(d), b.payload(d)
        assert sorted(pa) == sorted(pb), what
        for name in pa:
            _same_tensor(pa[name], pb[name], f"{what} {d}.{name}")
    assert len(a.tensors()) == len(b.tensors()), f"{what}: payload sharing"


@pytest.mark.parametrize("save_original", [False, True])
@pytest.mark.parametrize("name", list(RECIPES))
def test_restored_experts_are_the_saved_ones(name, save_original, monkeypatch):
    """Every save of a real step, restored at once from the saved tensors: each expert's tensor
    is the one saved (same quantizer, storage layout and payload views)."""
    if save_original and name == "fp8_delayed":
        pytest.skip("save_original_input is refused for delayed-scaling inputs (test_module_inputs)")
    checked: list[int] = []

    def check(ts, **k):
        tensors, rec = save_experts(ts, **k)
        assert all(type(t) is torch.Tensor for t in tensors)
        assert isinstance(rec, (SavedExperts, SavedJoined))
        back = restore_experts(rec, tensors)
        assert len(back) == len(ts)
        for e, (a, b) in enumerate(zip(ts, back)):
            if a is None:
                assert b is None
            elif isinstance(a, QuantizedTensor):
                assert isinstance(b, QuantizedTensor) and b.quantizer is a.quantizer
                _same_storage(a.qstorage, b.qstorage, f"{name} expert {e}")
            else:
                _same_tensor(a, b, f"{name} expert {e}")
        checked.append(len(ts))
        return tensors, rec

    monkeypatch.setattr(grouped_linear_function, "save_experts", check)
    _step(name, save_original)
    assert checked == [len(SPLITS)] * 2


@pytest.mark.parametrize("name", ["bf16", "mxfp8", "fp8_current", "composer2"])
def test_shared_buffers_are_saved_once(name, monkeypatch):
    """The experts' views of one buffer go to autograd as one tensor per slot: fewer saved
    tensors than one per expert and payload tensor, for x's copies (BF16: x's rows; MXFP8 /
    Composer-2: the padded groups' columnwise encoding) and, but for BF16's separate expert
    weights, for W's (the stacked weights' encodings)."""
    counts: list[tuple[int, int]] = []
    orig = save_experts

    def spy(ts, **k):
        tensors, rec = orig(ts, **k)
        each = sum(len(t.qstorage.tensors()) if isinstance(t, QuantizedTensor) else 1
                   for t in ts if t is not None)
        counts.append((len(tensors), each))
        return tensors, rec

    monkeypatch.setattr(grouped_linear_function, "save_experts", spy)
    _step(name)
    (x_saved, x_each), (w_saved, w_each) = counts
    # (FP8 current: x's columnwise copies are each expert's transpose in a 16-padded block,
    # not a split of one tensor: saved per expert, as before)
    assert x_saved < x_each or name == "fp8_current"
    assert w_saved < w_each or name == "bf16"


@pytest.mark.parametrize("name", list(RECIPES))
def test_offload_round_trip_is_bitwise(name):
    """Saved-tensor hooks see plain tensors only; copying each (as CPU offload does) and
    handing the copy back gives bitwise the step without hooks."""
    seen: list[type] = []

    def pack(t):
        seen.append(type(t))
        return t.clone()

    want = _step(name)
    got = _step(name, hooks=(pack, lambda t: t))
    assert seen and all(t is torch.Tensor for t in seen)
    for g, w in zip(got, want):
        assert_bitwise(g, w, name)


@pytest.mark.parametrize("name", ["bf16", "mxfp8", "fp8_current", "fp8_block", "composer2"])
def test_checkpoint_recompute_is_bitwise(name):
    want = _step(name)
    got = _step(name, checkpoint=True)
    for g, w in zip(got, want):
        assert_bitwise(g, w, name)
