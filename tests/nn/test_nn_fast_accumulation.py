"""fprop fast accumulation: off by default (numerics §1), opt-in per recipe, fprop only.

On the CPU no backend has fast accumulation, so these tests check the plumbing: what the
recipe says reaches ``gemm(fast_accumulation=...)`` for fprop and nothing else, and gemm
hands it to the selected backend. Its numerics are bounded on a CUDA GPU in
tests/kernels/test_kernels_cublas_fp8.py (test_fast_accumulation_only_when_asked).
"""

from __future__ import annotations

import pytest
import torch

import hybridfp
from hybridfp.gemm import backends, gemm
from hybridfp.gemm.backends import Backend
from hybridfp.nn import linear_function

RECIPES = {
    "fp8 current": lambda fast: hybridfp.Float8CurrentScaling(fprop_fast_accumulation=fast),
    "fp8 delayed": lambda fast: hybridfp.DelayedScaling(fprop_fast_accumulation=fast),
    "custom": lambda fast: hybridfp.CustomRecipe(
        qfactory=hybridfp.factories.per_gemm(fprop="fp8_current", dgrad="fp8_block", wgrad="fp8_block"),
        fprop_fast_accumulation=fast),
}


def _layouts_and_flags(module, x, recipe, monkeypatch) -> list[tuple[str, bool]]:
    seen: list[tuple[str, bool]] = []
    real = linear_function.gemm

    def spy(A, B, layout, **kw):
        seen.append((layout, kw.get("fast_accumulation", False)))
        return real(A, B, layout, **kw)
    monkeypatch.setattr(linear_function, "gemm", spy)
    with hybridfp.autocast(recipe=recipe):
        y = module(x)
    y.float().sum().backward()
    return sorted(seen)


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear"])
def test_recipe_flag_reaches_fprop_only(kind, name, fast, monkeypatch):
    torch.manual_seed(0)
    module = getattr(hybridfp, kind)(64, 48)
    x = torch.randn(32, 64, requires_grad=True)
    got = _layouts_and_flags(module, x, RECIPES[name](fast), monkeypatch)
    assert got == [("NN", False), ("NT", False), ("TN", fast)]


def test_default_recipes_do_not_use_fast_accumulation():
    assert hybridfp.Float8CurrentScaling().fprop_fast_accumulation is False
    assert hybridfp.MXFP8BlockScaling().fprop_fast_accumulation is False
    assert hybridfp.CustomRecipe(qfactory=lambda role: hybridfp.IdentityQuantizer()).fprop_fast_accumulation is False


def test_flag_is_part_of_the_recipe_key():
    f = hybridfp.factories.per_gemm(fprop="fp8_current", dgrad="fp8_current", wgrad="fp8_current")
    assert hybridfp.CustomRecipe(f).key() != hybridfp.CustomRecipe(f, fprop_fast_accumulation=True).key()
    assert (hybridfp.Float8CurrentScaling().key()
            != hybridfp.Float8CurrentScaling(fprop_fast_accumulation=True).key())
    assert "fprop_fast_accumulation=True" in repr(hybridfp.CustomRecipe(f, fprop_fast_accumulation=True))


def test_custom_recipe_rejects_a_non_bool_flag():
    with pytest.raises(TypeError, match="fprop_fast_accumulation"):
        hybridfp.CustomRecipe(lambda role: hybridfp.IdentityQuantizer(), fprop_fast_accumulation="yes")


@pytest.mark.parametrize("fast", [False, True])
def test_gemm_hands_the_flag_to_the_backend(fast, monkeypatch):
    """A backend sees exactly what the caller asked for (the FP8 per-tensor one acts on it)."""
    seen = []

    def run(sa, sb, layout, **kw):
        seen.append(kw.get("fast_accumulation", False))
        return torch.zeros(sa.rows, sb.rows)
    monkeypatch.setattr(backends, "BACKENDS", [Backend("spy", lambda *a: True, run)])
    q = hybridfp.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    a, b = q.quantize(torch.randn(8, 32)), q.quantize(torch.randn(16, 32))
    gemm(a, b, "TN", fast_accumulation=fast)
    assert seen == [fast]


def test_results_on_cpu_do_not_depend_on_the_flag():
    """No CPU backend accumulates in reduced precision: the flag changes no bit there."""
    torch.manual_seed(1)
    lin = hybridfp.Linear(64, 48)
    x = torch.randn(32, 64)
    outs = []
    for fast in (False, True):
        with hybridfp.autocast(recipe=hybridfp.Float8CurrentScaling(fprop_fast_accumulation=fast)):
            outs.append(lin(x))
    assert torch.equal(outs[0], outs[1])
