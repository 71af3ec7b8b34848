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
(tensorwise, rowwise) compiled; hybridfp FP8 current (with and without fprop fast
accumulation) and MXFP8 compiled too. For the MLP, "+ fused SwiGLU" rows run the same layers
with ``hybridfp.swiglu`` (one Triton kernel each way) instead of eager ``F.silu(g) * u``; the
BF16 eager baseline stays unfused.

Baselines (BF16 eager, BF16 torch.compile, torchao float8 tensorwise / rowwise compiled) run
first; a baseline that cannot run (torchao absent, compilation failed, ``--deadline-s`` passed)
fails the run by name unless a flag skips it explicitly (``--no-torchao``, ``--no-compile``;
recorded in the JSON). Every recipe's own row runs next, then their variants (fused, codes,
compiled), so a deadline leaves variants, not targets: a recipe's row not run by
``--deadline-s`` fails the run too; its variants are only named. Every ratio is paired (``bench.protocol.paired_ratio``) against BF16
eager and BF16 compiled, and every FP8 row against torchao tensorwise, the FP8 block rows also
against torchao rowwise (``torchao_baselines``). Every variant's
first step is checked against an FP32 reference of the same inputs: output, dx and each dW,
relative Frobenius error within ``common.error_bound`` of the variant's element formats and gain
(``common.gain``, the least-squares scale onto the reference) within ``common.GAIN_TOLERANCE`` of 1,
or the run fails. Rows slower than BF16 eager (below the 1.00x target) are marked.

    python -m bench.bench_mlp [--out results.json] [--quick] [--deadline-s S] [--linear-compiled]
                              [--no-torchao] [--no-compile] [--rounds N] [--samples N] [--variants TEXT]
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
from bench.mlp_targets import target_of
from bench.common import (AccuracyError, MissingBaselineError, bench_ms, bench_ms_steady, check_result,
                          copy_bandwidth, environment, error_bound, finish, gain, md_table, parser, profile_step,
                          protocol_from, protocol_record, rel_error, require_cuda)
from bench.protocol import Protocol, paired_ratio
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
#: element formats (forward operands, backward gradients) of each variant family: its error bound
RECIPE_FORMATS = {
    "BF16": ("bf16", "bf16"),
    "hybridfp FP8 current": ("e4m3", "e5m2"),
    "hybridfp FP8 current, fprop fast accumulation": ("e4m3", "e5m2"),
    "hybridfp FP8 block": ("e4m3", "e4m3"),
    "hybridfp hybrid FP8-current fwd / FP8-block bwd": ("e4m3", "e4m3"),
    "hybridfp MXFP8": ("e4m3", "e4m3"),
    "hybridfp NVFP4 fwd / MXFP8 bwd": ("e2m1", "e4m3"),
    "hybridfp NVFP4 (2D weights, RHT, SR)": ("e2m1", "e2m1"),
    "torchao float8": ("e4m3", "e5m2"),
}
#: (forward, backward) GEMMs on the longest path to each checked tensor (``common.error_bound``)
DEPTHS = {"Linear": {"y": (1, 0), "dx": (0, 1), "dW": (0, 1)},
          "MLP": {"y": (2, 0), "dx": (1, 2), "dW": (1, 2)}}
#: --quick sizes (hidden, intermediate, tokens)
QUICK_DIMS = (256, 512, 512)
BASELINE_EAGER, BASELINE_COMPILED = "BF16 eager", "BF16 torch.compile"
TORCHAO_TENSORWISE = "torchao float8 tensorwise (compiled)"
TORCHAO_ROWWISE = "torchao float8 rowwise (compiled)"


def torchao_baselines(name: str) -> tuple[str, ...]:
    """The torchao float8 baselines a variant named ``name`` is paired with: every FP8 row with
    tensorwise (torchao's fastest float8), the finer-grained FP8 scalings (block, the hybrid's
    block backward) also with rowwise (torchao's own finer-grained scaling); none for the MX and
    NVFP4 recipes, which torchao's float8 training does not cover, nor for the baselines.

    >>> torchao_baselines("hybridfp FP8 block")
    ('torchao float8 tensorwise (compiled)', 'torchao float8 rowwise (compiled)')
    >>> torchao_baselines("hybridfp MXFP8")
    ()
    """
    if not name.startswith("hybridfp") or "FP8" not in name.replace("MXFP8", ""):
        return ()
    return (TORCHAO_TENSORWISE, TORCHAO_ROWWISE) if "block" in name else (TORCHAO_TENSORWISE,)

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


def formats_of(variant: str) -> tuple[str, str]:
    """(forward, backward) element formats of a variant, from its name's recipe family."""
    family = max((k for k in RECIPE_FORMATS if variant.startswith(k)), key=len, default=None)
    if family is None:
        raise ValueError(f"bench_mlp: variant {variant!r} has no entry in RECIPE_FORMATS; add its formats")
    return RECIPE_FORMATS[family]


def fp32_reference(make: Callable[[Callable], nn.Module], base: nn.Module, x: torch.Tensor,
                   dy: torch.Tensor) -> dict[str, Any]:
    """y, dx and each dW (in ``base.parameters()`` order) of an FP32 copy of ``base`` on the same
    x and dy (FP32 products: no TF32 on CUDA, no reduced precision on oneDNN; ``common.ieee_fp32``)."""
    ref = make(lambda i, o: nn.Linear(i, o, bias=False, dtype=torch.float32, device=x.device))
    ref.load_state_dict({k: v.float() for k, v in base.state_dict().items()})
    xr = x.detach().float().requires_grad_(True)
    with common.ieee_fp32():
        y = ref(xr)
        y.backward(dy.float())
    return {"y": y.detach(), "dx": xr.grad, "dW": [p.grad for p in ref.parameters()]}


def check_step(label: str, family: str, variant: str, y: torch.Tensor, x: torch.Tensor,
               params: list[nn.Parameter], ref: dict[str, Any]) -> dict[str, float]:
    """Relative errors and gains (``common.check_result``) of y, dx and each dW against ``ref``:
    ``err_``, ``bound_`` and ``gain_`` of y, dx and dW (the worst error and the gain furthest from 1
    of the weights).

    Raises ``AccuracyError`` naming the variant and the tensor beyond its bound or with a gain
    off 1 (a dropped branch of dx, a wrong scale), after every tensor was measured."""
    fwd, bwd = formats_of(variant)
    pairs = {"y": [(y, ref["y"])], "dx": [(x.grad, ref["dx"])], "dW": [(p.grad, r) for p, r in zip(params, ref["dW"])]}
    out: dict[str, float] = {}
    failures: list[str] = []
    for t, got in pairs.items():
        bound = error_bound(fwd, bwd, *DEPTHS[family][t])
        errs, gains = [], []
        for i, (o, r) in enumerate(got):
            what = f"{label}: {variant}: {t}" + (f"[{i}]" if len(got) > 1 else "")
            if o is None:
                failures.append(f"{what}: no gradient reached the tensor")
                continue
            errs.append(rel_error(o, r))
            gains.append(gain(o, r))
            try:
                check_result(what, o, r, bound)
            except AccuracyError as e:
                failures.append(str(e))
        out[f"err_{t}"], out[f"bound_{t}"] = max(errs, default=float("nan")), bound
        out[f"gain_{t}"] = max(gains, key=lambda g: abs(g - 1), default=float("nan"))
    if failures:
        raise AccuracyError("; ".join(failures))
    return out


Variant = tuple[str, nn.Module, nn.Module, Callable[[], Any]]


def plan_variants(base: nn.Module, hf: nn.Module, compiled: bool, torchao: Optional[Any],
                  fuse: Optional[Callable[[nn.Module], nn.Module]]) -> tuple[list[Variant], int]:
    """The variants ``bench_model`` times, in the order it times them: the baselines, then every
    recipe's own row (the targets: ``--deadline-s`` reaches them first), then the optional
    variants (the fused SwiGLU, copies kept as codes, compiled).

    Parameters
    ----------
    base, hf : the BF16 model and its hybridfp twin (same weights).
    compiled : include BF16 compiled, torchao (when ``torchao`` is its float8 module) and the
        compiled hybridfp variants.
    torchao : ``torchao.float8``, or None.
    fuse : the model with the fused SwiGLU, or None (models without an activation).

    Returns
    -------
    tuple[list[Variant], int]
        (name, model to run, model whose parameters get gradients, context) per variant; the
        number of baselines at its head.
    """
    variants: list[Variant] = [(BASELINE_EAGER, base, base, contextlib.nullcontext)]
    if compiled:
        variants.append((BASELINE_COMPILED, torch.compile(base), base, contextlib.nullcontext))
        if torchao is not None:
            for rname in ("tensorwise", "rowwise"):
                m = torchao.convert_to_float8_training(copy.deepcopy(base),
                                                       config=torchao.Float8LinearConfig.from_recipe_name(rname))
                variants.append((f"torchao float8 {rname} (compiled)", torch.compile(m), m, contextlib.nullcontext))
    n_baselines = len(variants)
    for name, recipe in RECIPES:
        variants.append((name, hf, hf, lambda r=recipe(): hybridfp.autocast(recipe=r)))
    if fuse is not None:
        variants.append(("BF16 eager + hybridfp fused SwiGLU", fuse(base), base, contextlib.nullcontext))
    for name, recipe in RECIPES:
        if fuse is not None and name in FUSED_RECIPES:
            variants.append((name + FUSED, fuse(hf), hf, lambda r=recipe(): hybridfp.autocast(recipe=r)))
        if name in CODES_RECIPES:  # the A/B of copies written as BF16 decodes (the CUDA default)
            variants.append((name + common.CODES_SUFFIX, hf, hf,
                             lambda r=recipe(): common.decoded_mode("never", hybridfp.autocast(recipe=r))))
    if compiled:  # autocast outside, the model traced whole (fullgraph)
        for name, recipe in RECIPES:
            if name in COMPILED_RECIPES:
                variants.append((name + " (compiled)", torch.compile(hf, fullgraph=True), hf,
                                 lambda r=recipe(): hybridfp.autocast(recipe=r)))
    return variants, n_baselines


def bench_model(kind: str, family: str, make: Callable[[Callable], nn.Module], x: torch.Tensor, deadline: float,
                compiled: bool, torchao: Optional[Any], protocol: Protocol = Protocol(),
                checkpoint: Callable[[list], None] = lambda rows: None,
                fuse: Optional[Callable[[nn.Module], nn.Module]] = None, profile: Optional[str] = None,
                profiles: Optional[list[str]] = None, select: Optional[str] = None) -> list[dict[str, Any]]:
    """All variants of one model (``family``: "Linear" or "MLP", its error depths) in
    :func:`plan_variants`' order: baselines, the recipes' own rows, then the optional variants.
    ``select``: time only the candidates whose name contains one of its '|'-separated texts
    (every baseline runs; the others get no row).
    ``compiled``: BF16 compiled, torchao (when ``torchao`` is its float8 module) and the
    compiled hybridfp variants. ``fuse`` gives the model with the fused SwiGLU. Variants whose
    name contains ``profile`` get a kernel profile.

    Raises ``MissingBaselineError`` when a baseline cannot run; a variant beyond its error bound
    or failing gets an ``error`` row (``main`` fails the run on it)."""
    torch.manual_seed(0)
    base = make(torch_linear)
    with torch.no_grad():
        dy = torch.randn_like(base(x))
    ref = fp32_reference(make, base, x, dy)
    hf = make(hybridfp_linear)
    hf.load_state_dict(base.state_dict())
    variants, n_baselines = plan_variants(base, hf, compiled, torchao, fuse)
    if select is not None:
        variants = variants[:n_baselines] + [v for v in variants[n_baselines:] if selected(v[0], select)]
    rows: list[dict[str, Any]] = []
    steps: dict[str, Callable[[], Any]] = {}  # the baselines' steps
    for i, (name, model, plain, ctx) in enumerate(variants):
        is_baseline = i < n_baselines
        row: dict[str, Any] = {"model": kind, "variant": name, "baseline": is_baseline}
        if time.monotonic() > deadline:
            # named in the results; a recipe's own row not run fails the run (``main``)
            row.update(not_run="--deadline-s passed", optional=name not in dict(RECIPES))
            if is_baseline:
                raise MissingBaselineError(f"bench_mlp {kind}: baseline {name!r} not run: --deadline-s passed "
                                           "before it (baselines run first; raise --deadline-s)")
            rows.append(row)
            checkpoint(rows)
            continue
        try:
            params = list(plain.parameters())
            step = make_step(model, params, ctx, x, dy)
            t0 = time.monotonic()
            y = step()
            if x.is_cuda:
                torch.cuda.synchronize()
            row["first_step_s"] = time.monotonic() - t0  # includes compilation where compiled
            row.update(check_step(kind, family, name, y, x, params, ref))
            row["ms"] = bench_ms(step, warmup_ms=100, rep_ms=300)  # diagnostic: one unpaired median
            for bname in (BASELINE_EAGER, BASELINE_COMPILED) + torchao_baselines(name):
                if bname in steps:
                    r = paired_ratio(steps[bname], step, protocol)
                    row[f"vs {bname}"] = r.as_dict()
            # diagnostic: back-to-back steps and the host's time (not a ratio)
            row["ms_steady"], row["host_ms"] = bench_ms_steady(step)
            if profile and profiles is not None and selected(name, profile):
                profiles.append(profile_step(step, f"{kind}: {name} ({row['ms']:.2f} ms)"))
            if is_baseline:
                steps[name] = step
        except AccuracyError as e:
            row["error"] = str(e)
        except Exception as e:  # noqa: BLE001 - a candidate's failure is a row; a baseline's ends the run
            if is_baseline:
                raise MissingBaselineError(f"bench_mlp {kind}: baseline {name!r} failed: "
                                           f"{type(e).__name__}: {str(e)[:300]}") from e
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        checkpoint(rows)  # a partial JSON survives a timeout of the whole benchmark
        if x.is_cuda:
            torch.cuda.empty_cache()
    return rows


def candidate_names() -> list[str]:
    """Every candidate :func:`plan_variants` can time, by name (the baselines left out)."""
    variants, n_baselines = plan_variants(nn.Identity(), nn.Identity(), True, None, lambda m: m)
    return [name for name, *_ in variants[n_baselines:]]


def selected(name: str, select: str) -> bool:
    """Whether variant ``name`` contains one of ``select``'s '|'-separated texts (``--variants``,
    ``--profile``)."""
    return any(t and t in name for t in select.split("|"))


def _ci(r: dict[str, Any], name: str) -> Optional[str]:
    """The row's paired ratio against baseline ``name`` as "ratio [low, high]" (None if absent)."""
    p = r.get(f"vs {name}")
    return None if p is None else f"{p['ratio']:.3f} [{p['low']:.3f}, {p['high']:.3f}]"


def not_run(rows: list[dict[str, Any]]) -> list[str]:
    """The rows ``--deadline-s`` left unmeasured, "(optional)" after the variants of a recipe
    (fused, codes, compiled), whose absence does not fail the run."""
    return [f"{r['model']}: {r['variant']}" + (" (optional)" if r["optional"] else "") for r in rows if "not_run" in r]


def below_target(r: dict[str, Any]) -> bool:
    """Whether a hybridfp row's paired ratio against BF16 eager is below its recipe's target
    (``mlp_targets.target_of``)."""
    p, target = r.get(f"vs {BASELINE_EAGER}"), target_of(r["variant"])
    return target is not None and p is not None and p["ratio"] < target


def main(argv=None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--deadline-s", type=float, default=1e9,
                   help="skip the candidates left after this (a baseline not run by then fails the run)")
    p.add_argument("--linear-compiled", action="store_true", help="also compile the single Linear")
    p.add_argument("--no-torchao", action="store_true", help="skip the torchao baselines (recorded)")
    p.add_argument("--no-compile", action="store_true",
                   help="skip BF16 torch.compile, torchao and the compiled variants (recorded)")
    p.add_argument("--profile", default=None, help="profile one step of the variants whose name contains "
                   "this text ('|' separates alternatives); written to --profile-out")
    p.add_argument("--profile-out", type=Path, default=Path("mlp_profile.txt"))
    p.add_argument("--mlp-only", action="store_true", help="skip the single Linear")
    p.add_argument("--variants", default=None,
                   help="time only the candidates whose name contains this text ('|' separates alternatives; "
                        "the baselines always run; recorded), e.g. the variants a time-limited run leaves out")
    args = p.parse_args(argv)
    if args.variants is not None:
        names = candidate_names()
        if not any(selected(n, args.variants) for n in names):
            p.error(f"--variants {args.variants!r} matches no candidate; they are: {'; '.join(names)}")
    require_cuda()
    protocol = protocol_from(args)
    warnings.simplefilter("ignore")
    deadline = time.monotonic() + args.deadline_s
    env = environment()
    f8, ao = (None, "skipped (--no-torchao)") if args.no_torchao else torchao_status()
    env["torchao"] = ao
    skipped = [s for s, on in (("torchao (--no-torchao)", args.no_torchao),
                               ("BF16 torch.compile, torchao and compiled variants (--no-compile)", args.no_compile),
                               (f"candidates not matching --variants {args.variants!r}", args.variants is not None))
               if on]
    copy_bw = copy_bandwidth()
    d, h, tokens = QUICK_DIMS if args.quick else (D, H, TOKENS)
    x = torch.randn(tokens, d, device=common.DEVICE, dtype=torch.bfloat16, requires_grad=True)
    failures: list[str] = []

    def report(rows: list[dict[str, Any]], final: bool = False) -> None:
        table = md_table(["model", "variant", "x BF16 eager", "x BF16 compiled", "x torchao tensorwise",
                          "x torchao rowwise", "err y / dx / dW (bounds)", "gain y / dx / dW", "ms",
                          "steady ms (diagnostic)", "host ms", "first step s"], [
            (r["model"], r["variant"] + (f" **below {target_of(r['variant']):.2f}x target**" if below_target(r) else ""),
             r.get("error") or (f"not run: {r['not_run']}" if "not_run" in r else _ci(r, BASELINE_EAGER)),
             _ci(r, BASELINE_COMPILED),
             _ci(r, TORCHAO_TENSORWISE), _ci(r, TORCHAO_ROWWISE),
             "{:.3g} / {:.3g} / {:.3g} ({:.3g} / {:.3g} / {:.3g})".format(
                 *(r[f"{k}_{t}"] for k in ("err", "bound") for t in ("y", "dx", "dW"))) if "err_y" in r else None,
             " / ".join(f"{r[f'gain_{t}']:.4f}" for t in ("y", "dx", "dW")) if "gain_y" in r else None,
             r.get("ms"), r.get("ms_steady"), r.get("host_ms"), r.get("first_step_s")) for r in rows])
        md = ("### Linear and Llama-3-8B MLP, forward + backward (paired ratios)\n\n"
              f"torchao: {ao}. Ratios: median over {protocol.rounds} alternating rounds ({protocol.samples} "
              "steps a side each, L2 flushed before each) of baseline time / variant time (> 1: faster), "
              "[≥ 95 % interval]. err: relative Frobenius error of y, dx and the worst dW vs an FP32 "
              "reference of the same inputs, with its bound from the element formats; gain: the least-squares "
              "scale onto the reference (1 +- common.GAIN_TOLERANCE: a dropped term or wrong scale moves it). ms: one unpaired "
              "do_bench median; \"steady ms\": 20 back-to-back steps, no flush; \"host ms\": the host's "
              "time for one step on an idle GPU (above ms: host-bound); diagnostics, not ratios. hybridfp "
              "weights are re-quantized every step."
              + (f" Skipped by flag: {'; '.join(skipped)}." if skipped else "")
              + (f" Not run (--deadline-s passed): {'; '.join(not_run(rows))}." if not_run(rows) else "")
              + ("" if protocol.reportable else " NOT REPORTABLE (fewer than 10 rounds or samples).")
              + ("" if final else " PARTIAL (the run stopped early).") + "\n\n" + table + "\n")
        result = {"env": env, "protocol": protocol_record(protocol), "skipped": skipped, "not_run": not_run(rows),
                  "copy_bandwidth": copy_bw,
                  "rows": rows, "failures": failures, "markdown": md}
        if final:
            finish("mlp", result, args.out)
        elif args.out is not None:
            args.out.write_text(json.dumps({"name": "mlp", **result}, indent=1, default=str))

    if f8 is None and not args.no_torchao and not args.no_compile:
        failures.append(f"bench_mlp: baseline torchao float8 missing: {ao}; install torchao or pass --no-torchao")
        report([], final=True)
        raise SystemExit(failures[-1])
    profiles: list[str] = []
    rows: list[dict[str, Any]] = []
    try:
        if not args.mlp_only:
            rows += bench_model(f"Linear {tokens}x{d}->{h}", "Linear", lambda lin: lin(d, h), x, deadline,
                                args.linear_compiled and not args.no_compile, f8, protocol, report,
                                select=args.variants)
        rows += bench_model(f"Llama-3-8B MLP {tokens}x{d}->{h}->{d}", "MLP", lambda lin: MLP(lin, d, h), x, deadline,
                            not args.no_compile, f8, protocol, lambda new: report(rows + new), fuse=fused_swiglu,
                            profile=args.profile, profiles=profiles, select=args.variants)
    except MissingBaselineError as e:
        failures.append(str(e))
    if profiles:
        args.profile_out.write_text("\n\n".join(profiles))
    failures += [f"{r['model']}: {r['variant']}: {r['error']}" for r in rows if "error" in r]
    failures += [f"{r['model']}: {r['variant']}: not run ({r['not_run']})" for r in rows
                 if "not_run" in r and not r["optional"]]
    report(rows, final=True)
    if failures:
        raise SystemExit("bench_mlp failed:\n" + "\n".join(failures))


if __name__ == "__main__":
    main()
