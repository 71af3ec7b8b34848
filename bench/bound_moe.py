"""What the MoE layer's targets allow: the ratio a recipe could reach against the BF16 baselines
if everything but its unavoidable work were free, from quantities measured in one process,
under stated premises.

One step is ``--micro-batches`` N forward + backward passes (as bench_moe times it, each with
its own routing). The baseline's step (device time, torch.profiler) splits into its grouped
GEMMs (``aten::_grouped_mm``) and the rest S (routing, permutation, SwiGLU, un-permutation, the
router's FP32 GEMMs: the same kernels in every recipe's step). A recipe's step is at least

    S + its GEMMs + the bytes its quantization must move / the copy bandwidth

Per quantized element, at least:

- FP8 current scaling (``"fp8"``): the amax pass reads the high-precision tensor (2 bytes), the
  cast reads it again (2) and writes one FP8 copy (1): 5 bytes. With ``--fused-amax`` (the
  premise that the kernel producing each tensor also reduces its amax) the amax pass goes: 3
  bytes. The GEMMs at twice the baseline's speed (FP8 tensor cores' peak is twice BF16's):
  G_bf16 / 2.
- MXFP8 on Hopper (``"mxfp8"``): no MX tensor cores, so the GEMMs run on BF16 tensor cores on
  the decoded values (their in-step time measured on the recipe's own step: decoded values run
  slightly faster than the baseline's); each tensor read once (2 bytes) and written as the two
  copies the GEMMs read, row and column: as BF16 decodes (2 + 2) for the GEMMs as they run
  on Hopper, or (the generous floor) as FP8 codes read by a GEMM that decoded them for free (1 + 1).
  Block scales need no amax pass: ``--fused-amax`` changes nothing here.

Baselines: the three BF16 layers bench_moe times, each profiled here (device time of one step,
torch.profiler, after warm-up, every layer from the routing schedule's first step): "BF16
grouped" (``torch._grouped_mm``), "BF16 per-expert" (cuBLAS per expert) and "BF16 compiled"
(``torch.compile`` of the grouped layer, ``--compile-backend``). The floor above is built from
BF16 grouped's parts (its S: the recipe's layer runs eagerly, so its routing, permutation and
SwiGLU cost what the eager layer's do; no compiler fusion of them is credited to the recipe).
Each floor's bound is reported against BF16 grouped (the layer the floor splits) and against the
fastest of the three (the baseline of the targets, ``moe_targets.TARGETS``), named. Device time,
not wall time: a host-bound baseline (per-expert's host syncs) looks faster here than in
bench_moe's wall-clock ratios.

The quantized tensors of one step: both layers' weights — once a step with ``--weight-cast
step`` (quantized after the optimizer update, reused by every micro-batch: what bench_moe and
hybridfp's weight cache do) or once per micro-batch with ``--weight-cast micro-batch`` — and,
every micro-batch, the two inputs (x, the SwiGLU output) and the two output gradients.

With ``--at-cap`` the five steps are profiled in rounds at the GPU's steady power state
(``bench/profile_rounds.py``, as ``bound_mlp --at-cap``); every ratio is then the median of the
rounds' ratios with its order-statistic interval, against the baseline fastest by its median
step.

    python -m bench.bound_moe [--experts 64] [--micro-batches 4] [--weight-cast step|micro-batch] [--fused-amax]
        [--compile-backend B] [--at-cap [--rounds 10] [--warm-s 1] [--heat-s 15]]
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Optional

import torch

import hybridfp
from bench import common
from bench.common import MissingBaselineError, environment, finish, md_table, parser, require_cuda
from bench.moe_layer import HIDDEN, TOKENS, TOP_K, RoutingSchedule, make_step, moe_layer
from bench.moe_rows import BASELINES, BF16_COMPILED, BF16_GROUPED, BF16_PER_EXPERT
from bench.moe_targets import CONFIGS, FP8_CURRENT, MXFP8, target
from bench import profile_rounds
from bench.profile_rounds import AtCap

#: where the weights are cast: once a step (after the optimizer update) or every micro-batch
WEIGHT_CASTS = ("step", "micro-batch")


@dataclass(frozen=True)
class Premises:
    """What the bound assumes about the step.

    Parameters
    ----------
    micro_batches:
        Forward + backward passes a step (>= 1).
    weight_cast:
        ``"step"``: the weights are quantized once a step; ``"micro-batch"``: every micro-batch.
    fused_amax:
        FP8 current scaling's amax comes from the kernel producing each tensor (3 bytes an
        element instead of 5).

    Raises
    ------
    ValueError
        ``micro_batches`` below 1 or an unknown ``weight_cast``.
    """

    micro_batches: int = 4
    weight_cast: str = "step"
    fused_amax: bool = False

    def __post_init__(self) -> None:
        if self.micro_batches < 1:
            raise ValueError(f"Premises: micro_batches must be >= 1, got {self.micro_batches}")
        if self.weight_cast not in WEIGHT_CASTS:
            raise ValueError(f"Premises: weight_cast must be one of {WEIGHT_CASTS}, got {self.weight_cast!r}")


@dataclass(frozen=True)
class Measured:
    """Device ms of one step (``Premises.micro_batches`` passes) of each layer, the layer's
    shape and the copy bandwidth (GB/s, bytes read + written). ``bf16_step_ms`` and
    ``bf16_gemm_ms``: BF16 grouped's step and its grouped GEMMs; ``bf16_per_expert_ms`` and
    ``bf16_compiled_ms``: the other two BF16 baselines' steps."""

    experts: int
    ffn: int
    tokens: int
    hidden: int
    bf16_step_ms: float
    bf16_gemm_ms: float
    bf16_per_expert_ms: float
    bf16_compiled_ms: float
    mxfp8_step_ms: float
    mxfp8_gemm_ms: float
    fp8_step_ms: float
    copy_GBps: float
    #: measured at the power cap: each round's step fields (the figures above are their medians),
    #: each step's clock summary and ``AtCap``'s fields
    rounds: list[dict[str, float]] = field(default_factory=list)
    clocks: dict[str, dict[str, float]] = field(default_factory=dict)
    at_cap: Optional[dict[str, Any]] = None


#: the fields of ``Measured`` a round measures (the rest: the layer's shape and the copy bandwidth)
STEP_FIELDS = ("bf16_step_ms", "bf16_gemm_ms", "bf16_per_expert_ms", "bf16_compiled_ms", "mxfp8_step_ms",
               "mxfp8_gemm_ms", "fp8_step_ms")


def quantized_elements(m: Measured, p: Premises) -> tuple[int, int]:
    """(weight elements, activation and gradient elements) quantized in one step."""
    weights = m.experts * (2 * m.ffn * m.hidden + m.hidden * m.ffn)
    rows = m.tokens * TOP_K
    acts = rows * (m.hidden + m.ffn) + rows * (m.hidden + 2 * m.ffn)  # x, SwiGLU out; dy of fc2, dy of fc1
    casts = 1 if p.weight_cast == "step" else p.micro_batches
    return weights * casts, acts * p.micro_batches


def bf16_baselines(m: Measured) -> dict[str, float]:
    """Each BF16 baseline's device ms of one step, by bench_moe's name."""
    return {BF16_GROUPED: m.bf16_step_ms, BF16_PER_EXPERT: m.bf16_per_expert_ms, BF16_COMPILED: m.bf16_compiled_ms}


def fastest_bf16(m: Measured) -> tuple[str, float]:
    """(name, device ms) of the fastest BF16 baseline: the least step time (the first of
    ``BASELINES`` on a tie).

    Example
    -------
    >>> fastest_bf16(Measured(8, 64, 128, 32, bf16_step_ms=10.0, bf16_gemm_ms=8.0, bf16_per_expert_ms=11.0,
    ...                       bf16_compiled_ms=9.0, mxfp8_step_ms=12.0, mxfp8_gemm_ms=7.5, fp8_step_ms=9.0,
    ...                       copy_GBps=1.0))
    ('BF16 compiled', 9.0)
    """
    ms = bf16_baselines(m)
    name = min(BASELINES, key=lambda b: ms[b])
    return name, ms[name]


def floors(p: Premises) -> dict[str, int]:
    """Bytes a quantized element moves at least, per recipe and floor (module docstring)."""
    fp8 = ("FP8 current (cast read, one FP8 write; amax fused into the producer)", 3) if p.fused_amax else \
        ("FP8 current (amax read, cast read, one FP8 write)", 5)
    return {fp8[0]: fp8[1], "MXFP8, BF16-decoded row + col copies (as Hopper runs it)": 6,
            "MXFP8, FP8 row + col codes (a free in-GEMM decode)": 4}


def bound_rows(m: Measured, p: Premises) -> list[dict[str, Any]]:
    """Each floor's step time and the ratio it allows against BF16 grouped's measured step
    (``bound``) and against the fastest BF16 baseline's (``bound_fastest``, that baseline named in
    ``fastest_bf16``); the recipe's measured device-time ratios against both, and its target at
    this config (``moe_targets``; None for a config without one). Measured in rounds
    (``m.rounds``), each of the four ratios is the median of the rounds' ratios, with its
    ``_interval``, ``_coverage`` and ``_rounds`` (``profile_rounds.median_of_rounds``), against
    the baseline fastest by its median step.

    Example
    -------
    >>> m = Measured(8, 64, 128, 32, bf16_step_ms=10.0, bf16_gemm_ms=8.0, bf16_per_expert_ms=11.0,
    ...              bf16_compiled_ms=9.0, mxfp8_step_ms=12.0, mxfp8_gemm_ms=7.5, fp8_step_ms=9.0, copy_GBps=1.0)
    >>> [round(r["quantize_ms"], 4) for r in bound_rows(m, Premises(micro_batches=1))]
    [0.5734, 0.6881, 0.4588]
    """
    if m.rounds:
        return _median_of_rounds(m, p)
    weights, acts = quantized_elements(m, p)
    shared = m.bf16_step_ms - m.bf16_gemm_ms
    fastest, fastest_ms = fastest_bf16(m)
    out = []
    for name, nbytes in floors(p).items():
        fp8 = name.startswith("FP8")
        gemm = m.bf16_gemm_ms / 2 if fp8 else m.mxfp8_gemm_ms
        quantize = (weights + acts) * nbytes / m.copy_GBps / 1e6
        t = shared + gemm + quantize
        recipe_ms = m.fp8_step_ms if fp8 else m.mxfp8_step_ms
        out.append(dict(floor=name, bytes_per_element=nbytes, gemm_ms=gemm, quantize_ms=quantize, step_ms=t,
                        bound=m.bf16_step_ms / t, fastest_bf16=fastest, bound_fastest=fastest_ms / t,
                        target=target((m.experts, m.ffn), FP8_CURRENT if fp8 else MXFP8),
                        measured=m.bf16_step_ms / recipe_ms, measured_fastest=fastest_ms / recipe_ms))
    return out


def _profile(step: Callable[[], Any], warmup: int = 2,
             activities: Optional[list[torch.profiler.ProfilerActivity]] = None) -> tuple[float, dict[str, float]]:
    """(device ms of one step, op / kernel name -> self device ms) after ``warmup`` steps, the
    profiled one routed by the schedule's first step (``Step.reset``).

    The profiler starts during one more step that it traces and discards (its schedule's
    warm-up phase), so the GPU stays busy through the profiler's start-up: an idle GPU under a
    power cap would begin the recorded step at a higher clock. A synchronize ends that step's
    kernels before the recorded window opens (kernels still running when it opened would be
    recorded), leaving only the host's launch latency idle. ``activities``: what is traced
    (default CPU and CUDA; the CPU alone where no GPU is present, as in tests)."""
    cuda = torch.cuda.is_available()
    if activities is None:
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        step()
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule) as prof:
        step()  # traced and discarded
        sync()
        step.reset()
        prof.step()
        step()  # recorded
        sync()
        prof.step()
    return device_times(prof.events(), prof.key_averages())


def device_times(events: Any, averages: Any) -> tuple[float, dict[str, float]]:
    """(device ms of the recorded events, op / kernel name -> self device ms) from a profile's
    ``events()`` and ``key_averages()``. Device-side user annotations are left out of the sum
    (on CUDA the schedule's ``ProfilerStep#N`` is one, spanning the whole step, idle gaps
    included: it would count the step again on top of its kernels), and the step range out of
    the ops (Triton launches outside any aten op would be charged to it)."""
    total = sum(e.device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                and not getattr(e, "is_user_annotation", False)) / 1e3
    return total, {e.key: e.self_device_time_total / 1e3 for e in averages
                   if not str(e.key).startswith("ProfilerStep")}


def _median_of_rounds(m: Measured, p: Premises) -> list[dict[str, Any]]:
    """``bound_rows`` of a measurement in rounds: the rows of the medians, their four ratios
    replaced by the medians of the rounds' ratios (``<key>_interval``: the order-statistic
    interval), all against the baseline fastest by its median step."""
    med = replace(m, rounds=[])
    fastest, _ = fastest_bf16(med)
    each = [replace(med, **r) for r in m.rounds]
    per_round = [bound_rows(x, p) for x in each]
    fast_ms = [bf16_baselines(x)[fastest] for x in each]
    out = bound_rows(med, p)
    for j, row in enumerate(out):
        rounds = [rows[j] for rows in per_round]
        recipe = "fp8_step_ms" if row["floor"].startswith("FP8") else "mxfp8_step_ms"
        ratios = {"bound": [x["bound"] for x in rounds],
                  "bound_fastest": [f / x["step_ms"] for f, x in zip(fast_ms, rounds)],
                  "measured": [x["measured"] for x in rounds],
                  "measured_fastest": [f / r[recipe] for f, r in zip(fast_ms, m.rounds)]}
        for key, values in ratios.items():
            row.update(profile_rounds.median_of_rounds(key, values))
    return out


def measure(experts: int, micro_batches: int, compile_backend: str = "inductor", ffn: Optional[int] = None,
            tokens: int = TOKENS, hidden: int = HIDDEN, at_cap: Optional[AtCap] = None) -> Measured:
    """Profile one step of ``micro_batches`` passes (bench_moe's routing schedule; weights
    quantized once a step) of the three BF16 baselines (grouped, per-expert, ``torch.compile`` of
    the grouped layer with ``compile_backend``) and the one-weight-Parameter hybridfp layer under
    MXFP8 and FP8 current scaling, and the copy bandwidth. ``ffn``: the config's unless given
    (as ``tokens`` and ``hidden``: a smaller layer for a smoke run).

    With ``at_cap``, the five steps are profiled ``at_cap.rounds`` times at the GPU's steady
    power state (``profile_rounds``; the compiled layer compiled before the heating) and the
    step fields are the rounds' medians, each round kept in ``Measured.rounds``.

    Raises ``MissingBaselineError`` naming "BF16 compiled" where ``torch.compile`` refuses the layer."""
    f = ffn if ffn is not None else dict(CONFIGS)[experts]
    base, _, x, dy = moe_layer(experts, f, tokens, hidden)
    _, single, _, _ = moe_layer(experts, f, tokens, hidden, single_parameter=True)
    schedule = RoutingSchedule(tokens, experts, micro_batches)
    mx = lambda: hybridfp.autocast(recipe=hybridfp.MXFP8BlockScaling())  # noqa: E731
    fp8 = lambda: hybridfp.autocast(recipe=hybridfp.Float8CurrentScaling())  # noqa: E731
    steps = {BF16_GROUPED: make_step(base, x, dy, None, micro_batches, schedule),
             BF16_PER_EXPERT: make_step(base.sharing("per_expert"), x, dy, None, micro_batches, schedule),
             BF16_COMPILED: None, "MXFP8": make_step(single, x, dy, mx, micro_batches, schedule),
             "FP8 current": make_step(single, x, dy, fp8, micro_batches, schedule)}
    got: dict[str, list[tuple[float, dict[str, float]]]] = {}
    if at_cap is None:
        for name in (BF16_GROUPED, BF16_PER_EXPERT):
            got[name] = [_profile(steps[name])]
    try:  # only torch.compile's failures are the compiled baseline's
        compiled = torch.compile(base.sharing("grouped"), backend=compile_backend)
        steps[BF16_COMPILED] = make_step(compiled, x, dy, None, micro_batches, schedule)
        if at_cap is None:
            # three warm-ups: the first compiles, the next may recompile once for a changed routing
            got[BF16_COMPILED] = [_profile(steps[BF16_COMPILED], warmup=3)]
        else:
            for _ in range(3):  # compiled (and recompiled once for a changed routing) before the rounds
                steps[BF16_COMPILED]()
    except Exception as err:  # noqa: BLE001 - named: the fastest BF16 needs all three baselines
        raise MissingBaselineError(f"bound_moe: the baseline '{BF16_COMPILED}' failed: torch.compile(backend="
                                   f"{compile_backend!r}): {type(err).__name__}: {err}") from err
    clocks: dict[str, dict[str, float]] = {}
    if at_cap is None:
        for name in ("MXFP8", "FP8 current"):
            got[name] = [_profile(steps[name])]
    else:
        profiles = profile_rounds.profile_rounds(steps, at_cap, _profile)
        got, clocks = profiles.rounds, profiles.clocks
    rounds = [dict(zip(STEP_FIELDS, (
        got[BF16_GROUPED][i][0], grouped_mm_ms(got[BF16_GROUPED][i][1], "BF16 grouped"), got[BF16_PER_EXPERT][i][0],
        got[BF16_COMPILED][i][0], got["MXFP8"][i][0], expert_gemm_ms(got["MXFP8"][i][1], got[BF16_GROUPED][i][1]),
        got["FP8 current"][i][0]))) for i in range(len(got[BF16_GROUPED]))]
    medians = {k: statistics.median(r[k] for r in rounds) for k in STEP_FIELDS}
    return Measured(experts, f, tokens, hidden, **medians, copy_GBps=common.copy_bandwidth()["GBps"],
                    rounds=rounds if at_cap is not None else [], clocks=clocks,
                    at_cap=at_cap.record() if at_cap is not None else None)


def costliest_ops(ops: dict[str, float], n: int = 6) -> str:
    """The ``n`` costliest entries of a profile (op / kernel name -> self device ms), as text for
    an error that names where a step's time went.

    Example
    -------
    >>> costliest_ops({"aten::mm": 4.0, "aten::mul": 1.0, "aten::add": 2.5}, n=2)
    'aten::mm 4.00 ms, aten::add 2.50 ms'
    """
    return ", ".join(f"{k} {v:.2f} ms" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:n])


#: profiler ops of a plain GEMM: the router's in every layer, and the experts' where hybridfp
#: runs them per expert (cuBLAS on BF16 decodes; at 8 experts MXFP8 takes that path)
PLAIN_GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm")


def _plain_gemm_ms(ops: dict[str, float]) -> float:
    """Self device ms of a profile's plain GEMMs (``PLAIN_GEMM_OPS``)."""
    return sum(ops.get(k, 0.0) for k in PLAIN_GEMM_OPS)


def expert_gemm_ms(ops: dict[str, float], base_ops: dict[str, float]) -> float:
    """Self device ms of a hybridfp step's expert GEMMs: its ``aten::_grouped_mm`` plus its plain
    GEMMs (``PLAIN_GEMM_OPS``: the experts' when run per expert, and the router's), less the
    plain GEMMs of BF16 grouped's step (``base_ops``, whose experts run ``_grouped_mm``, so
    its plain GEMMs are the router's alone).

    Raises
    ------
    RuntimeError
        No expert GEMM time left (the GEMMs ran under an op name not counted here), naming the
        step's costliest ops.

    Example
    -------
    >>> expert_gemm_ms({"aten::mm": 6.5, "aten::mul": 1.0}, {"aten::_grouped_mm": 5.0, "aten::mm": 0.5})
    6.0
    """
    ms = ops.get("aten::_grouped_mm", 0.0) + _plain_gemm_ms(ops) - _plain_gemm_ms(base_ops)
    if ms <= 0:
        raise RuntimeError(f"bound_moe: the MXFP8 step's profile shows no expert GEMM time beyond the router's "
                           f"(aten::_grouped_mm or {', '.join(PLAIN_GEMM_OPS)}; its costliest ops: "
                           f"{costliest_ops(ops)}); the experts' GEMMs ran under another op name")
    return ms


def grouped_mm_ms(ops: dict[str, float], step: str) -> float:
    """Self device ms of ``aten::_grouped_mm`` in a step's profile (``_profile``'s op -> ms).

    Raises
    ------
    RuntimeError
        The profile has no ``aten::_grouped_mm`` with device time: the step's GEMMs ran elsewhere
        (per expert, another op name) and the bound would take them for the shared rest.

    Example
    -------
    >>> grouped_mm_ms({"aten::_grouped_mm": 5.5, "aten::mul": 1.0}, "BF16 grouped")
    5.5
    """
    ms = ops.get("aten::_grouped_mm", 0.0)
    if ms <= 0:
        raise RuntimeError(f"bound_moe: the {step} step's profile has no aten::_grouped_mm device time, the GEMMs "
                           f"the bound splits off (its costliest ops: {costliest_ops(ops)}); "
                           "the layer must run torch._grouped_mm")
    return ms


def report(m: Measured, p: Premises) -> str:
    """The bound table under ``p``, as Markdown."""
    weights, acts = quantized_elements(m, p)
    fastest, _ = fastest_bf16(m)
    head = (f"### MoE layer bound, {m.experts} experts x ffn {m.ffn}: {p.micro_batches} micro-batches a step, "
            f"weights cast once a {p.weight_cast}, amax {'fused into the producer' if p.fused_amax else 'its own pass'} "
            f"({profile_rounds.describe(m.at_cap, BF16_GROUPED)})\n\n")
    parts = md_table(["quantity", "ms"], [
        ["BF16 grouped step", m.bf16_step_ms], ["its grouped GEMMs (aten::_grouped_mm)", m.bf16_gemm_ms],
        ["BF16 per-expert step", m.bf16_per_expert_ms], ["BF16 compiled step", m.bf16_compiled_ms],
        ["shared rest S", m.bf16_step_ms - m.bf16_gemm_ms], ["MXFP8 step (one weight Parameter)", m.mxfp8_step_ms],
        ["its grouped GEMMs on decoded values", m.mxfp8_gemm_ms], ["FP8 current step", m.fp8_step_ms]])
    elems = (f"\n\ncopy bandwidth {m.copy_GBps:.0f} GB/s (read + write); {weights / 1e9:.3f} G weight and "
             f"{acts / 1e9:.3f} G activation / gradient elements quantized a step\n\n")
    elems += (f"fastest BF16 of the run: {fastest}; the floors take BF16 grouped's S; the targets are against "
              "the fastest BF16\n\n")
    table = md_table(["floor", "bytes / element", "GEMMs ms", "quantize ms", "step ms", "bound x BF16 grouped",
                      f"bound x {fastest} (fastest BF16)", "target", "measured device-time x BF16 grouped",
                      f"measured device-time x {fastest} (weights cast once a step)"],
                     [[b["floor"], b["bytes_per_element"], b["gemm_ms"], b["quantize_ms"], b["step_ms"],
                       *(profile_rounds.with_interval(b, k) for k in ("bound", "bound_fastest")), b["target"],
                       *(profile_rounds.with_interval(b, k) for k in ("measured", "measured_fastest"))]
                      for b in bound_rows(m, p)])
    clocks = profile_rounds.clock_table(m.clocks)
    return head + parts + elems + table + ("\n\n" + clocks if clocks else "") + "\n"


def main(argv: Optional[list[str]] = None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=64, choices=[e for e, _ in CONFIGS])
    p.add_argument("--micro-batches", type=int, default=4, help="forward + backward passes a step (default 4)")
    p.add_argument("--weight-cast", choices=WEIGHT_CASTS, default="step",
                   help="where the weights are quantized: once a step (default) or every micro-batch")
    p.add_argument("--fused-amax", action="store_true", help="FP8 current: the amax is reduced by the kernel "
                   "producing each tensor (3 bytes an element instead of 5)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile's backend for 'BF16 compiled'")
    profile_rounds.add_arguments(p, AtCap())
    args = p.parse_args(argv)
    try:
        premises = Premises(args.micro_batches, args.weight_cast, args.fused_amax)
    except ValueError as err:
        p.error(str(err))
    at_cap = profile_rounds.from_arguments(p, args, AtCap())
    require_cuda()
    try:
        m = measure(args.experts, premises.micro_batches, args.compile_backend, at_cap=at_cap)
    except MissingBaselineError as err:
        sys.exit(str(err))
    rows = bound_rows(m, premises)
    finish("bound_moe", {"env": environment(), **asdict(m), "premises": asdict(premises), "bounds": rows,
                         "markdown": report(m, premises)}, args.out)


if __name__ == "__main__":
    main()
