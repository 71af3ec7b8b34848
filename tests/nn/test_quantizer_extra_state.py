"""Quantizer state (delayed scaling's amax history and scale) travels in ``state_dict`` as each
module's extra state: tensors and plain values, restored bitwise through ``torch.save`` /
``torch.load(weights_only=True)`` and through ``torch.distributed.checkpoint``.

The resumed step is compared bitwise with the uninterrupted one: same process, same inputs,
same operations in the same order on both sides."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import hybridfp as hf
from hybridfp import Float8Quantizer, HybridQuantizer, MXFP8Quantizer

pytestmark = [
    pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning"),
    # DCP without a process group says it assumes a single process: that is the case tested
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]


def _delayed_hybrid_mx(role):
    """Delayed-scaling rowwise copies, MXFP8 columnwise: a hybrid with one stateful child."""
    return HybridQuantizer(Float8Quantizer(amax_history_len=4), MXFP8Quantizer())


RECIPES = {
    "delayed": lambda: hf.DelayedScaling(amax_history_len=4),
    "hybrid_delayed_mxfp8": lambda: hf.CustomRecipe(qfactory=_delayed_hybrid_mx),
}


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = hf.Linear(32, 64, name="fc1")
        self.fc2 = hf.Linear(64, 32, name="fc2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _inputs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    scale = 2.0 ** (step % 3)  # amaxes move from step to step: the scales do too
    return torch.randn(8, 32, generator=g) * scale, torch.randn(8, 32, generator=g)


def _step(model: nn.Module, recipe, step: int) -> list[torch.Tensor]:
    x, dy = _inputs(step)
    x.requires_grad_()
    with hf.autocast(recipe=recipe):
        y = model(x)
    y.backward(dy)
    out = [y.detach(), x.grad] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return out


def _fresh(seed: int = 1) -> _MLP:
    torch.manual_seed(seed)
    return _MLP()


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert torch.equal(u, v), f"output {i} differs"


def _torch_roundtrip(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ---------------------------------------------------------------- quantizer get_state / set_state
def test_float8_quantizer_state_roundtrip_bitwise():
    q = Float8Quantizer(amax_history_len=4)
    for s in range(3):
        q(_inputs(s)[0])
        q.finish_step()
    q(_inputs(3)[0])  # a pending amax, not yet committed
    state = q.get_state()
    assert set(state) == {"amax_history", "scale", "updates", "recorded"}
    r = Float8Quantizer(amax_history_len=4)
    r.set_state(state)
    for a, b in ((q.amax_history, r.amax_history), (q.scale, r.scale)):
        assert torch.equal(a, b)
    assert r.state_version() == q.state_version() == 3
    q.finish_step()
    r.finish_step()
    assert torch.equal(q.scale, r.scale) and torch.equal(q.amax_history, r.amax_history)
    x = _inputs(4)[0]
    assert torch.equal(q(x).dequantize(), r(x).dequantize())


def test_get_state_returns_copies():
    q = Float8Quantizer(amax_history_len=4)
    state = q.get_state()
    state["scale"].fill_(3.0)
    assert q.scale.item() == 1.0


@pytest.mark.parametrize("edit,match", [
    (lambda s: s.pop("scale"), r"missing keys \['scale'\]"),
    (lambda s: s.update(extra=1), r"unexpected keys \['extra'\]"),
    (lambda s: s.update(amax_history=torch.zeros(8)), r"amax_history.*shape \(4,\)"),
    (lambda s: s.update(scale=torch.ones((), dtype=torch.float64)), r"scale.*float32"),
    (lambda s: s.update(updates=2.0), r"updates.*int"),
])
def test_set_state_rejects_mismatches(edit, match):
    q = Float8Quantizer(amax_history_len=4)
    state = q.get_state()
    edit(state)
    with pytest.raises(ValueError, match=match):
        Float8Quantizer(amax_history_len=4).set_state(state)


def test_stateless_quantizer_state_is_empty():
    q = MXFP8Quantizer()
    assert q.get_state() == {}
    q.set_state({})
    with pytest.raises(ValueError, match="unexpected keys"):
        q.set_state({"scale": torch.ones(())})


def test_hybrid_state_prefixes_children():
    h = _delayed_hybrid_mx(None)
    h(_inputs(0)[0])
    h.finish_step()
    state = h.get_state()
    assert set(state) == {f"rowwise.{k}" for k in ("amax_history", "scale", "updates", "recorded")}
    r = _delayed_hybrid_mx(None)
    r.set_state(state)
    assert torch.equal(r.rowwise_quantizer.scale, h.rowwise_quantizer.scale)
    with pytest.raises(ValueError, match="unexpected keys"):
        r.set_state({"other.scale": torch.ones(())})


# ---------------------------------------------------------------- modules: torch.save / torch.load
@pytest.mark.parametrize("name", RECIPES)
def test_torch_save_load_resumes_bitwise(name):
    recipe = RECIPES[name]()
    model = _fresh()
    for s in range(3):
        _step(model, recipe, s)
    sd = _torch_roundtrip(model.state_dict())
    resumed = _fresh(seed=2)  # other weights, fresh quantizers: everything comes from sd
    resumed.load_state_dict(sd)
    for s in (3, 4):
        _assert_same(_step(resumed, recipe, s), _step(model, recipe, s))


def test_extra_state_is_tensors_and_plain_data():
    recipe = RECIPES["delayed"]()
    model = _fresh()
    _step(model, recipe, 0)
    extra = model.state_dict()["fc1._extra_state"]

    def leaves(obj):
        if isinstance(obj, dict):
            assert all(isinstance(k, str) for k in obj)
            for v in obj.values():
                yield from leaves(v)
        else:
            yield obj

    assert all(isinstance(v, (torch.Tensor, int, float, bool, str)) for v in leaves(extra))
    assert any(isinstance(v, torch.Tensor) for v in leaves(extra))


def test_load_into_a_module_that_already_ran_replaces_its_quantizers():
    recipe = RECIPES["delayed"]()
    model, other = _fresh(), _fresh(seed=2)
    for s in range(3):
        _step(model, recipe, s)
    _step(other, recipe, 0)
    other.load_state_dict(_torch_roundtrip(model.state_dict()))
    # saved again before any forward: the loaded state, not the replaced quantizers'
    sd = other.state_dict()
    for slot in ("input", "weight", "grad_output"):
        got = sd["fc1._extra_state"]["quantizers"][f"{slot}.0"]["state"]
        want = model.fc1._quantizers[slot][0]
        assert torch.equal(got["scale"], want.scale) and torch.equal(got["amax_history"], want.amax_history)
    _assert_same(_step(other, recipe, 3), _step(model, recipe, 3))


@pytest.mark.parametrize("first", ["delayed", "current"])
def test_loaded_state_survives_a_rebuild_before_the_next_forward(first):
    """A module that ran under another recipe, or whose next forward rebuilds its quantizers (a
    changed policy), still resumes from the loaded state."""
    recipe = RECIPES["delayed"]()
    model = _fresh()
    for s in range(3):
        _step(model, recipe, s)
    other = _fresh(seed=2)
    _step(other, recipe if first == "delayed" else hf.Float8CurrentScaling(), 0)
    other.load_state_dict(_torch_roundtrip(model.state_dict()))
    with hf.policy(decoded_copies="never"):  # a key change: other rebuilds its quantizers
        got = _step(other, recipe, 3)
    # FP8 per-tensor copies are never held decoded: the policy changes no number, and model
    # keeps its quantizers
    _assert_same(got, _step(model, recipe, 3))


def test_loading_an_unbuilt_state_drops_the_built_quantizers():
    """A state saved before its module ran replaces what the module had built; a trained state
    loaded after it is then applied, not lost."""
    recipe = RECIPES["delayed"]()
    trained = _fresh()
    for s in range(3):
        _step(trained, recipe, s)
    other = _fresh(seed=2)
    _step(other, recipe, 0)
    other.load_state_dict(_torch_roundtrip(_fresh(seed=5).state_dict()))
    assert other.fc1.get_extra_state() == {"version": 1, "built": False}
    other.load_state_dict(_torch_roundtrip(trained.state_dict()))
    _assert_same(_step(other, recipe, 3), _step(trained, recipe, 3))


def test_module_that_never_ran_roundtrips():
    model = _fresh()
    sd = _torch_roundtrip(model.state_dict())
    assert "fc1._extra_state" in sd
    other = _fresh(seed=2)
    other.load_state_dict(sd)
    _assert_same(_step(other, RECIPES["delayed"](), 0), _step(model, RECIPES["delayed"](), 0))
    # a state loaded but not yet applied (no forward since) is saved again as it was loaded
    trained = _fresh()
    _step(trained, RECIPES["delayed"](), 0)
    again = _fresh(seed=3)
    again.load_state_dict(_torch_roundtrip(trained.state_dict()))
    third = _fresh(seed=4)
    third.load_state_dict(_torch_roundtrip(again.state_dict()))
    _assert_same(_step(third, RECIPES["delayed"](), 1), _step(trained, RECIPES["delayed"](), 1))


def test_plain_pytorch_state_dict_still_loads():
    torch.manual_seed(0)
    plain = nn.Linear(32, 64)
    lin = hf.Linear(32, 64)
    lin.load_state_dict(plain.state_dict())  # strict: no quantizer state is needed
    assert torch.equal(lin.weight, plain.weight)


def test_state_saved_under_another_recipe_is_refused():
    model = _fresh()
    _step(model, RECIPES["delayed"](), 0)
    other = _fresh(seed=2)
    other.load_state_dict(_torch_roundtrip(model.state_dict()))
    with pytest.raises(ValueError, match=r"fc1.*'input'.*Float8Quantizer.*MXFP8Quantizer"):
        _step(other, hf.MXFP8BlockScaling(), 1)


def test_history_length_mismatch_names_module_and_slot():
    model = _fresh()
    _step(model, RECIPES["delayed"](), 0)
    other = _fresh(seed=2)
    other.load_state_dict(_torch_roundtrip(model.state_dict()))
    with pytest.raises(ValueError, match=r"fc1.*'input'.*amax_history"):
        _step(other, hf.DelayedScaling(amax_history_len=8), 1)


def test_grouped_linear_resumes_bitwise():
    recipe = RECIPES["delayed"]()
    splits = [3, 5, 0, 4]

    def make(seed):
        torch.manual_seed(seed)
        return hf.GroupedLinear(4, 16, 8, name="experts")

    def step(m, s):
        g = torch.Generator().manual_seed(s)
        x = (torch.randn(12, 16, generator=g) * 2.0 ** (s % 3)).requires_grad_()
        with hf.autocast(recipe=recipe):
            y = m(x, splits)
        y.backward(torch.randn(12, 8, generator=g))
        out = [y.detach(), x.grad] + [p.grad.clone() for p in m.parameters()]
        m.zero_grad()
        return out

    model = make(1)
    for s in range(3):
        step(model, s)
    extra = model.state_dict()["_extra_state"]
    assert len(extra["quantizers"]) == 3 * 4  # one entry per slot and expert
    resumed = make(2)
    resumed.load_state_dict(_torch_roundtrip(model.state_dict()))
    for s in (3, 4):
        _assert_same(step(resumed, s), step(model, s))


# ---------------------------------------------------------------- torch.distributed.checkpoint
def _dcp():
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    return dcp


@pytest.mark.parametrize("name", RECIPES)
def test_distributed_checkpoint_resumes_bitwise(name, tmp_path):
    dcp = _dcp()
    recipe = RECIPES[name]()
    model = _fresh()
    for s in range(3):
        _step(model, recipe, s)
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path))
    resumed = _fresh(seed=2)
    reference = copy.deepcopy(model)
    # DCP loads into the target's own state_dict: its quantizers must exist (one step builds
    # them; everything it changed is then overwritten)
    _step(resumed, recipe, 0)
    sd = resumed.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path))
    resumed.load_state_dict(sd)
    for s in (3, 4):
        _assert_same(_step(resumed, recipe, s), _step(reference, recipe, s))


def test_distributed_checkpoint_into_unbuilt_module_is_refused(tmp_path):
    dcp = _dcp()
    recipe = RECIPES["delayed"]()
    model = _fresh()
    _step(model, recipe, 0)
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path))
    target = _fresh(seed=2)
    sd = target.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path))
    with pytest.raises(ValueError, match=r"fc1.*(one forward|built)"):
        target.load_state_dict(sd)


def _held_state(m) -> dict:
    return m.held_weight_quantizers()[0].get_state()


@pytest.mark.parametrize("target", ["fresh", "trained"])
def test_a_module_that_never_ran_saves_its_held_weight_quantizer_state(target):
    """quantized_model_init's encode recorded the weight's amax in its delayed-scaling
    quantizer: a module saved before it ran carries that state, and a module loading it (one
    that trained since, too) continues as the saved one: same scale after the same region."""
    recipe = hf.DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    with hf.quantized_model_init(recipe=recipe):
        saved = hf.Linear(64, 64, bias=False)
    state = saved.get_extra_state()
    assert state["built"] is False and set(state["held"]) == {"weight.0"}
    sd = _roundtrip(saved.state_dict())
    torch.manual_seed(1)
    with hf.quantized_model_init(recipe=recipe):
        other = hf.Linear(64, 64, bias=False)
    if target == "trained":
        for _ in range(3):
            with hf.autocast(recipe=recipe):
                other(torch.randn(8, 64) * 100)
    other.load_state_dict(sd)
    for k, v in _held_state(saved).items():
        assert torch.equal(v, _held_state(other)[k]) if torch.is_tensor(v) else v == _held_state(other)[k], k
    x = torch.randn(8, 64)
    for m in (saved, other):
        with hf.autocast(recipe=recipe):
            m(x)
    a = saved.get_extra_state()["quantizers"]["weight.0"]["state"]
    b = other.get_extra_state()["quantizers"]["weight.0"]["state"]
    assert torch.equal(a["scale"], b["scale"]) and torch.equal(a["amax_history"], b["amax_history"])


def test_a_held_state_loads_into_a_high_precision_module_as_fresh_quantizers():
    recipe = hf.DelayedScaling(amax_history_len=4)
    with hf.quantized_model_init(recipe=recipe):
        saved = hf.Linear(64, 64, bias=False)
    plain = hf.Linear(64, 64, bias=False)
    plain.set_extra_state(saved.get_extra_state())
    assert plain.get_extra_state() == {"version": 1, "built": False}


def test_a_malformed_held_state_is_named():
    with hf.quantized_model_init(recipe=hf.DelayedScaling()):
        m = hf.Linear(64, 64, bias=False)
    with pytest.raises(ValueError, match="'held' is not a dict"):
        m.set_extra_state({"version": 1, "built": False, "held": [1]})
    with pytest.raises(ValueError, match="weight quantizer states for"):
        m.set_extra_state({"version": 1, "built": False, "held": {"weight.3": {}}})


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)
