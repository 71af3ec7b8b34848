"""numerics §1/§5 ``per_gemm``: three formats in one layer, one per GEMM.

With input = Hybrid(row=F, col=W), weight = Hybrid(row=F, col=D), grad_output = Hybrid(row=D,
col=W), each GEMM reads exactly the operands a single-format run of its format reads. So,
with the same upstream gradient: output == the all-F run's, dx == the all-D run's, dW == the
all-W run's, bitwise; db is high precision (sum of dy) and equal everywhere.
"""

from __future__ import annotations

import copy

import pytest
import torch
from nn_cases import (assert_bitwise, make_data, make_module, run_step)

from hybridfp import CustomRecipe, HybridQuantizer
from hybridfp.factories import per_gemm

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")  # CPU: expected

TRIPLES = [
    ("fp8", "mxfp8", "nvfp4"),       # NVFP4 wgrad: RHT on both operands + SR on dy.col
    ("nvfp4", "fp8", "mxfp8"),       # NVFP4 fprop; E5M2 dy against E4M3 W in dgrad
    ("mxfp8", "nvfp4", "bf16"),      # SR on dy.row in dgrad; high-precision wgrad
    ("fp8_block", "bf16", "fp8_current"),
    ("bf16", "fp8_block", "mxfp8"),
]
KINDS = ["linear", "linear_nobias", "layernorm", "rmsnorm", "grouped"]


def _module(kind: str) -> torch.nn.Module:
    if kind == "linear_nobias":
        return make_module("linear", bias=False)
    return make_module(kind)


def _run(base: torch.nn.Module, fprop: str, dgrad: str, wgrad: str, x, dy):
    m = copy.deepcopy(base)
    # Same seed before every run: only the runs whose gradient quantizer uses stochastic
    # rounding (NVFP4 dy) draw, one seed per quantize() call, in the same order.
    return m, run_step(m, x, dy, CustomRecipe(per_gemm(fprop, dgrad, wgrad)), seed=7)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("triple", TRIPLES, ids="-".join)
def test_each_gemm_uses_its_own_format(triple, kind):
    fprop, dgrad, wgrad = triple
    base = _module(kind)
    x, dy = make_data(seed=3)
    hm, hybrid = _run(base, fprop, dgrad, wgrad, x, dy)
    _, only_f = _run(base, fprop, fprop, fprop, x, dy)
    _, only_d = _run(base, dgrad, dgrad, dgrad, x, dy)
    _, only_w = _run(base, wgrad, wgrad, wgrad, x, dy)
    where = f"per_gemm{triple} {kind}"
    assert_bitwise(hybrid.y, only_f.y, f"{where}: output vs all-{fprop}")
    assert_bitwise(hybrid.dx, only_d.dx, f"{where}: dx vs all-{dgrad}")
    for n, g in hybrid.weight_grads().items():
        assert_bitwise(g, only_w.grads[n], f"{where}: {n}.grad vs all-{wgrad}")
    for n, g in hybrid.bias_grads().items():
        assert_bitwise(g, only_f.grads[n], f"{where}: {n}.grad")
    # The norm's parameters are upstream of dgrad: their gradients follow dx's format.
    for n in ("layer_norm_weight", "layer_norm_bias"):
        if n in hybrid.grads:
            assert_bitwise(hybrid.grads[n], only_d.grads[n], f"{where}: {n}.grad vs all-{dgrad}")
    assert (len(hybrid.bias_grads()) > 0) == (kind != "linear_nobias")
    # Guard: the three formats differ pairwise here, so every slot is a hybrid.
    for slot, qs in hm._quantizers.items():
        assert all(isinstance(q, HybridQuantizer) for q in qs), slot


@pytest.mark.parametrize("triple", TRIPLES[:3], ids="-".join)
def test_single_format_runs_differ(triple):
    """The comparisons above have teeth: the three single-format runs disagree with each other."""
    base = make_module("linear")
    x, dy = make_data(seed=3)
    runs = [_run(base, f, f, f, x, dy)[1] for f in triple]
    for a, b in ((0, 1), (1, 2), (0, 2)):
        assert not torch.equal(runs[a].y, runs[b].y)
        assert not torch.equal(runs[a].dx, runs[b].dx)
        assert not torch.equal(runs[a].grads["weight"], runs[b].grads["weight"])
