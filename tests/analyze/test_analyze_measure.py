"""hybridfp.analyze: measured errors against hybridfp.report, the budget, the factory."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from torch import nn

import hybridfp as hf
from hybridfp import report
from hybridfp.analyze import CANDIDATES, Budget, PlanFactory, recommend
from hybridfp.nn import set_names
from hybridfp.tensors import COLUMNWISE, ROWWISE

#: analysis format -> (report row (name, options), the copy compared, the GEMM and operand
#: that reads the layer input in that copy).
REPORT_ROWS = {
    "fp8_current": (("FP8 current", "E4M3"), ROWWISE, "fprop"),
    "fp8_delayed": (("FP8 delayed", "E4M3, after 1 update"), ROWWISE, "fprop"),
    "fp8_block_1d": (("FP8 block", "1x128 (col 128x1), pow2"), ROWWISE, "fprop"),
    "fp8_block_2d": (("FP8 block", "128x128, pow2"), ROWWISE, "fprop"),
    "mxfp8": (("MXFP8", "E4M3 rceil"), ROWWISE, "fprop"),
    "nvfp4_1d": (("NVFP4", "1x16"), ROWWISE, "fprop"),
    "nvfp4_2d": (("NVFP4", "16x16 (2D)"), ROWWISE, "fprop"),
    "nvfp4_sr": (("NVFP4", "1x16, stochastic rounding"), ROWWISE, "fprop"),
    "nvfp4_row_scaled": (("NVFP4", "row-scaled (row only)"), ROWWISE, "fprop"),
    "nvfp4_rht": (("NVFP4", "1x16, RHT on col"), COLUMNWISE, "wgrad"),
}


@pytest.mark.parametrize("kind", ["normal", "student_t"])
def test_input_sqnr_matches_report_within_half_a_db(kind):
    """The layer input's SQNR per format, measured by analyze on one sample, is within 0.5 dB
    of hybridfp.report's on an independent sample of the same distribution (same size)."""
    rows = cols = 256
    torch.manual_seed(0)
    lin = hf.Linear(cols, 64)
    x = report.sample(kind, rows, cols, seed=11)
    a = hf.analyze(lin, [x], formats=tuple(REPORT_ROWS))
    cases = {(name, opts): make for name, opts, make in report.CASES}
    ref_x = report.sample(kind, rows, cols, seed=0 if kind == "normal" else 1)
    for fmt, (row, direction, gemm) in REPORT_ROWS.items():
        torch.manual_seed(7919)
        want = report.measure(cases[row], ref_x)[direction][0]
        a_db, b_db = a.operand_db(a.layers[0], gemm, fmt)
        got = a_db if gemm == "fprop" else b_db  # wgrad reads the input as its B operand
        assert abs(got - want) <= 0.5, (kind, fmt, got, want)


class Planted(nn.Module):
    """Two layers: one reads Gaussian activations; the other reads activations with a massive
    channel in every 16-element block (20x the rest) that its weight ignores (zero columns),
    as LLMs' attention-sink channels. The output then comes from the other 15 values of each
    block, which NVFP4's E2M1 codes (scaled to the block's outlier) mostly round to zero and
    MXFP8's E4M3 codes keep."""

    def __init__(self) -> None:
        super().__init__()
        self.plain = hf.Linear(128, 64, bias=False)
        self.spiky = hf.Linear(128, 64, bias=False)
        with torch.no_grad():
            self.spiky.weight[:, ::16] = 0.0
        set_names(self)

    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.plain(x), self.spiky(s)])


def _planted_batches(n: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        x, s = torch.randn(256, 128, generator=g), torch.randn(256, 128, generator=g)
        s[:, ::16] *= 20.0
        out.append((x, s))
    return out


def test_recommendation_respects_the_budget_and_finds_the_planted_layer():
    torch.manual_seed(0)
    a = hf.analyze(Planted(), _planted_batches())
    budget = Budget(db=15.0)
    plan = recommend(a, budget)
    assert set(plan) == {"plain", "spiky"}
    for layer, choice in plan.items():
        for gemm, fmt in zip(("fprop", "dgrad", "wgrad"), choice):
            assert a.output_db(layer, gemm, fmt) >= 15.0, (layer, gemm, fmt)
            cheaper = [f for f in a.formats_for(gemm) if CANDIDATES[f].tier < CANDIDATES[fmt].tier]
            assert all(a.output_db(layer, gemm, f) < 15.0 for f in cheaper), (layer, gemm, fmt)
    assert CANDIDATES[plan["plain"][0]].tier == 4  # NVFP4 serves the Gaussian layer's fprop
    assert CANDIDATES[plan["spiky"][0]].tier == 8  # the outlier layer's fprop needs 8 bits
    assert a.operands[("spiky", "input")].kurtosis > a.operands[("plain", "input")].kurtosis + 5
    like = recommend(a, Budget(like="mxfp8"))
    for layer, choice in like.items():
        for gemm, fmt in zip(("fprop", "dgrad", "wgrad"), choice):
            assert a.output_db(layer, gemm, fmt) >= a.output_db(layer, gemm, "mxfp8")


def test_analysis_sees_every_expert_of_a_grouped_linear():
    torch.manual_seed(0)
    g = hf.GroupedLinear(3, 64, 32, bias=False)
    x = torch.randn(96, 64)
    a = hf.analyze(g, [None], loss_fn=lambda m, _: m(x, [32, 32, 32]).pow(2).mean(),
                   formats=("high_precision", "mxfp8"))
    e = a.errors[(a.layers[0], "wgrad", "mxfp8")]
    assert e.numel == 3 * (32 * 32 + 32 * 64)  # three experts' grad_output and input
    assert a.module_types[a.layers[0]] == "grouped_linear"


def test_plan_factory_is_picklable_and_builds_per_gemm_quantizers():
    f = PlanFactory({"fc": ("nvfp4_row_scaled", "mxfp8", "nvfp4_rht")}, default=("mxfp8",) * 3)
    g = pickle.loads(pickle.dumps(f))
    assert g == f
    qi = g(hf.QuantizerRole("linear", "input", "fc"))
    assert qi.rowwise_quantizer.row_scaled_nvfp4 and qi.columnwise_quantizer.with_rht
    qw = g(hf.QuantizerRole("linear", "weight", "fc"))
    assert (qw.rowwise_quantizer.format_name, qw.columnwise_quantizer.format_name) == ("nvfp4", "mxfp8")
    assert g(hf.QuantizerRole("linear", "weight", "other")).format_name == "mxfp8"
    recipe = hf.CustomRecipe(qfactory=g)
    assert recipe.quantizer(hf.QuantizerRole("linear", "grad_output", "fc")).columnwise_quantizer.with_rht


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="nvfp4_rht.*cannot serve fprop"):
        PlanFactory({"fc": ("nvfp4_rht", "mxfp8", "mxfp8")})
    with pytest.raises(ValueError, match="exactly one of db="):
        Budget()
    with pytest.raises(ValueError, match="'fp9' is unknown"):
        hf.analyze(hf.Linear(32, 32), [torch.randn(4, 32)], formats=("fp9",))
    with pytest.raises(ValueError, match="batches is empty"):
        hf.analyze(hf.Linear(32, 32), [])
    with pytest.raises(ValueError, match="no hybridfp GEMM ran"):
        hf.analyze(nn.Linear(32, 32), [torch.randn(4, 32)])
    a = hf.analyze(hf.Linear(32, 32), [torch.randn(4, 32)], formats=("high_precision", "nvfp4_1d"))
    with pytest.raises(ValueError, match="did not measure it"):
        recommend(a, Budget(like="mxfp8"))
    assert math.isinf(a.output_db(a.layers[0], "fprop", "high_precision"))
