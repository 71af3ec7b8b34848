"""Forward + backward of an MoE FFN layer: hybridfp GroupedLinear recipes vs BF16 grouped GEMMs.

Layer (16384 tokens, hidden 4096): a router in FP32 (logits, softmax, top-2), token
permutation (sort the 2 x 16384 assignments by expert), SwiGLU experts as two grouped
linears — gate+up fused [2F, D] then down [D, F], no bias — and the weighted un-permutation
(index_add). Configs: 8 experts F = 14336, 64 experts F = 1408. One step = zero grads,
forward, backward with a fixed random dy; hybridfp's quantized-weight caches are cleared each
step (weights re-quantized as after an optimizer update).

Variants: "BF16 grouped" — the same layer with stacked [E, out, in] BF16 weights and
``torch._grouped_mm`` directly (the fair baseline, the ratio's denominator); hybridfp
GroupedLinear (BF16 parameters) under CustomRecipe(high_precision), Float8CurrentScaling,
MXFP8BlockScaling and the Composer-2 factory nvfp4_row_scaled_fwd_mxfp8_bwd, each also with
``GroupedLinear(single_parameter=True)`` ("[one weight Parameter]"). "x BF16 grouped" = baseline
time / time (>1 is faster). "paths": which ``grouped_gemm`` path each GEMM took. With ``--ab``,
extra rows (suffixes) time a recipe again with one switch flipped in the same process, e.g.
"[cuBLAS per expert BF16]": path 1's grouped BF16 GEMMs as cuBLAS per expert.

    python -m bench.bench_moe [--experts 8|64] [--paired] [--micro-batches N] [--ab] [--variants 'A|B']
        [--out results.json] [--quick] [--profile TEXT [--profile-out FILE]]
"""

from __future__ import annotations

from contextlib import nullcontext

import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

import hybridfp
from bench import common
from bench.common import bench_ms, bench_ms_steady, bench_pair, environment, finish, md_table, parser, profile_step, require_cuda
from hybridfp.moe.gemm import PATH_COUNTS
from hybridfp.nn.base import QuantizedModule
from hybridfp.utils.device import clear_step_metadata

TOKENS, HIDDEN, TOP_K = 16384, 4096, 2
CONFIGS = [(8, 14336), (64, 1408)]
RECIPES: list[tuple[str, Callable[[], hybridfp.Recipe]]] = [
    ("hybridfp BF16 (high_precision)", lambda: hybridfp.CustomRecipe(qfactory=hybridfp.factories.high_precision)),
    ("hybridfp FP8 current", lambda: hybridfp.Float8CurrentScaling()),
    ("hybridfp MXFP8", lambda: hybridfp.MXFP8BlockScaling()),
    ("hybridfp Composer-2 (NVFP4 row-scaled fwd / MXFP8 bwd)",
     lambda: hybridfp.CustomRecipe(qfactory=hybridfp.factories.nvfp4_row_scaled_fwd_mxfp8_bwd)),
]
TARGETS = {"hybridfp FP8 current": 1.30, "hybridfp MXFP8": 0.90,
           "hybridfp Composer-2 (NVFP4 row-scaled fwd / MXFP8 bwd)": 0.90}
#: ``--ab``: recipes timed twice more: with grouped_gemm's Triton path forced on and forced off
#: on CUDA (its default there: from the policy's many_experts experts on). FP8 per-tensor
#: pairs keep cuBLAS FP8 and MXFP8 takes torch._grouped_mm: only Composer-2's row-scaled NVFP4
#: fprop is a candidate.
TRITON_VARIANTS = ("hybridfp Composer-2 (NVFP4 row-scaled fwd / MXFP8 bwd)",)
TRITON_SUFFIX = " [Triton grouped]"
PER_EXPERT_SUFFIX = " [per-expert GEMMs]"
#: recipes timed a second time with each expert's weight its own tensor (GroupedLinear
#: ``pack_weights=False``): big per-tensor-scaled weights are then quantized one by one instead
#: of through the grouped quantization of the joined buffer (moe/quantize_weights._worth_stacking)
UNPACKED_VARIANTS = ("hybridfp FP8 current",)
#: FP8 per-tensor timed twice more: with the Triton FP8 grouped GEMM taking fprop too (instead
#: of torch._scaled_grouped_mm: the policy's over_scaled_grouped_mm), and with the per-expert
#: cuBLAS loop for the GEMMs it takes by default at many experts (PER_EXPERT_SUFFIX)
FP8_TRITON_VARIANTS = ("hybridfp FP8 current",)
FP8_TRITON_SUFFIX = " [FP8 Triton grouped everywhere]"
UNPACKED_SUFFIX = " [unpacked weights]"
#: recipes timed a second time with their weight / grad_output copies kept as codes and scales
#: (``hybridfp.policy(decoded_copies="never")``) instead of written as BF16 decodes by the
#: quantize kernels (the CUDA default where every GEMM decodes them)
CODES_VARIANTS = ("hybridfp MXFP8", "hybridfp Composer-2 (NVFP4 row-scaled fwd / MXFP8 bwd)")
CODES_SUFFIX = common.CODES_SUFFIX
#: recipes timed twice more with path 1's grouped BF16 GEMMs forced to cuBLAS per expert and to
#: one CUTLASS ``torch._grouped_mm`` (the policy's ``bf16_per_group_cublas``; the
#: default, None, picks by size: ``grouped.per_group_wins``)
PER_GROUP_VARIANTS = ("hybridfp MXFP8", "hybridfp Composer-2 (NVFP4 row-scaled fwd / MXFP8 bwd)")
PER_GROUP_SUFFIX = " [cuBLAS per expert BF16]"
CUTLASS_SUFFIX = " [CUTLASS grouped BF16]"
#: recipes timed again with quantize_grouped's plan memo off (every call plans afresh): the host
#: time the memo saves
PLAN_VARIANTS = ("hybridfp MXFP8", "hybridfp Composer-2 (NVFP4 row-scaled fwd / MXFP8 bwd)")
NO_PLAN_MEMO_SUFFIX = " [plans not remembered]"
#: ... and with the routing's metadata (offsets, padded-row indexes, row maps) built at every use
#: instead of once a pass (``utils.device.step_metadata``)
NO_METADATA_MEMO_SUFFIX = " [metadata not shared]"
#: The same recipes with ``GroupedLinear(single_parameter=True)``: one [E, N, K] weight Parameter
#: a layer (as the baseline holds them) instead of one per expert.
SINGLE_PARAM_VARIANTS = tuple(name for name, _ in RECIPES)
SINGLE_PARAM_SUFFIX = " [one weight Parameter]"
#: with ``--micro-batches N`` (N > 1) every recipe, the baseline included, is timed a second time
#: as N micro-batches per weight update (gradient accumulation: the weights are quantized once
#: for N forward + backward passes); those rows' ratios are against the baseline's N-micro-batch row
MICRO_SUFFIX = " [{n} micro-batches a weight update]"
#: FP8 current timed again with the grouped FP8 GEMM's pointer kernel (the policy's
#: grouped_fp8_tma_rows / grouped_fp8_tma_wgrad set to FP8_TMA: None, None; ``--fp8-tma
#: ROWS/WGRAD`` names TMA configs instead),
#: on the per-expert and the one-Parameter layer, against the TMA kernel (the default)
FP8_TMA_VARIANTS = ("hybridfp FP8 current",)
FP8_TMA_SUFFIX = " [FP8 pointer grouped GEMM]"
FP8_TMA: list = [None, None]
#: ``--paired``: rounds of (baseline, variant) timed alternately for the "paired" ratio
PAIR_ROUNDS = 3


def with_per_group_cublas(step: Callable[[], torch.Tensor], on: bool) -> Callable[[], torch.Tensor]:
    """``step`` under the policy's ``bf16_per_group_cublas`` set to ``on``."""
    def run() -> torch.Tensor:
        with hybridfp.policy(bf16_per_group_cublas=on):
            return step()
    return run


def without_plan_memo(step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``step`` with GroupedLinear's plan memo not passed to ``quantize_grouped`` (every call
    plans afresh; restored after each call)."""
    from hybridfp.moe import grouped_linear_function, grouped_weights
    modules = (grouped_linear_function, grouped_weights)

    def run() -> torch.Tensor:
        saved = [m.plan_memo for m in modules]
        for m in modules:
            m.plan_memo = lambda module: None
        try:
            return step()
        finally:
            for m, memo in zip(modules, saved):
                m.plan_memo = memo
    return run


def without_metadata_memo(step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``step`` with ``step_metadata`` building its tensor at every call (restored after each call)."""
    from hybridfp.moe import gemm_bf16 as grouped_bf16
    from hybridfp.moe import quantize as qgrouped

    def run() -> torch.Tensor:
        saved = qgrouped.step_metadata, grouped_bf16.step_metadata
        qgrouped.step_metadata = grouped_bf16.step_metadata = lambda key, device, build: build()
        try:
            return step()
        finally:
            qgrouped.step_metadata, grouped_bf16.step_metadata = saved
    return run


def with_fp8_tma(step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``step`` with the grouped FP8 GEMM's kernels set by ``FP8_TMA`` (rows / wgrad: a TMA
    config name or None for the pointer kernel)."""
    def run() -> torch.Tensor:
        with hybridfp.policy(grouped_fp8_tma_rows=FP8_TMA[0], grouped_fp8_tma_wgrad=FP8_TMA[1]):
            return step()
    return run


def with_triton_grouped(step: Callable[[], torch.Tensor], on: bool,
                        fp8_everywhere: bool = False) -> Callable[[], torch.Tensor]:
    """``step`` (forward and backward) with the Triton grouped paths on CUDA taken for any
    number of experts (``on``) or for none; ``fp8_everywhere``: the FP8 grouped GEMM also for
    the E4M3 GEMMs torch._scaled_grouped_mm takes by default."""
    def run() -> torch.Tensor:
        pol = hybridfp.current_policy()
        changes = (dict(grouped_triton_devices=pol.grouped_triton_devices | {"cuda"}) if on
                   else dict(many_experts=1 << 30))
        with hybridfp.policy(over_scaled_grouped_mm=fp8_everywhere, **changes):
            return step()
    return run


class Routing:
    """Top-k routing in FP32 and the permutation that groups the assignments by expert."""

    def __init__(self, x: torch.Tensor, router: torch.Tensor, top_k: int) -> None:
        logits = x.float() @ router.float().t()
        probs, experts = torch.softmax(logits, -1).topk(top_k, dim=-1)
        flat = experts.reshape(-1)
        self.order = torch.argsort(flat, stable=True)
        self.token = self.order // top_k  # token of each permuted row
        self.weight = probs.reshape(-1)[self.order]
        self.counts = torch.bincount(flat, minlength=router.shape[0])
        self.offs = self.counts.cumsum(0).to(torch.int32)

    def permute(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.token]

    def unpermute(self, y: torch.Tensor, tokens: int) -> torch.Tensor:
        out = y.new_zeros(tokens, y.shape[-1])
        return out.index_add(0, self.token, y * self.weight.to(y.dtype)[:, None])


def swiglu(h: torch.Tensor) -> torch.Tensor:
    g, u = h.chunk(2, dim=-1)
    return F.silu(g) * u


class BF16MoE(nn.Module):
    """The baseline: stacked expert weights, torch._grouped_mm (BF16, autograd)."""

    def __init__(self, e: int, d: int, f: int) -> None:
        super().__init__()
        self.router = nn.Parameter(torch.randn(e, d, device=common.DEVICE) * d ** -0.5)
        self.w1 = nn.Parameter(torch.randn(e, 2 * f, d, device=common.DEVICE, dtype=torch.bfloat16) * d ** -0.5)
        self.w2 = nn.Parameter(torch.randn(e, d, f, device=common.DEVICE, dtype=torch.bfloat16) * f ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = Routing(x, self.router, TOP_K)
        h = torch._grouped_mm(r.permute(x), self.w1.transpose(1, 2), offs=r.offs)
        y = torch._grouped_mm(swiglu(h), self.w2.transpose(1, 2), offs=r.offs)
        return r.unpermute(y, x.shape[0])


class HybridMoE(nn.Module):
    """The same layer with two hybridfp GroupedLinear (weights copied from the baseline)."""

    def __init__(self, base: BF16MoE, pack_weights: bool = True, single_parameter: bool = False) -> None:
        super().__init__()
        e, f2, d = base.w1.shape
        self.router = nn.Parameter(base.router.detach().clone())
        kw = {"bias": False, "params_dtype": torch.bfloat16, "device": common.DEVICE, "pack_weights": pack_weights,
              "single_parameter": single_parameter}
        self.fc1 = hybridfp.GroupedLinear(e, d, f2, name="experts.fc1", **kw)
        self.fc2 = hybridfp.GroupedLinear(e, f2 // 2, d, name="experts.fc2", **kw)
        with torch.no_grad():
            for fc, w in ((self.fc1, base.w1), (self.fc2, base.w2)):
                for mine, theirs in zip(fc.weights(), w):  # views of ``weight`` with single_parameter
                    mine.copy_(theirs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = Routing(x, self.router, TOP_K)
        splits = r.counts.tolist()  # GroupedLinear takes host splits (one sync, as TE's)
        h = self.fc1(r.permute(x), splits)
        return r.unpermute(self.fc2(swiglu(h), splits), x.shape[0])


def moe_layer(e: int, f: int, tokens: int = TOKENS, d: int = HIDDEN, single_parameter: bool = False
              ) -> tuple[BF16MoE, "HybridMoE", torch.Tensor, torch.Tensor]:
    """(the BF16 baseline layer, the hybridfp layer with its weights, x, dy): seeded, on
    ``common.DEVICE``, as every MoE benchmark and diagnosis builds them; ``single_parameter``:
    the hybridfp layer's GroupedLinears hold one [E, N, K] weight Parameter each."""
    torch.manual_seed(0)
    base = BF16MoE(e, d, f)
    x = torch.randn(tokens, d, device=common.DEVICE, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, d, device=common.DEVICE, dtype=torch.bfloat16)
    return base, HybridMoE(base, single_parameter=single_parameter), x, dy


def make_step(model: nn.Module, x: torch.Tensor, dy: torch.Tensor, ctx: Optional[Callable[[], Any]],
              micro_batches: int = 1):
    """One timed step: ``micro_batches`` forward + backward passes of ``x`` (gradients
    accumulating, as between two optimizer updates) in one autocast region, hybridfp's quantized
    weights cleared once at its start (re-quantized as after an optimizer update, then reused by
    the later micro-batches: a cached weight lives for its autocast region)."""
    caches = [m for m in model.modules() if isinstance(m, QuantizedModule)]

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        x.grad = None
        for m in caches:
            m.invalidate_weight_cache()  # re-quantize weights every step (as after an optimizer step)
        with (nullcontext() if ctx is None else ctx()):
            for _ in range(micro_batches):
                # every pass routes anew in training: the metadata shared by one routing's calls
                # is built once a pass, not once for the whole benchmark (it reuses x and its routing)
                clear_step_metadata()
                y = model(x)
                y.backward(dy)
        return y
    return step


def device_ms(step: Callable[[], Any]) -> float:
    """Milliseconds the GPU spends in kernels (and copies) during one step (torch.profiler):
    against the step's wall time it says whether the layer is GPU- or host-bound."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3


def bench_config(e: int, f: int, tokens: int, d: int, profile: Optional[str] = None,
                 profiles: Optional[list[str]] = None, only: Optional[list[str]] = None,
                 stacks: bool = False, micro_batches: int = 1, paired: bool = False,
                 ab: bool = False) -> list[dict[str, Any]]:
    """Every variant of one config, in one process, ratios against its BF16 grouped baseline;
    variants whose name contains ``profile`` also get a one-step profile in ``profiles``.
    ``only``: just the variants whose name equals one of these (the baseline always runs);
    ``stacks``: the profiles also list the copy ops by call stack; ``micro_batches`` > 1: the
    baseline and the recipes timed again as that many micro-batches a weight update; ``paired``:
    each row also timed alternately with its baseline (``bench_pair``, ``PAIR_ROUNDS`` rounds),
    so that drift of the GPU's clocks or the host's load lands on both sides of the ratio; ``ab``:
    also the rows with one switch flipped (the ``*_VARIANTS`` tables; without it, only the
    one-weight-Parameter rows)."""
    base, hf, x, dy = moe_layer(e, f, tokens, d)
    variants: list[tuple[str, nn.Module, Optional[Callable[[], Any]]]] = [("BF16 grouped", base, None)]
    for name, recipe in RECIPES:
        variants.append((name, hf, lambda r=recipe(): hybridfp.autocast(recipe=r)))
    unpacked = HybridMoE(base, pack_weights=False) if UNPACKED_VARIANTS else None
    single = HybridMoE(base, single_parameter=True) if SINGLE_PARAM_VARIANTS else None
    extras = [(TRITON_VARIANTS, (TRITON_SUFFIX, PER_EXPERT_SUFFIX), hf),
              (UNPACKED_VARIANTS, (UNPACKED_SUFFIX,), unpacked), (FP8_TRITON_VARIANTS, (FP8_TRITON_SUFFIX, PER_EXPERT_SUFFIX), hf),
              (PER_GROUP_VARIANTS, (PER_GROUP_SUFFIX, CUTLASS_SUFFIX), hf),
              (PLAN_VARIANTS, (NO_PLAN_MEMO_SUFFIX, NO_METADATA_MEMO_SUFFIX), hf),
              (SINGLE_PARAM_VARIANTS, (SINGLE_PARAM_SUFFIX,), single),
              (FP8_TMA_VARIANTS, (FP8_TMA_SUFFIX,), hf), (FP8_TMA_VARIANTS, (SINGLE_PARAM_SUFFIX + FP8_TMA_SUFFIX,), single)]
    if not ab:
        extras = [x for x in extras if x[1] == (SINGLE_PARAM_SUFFIX,)]
    for name, recipe in RECIPES:
        if ab and name in CODES_VARIANTS:
            variants.append((name + CODES_SUFFIX, hf,
                             lambda r=recipe(): common.decoded_mode("never", hybridfp.autocast(recipe=r))))
    for names, suffixes, model in extras:
        for name, recipe in RECIPES:
            if name in names:
                variants += [(name + sx, model, lambda r=recipe(): hybridfp.autocast(recipe=r)) for sx in suffixes]
    if only is not None:
        variants = [v for v in variants if v[0] == "BF16 grouped" or v[0] in only]
    micro = [(1, v) for v in variants]
    if micro_batches > 1:
        sx = MICRO_SUFFIX.format(n=micro_batches)
        micro += [(micro_batches, (name + sx, model, ctx)) for name, model, ctx in variants
                  if name == "BF16 grouped" or name in dict(RECIPES)]
    rows: list[dict[str, Any]] = []
    ref_y = None
    base_steps: dict[int, Callable[[], torch.Tensor]] = {}  # the baseline's step per micro-batch count
    for n_micro, (name, model, ctx) in micro:
        row: dict[str, Any] = {"config": f"{e} experts, ffn {f}", "variant": name, "micro_batches": n_micro}
        try:
            step = make_step(model, x, dy, ctx, n_micro)
            if name.endswith((TRITON_SUFFIX, PER_EXPERT_SUFFIX, FP8_TRITON_SUFFIX)):
                step = with_triton_grouped(step, on=not name.endswith(PER_EXPERT_SUFFIX),
                                           fp8_everywhere=name.endswith(FP8_TRITON_SUFFIX))
            if name.endswith(FP8_TMA_SUFFIX):
                step = with_fp8_tma(step)
            if name.endswith(NO_PLAN_MEMO_SUFFIX):
                step = without_plan_memo(step)
            if name.endswith(NO_METADATA_MEMO_SUFFIX):
                step = without_metadata_memo(step)
            if name.endswith((PER_GROUP_SUFFIX, CUTLASS_SUFFIX)):
                step = with_per_group_cublas(step, on=name.endswith(PER_GROUP_SUFFIX))
            before = Counter(PATH_COUNTS)
            y = step().detach().float()
            paths = Counter(PATH_COUNTS) - before
            row["paths"] = ", ".join(f"{g}:{p}" for (g, p) in sorted(paths)) or "-"
            ref_y = y if ref_y is None else ref_y
            row["rel_err_vs_bf16"] = ((y - ref_y).norm() / ref_y.norm()).item()
            row["ms"] = bench_ms(step, warmup_ms=50, rep_ms=300)
            row["ms_steady"], row["host_ms"] = bench_ms_steady(step, steps=10)
            if name.startswith("BF16 grouped"):
                base_steps[n_micro] = step
            elif paired and n_micro in base_steps:
                tb, tv = bench_pair(base_steps[n_micro], step, rounds=PAIR_ROUNDS)
                row["paired_x_bf16_grouped"] = tb / tv
            if common.DEVICE == "cuda":
                row["gpu_busy"] = device_ms(step) / row["ms"]
            if profile and profiles is not None and any(t and t in name for t in profile.split("|")):
                profiles.append(profile_step(step, f"{row['config']}: {name}", stacks))
        except Exception as err:  # noqa: BLE001 - record the failure, keep the other variants
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        rows.append(row)
        if common.DEVICE == "cuda":
            torch.cuda.empty_cache()
    base_rows = {r["micro_batches"]: r for r in rows if r["variant"].startswith("BF16 grouped")}
    for r in rows:
        # each row against the baseline with as many micro-batches a weight update
        t0, t0_steady = base_rows[r["micro_batches"]].get("ms"), base_rows[r["micro_batches"]].get("ms_steady")
        if "ms_steady" in r and t0_steady:
            r["steady_x_bf16_grouped"] = t0_steady / r["ms_steady"]
        if "ms" in r and t0:
            r["x_bf16_grouped"] = t0 / r["ms"]
            r["target"] = TARGETS.get(r["variant"].split(" [")[0])  # the recipe's name, without a variant suffix
    return rows


def main(argv=None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=None, help="only the config with this many experts")
    p.add_argument("--profile", default=None, help="profile one step of the variants whose name "
                   "contains this text ('|'-separated texts), written to --profile-out")
    p.add_argument("--profile-out", type=Path, default=Path("moe_profile.txt"))
    p.add_argument("--ab", action="store_true", help="also the rows with one switch flipped (Triton / per-expert "
                   "GEMMs, unpacked weights, codes instead of decoded copies, memos off, FP8 pointer kernel)")
    p.add_argument("--profile-stacks", action="store_true", help="the profiles also list the copy ops "
                   "(copy_, clone, cat, ...) by Python call stack")
    p.add_argument("--micro-batches", type=int, default=1, help="N > 1: also time every recipe and the "
                   "baseline as N forward + backward passes a weight update (weights quantized once)")
    p.add_argument("--paired", action="store_true", help="also time each row alternately with its baseline "
                   f"({PAIR_ROUNDS} rounds): a ratio that clock or host drift does not bias")
    p.add_argument("--variants", default=None, help="only these '|'-separated variant names (the recipe "
                   "rows' names, with a suffix for the extra variants), besides the BF16 baseline")
    p.add_argument("--fp8-tma", default=None, help="ROWS/WGRAD: the TMA kernel configs (names in "
                   "kernels.moe.triton_grouped_fp8_tma.CONFIGS) the FP8 A/B variants take instead of the pointer "
                   "kernel")
    args = p.parse_args(argv)
    require_cuda()
    if args.fp8_tma:
        FP8_TMA[:] = args.fp8_tma.split("/")
    warnings.simplefilter("ignore")
    only = args.variants.split("|") if args.variants else None
    env = environment()
    rows: list[dict[str, Any]] = []
    profiles: list[str] = []
    configs = [(8, 512), (64, 256)] if args.quick else CONFIGS
    configs = [c for c in configs if args.experts in (None, c[0])]
    if not configs:
        p.error(f"--experts {args.experts}: the configs have {[c[0] for c in CONFIGS]} experts")
    tokens, d = (1024, 512) if args.quick else (TOKENS, HIDDEN)
    for e, f in configs:
        rows += bench_config(e, f, tokens, d, args.profile, profiles, only, args.profile_stacks,
                             args.micro_batches, args.paired, args.ab)
    table = md_table(["config", "variant", "ms", "x BF16 grouped", "target", "steady ms", "steady x BF16 grouped"]
                     + (["paired x BF16 grouped"] if args.paired else [])
                     + ["host ms", "GPU busy", "rel err vs BF16", "paths"], [
        [r["config"], r["variant"], r.get("ms", r.get("error")), r.get("x_bf16_grouped"), r.get("target"),
         r.get("ms_steady"), r.get("steady_x_bf16_grouped")] + ([r.get("paired_x_bf16_grouped")] if args.paired else [])
        + [r.get("host_ms"), r.get("gpu_busy"), r.get("rel_err_vs_bf16"), r.get("paths")] for r in rows])
    md = (f"### MoE FFN forward + backward ({tokens} tokens, hidden {d}, top-{TOP_K}, SwiGLU; median, "
          "do_bench)\n\n\"x BF16 grouped\" = torch._grouped_mm BF16 layer time / time (>1 is faster); "
          "hybridfp weights are re-quantized every step. \"steady\": 10 back-to-back steps (the host may "
          "run ahead, as in a training loop); \"host ms\": the host's time for one step started on an idle GPU. \"GPU busy\" = device time of one step's "
          "kernels (torch.profiler) / its wall time: well below 1 means host-bound."
          + (f" \"paired\": median over {PAIR_ROUNDS} rounds of the baseline and the row timed one after "
             "the other." if args.paired else "") + "\n\n" + table + "\n")
    result = {"env": env, "rows": rows, "markdown": md}
    if profiles:
        args.profile_out.write_text("\n\n".join(profiles))
    finish("moe", result, args.out)  # prints the table last


if __name__ == "__main__":
    main()
