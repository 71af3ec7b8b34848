"""Whether the library's GEMM-path thresholds and kernel tile defaults hold away from the shapes
they were fitted at (the Llama-3-8B MLP; MoE layers of 8 x 14336 and 64 x 1408).

For each decision every alternative is timed (``bench.common.bench_ms``: do_bench medians),
forced through the policy (``hybridfp.policy(...)`` fields) or the kernel's own tile arguments,
and each cell reports the alternative the library picks (asked of the library's own decision
function: ``moe.gemm.per_group_wins``, ``moe.gemm.grouped_path``,
``moe.quantize_weights._worth_stacking``, the kernels' tile constants), the fastest measured,
and the picked one's time / the fastest's: 1.00 where the choice holds; a cell more than 3 %
slower (``TOLERANCE``) is flagged. Where picked and fastest differ, the ratio is re-measured
paired (``bench.protocol.paired_ratio``: ``ROUNDS`` alternating rounds, the median ratio and
its interval in the JSON). The sweep only measures: no threshold is
changed from its result.

Decisions (``DECISIONS`` in ``bench/sweep_cases.py``), each on one GEMM of an expert linear
W_e [ffn, hidden]:

- ``bf16_per_group`` (policy ``bf16_per_group_cublas``): fprop's grouped BF16 matmul,
  cuBLAS per group vs ``torch._grouped_mm`` (picked: ``per_group_wins``);
- ``fp8_per_expert`` (``per_expert_fp8_triton_flops``): dgrad of per-tensor FP8 experts (E5M2 dy x E4M3
  W), cuBLAS per expert vs the Triton FP8 grouped GEMM (picked: ``grouped_path``, which also
  applies ``many_experts``);
- ``many_experts`` (``many_experts``, ``grouped_triton_max_flops``): fprop of NVFP4 experts (a
  global-scale epilogue), the per-expert loop vs the Triton grouped GEMM (picked:
  ``grouped_path``);
- ``stack_scaled`` (``stack_scaled_max_numel``): per-tensor FP8 weights quantized per expert vs
  stacked into one buffer (picked: ``_worth_stacking``; no token count);
- ``fp8_tile_rows`` / ``fp8_tile_wgrad``: the Triton FP8 grouped GEMM's pointer tiles ``TILE``
  (fprop) and ``WGRAD_TILE`` (wgrad) against neighbours (on CUDA the policy's TMA config runs
  wherever TMA can read the operands; the pointer tile is the fallback);
- ``fp8_tma_rows`` / ``fp8_tma_dgrad`` / ``fp8_tma_wgrad`` (``grouped_fp8_tma_rows``, for fprop
  and dgrad, / ``grouped_fp8_tma_wgrad``): that TMA config against neighbouring configs, at
  every expert count (picked: the policy's field);
- ``bf16_tile``: the Triton BF16 grouped GEMM's ``TILE`` (pointer kernel, row-scaled epilogue);
- ``nvfp4_hybrid_tile`` / ``mxfp8_decode_tile``: the NVFP4 + MXFP8 fused quantize's
  ``DEFAULT_TILES["natural"]`` and the MXFP8 1x32 decode's default tile, on [tokens, hidden].

Grid: tokens {4096, 8192, 16384} x hidden {2048, 4096, 8192}; the MoE decisions also over
experts {8, 16, 32, 64} with top-k ``TOPK`` (routed rows = tokens x top-k, split unevenly) and
ffn = hidden * 28 / experts rounded to 128 (8 experts: 3.5 x hidden, 14336 at hidden 4096 as the
8-expert layer; 64 experts: 0.44 x hidden, near the 64 x 1408 layer's 0.34); the pointer
kernels' tile decisions at the smallest and largest expert counts only. About 1000 timings of
``warmup_ms=10, rep_ms=60`` each (do_bench's estimate and warm-up calls included, ~0.15 s), the
paired re-measures, the operands' setup and a few dozen kernel compiles (the largest GEMMs,
32768 routed rows x hidden 8192 x ffn 28672, take ~25 ms a call); on one H100 the decisions
other than the TMA ones take 135 s in one process, fprop's and wgrad's TMA ones at 8 and 64
experts 44 s. ``--only`` runs a subset; ``--deadline-s S`` starts no cell after S seconds and records
the cells left as not run (``python -m bench sweep_dispatch --timeout-s T`` passes 3/4 of T),
so a run cut short still writes what it measured.
``--quick``: a tiny grid (a smoke test of the script, also on the CPU). The alternatives of one
kernel (tiles, TMA configs) are first run once each and checked to give the picked one's
output (``differs``, within ``RESULT_BOUND``); one that does not is an error, not timed. A cell
that raises, or an alternative that fails in a measured cell, fails the run (non-zero exit,
after the results are written): its verdict could name the wrong fastest.

    python -m bench.sweep_dispatch [--quick] [--out F.json] [--only NAME[,NAME]] [--deadline-s S]

Prints a Markdown table (one row per cell, with the SM clock while its alternatives ran: a
throttled stretch of the sweep slows every alternative of its cells) last; the JSON has every
alternative's time and each cell's clocks (min / median / max SM clock and power).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from bench import common
from bench.common import md_table, parser, require_cuda
from bench.protocol import POLL_S, ClockPoller, Sampler, clock_spread, device_sampler, summarize_clocks
from bench.sweep_cases import DECISIONS, FULL, QUICK, TOPK, Case, Grid

#: a picked alternative this much slower than the fastest is flagged
TOLERANCE = 0.03
#: do_bench per alternative: short, the grid is large (medians of ~10-400 calls)
WARMUP_MS, REP_MS = 10.0, 60.0
#: paired re-measure where picked and fastest differ: rounds x calls per side, the protocol's
#: reportable minimum (only the few cells that disagree pay for it)
ROUNDS, SAMPLES = 10, 10


# --- measuring and judging ---------------------------------------------------------------------

#: largest norm-wise difference ``same_result`` allows between two alternatives' outputs: tiles
#: sum in other orders (FP32 accumulators, differing in the last bits) and round once to a
#: 16-bit output, so elements differ by at most about one BF16 unit in the last place (2**-8
#: relative, 2**-7 at a binade edge); a wrong tile or descriptor is off by far more
RESULT_BOUND = 2.0 ** -7


def _tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of an alternative's output (a tensor, or tuples / lists of them), detached copies."""
    if isinstance(out, torch.Tensor):
        return [out.detach().clone()]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


def differs(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], bound: float = RESULT_BOUND) -> Optional[str]:
    """Why ``got`` (an alternative's output tensors) is not ``want`` (the picked one's) within
    ``bound``, ||a - b|| / ||b|| per tensor in FP32, or None; a NaN, another shape or another
    number of tensors fails.

    Example
    -------
    >>> import torch
    >>> from bench.sweep_dispatch import differs
    >>> differs([torch.ones(4) * (1 + 2**-9)], [torch.ones(4)]) is None
    True
    >>> differs([torch.zeros(4)], [torch.ones(4)])
    'output differs from the picked one by 1 (bound 0.0078125)'
    """
    if [t.shape for t in got] != [t.shape for t in want]:
        return f"output shapes {[tuple(t.shape) for t in got]} differ from the picked one's {[tuple(t.shape) for t in want]}"
    worst = 0.0
    for g, w in zip(got, want):
        g, w = g.float(), w.float()
        rel = float((g - w).norm() / w.norm()) if float(w.norm()) else float(g.norm())
        worst = max(worst, rel) if rel == rel else math.inf  # NaN: fails
    return None if worst <= bound else f"output differs from the picked one by {worst:.3g} (bound {bound:g})"


def judge(times: Mapping[str, Optional[float]], picked: str, paired: Optional[float] = None,
          tolerance: float = TOLERANCE) -> dict[str, Any]:
    """The verdict of one cell from its alternatives' ms (None: the alternative failed).

    Parameters
    ----------
    times:
        Alternative name -> median ms, or None where it failed.
    picked:
        The alternative the library picks (a key of ``times``).
    paired:
        picked / fastest measured paired, where they differ (replaces the medians' ratio; at
        most 1: the picked one counts as the fastest).
    tolerance:
        ``flagged`` when the picked one is more than this fraction slower.

    Returns
    -------
    dict
        ``picked``, ``fastest`` (None if every alternative failed), ``ratio`` (picked / fastest;
        None if either failed), ``holds`` (the picked one is the fastest, or within
        ``tolerance`` of it) and ``flagged`` (not ``holds``: slower by more than ``tolerance``,
        or the picked one failed).

    Raises
    ------
    KeyError
        ``picked`` is not one of ``times``.

    Example
    -------
    >>> from bench.sweep_dispatch import judge
    >>> v = judge({"a": 1.0, "b": 1.1}, picked="b")
    >>> v["fastest"], round(v["ratio"], 2), v["flagged"]
    ('a', 1.1, True)
    >>> judge({"a": 1.0, "b": 1.02}, picked="b")["holds"]
    True
    """
    if picked not in times:
        raise KeyError(f"judge: picked alternative {picked!r} is not one of the timed {sorted(times)}.")
    ok = {k: v for k, v in times.items() if v is not None}
    fastest = min(ok, key=ok.__getitem__) if ok else None
    ratio = None
    if fastest is not None and times[picked] is not None:
        ratio = 1.0 if picked == fastest else (paired if paired is not None else times[picked] / ok[fastest])
        if ratio <= 1.0:  # the paired measurement finds the picked one as fast: it is the fastest
            fastest, ratio = picked, 1.0
    holds = ratio is not None and ratio <= 1.0 + tolerance
    return {"picked": picked, "fastest": fastest, "ratio": ratio, "holds": holds, "flagged": not holds}


def _paired_ratio(picked: Callable[[], Any], fastest: Callable[[], Any], quick: bool = False) -> dict[str, Any]:
    """picked ms / fastest ms measured alternately (``bench.protocol.paired_ratio`` with the
    picked one as its baseline, so its ratio, baseline / candidate ms, is picked / fastest),
    with its interval; ``quick``: one round of one call (a smoke test).

    Example
    -------
    >>> import time
    >>> from bench.sweep_dispatch import _paired_ratio
    >>> r = _paired_ratio(lambda: time.sleep(0.2), lambda: time.sleep(0.001), quick=True)
    >>> r["ratio"] > 1.5
    True
    """
    from bench.protocol import Protocol, paired_ratio
    r = paired_ratio(picked, fastest, Protocol(1, 1, 0) if quick else Protocol(ROUNDS, SAMPLES, warmup=1))
    return {"ratio": r.ratio, "low": r.low, "high": r.high, "picked_ms": r.baseline_ms, "fastest_ms": r.candidate_ms,
            "rounds": len(r.rounds), "coverage": r.coverage}


def _took(name: str, want: str, fn: Callable[[], Any]) -> Optional[str]:
    """None if one call of ``fn`` takes grouped path ``want``, else what it took."""
    from hybridfp.moe.gemm import PATH_COUNTS
    before = PATH_COUNTS.copy()
    fn()
    took = {path for (_, path), n in (PATH_COUNTS - before).items() if n}
    return None if took == {want} else f"{name}: forced to {want} but took {sorted(took)}"


def measure(case: Case, quick: bool = False, sampler: Optional[Sampler] = None,
            poll_s: float = POLL_S) -> dict[str, Any]:
    """Time every alternative of ``case`` and judge the cell (``quick``: a one-call paired
    re-measure); a failing alternative is kept as its error (the sweep goes on). ``sampler``
    (``bench.protocol.device_sampler``): read every ``poll_s`` seconds while the alternatives
    are timed, summarized as the row's ``clocks`` (min / median / max SM clock, power), so a
    throttled stretch of a sweep shows in its rows."""
    times: dict[str, Optional[float]] = {}
    errors: dict[str, str] = {}
    if case.same_result:  # a wrong config must not be timed as the fastest
        want: Optional[list[torch.Tensor]] = None
        for name in [case.picked] + [n for n in case.alternatives if n != case.picked]:
            try:
                got = _tensors(case.alternatives[name]())  # copies: alternatives may share an output buffer
            except Exception as e:  # noqa: BLE001 - reported in the row, the sweep goes on
                errors[name] = f"{type(e).__name__}: {str(e)[:200]}"
                continue
            if name == case.picked:
                want = got
            elif want is not None and (why := differs(got, want)):
                errors[name] = why
        want = got = None  # the copies freed before timing (outputs of up to ~2 GB)
    poller = ClockPoller(sampler, poll_s) if sampler is not None else contextlib.nullcontext()
    with poller:
        for name, fn in case.alternatives.items():
            if name in errors:
                times[name] = None
                continue
            try:
                wrong = _took(name, case.paths[name], fn) if name in case.paths else None
                if wrong:
                    raise RuntimeError(wrong)
                times[name] = common.bench_ms(fn, WARMUP_MS, REP_MS)
            except Exception as e:  # noqa: BLE001 - reported in the row, the sweep goes on
                times[name], errors[name] = None, f"{type(e).__name__}: {str(e)[:200]}"
    row: dict[str, Any] = {"ms": times, **({"errors": errors} if errors else {})}
    if isinstance(poller, ClockPoller):
        row["clocks"] = summarize_clocks(poller.readings)
    first = judge(times, case.picked)
    if first["fastest"] not in (None, case.picked) and times[case.picked] is not None:
        row["paired"] = _paired_ratio(case.alternatives[case.picked], case.alternatives[first["fastest"]], quick)
        first = judge(times, case.picked, paired=row["paired"]["ratio"])
    return {**row, **first}


#: a row's ``not_run`` value for a cell the deadline left unmeasured
NOT_RUN = "deadline"


def sweep(names: Sequence[str], grid: Grid, quick: bool = False,
          deadline_s: Optional[float] = None) -> list[dict[str, Any]]:
    """One row per (decision, cell) of ``names`` over ``grid``; ``quick``: one tile next to each
    default and a one-call paired re-measure (a smoke test). ``deadline_s``: no cell starts
    after that many seconds; each one left is a row with ``not_run`` (:data:`NOT_RUN`)."""
    rows: list[dict[str, Any]] = []
    start = time.monotonic()
    sampler, poll_s = device_sampler()
    for name in names:
        d = DECISIONS[name]
        for cell in d.cells(grid):
            base = {"decision": name, "cell": cell.label(), "tokens": cell.tokens, "hidden": cell.hidden,
                    "experts": cell.experts, "ffn": cell.ffn, "rows": cell.rows if cell.experts else None}
            if deadline_s is not None and time.monotonic() - start >= deadline_s:
                rows.append({**base, "not_run": NOT_RUN})
                continue
            try:
                rows.append({**base, **measure(d.build(cell, quick), quick, sampler, poll_s)})
            except Exception as e:  # noqa: BLE001 - a cell whose operands cannot be built
                rows.append({**base, "error": f"{type(e).__name__}: {str(e)[:200]}", "flagged": True})
            if common.DEVICE == "cuda":
                torch.cuda.empty_cache()  # the next cell's operands may be of another size
    return rows


def headline(rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """Per decision: cells that hold, and the worst picked / fastest with its cell."""
    out = []
    for name in dict.fromkeys(r["decision"] for r in rows):
        mine = [r for r in rows if r["decision"] == name and not r.get("not_run")]
        left = sum(1 for r in rows if r["decision"] == name and r.get("not_run"))
        held = sum(bool(r.get("holds")) for r in mine)
        worst = max((r for r in mine if r.get("ratio") is not None), key=lambda r: r["ratio"], default=None)
        tail = f", worst {worst['ratio']:.3f}x ({worst['cell']}: {worst['fastest']})" if worst else ""
        tail += f", {left} not run (deadline)" if left else ""
        out.append((f"{name}: cells where the choice holds", f"{held} / {len(mine)}{tail}"))
    return out


def main(argv: Optional[list[str]] = None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--only", default=None, help="comma-separated decisions (default: all of DECISIONS)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="start no cell after this many seconds; the cells left are recorded as not run")
    args = p.parse_args(argv)
    if args.deadline_s is not None and not args.deadline_s > 0:
        p.error(f"--deadline-s must be > 0, got {args.deadline_s}")
    names = args.only.split(",") if args.only else list(DECISIONS)
    unknown = [n for n in names if n not in DECISIONS]
    if unknown:
        p.error(f"unknown decision {', '.join(unknown)}; choose from {', '.join(DECISIONS)}")
    require_cuda()
    grid = QUICK if args.quick else FULL
    rows = sweep(names, grid, args.quick, args.deadline_s)
    md = md_table(["decision", "cell", "picked", "fastest", "picked / fastest", "flag", "SM MHz median [min, max]"],
                  [[r["decision"], r["cell"], r.get("picked"), r.get("fastest"),
                    r.get("ratio") if r.get("ratio") is not None else r.get("error"),
                    "not run" if r.get("not_run") else "FLAG" if r.get("flagged") else "",
                    clock_spread(r.get("clocks") or {}, "sm_mhz")] for r in rows])
    failed = failures(rows)
    common.finish("sweep_dispatch", {"env": common.environment(), "grid": {**asdict(grid), "topk": TOPK},
                                     "tolerance": TOLERANCE, "rows": rows, "headline": headline(rows),
                                     "failures": failed, "markdown": md}, args.out)
    if failed:
        raise SystemExit("sweep_dispatch failed:\n" + "\n".join(failed))


def failures(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One line per cell that raised and per alternative that failed in a measured cell: a cell
    judged without one of its alternatives may name the wrong fastest, so the run fails (cells
    the deadline left unmeasured are reported as not run, not as failures)."""
    out = []
    for r in rows:
        where = f"{r.get('decision')} {r.get('cell')}"
        if r.get("error"):
            out.append(f"{where}: {r['error']}")
        out += [f"{where}: {name}: {error}" for name, error in sorted(r.get("errors", {}).items())]
    return out


if __name__ == "__main__":
    main()
