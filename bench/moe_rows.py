"""The rows a bench_moe run plans, before any is timed: the recipes and their A/B variants (the
suffixes), torchao's float8 rows (by name only, ``moe_torchao``), the switches each suffix flips
(``wrap``), the layer each row runs (``variants_of``) and each row's error bounds from its formats
(``error_bounds``, ``breaches``)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

import hybridfp
from bench import common, moe_torchao
from bench.common import GAIN_TOLERANCE, MissingBaselineError, error_bound
from bench.moe_layer import BF16MoE, HybridMoE, PrimaryWeightsMoE
from bench.moe_torchao import TORCHAO_FORMATS, TORCHAO_ROWS


#: in the order they run after the baselines: the rows with a target (``moe_targets.TARGETS``)
#: first, so a deadline reaches them before Composer-2 and the BF16 row (which have none)
RECIPES: list[tuple[str, Callable[[], hybridfp.Recipe]]] = [
    ("hybridfp FP8 current", lambda: hybridfp.Float8CurrentScaling()),
    ("hybridfp MXFP8", lambda: hybridfp.MXFP8BlockScaling()),
    ("hybridfp Composer-2 (NVFP4 row-scaled fwd / MXFP8 bwd)",
     lambda: hybridfp.CustomRecipe(qfactory=hybridfp.factories.nvfp4_row_scaled_fwd_mxfp8_bwd)),
    ("hybridfp BF16 (high_precision)", lambda: hybridfp.CustomRecipe(qfactory=hybridfp.factories.high_precision)),
]
#: the three BF16 baselines; the headline ratio is against the fastest of them in the run
BF16_GROUPED, BF16_PER_EXPERT, BF16_COMPILED = "BF16 grouped", "BF16 per-expert", "BF16 compiled"
BASELINES = (BF16_GROUPED, BF16_PER_EXPERT, BF16_COMPILED)
#: element formats (forward operands, backward gradients) of each row's recipe (its name
#: without a variant suffix; the BF16 baselines under "BF16"): its error bounds
RECIPE_FORMATS = {
    "BF16": ("bf16", "bf16"),
    "hybridfp BF16 (high_precision)": ("bf16", "bf16"),
    "hybridfp FP8 current": ("e4m3", "e5m2"),
    "hybridfp MXFP8": ("e4m3", "e4m3"),
    "hybridfp Composer-2 (NVFP4 row-scaled fwd / MXFP8 bwd)": ("e2m1", "e4m3"),
    **{name: TORCHAO_FORMATS for name in TORCHAO_ROWS},
    "BF16 grouped": ("bf16", "bf16"),  # its variant row "[fused SwiGLU]"
}
#: (forward, backward) GEMMs on the longest path to each checked tensor (``common.error_bound``;
#: the experts are a SwiGLU MLP, as bench_mlp's): all micro-batches' outputs, x's gradient and
#: each layer's weight gradient. The bench's CPU smoke shape (4 experts, 64 tokens, hidden 64,
#: 2 micro-batches) measures 0.4-0.5 % for BF16 (bounds 1.7-1.9 %), 6.3-7.5 % for FP8 current
#: (15-26 %), 6.5-6.7 % for MXFP8 (15-21 %), 21-24 % for Composer-2 (58-59 %).
DEPTHS = {"out": (2, 0), "dx": (1, 2), "dw": (1, 2)}
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
#: The quantized recipes with quantized primary weights (``PrimaryWeightsMoE``: built under
#: ``hybridfp.quantized_model_init``, FP32 masters re-encoded once a step inside the step)
PRIMARY_VARIANTS = tuple(name for name, _ in RECIPES if name != "hybridfp BF16 (high_precision)")
PRIMARY_SUFFIX = " [quantized primary weights]"
#: The quantized-primary-weight layer of these recipes under ``torch.compile`` too (the same
#: backend as "BF16 compiled"): the routing, permutation, SwiGLU and un-permutation compiled as
#: the compiled BF16 baseline's, each GroupedLinear call a graph break that runs eagerly. The
#: same layer (its weights and masters) as the eager quantized-primary row.
COMPILED_VARIANTS = ("hybridfp FP8 current", "hybridfp MXFP8")
COMPILED_SUFFIX = " [compiled]"
#: The recipes whose rows (plain and with quantized primary weights) are timed again with
#: ``hybridfp.swiglu`` as the experts' activation (``HybridMoE.with_fused_swiglu``: one Triton
#: kernel each way, fc1's gradient written as one tensor, FP8 current's per-expert amaxes of h
#: and of that gradient recorded by the kernels) instead of eager ``F.silu(g) * u``,
#: whose forward and backward are five memory-bound passes and a concatenation; the compiled
#: BF16 baseline fuses its activation too. A primary row's fused twin is planned right after it;
#: the plain layers' fused rows and BF16 grouped's after every primary row, before the compiled ones.
FUSED_SWIGLU_VARIANTS = ("hybridfp FP8 current", "hybridfp MXFP8")
FUSED_SWIGLU_SUFFIX = " [fused SwiGLU]"
#: BF16 grouped with the same fused SwiGLU, timed against the fastest BF16 like a variant row: it
#: shows whether the activation alone would make BF16 faster than the compiled baseline
BF16_FUSED_SWIGLU = "BF16 grouped" + FUSED_SWIGLU_SUFFIX
#: FP8 current timed again with the grouped FP8 GEMM's pointer kernel (the policy's
#: grouped_fp8_tma_rows / grouped_fp8_tma_wgrad set to None, None; ``--fp8-tma ROWS/WGRAD``
#: names TMA configs instead, passed down as ``bench_config``'s ``fp8_tma``),
#: on the per-expert and the one-Parameter layer, against the TMA kernel (the default)
FP8_TMA_VARIANTS = ("hybridfp FP8 current",)
FP8_TMA_SUFFIX = " [FP8 pointer grouped GEMM]"
#: (rows, wgrad) kernels of the FP8 TMA A/B rows: a TMA config name, or None for the pointer kernel
TmaPair = tuple[Optional[str], Optional[str]]

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


def with_fp8_tma(step: Callable[[], torch.Tensor], tma: TmaPair = (None, None)) -> Callable[[], torch.Tensor]:
    """``step`` with the grouped FP8 GEMM's kernels set by ``tma`` (rows / wgrad: a TMA config
    name or None for the pointer kernel)."""
    def run() -> torch.Tensor:
        with hybridfp.policy(grouped_fp8_tma_rows=tma[0], grouped_fp8_tma_wgrad=tma[1]):
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


def error_bounds(variant: str) -> dict[str, float]:
    """The bounds of ``variant``'s formats (``RECIPE_FORMATS``, ``DEPTHS``), or a clear error."""
    key = "BF16" if variant in BASELINES else variant.split(" [")[0]
    if key not in RECIPE_FORMATS:
        raise ValueError(f"{variant}: no element formats stated for '{key}'; add them to moe_rows.RECIPE_FORMATS")
    fwd, bwd = RECIPE_FORMATS[key]
    return {t: error_bound(fwd, bwd, *depth) for t, depth in DEPTHS.items()}


def breaches(variant: str, errors: dict[str, float], gains: Optional[dict[str, float]] = None) -> list[str]:
    """Each error of ``errors`` beyond ``variant``'s bound (or NaN), and each gain of ``gains``
    off 1 by more than ``common.GAIN_TOLERANCE`` (a missing term or a wrong scale: within a 4-bit
    format's loose error bound), as text."""
    bounds = error_bounds(variant)
    return [f"{variant}: {q} relative error {v:.4g} > bound {bounds[q.rstrip('12')]:.4g}"
            for q, v in errors.items() if not v <= bounds[q.rstrip("12")]] + [
        f"{variant}: {q} gain {g:.4g} off 1 by more than {GAIN_TOLERANCE} (a missing term or a wrong scale)"
        for q, g in (gains or {}).items() if not abs(g - 1) <= GAIN_TOLERANCE]


def wrap(name: str, step: Callable[[], Any], fp8_tma: TmaPair = (None, None)) -> Callable[[], Any]:
    """``step`` under the switches its variant's suffixes name (``fp8_tma``: the FP8 TMA A/B
    rows' kernels, ``with_fp8_tma``)."""
    run: Callable[[], Any] = step
    if name.endswith((TRITON_SUFFIX, PER_EXPERT_SUFFIX, FP8_TRITON_SUFFIX)):
        run = with_triton_grouped(run, on=not name.endswith(PER_EXPERT_SUFFIX),
                                  fp8_everywhere=name.endswith(FP8_TRITON_SUFFIX))
    if name.endswith(FP8_TMA_SUFFIX):
        run = with_fp8_tma(run, fp8_tma)
    if name.endswith(NO_PLAN_MEMO_SUFFIX):
        run = without_plan_memo(run)
    if name.endswith(NO_METADATA_MEMO_SUFFIX):
        run = without_metadata_memo(run)
    if name.endswith((PER_GROUP_SUFFIX, CUTLASS_SUFFIX)):
        run = with_per_group_cublas(run, on=name.endswith(PER_GROUP_SUFFIX))
    return run


def _once(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """``build`` called at the first call only (a layer built when its first row runs, then shared)."""
    built: list[nn.Module] = []

    def get() -> nn.Module:
        if not built:
            built.append(build())
        return built[0]
    return get


class UnknownRowError(ValueError):
    """``--variants`` names a row the run does not plan."""


def variants_of(base: BF16MoE, hf: HybridMoE, only: Optional[list[str]], ab: bool, compile_backend: str
                ) -> list[tuple[str, Callable[[], nn.Module], Optional[Callable[[], Any]]]]:
    """(name, its layer's builder, autocast context) of the three baselines, the torchao rows
    ``only`` names (``moe_torchao``: right after the baselines, the FP8 rows are paired against
    them too) and the candidates. The extra layers (unpacked, one weight Parameter, quantized primary
    weights, torchao's) are built when their first row runs: a run that selects none of their
    rows never holds them.

    Raises
    ------
    UnknownRowError
        A name in ``only`` (``--variants``) is no row of this run (a typo, or an A/B row without
        ``ab``): the run would otherwise time the baselines alone.
    MissingBaselineError
        ``torch.compile`` of the BF16 layer fails.
    """
    try:
        compiled = torch.compile(base.sharing("grouped"), backend=compile_backend)
    except Exception as err:  # noqa: BLE001 - named, as any baseline's failure
        raise MissingBaselineError(f"bench_moe: the baseline '{BF16_COMPILED}' failed: torch.compile(backend="
                                   f"{compile_backend!r}): {type(err).__name__}: {err}") from err
    per_expert = base.sharing("per_expert")
    variants: list[tuple[str, Callable[[], nn.Module], Optional[Callable[[], Any]]]] = [
        (BF16_GROUPED, lambda: base, None), (BF16_PER_EXPERT, lambda: per_expert, None),
        (BF16_COMPILED, lambda: compiled, None)]
    variants += [(name, _once(lambda n=name: moe_torchao.build(n, base, compile_backend)), None)
                 for name in moe_torchao.selected(only)]
    for name, recipe in RECIPES:
        variants.append((name, lambda: hf, lambda r=recipe(): hybridfp.autocast(recipe=r)))
    unpacked = _once(lambda: HybridMoE(base, pack_weights=False))
    single = _once(lambda: HybridMoE(base, single_parameter=True))
    same = lambda: hf  # noqa: E731
    extras = [(TRITON_VARIANTS, (TRITON_SUFFIX, PER_EXPERT_SUFFIX), same),
              (UNPACKED_VARIANTS, (UNPACKED_SUFFIX,), unpacked), (FP8_TRITON_VARIANTS, (FP8_TRITON_SUFFIX, PER_EXPERT_SUFFIX), same),
              (PER_GROUP_VARIANTS, (PER_GROUP_SUFFIX, CUTLASS_SUFFIX), same),
              (PLAN_VARIANTS, (NO_PLAN_MEMO_SUFFIX, NO_METADATA_MEMO_SUFFIX), same),
              (SINGLE_PARAM_VARIANTS, (SINGLE_PARAM_SUFFIX,), single),
              (FP8_TMA_VARIANTS, (FP8_TMA_SUFFIX,), same), (FP8_TMA_VARIANTS, (SINGLE_PARAM_SUFFIX + FP8_TMA_SUFFIX,), single)]
    if not ab:
        extras = [x for x in extras if x[1] == (SINGLE_PARAM_SUFFIX,)]
    for name, recipe in RECIPES:
        if ab and name in CODES_VARIANTS:
            variants.append((name + CODES_SUFFIX, same,
                             lambda r=recipe(): common.decoded_mode("never", hybridfp.autocast(recipe=r))))
    for names, suffixes, model in extras:
        for name, recipe in RECIPES:
            if name in names:
                variants += [(name + sx, model, lambda r=recipe(): hybridfp.autocast(recipe=r)) for sx in suffixes]
    compiled_rows: list = []
    fused_rows: list = []
    fused = _once(hf.with_fused_swiglu)
    for name, recipe in RECIPES:
        if name in FUSED_SWIGLU_VARIANTS:
            fused_rows.append((name + FUSED_SWIGLU_SUFFIX, fused, lambda r=recipe(): hybridfp.autocast(recipe=r)))
        if name in PRIMARY_VARIANTS:
            r = recipe()
            primary = _once(lambda r=r: PrimaryWeightsMoE(base, r))
            variants.append((name + PRIMARY_SUFFIX, primary, lambda r=r: hybridfp.autocast(recipe=r)))
            if name in FUSED_SWIGLU_VARIANTS:  # right after its eager twin: a deadline cuts neither alone
                variants.append((name + PRIMARY_SUFFIX + FUSED_SWIGLU_SUFFIX,
                                 _once(lambda p=primary: p().with_fused_swiglu()),
                                 lambda r=r: hybridfp.autocast(recipe=r)))
            if name in COMPILED_VARIANTS:
                compiled_rows.append((name + PRIMARY_SUFFIX + COMPILED_SUFFIX,
                                      _once(lambda p=primary: torch.compile(p(), backend=compile_backend)),
                                      lambda r=r: hybridfp.autocast(recipe=r)))
    fused_rows.append((BF16_FUSED_SWIGLU, _once(lambda: base.with_fused_swiglu()), None))
    variants += fused_rows + compiled_rows  # after the eager rows: a deadline reaches them last
    if only is not None:
        planned = {v[0] for v in variants}
        unknown = [n for n in only if n not in planned]
        if unknown:
            raise UnknownRowError(f"bench_moe --variants: no row named {', '.join(map(repr, unknown))}"
                             + ("" if ab else " (the A/B rows need --ab)") + "; the rows are: "
                             + "; ".join(v[0] for v in variants if not is_baseline(v[0]))
                             + "; by name only: " + "; ".join(TORCHAO_ROWS))
        variants = [v for v in variants if v[0] in BASELINES or v[0] in only]
    return variants


def is_baseline(variant: str) -> bool:
    """Whether other rows are paired against row ``variant``: its failure, or a deadline before
    it, stops the run by name.

    Parameters
    ----------
    variant:
        A row's name.

    Returns
    -------
    bool
        True for the BF16 baselines and the torchao rows (``moe_torchao.TORCHAO_ROWS``).
    """
    return variant in BASELINES or variant in TORCHAO_ROWS


def optional(variant: str) -> bool:
    """Whether a row may stay unmeasured without failing the run: an A/B variant (a suffix), not a
    recipe's row or a baseline (BF16, torchao)."""
    return not is_baseline(variant) and variant not in dict(RECIPES)


