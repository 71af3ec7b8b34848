"""Diagnosis (H200): where the GPU sits idle between kernels in the Llama-3-8B MLP step.

The FP8-current MLP step (fused SwiGLU) has kernels adding up to ~15.06 ms while the timed
step takes 15.9-16.3 ms. This script builds the step exactly as ``bench_mlp`` does, profiles a
few steady steps with torch.profiler (CPU + CUDA) and, from the kineto chrome trace, reports per
step the GPU span, the kernel time, the idle time and the largest gaps between kernels. For the
kernel after each gap it finds the runtime / driver call that launched it (same correlation id)
and the CPU op around that call: a launch that began after the GPU went idle means the host was
late; one made well before means the GPU serialized on something (a stream wait, launch
latency). It also times the plain step and, where capture works, the step as one CUDA graph
(CUDA events, back-to-back steps).

    python -m bench.diag_mlp_gaps [--recipe NAME] [--eager-swiglu] [--out PATH] [--trace PATH]

``--recipe`` picks one of ``bench_mlp.RECIPES`` by its name or a part of it (an exact name
wins, then the first in the list that contains the text). ``--out x.json`` writes the JSON and
``x.txt`` (the printed report). ``--trace`` keeps the raw chrome trace (open it in Perfetto).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch

import hybridfp
from bench import common
from bench.bench_mlp import D, H, MLP, RECIPES, TOKENS, fused_swiglu, hybridfp_linear, make_step
from bench.common import bench_ms_steady, environment, md_table, parser, require_cuda

STEP_PREFIX = "diag_mlp_step_"
#: Device-side activity that keeps the GPU busy (kineto chrome-trace categories).
BUSY_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
#: Host calls that carry the correlation id of the device activity they start.
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
NAME_CHARS = 60


def pick_recipe(text: str) -> tuple[str, Callable[[], Any]]:
    """The entry of ``bench_mlp.RECIPES`` named ``text``, else the first whose name contains it."""
    exact = [r for r in RECIPES if r[0] == text]
    near = [r for r in RECIPES if text.lower() in r[0].lower()]
    if not exact + near:
        raise SystemExit(f"--recipe {text!r} matches none of: " + "; ".join(n for n, _ in RECIPES))
    return (exact + near)[0]


def build_step(recipe_name: str, eager_swiglu: bool, quick: bool) -> tuple[Callable[[], torch.Tensor], str]:
    """bench_mlp's MLP step (zero grads, weights re-quantized, forward, backward) and its label."""
    name, recipe = pick_recipe(recipe_name)
    d, h, tokens = (256, 512, 512) if quick else (D, H, TOKENS)
    torch.manual_seed(0)
    model = MLP(hybridfp_linear, d, h)
    if not eager_swiglu:
        model = fused_swiglu(model)
        name += " + fused SwiGLU"
    x = torch.randn(tokens, d, device=common.DEVICE, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, d, device=common.DEVICE, dtype=torch.bfloat16)
    r = recipe()
    step = make_step(model, list(model.parameters()), lambda: hybridfp.autocast(recipe=r), x, dy)
    return step, f"{name}, MLP {tokens}x{d}->{h}->{d}"


def _end(e: dict[str, Any]) -> float:
    return float(e["ts"]) + float(e.get("dur", 0.0))


def _innermost(ops: list[dict[str, Any]], t: float) -> Optional[dict[str, Any]]:
    """The shortest op of ``ops`` (one host thread) whose interval contains time ``t``."""
    inside = [o for o in ops if float(o["ts"]) <= t <= _end(o)]
    return min(inside, key=lambda o: float(o.get("dur", 0.0)), default=None)


def analyze_trace(trace: dict[str, Any], step_prefix: str = STEP_PREFIX, top: int = 15) -> list[dict[str, Any]]:
    """Per profiled step (a ``user_annotation`` named ``step_prefix<i>``) of a kineto chrome
    trace: GPU span, kernel time, idle time and the ``top`` largest gaps between busy intervals,
    each with the kernel before / after it and the launch of the one after. Times in us.

    A device event belongs to the step during whose annotation its launch call began (any host
    thread: backward runs on autograd's thread while the annotated thread waits in backward()).
    The busy timeline merges all device events of all streams, so work of another step or of an
    unannotated lead-in still counts as busy. Gap verdicts: "cpu late" (the launch call began
    after the GPU went idle), "launching" (the call was in progress when the GPU went idle),
    "queued" (launched before: the GPU waited on something else), "unknown" (no launch found)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    dev = sorted((e for e in events if e.get("cat") in BUSY_CATS), key=lambda e: float(e["ts"]))
    launch = {e["args"]["correlation"]: e for e in events
              if e.get("cat") in LAUNCH_CATS and "correlation" in (e.get("args") or {})}
    ops_by_thread: dict[Any, list[dict[str, Any]]] = {}
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation"):
            ops_by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    steps = sorted((e for e in events if e.get("cat") == "user_annotation"
                    and str(e.get("name", "")).startswith(step_prefix)), key=lambda e: float(e["ts"]))

    def launch_of(e: dict[str, Any]) -> Optional[dict[str, Any]]:
        return launch.get((e.get("args") or {}).get("correlation"))

    def step_of(e: dict[str, Any]) -> Optional[int]:
        call = launch_of(e)
        if call is None:
            return None
        return next((i for i, s in enumerate(steps) if float(s["ts"]) <= float(call["ts"]) <= _end(s)), None)

    # Merge the device events into busy intervals [start, end, event opening it, event ending it].
    busy: list[list[Any]] = []
    for e in dev:
        if busy and float(e["ts"]) <= busy[-1][1]:
            if _end(e) > busy[-1][1]:
                busy[-1][1], busy[-1][3] = _end(e), e
        else:
            busy.append([float(e["ts"]), _end(e), e, e])
    gaps = []
    for (_, prev_end, _, before), (start, _, after, _) in zip(busy, busy[1:]):
        call = launch_of(after)
        gap: dict[str, Any] = {"gap_us": start - prev_end, "start": prev_end, "step": step_of(after),
                               "before": before["name"][:NAME_CHARS], "after": after["name"][:NAME_CHARS]}
        if call is None:
            gap["verdict"] = "unknown"
        else:
            op = _innermost(ops_by_thread.get((call.get("pid"), call.get("tid")), []), float(call["ts"]))
            gap.update(launch_call=call["name"][:NAME_CHARS], op=op["name"][:NAME_CHARS] if op else None,
                       launch_rel_us=float(call["ts"]) - prev_end, launch_end_rel_us=_end(call) - prev_end)
            gap["verdict"] = ("cpu late" if gap["launch_rel_us"] >= 0 else
                              "launching" if gap["launch_end_rel_us"] > 0 else "queued")
        gaps.append(gap)

    out = []
    for i, s in enumerate(steps):
        own = [e for e in dev if step_of(e) == i]
        if not own:
            out.append({"step": s["name"], "host_us": float(s.get("dur", 0.0)), "error": "no device events"})
            continue
        lo, hi = float(own[0]["ts"]), max(_end(e) for e in own)
        covered = sum(max(0.0, min(b, hi) - max(a, lo)) for a, b, _, _ in busy)
        inner = [g for g in gaps if lo <= g["start"] < hi]  # whoever launched the kernel after it
        lead = next((g for g in gaps if g["start"] < lo <= g["start"] + g["gap_us"]), None)
        mine = inner + ([lead] if lead else [])
        idle_by = {v: sum(g["gap_us"] for g in inner if g["verdict"] == v)
                   for v in ("cpu late", "launching", "queued", "unknown")}
        # cuda/cuStream-, Event-, DeviceSynchronize in the step: the host waited on the GPU there
        syncs = sorted(({"call": c["name"], "us": float(c.get("dur", 0.0))} for c in launch.values()
                        if "Synchronize" in c["name"] and float(s["ts"]) <= float(c["ts"]) <= _end(s)),
                       key=lambda c: -c["us"])
        top_gaps = [{**g, "start_rel_us": g["start"] - lo}  # negative for the lead gap
                    for g in sorted(mine, key=lambda g: -g["gap_us"])[:top]]
        out.append({
            "step": s["name"], "host_us": float(s.get("dur", 0.0)), "span_us": hi - lo,
            "kernels": sum(e.get("cat") == "kernel" for e in own),
            "kernel_us": sum(float(e.get("dur", 0.0)) for e in own if e.get("cat") == "kernel"),
            "memcpy_memset_us": sum(float(e.get("dur", 0.0)) for e in own if e.get("cat") != "kernel"),
            "idle_us": (hi - lo) - covered, "lead_gap_us": lead and lead["gap_us"], "gaps": len(inner),
            "idle_by_verdict_us": idle_by, "host_syncs": syncs[:5], "top_gaps": top_gaps})
    return out


def profile_trace(step: Callable[[], Any], steps: int, keep: Optional[Path]) -> dict[str, Any]:
    """Chrome trace (parsed) of ``steps`` annotated steps, after one unannotated lead-in step
    inside the profiler so that the annotated ones start with work queued, as in a training loop."""
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        step()
        for i in range(steps):
            with torch.profiler.record_function(f"{STEP_PREFIX}{i}"):
                step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        if keep is not None:
            keep.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, keep)
        return json.loads(path.read_text())


def graph_ms(step: Callable[[], torch.Tensor], steps: int) -> dict[str, Any]:
    """ms per replay of the whole step captured as one CUDA graph, or why capture failed."""
    try:
        ref = step().detach().float()
        side = torch.cuda.Stream()  # warm-up on a side stream before capture, as the torch docs do
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = step()
    except Exception as e:  # noqa: BLE001 - report why the recipe cannot be captured
        cause = e.__context__  # capture_end's error can hide the call that broke the capture
        why = f"{type(e).__name__}: {e}" + (f" (during: {type(cause).__name__}: {cause})" if cause else "")
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - the context may be unusable now; the report still prints
            pass
        return {"error": "no CUDA graph: " + " ".join(why.split())[:400]}
    ms, host = bench_ms_steady(graph.replay, steps=steps)
    diff = ((static_y.float() - ref).norm() / ref.norm()).item()  # a sanity check, not a proof
    return {"ms": ms, "host_ms": host, "rel_diff_vs_eager": diff}


def report(res: dict[str, Any]) -> str:
    """The per-step gap tables, then the summary table (last)."""
    parts = [f"## MLP step gaps: {res['variant']}\n",
             "Times in us from the profiled steps (profiler overhead slows the host: 'cpu late' is an "
             "upper bound). launch rel = the launch call's start - the gap's start (>= 0: the host was "
             "late). start = gap start - the step's first kernel start (< 0: the gap before the step).\n"]
    for s in res["steps"]:
        if "error" in s:
            parts.append(f"### {s['step']}: {s['error']}\n")
            continue
        v = s["idle_by_verdict_us"]
        parts.append(
            f"### {s['step']}: span {s['span_us']:.1f}, kernels {s['kernels']} = {s['kernel_us']:.1f}, "
            f"memcpy/memset {s['memcpy_memset_us']:.1f}, idle {s['idle_us']:.1f} in {s['gaps']} gaps "
            f"(cpu late {v['cpu late']:.1f}, launching {v['launching']:.1f}, queued {v['queued']:.1f}, "
            f"unknown {v['unknown']:.1f}), gap before the step {s['lead_gap_us']}, host {s['host_us']:.1f}; "
            f"host syncs: {s['host_syncs'] or 'none'}\n")
        parts.append(md_table(
            ["gap", "start", "before", "after", "launch call", "CPU op", "launch rel", "verdict"],
            [(g["gap_us"], g["start_rel_us"], g["before"], g["after"], g.get("launch_call"), g.get("op"),
              g.get("launch_rel_us"), g["verdict"]) for g in s["top_gaps"]]) + "\n")
    ok = [s for s in res["steps"] if "error" not in s]

    def mean_ms(get: Callable[[dict[str, Any]], float]) -> Optional[float]:
        return sum(get(s) for s in ok) / len(ok) / 1e3 if ok else None
    g = res["graph"]
    parts.append(f"CUDA graph of the whole step: {g}\n")
    parts.append("## Summary (ms per step; profile columns: mean of the profiled steps)\n")
    parts.append(md_table(
        ["variant", "plain (CUDA events)", "plain host", "CUDA graph", "kernel sum", "GPU span", "idle in span",
         "idle cpu late", "idle queued"],
        [(res["variant"], res["plain_ms"], res["plain_host_ms"], g.get("ms", g.get("error")),
          mean_ms(lambda s: s["kernel_us"]), mean_ms(lambda s: s["span_us"]), mean_ms(lambda s: s["idle_us"]),
          mean_ms(lambda s: s["idle_by_verdict_us"]["cpu late"]),
          mean_ms(lambda s: s["idle_by_verdict_us"]["queued"]))]))
    return "\n".join(parts)


def main(argv: Optional[list[str]] = None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--recipe", default=RECIPES[0][0], help="a bench_mlp recipe name or part of one "
                   f"(default {RECIPES[0][0]!r}): " + "; ".join(n for n, _ in RECIPES))
    p.add_argument("--eager-swiglu", action="store_true", help="eager silu * up instead of the fused SwiGLU")
    p.add_argument("--steps", type=int, default=3, help="profiled steps")
    p.add_argument("--timed-steps", type=int, default=20, help="back-to-back steps behind each ms")
    p.add_argument("--trace", type=Path, default=None, help="keep the chrome trace here")
    args = p.parse_args(argv)
    require_cuda()
    warnings.simplefilter("ignore")
    env = environment()  # before any capture attempt can leave CUDA unusable
    step, variant = build_step(args.recipe, args.eager_swiglu, args.quick)
    for _ in range(5):  # compile / autotune the Triton kernels, fill the allocator's cache
        step()
    plain_ms, plain_host = bench_ms_steady(step, steps=args.timed_steps)
    steps = analyze_trace(profile_trace(step, args.steps, args.trace))
    graph = graph_ms(step, args.timed_steps)  # last: a failed capture may leave CUDA unusable
    res = {"env": env, "variant": variant, "plain_ms": plain_ms, "plain_host_ms": plain_host,
           "graph": graph, "steps": steps}
    text = report(res)
    print(text, flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        txt = args.out.with_suffix(".txt")
        (args.out.with_suffix(".json") if txt == args.out else args.out).write_text(
            json.dumps({"name": "mlp_gaps", **res, "text": text}, indent=1, default=str))
        txt.write_text(text + "\n")


if __name__ == "__main__":
    main()
