"""What the Llama-3-8B MLP's speed targets allow: the ratio each recipe could reach against BF16
eager if everything but its unavoidable work were free, from quantities measured in one
process, under stated premises.

One step is bench_mlp's: zero grads, forward, backward with a fixed dy, weights re-quantized
(16384 tokens, 4096 -> 14336 -> 4096, SwiGLU, x requires grad). The BF16 eager step (device
time, torch.profiler) splits into its GEMMs G_bf16 (the ops in ``GEMM_OPS``: ``aten::mm`` and
its kin, ``aten::_scaled_mm``) and the rest S (SwiGLU forward and backward, gradient adds,
copies: the same kernels in every recipe's step). A recipe's step is at least

    S + G_r + the bytes its quantization must move / the copy bandwidth

with G_r its GEMMs' device time measured in its own step (FP8 GEMMs run on FP8 tensor cores;
MXFP8 and NVFP4 on Hopper run BF16 GEMMs on decoded values). The bound is T_bf16 / that; the
measured device-time ratio T_bf16 / T_r is printed beside it with the target.

The quantized tensors of one step (``quantized_elements``), by role and the two GEMMs that
read each: inputs (fprop and wgrad) are x, once (gate and up read the same copies) and the
SwiGLU output; weights (fprop and dgrad) gate, up and down; gradients (dgrad and wgrad) dy and
the gradients into gate and up. The GEMMs' outputs (y, dx, dW, the gradient into the SwiGLU)
are not quantized.

Per quantized element, at least: the high-precision tensor read once (2 bytes); an amax pass
reading it again (2) where one of its copies has a per-tensor scale (FP8 current scaling, and
NVFP4's second-level FP32 scale) unless ``--fused-amax`` (the premise that the kernel
producing each tensor also reduces its amax); and each copy written once:

- FP8 (current or block): 1 byte. Copies holding the same codes transposed are written once:
  FP8 current's row and column copies (one per-tensor scale; as ``bound_moe`` counts it, the
  transposed copy comes free), and 2D-tiled weights (FP8 block's 128x128, NVFP4's 16x16). 1D
  blocks (1x128, MXFP8's 1x32, NVFP4's 1x16) scale rows and columns differently: two copies.
- MXFP8 / NVFP4 as Hopper runs them (``decode="bf16"``): the BF16 decode each GEMM reads, 2
  bytes a copy; the generous floor (``decode="codes"``, a GEMM that decoded codes for free):
  the codes, 1 byte (MXFP8) or 0.5 (NVFP4) a copy.

Block scales (at most 1/16 byte an element) are not counted: every floor is a lower one, so
every bound an upper one.

With ``--at-cap`` every quantity is measured at the GPU's steady power state, as the paired
ratios the targets are stated on run (``bench/profile_rounds.py``: the BF16 step heats the GPU,
then ``--rounds`` rounds profile every step, each after ``--warm-s`` seconds of its own); each
round gives a bound and a measured ratio, reported as the median of the rounds with its
order-statistic interval, and each step's SM clock, power and temperature.

    python -m bench.bound_mlp [--fused-amax] [--at-cap [--rounds 10] [--warm-s 1] [--heat-s 15]]
        [--tokens N] [--quick] [--out results.json]
"""

from __future__ import annotations

import contextlib
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch

import hybridfp
from bench import bench_mlp, common
from bench.mlp_targets import TARGETS
from bench.bound_moe import _profile, costliest_ops
from bench.common import environment, finish, md_table, parser, require_cuda
from bench import profile_rounds
from bench.profile_rounds import AtCap

#: profiler op names whose self device time is a GEMM's (``aten::matmul`` only dispatches)
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::_scaled_mm")
#: element-format family of the (fprop, dgrad, wgrad) GEMMs' operands of each bench_mlp recipe
RECIPE_GEMMS = {
    "hybridfp FP8 current": ("fp8_current",) * 3,
    "hybridfp FP8 current, fprop fast accumulation": ("fp8_current",) * 3,
    "hybridfp FP8 block": ("fp8_block",) * 3,
    "hybridfp hybrid FP8-current fwd / FP8-block bwd": ("fp8_current", "fp8_block", "fp8_block"),
    "hybridfp MXFP8": ("mxfp8",) * 3,
    "hybridfp NVFP4 fwd / MXFP8 bwd": ("nvfp4", "mxfp8", "mxfp8"),
    "hybridfp NVFP4 (2D weights, RHT, SR)": ("nvfp4",) * 3,
}
#: recipes whose weights are 2D-tiled (row and column copies hold the same codes transposed)
TILED_WEIGHTS = ("hybridfp FP8 block", "hybridfp NVFP4 (2D weights, RHT, SR)")
#: which GEMMs read each role's two copies (indices into a RECIPE_GEMMS entry)
ROLE_GEMMS = {"input": (0, 2), "weight": (0, 1), "grad": (1, 2)}
#: bytes a copy writes per element: FP8 codes; MXFP8 / NVFP4 as BF16 decodes or as codes
COPY_BYTES = {"bf16": {"fp8_current": 1.0, "fp8_block": 1.0, "mxfp8": 2.0, "nvfp4": 2.0},
              "codes": {"fp8_current": 1.0, "fp8_block": 1.0, "mxfp8": 1.0, "nvfp4": 0.5}}
#: families with a per-tensor scale: an amax pass unless fused into the producer
PER_TENSOR = ("fp8_current", "nvfp4")
DECODED = ("mxfp8", "nvfp4")


@dataclass(frozen=True)
class Premises:
    """What the bound assumes about the step.

    Parameters
    ----------
    fused_amax:
        A per-tensor amax (FP8 current, NVFP4's global scale) comes from the kernel producing
        each tensor: no amax pass (2 bytes an element fewer).
    """

    fused_amax: bool = False


#: the baseline's name among the profiled steps (``Measured.rounds``)
BF16 = "BF16 eager"


@dataclass(frozen=True)
class Measured:
    """Device ms of one step: the BF16 eager MLP's and its GEMMs', each recipe's (step ms, GEMMs
    ms) by bench_mlp name; the MLP's shape and the copy bandwidth (GB/s, bytes read + written).
    Measured at the power cap (``at_cap``: ``AtCap``'s fields), also each round's (step ms,
    GEMMs ms) by step name (``BF16`` and the recipes; the single figures are their medians) and
    each step's clock summary."""

    tokens: int
    hidden: int
    intermediate: int
    bf16_step_ms: float
    bf16_gemm_ms: float
    recipes: dict[str, tuple[float, float]]
    copy_GBps: float
    rounds: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    clocks: dict[str, dict[str, float]] = field(default_factory=dict)
    at_cap: Optional[dict[str, Any]] = None


def quantized_elements(tokens: int, hidden: int, intermediate: int) -> dict[str, int]:
    """Elements quantized in one step of the gated MLP, by role (module docstring).

    Example
    -------
    >>> quantized_elements(2, 3, 5)
    {'input': 16, 'weight': 45, 'grad': 26}
    """
    return {"input": tokens * (hidden + intermediate),  # x (once for gate and up), the SwiGLU output
            "weight": 3 * hidden * intermediate,  # gate, up, down
            "grad": tokens * (hidden + 2 * intermediate)}  # dy; the gradients into gate and up


def role_bytes(recipe: str, p: Premises, decode: str) -> dict[str, float]:
    """Bytes a quantized element of each role moves at least under ``recipe`` (a bench_mlp
    name), ``p`` and ``decode`` ("bf16": MXFP8 / NVFP4 copies as the BF16 decodes Hopper's GEMMs
    read; "codes": as their codes).

    Raises
    ------
    ValueError
        A recipe without a ``RECIPE_GEMMS`` entry or an unknown ``decode``.

    Example
    -------
    >>> role_bytes("hybridfp FP8 current", Premises(), "bf16")
    {'input': 5.0, 'weight': 5.0, 'grad': 5.0}
    """
    if recipe not in RECIPE_GEMMS:
        raise ValueError(f"bound_mlp: recipe {recipe!r} has no operand formats; add it to RECIPE_GEMMS")
    if decode not in COPY_BYTES:
        raise ValueError(f"bound_mlp: decode must be one of {tuple(COPY_BYTES)}, got {decode!r}")
    gemms = RECIPE_GEMMS[recipe]
    out = {}
    for role, (i, j) in ROLE_GEMMS.items():
        a, b = gemms[i], gemms[j]
        same_codes = a == b and (a == "fp8_current" or (role == "weight" and recipe in TILED_WEIGHTS))
        written = COPY_BYTES[decode][a] + (0.0 if same_codes else COPY_BYTES[decode][b])
        amax = 0.0 if p.fused_amax or not {a, b} & set(PER_TENSOR) else 2.0
        out[role] = 2.0 + amax + written
    return out


def floors(recipe: str, p: Premises) -> dict[str, str]:
    """Each floor of ``recipe``: its label -> ``decode`` (two for MXFP8 / NVFP4 copies)."""
    amax = "amax fused into the producer" if p.fused_amax else "amax its own pass"
    if not set(RECIPE_GEMMS[recipe]) & set(DECODED):
        return {f"one read, FP8 copies ({amax})": "bf16"}
    return {f"BF16-decoded copies, as Hopper runs it ({amax})": "bf16",
            f"codes, a free in-GEMM decode ({amax})": "codes"}


def bound_rows(m: Measured, p: Premises) -> list[dict[str, Any]]:
    """Each recipe's floors (bench_mlp's order): the step time each allows and its ratio
    against the baseline's measured step, beside the recipe's measured ratio and target.

    Raises
    ------
    ValueError
        A bench_mlp recipe without a measured step in ``m``.
    """
    elems = quantized_elements(m.tokens, m.hidden, m.intermediate)
    shared = m.bf16_step_ms - m.bf16_gemm_ms
    out = []
    for recipe, _ in bench_mlp.RECIPES:
        if recipe not in m.recipes:
            raise ValueError(f"bound_mlp: no measured step for {recipe!r}; measure every bench_mlp recipe")
        step_ms, gemm = m.recipes[recipe]
        for name, decode in floors(recipe, p).items():
            nbytes = sum(elems[r] * b for r, b in role_bytes(recipe, p, decode).items())
            quantize = nbytes / m.copy_GBps / 1e6
            t = shared + gemm + quantize
            row = dict(recipe=recipe, floor=name, bytes_per_element=nbytes / sum(elems.values()),
                       gemm_ms=gemm, quantize_ms=quantize, step_ms=t, bound=m.bf16_step_ms / t,
                       target=TARGETS[recipe], measured_step_ms=step_ms, measured=m.bf16_step_ms / step_ms)
            if m.rounds:
                row.update(_per_round(m, recipe, quantize))
            out.append(row)
    return out


def _per_round(m: Measured, recipe: str, quantize: float) -> dict[str, Any]:
    """The bound and the measured ratio of each round (the BF16 step and the recipe's profiled in
    the same round), their medians (replacing the ratios of the medians) and intervals.

    Raises
    ------
    ValueError
        The baseline and ``recipe`` with different numbers of rounds.
    """
    base, mine = m.rounds[BF16], m.rounds.get(recipe, [])
    if len(base) != len(mine):
        raise ValueError(f"bound_mlp: {len(base)} rounds of {BF16!r} but {len(mine)} of {recipe!r}; "
                         "every step is profiled once a round")
    bounds = [b_step / ((b_step - b_gemm) + gemm + quantize) for (b_step, b_gemm), (_, gemm) in zip(base, mine)]
    measured = [b_step / step for (b_step, _), (step, _) in zip(base, mine)]
    return {**profile_rounds.median_of_rounds("bound", bounds), **profile_rounds.median_of_rounds("measured", measured)}


def gemm_ms(ops: dict[str, float]) -> float:
    """Self device ms of the GEMM ops (``GEMM_OPS``) in a profile's op / kernel name -> self ms
    (``bound_moe._profile``); kernels' own names are skipped, their op counts them once.

    Example
    -------
    >>> gemm_ms({"aten::mm": 2.0, "aten::_scaled_mm": 1.0, "aten::mul": 0.5, "sm90_xmma_gemm": 2.0})
    3.0
    """
    return sum(ms for key, ms in ops.items() if key in GEMM_OPS)


#: FP8 tensor cores run at most twice BF16's rate: a recipe's GEMMs in less than this share of the
#: BF16 step's GEMM time mean the profiler named a GEMM outside ``GEMM_OPS`` (a bound far too high)
MIN_GEMM_SHARE = 0.4


def check_gemm_share(recipe: str, gemm: float, bf16_gemm: float, ops: dict[str, float]) -> None:
    """Refuse a recipe whose measured GEMM time is implausibly small against the BF16 step's.

    Raises
    ------
    RuntimeError
        ``gemm`` < ``MIN_GEMM_SHARE`` x ``bf16_gemm``, naming the recipe and its step's costliest ops
        (one of them is a GEMM ``GEMM_OPS`` does not name).
    """
    if gemm < MIN_GEMM_SHARE * bf16_gemm:
        raise RuntimeError(f"bound_mlp: {recipe!r}: its GEMMs took {gemm:.3f} ms of device time, under "
                           f"{MIN_GEMM_SHARE} x the BF16 step's {bf16_gemm:.3f} ms: a GEMM op outside GEMM_OPS "
                           f"{GEMM_OPS}? Costliest ops of its step: {costliest_ops(ops)}")


#: the BF16 MLP step is nearly all GEMMs (three linears, fwd + bwd): a smaller named share means
#: the profiler's GEMM names went unmatched and S would swallow them (every bound far too low)
MIN_BF16_GEMM_SHARE = 0.3


def check_baseline(step_ms: float, gemm: float, ops: dict[str, float]) -> None:
    """Refuse a BF16 baseline profile without device time or whose GEMMs were not named.

    Raises
    ------
    RuntimeError
        ``step_ms`` <= 0 (no device events), or ``gemm`` < ``MIN_BF16_GEMM_SHARE`` x ``step_ms``,
        naming the step's costliest ops.
    """
    if step_ms <= 0:
        raise RuntimeError(f"bound_mlp: the BF16 eager step shows no device time in its profile "
                           f"(ops: {costliest_ops(ops)}); "
                           "run on a CUDA GPU with the profiler's CUDA activity available")
    if gemm < MIN_BF16_GEMM_SHARE * step_ms:
        raise RuntimeError(f"bound_mlp: the BF16 eager step's GEMMs took {gemm:.3f} of its {step_ms:.3f} device ms, "
                           f"under {MIN_BF16_GEMM_SHARE} of it: a GEMM op outside GEMM_OPS {GEMM_OPS}? "
                           f"Costliest ops: {costliest_ops(ops)}")


def _step(model: torch.nn.Module, ctx: Any, x: torch.Tensor, dy: torch.Tensor) -> Any:
    """bench_mlp's step, with the ``reset()`` bound_moe's ``_profile`` calls before the profiled
    step (nothing to reset: the MLP has no routing schedule)."""
    step = bench_mlp.make_step(model, list(model.parameters()), ctx, x, dy)
    step.reset = lambda: None
    return step


def measure(tokens: int, hidden: int, intermediate: int, at_cap: Optional[AtCap] = None) -> Measured:
    """Profile one bench_mlp step of the BF16 eager MLP and of the hybridfp MLP under every
    recipe in ``bench_mlp.RECIPES`` (same weights, x and dy), and the copy bandwidth. With
    ``at_cap``, every step ``at_cap.rounds`` times at the GPU's steady power state
    (``profile_rounds``) instead of once.

    Raises
    ------
    RuntimeError
        A baseline or recipe whose GEMMs the profiler did not name, in any round
        (:func:`check_baseline`, :func:`check_gemm_share`).
    """
    torch.manual_seed(0)
    base = bench_mlp.MLP(bench_mlp.torch_linear, hidden, intermediate)
    hf = bench_mlp.MLP(bench_mlp.hybridfp_linear, hidden, intermediate)
    hf.load_state_dict(base.state_dict())
    x = torch.randn(tokens, hidden, device=common.DEVICE, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, hidden, device=common.DEVICE, dtype=torch.bfloat16)
    steps = {BF16: _step(base, contextlib.nullcontext, x, dy)}
    for name, make in bench_mlp.RECIPES:
        steps[name] = _step(hf, lambda r=make(): hybridfp.autocast(recipe=r), x, dy)
    if at_cap is None:
        profiles = {name: [_profile(step)] for name, step in steps.items()}
        clocks: dict[str, dict[str, float]] = {}
    else:
        got = profile_rounds.profile_rounds(steps, at_cap, _profile)
        profiles, clocks = got.rounds, got.clocks
    rounds = split_rounds(profiles)
    step_ms, gemm = (statistics.median(v) for v in zip(*rounds[BF16]))
    recipes = {n: tuple(statistics.median(v) for v in zip(*rounds[n])) for n, _ in bench_mlp.RECIPES}
    return Measured(tokens, hidden, intermediate, step_ms, gemm, recipes, common.copy_bandwidth()["GBps"],
                    rounds=rounds if at_cap is not None else {}, clocks=clocks,
                    at_cap=at_cap.record() if at_cap is not None else None)


def split_rounds(profiles: dict[str, list[tuple[float, dict[str, float]]]]) -> dict[str, list[tuple[float, float]]]:
    """Each step's profiles as (step ms, GEMMs ms) a round, every profile checked: the baseline's
    (``BF16``) by :func:`check_baseline`, each recipe's against the same round's baseline GEMMs
    by :func:`check_gemm_share`.

    Raises
    ------
    RuntimeError
        From the checks, naming the step.
    ValueError
        No ``BF16`` profiles.
    """
    if not profiles.get(BF16):
        raise ValueError(f"bound_mlp: no profile of the baseline {BF16!r}")
    for t, ops in profiles[BF16]:
        check_baseline(t, gemm_ms(ops), ops)
    out = {BF16: [(t, gemm_ms(ops)) for t, ops in profiles[BF16]]}
    for name, got in profiles.items():
        if name == BF16:
            continue
        for (t, ops), (_, base_gemm) in zip(got, out[BF16]):
            check_gemm_share(name, gemm_ms(ops), base_gemm, ops)
        out[name] = [(t, gemm_ms(ops)) for t, ops in got]
    return out


def report(m: Measured, p: Premises) -> str:
    """The bound table under ``p``, as Markdown."""
    elems = quantized_elements(m.tokens, m.hidden, m.intermediate)
    how = profile_rounds.describe(m.at_cap, "BF16")
    head = (f"### Llama-3-8B MLP bound, {m.tokens} tokens x {m.hidden} -> {m.intermediate} -> {m.hidden}, "
            f"fwd + bwd, amax {'fused into the producer' if p.fused_amax else 'its own pass'} "
            f"({how}; weights re-quantized every step)\n\n")
    parts = md_table(["quantity", "ms"], [
        ["BF16 eager step", m.bf16_step_ms], [f"its GEMMs ({', '.join(GEMM_OPS)})", m.bf16_gemm_ms],
        ["shared rest S", m.bf16_step_ms - m.bf16_gemm_ms]])
    counts = ", ".join(f"{v / 1e9:.3f} G {k}" for k, v in elems.items())
    mid = f"\n\ncopy bandwidth {m.copy_GBps:.0f} GB/s (read + write); elements quantized a step: {counts}\n\n"
    ratio = profile_rounds.with_interval
    table = md_table(["recipe", "floor", "bytes / element", "GEMMs ms", "quantize ms", "step ms", "bound x BF16",
                      "target", "measured step ms", "measured device-time x BF16"],
                     [[b["recipe"], b["floor"], b["bytes_per_element"], b["gemm_ms"], b["quantize_ms"], b["step_ms"],
                       ratio(b, "bound"), b["target"], b["measured_step_ms"], ratio(b, "measured")]
                      for b in bound_rows(m, p)])
    clocks = profile_rounds.clock_table(m.clocks)
    return head + parts + mid + table + ("\n\n" + clocks if clocks else "") + "\n"


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m bench.bound_mlp``: measure (:func:`measure`), print the bound table and write the JSON
    (``--out``). Exits with a message without a CUDA GPU or for ``--tokens`` < 1."""
    p = parser(__doc__.splitlines()[0])
    p.set_defaults(out=common.RESULTS_DIR / "bound_mlp.json")
    p.add_argument("--tokens", type=int, default=None, help=f"tokens a step (default {bench_mlp.TOKENS}; "
                   f"--quick {bench_mlp.QUICK_DIMS[2]})")
    p.add_argument("--fused-amax", action="store_true", help="a per-tensor amax is reduced by the kernel producing "
                   "each tensor (no amax pass: FP8 current 3 bytes an element instead of 5)")
    profile_rounds.add_arguments(p, AtCap())
    args = p.parse_args(argv)
    if args.tokens is not None and args.tokens < 1:
        p.error(f"--tokens must be >= 1, got {args.tokens}")
    at_cap = profile_rounds.from_arguments(p, args, AtCap())
    premises = Premises(args.fused_amax)
    require_cuda()
    hidden, intermediate, tokens = bench_mlp.QUICK_DIMS if args.quick else (bench_mlp.D, bench_mlp.H, bench_mlp.TOKENS)
    m = measure(args.tokens or tokens, hidden, intermediate, at_cap)
    finish("bound_mlp", {"env": environment(), **asdict(m), "premises": asdict(premises),
                         "bounds": bound_rows(m, premises), "markdown": report(m, premises)}, args.out)


if __name__ == "__main__":
    main()
