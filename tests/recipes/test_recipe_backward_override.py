"""``backward_override``: every recipe takes it, checks it when made, and keeps it fixed."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

import hybridfp as hf

OVERRIDABLE = (hf.Float8CurrentScaling, hf.Float8BlockScaling, hf.MXFP8BlockScaling, hf.NVFP4BlockScaling)
MODES = (None, "high_precision", "dequantized")


def _factory(role):
    return hf.Float8CurrentScalingQuantizer()


@pytest.mark.parametrize("cls", OVERRIDABLE)
@pytest.mark.parametrize("mode", MODES)
def test_builtin_recipes_take_every_mode(cls, mode):
    r = cls(backward_override=mode)
    assert r.backward_override == mode
    assert cls().backward_override is None  # the default: quantized backward


@pytest.mark.parametrize("mode", MODES)
def test_custom_recipe_takes_every_mode(mode):
    r = hf.CustomRecipe(_factory, backward_override=mode)
    assert r.backward_override == mode
    assert hf.CustomRecipe(_factory).backward_override is None


def test_user_recipe_subclass_defaults_to_none():
    class Mine(hf.Recipe):
        def quantizer(self, role):
            return hf.MXFP8Quantizer()
    assert Mine().backward_override is None


@pytest.mark.parametrize("mode", ("high_precision", "dequantized"))
def test_delayed_scaling_refuses_an_override(mode):
    with pytest.raises(ValueError, match="DelayedScaling.*backward_override"):
        hf.DelayedScaling(backward_override=mode)
    assert hf.DelayedScaling(backward_override=None).backward_override is None


@pytest.mark.parametrize("bad", ("high-precision", "HIGH_PRECISION", "fp32", "", True, 1))
@pytest.mark.parametrize("make", [*(lambda v, c=c: c(backward_override=v) for c in OVERRIDABLE),
                                  lambda v: hf.CustomRecipe(_factory, backward_override=v)])
def test_unknown_values_are_refused(make, bad):
    with pytest.raises(ValueError, match="backward_override") as e:
        make(bad)
    msg = str(e.value)
    assert repr(bad) in msg and "'high_precision'" in msg and "'dequantized'" in msg


@pytest.mark.parametrize("cls", OVERRIDABLE)
def test_the_option_is_frozen(cls):
    r = cls(backward_override="dequantized")
    with pytest.raises(dataclasses.FrozenInstanceError, match="backward_override"):
        r.backward_override = "high_precision"
    assert r.backward_override == "dequantized"
    other = dataclasses.replace(r, backward_override="high_precision")  # the way to change it
    assert other.backward_override == "high_precision" and other.key() != r.key()
    with pytest.raises(ValueError, match="backward_override"):
        dataclasses.replace(r, backward_override="bad")


def test_custom_recipe_option_is_frozen_and_in_its_key():
    r = hf.CustomRecipe(_factory, backward_override="high_precision")
    with pytest.raises(dataclasses.FrozenInstanceError, match="backward_override"):
        r.backward_override = None
    assert r.key() != hf.CustomRecipe(_factory).key()
    assert "backward_override='high_precision'" in repr(r)


@pytest.mark.parametrize("cls", OVERRIDABLE)
def test_copies_keep_the_option(cls):
    r = cls(backward_override="high_precision")
    for c in (copy.copy(r), copy.deepcopy(r), pickle.loads(pickle.dumps(r))):
        assert c.backward_override == "high_precision" and c.key() == r.key()
