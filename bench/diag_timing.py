"""Why do do_bench and back-to-back steps disagree for some MLP variants? (diagnostic)

For each chosen recipe (unfused and with the fused SwiGLU) one process measures the Llama-3-8B
MLP step four ways and reports the per-iteration times and the caching allocator's counters
(device allocations / frees / retries) over each loop:

- ``dobench``: ``triton.testing.do_bench`` as ``bench_mlp`` calls it (median);
- ``flush``: the same loop by hand (256 MB L2 flush + events around each step, no sync);
- ``noflush``: the hand loop without the flush;
- ``steady``: ``common.bench_ms_steady``'s back-to-back GPU ms.

    python -m bench.diag_timing [--recipes nvfp4_mxfp8,mxfp8] [--iters 15] [--out F]
"""

from __future__ import annotations

import json
import statistics
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

import hybridfp
from bench import common
from bench.bench_mlp import D, H, TOKENS, MLP, NVFP4_MXFP8, fused_swiglu, hybridfp_linear, make_step, torch_linear
from bench.common import bench_ms, bench_ms_steady, parser, require_cuda

RECIPES: dict[str, Callable[[], Any]] = {
    "nvfp4_mxfp8": lambda: hybridfp.CustomRecipe(qfactory=NVFP4_MXFP8),
    "mxfp8": lambda: hybridfp.MXFP8BlockScaling(),
    "nvfp4": lambda: hybridfp.NVFP4BlockScaling(),
    "fp8": lambda: hybridfp.Float8CurrentScaling(),
}
_KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def _alloc_counts() -> dict[str, int]:
    s = torch.cuda.memory_stats()
    return {k: int(s.get(k, 0)) for k in _KEYS}


def _loop(step: Callable[[], Any], iters: int, flush: bool) -> tuple[list[float], dict[str, int]]:
    """Per-iteration event ms of ``iters`` queued steps (optionally flushing L2 before each), and
    the allocator counter deltas over the loop."""
    cache = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda") if flush else None
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    torch.cuda.synchronize()
    before = _alloc_counts()
    for s, e in ev:
        if cache is not None:
            cache.zero_()
        s.record()
        step()
        e.record()
    torch.cuda.synchronize()
    after = _alloc_counts()
    return [s.elapsed_time(e) for s, e in ev], {k: after[k] - before[k] for k in _KEYS}


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--recipes", default="nvfp4_mxfp8,mxfp8")
    p.add_argument("--iters", type=int, default=15)
    args = p.parse_args(argv)
    require_cuda()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    x = torch.randn(TOKENS, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    base = MLP(torch_linear, D, H)
    with torch.no_grad():
        dy = torch.randn_like(base(x))
    hf = MLP(hybridfp_linear, D, H)
    hf.load_state_dict(base.state_dict())
    del base
    rows: list[dict[str, Any]] = []
    for rname in args.recipes.split(","):
        for fused in (False, True):
            model = fused_swiglu(hf) if fused else hf
            recipe = RECIPES[rname]()
            step = make_step(model, list(hf.parameters()), lambda: hybridfp.autocast(recipe=recipe), x, dy)
            torch.cuda.empty_cache()
            for _ in range(3):
                step()
            row: dict[str, Any] = {"recipe": rname, "fused": fused}
            before = _alloc_counts()
            row["dobench"] = bench_ms(step, warmup_ms=100, rep_ms=300)
            row["dobench_alloc"] = {k: v - before[k] for k, v in _alloc_counts().items()}
            for mode, flush in (("flush", True), ("noflush", False)):
                t, a = _loop(step, args.iters, flush)
                row[mode] = statistics.median(t)
                row[mode + "_iters"] = [round(v, 2) for v in t]
                row[mode + "_alloc"] = a
            row["steady"], row["host"] = bench_ms_steady(step)
            row["reserved_gb"] = torch.cuda.memory_reserved() / 2**30
            row["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("| recipe | fused | do_bench | flush | no flush | steady | allocs (do_bench / flush / no flush) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        al = " / ".join(str(r[k]["num_device_alloc"]) + "+" + str(r[k]["num_device_free"])
                        for k in ("dobench_alloc", "flush_alloc", "noflush_alloc"))
        print(f"| {r['recipe']} | {r['fused']} | {r['dobench']:.2f} | {r['flush']:.2f} | {r['noflush']:.2f} "
              f"| {r['steady']:.2f} | {al} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"env": common.environment(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
