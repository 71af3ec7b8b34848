"""``quantize_grouped``'s remembered plans (``quantizers.grouped._plan``): the same quantizer
objects reuse their plan, and every change a live quantizer can undergo — usage flags, an
instance-level ``quantize`` wrapper, an amax-reduction group, splits that stop (or start)
being whole row blocks — gives the plan a fresh computation would, and the same bits as
quantizing each expert on its own."""

from __future__ import annotations

import torch

from hybridfp import factories
from hybridfp.quantizers import grouped
from hybridfp.quantizers.grouped import quantize_grouped

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


def _check_bits(qs, x, splits, what):
    got = quantize_grouped(qs, x, splits)
    for e, (q, xe) in enumerate(zip(qs, torch.split(x, splits))):
        if q is not None:
            assert_same_storage(got[e].qstorage, q.quantize(xe).qstorage, f"{what} expert {e}")


def test_same_quantizers_reuse_the_plan_object():
    qs = build(factories.BASE["mxfp8"], "input", USAGES["both"])
    splits = [0, 19, 45, 1, 130, 0, 33]
    first = grouped._plan(qs, splits)
    assert grouped._plan(qs, splits) is first
    assert _same_plan(first, _fresh(qs, splits))


def test_usage_change_replans():
    qs = build(factories.BASE["mxfp8"], "input", USAGES["both"])
    splits = [0, 19, 45, 1, 130, 0, 33]
    x = _rows(splits)
    both = grouped._plan(qs, splits)
    assert both.col_q is not None
    for q in qs:
        q.set_usage(rowwise=True, columnwise=False)
    rows_only = grouped._plan(qs, splits)
    assert rows_only.col_q is None and _same_plan(rows_only, _fresh(qs, splits))
    _check_bits(qs, x, splits, "rowwise only after both")
    qs[3].set_usage(rowwise=False, columnwise=True)  # one expert changes: still a correct plan
    assert _same_plan(grouped._plan(qs, splits), _fresh(qs, splits))
    _check_bits(qs, x, splits, "one expert columnwise")


def test_split_divisibility_change_replans():
    # FP8 block 128x128 weights share one rowwise encoding only for whole 128-row tiles
    qs = build(factories.BASE["float8_block_scaling"], "weight", [(True, False)] * 3)
    whole, ragged = [128, 256, 128], [128, 200, 128]
    x = _rows(whole, 128)
    tiled = grouped._plan(qs, whole)
    assert tiled is not None and tiled.row_block == 128
    assert _same_plan(grouped._plan(qs, ragged), _fresh(qs, ragged))
    assert grouped._plan(qs, ragged) is not tiled
    _check_bits(qs, x, whole, "whole tiles")
    _check_bits(qs, _rows(ragged, 128), ragged, "ragged tiles")


def test_instance_quantize_wrapper_disables_sharing_after_a_cached_plan():
    qs = build(factories.BASE["mxfp8"], "input", USAGES["rowwise"])
    splits = [0, 19, 45, 1, 130, 0, 33]
    assert grouped._plan(qs, splits) is not None
    seen = []
    real = qs[2].quantize
    qs[2].quantize = lambda x: (seen.append(x.shape[0]), real(x))[1]  # a spy on one instance
    assert grouped._plan(qs, splits) is None  # every expert quantizes on its own: the spy sees its call
    quantize_grouped(qs, _rows(splits), splits)
    assert seen == [45]


def test_amax_reduction_group_change_replans():
    qs = build(factories.BASE["current_scaling"], "input", USAGES["rowwise"])
    splits = [0, 19, 45, 1, 130, 0, 33]
    assert grouped._plan(qs, splits) is not None
    qs[1].set_amax_reduction_group(object())  # one expert reduces over another group
    assert _same_plan(grouped._plan(qs, splits), _fresh(qs, splits))
    assert grouped._plan(qs, splits) is None  # amaxes reduced over different groups: per expert


def test_memo_is_bounded():
    splits = [32, 32]
    for _ in range(grouped._PLANS_KEPT + 10):
        grouped._plan(build(factories.BASE["mxfp8"], "input", [(True, True)] * 2), splits)
    assert len(grouped._PLANS) <= grouped._PLANS_KEPT
