"""The validation's scoring: Spearman's rank correlation and the predicted error of a plan."""

from __future__ import annotations

import math

import torch

import hybridfp as hf
from hybridfp.analyze.validate import predicted_error, spearman


def test_spearman_ranks_with_ties():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 400]) == 1.0
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert math.isclose(spearman([1, 2, 2, 3], [1, 2, 3, 4]), 0.9486832980505138)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))


def test_predicted_error_orders_plans():
    torch.manual_seed(0)
    a = hf.analyze(hf.Linear(64, 32), [torch.randn(64, 64)], formats=("high_precision", "mxfp8", "nvfp4_1d"))
    layer = a.layers[0]
    exact = predicted_error(a, {layer: ("high_precision",) * 3})
    fp8 = predicted_error(a, {layer: ("mxfp8",) * 3})
    fp4 = predicted_error(a, {layer: ("nvfp4_1d",) * 3})
    assert exact == 0.0 < fp8 < fp4 < 0.1
