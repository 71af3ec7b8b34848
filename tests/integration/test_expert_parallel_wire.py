"""Tokens dispatched quantized: the bytes on the wire are the format's, the experts read the
sender's decode.

Each rank sends its rows encoded by the recipe's own input quantizer (rowwise only, a row-local
format); the experts' rank decodes them. Bitwise claims: (1) the layer equals one process run
on every rank's rows passed through that encode / decode first (the same operands everywhere:
the decode is exact in FP32, and so is everything after it); (2) for MXFP8 the output and the
input gradient also equal one process on the original rows: a rowwise MXFP8 re-encode of
MXFP8-decoded rows gives the same values (so fprop reads the same operand), the backward is
straight-through and dgrad does not read the input. The weight gradients differ there (the
columnwise copy is made from the decoded rows), which (1) covers.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hybridfp as hf

from spawn_ranks import run_ranks
from test_expert_parallel import D, _batch, _bits, _grads, _local, _reference, _run

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")  # CPU: expected

WORLD, EXPERTS = 2, 4
WIRE = {"mxfp8": hf.factories.mxfp8, "current": hf.factories.current_scaling}
ROLE = hf.QuantizerRole("grouped_linear", "input", "fc1")


def _count_bytes(sent: list) -> None:
    """Record the bytes of every all_to_all / all_gather this process issues (its input)."""
    for name in ("all_to_all_single", "all_gather_single", "all_gather_into_tensor"):
        orig = getattr(dist, name, None)
        if orig is not None:
            def counting(out, inp, *a, _orig=orig, _name=name, **k):
                sent.append(["gather" if "gather" in _name else "to", inp.numel() * inp.element_size()])
                return _orig(out, inp, *a, **k)
            setattr(dist, name, counting)


def _wire_worker(rank: int, world: int, recipes: list[str]) -> dict:
    sent: list = []
    _count_bytes(sent)
    out = {}
    for recipe in recipes:
        model = _local(EXPERTS, world, rank, recipe)
        ep = hf.ExpertParallel(model, EXPERTS, wire_quantizer=WIRE[recipe](ROLE))
        x, m_splits, dy = _batch(EXPERTS, rank, recipe)
        del sent[:]
        y = _run(ep, x, m_splits, dy, recipe)
        out[recipe] = {"y": _bits(y), "dx": _bits(x.grad), "grads": _grads(model, ep.local_experts),
                       "sent": list(sent), "rows": x.shape[0]}
    return out


def _decoded_batch(num_experts: int, rank: int, recipe: str):
    """A rank's rows passed through the wire's encode / decode."""
    x, m_splits, dy = _batch(num_experts, rank, recipe)
    return WIRE[recipe](ROLE).quantize(x).dequantize(direction="rowwise").to(x.dtype), m_splits, dy


def test_dispatch_sends_quantized_rows(tmp_path) -> None:
    results = run_ranks(_wire_worker, WORLD, (sorted(WIRE),), tmp_path)
    local = EXPERTS // WORLD
    for recipe in WIRE:
        want_rows, want_grads = _reference(EXPERTS, WORLD, recipe, _decoded_batch)
        plain_rows, _ = _reference(EXPERTS, WORLD, recipe)
        for rank, got in enumerate(results):
            got = got[recipe]
            assert got["y"] == want_rows[rank]["y"], (recipe, rank)
            assert got["dx"] == want_rows[rank]["dx"], (recipe, rank)
            for name, bits in got["grads"].items():
                assert bits == want_grads[name], (recipe, rank, name)
            if recipe == "mxfp8":  # the forward operand is the original rows' own encoding
                assert got["y"] == plain_rows[rank]["y"] and got["dx"] == plain_rows[rank]["dx"], rank
            # dispatch's forward: routing counts, the rows encoded (+ FP8's scale, once); its
            # backward: the FP32 gradient of the rows the experts received
            rows, received = got["rows"], len(want_rows[rank]["local_x"]) // D
            per_row = D + D // 32 if recipe == "mxfp8" else D  # codes + E8M0 scales / codes
            # (the first call's agreement checks: dispatch's and combine's, int64 values)
            expect = [["gather", 4 * 8], ["to", WORLD * (local + 4) * 8], ["to", rows * per_row]]
            if recipe == "current":
                expect.append(["gather", 4])  # the sender's FP32 scale_inv
            expect += [["gather", 3 * 8], ["to", received * D * 4]]
            assert got["sent"] == expect, (recipe, rank, got["sent"])
            # against the rows in BF16: MXFP8 (1 + 1/32) / 2, FP8 1/2 of the bytes
            assert expect[2][1] / (rows * D * 2) == (0.515625 if recipe == "mxfp8" else 0.5)


@pytest.mark.parametrize("wire", [hf.MXFP8Quantizer(), hf.Float8CurrentScalingQuantizer(),
                                  hf.Float8BlockQuantizer(block_scaling_dim=1)], ids=["mxfp8", "fp8_current", "fp8_block"])
def test_rows_arrive_as_their_rowwise_decode(wire) -> None:
    """One rank: each row-local format's rows arrive as the sender's rowwise decode, bitwise."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x = torch.randn(7, 256) * torch.logspace(-3, 3, 7).unsqueeze(1)
        local_x, _, _ = hf.expert_dispatch(x, [3, 4], wire_quantizer=wire)
        assert torch.equal(local_x, wire.quantize(x).dequantize(direction="rowwise"))
    finally:
        dist.destroy_process_group()
