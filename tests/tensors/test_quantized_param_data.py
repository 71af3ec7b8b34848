"""``param.data = ...`` and ``nn.Module`` conversions (``.to(dtype)``, ``.half()``, ``.to(device)``)
of quantized Parameters (``quantized_model_init``).

torch converts a module's parameters through ``param.data = fn(param)`` (``nn.Module._apply``;
a QuantizedTensor is no traceable wrapper subclass, so torch does not swap it) and EMA swaps or
``torch.nn.utils.vector_to_parameters`` assign ``.data`` too. torch's own ``set_data`` changes
only the wrapper's shape / dtype / device: the payloads the GEMMs read are the QuantizedTensor's
Python attributes. ``QuantizedTensor.data``'s setter moves them, so the forward reads what was
assigned, and refuses plain tensors (a quantized tensor cannot alias one) with a clear error.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import hybridfp as hf
from hybridfp import factories
from hybridfp.tensors import QuantizedTensor

RECIPES = {
    "fp8_current": hf.Float8CurrentScaling,
    "mxfp8": hf.MXFP8BlockScaling,
    "nvfp4": hf.NVFP4BlockScaling,
    "hybrid_mxfp8_nvfp4": lambda: hf.CustomRecipe(qfactory=factories.mxfp8_fwd_nvfp4_bwd),
}
#: the two recipes the GroupedLinear tests run (joined primary weights with both)
GROUPED_RECIPES = ["fp8_current", "mxfp8"]
HALF_DTYPES = {"to(bfloat16)": (lambda m: m.to(torch.bfloat16), torch.bfloat16),
               "half()": (lambda m: m.half(), torch.float16),
               "bfloat16()": (lambda m: m.bfloat16(), torch.bfloat16)}


def _linear(recipe: str, preserve: bool = False) -> hf.Linear:
    torch.manual_seed(0)
    with hf.quantized_model_init(recipe=RECIPES[recipe](), preserve_high_precision_init_val=preserve):
        return hf.Linear(64, 32, bias=False)


def _grouped(recipe: str) -> hf.GroupedLinear:
    torch.manual_seed(0)
    with hf.quantized_model_init(recipe=RECIPES[recipe]()):
        return hf.GroupedLinear(2, 64, 32, bias=False)


def _forward(m: nn.Module, recipe: str, x: torch.Tensor, *args) -> torch.Tensor:
    torch.manual_seed(1)  # NVFP4 stochastic rounding draws from torch's generator
    with torch.no_grad(), hf.autocast(recipe=RECIPES[recipe]()):
        return m(x, *args)


def _payloads(t: QuantizedTensor) -> list[torch.Tensor]:
    return [x.detach().clone() for x in t.qstorage.tensors()]


def _same_payloads(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b))


def _value(shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- param.data = QuantizedTensor
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_assigned_quantized_value_is_what_the_forward_reads(recipe: str) -> None:
    """``p.data = q`` (a checkpoint / EMA swap): the Parameter, the same object, now holds q's
    payloads and quantizer, and the forward equals that of a module ``copy_``-ed the same value."""
    lin, ref = _linear(recipe), _linear(recipe)
    p = lin.weight
    x = _value((4, 64), 2)
    before = _forward(lin, recipe, x)
    new = p.quantizer.quantize(_value((32, 64), 3))
    p.data = new
    assert lin.weight is p and isinstance(p, nn.Parameter) and p.requires_grad
    assert _same_payloads(_payloads(p), _payloads(new))
    assert torch.equal(p.dequantize(), new.dequantize())
    assert p.quantizer is new.quantizer
    with torch.no_grad():
        ref.weight.copy_(new)
    after = _forward(lin, recipe, x)
    assert torch.equal(after, _forward(ref, recipe, x))
    assert not torch.equal(after, before)


def test_assigned_tensor_aliases_like_torch_data() -> None:
    """As torch's ``.data =``: the Parameter aliases the assigned tensor's memory (a write through
    one is seen by the other), while each has a storage object of its own (dropping a copy from
    one leaves the other's)."""
    lin = _linear("mxfp8")
    p = lin.weight
    new = p.quantizer.quantize(_value((32, 64), 3))
    p.data = new
    with torch.no_grad():
        new.copy_(p.quantizer.quantize(torch.ones(32, 64)))
    assert torch.equal(p.dequantize(), torch.ones(32, 64))
    p.update_usage(columnwise_usage=False)
    assert new.directions() == ("rowwise", "columnwise")


def test_ema_swap_through_data() -> None:
    """``p.data, e.data = e.data, p.data`` swaps two quantized weights (the EMA evaluation pattern)."""
    lin, ema = _linear("mxfp8"), _linear("mxfp8")
    with torch.no_grad():
        ema.weight.copy_(torch.ones(32, 64))
    w, e = lin.weight.dequantize().clone(), ema.weight.dequantize().clone()
    x = _value((4, 64), 2)
    y_lin, y_ema = _forward(lin, "mxfp8", x), _forward(ema, "mxfp8", x)
    lin.weight.data, ema.weight.data = ema.weight.data, lin.weight.data
    assert torch.equal(lin.weight.dequantize(), e) and torch.equal(ema.weight.dequantize(), w)
    assert torch.equal(_forward(lin, "mxfp8", x), y_ema) and torch.equal(_forward(ema, "mxfp8", x), y_lin)
    lin.weight.data, ema.weight.data = ema.weight.data, lin.weight.data  # and back
    assert torch.equal(lin.weight.dequantize(), w) and torch.equal(ema.weight.dequantize(), e)


def test_quantizer_kept_for_a_loaded_value_of_the_same_format() -> None:
    """A value with no quantizer (``torch.load``): the Parameter keeps its own when the formats
    match (it re-encodes it from masters), and keeps none when they differ (it would encode the
    wrong layout; an in-place write then asks for ``set_quantizer``)."""
    lin = _linear("mxfp8")
    p, q = lin.weight, lin.weight.quantizer
    buf = io.BytesIO()
    torch.save(q.quantize(torch.ones(32, 64)), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert loaded.quantizer is None
    p.data = loaded
    assert p.quantizer is q and torch.equal(p.dequantize(), torch.ones(32, 64))
    other = hf.Float8CurrentScalingQuantizer()(torch.ones(32, 64))
    other.set_quantizer(None)
    p.data = other
    assert p.quantizer is None
    with pytest.raises(RuntimeError, match="set_quantizer"), torch.no_grad():
        p.copy_(torch.zeros(32, 64))


# ---------------------------------------------------------------- param.data = plain tensor
def test_assigned_plain_tensor_is_refused_and_changes_nothing() -> None:
    lin = _linear("mxfp8")
    p = lin.weight
    storage, value = p.qstorage, p.dequantize().clone()
    with pytest.raises(TypeError, match=r"Linear\.weight.*copy_\(t\).*quantize_master_weights"):
        p.data = torch.ones(32, 64)
    assert p.qstorage is storage and p.dtype == torch.float32 and torch.equal(p.dequantize(), value)


def test_vector_to_parameters_is_refused() -> None:
    """``torch.nn.utils.vector_to_parameters`` assigns plain views of the vector through ``.data``:
    refused, where it used to leave the weights as they were without a word."""
    lin = _linear("mxfp8")
    vec = torch.ones(32 * 64)
    with pytest.raises(TypeError, match="cannot assign a plain"):
        torch.nn.utils.vector_to_parameters(vec, lin.parameters())


@pytest.mark.filterwarnings("ignore:hybridfp. aten._to_copy has no quantized implementation")
def test_module_double_is_refused_with_the_dtypes_a_quantized_weight_takes() -> None:
    lin = _linear("mxfp8")
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        lin.double()
    assert lin.weight.dtype == torch.float32 and lin.weight.qstorage.dtype == torch.float32


def test_assignment_torch_refuses_changes_nothing() -> None:
    """torch's ``set_data`` refuses a meta tensor into a CPU one: the payloads stay too."""
    lin = _linear("mxfp8")
    p = lin.weight
    storage = p.qstorage
    with pytest.raises(RuntimeError, match="incompatible tensor type"):
        p.data = p.to("meta")
    assert p.qstorage is storage and p.device.type == "cpu"


# ---------------------------------------------------------------- Module conversions
@pytest.mark.parametrize("conversion", sorted(HALF_DTYPES))
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_module_dtype_conversion_keeps_codes(recipe: str, conversion: str) -> None:
    """``.to(bfloat16)`` / ``.half()`` / ``.bfloat16()``: the nominal dtype the Parameter reports,
    its storage's and ``dequantize()``'s agree; the codes and scales are kept bitwise (nothing is
    re-quantized), so the value and the forward are unchanged; ``.float()`` goes back."""
    convert, dtype = HALF_DTYPES[conversion]
    lin = _linear(recipe)
    p = lin.weight
    codes, value = _payloads(p), p.dequantize()
    x = _value((4, 64), 2).to(dtype)
    before = _forward(lin, recipe, x)
    convert(lin)
    assert lin.weight is p
    assert p.dtype == dtype and p.qstorage.dtype == dtype and p.dequantize().dtype == dtype
    assert _same_payloads(_payloads(p), codes)
    assert torch.equal(p.dequantize(torch.float32), value)
    assert torch.equal(_forward(lin, recipe, x), before)
    lin.float()
    assert p.dtype == torch.float32 and p.dequantize().dtype == torch.float32
    assert _same_payloads(_payloads(p), codes) and torch.equal(p.dequantize(), value)


@pytest.mark.parametrize("recipe", GROUPED_RECIPES)
def test_grouped_linear_to_bfloat16_rejoins_and_reads_the_converted_weights(recipe: str) -> None:
    gl = _grouped(recipe)
    joined = gl._primary is not None
    ws = [gl.weight0, gl.weight1]
    codes = [_payloads(w) for w in ws]
    x = _value((6, 64), 2).bfloat16()
    before = _forward(gl, recipe, x, [2, 4])
    gl.to(torch.bfloat16)
    assert [gl.weight0, gl.weight1] == ws
    for w, c in zip(ws, codes):
        assert w.dtype == w.qstorage.dtype == w.dequantize().dtype == torch.bfloat16
        assert _same_payloads(_payloads(w), c)
    # joined again on the converted storages (GroupedLinear._apply), as built
    assert (gl._primary is not None) == joined
    if joined:
        assert gl._primary.holds(ws)
    assert torch.equal(_forward(gl, recipe, x, [2, 4]), before)


@pytest.mark.parametrize("recipe", GROUPED_RECIPES)
def test_grouped_linear_expert_data_assignment_is_read(recipe: str) -> None:
    """An expert of a joined GroupedLinear assigned through ``.data``: its rows read the new
    value (the joined encoding no longer holds it), the other expert's are unchanged."""
    gl = _grouped(recipe)
    x = _value((8, 64), 2)
    before = _forward(gl, recipe, x, [4, 4])
    new = gl.weight1.quantizer.quantize(torch.ones(32, 64))
    gl.weight1.data = new
    after = _forward(gl, recipe, x, [4, 4])
    assert torch.equal(after[:4], before[:4])
    ref = _grouped(recipe)
    with torch.no_grad():
        ref.weight1.copy_(new)
    assert torch.equal(after, _forward(ref, recipe, x, [4, 4]))


def test_module_device_move_moves_the_payloads() -> None:
    """The ``.to(device)`` path on this machine's device: ``Module._apply`` with a copying move
    (what ``.to(other_device)`` runs) gives the same Parameter new payload tensors of equal values."""
    lin = _linear("mxfp8")
    p = lin.weight
    old = list(p.qstorage.tensors())
    lin._apply(lambda t: t.to("cpu", copy=True))
    assert lin.weight is p
    new = list(p.qstorage.tensors())
    assert all(a is not b and a.data_ptr() != b.data_ptr() for a, b in zip(old, new))
    assert _same_payloads(new, old)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("recipe", ["fp8_current", "mxfp8"])
def test_module_cuda_and_back_moves_the_payloads(recipe: str) -> None:
    lin = _linear(recipe)
    p = lin.weight
    codes, value = _payloads(p), p.dequantize()
    lin.cuda()
    assert lin.weight is p and p.device.type == "cuda"
    assert {t.device.type for t in p.qstorage.tensors()} == {"cuda"} and p.qstorage.device.type == "cuda"
    assert _same_payloads(_payloads(p), codes) and torch.equal(p.dequantize().cpu(), value)
    _forward(lin, recipe, _value((4, 64), 2).cuda())
    lin.to("cpu", torch.bfloat16)
    assert {t.device.type for t in p.qstorage.tensors()} == {"cpu"} and p.dtype == torch.bfloat16
    assert _same_payloads(_payloads(p), codes)


# ---------------------------------------------------------------- the kept initial value
def test_kept_initial_value_follows_a_dtype_conversion() -> None:
    """``preserve_high_precision_init_val``: after ``.to(bfloat16)`` the kept value is the initial
    one cast as the weights of a plain model are; masters seeded from it start there."""
    lin = _linear("mxfp8", preserve=True)
    init = lin.weight.get_high_precision_init_val().clone()
    lin.to(torch.bfloat16)
    kept = lin.weight.get_high_precision_init_val()
    assert kept.device.type == "cpu" and torch.equal(kept, init.to(torch.bfloat16))


def test_kept_initial_value_follows_an_assigned_value() -> None:
    """An assigned value without a kept value of its own: the kept value becomes it, as a
    ``copy_`` leaves it (masters seeded after the assignment start from the new weights)."""
    lin = _linear("mxfp8", preserve=True)
    new = lin.weight.quantizer.quantize(torch.ones(32, 64))
    lin.weight.data = new
    assert torch.equal(lin.weight.get_high_precision_init_val(), new.dequantize())
    opt = hf.MasterWeightOptimizer(torch.optim.SGD, lin.parameters(), lr=0.0)
    assert torch.equal(opt.master_of(lin.weight), torch.ones(32, 64))


def test_write_through_an_assigned_alias_reaches_its_source() -> None:
    """``p.data = w.data``: ``p`` aliases ``w``'s payloads, and a write through ``p`` moves ``w``'s
    kept initial value too, as a write through ``w.data`` does."""
    a, b = _linear("mxfp8", preserve=True), _linear("mxfp8", preserve=True)
    a.weight.data = b.weight.data
    with torch.no_grad():
        a.weight.copy_(torch.ones(32, 64))
    assert torch.equal(b.weight.dequantize(), torch.ones(32, 64))
    assert torch.equal(b.weight.get_high_precision_init_val(), torch.ones(32, 64))
    assert torch.equal(a.weight.get_high_precision_init_val(), torch.ones(32, 64))


# ---------------------------------------------------------------- swap_tensors and weight caching
@pytest.mark.parametrize("recipe", ["fp8_current", "mxfp8"])
def test_swap_module_params_on_conversion(recipe: str) -> None:
    """With ``torch.__future__.set_swap_module_params_on_conversion(True)`` ``Module._apply``
    swaps instead (``torch.utils.swap_tensors``, which moves the payloads with the ``__dict__``):
    the Parameter object stays, and dtype, storage and value agree as on the default path."""
    lin = _linear(recipe)
    p = lin.weight
    codes = _payloads(p)
    x = _value((4, 64), 2).bfloat16()
    before = _forward(lin, recipe, x)
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        lin.to(torch.bfloat16)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    assert lin.weight is p and p.dtype == p.qstorage.dtype == p.dequantize().dtype == torch.bfloat16
    assert _same_payloads(_payloads(p), codes)
    assert torch.equal(_forward(lin, recipe, x), before)


@pytest.mark.parametrize("recipe", ["fp8_current", "mxfp8"])
def test_weight_caching_reads_reassigned_and_converted_weights(recipe: str) -> None:
    """Inside one ``weight_caching`` scope: forward, ``.data =`` another value, forward (the new
    value, never a cached quantization of the old), ``.to(bfloat16)``, forward (the same value)."""
    lin, ref = _linear(recipe), _linear(recipe)
    x = _value((4, 64), 2)
    new = lin.weight.quantizer.quantize(_value((32, 64), 5))
    with torch.no_grad():
        ref.weight.copy_(new)
    with hf.weight_caching():
        before = _forward(lin, recipe, x)
        lin.weight.data = new
        after = _forward(lin, recipe, x)
        lin.to(torch.bfloat16)
        converted = _forward(lin, recipe, x.bfloat16())
    want = _forward(ref, recipe, x)
    assert not torch.equal(after, before)
    assert torch.equal(after, want)
    assert torch.equal(converted, _forward(ref, recipe, x.bfloat16()))


def test_assigning_its_own_data_keeps_the_kept_value() -> None:
    """``p.data = p.data`` (or ``p.detach()``) changes nothing, the kept initial value included
    (it is not replaced by the dequantized, rounded, value)."""
    lin = _linear("mxfp8", preserve=True)
    p = lin.weight
    init = p.get_high_precision_init_val()
    codes = _payloads(p)
    p.data = p.data
    p.data = p.detach()
    assert p.get_high_precision_init_val() is init and _same_payloads(_payloads(p), codes)


def test_compiled_module_reads_reassigned_and_converted_weights() -> None:
    """A module compiled before the assignment (``torch.compile``, ``aot_eager``) reads the
    assigned payloads and, after ``.to(bfloat16)``, the converted ones: no stale graph input."""
    torch._dynamo.reset()
    try:
        lin, ref = _linear("mxfp8"), _linear("mxfp8")
        compiled = torch.compile(lin, backend="aot_eager", fullgraph=True)
        x = _value((8, 64), 2)
        before = _forward(compiled, "mxfp8", x)
        new = lin.weight.quantizer.quantize(_value((32, 64), 5))
        lin.weight.data = new
        with torch.no_grad():
            ref.weight.copy_(new)
        after = _forward(compiled, "mxfp8", x)
        assert not torch.equal(after, before) and torch.equal(after, _forward(ref, "mxfp8", x))
        lin.to(torch.bfloat16)
        assert torch.equal(_forward(compiled, "mxfp8", x.bfloat16()), _forward(ref, "mxfp8", x.bfloat16()))
    finally:
        torch._dynamo.reset()
