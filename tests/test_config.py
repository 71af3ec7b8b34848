"""``hybridfp.config``: the policy's defaults and validation, per-thread isolation, nesting, a
changed decoded-copies policy rebuilding a module's quantizers, and ``quantize_kernels=False``
running the reference encode."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

import hybridfp
from hybridfp import Policy, current_policy, policy, use_policy
from hybridfp.config import DEFAULT_POLICY
from hybridfp.quantizers import backends


def test_defaults():
    p = Policy()
    assert p == DEFAULT_POLICY and current_policy() == p
    assert (p.decoded_copies, p.decoded_unverified_on_cuda, p.quantize_kernels) == ("auto", frozenset(), True)
    assert (p.many_experts, p.grouped_triton_devices, p.grouped_triton_native_fp8) == (16, frozenset(), False)
    assert p.over_scaled_grouped_mm is False
    assert (p.grouped_fp8_tma_rows, p.grouped_fp8_tma_wgrad) == ("256x128x128 w8 st3", "256x128x128 w8 st3 store")
    assert (p.bf16_per_group_cublas, p.per_group_max_groups, p.per_group_min_mean) == (None, 16, 2048)
    assert (p.per_expert_fp8_flops, p.per_expert_fp8_triton_flops, p.grouped_triton_max_flops) == (2.5e11, 4.5e10, 2e11)
    hash(p)  # frozen: usable as a key


def test_every_default_tma_config_exists():
    tma = pytest.importorskip("hybridfp.kernels.moe.triton_grouped_fp8_tma")
    assert {DEFAULT_POLICY.grouped_fp8_tma_rows, DEFAULT_POLICY.grouped_fp8_tma_wgrad} <= set(tma.CONFIGS)


@pytest.mark.parametrize("changes, error, field", [
    (dict(decoded_copies="sometimes"), ValueError, "decoded_copies"),
    (dict(quantize_kernels=1), TypeError, "quantize_kernels"),
    (dict(over_scaled_grouped_mm="yes"), TypeError, "over_scaled_grouped_mm"),
    (dict(grouped_triton_native_fp8=None), TypeError, "grouped_triton_native_fp8"),
    (dict(many_experts=-1), ValueError, "many_experts"),
    (dict(many_experts=True), ValueError, "many_experts"),
    (dict(per_group_min_mean=2.5), ValueError, "per_group_min_mean"),
    (dict(per_group_max_groups="16"), ValueError, "per_group_max_groups"),
    (dict(per_expert_fp8_flops=-1.0), ValueError, "per_expert_fp8_flops"),
    (dict(per_expert_fp8_flops=float("nan")), ValueError, "per_expert_fp8_flops"),
    (dict(per_expert_fp8_triton_flops=-1.0), ValueError, "per_expert_fp8_triton_flops"),
    (dict(per_expert_fp8_triton_flops="1e10"), ValueError, "per_expert_fp8_triton_flops"),
    (dict(grouped_triton_max_flops=-5.0), ValueError, "grouped_triton_max_flops"),
    (dict(grouped_triton_devices="cuda"), TypeError, "grouped_triton_devices"),
    (dict(decoded_unverified_on_cuda={1}), TypeError, "decoded_unverified_on_cuda"),
    (dict(grouped_fp8_tma_rows=""), TypeError, "grouped_fp8_tma_rows"),
    (dict(grouped_fp8_tma_wgrad=3), TypeError, "grouped_fp8_tma_wgrad"),
    (dict(bf16_per_group_cublas=0), TypeError, "bf16_per_group_cublas"),
])
def test_validation_names_the_field(changes, error, field):
    with pytest.raises(error, match=f"Policy.{field}"):
        Policy(**changes)
    with pytest.raises(error, match=f"Policy.{field}"):
        with policy(**changes):
            pass
    assert current_policy() == DEFAULT_POLICY


def test_sets_become_frozensets():
    p = Policy(grouped_triton_devices={"cpu"}, decoded_unverified_on_cuda=["MXFP8Quantizer"])
    assert p.grouped_triton_devices == frozenset({"cpu"}) and type(p.grouped_triton_devices) is frozenset
    assert p.decoded_unverified_on_cuda == frozenset({"MXFP8Quantizer"})


def test_unknown_field_and_non_policy():
    with pytest.raises(TypeError, match="no field 'kernels'"):
        with policy(kernels=False):
            pass
    with pytest.raises(TypeError, match="needs a hybridfp Policy"):
        with use_policy({"quantize_kernels": False}):
            pass
    with pytest.raises(Exception):
        DEFAULT_POLICY.quantize_kernels = False  # frozen


def test_nesting_restores_each_level_also_on_error():
    with policy(many_experts=4) as outer:
        assert current_policy() is outer and outer.many_experts == 4
        with policy(quantize_kernels=False) as inner:
            # changes apply to the current policy: the outer change is kept
            assert (inner.many_experts, inner.quantize_kernels) == (4, False)
            with use_policy(Policy()):
                assert current_policy() == DEFAULT_POLICY
            assert current_policy() is inner
        assert current_policy() is outer
        with pytest.raises(RuntimeError):
            with policy(decoded_copies="never"):
                raise RuntimeError("body fails")
        assert current_policy() is outer
    assert current_policy() == DEFAULT_POLICY


def test_policy_is_per_thread():
    """A thread starts with the default, whatever policy the thread that started it has; two
    threads in different policies do not see each other's."""
    seen: dict[str, Policy] = {}
    inside = threading.Barrier(2)

    def run(name: str, **changes) -> None:
        seen[name + " start"] = current_policy()
        with policy(**changes):
            inside.wait()  # both threads inside their own policy at once
            seen[name] = current_policy()
            inside.wait()

    with policy(quantize_kernels=False, many_experts=2):
        threads = [threading.Thread(target=run, args=("a",), kwargs=dict(many_experts=7)),
                   threading.Thread(target=run, args=("b",), kwargs=dict(decoded_copies="never"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert current_policy().many_experts == 2 and not current_policy().quantize_kernels
    assert seen["a start"] == DEFAULT_POLICY and seen["b start"] == DEFAULT_POLICY
    assert seen["a"] == Policy(many_experts=7) and seen["b"] == Policy(decoded_copies="never")


def _forward(m: hybridfp.Linear, x: torch.Tensor) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with hybridfp.autocast(recipe=hybridfp.MXFP8BlockScaling()):
            m(x)


def test_changed_decoded_copies_rebuilds_quantizers():
    """A module's quantizers (and their ``hold_decoded``) follow the policy of each forward:
    nothing built under one policy serves another."""
    m, x = hybridfp.Linear(64, 96), torch.randn(8, 64)
    with policy(decoded_copies="always"):
        _forward(m, x)
        built = m._quantizers["weight"][0]
        assert built.hold_decoded == {"rowwise", "columnwise"}
        _forward(m, x)
        assert m._quantizers["weight"][0] is built  # same policy: reused
    with policy(decoded_copies="never"):
        _forward(m, x)
        assert m._quantizers["weight"][0] is not built
        assert not any(qs[0].hold_decoded for qs in m._quantizers.values())
    with policy(decoded_copies="always", decoded_unverified_on_cuda={"MXFP8Quantizer"}):
        _forward(m, x)  # "always" ignores the list, but the list is part of what was built from
        assert m._quantizers["weight"][0].hold_decoded == {"rowwise", "columnwise"}
        rebuilt = m._quantizers["weight"][0]
    with policy(decoded_copies="always"):
        _forward(m, x)
        assert m._quantizers["weight"][0] is not rebuilt


def test_kernels_off_runs_the_reference(monkeypatch):
    """``quantize_kernels=False``: ``Quantizer.encode`` never asks a registered kernel and
    returns the reference encode; with the default policy the kernel runs."""
    calls: list[str] = []

    def run(q, x, rowwise, columnwise, seed=None):  # a kernel whose result shows it ran: 2x
        calls.append("kernel")
        return q.reference_encode(2 * x, rowwise, columnwise, seed)

    kernel = backends.QuantizeKernel("test", lambda q, x, r, c: True, run)
    monkeypatch.setitem(backends.QUANTIZE_KERNELS, hybridfp.MXFP8Quantizer,
                        [kernel, *backends.QUANTIZE_KERNELS.get(hybridfp.MXFP8Quantizer, [])])
    q, x = hybridfp.MXFP8Quantizer(), torch.randn(32, 64)
    with policy(quantize_kernels=False):
        assert backends.select_quantize_kernel(q, x, True, True) is None
        off = q.quantize(x).dequantize()
    assert calls == []
    on = q.quantize(x).dequantize()
    assert calls == ["kernel"]
    assert torch.equal(2 * off, on)  # MXFP8 scales by powers of two: 2x quantizes exactly to 2x
