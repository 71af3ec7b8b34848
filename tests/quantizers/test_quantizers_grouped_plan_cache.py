"""``quantize_grouped``'s remembered plans (``plans=``, a memo its caller owns: ``GroupedLinear``
keeps one per module): the same quantizer objects reuse their plan, and every change a live quantizer can undergo — usage flags, an
instance-level ``quantize`` wrapper, an amax-reduction group, splits that stop (or start)
being whole row blocks — gives the plan a fresh computation would, and the same bits as
quantizing each expert on its own."""

from __future__ import annotations

import torch

from hybridfp import factories
from hybridfp.moe import plan as grouped
from hybridfp.moe.quantize import quantize_grouped

from test_quantizers_grouped import USAGES, assert_same_storage, build


def _rows(splits: list[int], k: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(sum(splits), k, generator=g).to(torch.bfloat16)


def _fresh(qs, splits):
    """The plan computed without the memo."""
    return grouped._new_plan(qs, splits)


def _same_plan(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return (a.row_q is b.row_q and a.row_block == b.row_block and a.col_q is b.col_q
            and a.col_block == b.col_block and a.scaled == b.scaled)


def _check_bits(qs, x, splits, what, memo=None):
    got = quantize_grouped(qs, x, splits, memo)
    for e, (q, xe) in enumerate(zip(qs, torch.split(x, splits))):
        if q is not None:
            assert_same_storage(got[e].qstorage, q.quantize(xe).qstorage, f"{what} expert {e}")


def test_same_quantizers_reuse_the_plan_object():
    memo: dict = {}
    qs = build(factories.BASE["mxfp8"], "input", USAGES["both"])
    splits = [0, 19, 45, 1, 130, 0, 33]
    first = grouped.plan_for(qs, splits, memo)
    assert grouped.plan_for(qs, splits, memo) is first
    assert _same_plan(first, _fresh(qs, splits))


def test_usage_change_replans():
    memo: dict = {}
    qs = build(factories.BASE["mxfp8"], "input", USAGES["both"])
    splits = [0, 19, 45, 1, 130, 0, 33]
    x = _rows(splits)
    both = grouped.plan_for(qs, splits, memo)
    assert both.col_q is not None
    for q in qs:
        q.set_usage(rowwise=True, columnwise=False)
    rows_only = grouped.plan_for(qs, splits, memo)
    assert rows_only.col_q is None and _same_plan(rows_only, _fresh(qs, splits))
    _check_bits(qs, x, splits, "rowwise only after both", memo)
    qs[3].set_usage(rowwise=False, columnwise=True)  # one expert changes: still a correct plan
    assert _same_plan(grouped.plan_for(qs, splits, memo), _fresh(qs, splits))
    _check_bits(qs, x, splits, "one expert columnwise", memo)


def test_split_divisibility_change_replans():
    memo: dict = {}
    # FP8 block 128x128 weights share one rowwise encoding only for whole 128-row tiles
    qs = build(factories.BASE["float8_block_scaling"], "weight", [(True, False)] * 3)
    whole, ragged = [128, 256, 128], [128, 200, 128]
    x = _rows(whole, 128)
    tiled = grouped.plan_for(qs, whole, memo)
    assert tiled is not None and tiled.row_block == 128
    assert _same_plan(grouped.plan_for(qs, ragged, memo), _fresh(qs, ragged))
    assert grouped.plan_for(qs, ragged, memo) is not tiled
    _check_bits(qs, x, whole, "whole tiles", memo)
    _check_bits(qs, _rows(ragged, 128), ragged, "ragged tiles", memo)


def test_instance_quantize_wrapper_disables_sharing_after_a_cached_plan():
    memo: dict = {}
    qs = build(factories.BASE["mxfp8"], "input", USAGES["rowwise"])
    splits = [0, 19, 45, 1, 130, 0, 33]
    assert grouped.plan_for(qs, splits, memo) is not None
    seen = []
    real = qs[2].quantize
    qs[2].quantize = lambda x: (seen.append(x.shape[0]), real(x))[1]  # a spy on one instance
    assert grouped.plan_for(qs, splits, memo) is None  # every expert quantizes on its own: the spy sees its call
    quantize_grouped(qs, _rows(splits), splits, memo)
    assert seen == [45]


def test_amax_reduction_group_change_replans():
    memo: dict = {}
    qs = build(factories.BASE["current_scaling"], "input", USAGES["rowwise"])
    splits = [0, 19, 45, 1, 130, 0, 33]
    assert grouped.plan_for(qs, splits, memo) is not None
    qs[1].set_amax_reduction_group(object())  # one expert reduces over another group
    assert _same_plan(grouped.plan_for(qs, splits, memo), _fresh(qs, splits))
    assert grouped.plan_for(qs, splits, memo) is None  # amaxes reduced over different groups: per expert


def test_memo_is_bounded():
    memo: dict = {}
    splits = [32, 32]
    for _ in range(grouped.PLANS_KEPT + 10):
        grouped.plan_for(build(factories.BASE["mxfp8"], "input", [(True, True)] * 2), splits, memo)
    assert 0 < len(memo) <= grouped.PLANS_KEPT


def test_without_a_memo_every_call_plans_afresh(monkeypatch):
    qs = build(factories.BASE["mxfp8"], "input", USAGES["both"])
    calls = []
    real = grouped._new_plan
    monkeypatch.setattr(grouped, "_new_plan", lambda *a: (calls.append(1), real(*a))[1])
    splits = [0, 19, 45, 1, 130, 0, 33]
    grouped.plan_for(qs, splits)
    grouped.plan_for(qs, splits)
    assert len(calls) == 2


def test_grouped_linear_keeps_one_memo_per_module_and_drops_it_with_its_quantizers():
    import hybridfp
    torch.manual_seed(0)
    layers = [hybridfp.GroupedLinear(4, 64, 32, bias=False, params_dtype=torch.bfloat16) for _ in range(3)]
    x = torch.randn(40, 64, dtype=torch.bfloat16, requires_grad=True)
    recipe = hybridfp.MXFP8BlockScaling()
    for _ in range(2):
        with hybridfp.autocast(recipe=recipe):
            ys = [m(x, [8, 0, 17, 15]) for m in layers]
        sum(y.float().sum() for y in ys).backward()
    # each module's plans name its own quantizers only (no global memo for many layers to thrash)
    for m in layers:
        own = {id(q) for qs in m._quantizers.values() for q in qs}
        assert m._plans and all(i == id(None) or i in own for key in m._plans for i in key[0])
    old = dict(layers[0]._plans)
    with hybridfp.autocast(recipe=hybridfp.Float8CurrentScaling()):  # new quantizers: a new memo
        layers[0](x, [8, 0, 17, 15])
    assert layers[0]._plans and not (set(layers[0]._plans) & set(old))
