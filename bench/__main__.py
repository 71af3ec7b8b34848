"""Run the benchmarks on a CUDA GPU, one process each, and print their headline figures.

    python -m bench                 # every benchmark but those run by name only
    python -m bench NAME [NAME ...] # a subset (python -m bench --list names them)
    python -m bench --list
    python -m bench --quick         # small sizes, a smoke test (results not kept unless --results-dir)
    python -m bench mlp --timeout-s 280   # a time limit per benchmark (mlp / moe end their rows before it)

Each benchmark writes ``bench/results/<name>.json`` (overwritten when it succeeds; a failed or
timed-out run leaves the previous file and writes what it measured to ``<name>.failed.json``,
whose headline rows are still shown, under a FAILED row). Ratios are
paired (``bench/protocol.py``); the headlines show each with its ≥ 95 % interval.
``bench/RESULTS.md`` holds the latest figures with their hardware.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = Path(__file__).resolve().parent / "results"

Rows = list[tuple[str, str]]


@dataclass(frozen=True)
class Benchmark:
    module: str
    question: str
    args: tuple[str, ...] = ()
    #: run by ``python -m bench`` without names (False: only when named)
    default: bool = True
    #: the flag that names the JSON file the module writes
    out_flag: str = "--out"
    quick: bool = True
    timeout_s: float = 1200.0
    #: the module's own time-limit option (``--deadline-s``: rows left after it are recorded
    #: as not run; ``--budget-s``: the study stops its runs and reports), else None
    deadline_flag: Optional[str] = None
    headline: Callable[[dict[str, Any]], Rows] = field(default=lambda r: [], compare=False)


def _x(v: Optional[float], digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}x"


def _paired(p: Optional[dict[str, Any]], target: Optional[float] = None) -> str:
    """A paired ratio (``PairedRatio.as_dict``) as "1.234x [1.220, 1.250]", marked below ``target``."""
    if not p:
        return "-"
    text = f"{p['ratio']:.3f}x [{p['low']:.3f}, {p['high']:.3f}]"
    return text + (f" BELOW {target:.2f}x TARGET" if target is not None and p["ratio"] < target else "")


#: hybridfp.gemm / raw and decoded-pair / BF16-on-decoded below this are marked (bench_gemm.TARGET)
GEMM_TARGET = 0.97


def _gemm(r: dict[str, Any]) -> Rows:
    out: Rows = []
    for row in r.get("rows", []):
        if row.get("shape", "").startswith("8192"):
            out.append(("FP8 per-tensor hybridfp.gemm / raw torch._scaled_mm, 8192^3",
                        _paired(row.get("tensorwise_paired"), GEMM_TARGET)))
            out.append((f"FP8 block ({row.get('block_pair')}) hybridfp.gemm / raw, 8192^3",
                        _paired(row.get("block_paired"), GEMM_TARGET)))
            out.append(("TFLOP/s BF16 / FP8 per-tensor hybridfp, 8192^3",
                        f"{row.get('bf16', 0):.0f} / {row.get('tensorwise_hybridfp', 0):.0f}"))
        else:  # other shapes: only where they miss the target
            for key, what in (("tensorwise_paired", "FP8 per-tensor"), ("block_paired", "FP8 block")):
                if (row.get(key) or {}).get("ratio", GEMM_TARGET) < GEMM_TARGET:
                    out.append((f"{what} hybridfp.gemm / raw, {row.get('shape')}", _paired(row[key], GEMM_TARGET)))
    return out


def _gemm_pairs(r: dict[str, Any]) -> Rows:
    out: Rows = []
    for row in r.get("rows", []):
        if not row.get("shape", "").startswith("8192"):
            continue
        if "error" in row:
            out.append((f"{row['pair']} {row['layout']}, 8192^3", f"FAILED: {row['error'][:80]}"))
            continue
        for mode in ("cold", "warm"):
            out.append((f"{row['pair']} {row['layout']} {mode} / BF16 on decoded values; on randn, 8192^3",
                        f"{_paired(row.get(f'{mode}_vs_decoded'), GEMM_TARGET)}; {_paired(row.get(f'{mode}_vs_randn'))}"))
    return out


def _quantize(r: dict[str, Any]) -> Rows:
    return [(f"{row['quantizer']} row+col ({row.get('path')}) / copy of the same bytes", _paired(row["vs_copy"]))
            for row in r.get("rows", []) if row.get("directions") == "row+col" and "vs_copy" in row]


#: fused hybrid quantize time at most 1.10x the slower single-format one: a paired ratio >= 1 / 1.10
FUSED_TARGET = 1 / 1.10


def _quantize_kernels(r: dict[str, Any]) -> Rows:
    out: Rows = []
    for row in r.get("rows", []):
        if "vs_slower_single" in row:
            out.append((f"{row['case']}: slower single ({row['slower_single']}) / fused",
                        _paired(row["vs_slower_single"], FUSED_TARGET)))
        elif "vs_copy" in row and row["case"].endswith("row+col"):
            out.append((f"{row['case']}: copy of the same bytes / encode", _paired(row["vs_copy"])))
    return out


def _mlp(r: dict[str, Any]) -> Rows:
    out: Rows = []
    for row in r.get("rows", []):
        if row.get("model", "").startswith("Llama") and row.get("variant") != "BF16 eager":
            value = row.get("error") or (f"NOT RUN ({row['not_run']})" if "not_run" in row else "?")
            if "vs BF16 eager" in row:
                from bench.mlp_targets import target_of  # each recipe's own target (no torch)
                target = target_of(row["variant"])
                value = f"{_paired(row['vs BF16 eager'], target)} eager" + (
                    f", {_paired(row['vs BF16 torch.compile'])} compiled" if "vs BF16 torch.compile" in row else "")
                value += "".join(f", {_paired(row[k])} {k[len('vs '):].replace(' (compiled)', '')}"
                                 for k in sorted(row) if k.startswith("vs torchao"))
            out.append((f"MLP {row['variant']} vs BF16", value))
    return out


def _moe(r: dict[str, Any]) -> Rows:
    out: Rows = []
    for row in r.get("rows", []):
        if row.get("baseline"):
            continue
        value = f"FAILED: {(row.get('error') or '; '.join(row.get('breaches', [])) or '?')[:80]}"
        if "not_run" in row:
            value = f"NOT RUN ({row['not_run']})" + (" (optional)" if row.get("optional") else "")
        if "x_fastest_bf16" in row:
            from bench.moe_targets import target  # the config's targets, not the row's recorded one
            value = f"{_paired(row['x_fastest_bf16'], target(row['config'], row['variant']))} vs {row['fastest_bf16']}"
            value += "".join(f"; {_paired(p)} vs {name}" for name, p in row.get("x_torchao", {}).items())
        out.append((f"{row['config']}: {row['variant']}", value))
    return out


def _ratio(b: dict[str, Any], key: str) -> str:
    """``b[key]`` as "1.234x", with its interval where measured in rounds (``--at-cap``) and
    that interval's coverage below 95 %: ``profile_rounds.with_interval``'s text with an "x",
    written here because the runner imports no benchmark module (nor torch) to print headlines."""
    lo_hi, coverage = b.get(f"{key}_interval"), b.get(f"{key}_coverage")
    return (_x(b[key]) + (f" [{lo_hi[0]:.3f}, {lo_hi[1]:.3f}]" if lo_hi else "")
            + (f" ({coverage * 100:.0f} %)" if coverage is not None and coverage < 0.95 else ""))


def _sweep_headline(r: dict[str, Any]) -> Rows:
    """A dispatch sweep's own headline rows (per decision: cells that hold, the worst)."""
    return [tuple(row) for row in r.get("headline", [])]


def _bound_moe(r: dict[str, Any]) -> Rows:
    from bench.moe_targets import FP8_CURRENT, MXFP8, target  # the config's targets (vs the fastest BF16)
    out: Rows = []
    for b in r.get("bounds", []):
        recipe = FP8_CURRENT if b["floor"].startswith("FP8") else MXFP8
        goal = target((r["experts"], r["ffn"]), recipe) if "experts" in r else b.get("target")
        fastest = f"{_ratio(b, 'bound_fastest')} vs {b['fastest_bf16']}, " if "bound_fastest" in b else ""
        out.append((b["floor"], f"bound {fastest}{_ratio(b, 'bound')} vs BF16 grouped ("
                                + (f"target {goal:.2f}x" if goal is not None else "no target")
                                + (f", device time now {_ratio(b, 'measured_fastest')} vs {b['fastest_bf16']})"
                                   if "measured_fastest" in b else f", device time now {_ratio(b, 'measured')})")))
    return out


def _bound_mlp(r: dict[str, Any]) -> Rows:
    return [(f"{b['recipe']}: {b['floor']}", f"bound {_ratio(b, 'bound')} (target {b['target']:.2f}x, device time "
                                             f"now {_ratio(b, 'measured')})") for b in r.get("bounds", [])]


def _grouped_gemm(r: dict[str, Any]) -> Rows:
    out: Rows = []
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in r.get("rows", []):
        groups.setdefault((row.get("part", "fp8"), row["gemm"]), []).append(row)
    for (part, gemm), rows in groups.items():
        ours = [x for x in rows if "vs_grouped_mm" in x and x["variant"].startswith(("tma", "triton", "pointer"))]
        if not ours:
            continue
        best = max(ours, key=lambda x: x["vs_grouped_mm"]["ratio"])
        default = next((x for x in ours if x.get("library_default")), None)
        fastest = f"fastest config of the sweep {best['variant']}: {_paired(best['vs_grouped_mm'])}"
        if default is None:  # the sweep's best is no figure of the library
            out.append((f"{part} {gemm}: Triton / torch._grouped_mm", f"library default not measured; {fastest}"))
            continue
        same_values = (f"; {_paired(default['vs_grouped_mm_decoded'])} on the FP8 values"
                       if "vs_grouped_mm_decoded" in default else "")
        out.append((f"{part} {gemm}: library default Triton ({default['variant']}) / torch._grouped_mm",
                    _paired(default["vs_grouped_mm"]) + same_values + ("" if default is best else f" ({fastest})")))
    return out


def _moe_overhead(r: dict[str, Any]) -> Rows:
    return [(f"GroupedLinear step, {row['recipe']}", f"{row['ops_per_expert']:.1f} aten ops / expert, "
                                                     f"{row['python_calls']} Python calls")
            for row in r.get("rows", [])]


def _offload(r: dict[str, Any]) -> Rows:
    return [(f"CPU offload, {row['recipe']}: peak GiB off / on, without / with offload",
             f"FAILED: {row['error'][:80]}" if "error" in row else
             f"{row['peak_gib_off']:.2f} / {row['peak_gib_on']:.2f}, {_paired(row.get('vs_no_offload'))}")
            for row in r.get("rows", [])]


def _train_step(r: dict[str, Any]) -> Rows:
    return [(f"hybridfp train step, {row['preset']} {row['recipe']}: eager / fused SwiGLU",
             f"FAILED: {row['error'][:80]}" if "error" in row else _paired(row.get("fused_vs_eager")))
            for row in r.get("rows", [])]


def _convergence(r: dict[str, Any]) -> Rows:
    plan = r.get("plan", {}).get("comparisons", {})
    rows = [(f"{name}: steps per run", str(p.get("steps"))) for name, p in plan.items()]
    for name, study in r.get("studies", {}).items():
        if "error" in study:  # nothing analysed (e.g. every bf16 run failed): say so, never stay silent
            rows.append((f"{name}: report", f"failed: {study['error']}"))
        for row in study.get("stats", {}).get("rows", []):
            if row.get("verdict") == "failed":  # a diverged / stopped / dropped run fails its recipe
                rows.append((f"{name}: {row['recipe']} vs bf16", "failed (" + ", ".join(row["failed_runs"]) + ")"))
            elif row.get("ci_lo") is not None:  # gap vs BF16, its 95 % interval, the verdict
                rows.append((f"{name}: {row['recipe']} vs bf16", f"{row['gap_pct']:+.2f} % "
                             f"[{row['ci_lo']:+.2f}, {row['ci_hi']:+.2f}] {row['verdict']}".strip()))
    return rows


#: bench_moe's rows with quantized primary weights (``moe_rows.PRIMARY_VARIANTS`` + its suffix;
#: written out here, where torch is not imported: a test checks them against the rows)
MOE_PRIMARY_ROWS = "|".join([f"hybridfp {r} [quantized primary weights]" for r in (
    "FP8 current", "MXFP8", "Composer-2 (NVFP4 row-scaled fwd / MXFP8 bwd)")]
    + [f"hybridfp {r} [quantized primary weights] [compiled]" for r in ("FP8 current", "MXFP8")])

#: the 64-expert rows with quantized primary weights, eager and under ``torch.compile`` (the
#: routing, permutation, SwiGLU and un-permutation compiled; GroupedLinear a graph break), paired
MOE_COMPILED_ROWS = "|".join([f"hybridfp {r} [quantized primary weights]{c}" for r in ("FP8 current", "MXFP8")
                              for c in ("", " [compiled]")])

#: the torchao float8 MoE rows (``moe_torchao.TORCHAO_ROW``, by name only) and the hybridfp FP8 row
#: paired against it: with the BF16 baselines, every row the torchao benchmarks need
MOE_TORCHAO_ROWS = "torchao float8 rowwise (compiled)|hybridfp FP8 current"

#: BF16 grouped with the fused SwiGLU, and the FP8 current and MXFP8 rows as training runs them
#: (quantized primary weights), each with eager ``F.silu(g) * u`` and with the fused
#: ``hybridfp.swiglu`` (``moe_rows.FUSED_SWIGLU_SUFFIX``): five rows, so that the 8-expert run fits
#: ten minutes on an H100 (the plain layers' fused rows: ``--variants``)
MOE_FUSED_SWIGLU_ROWS = "|".join(["BF16 grouped [fused SwiGLU]"] + [
    f"hybridfp {r} [quantized primary weights]{f}" for r in ("FP8 current", "MXFP8") for f in ("", " [fused SwiGLU]")])

BENCHMARKS: dict[str, Benchmark] = {
    "gemm": Benchmark("bench.bench_gemm", "FP8 GEMMs through hybridfp.gemm vs raw torch._scaled_mm and BF16",
                      headline=_gemm),
    "gemm_pairs": Benchmark("bench.bench_gemm_pairs", "MXFP8 / NVFP4 / mixed format pairs vs BF16 a @ b.t()",
                            headline=_gemm_pairs),
    "quantize": Benchmark("bench.bench_quantize", "each quantizer's quantize() vs copy bandwidth",
                          headline=_quantize),
    "quantize_kernels": Benchmark("bench.bench_quantize_kernels",
                                  "quantize kernels' bandwidth; fused hybrids vs their single formats",
                                  headline=_quantize_kernels),
    "mlp": Benchmark("bench.bench_mlp", "Llama-3-8B MLP step vs BF16 eager / compiled, torchao float8",
                     deadline_flag="--deadline-s", headline=_mlp),
    "mlp_fused": Benchmark("bench.bench_mlp", "the Llama-3-8B MLP's fused-SwiGLU rows alone (mlp times them "
                           "last)", ("--mlp-only", "--no-torchao", "--variants", "fused SwiGLU"),
                           default=False, timeout_s=600.0, deadline_flag="--deadline-s", headline=_mlp),
    "mlp_compiled_codes": Benchmark("bench.bench_mlp", "the Llama-3-8B MLP's compiled hybridfp rows and copies "
                                    "decoded per GEMM alone", ("--mlp-only", "--variants", "(compiled)|decoded per GEMM"),
                                    default=False, timeout_s=600.0, deadline_flag="--deadline-s", headline=_mlp),
    "moe": Benchmark("bench.bench_moe", "MoE layer step (4 micro-batches), 8 experts x ffn 14336, vs the fastest BF16",
                     ("--experts", "8"), deadline_flag="--deadline-s", headline=_moe),
    "moe_64": Benchmark("bench.bench_moe", "MoE layer step (4 micro-batches), 64 experts x ffn 1408, vs the fastest BF16",
                        ("--experts", "64"), deadline_flag="--deadline-s", headline=_moe),
    "moe_primary": Benchmark("bench.bench_moe", "the 8-expert MoE's rows with quantized primary weights (FP32 "
                             "masters, weights encoded once a step) alone", ("--experts", "8", "--variants",
                                                                             MOE_PRIMARY_ROWS),
                             default=False, deadline_flag="--deadline-s", headline=_moe),
    "moe_64_primary": Benchmark("bench.bench_moe", "the 64-expert MoE's rows with quantized primary weights alone",
                                ("--experts", "64", "--variants", MOE_PRIMARY_ROWS), default=False,
                                deadline_flag="--deadline-s", headline=_moe),
    "moe_64_compiled": Benchmark("bench.bench_moe", "the 64-expert MoE's quantized-primary-weight rows, eager and "
                                 "under torch.compile", ("--experts", "64", "--variants", MOE_COMPILED_ROWS),
                                 default=False, deadline_flag="--deadline-s", headline=_moe),
    "moe_torchao": Benchmark("bench.bench_moe", "the 8-expert MoE: torchao float8 rowwise (compiled) and hybridfp FP8 "
                             "current vs the fastest BF16, and hybridfp FP8 vs torchao",
                             ("--experts", "8", "--fastest-only", "--variants", MOE_TORCHAO_ROWS), default=False,
                             timeout_s=600.0, deadline_flag="--deadline-s", headline=_moe),
    "moe_64_torchao": Benchmark("bench.bench_moe", "the 64-expert MoE: torchao float8 rowwise (compiled) and hybridfp "
                                "FP8 current vs the fastest BF16, and hybridfp FP8 vs torchao",
                                ("--experts", "64", "--fastest-only", "--variants", MOE_TORCHAO_ROWS), default=False,
                                timeout_s=600.0, deadline_flag="--deadline-s", headline=_moe),
    "moe_fused_swiglu": Benchmark("bench.bench_moe", "the 8-expert MoE's FP8 current and MXFP8 rows (quantized "
                                  "primary weights) with eager and fused SwiGLU, vs the fastest BF16",
                                  ("--experts", "8", "--fastest-only", "--variants", MOE_FUSED_SWIGLU_ROWS),
                                  default=False, timeout_s=600.0, deadline_flag="--deadline-s", headline=_moe),
    "moe_64_fused_swiglu": Benchmark("bench.bench_moe", "the 64-expert MoE's FP8 current and MXFP8 rows (quantized "
                                     "primary weights) with eager and fused SwiGLU, vs the fastest BF16",
                                     ("--experts", "64", "--fastest-only", "--variants", MOE_FUSED_SWIGLU_ROWS),
                                     default=False, timeout_s=600.0, deadline_flag="--deadline-s", headline=_moe),
    "bound_moe": Benchmark("bench.bound_moe", "the best ratio the 64-expert MoE allows, from measured parts",
                           ("--experts", "64"), headline=_bound_moe),
    "bound_moe_8": Benchmark("bench.bound_moe", "the best ratio the 8-expert MoE allows, from measured parts",
                             ("--experts", "8"), headline=_bound_moe),
    "bound_moe_8_at_cap": Benchmark("bench.bound_moe", "the 8-expert MoE bound measured at the GPU's power cap "
                                    "(10 rounds)", ("--experts", "8", "--at-cap"), default=False,
                                    headline=_bound_moe),
    "bound_moe_64_at_cap": Benchmark("bench.bound_moe", "the 64-expert MoE bound measured at the GPU's power cap "
                                     "(10 rounds)", ("--experts", "64", "--at-cap"), default=False,
                                     headline=_bound_moe),
    "bound_mlp": Benchmark("bench.bound_mlp", "the best ratio each recipe allows the Llama-3-8B MLP, from "
                           "measured parts", headline=_bound_mlp),
    "bound_mlp_fused_amax": Benchmark("bench.bound_mlp", "the same with amax fused into each tensor's producer",
                                      ("--fused-amax",), headline=_bound_mlp),
    "bound_mlp_at_cap": Benchmark("bench.bound_mlp", "the MLP bound measured at the GPU's power cap, as the paired "
                                  "ratios run (10 rounds)", ("--at-cap",), default=False, headline=_bound_mlp),
    "grouped_gemm": Benchmark("bench.bench_grouped_gemm", "Triton BF16 / FP8 grouped GEMMs vs torch._grouped_mm",
                              headline=_grouped_gemm),
    "moe_overhead": Benchmark("bench.bench_moe_overhead", "GroupedLinear host work per expert (runs on the CPU)",
                              headline=_moe_overhead),
    "offload": Benchmark("bench.bench_offload", "CPU offload of activations: peak memory and step time, 4 layers",
                         headline=_offload),
    "train_step": Benchmark("bench.bench_train_step", "hybridfp train's step (gpt-100m, moe-small; bf16, fp8, "
                            "mxfp8) with the fused SwiGLU vs the eager one", default=False, timeout_s=600.0,
                            headline=_train_step),
    "convergence": Benchmark("bench.convergence", "validation loss of every recipe vs BF16 (trains ~10 minutes)",
                             # 4 validation batches an evaluation: the committed study's setting, which
                             # leaves the MoE workers time to train at a 10-minute budget
                             ("--out", "runs/convergence", "--eval-iters", "4"), default=False, out_flag="--json",
                             quick=False,
                             timeout_s=1800.0, deadline_flag="--budget-s", headline=_convergence),
    "sweep_dispatch": Benchmark("bench.sweep_dispatch", "GEMM-path thresholds and tile defaults away from their "
                                "fitted shapes: picked / fastest per cell", default=False, timeout_s=900.0,
                                deadline_flag="--deadline-s", headline=_sweep_headline),
    "sweep_dispatch_paths": Benchmark("bench.sweep_dispatch", "the grouped-GEMM path thresholds alone (FP8 dgrad, "
                                      "NVFP4 fprop): picked / fastest per cell", ("--only", "fp8_per_expert,many_experts"),
                                      default=False, timeout_s=600.0, deadline_flag="--deadline-s",
                                      headline=_sweep_headline),
    "sweep_dispatch_tma": Benchmark("bench.sweep_dispatch", "the grouped FP8 GEMM's TMA configs (the policy's) "
                                    "away from their fitted shapes: picked / fastest per cell",
                                    ("--only", "fp8_tma_rows,fp8_tma_dgrad,fp8_tma_wgrad"), default=False, timeout_s=600.0,
                                    deadline_flag="--deadline-s", headline=_sweep_headline),
}


def _print_captured(stdout: Any, stderr: Any) -> None:
    """A benchmark's captured output (``str``, or ``bytes`` from a timed-out run), stdout to
    stdout and the tail of stderr to stderr."""
    def text(v: Any) -> str:
        return v.decode(errors="replace") if isinstance(v, bytes) else (v or "")
    print(text(stdout), flush=True)
    if stderr:
        print(text(stderr)[-4000:], file=sys.stderr, flush=True)


def _keep_failed(tmp: Path, out: Path) -> Optional[dict[str, Any]]:
    """Move a failed run's JSON (what it measured before failing or timing out) to
    ``<name>.failed.json`` beside the last good one; its content, or None (none written, or cut
    off mid-write)."""
    if not tmp.exists():
        return None
    failed = out.with_name(out.stem + ".failed.json")
    tmp.replace(failed)
    try:
        return json.loads(failed.read_text())
    except json.JSONDecodeError:
        return None


#: seconds a timed-out benchmark gets after SIGTERM (the convergence study stops its workers and
#: writes its reports then) before its process group is killed
TERM_GRACE_S = 60.0


def _stop(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGTERM to ``proc``'s process group, SIGKILL after ``TERM_GRACE_S``; its output so far.

    Parameters
    ----------
    proc : a benchmark started as its own process group (``start_new_session=True``).

    Returns
    -------
    tuple[str, str]
        Its stdout and stderr.
    """
    with contextlib.suppress(ProcessLookupError):  # it and its children may be gone already
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        return proc.communicate(timeout=TERM_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()


#: with a time limit, a benchmark that takes ``--deadline-s`` stops starting rows at this
#: fraction of it, so its last row and its JSON fit before the limit kills the process
DEADLINE_FRACTION = 0.75


def run_one(name: str, out: Path, quick: bool, timeout_s: Optional[float] = None
            ) -> tuple[Optional[dict[str, Any]], str, bool]:
    """One benchmark in its own process (and process group).

    Parameters
    ----------
    name : a key of ``BENCHMARKS``.
    out : where its JSON goes when it succeeds; a failed or timed-out run's JSON is kept as
        ``<name>.failed.json`` beside it, and ``out`` is left as it was.
    quick : pass ``--quick`` (small sizes) where the benchmark takes it.
    timeout_s : replaces the benchmark's own time limit; one with a time-limit option of its
        own (``deadline_flag``) is given ``DEADLINE_FRACTION`` of it, so it ends on its own and
        writes its JSON (rows left recorded as not run; the study's runs stopped and reported).
        At the limit its process group gets SIGTERM, then SIGKILL after ``TERM_GRACE_S``.

    Returns
    -------
    tuple
        (its JSON, or what a failed / timed-out run wrote, or None; a status; whether it
        succeeded).
    """
    b = BENCHMARKS[name]
    tmp = out.with_name(out.name + ".tmp")
    tmp.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", b.module, *b.args, b.out_flag, str(tmp)] + (["--quick"] if quick and b.quick else [])
    limit = b.timeout_s if timeout_s is None else timeout_s
    if timeout_s is not None and b.deadline_flag:
        cmd += [b.deadline_flag, f"{DEADLINE_FRACTION * timeout_s:g}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    t0 = time.monotonic()
    # its own process group: a time-out signals the benchmark and every process it started
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        stdout, stderr = _stop(proc)  # its checkpointed JSON and its output so far stay readable
        _print_captured(stdout, stderr)
        return _keep_failed(tmp, out), f"timed out after {limit:.0f} s", False
    if proc.returncode != 0 or not tmp.exists():
        _print_captured(stdout, stderr)
        last = stderr.strip().splitlines()[-1:] or [""]
        # what it measured before failing (a check, a missing baseline) stays readable
        return _keep_failed(tmp, out), f"failed (exit {proc.returncode}) {last[0][:160]}".strip(), False
    print(stdout, flush=True)
    tmp.replace(out)
    return json.loads(out.read_text()), f"{time.monotonic() - t0:.0f} s", True


def summary(results: dict[str, Optional[dict[str, Any]]], status: dict[str, str],
            ok: Optional[dict[str, bool]] = None) -> str:
    """One Markdown table: every benchmark's headline rows, or its status when it has none. A
    failed benchmark (``ok`` False) gets a FAILED row first, then the headline rows of what it
    measured (its ``.failed.json``): one failing variant does not hide the other ratios."""
    from bench.common import md_table
    rows: list[tuple[str, str, str]] = []
    for name, r in results.items():
        lines = [(name, label, value) for label, value in (BENCHMARKS[name].headline(r) if r is not None else [])]
        if ok is not None and not ok.get(name, True):
            kept = f"; measured before: {name}.failed.json" if r is not None else ""
            lines.insert(0, (name, "FAILED: " + status.get(name, ""), f"the rows below are partial{kept}"
                             if lines else f"nothing measured{kept}"))
        rows += lines or [(name, "", status.get(name, ""))]
    return md_table(["benchmark", "row", "value"], rows)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", metavar="NAME", help="benchmarks to run (default: all but the by-name ones)")
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke test of the scripts")
    p.add_argument("--results-dir", type=Path, default=None,
                   help=f"where <name>.json goes (default {RESULTS_DIR.relative_to(ROOT)}; with --quick a "
                        "temporary folder)")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="each benchmark's time limit instead of its own; mlp and moe stop starting rows at "
                        f"{DEADLINE_FRACTION:.0%}% of it and record the rest as not run, convergence "
                        "gets that as its --budget-s")
    args = p.parse_args(argv)
    if args.timeout_s is not None and args.timeout_s <= 0:
        p.error(f"--timeout-s must be positive; got {args.timeout_s}")
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    if args.list:
        width = max(map(len, BENCHMARKS))
        for name, b in BENCHMARKS.items():
            print(f"{name:{width}s}  {b.question}" + ("" if b.default else " [by name only]"))
        return 0
    import torch
    if not torch.cuda.is_available():
        print("bench: no CUDA GPU on this machine; the benchmarks need one (python -m bench --list names them).",
              file=sys.stderr)
        return 2
    names = args.names or [n for n, b in BENCHMARKS.items() if b.default]
    with tempfile.TemporaryDirectory() as tmp:
        results_dir = args.results_dir or (Path(tmp) if args.quick else RESULTS_DIR)
        results_dir.mkdir(parents=True, exist_ok=True)
        results: dict[str, Optional[dict[str, Any]]] = {}
        status: dict[str, str] = {}
        ok: dict[str, bool] = {}
        for name in names:
            print(f"== {name}: {BENCHMARKS[name].question}", flush=True)
            results[name], status[name], ok[name] = run_one(name, results_dir / f"{name}.json", args.quick,
                                                               args.timeout_s)
            print(f"== {name}: {status[name]}", flush=True)
    print("\n" + summary(results, status, ok))
    return 0 if all(ok.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
