"""Weight / grad_output copies held as their BF16 decodes (the policy's ``decoded_copies``): every
module's forward and backward are bitwise those with codes, and the modes pick the slots."""

from __future__ import annotations

import warnings

import pytest
import torch

import hybridfp
from hybridfp import CustomRecipe, GroupedLinear, LayerNormLinear, Linear, autocast, factories
from hybridfp.tensors import DecodedMXFP8Storage

HAS_CUDA = torch.cuda.is_available()
RECIPES = {
    "mxfp8": lambda: hybridfp.MXFP8BlockScaling(),
    "composer2": lambda: CustomRecipe(qfactory=factories.nvfp4_row_scaled_fwd_mxfp8_bwd),
    "nvfp4_fwd_mxfp8_bwd": lambda: CustomRecipe(qfactory=factories.per_gemm(fprop="nvfp4", dgrad="mxfp8",
                                                                            wgrad="mxfp8")),
    "fp8_current": lambda: hybridfp.Float8CurrentScaling(),
}
BOTH, ROW = {"rowwise", "columnwise"}, {"rowwise"}
#: copies held decoded under "always", per slot: 1D MXFP8's two copies (one storage: both or
#: none, so not the input's), an NVFP4 -> MXFP8 hybrid's any (the input's rowwise copy too)
MXFP8_HELD = {"input": set(), "weight": BOTH, "grad_output": BOTH}
HYBRID_HELD = {"input": ROW, "weight": BOTH, "grad_output": BOTH}
DECODED = {"mxfp8": MXFP8_HELD, "composer2": HYBRID_HELD, "nvfp4_fwd_mxfp8_bwd": HYBRID_HELD,
           "fp8_current": {"input": set(), "weight": set(), "grad_output": set()}}
#: Composer-2 is plain MXFP8 outside grouped linears (its hybrids are the experts' input / weight)
PLAIN = {("composer2", "linear"), ("composer2", "layernorm_linear")}


@pytest.fixture(autouse=True)
def _restore_mode():
    with hybridfp.policy(decoded_copies="auto"):
        yield


def _module(kind: str, device: str):
    torch.manual_seed(0)
    if kind == "linear":
        return Linear(64, 96, device=device)
    if kind == "layernorm_linear":
        return LayerNormLinear(64, 96, device=device)
    return GroupedLinear(4, 64, 96, device=device)


def _step(mode: str, kind: str, recipe: str, device: str = "cpu", rows: int = 70, splits=(20, 0, 33, 17)):
    m = _module(kind, device)
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(rows, 64, generator=g, device=device).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(rows, 96, generator=g, device=device).to(torch.bfloat16)
    with warnings.catch_warnings(), hybridfp.policy(decoded_copies=mode):
        warnings.simplefilter("ignore")
        with autocast(recipe=RECIPES[recipe]()):
            y = m(x, list(splits)) if kind == "grouped" else m(x)
        y.backward(dy)
    held = {slot: set(qs[0].hold_decoded) for slot, qs in m._quantizers.items()}
    return [y.detach(), x.grad] + [p.grad for p in m.parameters() if p.grad is not None], held, m


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", ["linear", "layernorm_linear", "grouped"])
def test_decoded_equals_codes(kind, recipe):
    want, held_never, _ = _step("never", kind, recipe)
    got, held, m = _step("always", kind, recipe)
    assert not any(held_never.values()) and held == DECODED["mxfp8" if (recipe, kind) in PLAIN else recipe]
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    if held["weight"] == BOTH and recipe == "mxfp8" and kind != "grouped":
        assert type(m._wcache[0][1].qstorage) is DecodedMXFP8Storage


def test_auto_is_off_without_decoding_gemms():
    """On the CPU every MXFP8 GEMM is emulated (nothing decodes to BF16): codes stay."""
    _, held, _ = _step("auto", "linear", "mxfp8")
    assert not any(held.values())


def test_unknown_mode():
    with pytest.raises(ValueError, match="Policy.decoded_copies"):
        hybridfp.Policy(decoded_copies="sometimes")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe", ["mxfp8", "composer2", "nvfp4_fwd_mxfp8_bwd"])
@pytest.mark.parametrize("kind", ["linear", "grouped"])
@pytest.mark.parametrize("mode", ["auto", "always"])
def test_decoded_on_cuda_is_bitwise(kind, recipe, mode):
    """On the GPU (BF16 tensor-core GEMMs, the fused kernels writing the decodes) every step equals
    the one with codes; "auto" holds what "always" does except the classes still in
    the policy's ``decoded_unverified_on_cuda``."""
    rows, splits = 4160, (1000, 0, 1999, 1161)
    want, _, _ = _step("never", kind, recipe, "cuda", rows, splits)
    got, held, m = _step(mode, kind, recipe, "cuda", rows, splits)
    expected = DECODED["mxfp8" if (recipe, kind) in PLAIN else recipe]
    if mode == "auto":
        unverified = hybridfp.current_policy().decoded_unverified_on_cuda
        expected = {slot: (set() if type(m._quantizers[slot][0]).__name__ in unverified else held_)
                    for slot, held_ in expected.items()}
    assert held == expected
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_quantizer_shared_by_slots_holds_nothing():
    """A factory that hands one quantizer object to several slots: holding its copies decoded for
    the weight would hold the input's saved columnwise copy in BF16 too, so nothing is held."""
    shared = hybridfp.MXFP8Quantizer()
    m = Linear(64, 96)
    with warnings.catch_warnings(), hybridfp.policy(decoded_copies="always"):
        warnings.simplefilter("ignore")
        with autocast(recipe=CustomRecipe(qfactory=lambda role: shared)):
            m(torch.randn(8, 64))
    assert all(not qs[0].hold_decoded for qs in m._quantizers.values())
