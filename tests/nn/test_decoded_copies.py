"""Decoded copies written by the quantize pass (``Quantizer.decoded_copies``): which copies a
module asks for and (GPU) that a training step with them is bitwise the step without them
while skipping those decode passes. The kernel side: tests/kernels/test_kernels_mxfp8_decoded.py."""

from __future__ import annotations

import copy

import pytest
import torch
from nn_cases import assert_bitwise, assert_grads_bitwise, call, make_data, make_module, run_step

import hybridfp.nn.base as nn_base
from hybridfp import MXFP8BlockScaling, autocast
from hybridfp.gemm import bf16_tensorcore
from hybridfp.tensors import COLUMNWISE, ROWWISE

pytestmark = pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning")

BOTH = frozenset({ROWWISE, COLUMNWISE})


def _built(module: torch.nn.Module) -> dict[str, frozenset]:
    return {slot: qs[0].decoded_copies for slot, qs in module._quantizers.items()}


def _forward(module: torch.nn.Module) -> None:
    x, _ = make_data()
    with autocast(recipe=MXFP8BlockScaling()):
        call(module, x)


@pytest.mark.parametrize("kind", ["linear", "layernorm"])
def test_module_asks_for_the_copies_its_bf16_gemms_read_now(kind, monkeypatch):
    """Every GEMM on the BF16 tensor-core path: all copies but x.columnwise (kept for backward)."""
    monkeypatch.setattr(nn_base, "decodes_to_bf16", lambda ka, kb, layout, device: True)
    m = make_module(kind)
    _forward(m)
    assert _built(m) == {"input": frozenset({ROWWISE}), "weight": BOTH, "grad_output": BOTH}


def test_module_asks_for_nothing_without_bf16_gemms_or_weight_cache(monkeypatch):
    m = make_module("linear")
    _forward(m)  # CPU: no BF16 tensor-core backend, every GEMM is emulated
    assert set(_built(m).values()) == {frozenset()}
    monkeypatch.setattr(nn_base, "decodes_to_bf16", lambda ka, kb, layout, device: layout == "NT")
    bf16_tensorcore.cache_weight_decodes(False)
    try:
        m = make_module("linear")
        _forward(m)
        assert _built(m) == {"input": frozenset(), "weight": frozenset(), "grad_output": frozenset({COLUMNWISE})}
        monkeypatch.setattr(nn_base, "decodes_to_bf16", lambda ka, kb, layout, device: True)
        m = make_module("linear")
        _forward(m)
        assert _built(m)["weight"] == frozenset(), "weight decodes are off: none written either"
    finally:
        bf16_tensorcore.cache_weight_decodes(True)


def test_grouped_linear_asks_for_none(monkeypatch):
    """The experts' copies are encoded and decoded jointly; per-expert decodes would go unread."""
    monkeypatch.setattr(nn_base, "decodes_to_bf16", lambda ka, kb, layout, device: True)
    m = make_module("grouped")
    _forward(m)
    assert set(_built(m).values()) == {frozenset()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["linear", "layernorm"])
@pytest.mark.parametrize("rows", [2048, 1000])
def test_gpu_step_with_decoded_copies_is_bitwise_and_skips_decodes(kind, rows, monkeypatch):
    """MXFP8 on the H200 (BF16 tensor-core GEMMs): two steps with the quantize pass writing the
    decoded copies equal two steps without, bitwise (output, dx, every gradient), and only
    x.columnwise is decoded by a separate pass (wgrad)."""
    from hybridfp.kernels import triton_decode
    calls: list[tuple] = []
    orig = triton_decode.decode_mxfp8

    def counting(data, scale, **kw):
        calls.append(tuple(data.shape))
        return orig(data, scale, **kw)
    monkeypatch.setattr(triton_decode, "decode_mxfp8", counting)
    base = make_module(kind, in_features=512, out_features=768, params_dtype=torch.bfloat16, device="cuda")
    x, dy = make_data(torch.bfloat16, seed=5, rows=rows, in_features=512, out_features=768, device="cuda")
    results, decodes = [], []
    for writes in (True, False):
        m = copy.deepcopy(base)
        m.writes_decoded_copies = writes
        calls.clear()
        for step in range(2):
            r = run_step(m, x, dy, MXFP8BlockScaling(), seed=step)
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(p.grad, alpha=-0.01)  # new weights: the next step quantizes them again
        results.append(r)
        decodes.append(list(calls))
    assert_bitwise(results[0].y, results[1].y, "output")
    assert_bitwise(results[0].dx, results[1].dx, "dx")
    assert_grads_bitwise(results[0].weight_grads(), results[1].weight_grads(), "grads")
    assert decodes[0] == [(512, rows)] * 2, decodes[0]  # x.columnwise in each step's wgrad
    assert len(decodes[1]) == 2 * 6, decodes[1]
