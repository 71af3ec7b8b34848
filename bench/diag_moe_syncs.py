"""Diagnosis (H200): where a ``bench_moe`` step makes the host wait for the GPU.

A step whose GPU sits idle a third of the time while its host work is below the GPU's
(64 experts, Composer-2: "GPU busy" 0.71) is likely synchronizing more often than the one
``.tolist()`` of the routing. For each recipe this runs ``bench_moe``'s layer and step (after
two warm-up steps) once under ``torch.cuda.set_sync_debug_mode("warn")``, recording each
synchronizing call with the innermost hybridfp / bench frames of its Python stack, and once
under torch.profiler, counting the CUDA runtime calls that block the host
(``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``, ``cudaMemcpy``).

    python -m bench.diag_moe_syncs [--experts 64] [--recipe TEXT] [--out PATH]
"""

from __future__ import annotations

import traceback
import warnings
from collections import Counter
from typing import Any, Callable, Optional

import torch

import hybridfp
from bench import common
from bench.bench_moe import CONFIGS, RECIPES, make_step, moe_layer
from bench.common import finish, md_table, parser, require_cuda

BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def sync_sites(step: Callable[[], Any], depth: int = 3) -> Counter:
    """Synchronizing calls of one ``step`` by their innermost ``depth`` hybridfp / bench frames."""
    sites: Counter = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "/hybridfp/" in f.filename or "/bench/" in f.filename]
        where = " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}:{f.name}" for f in frames[-depth:][::-1])
        sites[(str(message).split(".")[0][:60], where or f"{filename}:{lineno}")] += 1

    saved = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            # backward on this thread: the device thread's syncs would be recorded without its stack
            with torch.autograd.set_multithreading_enabled(False):
                step()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = saved
    return sites


def blocking_calls(step: Callable[[], Any]) -> Counter:
    """CUDA runtime calls of one ``step`` that block the host (torch.profiler), by name."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    calls: Counter = Counter()
    for e in prof.events():
        if e.name in BLOCKING:
            calls[e.name] += 1
    return calls


def main(argv: Optional[list[str]] = None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--recipe", default=None, help="only recipes whose name contains this text")
    args = p.parse_args(argv)
    require_cuda()
    f = dict(CONFIGS)[args.experts]
    base, model, x, dy = moe_layer(args.experts, f)
    rows, details = [], []
    for name, make in RECIPES:
        if args.recipe and args.recipe not in name:
            continue
        recipe = make()
        step = make_step(model, x, dy, lambda r=recipe: hybridfp.autocast(recipe=r))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(2):
                step()
        torch.cuda.synchronize()
        sites = sync_sites(step)
        calls = blocking_calls(step)
        rows.append((name, sum(sites.values()), len(sites),
                     ", ".join(f"{k} {v}" for k, v in calls.items() if k in BLOCKING) or "-"))
        details.append(f"#### {name}\n\n" + md_table(["count", "warning", "where (innermost first)"],
                                                      [(v, m, w) for (m, w), v in sites.most_common()]))
        torch.cuda.empty_cache()
    md = (f"### Synchronizing calls per bench_moe step ({args.experts} experts, ffn {f})\n\n"
          "'syncs': calls flagged by torch.cuda.set_sync_debug_mode (the routing's .tolist() is one); "
          "'blocking runtime calls': torch.profiler's count (the step's final synchronize included).\n\n"
          + md_table(["recipe", "syncs", "sites", "blocking runtime calls"], rows) + "\n\n" + "\n\n".join(details) + "\n")
    finish("diag_moe_syncs", {"env": common.environment(), "markdown": md}, args.out)


if __name__ == "__main__":
    main()
