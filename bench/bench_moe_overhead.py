"""Per-expert overhead of ``GroupedLinear`` on the CPU: ops dispatched and time per step.

At a shape where per-expert work dominates (64 experts, hidden 64, ffn 128, a few tokens per
expert, some awkward counts and one empty expert), one forward + backward step of a
``GroupedLinear`` under each recipe is timed (median of ``--reps``) and its dispatched torch
ops are counted with a ``TorchDispatchMode`` (every aten op call, views included). Weights are
re-quantized each step (caches cleared, as after an optimizer update). No GPU needed; the
counts say how much host work per step scales with the number of experts. ``--micro-batches N``
runs N forward + backward passes a step in one autocast region (weights quantized once,
gradients accumulating); ``--primary-weights`` builds the layer under
``quantized_model_init`` with FP32 masters laid out by ``MasterWeightOptimizer`` and re-encodes
them once a step, as training runs it. "Gradient accumulations" counts the weight and bias
gradients autograd accumulates into their Parameters a step (each one node of the autograd
graph and, after the first micro-batch, one ``add_`` on the device): one per expert and
micro-batch with a Parameter per expert, one per micro-batch with ``--single-parameter``.
The FP8 block row's GEMMs run on the exact emulation on the CPU (its GPU backend is not
stubbed, so it warns ``EmulatedGemmWarning``): its counts say nothing of its GPU path.

    python -m bench.bench_moe_overhead [--experts 64] [--hidden 64] [--ffn 128] [--reps 20] [--out results.json] [--quick]
        [--cuda-paths [--stub-cublas] [--stub-grouped-mm] [--stub-kernels]] [--profile "bf16 (high_precision)"]
        [--micro-batches 4] [--primary-weights | --single-parameter]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hybridfp
from bench.common import environment, finish, md_table
from hybridfp import factories
from hybridfp.utils.device import clear_step_metadata

RECIPES: dict[str, Callable[[], hybridfp.Recipe]] = {
    "bf16 (high_precision)": lambda: hybridfp.CustomRecipe(qfactory=factories.high_precision),
    "mxfp8": lambda: hybridfp.MXFP8BlockScaling(),
    "fp8 current": lambda: hybridfp.Float8CurrentScaling(),
    "fp8 block": lambda: hybridfp.Float8BlockScaling(),
    "composer-2": lambda: hybridfp.CustomRecipe(qfactory=factories.nvfp4_row_scaled_fwd_mxfp8_bwd),
}


class OpCounter(TorchDispatchMode):
    """Counts aten ops dispatched inside the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def splits_for(experts: int, tokens_per_expert: int) -> list[int]:
    """Uneven counts around ``tokens_per_expert`` (not multiples of 32), expert 1 empty."""
    g = torch.Generator().manual_seed(0)
    s = torch.randint(1, 2 * tokens_per_expert, (experts,), generator=g).tolist()
    s[1] = 0
    return s


def make_step(m: hybridfp.GroupedLinear, x: torch.Tensor, dy: torch.Tensor, splits: list[int],
              recipe: hybridfp.Recipe, micro_batches: int = 1,
              before_step: Optional[Callable[[], None]] = None) -> Callable[[], None]:
    """One step: gradients cleared, the weights re-quantized (``before_step``, default the
    layer's ``invalidate_weight_cache``), then ``micro_batches`` forward + backward passes in
    one autocast region, each routing anew (its step metadata built again)."""
    def step() -> None:
        m.zero_grad(set_to_none=True)
        x.grad = None
        (before_step or m.invalidate_weight_cache)()
        with hybridfp.autocast(recipe=recipe):
            for _ in range(micro_batches):
                clear_step_metadata()
                m(x, splits).backward(dy)
    return step


def primary_weights_layer(recipe: hybridfp.Recipe, experts: int, hidden: int, ffn: int
                          ) -> tuple[hybridfp.GroupedLinear, list[torch.Tensor], Callable[[], None]]:
    """(layer, masters, re-encode): a ``GroupedLinear`` built under
    ``quantized_model_init(recipe=recipe)``, its FP32 masters laid out by
    ``MasterWeightOptimizer`` (one buffer a joined layer) and the re-encode of its weights from
    them, as the optimizer's ``step`` runs it after an update."""
    with hybridfp.quantized_model_init(recipe=recipe):
        m = hybridfp.GroupedLinear(experts, hidden, ffn, bias=False, params_dtype=torch.bfloat16)
    weights = list(m.weights())
    opt = hybridfp.MasterWeightOptimizer(torch.optim.SGD, weights, lr=0.0)
    masters = [opt.master_of(w) for w in weights]
    return m, masters, lambda: hybridfp.quantize_master_weights(weights, masters)


def accumulations_per_step(m: torch.nn.Module, step: Callable[[], None]) -> int:
    """Gradients autograd accumulates into ``m``'s Parameters during one call of ``step``
    (``register_post_accumulate_grad_hook``: one per Parameter and backward pass)."""
    count = [0]

    def hook(_: torch.Tensor) -> None:
        count[0] += 1
    handles = [p.register_post_accumulate_grad_hook(hook) for p in m.parameters() if p.requires_grad]
    try:
        step()
    finally:
        for h in handles:
            h.remove()
    return count[0]


def measure(step: Callable[[], None], reps: int) -> tuple[float, int]:
    """(median ms per step, ops dispatched in one step)."""
    step()  # warm-up (quantizers built, reports issued)
    counter = OpCounter()
    with counter:
        step()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), sum(counter.ops.values())


def layer_step(recipe: hybridfp.Recipe, experts: int, hidden: int = 64, ffn: int = 128,
               tokens_per_expert: int = 24, single_parameter: bool = False) -> Callable[[], None]:
    """One forward + backward step of a fresh ``GroupedLinear`` (seeded) on the CPU, with
    ``splits_for``'s counts."""
    torch.manual_seed(0)
    splits = splits_for(experts, tokens_per_expert)
    m = hybridfp.GroupedLinear(experts, hidden, ffn, bias=False, params_dtype=torch.bfloat16,
                               single_parameter=single_parameter)
    x = torch.randn(sum(splits), hidden, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(sum(splits), ffn, dtype=torch.bfloat16)
    return make_step(m, x, dy, splits, recipe)


def ops_per_step(recipe: hybridfp.Recipe, experts: int, hidden: int = 64, ffn: int = 128,
                 tokens_per_expert: int = 24) -> int:
    """Aten ops one forward + backward step dispatches (after a warm-up step), on the CPU."""
    step = layer_step(recipe, experts, hidden, ffn, tokens_per_expert)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step()
        counter = OpCounter()
        with counter:
            step()
    return sum(counter.ops.values())


def stub_kernels(setattr: Callable = setattr, launches: Optional[Counter] = None) -> None:
    """This process only (a measuring switch): the fused kernels taken as on CUDA (the quantize
    kernels: ``quantizers.fast.device_ok`` true for any high-precision tensor; ``hybridfp.swiglu``'s
    for its kernel dtypes), every Triton launch a no-op (compiled or interpreted; what it would
    write stays unwritten), so a step's host work is what the GPU's path runs in Python and aten.
    Pair it with ``stub_cublas`` and ``stub_grouped_mm``. ``launches``: each no-op launch counted
    there under its kernel's name."""
    import importlib

    import triton.runtime.interpreter as interpreter
    import triton.runtime.jit as jit

    from hybridfp.formats.common import HIGH_PRECISION_DTYPES
    from hybridfp.quantizers import fast

    # the module, not the function ``hybridfp.nn.swiglu`` that the package's namespace exports
    swiglu = importlib.import_module("hybridfp.nn.swiglu")

    def no_launch(self, *args, **kwargs):
        if launches is not None:
            launches[getattr(self, "__name__", None) or getattr(getattr(self, "fn", None), "__name__", "?")] += 1
        return None

    setattr(jit.JITFunction, "run", no_launch)
    setattr(interpreter.InterpretedFunction, "run", no_launch)
    setattr(fast, "device_ok", lambda x, rows=None: x.dtype in HIGH_PRECISION_DTYPES)
    setattr(swiglu, "_uses_kernels", lambda g: g.dtype in swiglu.KERNEL_DTYPES)


def python_calls_per_step(recipe: hybridfp.Recipe, experts: int, hidden: int = 64, ffn: int = 128,
                          tokens_per_expert: int = 24, single_parameter: bool = False) -> int:
    """Python function calls (``sys.setprofile`` "call" events: frames, generator steps
    included) one forward + backward step makes after a warm-up step, on the CPU: a
    deterministic measure of the host's Python work, unlike its time on a shared machine."""
    step = layer_step(recipe, experts, hidden, ffn, tokens_per_expert, single_parameter)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step()
        return python_calls(step)


def python_calls(step: Callable[[], None]) -> int:
    """Python function calls (``sys.setprofile`` "call" events) one call of ``step`` makes (warm
    it up first: a first step builds quantizers and reports)."""
    import sys

    calls = [0]

    def count(frame, event, arg):
        if event == "call":
            calls[0] += 1
    sys.setprofile(count)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls[0]


def stub_cublas(setattr: Callable = setattr, launches: Optional[Counter] = None) -> None:
    """This process only (a measuring switch): the cuBLAS FP8 backends selected as on an sm90 GPU,
    ``torch._scaled_mm`` / ``torch._scaled_grouped_mm`` replaced by stubs that return an output of
    the right shape (no values), the grouped rowwise FP8 path refused for E5M2 operands as on
    the GPU, and the Triton grouped paths taken as on CUDA (from the policy's ``many_experts``
    experts), their
    launches stubbed (the output returned unwritten). What remains of a step's time is the host's Python and aten work of the GPU path.
    ``setattr``: how to patch (a test passes pytest's ``monkeypatch.setattr`` to undo it);
    ``launches``: each stubbed GEMM counted there by its name."""
    from hybridfp.gemm import fast
    from hybridfp.moe import gemm as grouped

    def scaled_mm(a, b, scale_a=None, scale_b=None, bias=None, out_dtype=None, use_fast_accum=False, out=None):
        if launches is not None:  # inline: no frame of its own in the counted calls
            launches["torch._scaled_mm"] += 1
        return out if out is not None else torch.empty(a.shape[0], b.shape[1], dtype=out_dtype)

    def scaled_grouped_mm(a, b, scale_a, scale_b, offs=None, out_dtype=None, use_fast_accum=False):
        if launches is not None:  # inline: no frame of its own in the counted calls
            launches["torch._scaled_grouped_mm"] += 1
        return torch.empty(a.shape[0], b.shape[-1], dtype=out_dtype)

    def rowwise_unsupported(sa, sb, layout, device):
        da, db = grouped.LAYOUTS[layout]
        dtypes = {s.payload(da)["data"].dtype for s in sa} | {s.payload(db)["data"].dtype for s in sb}
        return None if dtypes == {torch.float8_e4m3fn} else "E4M3 only"

    from hybridfp.moe import gemm_triton as grouped_triton
    from hybridfp.kernels.moe import triton_grouped_fp8_gemm, triton_grouped_gemm

    cuda_rule = grouped_triton.enabled

    def enabled(device, use_triton, experts=1, flops=None):  # the CUDA rule on any device
        return cuda_rule(torch.device("cuda"), use_triton, experts, flops)

    setattr(grouped_triton, "enabled", enabled)

    def fp8_launch(*a):  # (base_a, base_b, sa, sb, bias, out, ...)
        if launches is not None:  # inline: no frame of its own in the counted calls
            launches["grouped FP8 GEMM (Triton)"] += 1
        return a[5]

    def launch(a, b, out, *rest, **kw):
        if launches is not None:  # inline: no frame of its own in the counted calls
            launches["grouped GEMM (Triton)"] += 1
        return out

    setattr(triton_grouped_fp8_gemm, "_launch", fp8_launch)
    setattr(triton_grouped_gemm, "_launch", launch)
    setattr(fast, "_device_ok", lambda device, kind: True)
    setattr(torch, "_scaled_mm", scaled_mm)
    setattr(torch, "_scaled_grouped_mm", scaled_grouped_mm)
    setattr(grouped, "_fp8_rowwise_unsupported", rowwise_unsupported)


def stub_grouped_mm(setattr: Callable = setattr, launches: Optional[Counter] = None) -> None:
    """This process only: ``torch._grouped_mm`` replaced by a stub returning an output of the
    right shape (2D x 3D: [M, N]; 2D x 2D: [G, M, N]), so a step's time is host work only (the
    CPU's grouped matmul of the BF16 path otherwise takes a third of it). ``launches``: each
    call counted there as ``torch._grouped_mm``."""
    def grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
        if launches is not None:
            launches["torch._grouped_mm"] += 1
        dtype = out_dtype or a.dtype
        if b.dim() == 3:
            return torch.empty(a.shape[0], b.shape[-1], dtype=dtype)
        return torch.empty(offs.shape[0], a.shape[0], b.shape[1], dtype=dtype)

    setattr(torch, "_grouped_mm", grouped_mm)
    from hybridfp.moe import gemm as grouped
    setattr(grouped, "per_group_wins", lambda sizes: False)  # every group through the stub, whatever its size


def stub_gpu_paths(setattr: Callable = setattr, launches: Optional[Counter] = None) -> None:
    """This process only (a measuring switch): the GPU's code paths on the CPU with the GPU's work
    stubbed, as ``--cuda-paths --stub-cublas --stub-grouped-mm --stub-kernels`` take them: the
    grouped GEMM paths chosen as on CUDA, ``stub_cublas``, ``stub_grouped_mm``, ``stub_kernels``.
    ``setattr`` and ``launches`` as theirs. Run the step under ``hybridfp.policy(decoded_copies=
    "always")`` (the copies the GPU's kernels write)."""
    from hybridfp.moe import gemm as grouped

    setattr(grouped, "_grouped_mm_device", lambda device: True)
    stub_cublas(setattr, launches)
    stub_grouped_mm(setattr, launches)
    stub_kernels(setattr, launches)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--tokens-per-expert", type=int, default=24)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", type=Path, default=None, help="write the results JSON here")
    p.add_argument("--quick", action="store_true", help="5 repetitions")
    p.add_argument("--cuda-paths", action="store_true", help="take the grouped GEMM paths the GPU takes "
                   "(torch._grouped_mm on the CPU; decodes still the PyTorch reference) to see the host "
                   "work of the CUDA path")
    p.add_argument("--stub-cublas", action="store_true", help="with --cuda-paths: also take the cuBLAS FP8 "
                   "backends the GPU takes (per-expert / grouped FP8 GEMMs), their matmuls replaced by "
                   "shape-only stubs, so the time is the host work of the GPU's FP8 path")
    p.add_argument("--stub-grouped-mm", action="store_true", help="with --cuda-paths: torch._grouped_mm "
                   "replaced by a shape-only stub too (the step's time is then host work only)")
    p.add_argument("--stub-kernels", action="store_true", help="with --cuda-paths: the fused quantize "
                   "kernels taken as on CUDA, every Triton launch a no-op (``stub_kernels``)")
    p.add_argument("--single-parameter", action="store_true", help="GroupedLinear(single_parameter=True): "
                   "one [E, N, K] weight Parameter instead of one per expert")
    p.add_argument("--micro-batches", type=int, default=1, help="forward + backward passes a step (weights "
                   "quantized once a step, gradients accumulating; default 1)")
    p.add_argument("--primary-weights", action="store_true", help="quantized primary weights: the layer built "
                   "under quantized_model_init, re-encoded from FP32 masters once a step (not with "
                   "--single-parameter, which quantized_model_init refuses)")
    p.add_argument("--profile", default=None, help="cProfile one recipe (its name) and print the top 30 "
                   "functions by own time")
    args = p.parse_args(argv)
    if args.micro_batches < 1:
        p.error(f"--micro-batches must be at least 1; got {args.micro_batches}")
    if args.primary_weights and args.single_parameter:
        p.error("--primary-weights with --single-parameter: quantized_model_init refuses a single_parameter "
                "layer; pick one")
    if args.quick:
        args.reps = 5
    warnings.simplefilter("ignore")
    if args.cuda_paths:
        from hybridfp.moe import gemm as grouped
        grouped._grouped_mm_device = lambda device: True  # this process only: a measuring switch
        if args.stub_cublas:
            stub_cublas()
        if args.stub_grouped_mm:
            stub_grouped_mm()
        if args.stub_kernels:
            stub_kernels()
    # with --stub-kernels: the copies the GPU's kernels write
    with hybridfp.policy(decoded_copies="always" if args.cuda_paths and args.stub_kernels else "auto"):
        torch.manual_seed(0)
        splits = splits_for(args.experts, args.tokens_per_expert)
        plain = hybridfp.GroupedLinear(args.experts, args.hidden, args.ffn, bias=False,
                                       params_dtype=torch.bfloat16, single_parameter=args.single_parameter)
        x = torch.randn(sum(splits), args.hidden, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(sum(splits), args.ffn, dtype=torch.bfloat16)
        head = (f"{args.experts} experts, hidden {args.hidden}, ffn {args.ffn}, {sum(splits)} tokens, "
                f"{args.micro_batches} micro-batch(es) a step"
                + (", quantized primary weights" if args.primary_weights else "")
                + (", one weight Parameter" if args.single_parameter else "")
                + f", torch {torch.__version__}, {torch.get_num_threads()} threads")
        rows = []
        for name, recipe in RECIPES.items():
            m, before = plain, None
            if args.primary_weights:
                torch.manual_seed(0)
                m, _, before = primary_weights_layer(recipe(), args.experts, args.hidden, args.ffn)
            step = make_step(m, x, dy, splits, recipe(), args.micro_batches, before)
            ms, ops = measure(step, args.reps)
            accumulations = accumulations_per_step(m, step)
            calls = python_calls(step)
            rows.append(dict(recipe=name, ms=ms, ops=ops, ops_per_expert=ops / args.experts, python_calls=calls,
                             grad_accumulations=accumulations))
            if name == args.profile:
                import cProfile
                import pstats
                prof = cProfile.Profile()
                prof.runcall(lambda: [step() for _ in range(args.reps)])
                pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        md = (f"### GroupedLinear host work per step on the CPU ({head})\n\n"
              + md_table(["recipe", "ms / step", "ops / step", "ops / expert", "Python calls / step",
                          "gradient accumulations / step"],
                         [(r["recipe"], r["ms"], r["ops"], r["ops_per_expert"], r["python_calls"],
                           r["grad_accumulations"]) for r in rows]) + "\n")
        finish("moe_overhead", {"env": environment(), "args": {k: v for k, v in vars(args).items() if k != "out"},
                                "rows": rows, "markdown": md}, args.out)


if __name__ == "__main__":
    main()
