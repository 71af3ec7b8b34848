"""A warmed-up dense MLP step (three ``Linear`` layers and the fused SwiGLU, forward + backward
under autocast) queues all its work without waiting for the GPU, for every built-in recipe and
the hybrids the benchmarks run: ``torch.cuda.set_sync_debug_mode("error")`` raises on any
host-device synchronization. A sync drains the GPU's queue and leaves it idle while the host
prepares the next launches (the NVFP4 MLP steps spend 19-29 ms of host time per 30-35 ms step
on an NVIDIA H200, ``python -m bench.bench_mlp``: this says whether waiting is part of it)."""

from __future__ import annotations

import pytest
import torch
from nn_cases import GatedMLP

import hybridfp
from hybridfp import autocast
from hybridfp.factories import per_gemm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.filterwarnings("ignore::hybridfp.gemm.EmulatedGemmWarning"),
]

RECIPES = {
    "fp8_current": lambda: hybridfp.Float8CurrentScaling(),
    "fp8_block": lambda: hybridfp.Float8BlockScaling(),
    "mxfp8": lambda: hybridfp.MXFP8BlockScaling(),
    "nvfp4": lambda: hybridfp.NVFP4BlockScaling(),
    "fp8_current_fwd_fp8_block_bwd": lambda: hybridfp.CustomRecipe(qfactory=per_gemm("fp8", "fp8_block", "fp8_block")),
    "nvfp4_fwd_mxfp8_bwd": lambda: hybridfp.CustomRecipe(qfactory=per_gemm("nvfp4", "mxfp8", "mxfp8")),
}


@pytest.mark.parametrize("name", RECIPES)
def test_mlp_step_has_no_host_sync(name):
    torch.manual_seed(0)
    m = GatedMLP(512, 1536)
    x = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        for mod in (m.gate, m.up, m.down):
            mod.invalidate_weight_cache()  # weights quantized every step, as after an optimizer update
        with autocast(recipe=RECIPES[name]()):
            y = m(x)
        y.backward(dy)

    step()  # compiles kernels, builds quantizers
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(x.grad.float()).all()
