"""Diagnosis (H200): where the host time of a 64-expert ``bench_moe`` step goes, by phase.

cProfile inflates every Python call several times over and cannot see time spent in aten
dispatch and CUDA launches as such; a CPU run cannot see the launches at all. This wraps a
handful of functions of the GPU path in wall-clock timers (inclusive, nested: a phase's time
includes the phases it calls), runs ``--steps`` steps of ``bench_moe``'s layer per recipe, each
started on an idle GPU, and reports host milliseconds per step for every phase, with the step's
and the BF16 baseline's host time for reference.

    python -m bench.diag_moe_host_phases [--experts 64] [--steps 10] [--recipe TEXT] [--deep]
"""

from __future__ import annotations

import functools
import time
import warnings
from collections import defaultdict
from typing import Any, Callable, Optional

import torch

import hybridfp
from bench import bench_moe, common
from bench.bench_moe import CONFIGS, RECIPES, make_step, moe_layer
from bench.common import finish, md_table, parser, require_cuda
from hybridfp.nn import grouped_linear

TIMES: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)


def _timed(name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name] += time.perf_counter() - t0
            CALLS[name] += 1
    return run


def instrument() -> None:
    """Wrap the phases (this process only)."""
    gl = grouped_linear
    for attr in ("quantize_grouped", "quantize_weights_grouped", "grouped_gemm", "save_experts",
                 "restore_experts", "_quantize_inputs", "_quantize_grads", "_wgrads", "_saved_inputs"):
        setattr(gl, attr, _timed(attr, getattr(gl, attr)))
    fn = gl.GroupedLinearFunction
    fn.forward = staticmethod(_timed("GroupedLinearFunction.forward", fn.forward))
    fn.backward = staticmethod(_timed("GroupedLinearFunction.backward", fn.backward))
    for cls, attr in ((gl.GroupedLinear, "quantized_weights"), (gl.GroupedLinear, "quantizers"),
                      (gl.GroupedLinear, "forward"), (bench_moe.Routing, "__init__"),
                      (bench_moe.HybridMoE, "forward")):
        setattr(cls, attr, _timed(f"{cls.__name__}.{attr}", getattr(cls, attr)))
    torch.autograd.backward = _timed("torch.autograd.backward", torch.autograd.backward)


#: ``--deep``: inner functions wrapped too, as (module, attribute) — a module-level function is
#: patched in every module that calls it by name (its own and the importers)
DEEP = [
    ("hybridfp.quantizers.grouped", "_plan"), ("hybridfp.quantizers.grouped", "_quantize_planned"),
    ("hybridfp.quantizers.grouped", "_assemble"), ("hybridfp.quantizers.grouped", "encode_padded_columns"),
    ("hybridfp.quantizers.grouped", "pad_row_groups"), ("hybridfp.quantizers.grouped", "padded_row_index"),
    ("hybridfp.quantizers.grouped", "_row_map"), ("hybridfp.quantizers.grouped", "_worth_stacking"),
    ("hybridfp.gemm.grouped_triton", "padded_row_index"),
    ("hybridfp.quantizers.grouped", "device_tensor"), ("hybridfp.quantizers.grouped_scaled", "device_tensor"),
    ("hybridfp.gemm.grouped", "device_tensor"), ("hybridfp.gemm.grouped_bf16", "device_tensor"),
    ("hybridfp.gemm.grouped", "_run_joined"), ("hybridfp.gemm.grouped_joined", "_wgrad"),
    ("hybridfp.gemm.grouped_joined", "_weights_kn"), ("hybridfp.gemm.bf16_decode", "decode_bf16"),
    ("hybridfp.gemm.bf16_decode", "decode_bf16_joined"), ("hybridfp.tensors.slicing", "adjacent_rows"),
    ("hybridfp.quantizers.grouped", "adjacent_rows"), ("hybridfp.nn.grouped_linear", "adjacent_rows"),
    # FP8 current scaling's grouped path (its 64-expert host time is twice MXFP8's)
    ("hybridfp.quantizers.grouped", "encode_group_scaled"), ("hybridfp.quantizers.grouped_scaled", "_row_groups"),
    ("hybridfp.kernels.triton_grouped_fp8", "group_amax"), ("hybridfp.kernels.triton_grouped_fp8", "quantize"),
    ("hybridfp.kernels.triton_grouped_fp8_gemm", "grouped_fp8_at"), ("hybridfp.kernels.triton_grouped_fp8_gemm", "_launch"),
    ("hybridfp.kernels.triton_grouped_fp8_gemm", "tile_plan"), ("hybridfp.gemm.grouped_fp8", "run_joined"),
    # grouped_gemm's own pieces (BF16 high_precision's grouped_gemm took ~450 us a call, s24)
    ("hybridfp.gemm.grouped", "_torch_path"), ("hybridfp.gemm.grouped", "run_joined"),
    ("hybridfp.gemm.grouped", "torch_grouped_mm"), ("hybridfp.gemm.grouped", "_fp8_joined_path"),
    ("hybridfp.gemm.grouped_bf16", "offsets"),
    ("hybridfp.nn.grouped_linear", "_wgrads"), ("hybridfp.gemm.grouped_joined", "_wgrad_result"),
    ("hybridfp.kernels.triton_grouped_fp8_gemm", "launch_tma"),
]


def instrument_deep() -> None:
    """Wrap ``DEEP`` and every Triton launch (``JITFunction.run``) too."""
    import importlib

    import triton.runtime.jit as jit

    for mod, attr in DEEP:
        m = importlib.import_module(mod)
        setattr(m, attr, _timed(f"{attr} ({mod.rsplit('.', 1)[-1]})" if attr == "device_tensor" else attr,
                                getattr(m, attr)))
    jit.JITFunction.run = _timed("Triton launch (JITFunction.run)", jit.JITFunction.run)


def host_phases(step: Callable[[], Any], steps: int) -> tuple[float, dict[str, tuple[float, float]]]:
    """(host ms per step, phase -> (calls per step, host ms per step)); each step starts on an
    idle GPU."""
    TIMES.clear()
    CALLS.clear()
    total = 0.0
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        total += time.perf_counter() - t0
    torch.cuda.synchronize()
    return total * 1e3 / steps, {k: (CALLS[k] / steps, TIMES[k] * 1e3 / steps) for k in TIMES}


def aten_host(step: Callable[[], Any], steps: int, top: int) -> list[tuple[str, float, float]]:
    """The ``top`` aten ops by self CPU time per step over ``steps`` steps (torch.profiler, CPU
    activity only: what each op costs the host, launches included), as (op, calls, ms) a step."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    ops = [e for e in prof.key_averages() if e.key.startswith("aten::") or e.key.startswith("cuda")]
    ops.sort(key=lambda e: -e.self_cpu_time_total)
    return [(e.key, e.count / steps, e.self_cpu_time_total / 1e3 / steps) for e in ops[:top]]


def main(argv: Optional[list[str]] = None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--recipe", default=None, help="only recipes whose name contains this text")
    p.add_argument("--deep", action="store_true", help="also time inner functions (``DEEP``) and Triton launches")
    p.add_argument("--single-parameter", action="store_true", help="GroupedLinear(single_parameter=True): one "
                   "[E, N, K] weight Parameter a layer")
    p.add_argument("--aten", type=int, default=0, help="also list the N aten ops with the most host (self CPU) "
                   "time a step (torch.profiler, CPU activity only)")
    args = p.parse_args(argv)
    require_cuda()
    warnings.simplefilter("ignore")
    f = dict(CONFIGS)[args.experts]
    base, model, x, dy = moe_layer(args.experts, f, single_parameter=args.single_parameter)
    base_step = make_step(base, x, dy, None)
    for _ in range(3):
        base_step()
    base_ms, _ = host_phases(base_step, args.steps)
    instrument()
    if args.deep:
        instrument_deep()
    tables = []
    for name, make in RECIPES:
        if args.recipe and args.recipe not in name:
            continue
        recipe = make()
        step = make_step(model, x, dy, lambda r=recipe: hybridfp.autocast(recipe=r))
        for _ in range(3):
            step()
        ms, phases = host_phases(step, args.steps)
        rows = [("step", 1, ms)] + [(k, c, t) for k, (c, t) in sorted(phases.items(), key=lambda kv: -kv[1][1])]
        tables.append(f"#### {name}: host {ms:.2f} ms a step (BF16 grouped baseline {base_ms:.2f} ms)\n\n"
                      + md_table(["phase (inclusive)", "calls / step", "host ms / step"], rows))
        if args.aten:
            tables.append(f"{name}, aten ops by host self time (profiled: times inflated alike)\n\n"
                          + md_table(["aten op", "calls / step", "self host ms / step"],
                                     aten_host(step, args.steps, args.aten)))
        torch.cuda.empty_cache()
    md = (f"### Host time by phase, {args.experts} experts (ffn {f}), {args.steps} steps each started on an "
          f"idle GPU{', one weight Parameter a layer' if args.single_parameter else ''}\n\n" + "\n\n".join(tables) + "\n")
    finish("diag_moe_host_phases", {"env": common.environment(), "markdown": md}, args.out)


if __name__ == "__main__":
    main()
