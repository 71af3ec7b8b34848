"""Modules built under ``torch.inference_mode`` run quantized: their weights are inference
tensors, which keep no version counter, so each call quantizes them anew (a write between calls
is seen) and ``is_first_microbatch=False`` is refused."""

from __future__ import annotations

import warnings

import pytest
import torch

import hybridfp as hf


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _pair(build):
    """The module built normally and under inference_mode, with the same weights."""
    torch.manual_seed(0)
    plain = build()
    with torch.inference_mode():
        inference = build()
        inference.load_state_dict(plain.state_dict())
    return plain, inference


@pytest.mark.parametrize("kind", ["linear", "grouped"])
def test_a_module_built_under_inference_mode_runs_quantized_and_sees_writes(kind):
    build = (lambda: hf.Linear(64, 64)) if kind == "linear" else (lambda: hf.GroupedLinear(2, 64, 64))
    plain, inference = _pair(build)
    x = torch.randn(8, 64)
    args = (x,) if kind == "linear" else (x, [4, 4])
    recipe = hf.MXFP8BlockScaling()
    with torch.no_grad(), hf.autocast(recipe=recipe):
        want = plain(*args)
    with torch.inference_mode(), hf.autocast(recipe=recipe):
        assert torch.equal(inference(*args), want)
        for p in inference.parameters():
            p.mul_(2)  # a write the next call of the same region must see
        doubled = inference(*args)
    with torch.no_grad():
        for p in plain.parameters():
            p.mul_(2)
    with torch.no_grad(), hf.autocast(recipe=recipe):
        assert torch.equal(doubled, plain(*args))


def test_is_first_microbatch_false_is_refused_for_an_inference_weight():
    with torch.inference_mode():
        lin = hf.Linear(64, 64)
        with hf.autocast(recipe=hf.MXFP8BlockScaling()):
            lin(torch.randn(8, 64), is_first_microbatch=True)
            with pytest.raises(RuntimeError, match="made under torch.inference_mode"):
                lin(torch.randn(8, 64), is_first_microbatch=False)
