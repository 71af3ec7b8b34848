"""When and how modules call a recipe (numerics §4): once per slot at build, never per forward;
the roles they pass; what a factory may return; a recipe or factory changed between steps
takes effect at the next step (quantizers rebuilt, cached quantized weights dropped)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from recipe_cases import describe

import hybridfp as hf
from hybridfp import CustomRecipe, factories

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")


class Counting:
    """A factory that records every role it is asked about."""

    def __init__(self, inner=factories.mxfp8) -> None:
        self.inner, self.roles = inner, []

    def __call__(self, role):
        self.roles.append(role)
        return self.inner(role)

    def seen(self):
        return [(r.module_type, r.tensor_type, r.name) for r in self.roles]


def _step(model, x, recipe, *args):
    with hf.autocast(recipe=recipe):
        y = model(x, *args)
    y.float().square().mean().backward()
    return y.detach()


SLOT_ORDER = ("input", "weight", "grad_output")


# ------------------------------------------------------------------ call counts and roles
def test_linear_calls_the_factory_three_times_at_build_only():
    f = Counting()
    lin, x = hf.Linear(32, 16, name="blocks.0.fc1"), torch.randn(8, 32, requires_grad=True)
    recipe = CustomRecipe(f)
    _step(lin, x, recipe)
    assert f.seen() == [("linear", t, "blocks.0.fc1") for t in SLOT_ORDER]
    for _ in range(4):  # more steps, and several forwards in one region (micro-batches)
        with hf.autocast(recipe=recipe):
            ys = [lin(x) for _ in range(3)]
        sum(y.sum() for y in ys).backward()
    assert len(f.roles) == 3
    assert {s: [str(r) for r in rs] for s, rs in lin.quantizer_roles().items()} == {
        t: [f"blocks.0.fc1.{t}"] for t in SLOT_ORDER}


def test_a_fresh_custom_recipe_with_the_same_factory_does_not_rebuild():
    """Users often write ``autocast(recipe=CustomRecipe(f))`` inside the loop."""
    f = Counting()
    lin, x = hf.Linear(32, 16), torch.randn(8, 32)
    for _ in range(3):
        _step(lin, x, CustomRecipe(f))
    assert len(f.roles) == 3


def test_equal_per_gemm_instances_do_not_rebuild():
    lin, x = hf.Linear(32, 16), torch.randn(8, 32)
    _step(lin, x, CustomRecipe(factories.per_gemm("mxfp8", "nvfp4", "bf16")))
    built = lin._quantizers
    _step(lin, x, CustomRecipe(factories.per_gemm("mxfp8", "nvfp4", "bf16")))
    assert lin._quantizers is built
    _step(lin, x, CustomRecipe(factories.per_gemm("mxfp8", "nvfp4", "mxfp8")))
    assert lin._quantizers is not built


@pytest.mark.parametrize("num_gemms", [1, 3])
def test_grouped_linear_calls_three_times_per_expert(num_gemms):
    f = Counting()
    g = hf.GroupedLinear(num_gemms, 32, 16, name="moe.experts")
    x = torch.randn(12, 32, requires_grad=True)
    splits = [12 - 5 * (num_gemms - 1)] + [5] * (num_gemms - 1)
    for _ in range(3):
        _step(g, x, CustomRecipe(f), splits)
    assert len(f.roles) == 3 * num_gemms
    assert sorted(f.seen()) == sorted([("grouped_linear", t, "moe.experts") for t in SLOT_ORDER] * num_gemms)
    assert {s: len(rs) for s, rs in g.quantizer_roles().items()} == {t: num_gemms for t in SLOT_ORDER}


def test_layernorm_linear_roles_are_linear_roles():
    f = Counting()
    m = hf.LayerNormLinear(32, 16, name="attn.qkv")
    _step(m, torch.randn(8, 32), CustomRecipe(f))
    _step(m, torch.randn(8, 32), CustomRecipe(f))
    assert f.seen() == [("linear", t, "attn.qkv") for t in SLOT_ORDER]


def test_names_come_from_the_model():
    f = Counting()
    model = torch.nn.Sequential(hf.Linear(16, 32), torch.nn.GELU(), hf.Linear(32, 4))
    hf.set_names(model)
    _step(model, torch.randn(8, 16), CustomRecipe(f))
    assert f.seen() == [("linear", t, n) for n in ("0", "2") for t in SLOT_ORDER]


def test_mixed_model_counts_per_module_type():
    """3 per Linear, 3 * num_gemms per GroupedLinear, in one region."""
    f = Counting()

    class MoE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router_proj = hf.Linear(16, 16)
            self.experts = hf.GroupedLinear(4, 16, 16)

        def forward(self, x):
            return self.experts(self.router_proj(x), [2, 0, 3, 3])

    model = hf.set_names(MoE())
    for _ in range(2):
        _step(model, torch.randn(8, 16), CustomRecipe(f))
    counts: dict = {}
    for m, t, n in f.seen():
        counts[(m, n, t)] = counts.get((m, n, t), 0) + 1
    assert counts == {**{("linear", "router_proj", t): 1 for t in SLOT_ORDER},
                      **{("grouped_linear", "experts", t): 4 for t in SLOT_ORDER}}


# ------------------------------------------------------------------ what a factory returns
def test_factory_returning_none_says_return_identity():
    lin = hf.Linear(8, 8, name="fc")
    with pytest.raises(ValueError) as e:
        with hf.autocast(recipe=CustomRecipe(lambda role: None)):
            lin(torch.randn(2, 8))
    msg = str(e.value)
    assert "IdentityQuantizer()" in msg and "fc.input" in msg and "None" in msg


@pytest.mark.parametrize("bad", ["mxfp8", torch.float8_e4m3fn, hf.MXFP8Quantizer, 1.0])
def test_factory_returning_a_non_quantizer_is_a_type_error(bad):
    lin = hf.Linear(8, 8, name="fc")
    with pytest.raises(TypeError) as e:
        with hf.autocast(recipe=CustomRecipe(lambda role: bad)):
            lin(torch.randn(2, 8))
    assert type(bad).__name__ in str(e.value) and "Quantizer" in str(e.value)


def test_custom_recipe_needs_a_callable():
    with pytest.raises(TypeError, match="callable"):
        CustomRecipe(qfactory="mxfp8")


def test_factory_errors_leave_the_autocast_stack_clean():
    with pytest.raises(ValueError):
        with hf.autocast(recipe=CustomRecipe(lambda role: None)):
            hf.Linear(8, 8)(torch.randn(2, 8))
    assert hf.recipes.current_autocast() is None


# ------------------------------------------------------------------ changes between steps
def _types(module):
    return {s: type(qs[0]).__name__ for s, qs in module._quantizers.items()}


def test_changing_the_recipe_takes_effect_at_the_next_step():
    """DelayedScaling -> MXFP8 -> NVFP4: quantizers rebuilt; the result equals a fresh module
    run under the new recipe (so no stale cached weight was used)."""
    torch.manual_seed(0)
    lin, x = hf.Linear(64, 32), torch.randn(16, 64)
    twin = copy.deepcopy(lin)
    _step(lin, x, hf.DelayedScaling())
    assert set(_types(lin).values()) == {"Float8Quantizer"}
    y = _step(lin, x, hf.MXFP8BlockScaling())
    assert set(_types(lin).values()) == {"MXFP8Quantizer"}
    assert torch.equal(y, _step(copy.deepcopy(twin), x, hf.MXFP8BlockScaling()))
    torch.manual_seed(5)
    y = _step(lin, x, hf.NVFP4BlockScaling())
    torch.manual_seed(5)
    assert torch.equal(y, _step(copy.deepcopy(twin), x, hf.NVFP4BlockScaling()))


def test_editing_a_recipe_in_place_takes_effect():
    torch.manual_seed(0)
    lin, x = hf.Linear(64, 32), torch.randn(16, 64)
    twin = copy.deepcopy(lin)
    r = hf.Float8CurrentScaling()
    _step(lin, x, r)
    assert lin._quantizers["weight"][0].dtype == torch.float8_e4m3fn
    r.fp8_format = "E5M2"
    y = _step(lin, x, r)
    assert lin._quantizers["weight"][0].dtype == torch.float8_e5m2
    assert torch.equal(y, _step(twin, x, hf.Float8CurrentScaling(fp8_format="E5M2")))


def test_swapping_the_factory_takes_effect_at_the_next_step():
    torch.manual_seed(0)
    lin, x = hf.Linear(64, 32), torch.randn(16, 64)
    twin = copy.deepcopy(lin)
    f1, f2 = Counting(factories.mxfp8), Counting(factories.high_precision_fwd_mxfp8_bwd)
    r = CustomRecipe(f1)
    _step(lin, x, r)
    _step(lin, x, r)
    r.qfactory = f2
    y = _step(lin, x, r)
    assert (len(f1.roles), len(f2.roles)) == (3, 3)
    assert _types(lin) == {"input": "HybridQuantizer", "weight": "HybridQuantizer",
                           "grad_output": "MXFP8Quantizer"}
    assert torch.equal(y, _step(twin, x, CustomRecipe(factories.high_precision_fwd_mxfp8_bwd)))
    r.qfactory = f1  # and back
    _step(lin, x, r)
    assert len(f1.roles) == 6 and set(_types(lin).values()) == {"MXFP8Quantizer"}


def test_fresh_closures_are_told_apart():
    """A new closure built where the previous step's (freed) closure lived has the same id and
    qualname; a recipe key of id(qfactory) would keep the old quantizers. Each step here makes
    a fresh closure and drops it."""
    lin, x = hf.Linear(16, 8), torch.randn(4, 16)

    def make(kind):
        def factory(role):
            return hf.MXFP8Quantizer() if kind == "mx" else hf.IdentityQuantizer()
        return factory

    for kind in ["mx", "id", "mx", "id", "mx", "id"]:
        _step(lin, x, CustomRecipe(make(kind)))
        assert set(_types(lin).values()) == {"MXFP8Quantizer" if kind == "mx" else "IdentityQuantizer"}


def test_quantizers_carry_their_roles():
    lin = hf.Linear(16, 8, name="proj")
    _step(lin, torch.randn(4, 16), CustomRecipe(factories.mxfp8_fwd_nvfp4_bwd))
    for slot, (q,) in lin._quantizers.items():
        assert str(q.role) == f"proj.{slot}"
        assert describe(q) == describe(factories.mxfp8_fwd_nvfp4_bwd(q.role))
        if isinstance(q, hf.HybridQuantizer):  # children are labelled too (error messages)
            assert q.rowwise_quantizer.role == q.role == q.columnwise_quantizer.role


# ------------------------------------------------------------------ user-defined recipe classes
class _AllMXFP8(hf.Recipe):
    """A user recipe that is not a dataclass (Recipe.key used dataclasses.fields: TypeError)."""

    def __init__(self):
        self.calls = 0

    def quantizer(self, role):
        self.calls += 1
        return hf.MXFP8Quantizer()


def test_user_recipe_subclass_works_and_is_keyed_by_identity():
    lin, x = hf.Linear(32, 16), torch.randn(8, 32)
    r = _AllMXFP8()
    _step(lin, x, r)
    _step(lin, x, r)
    assert r.calls == 3 and set(_types(lin).values()) == {"MXFP8Quantizer"}
    r2 = _AllMXFP8()
    _step(lin, x, r2)
    assert r2.calls == 3  # another recipe object: rebuilt


def test_recipe_base_needs_quantizer():
    """Recipe is abstract: a subclass must define quantizer(role)."""
    with pytest.raises(TypeError, match="quantizer"):
        hf.Recipe()


def test_deepcopy_and_pickle_of_a_module_after_a_step():
    """A deep copy shares the factory in its recipe key (no rebuild, state copied); a module
    saved whole (torch.save pickles it; plain pickle cannot load FP8 tensors in torch 2.13)
    loads and rebuilds its quantizers at its next step."""
    f = Counting()
    lin, x = hf.Linear(32, 16), torch.randn(8, 32)
    recipe = CustomRecipe(f)
    _step(lin, x, recipe)
    twin = copy.deepcopy(lin)
    y = _step(twin, x, recipe)
    assert len(f.roles) == 3 and torch.equal(y, _step(lin, x, recipe))
    buf = io.BytesIO()
    torch.save(lin, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    y = _step(loaded, x, recipe)
    assert len(f.roles) == 6 and torch.equal(y, _step(lin, x, recipe))
