"""Where the host time of one MoE step goes: a Python profile (cProfile) of bench_moe's rows.

A step of the 64-expert layer is host-bound where the host's own work (bench_moe's "host ms"
less its waits at the routing syncs) comes close to the step's "ms": the GPU waits for the
Python that launches its kernels. This builds the same layer, routings and rows
as ``bench_moe`` (``--variants``, its row names), runs a few warm-up steps, then profiles one
step per row with ``cProfile`` (the step synchronized at its end, so the time is the host's
until the last launch) and prints the functions by own time and by cumulative time. No ratio is
measured; the figures say which Python to cut, not how fast the layer is.

``--torch-profiler`` profiles the step with ``torch.profiler`` instead: the aten ops and CUDA API
calls by their own host time, and a line splitting the step's host time into the CUDA runtime
and driver calls (kernel launches, copies, syncs: what the host spends handing work to the GPU)
and the rest (Python, aten's dispatch, Triton's launcher). Without Python frames (cProfile's
2-3x inflation) it says whether launches or Python hold a host-bound step.

``--cpu-stub`` needs no GPU: the rows run on the CPU along the GPU's code paths with the GPU's
work stubbed (``bench_moe_overhead.stub_gpu_paths``: the grouped GEMMs a shape-only stub, every
Triton launch a no-op), at ``--quick``'s shapes, and one step of each is counted: its Python
calls, aten ops and the Triton kernels and grouped GEMMs it would launch (by name: the calls the
stubs replaced; a baseline's backward GEMMs, called inside autograd, run on the CPU and show
among its aten ops). The counts are deterministic; no time is given (the aten ops' arithmetic
runs on the CPU). Cached weight decodes (MXFP8 quantized primary weights, once a step) run
PyTorch's reference decode there, a Triton kernel on the GPU.

    python -m bench.profile_moe_host [--experts 64] [--variants "hybridfp FP8 current|..."] [--top 40]
        [--out moe_host_profile.txt] [--reps 5] [--quick] [--torch-profiler | --cpu-stub]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections import Counter
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Optional

from torch.profiler import ProfilerActivity, profile

import hybridfp
from bench import common
from bench.bench_moe import QUICK_CONFIGS, QUICK_SHAPE
from bench.bench_moe_overhead import OpCounter, python_calls, stub_gpu_paths
from bench.common import host_ms
from bench.moe_layer import HIDDEN, ROUTING_SKEW, TOKENS, RoutingSchedule, Step, moe_layer
from bench.moe_rows import BASELINES, variants_of, wrap
from bench.moe_targets import CONFIGS

#: rows profiled when ``--variants`` is not given: the FP8 recipe as the layer and as training runs it
DEFAULT_VARIANTS = "BF16 grouped|hybridfp FP8 current|hybridfp FP8 current [quantized primary weights]"


def profile_text(step: Callable[[], Any], title: str, top: int, reps: int = 5, model: Any = None) -> str:
    """One step of ``step`` under cProfile: its functions by own time and by cumulative time.

    Parameters
    ----------
    step:
        One training step.
    title:
        The row's name, for the title line.
    top:
        Functions listed per table.
    reps:
        Unprofiled steps timed for the title line's host ms (``bench_moe.host_ms``: the step
        returning, not the GPU finishing).
    model:
        The layer ``step`` runs: the title line gives the waits at its routing syncs (its
        ``SyncClock``; the profile shows them as ``tolist``); None: a layer without one (0).

    Returns
    -------
    str
        The title line and the two tables."""
    prof = cProfile.Profile()
    common.synchronize()
    prof.enable()
    step()
    common.synchronize()
    prof.disable()
    host, waited = host_ms(step, model, warmup=0, reps=reps)
    text = [f"## {title}: host ms (median of {reps}, unprofiled) {host:.2f}, of it at syncs {waited:.2f}"]
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).strip_dirs().sort_stats(key).print_stats(top)
        text.append(f"### by {key}\n" + buf.getvalue().split("\n\n", 1)[-1])
    return "\n".join(text)


#: CUDA runtime / driver calls a step makes, by their name's start (torch.profiler names them as
#: the API does: cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync, cudaStreamSynchronize, ...)
CUDA_API_PREFIXES = ("cuda", "cu")


def api_split(events: list[Any]) -> dict[str, float]:
    """The host time of one profiled step by kind, from ``torch.profiler``'s averaged events.

    Parameters
    ----------
    events:
        ``profile.key_averages()``: one entry per event name with its count and own CPU time (us).

    Returns
    -------
    dict[str, float]
        ``api_ms``: own time of the CUDA runtime and driver calls; ``launches`` and
        ``launch_ms``: the kernel launches among them (names holding "LaunchKernel");
        ``aten_ops`` and ``aten_ms``: aten ops' count and own time (their dispatch and CPU work,
        the launches they make excluded)."""
    out = {"api_ms": 0.0, "launches": 0.0, "launch_ms": 0.0, "aten_ops": 0.0, "aten_ms": 0.0}
    for e in events:
        own_ms = e.self_cpu_time_total / 1e3
        if e.key.startswith(CUDA_API_PREFIXES):
            out["api_ms"] += own_ms
            if "LaunchKernel" in e.key:
                out["launches"] += e.count
                out["launch_ms"] += own_ms
        elif e.key.startswith("aten::"):
            out["aten_ops"] += e.count
            out["aten_ms"] += own_ms
    return out


def torch_profile_text(step: Callable[[], Any], title: str, top: int, reps: int = 5, model: Any = None) -> str:
    """One step of ``step`` under ``torch.profiler``: the split of its host time and its events
    by own host time.

    Parameters
    ----------
    step, title, reps, model:
        As :func:`profile_text`.
    top:
        Events listed.

    Returns
    -------
    str
        The title line, the split line and the table."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if common.DEVICE == "cuda" else [])
    common.synchronize()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step()
        profiled_ms = (time.perf_counter() - t0) * 1e3
    common.synchronize()
    host, waited = host_ms(step, model, warmup=0, reps=reps)
    events = prof.key_averages()
    split = api_split(events)
    text = [f"## {title}: host ms (median of {reps}, unprofiled) {host:.2f}, of it at syncs {waited:.2f}",
            f"profiled step: host {profiled_ms:.2f} ms; CUDA API calls {split['api_ms']:.2f} ms, of it "
            f"{int(split['launches'])} kernel launches {split['launch_ms']:.2f} ms; {int(split['aten_ops'])} aten ops "
            f"{split['aten_ms']:.2f} ms own time; the rest (Python, Triton's launcher, autograd) "
            f"{profiled_ms - split['api_ms'] - split['aten_ms']:.2f} ms",
            "### by own host time",
            events.table(sort_by="self_cpu_time_total", row_limit=top)]
    return "\n".join(text)


def count_text(step: Callable[[], Any], title: str, top: int, launches: Optional[Counter] = None) -> str:
    """One step of ``step`` counted (``--cpu-stub``: the GPU's paths on the CPU, its work stubbed).
    No time is given: the aten ops run on the CPU at these shapes, so this CPU's step time holds
    their arithmetic, not just the host's work.

    Parameters
    ----------
    step, title:
        As :func:`profile_text`.
    top:
        Aten ops listed.
    launches:
        The counter the stubs count their launches in (``stub_gpu_paths``).

    Returns
    -------
    str
        The title line, a line of counts and the aten ops by count."""
    launches = Counter() if launches is None else launches
    ops = OpCounter()
    launches.clear()
    with ops:
        step()
    stubbed = dict(launches)  # the counted step's own
    calls = python_calls(step)
    by_kernel = ", ".join(f"{k} {v}" for k, v in sorted(stubbed.items(), key=lambda kv: (-kv[1], kv[0])))
    rows = "\n".join(f"| {name} | {n} |" for name, n in ops.ops.most_common(top))
    return "\n".join([f"## {title}: counted on the CPU, the GPU's work stubbed",
                      f"one step: {calls} Python calls, {sum(ops.ops.values())} aten ops, "
                      f"{sum(stubbed.values())} launches stubbed ({by_kernel or 'none'})",
                      "### aten ops by count", "| op | calls |", "|---|---:|", rows])


def main(argv: Optional[list[str]] = None) -> None:
    """Profile the rows named by ``--variants`` (bench_moe's names) at ``--experts``.

    Raises
    ------
    SystemExit
        ``--experts`` is no bench_moe config, or a name in ``--variants`` is no row.
    """
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=64, help="the bench_moe config with this many experts")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="'|'-separated row names (bench_moe's)")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3, help="steps run before the profiled one")
    p.add_argument("--top", type=int, default=40, help="functions listed per table")
    p.add_argument("--reps", type=int, default=5, help="unprofiled steps timed for the host ms (their median)")
    p.add_argument("--out", type=Path, default=None, help="also write the profiles here")
    p.add_argument("--quick", action="store_true", help="bench_moe --quick's small shapes (a CPU check)")
    p.add_argument("--torch-profiler", action="store_true", help="torch.profiler instead of cProfile: the host "
                   "time split into CUDA API calls (launches, copies, syncs), aten ops and the rest")
    p.add_argument("--cpu-stub", action="store_true", help="no GPU: the rows on the CPU along the GPU's paths, "
                   "its work stubbed, at --quick's shapes; one step's Python calls, aten ops and launches "
                   "(by kernel) counted")
    args = p.parse_args(argv)
    if args.reps < 1 or args.warmup < 0 or args.top < 1 or args.micro_batches < 1:
        p.error(f"--reps {args.reps}, --top {args.top}, --micro-batches {args.micro_batches} must be >= 1 and "
                f"--warmup {args.warmup} >= 0")
    if args.cpu_stub and args.torch_profiler:
        p.error("--cpu-stub counts the step instead of profiling it: leave out --torch-profiler")
    launches: Counter = Counter()
    if args.cpu_stub:  # this process only: a measuring switch
        common.DEVICE = "cpu"
        stub_gpu_paths(launches=launches)
        args.quick = True  # the CPU runs the routing's real ops: the full shapes would time those
    common.require_cuda()
    configs, (tokens, hidden) = (QUICK_CONFIGS, QUICK_SHAPE) if args.quick else (CONFIGS, (TOKENS, HIDDEN))
    ffn = dict(configs).get(args.experts)
    if ffn is None:
        p.error(f"--experts {args.experts}: the configs have {', '.join(str(e) for e, _ in configs)} experts")
    names = args.variants.split("|")
    base, hf, x, dy = moe_layer(args.experts, ffn, tokens, hidden)
    schedule = RoutingSchedule(tokens, args.experts, args.micro_batches, skew=ROUTING_SKEW)
    try:
        rows = variants_of(base, hf, [n for n in names if n not in BASELINES], False, "inductor")
    except ValueError as err:
        p.error(str(err))
    texts = [f"# {args.experts} experts, ffn {ffn}, {tokens} tokens, {args.micro_batches} micro-batches; "
             f"{common.environment()}"]
    # with the kernels stubbed: the copies the GPU's kernels write (bench_moe_overhead's main)
    with hybridfp.policy(decoded_copies="always") if args.cpu_stub else nullcontext():
        for name, build, ctx in rows:
            if name not in names:
                continue
            core = Step(build(), x, dy, ctx, args.micro_batches, schedule)
            step = wrap(name, core)
            for _ in range(args.warmup):
                step()
            if args.cpu_stub:
                texts.append(count_text(step, name, args.top, launches))
            else:
                profiler = torch_profile_text if args.torch_profiler else profile_text
                texts.append(profiler(step, name, args.top, args.reps, core.model))
            core.release()
            print("\n".join(texts[-1].splitlines()[:2 if args.cpu_stub else 1]), flush=True)
    report = "\n\n".join(texts)
    if args.out is not None:
        args.out.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
