"""The FSDP2 gather layout: a weight's shards packed per rank, concatenated (what the
all-gather does) and unpacked give back the whole weight's payloads, bitwise.

The shards are dim-0 slices of the whole weight's quantization (each rank's own
quantization of its rows, with the per-tensor entries of the whole, is that slice: the
distributed tests check that part), so the claim here is the layout: offsets, row axes,
dtypes and the reassembly, for every format, both copies and hybrids of two formats.
"""

from __future__ import annotations

import pytest
import torch

import hybridfp as hf
from hybridfp import factories
from hybridfp.integration.fsdp_layout import assemble, block_bounds, gather_layout, pack, unpack
from hybridfp.recipes import current_autocast
from hybridfp.tensors import COLUMNWISE, ROWWISE, QuantizedTensor

RECIPES = {
    "current": hf.Float8CurrentScaling,
    "delayed": hf.DelayedScaling,
    "block": hf.Float8BlockScaling,
    "mxfp8": hf.MXFP8BlockScaling,
    "nvfp4": hf.NVFP4BlockScaling,
    "hybrid_mxfp8_nvfp4": lambda: hf.CustomRecipe(qfactory=factories.mxfp8_fwd_nvfp4_bwd),
    "hybrid_nvfp4_1d": lambda: hf.CustomRecipe(qfactory=factories.nvfp4_1d_weight),
    "hybrid_hp_mxfp8": lambda: hf.CustomRecipe(qfactory=factories.high_precision_fwd_mxfp8_bwd),
}
SETS = {"split": ((ROWWISE,), (COLUMNWISE,)), "both": ((ROWWISE, COLUMNWISE),)}


def _weight_quantizer(recipe_name: str, rows: int, cols: int):
    m = hf.Linear(cols, rows)
    with hf.autocast(recipe=RECIPES[recipe_name]()):
        q = m.quantizers(current_autocast())["weight"][0]
    q.set_usage(rowwise=True, columnwise=True)
    return q, m.weight.detach()


def _meta(q, cols: int):
    def quantize_meta(rows: int) -> QuantizedTensor:
        with hf.policy(decoded_copies="never"):
            return q.quantize(torch.empty(rows, cols, device="meta"))
    return quantize_meta


def _payloads(t: QuantizedTensor) -> dict:
    st = t.qstorage
    return {(d, n): x for d in st.directions() for n, x in st.part(d).payloads[d].items()}


@pytest.mark.parametrize("mode", sorted(SETS))
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_pack_gather_unpack_is_the_whole(recipe: str, world: int, mode: str) -> None:
    rows, cols = 128 * world, 128
    torch.manual_seed(0)
    q, w = _weight_quantizer(recipe, rows, cols)
    with hf.policy(decoded_copies="never"):
        whole = q.quantize(w)
    n = rows // world
    shards = [QuantizedTensor(whole.qstorage.slice_dim0(r * n, (r + 1) * n), q) for r in range(world)]
    layout = gather_layout(_meta(q, cols), rows, world, SETS[mode])
    assert layout.aligned
    want = _payloads(whole)
    for sent in SETS[mode]:
        gathered = torch.cat([pack(s, layout, sent) for s in shards])
        assert gathered.numel() == world * layout.nbytes
        got = assemble(shards[0], rows, unpack(gathered, world, layout, sent))
        assert got.qstorage.directions() == sent
        for key, t in _payloads(got).items():
            assert t.dtype == want[key].dtype and torch.equal(t.reshape(-1).view(torch.uint8), want[key].reshape(-1).view(torch.uint8)), key
        assert torch.equal(got.dequantize(direction=sent[0]), whole.dequantize(direction=sent[0]))


def test_one_format_sends_the_same_bytes_each_way() -> None:
    """Forward (rowwise) and backward (columnwise) copies of one format are the same size, so
    no padding is sent; a hybrid of two formats pads the smaller to the larger."""
    for recipe, padded in (("mxfp8", False), ("current", False), ("hybrid_mxfp8_nvfp4", True)):
        q, _ = _weight_quantizer(recipe, 256, 128)
        layout = gather_layout(_meta(q, 128), 256, 2, SETS["split"])
        sizes = [sum(p.nbytes for p in layout.pieces[s]) for s in SETS["split"]]
        assert (sizes[0] != sizes[1]) == padded, (recipe, sizes)
        assert layout.nbytes == max(sizes)


@pytest.mark.parametrize("mode", sorted(SETS))
@pytest.mark.parametrize("recipe", ["block", "mxfp8", "nvfp4", "hybrid_nvfp4_1d"])
def test_blocks_straddling_shards_are_encoded_where_they_start(recipe: str, mode: str) -> None:
    """Shards of one and a half blocks split every other block: each rank encodes its rows
    from its first block boundary to the next rank's (the ranges ``block_bounds`` gives, a
    dim-0 slice of the whole quantization at block boundaries), the pieces of unequal size are
    padded to one per-rank size, and unpacking gives the whole weight's payloads."""
    block = {"block": 128, "mxfp8": 32}.get(recipe, 16)
    cols, world = 128, 4
    rows = world * block * 3 // 2
    torch.manual_seed(0)
    q, w = _weight_quantizer(recipe, rows, cols)
    with hf.policy(decoded_copies="never"):
        whole = q.quantize(w)
    layout = gather_layout(_meta(q, cols), rows, world, SETS[mode])
    assert not layout.aligned and sum(layout.rank_rows) == rows
    b = block_bounds(rows, world, layout.granularity)
    shards = [QuantizedTensor(whole.qstorage.slice_dim0(b[r], b[r + 1]), q) for r in range(world)]
    want = _payloads(whole)
    for sent in SETS[mode]:
        gathered = torch.cat([pack(s, layout, sent) for s in shards])
        got = assemble(shards[0], rows, unpack(gathered, world, layout, sent))
        for key, t in _payloads(got).items():
            assert torch.equal(t.reshape(-1).view(torch.uint8), want[key].reshape(-1).view(torch.uint8)), key

