"""Quantized primary weights of a GroupedLinear held as one joined encoding, on a CUDA GPU: the
grouped Triton / cuBLAS routes build the joined layout (FP8 current scaling, MXFP8), a re-encode
from FP32 masters is bitwise the per-expert reference, the GEMMs read the joined copies (results
those of a twin never joined, within the GEMMs' own accumulation-order difference), and the
hybrid whose cuts carry an amax of their own stays per expert. The CPU tests
(test_primary_group.py) hold the bitwise step claims; here the routes differ between the joined
and the per-expert layer, so steps are compared by a bound."""

from __future__ import annotations

import warnings

import pytest
import torch

import hybridfp as hfp
from hybridfp.moe import primary_group
from hybridfp.moe.grouped_tensor import GroupedTensor

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Kernel-sized shapes (multiples of 128) and uneven routing with an empty expert.
E, D, H = 8, 256, 512
SPLITS = [130, 0, 257, 64, 512, 33, 96, 200]
JOINED = {"fp8_current": hfp.Float8CurrentScaling, "mxfp8": hfp.MXFP8BlockScaling}
# One BF16 rounding of the output (at most 2^-8 relative per element) dominates the accumulation-order
# difference of two FP32-accumulating GEMM routes; a stale or zero weight gives ~1.
REL_BOUND = 4e-3


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def build(recipe: hfp.Recipe, joined: bool = True) -> hfp.GroupedLinear:
    """The layer under quantized_model_init on the GPU (seed 0, BF16 weights as training holds
    them); ``joined=False``: a twin never joined."""
    torch.manual_seed(0)
    with hfp.quantized_model_init(recipe=recipe):
        m = hfp.GroupedLinear(E, D, H, bias=False, name="experts", params_dtype=torch.bfloat16,
                              device="cuda")
    if not joined:
        m.unjoin_primary()
        assert m._primary is None
    return m


def payloads(w: torch.Tensor) -> list[torch.Tensor]:
    return [t for _, _, t in primary_group._slots(w.qstorage)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def masters(seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(H, D, generator=g, device="cuda") for _ in range(E)]


def step(m: hfp.GroupedLinear, recipe: hfp.Recipe) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(output, dx, weight gradients) of one forward + backward on fixed data."""
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(sum(SPLITS), D, generator=g, device="cuda").bfloat16().requires_grad_(True)
    dy = torch.randn(sum(SPLITS), H, generator=g, device="cuda").bfloat16()
    with hfp.autocast(recipe=recipe):
        y = m(x, SPLITS)
    y.backward(dy)
    grads = [w.grad.float().clone() for w in m.weights()]
    m.zero_grad(set_to_none=True)
    return y.detach().float(), x.grad.float(), grads


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_close_step(a: hfp.GroupedLinear, b: hfp.GroupedLinear, recipe: hfp.Recipe) -> None:
    (ya, dxa, ga), (yb, dxb, gb) = step(a, recipe), step(b, recipe)
    assert rel(ya, yb) < REL_BOUND, "output"
    assert rel(dxa, dxb) < REL_BOUND, "dx"
    for i, (x, y) in enumerate(zip(ga, gb)):
        if SPLITS[i]:
            assert rel(x, y) < REL_BOUND, f"dW of expert {i}"
        else:  # no tokens routed: a zero gradient on both
            assert not x.any() and not y.any(), f"dW of empty expert {i}"


@pytest.mark.parametrize("name", sorted(JOINED))
def test_joined_on_the_gpu_and_read_by_the_gemms(name):
    m = build(JOINED[name]())
    assert m._primary is not None and m._primary.holds(m.weights())
    params = list(m.weights())
    got = m.quantized_weights(params, [p.quantizer for p in params], True)
    assert isinstance(got, GroupedTensor) and got is m._primary.group and got.joined_only


@pytest.mark.parametrize("name", sorted(JOINED))
def test_reencode_bitwise_per_expert_and_steps_close_to_the_twin(name, monkeypatch):
    recipe = JOINED[name]()
    a, b = build(recipe), build(recipe, joined=False)
    ms = masters(7)
    for w, mst in zip(b.weights(), ms):  # the per-expert reference
        w.quantizer.update_quantized(mst, w, directions=w.directions())
    with monkeypatch.context() as mp:  # the joined layer must take its grouped route
        for w in a.weights():
            mp.setattr(w.quantizer, "update_quantized", lambda *a_, **k: pytest.fail("per-expert re-encode"))
        hfp.quantize_master_weights(a.weights(), ms)
    assert a._primary.holds(a.weights())
    for i, (wa, wb) in enumerate(zip(a.weights(), b.weights())):
        for ta, tb in zip(payloads(wa), payloads(wb)):
            assert torch.equal(bits(ta), bits(tb)), f"expert {i}"
    assert_close_step(a, b, recipe)


@pytest.mark.parametrize("name", sorted(JOINED))
def test_steps_after_a_reencode_read_the_new_values(name):
    """Whatever a step cached from the joined copies (decodes, stacked views) is not served
    after the next re-encode writes them in place."""
    recipe = JOINED[name]()
    a = build(recipe)
    hfp.quantize_master_weights(a.weights(), masters(21))
    y_old, _, _ = step(a, recipe)
    hfp.quantize_master_weights(a.weights(), masters(22))
    fresh = build(recipe, joined=False)
    hfp.quantize_master_weights(fresh.weights(), masters(22))
    assert_close_step(a, fresh, recipe)
    y_new, _, _ = step(a, recipe)
    assert rel(y_new, y_old) > 0.5  # different masters: the new step did not read the old codes


def test_hybrid_whose_cuts_hold_their_own_amax_stays_per_expert():
    """NVFP4 row-scaled forward / MXFP8 backward takes the fused grouped encode on CUDA, whose
    cuts carry an amax of their own: not joined, and each expert re-encoded per expert holds
    what its quantizer encodes from its master anew."""
    from hybridfp import factories
    recipe = hfp.CustomRecipe(qfactory=factories.nvfp4_row_scaled_fwd_mxfp8_bwd)
    a = build(recipe)
    assert a._primary is None
    ms = masters(3)
    hfp.quantize_master_weights(a.weights(), ms)
    for i, (w, mst) in enumerate(zip(a.weights(), ms)):
        q = w.quantizer
        q.set_usage(rowwise=True, columnwise=True)
        fresh = q.quantize(mst)
        for d in w.directions():
            assert torch.equal(w.dequantize(torch.float32, d), fresh.dequantize(torch.float32, d)), (i, d)
    y, dx, _ = step(a, recipe)
    assert torch.isfinite(y).all() and torch.isfinite(dx).all()
