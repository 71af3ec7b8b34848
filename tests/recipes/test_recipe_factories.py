"""Built-in and zoo factories (numerics §5): what each returns per role, parity of the base
factories with the built-in recipes (settings and bitwise Linear results), per_gemm's
mapping (numerics §1), errors, pickling and equality."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from recipe_cases import (BUILTIN, E4M3, E5M2, NV_1D, NV_GRAD, NV_INPUT, ROLES, base_expected,
                          describe, fp8_block, fp8_current, fp8_delayed, hybrid, identity, mxfp8,
                          role_id, zoo_expected)

import hybridfp as hf
from hybridfp import CustomRecipe, QuantizerRole, factories
from hybridfp.factories import BASE, FORMAT_NAMES, ZOO, per_gemm
from hybridfp.tensors import COLUMNWISE, ROWWISE

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")


def _all_quantizers(q):
    """q and, for a hybrid, its two children."""
    if isinstance(q, hf.HybridQuantizer):
        return [q, q.rowwise_quantizer, q.columnwise_quantizer]
    return [q]


# ------------------------------------------------------------------ what each factory returns
@pytest.mark.parametrize("role", ROLES, ids=role_id)
@pytest.mark.parametrize("name", sorted(BASE))
def test_base_factory_settings(name, role):
    q = BASE[name](role)
    assert describe(q) == base_expected(name, role)
    assert q.rowwise_usage and q.columnwise_usage


@pytest.mark.parametrize("role", ROLES, ids=role_id)
@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_base_factory_equals_builtin_recipe_quantizer(name, role):
    assert describe(BASE[name](role)) == describe(BUILTIN[name]().quantizer(role))


@pytest.mark.parametrize("role", ROLES, ids=role_id)
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_factory_settings(name, role):
    q = ZOO[name](role)
    assert describe(q) == zoo_expected(name, role)
    assert q.rowwise_usage and q.columnwise_usage


@pytest.mark.parametrize("name", sorted({**BASE, **ZOO}))
def test_each_call_returns_fresh_quantizers(name):
    """Every slot owns its quantizer (usage flags, delayed-scaling state): no sharing."""
    role = QuantizerRole("linear", "input", "fc")
    a, b = BASE.get(name, ZOO.get(name))(role), BASE.get(name, ZOO.get(name))(role)
    ids_a, ids_b = {id(q) for q in _all_quantizers(a)}, {id(q) for q in _all_quantizers(b)}
    assert not ids_a & ids_b


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_docstrings_say_unvalidated_and_why(name):
    doc = ZOO[name].__doc__ or ""
    assert "unvalidated" in doc.lower()
    assert "motivat" in doc.lower()  # "Motivation: ..." or "motivates"
    assert len(doc.split()) > 20


@pytest.mark.parametrize("name", sorted(BASE))
def test_base_docstrings_exist(name):
    assert (BASE[name].__doc__ or "").strip()


def test_public_factory_names():
    assert set(BASE) == {"high_precision", "bf16", "delayed_scaling", "current_scaling",
                         "float8_block_scaling", "mxfp8", "nvfp4"}
    assert set(ZOO) == {"high_precision_fwd_mxfp8_bwd", "mxfp8_fwd_nvfp4_bwd", "nvfp4_1d_weight",
                        "mxfp8_fwd_high_precision_bwd", "nvfp4_row_scaled_fwd_mxfp8_bwd",
                        "nvfp4_row_scaled_fwd_high_precision_bwd"}
    for name, f in {**BASE, **ZOO}.items():
        assert getattr(factories, name) is f and getattr(hf.recipes.factories, name) is f


def test_zoo_rowwise_dequantized_only_on_forward_operands():
    """numerics §5 guidance: rowwise_dequantized for input/weight whose backward copy differs in
    format; never for gradients."""
    for name, f in ZOO.items():
        for role in ROLES:
            q = f(role)
            if isinstance(q, hf.HybridQuantizer) and q.columnwise_source == "rowwise_dequantized":
                assert role is not None and role.tensor_type in ("input", "weight"), (name, role)
                assert describe(q.rowwise_quantizer) != describe(q.columnwise_quantizer) or \
                    name == "nvfp4_1d_weight", (name, role)


# ------------------------------------------------------------------ bitwise parity in a Linear
def _linear_steps(recipe_for_step, seed: int = 0, steps: int = 3):
    """Forward+backward of a small Linear under ``recipe_for_step()`` for a few SGD steps;
    returns every output and gradient. NVFP4's stochastic rounding draws from torch's
    generator: it is re-seeded before each step so two runs draw the same numbers."""
    torch.manual_seed(1234)
    lin = hf.Linear(48, 40, name="fc")
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        x = (torch.randn(2, 12, 48, generator=g) * (1 + step)).requires_grad_()
        dy = torch.randn(2, 12, 40, generator=g)
        torch.manual_seed(100 + step)
        with hf.autocast(recipe=recipe_for_step()):
            y = lin(x)
        y.backward(dy)
        out += [y.detach().clone(), x.grad.clone(), lin.weight.grad.clone(), lin.bias.grad.clone()]
        with torch.no_grad():
            lin.weight -= 0.1 * lin.weight.grad
            lin.bias -= 0.1 * lin.bias.grad
        lin.zero_grad()
    return out


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_linear_custom_recipe_bitwise_equals_builtin(name):
    recipe = CustomRecipe(BASE[name])
    builtin = BUILTIN[name]()  # one recipe object across steps: delayed scaling keeps state
    got = _linear_steps(lambda: recipe)
    want = _linear_steps(lambda: builtin)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{name}: tensor {i} differs"
    assert all(torch.isfinite(t).all() for t in got)


def test_linear_high_precision_factory_is_fp32_math():
    """high_precision has no built-in recipe: its GEMMs are the FP32 products (FP32
    accumulation over K=48, N=40 or M=24: relative error << 1e-5, see test_gemm_pairs)."""
    recipe = CustomRecipe(factories.high_precision)
    got = _linear_steps(lambda: recipe, steps=1)
    torch.manual_seed(1234)
    lin = hf.Linear(48, 40)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 12, 48, generator=g).double().requires_grad_()
    dy = torch.randn(2, 12, 40, generator=g).double()
    w, b = lin.weight.detach().double().requires_grad_(), lin.bias.detach().double().requires_grad_()
    y = torch.nn.functional.linear(x, w, b)
    y.backward(dy)
    for a, ref in zip(got, [y, x.grad, w.grad, b.grad]):
        ref = ref.detach()
        assert ((a.double() - ref).norm() / ref.norm()).item() < 1e-6


# ------------------------------------------------------------------ per_gemm
def _fmt(name: str, t):
    """per_gemm's format names, configured for the role as the built-in recipes would."""
    grad = t in ("grad_output", "grad_input")
    return {
        "bf16": ("IdentityQuantizer", {"dtype": torch.bfloat16}), "identity": identity(),
        "high_precision": identity(),
        "fp8": fp8_current(E5M2 if grad else E4M3), "fp8_current": fp8_current(E5M2 if grad else E4M3),
        "fp8_delayed": fp8_delayed(E5M2 if grad else E4M3),
        "fp8_block": fp8_block(2 if t == "weight" else 1), "mxfp8": mxfp8(),
        # NVFP4 1D: RHT on the wgrad operands' columnwise copies, SR on gradients.
        "nvfp4": NV_1D if t == "weight" else NV_GRAD if grad else NV_INPUT,
    }[name]


TRIPLES = [("mxfp8", "nvfp4", "bf16"), ("nvfp4", "mxfp8", "mxfp8"), ("fp8", "fp8", "fp8"),
           ("fp8_block", "fp8_delayed", "nvfp4"), ("bf16", "mxfp8", "mxfp8"),
           ("mxfp8", "mxfp8", "fp8_current")]


@pytest.mark.parametrize("role", ROLES, ids=role_id)
@pytest.mark.parametrize("triple", TRIPLES, ids="-".join)
def test_per_gemm_mapping(triple, role):
    """input = Hybrid(row=F, col=W), weight = Hybrid(row=F, col=D), grad_output =
    Hybrid(row=D, col=W); a plain quantizer where the two are equal; other roles: F."""
    f, d, w = triple
    t = None if role is None else role.tensor_type
    row, col = {"input": (f, w), "weight": (f, d), "grad_output": (d, w)}.get(t, (f, f))
    want = _fmt(row, t) if row == col else hybrid(_fmt(row, t), _fmt(col, t))
    assert describe(per_gemm(*triple)(role)) == want


def test_per_gemm_keyword_form_and_gemm_formats():
    """Each GEMM reads the format it was given: fprop x.row/W.row, dgrad dy.row/W.col, wgrad
    dy.col/x.col (numerics §1), checked on the format keys the GEMM backends see."""
    f = per_gemm(fprop="mxfp8", dgrad="fp8", wgrad="nvfp4")
    qs = {t: f(QuantizerRole("linear", t)) for t in ("input", "weight", "grad_output")}
    key = lambda t, d: qs[t].format_key(d)[0]  # noqa: E731
    assert (key("input", ROWWISE), key("weight", ROWWISE)) == ("MXFP8", "MXFP8")
    assert (key("grad_output", ROWWISE), key("weight", COLUMNWISE)) == ("FP8 per-tensor", "FP8 per-tensor")
    assert (key("grad_output", COLUMNWISE), key("input", COLUMNWISE)) == ("NVFP4", "NVFP4")
    # Both wgrad operands carry the RHT, so it cancels inside the GEMM.
    assert dict(qs["grad_output"].format_key(COLUMNWISE)[1])["rht"]
    assert dict(qs["input"].format_key(COLUMNWISE)[1])["rht"]


@pytest.mark.parametrize("position", range(3))
def test_per_gemm_unknown_format_lists_the_names(position):
    args = ["mxfp8", "mxfp8", "mxfp8"]
    args[position] = "fp4"
    with pytest.raises(ValueError) as e:
        per_gemm(*args)
    msg = str(e.value)
    assert "'fp4'" in msg and ("fprop", "dgrad", "wgrad")[position] in msg
    for n in FORMAT_NAMES:
        assert n in msg


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_every_listed_format_name_is_accepted(name):
    f = per_gemm(name, name, name)
    for role in ROLES:
        assert isinstance(f(role), hf.Quantizer)


def test_per_gemm_equality_hash_repr():
    a, b = per_gemm("mxfp8", "nvfp4", "bf16"), per_gemm(fprop="mxfp8", dgrad="nvfp4", wgrad="bf16")
    assert a == b and hash(a) == hash(b)
    assert a != per_gemm("mxfp8", "bf16", "nvfp4")
    assert a != ("mxfp8", "nvfp4", "bf16")
    assert repr(a) == "per_gemm(fprop='mxfp8', dgrad='nvfp4', wgrad='bf16')"
    assert CustomRecipe(a).key() == CustomRecipe(b).key()  # equal factories: no rebuild


def test_per_gemm_pickle_round_trip():
    a = per_gemm("nvfp4", "mxfp8", "fp8_block")
    b = pickle.loads(pickle.dumps(a))
    assert b == a and b is not a
    for role in ROLES:
        assert describe(b(role)) == describe(a(role))
    r = pickle.loads(pickle.dumps(CustomRecipe(a)))
    assert r.qfactory == a and r.key() == CustomRecipe(a).key()
    assert copy.deepcopy(a) == a


@pytest.mark.parametrize("name", sorted({**BASE, **ZOO}))
def test_every_factory_pickles_by_reference(name):
    f = BASE.get(name, ZOO.get(name))
    assert pickle.loads(pickle.dumps(f)) is f
    r = pickle.loads(pickle.dumps(CustomRecipe(f)))
    assert r.qfactory is f
