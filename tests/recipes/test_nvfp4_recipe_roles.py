"""Per-role settings of the built-in recipes for backward (gradient) slots.

TransformerEngine's NVFP4 recipe gives every gradient slot the gradient settings (RHT on the
columnwise copy and stochastic rounding) and no forward slot stochastic rounding; the FP8
recipes under "HYBRID" give every gradient slot E5M2.
"""

from __future__ import annotations

import pytest
import torch

from hybridfp import QuantizerRole
from hybridfp.quantizers import NVFP4Quantizer
from hybridfp.recipes.recipes import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                                      MXFP8BlockScaling, NVFP4BlockScaling)

GRAD_TYPES = ("grad_output", "grad_input")
FORWARD_TYPES = ("input", "output")
MODULES = ("linear", "grouped_linear")


@pytest.mark.parametrize("module_type", MODULES)
@pytest.mark.parametrize("tensor_type", GRAD_TYPES)
def test_nvfp4_every_gradient_slot_gets_rht_and_sr(module_type, tensor_type):
    q = NVFP4BlockScaling().quantizer(QuantizerRole(module_type, tensor_type))
    assert isinstance(q, NVFP4Quantizer)
    assert q.with_rht and q.stochastic_rounding and not q.with_2d_quantization


@pytest.mark.parametrize("tensor_type", GRAD_TYPES)
def test_nvfp4_gradient_switches_apply_to_every_gradient_slot(tensor_type):
    role = QuantizerRole("linear", tensor_type)
    assert not NVFP4BlockScaling(disable_stochastic_rounding=True).quantizer(role).stochastic_rounding
    assert not NVFP4BlockScaling(disable_rht=True).quantizer(role).with_rht


@pytest.mark.parametrize("module_type", MODULES)
@pytest.mark.parametrize("tensor_type", FORWARD_TYPES)
def test_nvfp4_forward_slots_have_no_stochastic_rounding(module_type, tensor_type):
    q = NVFP4BlockScaling().quantizer(QuantizerRole(module_type, tensor_type))
    assert isinstance(q, NVFP4Quantizer)
    assert q.with_rht and not q.stochastic_rounding


def test_nvfp4_weight_slot_unchanged():
    q = NVFP4BlockScaling().quantizer(QuantizerRole("linear", "weight"))
    assert q.with_2d_quantization and not q.with_rht and not q.stochastic_rounding


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling(),
                                    Float8BlockScaling(fp8_format="HYBRID"),
                                    MXFP8BlockScaling(fp8_format="HYBRID")],
                         ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("tensor_type", GRAD_TYPES)
def test_fp8_hybrid_every_gradient_slot_is_e5m2(recipe, tensor_type):
    q = recipe.quantizer(QuantizerRole("linear", tensor_type))
    assert q.dtype == torch.float8_e5m2
    assert recipe.quantizer(QuantizerRole("linear", "input")).dtype == torch.float8_e4m3fn
