"""bench_moe's fused-SwiGLU rows: the FP8 current and MXFP8 layers, plain and with quantized
primary weights, timed again with ``hybridfp.swiglu`` as the experts' activation. On the CPU
(tiny shapes; ``hybridfp.swiglu`` runs torch's eager ops there, so the rows compute what the
eager rows compute, bit for bit, and pass the same checks)."""

from __future__ import annotations

import json

import torch

import hybridfp
from bench import bench_moe, moe_layer, moe_rows
from bench.__main__ import BENCHMARKS, MOE_FUSED_SWIGLU_ROWS

FP8, MX = "hybridfp FP8 current", "hybridfp MXFP8"
FUSED, PRIMARY = moe_rows.FUSED_SWIGLU_SUFFIX, moe_rows.PRIMARY_SUFFIX
FAST = ["--quick", "--micro-batches", "2", "--rounds", "2", "--samples", "1", "--compile-backend", "eager"]


def test_the_by_name_benchmarks_time_the_training_rows_eager_and_fused():
    rows = MOE_FUSED_SWIGLU_ROWS.split("|")
    assert rows == [moe_rows.BF16_FUSED_SWIGLU, FP8 + PRIMARY, FP8 + PRIMARY + FUSED, MX + PRIMARY, MX + PRIMARY + FUSED]
    for name, experts in (("moe_fused_swiglu", "8"), ("moe_64_fused_swiglu", "64")):
        b = BENCHMARKS[name]
        assert not b.default and b.args == ("--experts", experts, "--fastest-only", "--variants", MOE_FUSED_SWIGLU_ROWS)


def test_the_fused_rows_share_the_layers_and_run_after_the_primary_rows(tiny):
    base, hf, _, _ = moe_layer.moe_layer(4, 32, 64, 64)
    plan = moe_rows.variants_of(base, hf, None, False, "eager")
    names = [v[0] for v in plan]
    fused = [n for n in names if n.endswith(FUSED)]
    assert fused == [FP8 + PRIMARY + FUSED, MX + PRIMARY + FUSED, FP8 + FUSED, MX + FUSED, moe_rows.BF16_FUSED_SWIGLU]
    for name in (FP8, MX):  # a primary row's fused twin right after it: a deadline cuts neither alone
        assert names.index(name + PRIMARY + FUSED) == names.index(name + PRIMARY) + 1
    last_primary = max(i for i, n in enumerate(names) if n.endswith(PRIMARY))
    first_compiled = min(i for i, n in enumerate(names) if n.endswith(moe_rows.COMPILED_SUFFIX))
    assert all(last_primary < names.index(n) < first_compiled for n in fused[2:])
    assert all(moe_rows.optional(n) for n in fused)
    layers = {n: build() for n, build, _ in plan if n in (FP8, FP8 + FUSED, MX + FUSED, FP8 + PRIMARY,
                                                         FP8 + PRIMARY + FUSED)}
    assert layers[FP8 + FUSED] is layers[MX + FUSED] and layers[FP8 + FUSED] is not hf
    assert layers[FP8 + FUSED].fc1 is hf.fc1 and layers[FP8 + FUSED].fused_swiglu and not hf.fused_swiglu
    primary, fused_primary = layers[FP8 + PRIMARY], layers[FP8 + PRIMARY + FUSED]
    assert fused_primary.fc2 is primary.fc2 and fused_primary.masters is primary.masters
    assert fused_primary.fused_swiglu and not primary.fused_swiglu


def test_the_fused_layer_computes_the_eager_layer_on_the_cpu(tiny):
    """Off CUDA ``hybridfp.swiglu(h)`` runs eager ops: the same outputs and gradients, bit for bit."""
    base, hf, x, dy = moe_layer.moe_layer(4, 32, 64, 64)
    results = []
    for model in (hf, hf.with_fused_swiglu()):
        xi = x.detach().clone().requires_grad_()
        with hybridfp.autocast(recipe=hybridfp.Float8CurrentScaling()):
            y = model(xi)
        y.backward(dy)
        results.append((y.detach(), xi.grad, *(w.grad.clone() for w in model.fc1.weights())))
        for w in (*model.fc1.weights(), *model.fc2.weights()):
            w.grad = None
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_the_fused_rows_run_and_pass_their_checks(tiny, tmp_path):
    out = tmp_path / "moe.json"
    bf16_fused = moe_rows.BF16_FUSED_SWIGLU
    bench_moe.main(FAST + ["--fastest-only", "--variants", f"{FP8}|{FP8 + FUSED}|{MX + PRIMARY + FUSED}|{bf16_fused}",
                           "--out", str(out)])
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows[bf16_fused]["rel_err"] == rows[bench_moe.BF16_GROUPED]["rel_err"] and not rows[bf16_fused]["baseline"]
    for name in (FP8 + FUSED, MX + PRIMARY + FUSED, bf16_fused):
        assert rows[name]["breaches"] == [] and rows[name]["bounds"] == bench_moe.error_bounds(name)
    assert rows[FP8 + FUSED]["rel_err"] == rows[FP8]["rel_err"]  # the same computation on the CPU
