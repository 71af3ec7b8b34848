"""The FSDP2 gather layout of unevenly sharded weights and of shards shorter than a block.

FSDP2 gives rank r rows [r c, r c + s_r) with c = ceil(N / world) (``torch.chunk``); each rank
encodes from its first block boundary to the next rank's, which may be no rows at all where a
block is longer than a shard. Packed per rank, concatenated and unpacked, the pieces give the
whole weight's payloads, bitwise (the distributed test trains through it).
"""

from __future__ import annotations

import pytest
import torch

import hybridfp as hf
from hybridfp.integration.fsdp_layout import (assemble, block_bounds, gather_layout, halo_rows, pack,
                                              shard_rows, unpack)
from hybridfp.tensors import QuantizedTensor

from test_fsdp_layout import SETS, _meta, _payloads, _weight_quantizer


def test_shards_follow_torch_chunk() -> None:
    for rows, world in ((70, 4), (35, 2), (36, 4), (5, 4), (64, 4)):
        want = tuple(c.shape[0] for c in torch.arange(rows).chunk(world))
        assert shard_rows(rows, world) == want + (0,) * (world - len(want)), (rows, world)


def test_halo_reaches_past_shards_shorter_than_a_block() -> None:
    """70 rows on 4 ranks, 32-row blocks: ranks encode [0, 32), [32, 64), nothing, [64, 70);
    rank 1 takes shard 2 whole (18 rows) and shard 3's first 10 rows."""
    assert block_bounds(70, 4, 32) == [0, 32, 64, 64, 70]
    assert halo_rows(70, 4, 32) == 18
    assert halo_rows(70, 4, 1) == 0 and halo_rows(64, 4, 16) == 0


@pytest.mark.parametrize("mode", sorted(SETS))
@pytest.mark.parametrize("rows,world", [(70, 4), (35, 2), (36, 4), (256, 4)])
@pytest.mark.parametrize("recipe", ["current", "block", "mxfp8", "nvfp4", "hybrid_nvfp4_1d", "hybrid_mxfp8_nvfp4"])
def test_uneven_pack_gather_unpack_is_the_whole(recipe: str, rows: int, world: int, mode: str) -> None:
    cols = 64
    torch.manual_seed(0)
    q, w = _weight_quantizer(recipe, rows, cols)
    with hf.policy(decoded_copies="never"):
        whole = q.quantize(w)
    layout = gather_layout(_meta(q, cols), rows, world, SETS[mode])
    assert sum(layout.rank_rows) == rows and layout.even == (rows % world == 0)
    b = block_bounds(rows, world, layout.granularity)
    # a rank encoding no rows packs an empty piece (cut at row 0: slices start on block boundaries)
    shards = [QuantizedTensor(whole.qstorage.slice_dim0(*((b[r], b[r + 1]) if b[r] < b[r + 1] else (0, 0))), q)
              for r in range(world)]
    want = _payloads(whole)
    for sent in SETS[mode]:
        gathered = torch.cat([pack(s, layout, sent) for s in shards])
        got = assemble(shards[0], rows, unpack(gathered, world, layout, sent))
        assert got.qstorage.directions() == sent
        for key, t in _payloads(got).items():
            assert torch.equal(t.reshape(-1).view(torch.uint8), want[key].reshape(-1).view(torch.uint8)), key
