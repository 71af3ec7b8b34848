"""Run every benchmark (one process each), write results/<date>.md and .json, print a summary.

    python -m bench.run_all [--results-dir bench/results] [--quick] [--budget-s 330] [--only moe,mlp]

Each benchmark measures its own baselines (copy bandwidth, BF16) in its own process; the
summary printed last repeats the headline numbers: FP8 GEMM through hybridfp.gemm vs raw
torch._scaled_mm at 8192^3 (target >= 0.97) and MLP forward+backward speedups vs BF16.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from bench.common import RESULTS_DIR, md_table

BENCHES = ["gemm", "gemm_pairs", "quantize", "mlp", "moe"]


def run_bench(name: str, out: Path, quick: bool, timeout: float, extra: list[str]) -> Optional[dict[str, Any]]:
    """One benchmark in its own process; its JSON, or None (failure printed)."""
    cmd = [sys.executable, "-m", f"bench.bench_{name}", "--out", str(out)] + (["--quick"] if quick else []) + extra
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                        os.environ.get("PYTHONPATH")]))}
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, timeout=max(timeout, 1), text=True, capture_output=True)
    except subprocess.TimeoutExpired as e:
        print(f"bench_{name}: timed out after {timeout:.0f} s\n{(e.stdout or '')[-2000:]}", flush=True)
        return json.loads(out.read_text()) if out.exists() else None  # a partial result, if written
    print(proc.stdout, flush=True)
    if proc.returncode != 0 or not out.exists():
        print(f"bench_{name}: failed (rc={proc.returncode})\n{proc.stderr[-4000:]}", flush=True)
        return None
    result = json.loads(out.read_text())
    result["wall_s"] = time.monotonic() - t0
    return result


def summary(results: dict[str, dict[str, Any]], benches: Optional[list[str]] = None) -> str:
    """The headline numbers, one short table."""
    rows: list[tuple[str, str]] = []
    g = results.get("gemm")
    for r in (g or {}).get("rows", []):
        if r["shape"].startswith("8192"):
            rows += [("GEMM 8192^3 TFLOP/s BF16 / FP8 raw / FP8 hybridfp",
                      f"{r['bf16']:.0f} / {r['tensorwise_raw']:.0f} / {r['tensorwise_hybridfp']:.0f}"),
                     ("  FP8 hybridfp / raw _scaled_mm (target >= 0.97)", f"{r['tensorwise_ratio']:.3f}"),
                     ("  same with fprop fast accumulation: raw / hybridfp TFLOP/s",
                      f"{r.get('tensorwise_fast_raw', 0):.0f} / {r.get('tensorwise_fast_hybridfp', 0):.0f}"),
                     (f"GEMM 8192^3 TFLOP/s FP8 block ({r['block_pair']}) raw / hybridfp",
                      f"{r['block_raw']:.0f} / {r['block_hybridfp']:.0f}"),
                     ("  block hybridfp / raw", f"{r['block_ratio']:.3f}")]
    for r in (results.get("gemm_pairs") or {}).get("rows", []):
        if r["shape"].startswith("8192"):
            rows.append((f"GEMM 8192^3 {r['pair']} {r['layout']} ({r['backend']}) / BF16, cold / warm weight",
                         f"{r['cold_ratio']:.2f} / {r['warm_ratio']:.2f}"))
    m = results.get("mlp")
    for r in (m or {}).get("rows", []):
        if r["model"].startswith("Llama") and r["variant"] != "BF16 eager":
            val = r.get("error", "?")
            if r.get("speedup_vs_bf16_eager"):
                val = f"{r['speedup_vs_bf16_eager']:.2f}x eager" + (
                    f", {r['speedup_vs_bf16_compile']:.2f}x compile" if r.get("speedup_vs_bf16_compile") else "")
            rows.append((f"MLP fwd+bwd {r['variant']}", val))
    q = results.get("quantize")
    for r in (q or {}).get("rows", []):
        if r["directions"] == "row+col" and "GBps" in r and r["quantizer"] in (
                "FP8 current E4M3", "FP8 block 1x128", "MXFP8", "Hybrid FP8 current / FP8 block 1x128"):
            rows.append((f"quantize {r['quantizer']} row+col", f"{r['x_copy']:.2f}x copy ({r['path']})"))
    missing = [b for b in (benches or BENCHES) if b not in results]
    if missing:
        rows.append(("benchmarks that failed", ", ".join(missing)))
    return md_table(["summary", "value"], rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget for all benchmarks")
    p.add_argument("--only", default=None, help="comma-separated subset of " + ",".join(BENCHES))
    args = p.parse_args(argv)
    benches = [b for b in BENCHES if args.only is None or b in args.only.split(",")]
    start = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in benches:
            left = args.budget_s - (time.monotonic() - start)
            # the MLP's compiled variants stop early enough to leave the MoE benchmark its time
            extra = ["--deadline-s", str(max(left - 150, 0)), "--linear-compiled"] if name == "mlp" else []
            r = run_bench(name, Path(tmp) / f"{name}.json", args.quick, left, extra)
            if r is not None:
                results[name] = r
    env = next((r["env"] for r in results.values()), {})
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    head = (f"# hybridfp benchmarks, {env.get('date', date)}\n\n"
            f"GPU: {env.get('gpu')} (sm{env.get('capability')}), torch {env.get('torch')}, CUDA "
            f"{env.get('cuda')}, triton {env.get('triton')}, torchao "
            f"{results.get('mlp', {}).get('env', {}).get('torchao', 'n/a')}, commit {env.get('commit')}.\n"
            "Reproduce: `python -m bench.run_all` on the GPU machine (one process per benchmark).\n")
    table = summary(results, benches)
    md = "\n".join([head, "## Summary\n", table, ""] + [results[b]["markdown"] for b in BENCHES if b in results])
    (args.results_dir / f"{date}.md").write_text(md)
    (args.results_dir / f"{date}.json").write_text(json.dumps({"env": env, "benchmarks": results}, indent=1,
                                                               default=str))
    print(f"\nwrote {args.results_dir / (date + '.md')} and .json; total {time.monotonic() - start:.0f} s\n")
    print(table)


if __name__ == "__main__":
    main()
