"""The emulated-pair report (numerics §1: a slow path is never taken silently): building
a module's quantizers warns once per (device, GEMM, format pair) that has no fast kernel,
naming the role and both formats, and records it in ``hybridfp.gemm.EMULATED``; a registered
backend that supports a pair is selected by ``gemm`` and silences the report for that pair."""

from __future__ import annotations

import warnings

import pytest
import torch
from gemm_operands import operand

import hybridfp as hf
from hybridfp import CustomRecipe, factories
from hybridfp.gemm import (BACKENDS, EMULATED, Backend, EmulatedGemmWarning, describe_key, gemm,
                           register_backend, report_emulated, select)

MX = "MXFP8(fp8_dtype=float8_e4m3fn)"


@pytest.fixture(autouse=True)
def clean_registry():
    """EMULATED and BACKENDS are process-global: start empty, restore afterwards."""
    saved_emulated, saved_backends = dict(EMULATED), list(BACKENDS)
    EMULATED.clear()
    BACKENDS.clear()
    yield
    EMULATED.clear()
    EMULATED.update(saved_emulated)
    BACKENDS[:] = saved_backends


def _build(module, recipe, x):
    """Run a forward under ``recipe``, returning the EmulatedGemmWarnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hf.autocast(recipe=recipe):
            module(x)
    return [w for w in caught if issubclass(w.category, EmulatedGemmWarning)]


def test_each_pair_is_reported_once_naming_role_and_formats():
    fc1 = hf.Linear(32, 16, name="blocks.0.fc1")
    ws = _build(fc1, CustomRecipe(factories.mxfp8_fwd_nvfp4_bwd), torch.randn(4, 32))
    msgs = [str(w.message) for w in ws]
    assert len(msgs) == 3
    expect = {"fprop": (MX, MX), "dgrad": ("NVFP4", "NVFP4"), "wgrad": ("NVFP4(rht=True)", "NVFP4(rht=True)")}
    for (gemm_name, (fa, fb)), msg in zip(expect.items(), msgs):
        assert msg.startswith(f"hybridfp: {gemm_name} of blocks.0.fc1 ({fa} x {fb})"), msg
        assert "cpu" in msg and "emulation" in msg
    assert EMULATED == {("cpu", g, fa, fb): "blocks.0.fc1" for g, (fa, fb) in expect.items()}

    # The same pairs again, in another module, in later steps: no new warning.
    fc2 = hf.Linear(32, 16, name="blocks.1.fc1")
    assert _build(fc2, CustomRecipe(factories.mxfp8_fwd_nvfp4_bwd), torch.randn(4, 32)) == []
    assert _build(fc1, CustomRecipe(factories.mxfp8_fwd_nvfp4_bwd), torch.randn(4, 32)) == []
    assert set(EMULATED.values()) == {"blocks.0.fc1"}


def test_reported_at_build_not_per_forward():
    lin = hf.Linear(32, 16, name="fc")
    recipe = CustomRecipe(factories.mxfp8)
    assert len(_build(lin, recipe, torch.randn(4, 32))) == 3  # fprop, dgrad, wgrad: MX x MX
    assert _build(lin, recipe, torch.randn(4, 32)) == []  # later forwards: nothing new


def test_direct_gemm_call_reports_its_pair_once():
    """gemm() called outside a module reports a new emulated pair itself (never silent)."""
    a = hf.MXFP8Quantizer()(torch.randn(8, 32))
    b = hf.NVFP4Quantizer()(torch.randn(16, 32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gemm(a, b, "TN", out_dtype=torch.float32)
        gemm(a, b, "TN", out_dtype=torch.float32)
    msgs = [str(w.message) for w in caught if issubclass(w.category, EmulatedGemmWarning)]
    assert len(msgs) == 1 and msgs[0].startswith("hybridfp: fprop of a direct gemm() call (MXFP8")
    assert ("cpu", "fprop", describe_key(a.qstorage.format_key("rowwise")),
            describe_key(b.qstorage.format_key("rowwise"))) in EMULATED


def test_a_new_pair_in_a_known_gemm_is_reported():
    a = hf.Linear(32, 16, name="a")
    _build(a, hf.MXFP8BlockScaling(), torch.randn(4, 32))
    b = hf.Linear(32, 16, name="b")
    ws = _build(b, hf.NVFP4BlockScaling(), torch.randn(4, 32))
    heads = [str(w.message).split(" (")[0] for w in ws]
    assert heads == [f"hybridfp: {g} of b" for g in ("fprop", "dgrad", "wgrad")]
    assert "NVFP4(block_2d=True)" in str(ws[0].message)
    assert len(EMULATED) == 6


def test_grouped_linear_reports_with_its_name():
    g = hf.GroupedLinear(3, 32, 16, name="moe.experts")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hf.autocast(recipe=CustomRecipe(factories.nvfp4_row_scaled_fwd_mxfp8_bwd)):
            g(torch.randn(6, 32), [2, 2, 2])
    msgs = [str(w.message) for w in caught if issubclass(w.category, EmulatedGemmWarning)]
    assert len(msgs) == 3  # once per GEMM, not once per expert
    assert msgs[0].startswith("hybridfp: fprop of moe.experts (NVFP4(row_scaled=True) x NVFP4)")
    assert msgs[1].startswith(f"hybridfp: dgrad of moe.experts ({MX} x {MX})")


def test_report_emulated_directly():
    key = hf.MXFP8Quantizer().format_key("rowwise")
    with pytest.warns(EmulatedGemmWarning, match=r"fprop of fc\.input"):
        assert report_emulated("fprop", "fc.input", key, key, "TN", torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert report_emulated("fprop", "other", key, key, "TN", torch.device("cpu"))  # no second warning
    assert describe_key(key) == MX


# ------------------------------------------------------------------ a registered fast backend
def _fake_backend(calls, name="fake", layouts=("TN",)):
    def supports(ka, kb, layout, device):
        return (ka[0] == "MXFP8" and kb[0] == "MXFP8" and layout in layouts
                and torch.device(device).type == "cpu")

    def run(sa, sb, layout, *, out_dtype, bias=None, accumulate_into=None, fast_accumulation=False):
        calls.append((name, layout, out_dtype, bias is not None, accumulate_into is not None))
        m = sa.rows if layout != "NT" else sa.cols
        n = sb.rows if layout == "TN" else sb.cols
        return torch.full((m, n), 7.0, dtype=out_dtype)

    return Backend(name, supports, run)


def test_registered_backend_is_selected_for_its_pair():
    calls = []
    register_backend(_fake_backend(calls))
    x, w, dy = operand("mxfp8_1d", "x"), operand("mxfp8_1d", "w"), operand("mxfp8_1d", "dy")
    bias = torch.zeros(24)
    y = gemm(x, w, "TN", out_dtype=torch.float32, bias=bias)
    assert torch.equal(y, torch.full((40, 24), 7.0))
    assert calls == [("fake", "TN", torch.float32, True, False)]
    # Pairs and layouts it does not support still run the exact emulation.
    dx = gemm(dy, w, "NN", out_dtype=torch.float32)
    assert not torch.equal(dx, torch.full_like(dx, 7.0))
    gemm(operand("nvfp4_1d", "x"), w, "TN")
    assert len(calls) == 1


def test_later_registrations_take_precedence():
    calls = []
    register_backend(_fake_backend(calls, "first"))
    register_backend(_fake_backend(calls, "second"))
    key = hf.MXFP8Quantizer().format_key("rowwise")
    assert select(key, key, "TN", torch.device("cpu")).name == "second"
    gemm(operand("mxfp8_1d", "x"), operand("mxfp8_1d", "w"), "TN")
    assert [c[0] for c in calls] == ["second"]
    assert select(key, key, "NN", torch.device("cpu")) is None


def test_supported_pair_is_not_reported():
    calls = []
    register_backend(_fake_backend(calls, layouts=("TN", "NT")))
    lin = hf.Linear(32, 16, name="fc")
    ws = _build(lin, hf.MXFP8BlockScaling(), torch.randn(4, 32))
    assert [str(w.message).split(" of ")[0] for w in ws] == ["hybridfp: dgrad"]
    assert list(EMULATED) == [("cpu", "dgrad", MX, MX)]
    assert calls and {c[1] for c in calls} == {"TN"}  # the forward ran on the backend
