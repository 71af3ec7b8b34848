"""``utils.device.step_metadata``: small read-only metadata tensors shared by the calls of one
routing — the same key gives the same tensor, a different key (splits, starts, block, device)
never does, the memo stays bounded, and the users (``grouped_bf16.offsets``,
``moe.quantize.padded_row_index`` / ``_row_map``) return the values they computed before
the memo, for every split pattern in turn."""

from __future__ import annotations

import pytest
import torch

from hybridfp.moe import gemm_bf16 as grouped_bf16
from hybridfp.moe import quantize as grouped
from hybridfp.moe.quantize_scaled import _offsets
from hybridfp.utils import device


def _fresh_index(splits, starts):
    """The padded-row index as a plain loop computes it."""
    out = []
    for m, s in zip(splits, starts):
        out += range(s, s + m)
    return torch.tensor(out, dtype=torch.int64)


def test_same_key_same_tensor_other_key_built_anew():
    built = []

    def build(v):
        built.append(v)
        return torch.tensor([v])

    a = device.step_metadata(("t", 1), "cpu", lambda: build(1))
    assert device.step_metadata(("t", 1), "cpu", lambda: build(99)) is a
    b = device.step_metadata(("t", 2), "cpu", lambda: build(2))
    assert b is not a and int(b) == 2 and built == [1, 2]


def test_inference_mode_tensors_are_not_handed_to_autograd_calls():
    with torch.inference_mode():
        inside = grouped_bf16.offsets([6, 2], "cpu")
    outside = grouped_bf16.offsets([6, 2], "cpu")
    assert inside.is_inference() and not outside.is_inference()
    assert torch.equal(inside, outside)


def test_memo_is_bounded():
    for i in range(device.STEP_METADATA_KEPT + 5):
        device.step_metadata(("bounded", i), "cpu", lambda i=i: torch.tensor([i]))
    assert device.step_metadata_count() <= device.STEP_METADATA_KEPT


@pytest.mark.parametrize("block", [32, 128])
def test_row_maps_follow_every_split_pattern(block):
    # patterns that share totals or prefixes: a key missing any part would hand out a stale map
    patterns = [[5, 0, 27, 33], [5, 27, 0, 33], [32, 0, 32, 1], [0, 0, 0, 65], [5, 0, 27, 33]]
    for splits in patterns:
        starts = _offsets(splits, block)
        total = grouped._padded_total(splits, block, starts)
        x = torch.zeros(sum(splits), 4)
        index = grouped.padded_row_index(splits, starts, x.device)
        assert torch.equal(index, _fresh_index(splits, starts)), splits
        row_map = grouped._row_map(splits, starts, total, x)
        want = torch.full((total,), -1, dtype=torch.int32)
        want[_fresh_index(splits, starts)] = torch.arange(sum(splits), dtype=torch.int32)
        assert torch.equal(row_map, want), splits


def test_grouped_mm_offsets_follow_the_sizes():
    for sizes in ([3, 0, 5], [3, 5, 0], [8], [0, 8], [3, 0, 5]):
        offs = grouped_bf16.offsets(sizes, "cpu")
        assert offs.dtype == torch.int32
        assert offs.tolist() == torch.tensor(sizes).cumsum(0).tolist(), sizes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_streams_do_not_share_metadata():
    dev = torch.device("cuda")
    a = grouped_bf16.offsets([4, 4], dev)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        b = grouped_bf16.offsets([4, 4], dev)
    side.synchronize()
    assert a is not b and torch.equal(a, b)
    assert grouped_bf16.offsets([4, 4], dev) is a
