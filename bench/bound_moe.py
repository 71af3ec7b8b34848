"""What the MoE layer's targets allow (H200): the ratio a recipe could reach against the BF16
grouped baseline if everything but its unavoidable work were free, from quantities measured in
one process.

The baseline's step (device time, torch.profiler) splits into its grouped GEMMs
(``aten::_grouped_mm``) and the rest S (routing, permutation, SwiGLU, un-permutation, the
router's FP32 GEMMs: the same kernels in every recipe's step). A recipe's step is at least

    S + its GEMMs + the bytes its quantization must move / the copy bandwidth

when the weights are quantized anew every step (after each optimizer update, as the benchmark
and a training step with one micro-batch do). Per element, at least:

- FP8 current scaling (``"fp8"``): the amax pass reads the high-precision tensor (2 bytes), the
  cast reads it again (2) and writes one FP8 copy (1): 5 bytes. The GEMMs at twice the
  baseline's speed (FP8 tensor cores' peak is twice BF16's): G_bf16 / 2.
- MXFP8 on Hopper (``"mxfp8"``): no MX tensor cores, so the GEMMs run on BF16 tensor cores on
  the decoded values (their in-step time measured on the recipe's own step: decoded values run
  slightly faster than the baseline's); each tensor read once (2 bytes) and written as the two
  copies the GEMMs read, row and column: as BF16 decodes (2 + 2) for the GEMMs as they run
  on Hopper, or (the generous floor) as FP8 codes read by a GEMM that decoded them for free (1 + 1).

The quantized tensors of one step: both layers' weights, the two inputs (x, the SwiGLU output)
and the two output gradients. ``python -m bench.bound_moe [--experts 64]``
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

import hybridfp
from bench import common
from bench.bench_moe import CONFIGS, TOKENS, TOP_K, HIDDEN, make_step, moe_layer
from bench.common import environment, finish, md_table, parser, require_cuda

#: bytes a quantized element moves at least, per recipe and floor (module docstring)
FLOORS = {"FP8 current (amax read, cast read, one FP8 write)": 5,
          "MXFP8, BF16-decoded row + col copies (as Hopper runs it)": 6,
          "MXFP8, FP8 row + col codes (a free in-GEMM decode)": 4}
TARGETS = {"FP8 current": 1.30, "MXFP8": 0.90}


def _profile(step: Callable[[], Any]) -> tuple[float, dict[str, float]]:
    """(device ms of one step, op / kernel name -> self device ms) after two warm-up steps."""
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    total = sum(e.device_time_total for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
    return total, {e.key: e.self_device_time_total / 1e3 for e in prof.key_averages()}


def run(experts: int) -> dict[str, Any]:
    f = dict(CONFIGS)[experts]
    base, _, x, dy = moe_layer(experts, f)
    _, single, _, _ = moe_layer(experts, f, single_parameter=True)
    t_bf16, ops_bf16 = _profile(make_step(base, x, dy, None))
    g_bf16 = ops_bf16["aten::_grouped_mm"]
    shared = t_bf16 - g_bf16
    t_mx, ops_mx = _profile(make_step(single, x, dy, lambda: hybridfp.autocast(recipe=hybridfp.MXFP8BlockScaling())))
    g_mx = ops_mx["aten::_grouped_mm"]
    t_fp8, ops_fp8 = _profile(make_step(single, x, dy, lambda: hybridfp.autocast(recipe=hybridfp.Float8CurrentScaling())))
    rows = TOKENS * TOP_K
    weights = experts * (2 * f * HIDDEN + HIDDEN * f)
    acts = rows * (HIDDEN + f) + rows * (HIDDEN + 2 * f)  # x, SwiGLU out; dy of fc2, dy of fc1
    bw = common.copy_bandwidth()["GBps"]  # bytes read + written per second / 1e9

    def floor_ms(nbytes: int) -> float:
        return (weights + acts) * nbytes / bw / 1e6

    out: dict[str, Any] = dict(env=environment(), experts=experts, ffn=f, bf16_step_ms=t_bf16, bf16_gemm_ms=g_bf16, shared_ms=shared,
                               mxfp8_step_ms=t_mx, mxfp8_gemm_ms=g_mx, fp8_step_ms=t_fp8,
                               fp8_gemm_ms=ops_fp8.get("_kernel", 0.0), copy_GBps=bw,
                               quantized_elements=weights + acts, bounds=[])
    for name, nbytes in FLOORS.items():
        fp8 = name.startswith("FP8")
        gemm = g_bf16 / 2 if fp8 else g_mx
        t = shared + gemm + floor_ms(nbytes)
        out["bounds"].append(dict(floor=name, gemm_ms=gemm, quantize_ms=floor_ms(nbytes), step_ms=t,
                                  bound=t_bf16 / t, target=TARGETS["FP8 current" if fp8 else "MXFP8"],
                                  measured=t_bf16 / (t_fp8 if fp8 else t_mx)))
    return out


def main(argv: Optional[list[str]] = None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=64, choices=[e for e, _ in CONFIGS])
    args = p.parse_args(argv)
    require_cuda()
    r = run(args.experts)
    print(f"### MoE layer bound, {r['experts']} experts x ffn {r['ffn']} (device ms of one step, torch.profiler)\n")
    print(md_table(["quantity", "ms"], [
        ["BF16 baseline step", r["bf16_step_ms"]], ["its grouped GEMMs (aten::_grouped_mm)", r["bf16_gemm_ms"]],
        ["shared rest S", r["shared_ms"]], ["MXFP8 step (one weight Parameter)", r["mxfp8_step_ms"]],
        ["its grouped GEMMs on decoded values", r["mxfp8_gemm_ms"]], ["FP8 current step", r["fp8_step_ms"]],
        ["its grouped FP8 GEMMs (Triton)", r["fp8_gemm_ms"]]]))
    print(f"\ncopy bandwidth {r['copy_GBps']:.0f} GB/s (read + write); {r['quantized_elements'] / 1e9:.3f} G "
          "elements quantized a step\n")
    print(md_table(["floor", "GEMMs ms", "quantize ms", "step ms", "bound x BF16", "target", "measured device-time x BF16"],
                   [[b["floor"], b["gemm_ms"], b["quantize_ms"], b["step_ms"], b["bound"], b["target"], b["measured"]]
                    for b in r["bounds"]]))
    finish("bound_moe", r, args.out)


if __name__ == "__main__":
    main()
