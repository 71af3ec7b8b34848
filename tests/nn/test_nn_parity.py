"""numerics §3/§4: a hybrid whose two children are the built-in format for the role gives results
bitwise equal to the built-in recipe, in every module — forward output, input gradient,
weight / bias (and norm) gradients — over three training steps (delayed scaling updates its
scales at each autocast region's end, so steps 2 and 3 use updated scales)."""

from __future__ import annotations

import pytest
import torch
from nn_cases import (FORMATS, MODULES, ODD_IN, ODD_OUT, ODD_ROWS, check_twin_parity, make_data,
                      make_module, run_step)

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")  # CPU: expected


DTYPES = {  # (input dtype, params dtype)
    "fp32": (torch.float32, torch.float32),
    "bf16_input": (torch.bfloat16, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
}


@pytest.mark.parametrize("dtypes", list(DTYPES))
@pytest.mark.parametrize("kind", MODULES)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_twin_hybrid_equals_builtin_recipe(fmt, kind, dtypes):
    x_dtype, params_dtype = DTYPES[dtypes]
    check_twin_parity(kind, fmt, x_dtype, (48, 64, 32), params_dtype)


@pytest.mark.parametrize("kind", ["linear", "grouped"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_twin_hybrid_equals_builtin_recipe_odd_shapes(fmt, kind):
    # M odd, K = 80 (not a multiple of 32 / 128), N = 24 (not a multiple of 16): every
    # format's padding path, and NVFP4's RHT over a padded last tile of the wgrad reduction.
    check_twin_parity(kind, fmt, torch.float32, (ODD_ROWS, ODD_IN, ODD_OUT))


def test_delayed_scaling_steps_use_the_previous_amaxes():
    """The 3-step comparison is only meaningful for delayed scaling if its scales move. Step 1
    runs with the initial scale 1; a region's end updates the forward quantizers from the
    amaxes recorded so far (448 / max of the history, E4M3); gradient quantizers, which
    record in the backward after the region, update at the next region's end (57344 / amax,
    E5M2), so every quantization uses the scale of the previous update (numerics §2.2)."""
    m = make_module("linear")
    x1, dy1 = make_data(seed=1)
    x2, dy2 = make_data(seed=2)
    x2, dy2 = 3 * x2, 5 * dy2
    run_step(m, x1, dy1, FORMATS["fp8_delayed"]())
    qx, qw, qg = (m._quantizers[s][0] for s in ("input", "weight", "grad_output"))
    assert qx.scale.item() == pytest.approx(448.0 / x1.abs().max().item(), rel=1e-6)
    assert qw.scale.item() == pytest.approx(448.0 / m.weight.abs().max().item(), rel=1e-6)
    assert qg.scale.item() == 1.0  # dy1's amax is recorded, not applied yet
    # Step 2's backward quantizes dy2 with 57344 / amax(dy1): compare with that FP8 cast.
    saved = []
    orig = qg.quantize
    qg.quantize = lambda t: saved.append(orig(t)) or saved[-1]
    run_step(m, x2, dy2, FORMATS["fp8_delayed"]())
    assert qg.scale.item() == pytest.approx(57344.0 / dy1.abs().max().item(), rel=1e-6)
    used = saved[0].qstorage.payload("rowwise")["scale_inv"].item()
    assert used == pytest.approx(dy1.abs().max().item() / 57344.0, rel=1e-6)
    # The forward quantizer's history now holds both steps' amaxes: the max wins.
    assert qx.scale.item() == pytest.approx(448.0 / x2.abs().max().item(), rel=1e-6)
