"""Forward + backward of an MoE FFN layer: hybridfp GroupedLinear recipes vs the fastest BF16.

Layer (16384 tokens, hidden 4096): a router in FP32 (logits, softmax, top-2), token
permutation (sort the 2 x 16384 assignments by expert), SwiGLU experts as two grouped
linears — gate+up fused [2F, D] then down [D, F], no bias — and the weighted un-permutation
(index_add). Configs: 8 experts F = 14336, 64 experts F = 1408.

As training runs it: one step = zero grads, then ``--micro-batches`` (default 4) forward +
backward passes accumulating gradients in one autocast region, hybridfp's quantized weights
re-quantized once at the step's start (as after an optimizer update) and reused by the later
micro-batches. Routing changes every micro-batch: each gets seeded router-logit offsets
(``RoutingSchedule``: a fresh lognormal expert popularity, plus per-token noise), so the
experts' loads are uneven and move; the baseline and the candidate get the same routings in the
same order.

Baselines (all three always run; one that fails stops the benchmark, naming it): "BF16
grouped" (stacked [E, out, in] BF16 weights, ``torch._grouped_mm``), "BF16 per-expert" (a loop
of ``torch.mm``, cuBLAS per expert) and "BF16 compiled" (``torch.compile`` of the grouped
layer). Candidates: hybridfp GroupedLinear (BF16 parameters) under CustomRecipe(high_precision),
Float8CurrentScaling, MXFP8BlockScaling and the Composer-2 factory nvfp4_row_scaled_fwd_mxfp8_bwd,
each also with ``GroupedLinear(single_parameter=True)`` ("[one weight Parameter]") and, the
quantized ones, with quantized primary weights ("[quantized primary weights]": built under
``hybridfp.quantized_model_init``, re-encoded from FP32 masters once a step inside the step);
FP8 current and MXFP8 with quantized primary weights also under ``torch.compile`` ("[compiled]":
the routing, permutation, SwiGLU and un-permutation compiled as the compiled BF16 baseline's,
each GroupedLinear call a graph break run eagerly); FP8 current and MXFP8, plain and with
quantized primary weights, also with ``hybridfp.swiglu`` as the experts' activation ("[fused
SwiGLU]": one Triton kernel each way on fc1's [rows, 2F] output, its gradient written as one
tensor, each expert's FP8 current amaxes of h and of that gradient recorded on the way, where
the other rows run eager ``F.silu(g) * u``), beside BF16 grouped with the same activation ("BF16
grouped [fused SwiGLU]", against the fastest BF16 like a variant row: whether the activation
alone would beat the compiled baseline; ``moe_fused_swiglu``, ``moe_64_fused_swiglu``). By name only (``--variants``): torchao's
float8 MoE training ("torchao float8 rowwise (compiled)", or its eager twin: ``moe_torchao``, the
BF16 grouped layer with its expert weights converted to FP8 rowwise, each expert's tokens padded
to 16 rows as torchao's FP8 weight gradient needs), a baseline of the hybridfp FP8 rows: each is
also paired against it ("x torchao"); torchao missing or no sm90 GPU fails the run, naming it.

Every ratio is ``bench.protocol.paired_ratio`` (median of per-round ratios, its ≥ 95 % interval,
the GPU's clocks), baseline ms / candidate ms (>1 is faster): a recipe's row against each
baseline, and the headline against the fastest of the three in this run (named in the row); a
variant row (a suffix), a torchao row (and with ``--fastest-only`` every row) against that fastest
one only. Every row's output,
dx and dW are checked against an FP32 reference of the same routings (relative Frobenius
error within ``common.error_bound`` of its formats, gain within ``common.GAIN_TOLERANCE`` of 1); a
breach, or any failed row, ends the run with a non-zero exit after the table is printed. Rows run
one after the other, each complete (checked, timed) before the next; the JSON is written after
every row, so a run stopped by a timeout keeps what it measured. ``--deadline-s``: the rows left
then are not run and named; the run fails unless they are all A/B variants (a suffix). "paths": which ``grouped_gemm`` path each GEMM took. With
``--ab``, extra rows (suffixes) time a recipe again with one switch flipped in the same
process, e.g. "[cuBLAS per expert BF16]": path 1's grouped BF16 GEMMs as cuBLAS per expert.

How long a run takes, to choose ``--deadline-s``: one paired comparison times 2 x rounds x samples
steps (200 with the default 10 x 10) besides its warm-up and accuracy check. BF16 per-expert and
compiled are each paired once (against BF16 grouped), each recipe row three times (against every
BF16 baseline), each variant row once: (2 + 3 x recipe rows + variant rows) x 200 x the step time.
On an H100 the ``--experts 8`` step takes 200-270 ms: its baselines and the FP8 and MXFP8 rows
take about 7 minutes (``--deadline-s 420`` reached them), the full run (4 recipe rows, 7 variant
rows: 21 comparisons) about 18 minutes. With ``--fastest-only`` a recipe row is paired once, and a
hybridfp FP8 row once more for each torchao row: the torchao benchmarks take 5 comparisons a config.

    python -m bench.bench_moe [--experts 8|64] [--micro-batches N] [--skew S] [--ab] [--variants 'A|B']
        [--rounds R --samples S] [--compile-backend B] [--out results.json] [--quick] [--deadline-s S]
        [--profile TEXT [--profile-out FILE]] [--fastest-only]
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from bench import common, moe_torchao
from bench.common import (GAIN_TOLERANCE, AccuracyError, MissingBaselineError, environment, finish, gain, host_ms, md_table,
                          parser, profile_step, protocol_from, protocol_record, rel_error, require_cuda)
from bench.moe_layer import HIDDEN, ROUTING_SKEW, TOKENS, TOP_K, BF16MoE, RoutingSchedule, Step, moe_layer
# the row planning lives in moe_rows; its names are bench_moe's too (``bench_moe.RECIPES``, ...)
from bench.moe_rows import (BASELINES, BF16_COMPILED, BF16_GROUPED, BF16_PER_EXPERT, CODES_SUFFIX, COMPILED_SUFFIX,
                            CUTLASS_SUFFIX,
                            DEPTHS, FP8_TMA_SUFFIX, FP8_TRITON_SUFFIX, NO_METADATA_MEMO_SUFFIX,
                            NO_PLAN_MEMO_SUFFIX, PER_EXPERT_SUFFIX, PER_GROUP_SUFFIX, PRIMARY_SUFFIX,
                            RECIPE_FORMATS, RECIPES, SINGLE_PARAM_SUFFIX, TRITON_SUFFIX, UNPACKED_SUFFIX, TmaPair,
                            UnknownRowError, breaches, error_bounds, is_baseline, optional, variants_of, wrap)
from bench.moe_targets import CONFIGS, below, config_name, target
from bench.moe_torchao import TORCHAO_ROWS, paired_with_torchao
from bench.protocol import PairedRatio, Protocol, paired_ratio
from hybridfp.moe.gemm import PATH_COUNTS

__all__ = ["BASELINES", "BF16_COMPILED", "BF16_GROUPED", "BF16_PER_EXPERT", "CODES_SUFFIX", "COMPILED_SUFFIX", "CONFIGS",
           "CUTLASS_SUFFIX", "DEPTHS", "FP8_TMA_SUFFIX", "FP8_TRITON_SUFFIX", "NO_METADATA_MEMO_SUFFIX",
           "NO_PLAN_MEMO_SUFFIX", "PER_EXPERT_SUFFIX", "PER_GROUP_SUFFIX", "PRIMARY_SUFFIX", "QUICK_CONFIGS",
           "QUICK_SHAPE", "RECIPE_FORMATS", "RECIPES", "SINGLE_PARAM_SUFFIX", "TRITON_SUFFIX", "UNPACKED_SUFFIX",
           "RowFailure", "bench_config", "breaches", "check_rows", "device_ms", "error_bounds", "main",
           "markdown_table", "pair", "reference_result", "relative_errors", "time_baselines", "time_row", "wrap"]

#: ``--quick``: (experts, ffn) configs and (tokens, hidden); the configs' targets: moe_targets.TARGETS
QUICK_CONFIGS, QUICK_SHAPE = [(8, 512), (64, 256)], (1024, 512)


def device_ms(step: Callable[[], Any]) -> float:
    """Milliseconds the GPU spends in kernels (and copies) during one step (torch.profiler):
    against the step's wall time it says whether the layer is GPU- or host-bound."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3


class RowFailure(RuntimeError):
    """A candidate row failed to run: the run's ratios are not to be reported."""


def relative_errors(run: Callable[[], list[torch.Tensor]], step: Step, ref: dict[str, Any],
                    gains: Optional[dict[str, float]] = None) -> dict[str, float]:
    """Call ``run`` (``step``, maybe under a variant's switches) once from the schedule's first
    step; the relative Frobenius error of its outputs, x's gradient and each layer's weight
    gradient against ``ref`` (``reference_result``); ``gains``, when given, gets each one's
    ``common.gain`` onto the reference."""
    step.reset()
    ys = run()
    model = getattr(step.model, "_orig_mod", step.model)  # a compiled layer's module
    got = dict(zip(("dw1", "dw2"), model.expert_grads()), out=torch.cat([y.detach() for y in ys]), dx=step.x.grad)
    for k in ("out", "dx", "dw1", "dw2"):
        if got[k] is None:
            raise AccuracyError(f"{k}: the step produced none (a gradient that never reached its tensor)")
    errors = {k: rel_error(got[k], ref[k]) for k in ("out", "dx", "dw1", "dw2")}
    if gains is not None:
        gains.update({k: gain(got[k], ref[k]) for k in ("out", "dx", "dw1", "dw2")})
    step.release()
    return errors


def reference_result(base: BF16MoE, x: torch.Tensor, dy: torch.Tensor, micro_batches: int,
                     schedule: Optional[RoutingSchedule]) -> dict[str, torch.Tensor]:
    """The FP32 layer's outputs, dx and dW for the schedule's first step (x, dy and the weights
    the BF16 values, widened; FP32 products: no TF32 on CUDA, no reduced precision on oneDNN)."""
    ref = base.reference()
    x32 = x.detach().float().requires_grad_(True)
    step = Step(ref, x32, dy.float(), None, micro_batches, schedule)
    with common.ieee_fp32():
        out = torch.cat([y.detach() for y in step()])
    return {"out": out, "dx": x32.grad, "dw1": ref.w1.grad, "dw2": ref.w2.grad}


def pair(baseline: tuple[Callable[[], Any], Step], candidate: tuple[Callable[[], Any], Step],
         protocol: Protocol) -> PairedRatio:
    """``paired_ratio`` of two (step, its ``Step``) with both schedules restarted: the i-th call
    of each side routes the same."""
    baseline[1].reset()
    candidate[1].reset()
    try:
        return paired_ratio(baseline[0], candidate[0], protocol)
    finally:
        baseline[1].release()
        candidate[1].release()


#: a row's ``not_run`` when ``--deadline-s`` passed before it
PAST_DEADLINE = "--deadline-s passed"


def bench_config(e: int, f: int, tokens: int, d: int, profile: Optional[str] = None,
                 profiles: Optional[list[str]] = None, only: Optional[list[str]] = None,
                 stacks: bool = False, micro_batches: int = 4, ab: bool = False,
                 protocol: Protocol = Protocol(), skew: float = ROUTING_SKEW,
                 compile_backend: str = "inductor", deadline: float = math.inf,
                 checkpoint: Callable[[list[dict[str, Any]]], None] = lambda rows: None,
                 fp8_tma: TmaPair = (None, None), fastest_only: bool = False) -> list[dict[str, Any]]:
    """Every variant of one config, in one process, row by row: each checked against the FP32
    reference of the same routings, then timed with ``protocol`` against each BF16 baseline (the
    three baselines first, against BF16 grouped; a variant row, one with a suffix, against the
    fastest of them only). After each row its layer's gradients are released and ``checkpoint``
    gets the rows so far (a timed-out run keeps them).

    ``only``: just the variants whose name equals one of these (the baselines always run);
    ``profile``: variants whose name contains it also get a one-step profile in ``profiles``
    (``stacks``: with the copy ops by call stack); ``micro_batches``: forward + backward passes a
    step; ``ab``: also the rows with one switch flipped (the ``*_VARIANTS`` tables; without it,
    only the one-weight-Parameter rows); ``skew``: ``RoutingSchedule``'s; ``compile_backend``:
    ``torch.compile``'s for "BF16 compiled"; ``deadline``: a ``time.monotonic()`` after which the
    rows left are not run (``not_run``); ``fp8_tma``: the FP8 TMA A/B rows' kernels;
    ``fastest_only``: the recipes' rows too are paired against the fastest baseline only. The
    torchao rows ``only`` names run after the baselines and are baselines too: the hybridfp FP8
    rows are also paired against each of them (``x_torchao``).

    Raises ``MissingBaselineError`` naming a baseline (BF16, torchao) that fails or is past the
    deadline (its ratios cannot be measured); a candidate's failure or bound breach is recorded in its row
    (``error``, ``breaches``; such a row is not timed), for :func:`check_rows`.
    """
    base, hf, x, dy = moe_layer(e, f, tokens, d)
    schedule = RoutingSchedule(tokens, e, micro_batches, skew=skew)
    ref = reference_result(base, x, dy, micro_batches, schedule)
    config = config_name(e, f)
    imbalance = schedule.imbalance(x, base.router)
    rows: list[dict[str, Any]] = []
    steps: dict[str, tuple[Callable[[], Any], Step]] = {}
    fastest: Optional[str] = None
    for name, build, ctx in variants_of(base, hf, only, ab, compile_backend):
        row: dict[str, Any] = {"config": config, "variant": name, "micro_batches": micro_batches,
                               "baseline": name in BASELINES, "load_max_over_mean": imbalance,
                               "target": target(config, name)}
        if time.monotonic() > deadline:
            if is_baseline(name):
                raise MissingBaselineError(f"bench_moe: the baseline '{name}' ({config}) not run: {PAST_DEADLINE} "
                                           "before it (baselines run first; raise --deadline-s)")
            row.update(not_run=PAST_DEADLINE, optional=optional(name))
            rows.append(row)
            checkpoint(rows)
            continue
        try:
            core = Step(build(), x, dy, ctx, micro_batches, schedule)
            step = wrap(name, core, fp8_tma)
            before = Counter(PATH_COUNTS)
            gains: dict[str, float] = {}
            row["rel_err"] = relative_errors(step, core, ref, gains)
            row["gain"] = gains
            paths = Counter(PATH_COUNTS) - before
            row["paths"] = ", ".join(f"{g}:{p}" for (g, p) in sorted(paths)) or "-"
            row["bounds"] = error_bounds(name)
            row["breaches"] = breaches(name, row["rel_err"], gains)
            row["host_ms"], row["sync_wait_ms"] = host_ms(step, core.model)
            if profile and profiles is not None and any(t and t in name for t in profile.split("|")):
                profiles.append(profile_step(step, f"{config}: {name}", stacks))
            core.release()  # the rows take turns: only the running one holds its gradients
            steps[name] = (step, core)
            if fastest is not None and not row["breaches"]:
                time_row(row, steps, fastest, protocol, fastest_only)
        except Exception as err:  # noqa: BLE001 - a candidate's failure is recorded and fails the run at its end
            if is_baseline(name):
                needs = (f"Every ratio needs all of {', '.join(BASELINES)}; no row is reported without them"
                         if name in BASELINES else "The FP8 rows' ratios against torchao need it")
                raise MissingBaselineError(f"bench_moe: the baseline '{name}' ({config}) failed: {type(err).__name__}: "
                                           f"{err}. {needs}.") from err
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        rows.append(row)
        if fastest is None and all(b in steps for b in BASELINES):
            fastest = time_baselines(rows, steps, protocol)
        for r in rows:
            r["fastest_bf16"] = fastest
        checkpoint(rows)
        if common.DEVICE == "cuda":
            torch.cuda.empty_cache()
    return rows


def time_baselines(rows: list[dict[str, Any]], steps: dict[str, tuple[Callable[[], Any], Step]],
                   protocol: Protocol) -> str:
    """Pair BF16 per-expert and compiled against BF16 grouped (their rows' ``x_bf16`` and ``ms``);
    the fastest of the three: the least median ms, BF16 grouped's the median of its two pairs."""
    by_name = {r["variant"]: r for r in rows}
    ms, grouped_ms = {}, []
    for b in BASELINES[1:]:
        pr = pair(steps[BF16_GROUPED], steps[b], protocol)
        by_name[b]["x_bf16"] = {BF16_GROUPED: pr.as_dict()}
        ms[b] = pr.candidate_ms
        grouped_ms.append(pr.baseline_ms)
    ms[BF16_GROUPED] = statistics.median(grouped_ms)  # of two values: their mean, not the larger
    for b in BASELINES:
        by_name[b]["ms"] = ms[b]
    return min(BASELINES, key=lambda b: ms[b])


def time_row(row: dict[str, Any], steps: dict[str, tuple[Callable[[], Any], Step]], fastest: str,
             protocol: Protocol, fastest_only: bool = False) -> None:
    """A candidate's paired ratios: a recipe's row against each baseline (``fastest_only``: the
    fastest only), a variant or torchao row against the fastest (``fastest``) only, a hybridfp FP8
    row also against each torchao row run before it (``x_torchao``: torchao's ms / the row's); its
    ms, target and (CUDA) GPU busy fraction."""
    name = row["variant"]
    against = BASELINES if name in dict(RECIPES) and not fastest_only else (fastest,)
    row["x_bf16"] = {b: pair(steps[b], steps[name], protocol).as_dict() for b in against}
    torchao = [t for t in TORCHAO_ROWS if t in steps] if paired_with_torchao(name) else []
    if torchao:
        row["x_torchao"] = {t: pair(steps[t], steps[name], protocol).as_dict() for t in torchao}
    row["x_fastest_bf16"] = row["x_bf16"][fastest]
    row["ms"] = row["x_fastest_bf16"]["candidate_ms"]
    row["target"] = target(row["config"], row["variant"])  # the recipe's, at this config (moe_targets)
    if common.DEVICE == "cuda":
        row["gpu_busy"] = device_ms(steps[row["variant"]][0]) / row["ms"]
        steps[row["variant"]][1].release()


def not_run(rows: list[dict[str, Any]]) -> list[str]:
    """The rows ``--deadline-s`` left unmeasured, "(optional)" after the A/B variants'."""
    return [f"{r['config']}: {r['variant']}" + (" (optional)" if r["optional"] else "") for r in rows if "not_run" in r]


def check_rows(rows: list[dict[str, Any]]) -> None:
    """Raise ``AccuracyError`` listing every error beyond its bound (and any failed or missing
    row), else ``RowFailure`` listing the failed rows and the recipe rows not run."""
    failed = [f"{r['config']}: {r['variant']}: {r['error']}" for r in rows if "error" in r]
    failed += [f"{r['config']}: {r['variant']}: not run ({r['not_run']})" for r in rows
               if "not_run" in r and not r["optional"]]
    beyond = [f"{r['config']}: {b}" for r in rows for b in r.get("breaches", [])]
    if beyond:
        raise AccuracyError("bench_moe: beyond the FP32 reference's bound (common.error_bound) or gain: "
                            + "; ".join(beyond + failed))
    if failed:
        raise RowFailure("bench_moe: rows failed: " + "; ".join(failed))


def _ratio(pr: Optional[dict[str, Any]]) -> Optional[str]:
    """"1.23 [1.20, 1.25]": a paired ratio with its interval."""
    return None if pr is None else f"{pr['ratio']:.3f} [{pr['low']:.3f}, {pr['high']:.3f}]"


def _clocks(pr: Optional[dict[str, Any]]) -> Optional[str]:
    c = (pr or {}).get("clocks", {})
    return f"{c['sm_mhz_min']:.0f}-{c['sm_mhz_max']:.0f}" if "sm_mhz_min" in c else None


def _headline(r: dict[str, Any]) -> Optional[str]:
    """A row's "x fastest BF16" cell: its paired ratio, marked below the row's target; else its
    failure or why it was not run."""
    pr = r.get("x_fastest_bf16")
    if pr is not None:
        mark = f" BELOW {r['target']:.2f}x TARGET" if below(pr["ratio"], r.get("target")) else ""
        return _ratio(pr) + mark
    return r.get("error") or (f"not run: {r['not_run']}" if "not_run" in r else None)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The report's table of ``rows`` (bench_config's), a ratio below its row's target marked; an
    "x torchao" column where a row was paired against torchao's float8 layer."""
    torchao = any("x_torchao" in r for r in rows)  # runs without torchao's rows keep their table
    return md_table(["config", "variant", "x fastest BF16 [≥ 95 % interval]", "fastest BF16", "target"]
                    + [f"x {b}" for b in BASELINES] + ["x torchao"] * torchao
                    + ["ms", "SM MHz", "host ms", "of it at syncs", "GPU busy", "rel err out / dx / dW1 / dW2", "bound",
                       "gain out / dx / dW1 / dW2", "paths"], [
        [r["config"], r["variant"], _headline(r), r.get("fastest_bf16"), r.get("target")]
        + [_ratio(r.get("x_bf16", {}).get(b)) for b in BASELINES]
        + ["; ".join(f"{_ratio(p)} {t.rsplit(' ', 1)[-1]}" for t, p in r.get("x_torchao", {}).items()) or None] * torchao
        + [r.get("ms"), _clocks(r.get("x_fastest_bf16")), r.get("host_ms"), r.get("sync_wait_ms"), r.get("gpu_busy"),
           " / ".join(f"{v:.3g}" for v in r.get("rel_err", {}).values()) or None,
           " / ".join(f"{v:g}" for v in r.get("bounds", {}).values()) or None,
           " / ".join(f"{v:.4f}" for v in r.get("gain", {}).values()) or None, r.get("paths")] for r in rows])


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
    p.add_argument("--micro-batches", type=int, default=4, help="forward + backward passes a step (weights "
                   "quantized once a step, gradients accumulated; default 4)")
    p.add_argument("--skew", type=float, default=ROUTING_SKEW, help="standard deviation of the experts' "
                   f"log-popularity in the routing schedule (default {ROUTING_SKEW}; 0: balanced on average)")
    p.add_argument("--paired", action="store_true", help="accepted for older command lines: every ratio is paired")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile's backend for 'BF16 compiled'")
    p.add_argument("--variants", default=None, help="only these '|'-separated variant names (the recipe "
                   "rows' names, with a suffix for the extra variants), besides the BF16 baselines")
    p.add_argument("--fp8-tma", default=None, help="ROWS/WGRAD: the TMA kernel configs (names in "
                   "kernels.moe.triton_grouped_fp8_tma.CONFIGS) the FP8 A/B variants take instead of the pointer "
                   "kernel")
    p.add_argument("--deadline-s", type=float, default=1e9, help="rows left after this many seconds are not run "
                   "(named; the run fails unless they are A/B variants; a baseline not run by then fails it). "
                   "A run takes (2 + 3 x recipe rows + variant rows) x 2 x rounds x samples steps: --experts 8 on an "
                   "H100 about 7 minutes to its FP8 and MXFP8 rows, about 18 for every row")
    p.add_argument("--fastest-only", action="store_true", help="pair the recipes' rows too against the fastest "
                   "BF16 baseline only (fewer pairings: the torchao runs ask only the fastest BF16 and torchao)")
    args = p.parse_args(argv)
    only = args.variants.split("|") if args.variants else None
    try:  # before require_cuda: a missing torchao or GPU is named with the row that needs it
        torchao_version = moe_torchao.require(moe_torchao.selected(only))
    except MissingBaselineError as err:
        sys.exit(str(err))
    require_cuda()
    if args.micro_batches < 1:
        p.error(f"--micro-batches {args.micro_batches}: must be >= 1")
    try:
        protocol = protocol_from(args)
    except ValueError as err:
        p.error(str(err))
    fp8_tma: TmaPair = (None, None)
    if args.fp8_tma:
        rows_cfg, _, wgrad_cfg = args.fp8_tma.partition("/")
        fp8_tma = (rows_cfg or None, wgrad_cfg or None)
    warnings.simplefilter("ignore")
    deadline = time.monotonic() + args.deadline_s
    env = environment()
    if torchao_version:
        env["torchao"] = torchao_version
    rows: list[dict[str, Any]] = []
    profiles: list[str] = []
    failures: list[str] = []
    configs = QUICK_CONFIGS if args.quick else CONFIGS
    configs = [c for c in configs if args.experts in (None, c[0])]
    if not configs:
        p.error(f"--experts {args.experts}: the configs have {[c[0] for c in CONFIGS]} experts")
    tokens, d = QUICK_SHAPE if args.quick else (TOKENS, HIDDEN)

    def report(rows: list[dict[str, Any]], final: bool = False) -> None:
        """The table and JSON of ``rows``: printed and written at the end, written after each row."""
        table = markdown_table(rows)
        imbalance = ", ".join(f"{r['config']}: {r['load_max_over_mean']:.2f}" for r in rows if r["variant"] == BF16_GROUPED)
        skipped = not_run(rows)
        md = (f"### MoE FFN forward + backward ({tokens} tokens, hidden {d}, top-{TOP_K}, SwiGLU; "
              f"{args.micro_batches} micro-batches a step, weights quantized once a step)\n\n"
              "\"x B\" = B's step time / the row's (>1 is faster): bench.protocol.paired_ratio, median of "
              f"{protocol.rounds} rounds of {protocol.samples} calls a side, [≥ 95 % interval]; the BF16 baselines' "
              "rows are against BF16 grouped; \"fastest BF16\": the least ms of the three in this run. Routing "
              f"changes every micro-batch (log-popularity std {args.skew}; busiest expert / mean load, median: {imbalance}), "
              "the same routings for every row. \"rel err\": relative Frobenius error against the FP32 layer on "
              "the same routings (all micro-batches' outputs, dx, each layer's dW); \"bound\": the format's "
              "(out / dx / dW); \"gain\": the least-squares scale onto the reference (1 +- "
              f"{GAIN_TOLERANCE}: a missing term or a wrong scale moves it). \"host ms\": one step started on an "
              "idle GPU, \"of it at syncs\" the part spent waiting for the GPU at the micro-batches' routing "
              "syncs (the rest is the host's own work); \"GPU busy\" = device time of one step / its ms (well below 1: the GPU waits for the host, for its "
              "own work or after a sync); \"SM MHz\": "
              "min-max over the headline pair's rounds (sampled while they run)."
              + (" \"x torchao\": the torchao row's ms / the row's (paired; torchao's token groups padded to 16 "
                 "rows, counted in its time)." if moe_torchao.selected(only) else "")
              + (" --fastest-only: every row paired against the fastest BF16 only." if args.fastest_only else "")
              + (f" Rows not run ({PAST_DEADLINE}): {'; '.join(skipped)}." if skipped else "")
              + ("" if final else " PARTIAL (the run stopped early).") + "\n\n" + table + "\n")
        result = {"env": env, "protocol": protocol_record(protocol), "rows": rows, "not_run": skipped,
                  "failures": failures, "fastest_only": args.fastest_only, "markdown": md}
        if final:
            finish("moe", result, args.out)  # prints the table last
        elif args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"name": "moe", **result}, indent=1, default=str))

    try:
        for e, f in configs:
            rows += bench_config(e, f, tokens, d, args.profile, profiles, only, args.profile_stacks,
                                 args.micro_batches, args.ab, protocol, args.skew, args.compile_backend,
                                 deadline, lambda new: report(rows + new), fp8_tma, args.fastest_only)
    except MissingBaselineError as err:
        failures.append(str(err))
    except UnknownRowError as err:  # before any row is timed
        p.error(str(err))
    if profiles:
        args.profile_out.write_text("\n\n".join(profiles))
    report(rows, final=True)
    if failures:
        sys.exit(failures[0])
    try:
        check_rows(rows)
    except (AccuracyError, RowFailure) as err:
        sys.exit(str(err))


if __name__ == "__main__":
    main()
