"""The trainer's ``bf16`` baseline: BF16 GEMM operands (FP32 accumulation), the report's list of
GEMMs on the exact emulation path, and gaps paired by seed."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hybridfp as hf
from hybridfp import factories
from hybridfp.gemm import Backend
from hybridfp.recipes import QuantizerRole
from hybridfp.train import cli
from hybridfp.train import emulated as emulated_module
from hybridfp.train.emulated import emulated_pairs
from hybridfp.train.loop import RunResult, build_model
from hybridfp.train.recipes_by_name import parse_recipe
from hybridfp.train.report import summary_markdown

gemm_module = importlib.import_module("hybridfp.gemm.gemm")  # the module (the package exports the function)
pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")

ROLES = [QuantizerRole("linear", t) for t in ("input", "weight", "grad_output")] + [None]
MMS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


# ------------------------------------------------------------------ the factories
@pytest.mark.parametrize("role", ROLES)
def test_bf16_factory_casts_every_role_to_bf16(role):
    q = factories.bf16(role)
    assert type(q) is hf.IdentityQuantizer and q.dtype == torch.bfloat16
    assert factories.high_precision(role).dtype is None  # the no-cast Identity stays so
    assert factories.BASE["bf16"] is factories.bf16


def test_per_gemm_bf16_is_the_cast_identity_the_no_cast():
    f = factories.per_gemm("bf16", "identity", "high_precision")
    w = f(QuantizerRole("linear", "weight"))  # fprop bf16, dgrad identity
    assert w.rowwise_quantizer.dtype == torch.bfloat16 and w.columnwise_quantizer.dtype is None
    g = f(QuantizerRole("linear", "grad_output"))  # dgrad identity, wgrad high_precision
    assert g.rowwise_quantizer.dtype is None and g.columnwise_quantizer.dtype is None


def test_trainer_names_bf16_and_high_precision_apart():
    bf16 = parse_recipe("bf16")
    assert bf16.label == "bf16" and bf16.recipe.qfactory is factories.bf16
    assert "BF16" in bf16.description and "FP32 accumulation" in bf16.description
    for name in ("high-precision", "high_precision", "hp"):
        r = parse_recipe(name)
        assert r.label == "high-precision" and r.recipe.qfactory is factories.high_precision


# ------------------------------------------------------------------ what the GEMMs read
class _MatmulLog(TorchDispatchMode):
    """Operand dtypes of every aten.mm / addmm (the matrices, not addmm's bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[tuple[torch.dtype, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MMS:
            mats = args[-2:]  # addmm(bias, a, b), mm(a, b)
            self.dtypes.append(tuple(t.dtype for t in mats))
        return func(*args, **(kwargs or {}))


def _linear_step(recipe, monkeypatch, backend=None):
    """One step of hf.Linear(256, 512) (FP32 weights, as the trainer's masters) on a BF16 input:
    the matmul operand dtypes, the values ``emulate`` received, and what a backend got."""
    torch.manual_seed(0)
    lin = hf.Linear(256, 512, bias=False)
    x = torch.randn(8, 256, dtype=torch.bfloat16, requires_grad=True)
    emulated = []
    real_emulate = gemm_module.emulate

    def spy(a, b, *args, **kwargs):
        emulated.append((a.values, b.values))
        return real_emulate(a, b, *args, **kwargs)

    monkeypatch.setattr(gemm_module, "emulate", spy)
    if backend is not None:
        monkeypatch.setattr(gemm_module, "select", lambda *a: backend)
    with _MatmulLog() as log:
        with hf.autocast(recipe=recipe):
            y = lin(x)
        y.float().square().sum().backward()
    assert lin.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    return log.dtypes, emulated


def _bf16_exact(t: torch.Tensor) -> bool:
    return torch.equal(t, t.to(torch.bfloat16).float())


def test_trainer_bf16_fprop_dgrad_are_bf16_gemms_and_wgrad_reads_bf16(monkeypatch):
    dtypes, emulated = _linear_step(parse_recipe("bf16").recipe, monkeypatch)
    # fprop and dgrad: torch's own BF16 GEMM on the BF16 copies (FP32 accumulation inside)
    assert dtypes[:2] == [(torch.bfloat16, torch.bfloat16)] * 2
    # wgrad writes the FP32 weight gradient: on the CPU the exact path, fed BF16 values
    assert len(emulated) == 1 and all(_bf16_exact(v) for v in emulated[0])


def test_trainer_bf16_wgrad_hands_bf16_copies_to_a_backend(monkeypatch):
    """As on CUDA, where the BF16 tensor-core backend serves Identity keys: what it is given."""
    seen = []

    def run(sa, sb, layout, **kw):
        seen.append((layout, sa.tensors()[0].dtype, sb.tensors()[0].dtype))
        return gemm_module.emulate(sa.gemm_operand(gemm_module.LAYOUTS[layout][0]),
                                   sb.gemm_operand(gemm_module.LAYOUTS[layout][1]), kw["out_dtype"],
                                   kw.get("bias"), kw.get("accumulate_into"))

    fake = Backend("fake_bf16", lambda *a: True, run)
    _linear_step(parse_recipe("bf16").recipe, monkeypatch, fake)
    assert seen == [("NT", torch.bfloat16, torch.bfloat16)]  # fprop / dgrad never needed one


def test_high_precision_reads_the_fp32_weight(monkeypatch):
    """The no-cast recipe: fprop and dgrad read the FP32 master (the exact path)."""
    _, emulated = _linear_step(parse_recipe("high-precision").recipe, monkeypatch)
    assert len(emulated) == 3
    assert not _bf16_exact(emulated[0][1])  # fprop's weight operand: FP32 values


# ------------------------------------------------------------------ the report's emulated GEMMs
def _cfg(*argv):
    return cli.config_from_args(cli.build_parser().parse_args(["train", "--preset", "test", *argv]))


def _pairs(name, device="cpu"):
    cfg = _cfg()
    named = parse_recipe(name)
    model = build_model(cfg, 64, named.recipe)
    return emulated_pairs(model, named, device, torch.bfloat16)


def _serve_every_key(monkeypatch):
    """A backend for every format key, as CUDA's BF16 tensor-core backend serves Identity keys."""
    fake = Backend("fake", lambda *a: True, lambda *a, **k: None)
    monkeypatch.setattr(emulated_module, "select", lambda *a: fake)


def test_emulated_pairs_name_fp32_identity_copies_a_backend_cannot_take(monkeypatch):
    _serve_every_key(monkeypatch)
    hp = _pairs("high-precision")
    assert [p.split(":")[0] for p in hp] == ["fprop", "dgrad"], hp
    assert all("[weight held in float32]" in p for p in hp), hp
    assert _pairs("bf16") == []
    assert _pairs("mxfp8") == []
    # the zoo recipe whose backward reads the forward value in FP32 (rowwise_dequantized)
    rd = _pairs("mxfp8-fwd-hp-bwd")
    assert [p.split(":")[0] for p in rd] == ["dgrad", "wgrad"], rd


def test_emulated_pairs_belong_to_their_run_in_one_process(monkeypatch):
    """Several recipes in one process: each run's list is its own, whatever ran before."""
    _serve_every_key(monkeypatch)
    first = (_pairs("bf16"), _pairs("high-precision"))
    second = (_pairs("bf16"), _pairs("high-precision"))
    assert first == second and first[0] == [] and len(first[1]) == 2


def test_emulated_pairs_on_the_cpu_list_only_the_exact_path():
    """On the CPU the BF16 recipe's fprop / dgrad are torch's BF16 op; its wgrad (FP32 output)
    has no fast kernel there."""
    pairs = _pairs("bf16")
    assert [p.split(":")[0] for p in pairs] == ["wgrad"], pairs
    assert len(_pairs("high-precision")) == 3


# ------------------------------------------------------------------ gaps paired by seed
def _result(label, val):
    recs = [{"step": 1, "recipe": label, "train_loss": val, "val_loss": val}]
    return RunResult(label, f"{label} recipe", recs, [], tokens=1000, train_seconds=2.0)


def test_gap_pairs_each_run_with_the_same_seed_baseline():
    cfg = _cfg("--seed", "0")
    md = summary_markdown([_result("bf16@seed=0", 2.0), _result("mxfp8@seed=0", 2.1),
                           _result("bf16@seed=1", 4.0), _result("mxfp8@seed=1", 4.2)], cfg, {})
    assert "| `bf16@seed=0` | 2.0000 | baseline |" in md
    assert "| `bf16@seed=1` | 4.0000 | +100.00 % |" in md  # to bf16 at --seed: the noise floor
    assert "| `mxfp8@seed=0` | 2.1000 | +5.00 % |" in md and "| `mxfp8@seed=1` | 4.2000 | +5.00 % |" in md
    assert "No `bf16" not in md
    # a plain label runs at --seed: it pairs with a plain or same-seed bf16
    md = summary_markdown([_result("bf16", 2.0), _result("fp8@seed=0", 2.2), _result("fp8", 2.1)], cfg, {})
    assert "| `fp8@seed=0` | 2.2000 | +10.00 % |" in md and "| `fp8` | 2.1000 | +5.00 % |" in md


def test_gap_says_which_same_seed_baseline_is_missing():
    cfg = _cfg("--seed", "0")
    md = summary_markdown([_result("bf16@seed=0", 2.0), _result("mxfp8@seed=1", 2.1)], cfg, {})
    assert "| `mxfp8@seed=1` | 2.1000 | no bf16@seed=1 |" in md
    assert "No `bf16@seed=1` run" in md and "`mxfp8@seed=1`" in md.split("No `bf16@seed=1` run")[1]
    md = summary_markdown([_result("mxfp8", 2.1)], cfg, {})
    assert "No `bf16` run" in md


def test_emulated_pairs_follow_the_recipes_backward_override(monkeypatch):
    """With a backward_override the backward GEMMs multiply the plain tensors: dgrad reads the
    FP32 master weight (the exact path even where a backend serves the quantized keys)."""
    import dataclasses
    from hybridfp.train.recipes_by_name import NamedRecipe
    _serve_every_key(monkeypatch)
    base = parse_recipe("mxfp8")
    for mode in ("high_precision", "dequantized"):
        named = NamedRecipe(base.label, dataclasses.replace(base.recipe, backward_override=mode), base.description)
        model = build_model(_cfg(), 64, named.recipe)
        pairs = emulated_pairs(model, named, "cpu", torch.bfloat16)
        assert [p.split(":")[0] for p in pairs] == ["dgrad"], (mode, pairs)
        assert "Identity x Identity [weight held in float32]" in pairs[0], pairs
    assert _pairs("mxfp8") == []  # the quantized backward: every key served
