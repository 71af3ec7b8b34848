"""Quantized primary weights of a GroupedLinear held as one joined encoding (moe/primary_group.py):
the experts' Parameters become cuts of it, the GEMMs read it as it is, re-encoding from masters
is one grouped encode, and every way a Parameter can change afterwards (a write, a dropped copy,
a copied module, a partial master list) either lands in the joined copies or leaves them unused
— the results always those of a twin whose experts are never joined."""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch

import hybridfp as hfp
from hybridfp.moe import primary_group
from hybridfp.moe.grouped_tensor import GroupedTensor

E, D, H = 4, 64, 32
SPLITS = [5, 0, 19, 8]
JOINED = {"fp8_current": hfp.Float8CurrentScaling, "mxfp8": hfp.MXFP8BlockScaling}
#: tests that force a Triton path on CPU tensors run only where Triton interprets (CPU CI); on a
#: CUDA machine the kernels compile for the GPU and cannot take CPU tensors
interpreted_triton = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                        reason="forces a Triton kernel on CPU tensors: needs TRITON_INTERPRET=1")


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def build(recipe: hfp.Recipe, joined: bool = True, dtype: torch.dtype = torch.float32) -> hfp.GroupedLinear:
    """The layer under quantized_model_init (seed 0, weights of ``dtype``); ``joined=False``: a
    twin never joined."""
    torch.manual_seed(0)
    with hfp.quantized_model_init(recipe=recipe):
        m = hfp.GroupedLinear(E, D, H, bias=False, name="experts", params_dtype=dtype)
    if not joined:
        m.unjoin_primary()  # each expert its own contiguous copies again, the per-expert paths
        assert m._primary is None and all(t.is_contiguous() for w in m.weights() for t in payloads(w))
    return m


def payloads(w: torch.Tensor) -> list[torch.Tensor]:
    return [t for _, _, t in primary_group._slots(w.qstorage)]


def bits(t: torch.Tensor) -> torch.Tensor:
    """A payload tensor's bytes (scales are 0-dim; column-slice copies are strided)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same_weights(a: hfp.GroupedLinear, b: hfp.GroupedLinear) -> None:
    for i, (wa, wb) in enumerate(zip(a.weights(), b.weights())):
        assert wa.directions() == wb.directions(), i
        for ta, tb in zip(payloads(wa), payloads(wb)):
            assert torch.equal(bits(ta), bits(tb)), f"expert {i}"


def step(m: hfp.GroupedLinear, recipe: hfp.Recipe) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(output, weight gradients) of one forward + backward on fixed data."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(sum(SPLITS), D, generator=g).to(m.weights()[0].dtype)
    with hfp.autocast(recipe=recipe):
        y = m(x, SPLITS)
    y.square().sum().backward()
    grads = [w.grad.clone() for w in m.weights()]
    m.zero_grad(set_to_none=True)
    return y.detach(), grads


def assert_same_step(a: hfp.GroupedLinear, b: hfp.GroupedLinear, recipe: hfp.Recipe) -> None:
    (ya, ga), (yb, gb) = step(a, recipe), step(b, recipe)
    assert torch.equal(ya, yb)
    assert all(torch.equal(x, y) for x, y in zip(ga, gb))


def masters(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(H, D, generator=g) for _ in range(E)]


@pytest.mark.parametrize("name", sorted(JOINED))
def test_joined_at_init_and_read_by_the_gemms(name):
    m = build(JOINED[name]())
    assert m._primary is not None
    params = list(m.weights())
    assert all(isinstance(p, torch.nn.Parameter) and isinstance(p, hfp.QuantizedTensor) for p in params)
    got = m.quantized_weights(params, [p.quantizer for p in params], True)
    assert isinstance(got, GroupedTensor) and got is m._primary.group and got.joined_only
    # every expert's copies are views of the joined storage: one memory block per direction
    for d in got.directions():
        base = got.joined(d).storage.payloads[d]["data"]
        lo, hi = base.data_ptr(), base.data_ptr() + base.numel() * base.element_size()
        for p in params:
            t = p.qstorage.payloads[d]["data"]
            assert lo <= t.data_ptr() < hi


@pytest.mark.parametrize("name", sorted(JOINED))
def test_join_and_step_bitwise_the_unjoined_twin(name):
    recipe = JOINED[name]()
    a, b = build(recipe), build(recipe, joined=False)
    assert a._primary is not None and b._primary is None
    assert_same_weights(a, b)
    assert_same_step(a, b, recipe)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(JOINED))
def test_master_reencode_is_one_grouped_encode_bitwise_per_expert(name, dtype, monkeypatch):
    recipe = JOINED[name]()
    a, b = build(recipe, dtype=dtype), build(recipe, joined=False, dtype=dtype)
    assert a._primary is not None
    ms = masters(7)
    for w, mst in zip(b.weights(), ms):  # the per-expert reference
        w.quantizer.update_quantized(mst, w, directions=w.directions())
    with monkeypatch.context() as mp:  # the joined layer must not take the per-expert route
        for w in a.weights():
            mp.setattr(w.quantizer, "update_quantized", lambda *a_, **k: pytest.fail("per-expert re-encode"))
        hfp.quantize_master_weights(a.weights(), ms)
    assert a._primary.holds(a.weights())
    assert_same_weights(a, b)
    assert_same_step(a, b, recipe)


@pytest.mark.parametrize("name", sorted(JOINED))
def test_a_write_to_one_expert_reaches_the_joined_copies(name):
    recipe = JOINED[name]()
    a, b = build(recipe), build(recipe, joined=False)
    new = torch.full((H, D), 0.75)
    for m in (a, b):
        w = m.weights()[2]
        w.quantizer.update_quantized(new, w, directions=w.directions())
    assert a._primary.holds(a.weights())
    joined = a._primary.group.experts()[2].dequantize()
    assert torch.equal(joined, b.weights()[2].dequantize())
    assert_same_step(a, b, recipe)


def test_partial_master_list_and_dropped_copy_leave_the_joined_copies_unused():
    recipe = hfp.Float8CurrentScaling()
    a, b = build(recipe), build(recipe, joined=False)
    ms = masters(11)
    # two experts' masters only: the per-expert route, still into the joined views
    hfp.quantize_master_weights(a.weights()[:2], ms[:2])
    hfp.quantize_master_weights(b.weights()[:2], ms[:2])
    assert a._primary.holds(a.weights())
    assert_same_weights(a, b)
    # a dropped columnwise copy: the group no longer holds its Parameters as joined
    for m in (a, b):
        m.weights()[1].update_usage(columnwise_usage=False)
    assert not a._primary.holds(a.weights())
    with torch.no_grad(), hfp.autocast(recipe=recipe):
        x = torch.randn(sum(SPLITS), D)
        assert torch.equal(a(x, SPLITS), b(x, SPLITS))


def test_a_copied_module_is_its_own():
    recipe = hfp.Float8CurrentScaling()
    a = build(recipe)
    c = copy.deepcopy(a)
    assert_same_step(a, c, recipe)
    hfp.quantize_master_weights(c.weights(), masters(5))
    ref = build(recipe, joined=False)
    assert_same_weights(a, ref)  # the original untouched by the copy's re-encode
    assert_same_step(a, ref, recipe)
    twin = build(recipe, joined=False)
    hfp.quantize_master_weights(twin.weights(), masters(5))
    assert_same_weights(c, twin)
    assert_same_step(c, twin, recipe)


def test_master_shape_mismatch_named():
    a = build(hfp.Float8CurrentScaling())
    ms = masters(1)
    ms[3] = torch.zeros(H, D + 1)
    with pytest.raises(ValueError, match="expert 3 has shape"):
        hfp.quantize_master_weights(a.weights(), ms)


def test_formats_without_joined_copies_stay_per_expert():
    for recipe in (hfp.DelayedScaling(), hfp.Float8BlockScaling()):
        m = build(recipe)
        assert m._primary is None
        params = list(m.weights())
        assert not isinstance(m.quantized_weights(params, [p.quantizer for p in params], True), GroupedTensor)


def test_a_moved_module_is_joined_again():
    recipe = hfp.Float8CurrentScaling()
    a, ref = build(recipe), build(recipe, joined=False)
    a.cpu()  # every Parameter moved (its buffers may be new): joined again, the same values
    assert a._primary is not None and a._primary.holds(a.weights())
    assert_same_weights(a, ref)
    assert_same_step(a, ref, recipe)


def test_a_loaded_state_dict_keeps_the_joined_copies_true():
    recipe = hfp.Float8CurrentScaling()
    a, src = build(recipe), build(recipe, joined=False)
    hfp.quantize_master_weights(src.weights(), masters(9))
    a.load_state_dict(src.state_dict())  # copied into the Parameters' views in place
    assert a._primary.holds(a.weights())
    assert_same_weights(a, src)
    assert_same_step(a, src, recipe)


@pytest.mark.parametrize("write", ["load_state_dict", "copy_", "nn.init"])
@pytest.mark.parametrize("joined", [True, False])
def test_a_write_after_a_forward_is_what_the_next_forward_reads(joined, write, monkeypatch):
    """On the grouped BF16 route (MXFP8 on Hopper) a forward caches the weights' BF16 decodes,
    keyed on their payloads' versions: a write made through the Parameters afterwards (a loaded
    checkpoint, a copy, a fresh initialisation) must reach the next forward."""
    from hybridfp.moe import gemm as grouped
    monkeypatch.setattr(grouped, "_grouped_mm_device", lambda device: True)
    recipe = hfp.MXFP8BlockScaling()
    a, src = build(recipe, joined, torch.bfloat16), build(recipe, False, torch.bfloat16)
    x = torch.randn(sum(SPLITS), D, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)

    def forward(m: hfp.GroupedLinear) -> torch.Tensor:
        with torch.no_grad(), hfp.autocast(recipe=recipe):
            return m(x, SPLITS)

    before = forward(a)  # caches the decodes
    with torch.no_grad():
        if write == "load_state_dict":
            hfp.quantize_master_weights(src.weights(), masters(9))
            a.load_state_dict(src.state_dict())
        elif write == "copy_":
            for w, v in zip(a.weights(), masters(9)):
                w.copy_(v)
            hfp.quantize_master_weights(src.weights(), masters(9))
        else:
            for m in (a, src):  # the same draws for both
                torch.manual_seed(5)
                for w in m.weights():
                    torch.nn.init.normal_(w, std=0.02)
    want = forward(src)  # src never ran a forward before its weights were written
    assert not torch.equal(want, before)
    assert torch.equal(forward(a), want)


def test_a_dead_module_leaves_no_owner_entry():
    import gc
    gc.collect()  # modules of earlier tests
    before = len(primary_group._OWNERS)
    m = build(hfp.Float8CurrentScaling())
    assert len(primary_group._OWNERS) == before + E
    del m
    gc.collect()
    assert len(primary_group._OWNERS) == before


def test_fsdp_quantized_all_gather_takes_the_experts_unjoined():
    m = build(hfp.Float8CurrentScaling())
    ref = build(hfp.Float8CurrentScaling(), joined=False)
    before = list(m.weights())
    assert hfp.enable_quantized_all_gather(m) == E
    assert m._primary is None
    # each expert handed over with its own contiguous copies, its values unchanged
    for w, r in zip(before, ref.weights()):
        assert all(t.is_contiguous() for t in payloads(w))
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(payloads(w), payloads(r)))


def test_built_on_the_meta_device_joined_once_materialized():
    recipe = hfp.Float8CurrentScaling()
    with hfp.quantized_model_init(recipe=recipe):
        m = hfp.GroupedLinear(E, D, H, bias=False, device="meta")
    assert m._primary is None  # nothing to join yet
    m.to_empty(device="cpu")
    assert m._primary is not None and m._primary.holds(m.weights())
    ref = build(recipe, joined=False)
    ms = masters(4)
    hfp.quantize_master_weights(m.weights(), ms)  # the values a materialized model is given
    hfp.quantize_master_weights(ref.weights(), ms)
    assert_same_weights(m, ref)
    assert_same_step(m, ref, recipe)


@pytest.mark.parametrize("name", sorted(JOINED))
def test_steps_between_reencodes_read_the_new_values(name):
    """A step, a re-encode, a step: whatever the first step cached (decodes keyed by the
    payloads' version counters) is not served to the second (the joined copies are written in
    place, the same objects every step)."""
    recipe = JOINED[name]()
    a, b = build(recipe), build(recipe, joined=False)
    for seed in (21, 22):
        assert_same_step(a, b, recipe)
        ms = masters(seed)
        hfp.quantize_master_weights(a.weights(), ms)
        hfp.quantize_master_weights(b.weights(), ms)
        assert_same_weights(a, b)
    ya, _ = step(a, recipe)
    fresh = build(recipe, joined=False)
    hfp.quantize_master_weights(fresh.weights(), masters(22))
    yf, _ = step(fresh, recipe)
    assert torch.equal(ya, yf)  # the last masters' values, not an earlier step's


@interpreted_triton
def test_a_hybrid_whose_cuts_hold_their_own_amax_is_not_joined(monkeypatch):
    """NVFP4 row-scaled forward / MXFP8 backward through the fused grouped encode (forced here as
    on CUDA): the experts' cuts carry a per-expert amax stacked anew, not a view of the joined
    rows' amax, so a write through a Parameter would not reach what the GEMMs read. Not joined;
    the per-expert route gives the unjoined results."""
    import hybridfp.moe.quantize as grouped_quantize
    from hybridfp import factories
    monkeypatch.setattr(grouped_quantize, "fused_nvfp4_mxfp8_supported", lambda hq, x: True)
    recipe = hfp.CustomRecipe(qfactory=factories.nvfp4_row_scaled_fwd_mxfp8_bwd)
    a = build(recipe)
    assert a._primary is None
    ref = build(recipe)
    ms = masters(3)
    hfp.quantize_master_weights(a.weights(), ms)
    hfp.quantize_master_weights(ref.weights(), ms)
    assert_same_weights(a, ref)


def test_reencode_leaves_the_shared_scale_constant_alone():
    """FP8 current scaling's joined codes are read with a shared constant scale_inv of 1; a
    re-encode writes the per-expert scales, never that constant (made under inference mode by an
    earlier evaluation here, where a write would raise)."""
    recipe = hfp.Float8CurrentScaling()
    ev = hfp.GroupedLinear(E, D, H, bias=False, name="eval")
    with torch.inference_mode(), hfp.autocast(recipe=recipe):
        ev(torch.randn(sum(SPLITS), D), SPLITS)
    a, ref = build(recipe), build(recipe, joined=False)
    ms = masters(8)
    hfp.quantize_master_weights(a.weights(), ms)
    hfp.quantize_master_weights(ref.weights(), ms)
    assert_same_weights(a, ref)


def test_joined_parameters_can_be_swapped():
    """No weak reference is held to a Parameter (torch.utils.swap_tensors refuses those): a
    swapped-in value is read, through the per-expert route."""
    recipe = hfp.Float8CurrentScaling()
    a, twin, src = build(recipe), build(recipe, joined=False), build(recipe, joined=False)
    hfp.quantize_master_weights(a.weights(), masters(7))
    hfp.quantize_master_weights(twin.weights(), masters(7))
    hfp.quantize_master_weights(src.weights(), masters(6))
    torch.utils.swap_tensors(a.weights()[1], copy.deepcopy(src.weights()[1]))
    torch.utils.swap_tensors(twin.weights()[1], copy.deepcopy(src.weights()[1]))
    assert not a._primary.holds(a.weights())
    assert_same_step(a, twin, recipe)


def test_moving_a_layer_that_cannot_join_leaves_its_quantizer_state():
    """Delayed scaling keeps an amax history: a layer of it is never joined, and a move or a
    load does not encode anything through its quantizers (no amax recorded)."""
    recipe = hfp.DelayedScaling()
    a = build(recipe)
    assert a._primary is None and not a._join_wanted
    step(a, recipe)
    qs = [w.quantizer for w in a.weights()]
    before = [(q.amax_history.clone(), q._recorded, q.state_version()) for q in qs]
    a.cpu()
    a.load_state_dict(a.state_dict())
    after = [(q.amax_history, q._recorded, q.state_version()) for q in qs]
    for (h0, r0, v0), (h1, r1, v1) in zip(before, after):
        assert torch.equal(h0, h1) and r0 == r1 and v0 == v1


@interpreted_triton
def test_fp8_kernel_path_joins_and_reencodes_bitwise(monkeypatch):
    """The grouped FP8 Triton kernels (the CUDA route, run by the interpreter here) build the
    same joined layout: joined, and a re-encode through them is bitwise the per-expert reference."""
    import hybridfp.moe.quantize_scaled as quantize_scaled
    recipe = hfp.Float8CurrentScaling()
    ref = build(recipe, joined=False, dtype=torch.bfloat16)
    ms = masters(12)
    hfp.quantize_master_weights(ref.weights(), ms)
    monkeypatch.setattr(quantize_scaled, "select_quantize_kernel", lambda q, x, rowwise, columnwise: True)
    a = build(recipe, dtype=torch.bfloat16)
    assert a._primary is not None
    hfp.quantize_master_weights(a.weights(), ms)
    assert_same_weights(a, ref)


def test_stacked_view_only_for_tensors_lying_one_after_another():
    buf = torch.randn(E, H, D)
    rows = list(buf.unbind(0))
    v = primary_group.stacked_view(rows)
    assert v is not None and v.data_ptr() == buf.data_ptr() and torch.equal(v, buf)
    assert primary_group.stacked_view(rows[::-1]) is None  # out of order
    assert primary_group.stacked_view(rows[1:] + rows[:1]) is None
    assert primary_group.stacked_view([r.clone() for r in rows]) is None  # separate memory
    assert primary_group.stacked_view(list(torch.randn(E, D, H).transpose(1, 2).unbind(0))) is None  # strided
    assert primary_group.stacked_view(list(torch.randn(E, H, D + 1)[..., :D].unbind(0))) is None  # gaps
    assert primary_group.stacked_view([]) is None


@pytest.mark.parametrize("name", sorted(JOINED))
def test_optimizer_packs_joined_masters_and_the_reencode_reads_them_in_place(name, monkeypatch):
    """MasterWeightOptimizer gives a joined layer's masters one [E, N, K] buffer: the re-encode
    stacks nothing, and training stays bitwise an unjoined twin's (separate masters)."""
    recipe = JOINED[name]()
    a, b = build(recipe), build(recipe, joined=False)
    oa = hfp.MasterWeightOptimizer(torch.optim.AdamW, a.parameters(), lr=1e-2)
    ob = hfp.MasterWeightOptimizer(torch.optim.AdamW, b.parameters(), lr=1e-2)
    ma = [oa.master_of(w) for w in a.weights()]
    assert primary_group.stacked_view(ma) is not None
    assert all(isinstance(m, torch.nn.Parameter) and m.is_leaf for m in ma)
    assert primary_group.stacked_view([ob.master_of(w) for w in b.weights()]) is None
    views = []  # each re-encode's view of the masters: None would mean they were stacked
    real_view = primary_group.stacked_view
    monkeypatch.setattr(primary_group, "stacked_view", lambda ts: views.append(real_view(ts)) or views[-1])
    for _ in range(2):
        for m, opt in ((a, oa), (b, ob)):
            _, grads = step(m, recipe)  # step() clears the gradients: given back for the optimizer
            for w, g in zip(m.weights(), grads):
                w.grad = g
            opt.step()
            opt.zero_grad()
        assert a._primary.holds(a.weights())
        assert_same_weights(a, b)
    assert len(views) == 2 and all(v is not None for v in views)
    monkeypatch.undo()
    # a loaded optimizer state copies into the packed masters in place
    state = ob.state_dict()
    oa.load_state_dict(state)
    assert primary_group.stacked_view([oa.master_of(w) for w in a.weights()]) is not None
    assert all(torch.equal(oa.master_of(w), ob.master_of(v)) for w, v in zip(a.weights(), b.weights()))


def test_a_saved_expert_is_a_view_and_its_clone_holds_its_own_values():
    """An expert's Parameter views the joined block, and torch.save of a view writes its whole
    memory block (as for any torch view: the layer's other experts ride along); its clone()
    holds its own elements alone and loads (weights_only) as its value. A whole state dict
    writes each block once and loads back joined."""
    import io
    recipe = hfp.Float8CurrentScaling()
    a = build(recipe)
    hfp.quantize_master_weights(a.weights(), masters(2))

    def saved(obj) -> io.BytesIO:
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        return buf

    view, alone, whole = saved(a.weights()[1]), saved(a.weights()[1].detach().clone()), saved(a.state_dict())
    assert alone.getbuffer().nbytes < 0.5 * view.getbuffer().nbytes  # 1 of 4 experts, plus headers
    assert view.getbuffer().nbytes <= whole.getbuffer().nbytes
    w = torch.load(alone, weights_only=True)
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in payloads(w))
    assert torch.equal(w.dequantize(), a.weights()[1].dequantize())
    b = build(recipe)
    b.load_state_dict(torch.load(whole, weights_only=True))
    assert b._primary.holds(b.weights())
    assert_same_weights(a, b)
    assert_same_step(a, b, recipe)


def test_joined_mxfp8_weights_are_decoded_once_a_step_on_the_bf16_route(monkeypatch):
    """Hopper's MXFP8 GEMMs read the joined codes through their BF16 decodes (the route forced
    here as on CUDA), cached while the codes are unchanged: one decode a direction a step, however
    many micro-batches, and a new one after each re-encode (never the last step's values)."""
    from hybridfp.gemm import bf16_decode
    from hybridfp.moe import gemm as grouped
    monkeypatch.setattr(grouped, "_grouped_mm_device", lambda device: True)
    recipe = hfp.MXFP8BlockScaling()
    a = build(recipe, dtype=torch.bfloat16)
    group = a._primary.group
    weight_data = {group.joined(d).storage.payload(d)["data"].data_ptr(): d for d in group.directions()}
    decoded: list[str] = []
    real = bf16_decode._run

    def spy(decoder, s, direction):
        if weight_data.get(s.payload(direction)["data"].data_ptr()) == direction:
            decoded.append(direction)
        return real(decoder, s, direction)

    monkeypatch.setattr(bf16_decode, "_run", spy)
    x = torch.randn(sum(SPLITS), D, dtype=torch.bfloat16)
    outs = []
    for seed in (31, 32, 31):
        decoded.clear()
        hfp.quantize_master_weights(a.weights(), masters(seed))
        with torch.no_grad(), hfp.autocast(recipe=recipe):
            ys = [a(x, SPLITS) for _ in range(3)]  # three micro-batches of one step
        with hfp.autocast(recipe=recipe):
            a(x.requires_grad_(), SPLITS).sum().backward()  # a dgrad reads the columnwise copy
        x = x.detach()
        assert sorted(decoded) == ["columnwise", "rowwise"], decoded
        assert all(torch.equal(y, ys[0]) for y in ys)
        outs.append(ys[0])
    assert not torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
