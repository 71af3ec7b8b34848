"""Forward + backward of a Linear and a Llama-3-8B MLP block with hybridfp recipes.

Llama-3-8B MLP: y = down(silu(gate(x)) * up(x)), hidden 4096, intermediate 14336, no bias,
16384 tokens, BF16 parameters and activations; x requires grad (so dgrad of the first layer
runs, as inside a network). Linear: 16384 x 4096 -> 14336. One step = zero grads, forward,
backward with a fixed random dy. hybridfp modules' quantized-weight caches are cleared each
step, so weights are quantized every step as after an optimizer update (torchao does too).

Variants: BF16 eager (nn.Linear), BF16 torch.compile, hybridfp under autocast with
Float8CurrentScaling, Float8BlockScaling, the hybrid per_gemm(fprop="fp8_current",
dgrad="fp8_block", wgrad="fp8_block") as a CustomRecipe, MXFP8BlockScaling, per_gemm(fprop=
"nvfp4", dgrad="mxfp8", wgrad="mxfp8") and NVFP4BlockScaling (NVIDIA's defaults); torchao float8 training
(tensorwise, rowwise) compiled, when torchao imports; hybridfp FP8 current (with and without fprop
fast accumulation) and MXFP8 compiled too. "speedup" = BF16 eager time / time.
For the MLP, "+ fused SwiGLU" rows run the same layers with ``hybridfp.swiglu`` (one Triton
kernel each way) instead of eager ``F.silu(g) * u`` (silu + mul forward, two muls +
silu_backward backward); the BF16 eager baseline stays unfused.

    python -m bench.bench_mlp [--out results.json] [--quick] [--deadline-s S] [--linear-compiled]
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

import hybridfp
from bench import common
from bench.common import bench_ms, bench_ms_steady, bench_pair, copy_bandwidth, environment, finish, md_table, parser, profile_step, require_cuda
from hybridfp.nn.base import QuantizedModule

D, H, TOKENS = 4096, 14336, 16384
HYBRID = hybridfp.factories.per_gemm(fprop="fp8_current", dgrad="fp8_block", wgrad="fp8_block")
NVFP4_MXFP8 = hybridfp.factories.per_gemm(fprop="nvfp4", dgrad="mxfp8", wgrad="mxfp8")
RECIPES = [
    ("hybridfp FP8 current", lambda: hybridfp.Float8CurrentScaling()),
    # torchao's float8 and TE run fprop with cuBLAS fast accumulation: the like-for-like row
    ("hybridfp FP8 current, fprop fast accumulation",
     lambda: hybridfp.Float8CurrentScaling(fprop_fast_accumulation=True)),
    ("hybridfp FP8 block", lambda: hybridfp.Float8BlockScaling()),
    ("hybridfp hybrid FP8-current fwd / FP8-block bwd", lambda: hybridfp.CustomRecipe(qfactory=HYBRID)),
    ("hybridfp MXFP8", lambda: hybridfp.MXFP8BlockScaling()),
    ("hybridfp NVFP4 fwd / MXFP8 bwd", lambda: hybridfp.CustomRecipe(qfactory=NVFP4_MXFP8)),
    ("hybridfp NVFP4 (2D weights, RHT, SR)", lambda: hybridfp.NVFP4BlockScaling()),
]
#: Recipes that also get a row with the fused SwiGLU (models that have an activation).
#: recipes also timed with their weight / grad_output copies kept as codes (``common.decoded_mode``)
CODES_RECIPES = ("hybridfp MXFP8", "hybridfp NVFP4 fwd / MXFP8 bwd")
FUSED_RECIPES = ("hybridfp FP8 current", "hybridfp FP8 block", "hybridfp hybrid FP8-current fwd / FP8-block bwd",
                 "hybridfp MXFP8", "hybridfp NVFP4 fwd / MXFP8 bwd", "hybridfp NVFP4 (2D weights, RHT, SR)")
FUSED = " + fused SwiGLU"
#: recipes also timed with the model under ``torch.compile(fullgraph=True)`` (beside torchao's)
COMPILED_RECIPES = ("hybridfp FP8 current", "hybridfp FP8 current, fprop fast accumulation", "hybridfp MXFP8")
#: Alternating rounds of (BF16 eager, variant) behind each "paired" ratio. The H200's clocks move
#: by several per cent over a run (power limit), so a ratio of two medians taken a minute apart
#: carries that drift; the paired one does not.
PAIR_ROUNDS = 3

Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def eager_swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Llama's activation as eager torch runs it (the baseline)."""
    return F.silu(g) * u


class MLP(nn.Module):
    """Llama's gated MLP with a pluggable linear class and activation ``act(gate, up)``."""

    def __init__(self, linear: Callable[[int, int], nn.Module], d: int, h: int,
                 act: Activation = eager_swiglu) -> None:
        super().__init__()
        self.gate, self.up, self.down = linear(d, h), linear(d, h), linear(h, d)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x), self.up(x)))

    def with_act(self, act: Activation) -> "MLP":
        """The same layers (shared parameters and weight caches) with another activation."""
        twin = copy.copy(self)  # shallow: the submodule dict is shared, ``act`` is twin's own
        twin.act = act
        return twin


def fused_swiglu(model: nn.Module) -> nn.Module:
    """``model`` (an MLP) with hybridfp's fused SwiGLU."""
    return model.with_act(hybridfp.swiglu)


def torch_linear(i: int, o: int) -> nn.Module:
    return nn.Linear(i, o, bias=False, dtype=torch.bfloat16, device=common.DEVICE)


def hybridfp_linear(i: int, o: int) -> nn.Module:
    return hybridfp.Linear(i, o, bias=False, params_dtype=torch.bfloat16, device=common.DEVICE)


def torchao_status() -> tuple[Optional[Any], str]:
    """(torchao.float8 module or None, version or why not)."""
    try:
        import torchao
        import torchao.float8 as f8
        return f8, torchao.__version__
    except Exception as e:  # noqa: BLE001 - any import failure means "no torchao column"
        return None, f"unavailable ({type(e).__name__}: {str(e)[:120]})"


def make_step(model: nn.Module, params: list[nn.Parameter], ctx: Callable[[], Any], x: torch.Tensor,
              dy: torch.Tensor) -> Callable[[], torch.Tensor]:
    hf = [m for m in model.modules() if isinstance(m, QuantizedModule)]

    def step() -> torch.Tensor:
        for p in params:
            p.grad = None
        x.grad = None
        for m in hf:
            m.invalidate_weight_cache()  # re-quantize weights every step (as after an optimizer step)
        with ctx():
            y = model(x)
        y.backward(dy)
        return y
    return step


def bench_model(kind: str, make: Callable[[Callable], nn.Module], x: torch.Tensor, deadline: float,
                compiled: bool, checkpoint: Callable[[list], None] = lambda rows: None,
                fuse: Optional[Callable[[nn.Module], nn.Module]] = None, profile: Optional[str] = None,
                profiles: Optional[list[str]] = None) -> list[dict[str, Any]]:
    """All variants of one model; ratios against BF16 eager / compiled of this process. ``fuse``
    (models with an activation) gives the model with the fused SwiGLU: rows for BF16 eager and
    each of FUSED_RECIPES, each right after its unfused row. Variants whose name contains
    ``profile`` also get a one-step kernel profile appended to ``profiles``."""
    torch.manual_seed(0)
    base = make(torch_linear)
    with torch.no_grad():
        dy = torch.randn_like(base(x))
    variants: list[tuple[str, nn.Module, nn.Module, Callable[[], Any]]] = [
        ("BF16 eager", base, base, contextlib.nullcontext)]
    if fuse is not None:
        variants.append(("BF16 eager + hybridfp fused SwiGLU", fuse(base), base, contextlib.nullcontext))
    hf = make(hybridfp_linear)
    hf.load_state_dict(base.state_dict())
    for name, recipe in RECIPES:
        variants.append((name, hf, hf, lambda r=recipe(): hybridfp.autocast(recipe=r)))
        if fuse is not None and name in FUSED_RECIPES:
            variants.append((name + FUSED, fuse(hf), hf, lambda r=recipe(): hybridfp.autocast(recipe=r)))
        if name in CODES_RECIPES:  # the A/B of copies written as BF16 decodes (the CUDA default)
            variants.append((name + common.CODES_SUFFIX, hf, hf,
                             lambda r=recipe(): common.decoded_mode("never", hybridfp.autocast(recipe=r))))
    if compiled:  # compiled variants last: each checks the deadline before compiling
        variants.append(("BF16 torch.compile", torch.compile(base), base, contextlib.nullcontext))
        for name, recipe in RECIPES:
            if name in COMPILED_RECIPES:  # autocast outside, the model traced whole (fullgraph)
                variants.append((name + " (compiled)", torch.compile(hf, fullgraph=True), hf,
                                 lambda r=recipe(): hybridfp.autocast(recipe=r)))
    f8, why = torchao_status()
    if compiled and f8 is not None:
        for rname in ("tensorwise", "rowwise"):
            m = f8.convert_to_float8_training(copy.deepcopy(base),
                                              config=f8.Float8LinearConfig.from_recipe_name(rname))
            variants.append((f"torchao float8 {rname} (compiled)", torch.compile(m), m, contextlib.nullcontext))
    rows: list[dict[str, Any]] = []
    ref_y = None
    base_step: Optional[Callable[[], Any]] = None  # BF16 eager's, the first variant
    for name, model, plain, ctx in variants:
        row: dict[str, Any] = {"model": kind, "variant": name}
        if "compile" in name and time.monotonic() > deadline:
            rows.append({**row, "error": "skipped: time budget"})
            continue
        try:
            step = make_step(model, list(plain.parameters()), ctx, x, dy)
            t0 = time.monotonic()
            y = step()
            if x.is_cuda:
                torch.cuda.synchronize()
            row["first_step_s"] = time.monotonic() - t0  # includes compilation where compiled
            y = y.detach().float()
            if ref_y is None:
                ref_y = y
            row["rel_err_vs_bf16"] = ((y - ref_y).norm() / ref_y.norm()).item()
            row["ms"] = bench_ms(step, warmup_ms=100, rep_ms=300)
            if base_step is None:
                base_step = step
            elif x.is_cuda:  # the baseline timed right beside this variant: clock drift cancels
                tb, tv = bench_pair(base_step, step, rounds=PAIR_ROUNDS)
                row["paired_speedup_vs_bf16_eager"] = tb / tv
            row["ms_steady"], row["host_ms"] = bench_ms_steady(step)
            if profile and profiles is not None and any(t and t in name for t in profile.split("|")):
                profiles.append(profile_step(step, f"{kind}: {name} ({row['ms']:.2f} ms)"))
        except Exception as e:  # noqa: BLE001 - record the failure, keep the other variants
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        _speedups(rows)
        checkpoint(rows)  # a partial JSON survives a timeout of the whole benchmark
        if x.is_cuda:
            torch.cuda.empty_cache()
    if not (compiled and f8 is not None):
        rows.append({"model": kind, "variant": "torchao float8", "error": why if f8 is None else
                     "not run for this model (compiled variants off)"})
    _speedups(rows)
    return rows


def _speedups(rows: list[dict[str, Any]]) -> None:
    """BF16 eager (and compiled) time / each variant's time, for the rows measured so far."""
    t_eager = next((r["ms"] for r in rows if r["variant"] == "BF16 eager" and "ms" in r), None)
    t_comp = next((r["ms"] for r in rows if r["variant"] == "BF16 torch.compile" and "ms" in r), None)
    t_steady = next((r["ms_steady"] for r in rows if r["variant"] == "BF16 eager" and "ms_steady" in r), None)
    for r in rows:
        if "ms" in r:
            r["speedup_vs_bf16_eager"] = t_eager / r["ms"] if t_eager else None
            r["speedup_vs_bf16_compile"] = t_comp / r["ms"] if t_comp else None
        if "ms_steady" in r:
            r["steady_speedup_vs_bf16_eager"] = t_steady / r["ms_steady"] if t_steady else None


def main(argv=None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--deadline-s", type=float, default=1e9, help="skip compiled variants after this")
    p.add_argument("--linear-compiled", action="store_true", help="also compile the single Linear")
    p.add_argument("--profile", default=None, help="profile one step of the variants whose name contains "
                   "this text ('|' separates alternatives); written to --profile-out")
    p.add_argument("--profile-out", type=Path, default=Path("mlp_profile.txt"))
    p.add_argument("--mlp-only", action="store_true", help="skip the single Linear")
    args = p.parse_args(argv)
    require_cuda()
    warnings.simplefilter("ignore")
    deadline = time.monotonic() + args.deadline_s
    env = environment()
    f8, ao = torchao_status()
    env["torchao"] = ao
    copy_bw = copy_bandwidth()
    d, h, tokens = (256, 512, 512) if args.quick else (D, H, TOKENS)
    x = torch.randn(tokens, d, device=common.DEVICE, dtype=torch.bfloat16, requires_grad=True)

    def report(rows: list[dict[str, Any]], final: bool = False) -> None:
        table = md_table(["model", "variant", "ms", "x BF16 eager", "paired x BF16 eager", "x BF16 compile", "steady ms",
                          "steady x BF16 eager", "host ms", "rel err vs BF16", "first step s"], [
            (r["model"], r["variant"], r.get("ms", r.get("error")), r.get("speedup_vs_bf16_eager"),
             r.get("paired_speedup_vs_bf16_eager"), r.get("speedup_vs_bf16_compile"), r.get("ms_steady"), r.get("steady_speedup_vs_bf16_eager"),
             r.get("host_ms"), r.get("rel_err_vs_bf16"), r.get("first_step_s")) for r in rows])
        md = ("### Linear and Llama-3-8B MLP, forward + backward (median, do_bench)\n\n"
              f"torchao: {ao}. \"x BF16 eager\" = BF16 eager time / time (>1 is faster), times from "
              "do_bench (the L2 flushed before each step; steps queued without waiting, so a host slower "
              "than the GPU shows as idle time). \"paired\": median of BF16 eager / variant over "
              f"{PAIR_ROUNDS} alternating rounds timed right beside each other (clock drift cancels). \"steady\": 20 back-to-back steps as a training loop "
              "runs them, no flush; \"host ms\": the host's time for one step started on an idle GPU "
              "(above ms: host-bound). hybridfp weights are re-quantized every step." + ("" if final else " PARTIAL (the run stopped early).")
              + "\n\n" + table + "\n")
        result = {"env": env, "copy_bandwidth": copy_bw, "rows": rows, "markdown": md}
        if final:
            finish("mlp", result, args.out)
        elif args.out is not None:
            args.out.write_text(json.dumps({"name": "mlp", **result}, indent=1, default=str))

    profiles: list[str] = []
    rows = [] if args.mlp_only else bench_model(f"Linear {tokens}x{d}->{h}", lambda lin: lin(d, h), x, deadline,
                                                args.linear_compiled, report)
    rows += bench_model(f"Llama-3-8B MLP {tokens}x{d}->{h}->{d}", lambda lin: MLP(lin, d, h), x, deadline, True,
                        lambda new: report(rows + new), fuse=fused_swiglu, profile=args.profile,
                        profiles=profiles)
    if profiles:
        args.profile_out.write_text("\n\n".join(profiles))
    report(rows, final=True)


if __name__ == "__main__":
    main()
