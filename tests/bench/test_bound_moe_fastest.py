"""bound_moe against the fastest BF16: it times the three BF16 baselines (grouped, per-expert,
compiled) as bench_moe has them, in the same process, and reports each floor's bound against
BF16 grouped and against the fastest of the three, named; its targets are the config's."""

from __future__ import annotations

import pytest

from bench import bound_moe, common, moe_layer
from bench.__main__ import _bound_moe


def _measured(experts=64, ffn=1408, per_expert=11.0, compiled=9.0):
    return bound_moe.Measured(experts=experts, ffn=ffn, tokens=128, hidden=32, bf16_step_ms=10.0,
                              bf16_gemm_ms=8.0, bf16_per_expert_ms=per_expert, bf16_compiled_ms=compiled,
                              mxfp8_step_ms=12.0, mxfp8_gemm_ms=7.5, fp8_step_ms=9.0, copy_GBps=2000.0)


@pytest.mark.parametrize("per_expert, compiled, fastest, fastest_ms", [
    (11.0, 9.0, "BF16 compiled", 9.0), (8.5, 9.0, "BF16 per-expert", 8.5), (11.0, 12.0, "BF16 grouped", 10.0)])
def test_the_fastest_bf16_is_chosen_and_bounds_are_against_it(per_expert, compiled, fastest, fastest_ms):
    m = _measured(per_expert=per_expert, compiled=compiled)
    assert bound_moe.bf16_baselines(m) == {"BF16 grouped": 10.0, "BF16 per-expert": per_expert,
                                           "BF16 compiled": compiled}
    assert bound_moe.fastest_bf16(m) == (fastest, fastest_ms)
    rows = bound_moe.bound_rows(m, bound_moe.Premises())
    for r in rows:
        assert r["fastest_bf16"] == fastest
        assert r["bound"] == pytest.approx(10.0 / r["step_ms"], rel=1e-12)  # against BF16 grouped, as before
        assert r["bound_fastest"] == pytest.approx(fastest_ms / r["step_ms"], rel=1e-12)
        fp8 = r["floor"].startswith("FP8")
        assert r["measured_fastest"] == pytest.approx(fastest_ms / (9.0 if fp8 else 12.0), rel=1e-12)
        assert r["target"] == (1.20 if fp8 else 0.95)  # 64 experts x ffn 1408's targets
    text = bound_moe.report(m, bound_moe.Premises())
    assert f"bound x {fastest} (fastest BF16)" in text and "bound x BF16 grouped" in text
    assert "BF16 compiled step" in text and "BF16 per-expert step" in text


def test_targets_are_the_configs():
    premises = bound_moe.Premises()
    t8 = {r["floor"].split(" ")[0]: r["target"] for r in bound_moe.bound_rows(_measured(8, 14336), premises)}
    assert t8 == {"FP8": 1.30, "MXFP8,": 0.95}
    assert all(r["target"] is None for r in bound_moe.bound_rows(_measured(8, 64), premises))  # not a product config
    assert not hasattr(bound_moe, "TARGETS")


def test_headline_shows_the_bound_against_the_fastest_named():
    m = _measured()
    rows = bound_moe.bound_rows(m, bound_moe.Premises())
    heads = dict(_bound_moe({"bounds": rows}))
    fp8 = heads[rows[0]["floor"]]
    assert f"{rows[0]['bound_fastest']:.3f}x vs BF16 compiled" in fp8
    assert f"{rows[0]['bound']:.3f}x vs BF16 grouped" in fp8 and "target 1.20x" in fp8


def test_measure_profiles_the_three_baselines_in_one_process(monkeypatch):
    """The wiring of ``measure`` on the CPU: each layer's step profiled (faked device times)."""
    monkeypatch.setattr(common, "DEVICE", "cpu")
    monkeypatch.setattr(common, "copy_bandwidth", lambda: {"GBps": 100.0})
    seen = []

    def profile(step, warmup=2):
        model = step.model
        name = ("compiled" if hasattr(model, "_orig_mod") else getattr(model, "gemm", None)
                or ("mxfp8" if len(seen) == 3 else "fp8"))
        seen.append(name)
        ms = {"grouped": 10.0, "per_expert": 11.0, "compiled": 9.5, "mxfp8": 12.0, "fp8": 8.0}[name]
        return ms, {"aten::_grouped_mm": ms / 2}
    monkeypatch.setattr(bound_moe, "_profile", profile)
    m = bound_moe.measure(4, 2, compile_backend="eager", ffn=32, tokens=64, hidden=64)
    assert seen == ["grouped", "per_expert", "compiled", "mxfp8", "fp8"]
    assert (m.bf16_step_ms, m.bf16_per_expert_ms, m.bf16_compiled_ms) == (10.0, 11.0, 9.5)
    assert (m.mxfp8_step_ms, m.fp8_step_ms, m.copy_GBps, m.ffn) == (12.0, 8.0, 100.0, 32)
    assert isinstance(moe_layer.BF16MoE, type)


def test_a_profile_without_grouped_gemms_fails_by_name():
    assert bound_moe.grouped_mm_ms({"aten::_grouped_mm": 2.5}, "MXFP8") == 2.5
    with pytest.raises(RuntimeError, match=r"the BF16 grouped step's profile has no aten::_grouped_mm.*aten::mm 4.00"):
        bound_moe.grouped_mm_ms({"aten::mm": 4.0, "aten::mul": 1.0}, "BF16 grouped")


def test_mxfp8_experts_run_per_expert_count_as_its_gemms():
    """At 8 experts MXFP8 runs its experts per expert (cuBLAS, aten::mm): those GEMMs, less the
    router's (BF16 grouped's aten::mm), are its expert GEMMs; a grouped run counts alike."""
    base = {"aten::_grouped_mm": 5.0, "aten::mm": 0.5, "aten::mul": 2.0}
    assert bound_moe.expert_gemm_ms({"aten::mm": 6.5, "aten::_fused": 1.0}, base) == 6.0
    assert bound_moe.expert_gemm_ms({"aten::_grouped_mm": 4.0, "aten::mm": 0.5}, base) == 4.0
    assert bound_moe.expert_gemm_ms({"aten::mm": 3.0, "aten::addmm": 3.5}, base) == 6.0
    with pytest.raises(RuntimeError, match=r"no expert GEMM time beyond the router's.*triton_gemm 7.00 ms"):
        bound_moe.expert_gemm_ms({"aten::mm": 0.5, "triton_gemm": 7.0}, base)
