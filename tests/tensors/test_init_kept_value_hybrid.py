"""In-place initialisation of a quantized weight whose quantizer has a high-precision side.

``quantized_model_init(preserve_high_precision_init_val=True)`` keeps a weight's initial
high-precision value, from which FP32 master weights are seeded. An in-place init
(``nn.init.normal_`` ...) must leave there the exact value it wrote, and the quantized copies
must be what quantizing that value gives. A weight held as Hybrid(row=MXFP8 / NVFP4,
col=Identity, rowwise_dequantized) used to keep the rounded (dequantized rowwise) value: the
op ran on the Identity copy's own memory, which re-quantizing then overwrote.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import hybridfp
from hybridfp.factories import BASE, ZOO
from hybridfp.quantizers import HybridQuantizer, IdentityQuantizer

WEIGHT = hybridfp.QuantizerRole("linear", "weight")


def _has_high_precision_side(factory) -> bool:
    q = factory(WEIGHT)
    children = (q.rowwise_quantizer, q.columnwise_quantizer) if isinstance(q, HybridQuantizer) else (q,)
    return any(isinstance(c, IdentityQuantizer) for c in children)


#: every built-in factory whose weight quantizer keeps a high-precision (Identity) copy
HIGH_PRECISION_SIDE = sorted(n for n, f in {**BASE, **ZOO}.items() if _has_high_precision_side(f))


def _recipe(name: str) -> hybridfp.Recipe:
    if name == "plain MXFP8BlockScaling":
        return hybridfp.MXFP8BlockScaling()
    return hybridfp.CustomRecipe(qfactory={**BASE, **ZOO}[name])


RECIPES = HIGH_PRECISION_SIDE + ["plain MXFP8BlockScaling", "mxfp8", "nvfp4"]


def _weight(name: str, rows: int = 96, cols: int = 64) -> torch.nn.Parameter:
    torch.manual_seed(1)
    with hybridfp.quantized_model_init(recipe=_recipe(name), preserve_high_precision_init_val=True):
        return hybridfp.Linear(cols, rows, bias=False).weight


def _draw(shape, fn) -> torch.Tensor:
    torch.manual_seed(0)
    return fn(torch.empty(shape))


#: name -> (the write on w, the value w takes from its value before); the drawing ones reseed
INITS = {
    "normal_": (lambda w: torch.nn.init.normal_(w, std=0.02),
                lambda w, before: _draw(w.shape, lambda x: x.normal_(std=0.02))),
    "uniform_": (lambda w: torch.nn.init.uniform_(w, -0.05, 0.05),
                 lambda w, before: _draw(w.shape, lambda x: x.uniform_(-0.05, 0.05))),
    "fill_": (lambda w: w.fill_(0.0123),
              lambda w, before: torch.full(w.shape, 0.0123)),
    "copy_": (lambda w: w.copy_(_draw(w.shape, lambda x: x.normal_(std=0.03))),
              lambda w, before: _draw(w.shape, lambda x: x.normal_(std=0.03))),
    "zero_": (lambda w: w.zero_(), lambda w, before: torch.zeros(w.shape)),
    # an optimizer-style update of a parameter is refused; through a detached alias it is a write
    "mul_ (detached alias)": (lambda w: w.detach().mul_(_factor(w.shape)),
                              lambda w, before: before * _factor(w.shape)),
}


def _factor(shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.rand(shape, generator=g) * 1.7 + 0.1


def _run(write, w) -> None:
    torch.manual_seed(0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        write(w)


def _assert_copies_quantize(t: hybridfp.QuantizedTensor, value: torch.Tensor) -> None:
    """Each copy ``t`` holds is that copy of quantizing ``value`` with ``t``'s quantizer."""
    q = t.quantizer.copy()
    assert not q.uses_randomness()
    q.set_usage(rowwise=True, columnwise=True)
    ref = q.quantize(value.to(t.device, t.dtype))
    assert t.directions()
    for d in t.directions():
        torch.testing.assert_close(t.dequantize(torch.float32, direction=d),
                                   ref.dequantize(torch.float32, direction=d), rtol=0, atol=0,
                                   msg=lambda m: f"{d} copy: {m}")


def test_the_factories_with_a_high_precision_weight_side_are_found():
    assert {"mxfp8_fwd_high_precision_bwd", "nvfp4_row_scaled_fwd_high_precision_bwd",
            "high_precision_fwd_mxfp8_bwd", "high_precision"} <= set(HIGH_PRECISION_SIDE)


@pytest.mark.parametrize("how", list(INITS))
@pytest.mark.parametrize("name", RECIPES)
def test_an_in_place_init_keeps_the_value_written(name, how):
    w = _weight(name)
    assert w.get_high_precision_init_val() is not None
    before = w.dequantize(torch.float32).cpu().clone()  # an Identity copy dequantizes to itself
    write, value = INITS[how]
    _run(write, w)
    want = value(w, before).to(w.dtype)
    kept = w.get_high_precision_init_val()
    torch.testing.assert_close(kept, want.cpu(), rtol=0, atol=0)
    _assert_copies_quantize(w, kept)


@pytest.mark.parametrize("name", HIGH_PRECISION_SIDE)
def test_normal_init_keeps_the_drawn_value_not_the_rounded_one(name):
    """A hybrid's Identity copy holding dequantize(rowwise): the drawn value is kept, not the rounded one."""
    w = _weight(name)
    _run(lambda t: torch.nn.init.normal_(t, std=0.02), w)
    drawn = _draw(w.shape, lambda x: x.normal_(std=0.02))
    assert torch.equal(w.get_high_precision_init_val(), drawn)
    rounded = w.dequantize(torch.float32, direction="rowwise").cpu()
    if not torch.equal(rounded, drawn):  # a lossy rowwise copy: the kept value is not its value
        assert not torch.equal(w.get_high_precision_init_val(), rounded)


#: name -> an in-place write into entries [0, g) of dim 0 of w, through a tensor made from it
PARTIAL = {
    "slice normal_": lambda w, g: w[0:g].normal_(std=0.02),
    "slice uniform_": lambda w, g: w[0:g].uniform_(-0.05, 0.05),
    "slice mul_": lambda w, g: w[0:g].mul_(_factor((g, w.shape[1]))),
    "detached slice normal_": lambda w, g: w.detach()[0:g].normal_(std=0.02),
    "split fill_": lambda w, g: torch.split(w, g)[0].fill_(0.0123),
}


@pytest.mark.parametrize("how", list(PARTIAL))
@pytest.mark.parametrize("name", RECIPES)
def test_a_write_through_a_slice_keeps_the_rows_written(name, how):
    w = _weight(name)
    g = math.lcm(w.qstorage.row_granularity(), 32)
    w = _weight(name, rows=3 * g)
    kept_before = w.get_high_precision_init_val().clone()
    before = w.dequantize(torch.float32).cpu().clone()  # an Identity copy dequantizes to itself
    piece = {}

    def write(t):
        piece["t"] = PARTIAL[how](t, g)

    try:
        w[0:g].qstorage.check_writable()
    except ValueError:  # a slice sharing a per-tensor scale (NVFP4): refused, nothing changes
        with pytest.raises(ValueError, match="per-tensor"):
            _run(write, w)
        torch.testing.assert_close(w.get_high_precision_init_val(), kept_before, rtol=0, atol=0)
        torch.testing.assert_close(w.dequantize(torch.float32).cpu(), before, rtol=0, atol=0)
        return
    _run(write, w)
    torch.manual_seed(0)
    rows = torch.empty(g, w.shape[1])
    if "normal_" in how:
        want = rows.normal_(std=0.02)
    elif "uniform_" in how:
        want = rows.uniform_(-0.05, 0.05)
    elif "fill_" in how:
        want = rows.fill_(0.0123)
    else:
        want = before[0:g] * _factor((g, w.shape[1]))
    kept = w.get_high_precision_init_val()
    torch.testing.assert_close(kept[0:g], want.to(w.dtype), rtol=0, atol=0)
    torch.testing.assert_close(kept[g:], kept_before[g:], rtol=0, atol=0)
    _assert_copies_quantize(piece["t"], want)


@pytest.mark.parametrize("name", ["mxfp8_fwd_high_precision_bwd", "high_precision"])
def test_copy_of_the_weights_own_identity_value_keeps_that_value(name):
    """``w.copy_(x)`` where ``x`` is ``w``'s own Identity memory: re-quantizing overwrites it."""
    w = _weight(name)
    _run(lambda t: torch.nn.init.normal_(t, std=0.02), w)
    d = "columnwise" if w.has_direction("columnwise") and name != "high_precision" else "rowwise"
    own = w.qstorage.dequantize(direction=d)  # the Identity data tensor itself
    value = own.clone()
    _run(lambda t: t.copy_(own), w)
    torch.testing.assert_close(w.get_high_precision_init_val(), value.cpu(), rtol=0, atol=0)
    _assert_copies_quantize(w, value)
