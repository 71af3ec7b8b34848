"""GroupedLinear on joined copies (``moe/grouped_tensor.py``, ``moe/gemm_joined.py``):
where x, dy and the weights are quantized as views of shared encodings (BF16 Identity, MXFP8),
a step on the grouped BF16 path (``torch._grouped_mm``, here the CPU's) never builds the
per-expert tensors, and gives bitwise the step that builds them and runs the per-expert-list
code of the same path. Also: ``GroupedTensor`` built lazily equal the per-expert quantizations,
and the weights' joined copies are cached until a weight changes."""

from __future__ import annotations

import copy

import pytest
import torch
from nn_cases import assert_bitwise

from hybridfp import CustomRecipe, GroupedLinear, autocast, factories
from hybridfp.moe import gemm as grouped
from hybridfp.quantizers import IdentityQuantizer, MXFP8Quantizer
from hybridfp.moe import assemble as qgrouped
from hybridfp.moe.quantize import quantize_grouped
from hybridfp.moe.quantize_weights import quantize_weights_grouped
from hybridfp.moe.grouped_tensor import GroupedTensor

IN = 64
SPLITS = [0, 19, 45, 1, 33]  # an empty expert, counts not multiples of 8 / 32
RECIPES = {"bf16": factories.high_precision, "mxfp8": factories.mxfp8}


def _step(m: GroupedLinear, factory, out: int):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(sum(SPLITS), IN, generator=g).bfloat16().requires_grad_()
    dy = torch.randn(sum(SPLITS), out, generator=g).bfloat16()
    with autocast(recipe=CustomRecipe(qfactory=factory)):
        y = m(x, SPLITS)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad for p in m.parameters()]


#: every GEMM of a step on path 1 (torch._grouped_mm)
ALL_GROUPED_BF16 = {("fprop", "grouped_bf16"): 1, ("dgrad", "grouped_bf16"): 1, ("wgrad", "grouped_bf16"): 1}


def count_cuts(monkeypatch) -> list[int]:
    """A list that records the expert count of every per-expert build from joined copies."""
    built: list[int] = []
    real_cut = qgrouped._cut_experts
    monkeypatch.setattr(qgrouped, "_cut_experts", lambda *a: built.append(len(a[1])) or real_cut(*a))
    return built


def _grouped_path_on_cpu(monkeypatch) -> None:
    """The CUDA choice of path 1 (``torch._grouped_mm``) on the CPU, as bench_moe_overhead does."""
    monkeypatch.setattr(grouped, "_grouped_mm_device", lambda device: True)


@pytest.mark.parametrize("out", [128, 48], ids=["N=128", "N=48"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_joined_step_equals_per_expert_lists(name, out, monkeypatch):
    """Bitwise the same step; with N a multiple of 32 all three GEMMs take the joined copies and
    no per-expert tensor is built (N=48: MXFP8 weights' columnwise groups are padded, so dgrad
    goes through the per-expert lists and builds dy's and the weights' tensors; still bitwise)."""
    _grouped_path_on_cpu(monkeypatch)
    torch.manual_seed(1)
    m = GroupedLinear(len(SPLITS), IN, out, bias=False, params_dtype=torch.bfloat16)
    fresh = copy.deepcopy(m)
    built = count_cuts(monkeypatch)
    grouped.PATH_COUNTS.clear()
    got = _step(m, RECIPES[name], out)
    joined_counts = dict(grouped.PATH_COUNTS)
    joined_built = list(built)
    with monkeypatch.context() as mp:
        mp.setattr(grouped, "_run_joined", lambda *a: None)  # the per-expert-list code
        grouped.PATH_COUNTS.clear()
        want = _step(fresh, RECIPES[name], out)
        assert dict(grouped.PATH_COUNTS) == joined_counts  # the same path for each GEMM
    assert joined_counts == ALL_GROUPED_BF16
    for i, (a, b) in enumerate(zip(got, want)):
        assert_bitwise(a, b, f"{name} output {i}")
    if name == "bf16" or out == 128:
        assert joined_built == [], joined_built
    else:
        assert joined_built == [len(SPLITS)] * 2  # dgrad's operands only


def test_lazy_experts_equal_each_quantize():
    """An GroupedTensor indexes to each expert's own quantization (MXFP8 both copies, awkward
    splits), built once; dropping rowwise drops it from each built expert."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(SPLITS), IN, generator=g).bfloat16()
    qs = [MXFP8Quantizer() for _ in SPLITS]
    got = quantize_grouped(qs, x, SPLITS)
    assert isinstance(got, GroupedTensor) and not got.materialized
    assert got.directions() == ("rowwise", "columnwise")
    for e, (q, xe) in enumerate(zip(qs, torch.split(x, SPLITS))):
        want = q.quantize(xe)
        for d in ("rowwise", "columnwise"):
            assert_bitwise(got[e].dequantize(torch.float32, d), want.dequantize(torch.float32, d), f"expert {e} {d}")
    assert got.materialized and got[2] is got[2]
    got.drop("rowwise")
    assert got.directions() == ("columnwise",)
    assert all(t.directions() == ("columnwise",) for t in got)
    with pytest.raises(ValueError, match="no copy at all"):
        got.drop("columnwise")


def test_identity_packed_weights_are_one_joined_copy():
    """Identity (BF16) weights handed with the buffer they are views of (``stacked=``) come back
    as one joined copy over that buffer; separate weights stay a list."""
    buf = torch.randn(3, 16, IN).bfloat16()
    ws = list(buf)
    qs = [IdentityQuantizer() for _ in ws]
    got = quantize_weights_grouped(qs, ws, stacked=buf)
    assert isinstance(got, GroupedTensor)
    j = got.joined("rowwise")
    assert j.starts is None and j.storage.payload("rowwise")["data"].data_ptr() == buf.data_ptr()
    for t, w in zip(got, ws):
        assert_bitwise(t.dequantize(), w, "identity weight")
    assert isinstance(quantize_weights_grouped(qs, [w.clone() for w in ws]), list)


def test_weight_group_cached_until_a_weight_changes(monkeypatch):
    """The joined weights are quantized once for repeated forwards; after one weight changes,
    only that expert is quantized again (the others keep their tensors) and the output moves
    only in that expert's rows."""
    from hybridfp.moe import grouped_weights
    calls = []
    real = grouped_weights.quantize_weights_grouped
    monkeypatch.setattr(grouped_weights, "quantize_weights_grouped", lambda qs, ws, plans=None, **k: calls.append(len(ws)) or real(qs, ws, plans, **k))
    m = GroupedLinear(4, IN, 64, bias=False, params_dtype=torch.bfloat16)
    x = torch.randn(40, IN).bfloat16()
    with torch.no_grad(), autocast(recipe=CustomRecipe(qfactory=factories.mxfp8)):
        first = m(x, [10] * 4)
        again = m(x, [10] * 4)
        m.weight1.mul_(2)
        changed = m(x, [10] * 4)
        m(x, [10] * 4)
    assert calls == [4, 1]
    assert torch.equal(first, again)
    assert torch.equal(first[:10], changed[:10]) and torch.equal(first[20:], changed[20:])
    assert not torch.equal(first[10:20], changed[10:20])


def test_hybrid_experts_are_joined_and_equal_each_quantize():
    """Composer-2's input hybrid (row-scaled NVFP4 rows read at the padded groups' starts,
    MXFP8 columns derived from them): one GroupedTensor whose experts equal each expert's own
    quantization in both copies; after dropping the rows (what backward keeps) the experts hold
    the columnwise part only, and the saved record is the joined copy."""
    from hybridfp import HybridQuantizer, NVFP4Quantizer
    from hybridfp.moe.saved import SavedJoined, restore_experts, save_experts
    g = torch.Generator().manual_seed(4)
    x = torch.randn(sum(SPLITS), IN, generator=g).bfloat16()
    qs = [HybridQuantizer(NVFP4Quantizer(row_scaled_nvfp4=True), MXFP8Quantizer(), "rowwise_dequantized")
          for _ in SPLITS]
    got = quantize_grouped(qs, x, SPLITS)
    assert isinstance(got, GroupedTensor) and got.joined("rowwise").starts is not None  # padded starts
    for e, (q, xe) in enumerate(zip(qs, torch.split(x, SPLITS))):
        want = q.quantize(xe)
        for d in ("rowwise", "columnwise"):
            assert_bitwise(got[e].dequantize(torch.float32, d), want.dequantize(torch.float32, d), f"expert {e} {d}")
    got.drop("rowwise")
    assert all(t.directions() == ("columnwise",) for t in got)
    tensors, rec = save_experts(got)
    assert isinstance(rec, SavedJoined) and len(tensors) == 2  # MXFP8 data and scales
    back = restore_experts(rec, tensors)
    for a, b in zip(got, back):
        assert_bitwise(a.dequantize(torch.float32, "columnwise"), b.dequantize(torch.float32, "columnwise"), "restored")


def test_weight_group_replaces_per_expert_entries():
    """After a partial change (per-expert cache entries) and then a change of every weight (one
    joined entry again), no per-expert entry of the older weights stays cached."""
    m = GroupedLinear(3, IN, 64, bias=False, params_dtype=torch.bfloat16)
    x = torch.randn(30, IN).bfloat16()
    with torch.no_grad(), autocast(recipe=CustomRecipe(qfactory=factories.mxfp8)):
        m(x, [10] * 3)
        m.weight0.mul_(2)
        m(x, [10] * 3)
        assert sorted(m._wcache) == [0, 1, 2]
        for w in m.weights():
            w.mul_(2)
        m(x, [10] * 3)
    assert list(m._wcache) == [-1]
