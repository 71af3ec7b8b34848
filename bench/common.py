"""What every benchmark shares: timing, the copy-bandwidth baseline, accuracy bounds,
environment, results.

Each benchmark runs in one process and measures its baselines in that process, so ratios
compare like with like. Every reported ratio is a paired one (``bench.protocol.paired_ratio``);
single times are medians of ``triton.testing.do_bench`` (CUDA events, L2 flushed between runs,
warm-up excluded). Each benchmark checks the error of what it times against an FP32 reference
(``error_bound`` / ``check_error``) and fails when a baseline it needs is missing
(``MissingBaselineError``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import platform
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
#: Where benchmarks allocate; "cpu" only for a smoke test of the scripts themselves.
DEVICE = "cuda"


def environment() -> dict[str, Any]:
    """Date, GPU, library versions and the repository commit (when git is there)."""
    import triton

    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                   gpu_memory_gib=round(p.total_memory / 2**30, 1), **driver_and_power_limit())
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True, cwd=Path(__file__).parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["commit"] = None
    # A copy of the tree without (or with a stale) .git: HYBRIDFP_COMMIT names the commit.
    env["commit"] = os.environ.get("HYBRIDFP_COMMIT") or env["commit"]
    return env


def driver_and_power_limit(run: Callable[..., Any] = subprocess.run) -> dict[str, Any]:
    """The NVIDIA driver version and the enforced power limit (W) of the GPU torch uses, from
    ``nvidia-smi`` (a ratio measured at the cap depends on both); each None where nvidia-smi is
    absent or cannot say. ``run``: how to call it (tests pass a fake)."""
    from bench.protocol import smi_device  # (protocol imports this module)

    out: dict[str, Any] = {"driver": None, "power_limit_w": None}
    try:
        text = run(["nvidia-smi", "--query-gpu=driver_version,enforced.power.limit", "--format=csv,noheader,nounits",
                    "-i", smi_device()], capture_output=True, text=True, timeout=10).stdout
        driver, limit = (v.strip() for v in text.strip().splitlines()[0].split(","))
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return out
    out["driver"] = driver or None
    try:
        out["power_limit_w"] = float(limit)
    except ValueError:  # "[N/A]" on some boards
        pass
    return out


def bench_ms(fn: Callable[[], Any], warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds of ``fn`` on the GPU (triton.testing.do_bench)."""
    if DEVICE == "cpu":  # smoke test of the scripts: one timed call
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def synchronize() -> None:
    """Wait for the GPU's queued work (``torch.cuda.synchronize``); nothing on the CPU."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def host_ms(step: Callable[[], Any], model: Any = None, warmup: int = 3, reps: int = 5) -> tuple[float, float]:
    """(host ms, of which waiting at the routing's syncs) of one step started on an idle GPU: the
    call with the median host time of ``reps`` after ``warmup``, both figures from that call.
    The waits are what ``model``'s ``SyncClock`` (its ``sync``; none: no sync) adds during the
    call: at each micro-batch's sync the host waits for the GPU to finish the micro-batches
    before, so host ms minus the wait is the host's own work (Python, launches), the figure to
    compare with the step's device time. A launch that blocks because CUDA's launch queue is full
    also waits for the GPU and is not counted as a wait (from an idle GPU that takes some
    hundreds of queued launches).

    Parameters
    ----------
    step:
        One training step (``Step``, maybe under a variant's switches).
    model:
        The layer the step runs (``torch.compile``'s wrapper forwards ``sync`` to it; an MoE
        layer of ``bench.moe_layer``), or None: no routing sync.
    warmup:
        Calls run first, untimed.
    reps:
        Calls timed, each started on an idle GPU.

    Returns
    -------
    tuple[float, float]
        The host ms and the ms of it spent reading the routing's counts (on the CPU only the
        read itself: nothing is queued)."""
    clock = getattr(model, "sync", None)
    waits = (lambda: clock.seconds) if clock is not None else (lambda: 0.0)
    for _ in range(warmup):
        step()
    calls = []
    for _ in range(reps):
        synchronize()
        waited, t0 = waits(), time.perf_counter()
        step()
        calls.append(((time.perf_counter() - t0) * 1e3, (waits() - waited) * 1e3))
        synchronize()
    return sorted(calls)[len(calls) // 2]


def bench_ms_steady(fn: Callable[[], Any], steps: int = 20, warmup: int = 3,
                    host_reps: int = 5) -> tuple[float, float]:
    """(GPU ms per call, host ms per call). GPU ms: ``steps`` back-to-back calls, as a training
    loop runs them: one CUDA event before the first and one after the last, no synchronization
    or cache flush in between, so the host may run ahead of the GPU (``do_bench`` flushes the
    L2 before each call). Host ms: the median time one call takes to return when it starts on
    an idle GPU (synchronized before each of ``host_reps`` calls). It is not taken from the
    back-to-back calls: once the host is some hundred launches ahead, CUDA's launch queue is
    full and every launch waits for the GPU, so their host time approaches the GPU time for
    any step with many kernels. Host ms above GPU ms means host-bound."""
    if DEVICE == "cpu":
        ms = bench_ms(fn)
        return ms, ms
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps, host_ms(fn, warmup=0, reps=host_reps)[0]


def bench_pair(a: Callable[[], Any], b: Callable[[], Any], rounds: int = 3) -> tuple[float, float]:
    """(median ms of ``a``, median ms of ``b``) over ``rounds`` alternate ``bench_ms`` calls.
    Their quotient is a ratio of medians, not a paired ratio: a reported ratio comes from
    ``bench.protocol.paired_ratio`` (median of per-round ratios, with its interval)."""
    ta, tb = [], []
    for _ in range(rounds):
        ta.append(bench_ms(a))
        tb.append(bench_ms(b))
    return sorted(ta)[rounds // 2], sorted(tb)[rounds // 2]


def copy_bandwidth(nbytes: int = 1 << 30) -> dict[str, float]:
    """Device-to-device copy of ``nbytes``: GB/s counting bytes read plus bytes written (1 MiB on
    the CPU smoke path)."""
    if DEVICE == "cpu":
        nbytes = min(nbytes, 1 << 20)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return {"bytes": 2 * nbytes, "ms": ms, "GBps": 2 * nbytes / ms / 1e6}


def copy_step(nbytes: int) -> Callable[[], Any]:
    """``dst.copy_(src)`` moving ``nbytes`` (half read, half written; ``copy_bandwidth``'s copy):
    the baseline of a paired ratio for a kernel that moves ``nbytes``, so the ratio is the
    fraction of copy bandwidth it reaches (the same bytes counted on both sides).

    Raises
    ------
    ValueError
        ``nbytes`` below 2 (no byte would move).

    Example
    -------
    >>> copy_step(1)
    Traceback (most recent call last):
    ...
    ValueError: copy_step: nbytes (1) must be >= 2 (half read, half written)
    """
    if nbytes < 2:
        raise ValueError(f"copy_step: nbytes ({nbytes}) must be >= 2 (half read, half written)")
    src = torch.randint(0, 255, (nbytes // 2,), dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def require_baseline(where: str, name: str, make: Callable[[], Callable[[], Any]]) -> Callable[[], Any]:
    """The baseline step ``make()`` builds, called once; ``MissingBaselineError`` naming ``where``
    and ``name`` when building or calling it fails (its ratios cannot be measured).

    Example
    -------
    >>> require_baseline("bench_x", "copy", lambda: (lambda: 1))()
    1
    """
    try:
        step = make()
        step()
    except Exception as e:  # noqa: BLE001 - any failure means the baseline is missing: say which
        raise MissingBaselineError(f"{where}: baseline {name!r} failed: {type(e).__name__}: {str(e)[:200]}; "
                                   "the ratios against it cannot be measured") from e
    return step


def tflops(flops: float, ms: float) -> float:
    """TFLOP/s of ``flops`` done in ``ms`` milliseconds."""
    return flops / ms / 1e9


def md_table(headers: list[str], rows: Iterable[Iterable[Any]]) -> str:
    """A Markdown table; floats with 4 significant digits, text on one line."""
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        text = "" if v is None else " ".join(str(v).split())  # one line: errors can span several
        return text.replace("|", "/")[:160]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def parser(description: str) -> argparse.ArgumentParser:
    """The arguments every benchmark takes (``protocol_from`` reads the timing ones)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", type=Path, default=None, help="write the results JSON here")
    p.add_argument("--quick", action="store_true", help="smaller sizes (a smoke test)")
    p.add_argument("--rounds", type=int, default=None,
                   help="A/B rounds per paired ratio (default 10; --quick 3; < 10 is not reportable)")
    p.add_argument("--samples", type=int, default=None,
                   help="timed calls per side per round (default 10; --quick 2)")
    return p


def protocol_from(args: argparse.Namespace) -> Any:
    """The ``bench.protocol.Protocol`` the arguments ask for (smaller under ``--quick``)."""
    from bench.protocol import Protocol
    quick = getattr(args, "quick", False)
    rounds = args.rounds if args.rounds is not None else (3 if quick else Protocol.rounds)
    samples = args.samples if args.samples is not None else (2 if quick else Protocol.samples)
    return Protocol(rounds=rounds, samples=samples, warmup=1 if quick else Protocol.warmup)


def protocol_record(protocol: Any) -> dict[str, Any]:
    """The protocol's fields for a results JSON, with whether its figures may be reported."""
    return {"rounds": protocol.rounds, "samples": protocol.samples, "warmup": protocol.warmup,
            "flush_l2": protocol.flush_l2, "reportable": protocol.reportable}


# ---------------------------------------------------------------- accuracy bounds
#: mantissa bits of each element format (docs/numerics.md); a value rounded to the format has a
#: relative error of at most u = 2^-(bits + 1) (its normal range; block scales keep the
#: elements there but for the smallest of a block)
MANTISSA_BITS = {"fp32": 23, "bf16": 7, "e4m3": 3, "e5m2": 2, "e2m1": 1}
#: slack for BF16 outputs and activations between GEMMs (a few roundings of 2^-9 each)
BF16_SLACK = 2.0 ** -7


class AccuracyError(RuntimeError):
    """A benchmarked variant's result is further from the FP32 reference than its format allows."""


class MissingBaselineError(RuntimeError):
    """A baseline a reported ratio needs was not measured (not importable, failed, out of time)."""


def unit_roundoff(fmt: str) -> float:
    """2^-(mantissa bits + 1) of ``fmt`` (a ``MANTISSA_BITS`` key)."""
    if fmt not in MANTISSA_BITS:
        raise ValueError(f"unit_roundoff: unknown element format {fmt!r}; one of {sorted(MANTISSA_BITS)}")
    return 2.0 ** -(MANTISSA_BITS[fmt] + 1)


def error_bound(fwd: str, bwd: str, fwd_gemms: int, bwd_gemms: int) -> float:
    """Bound on the relative Frobenius error (vs FP32) of a tensor computed through
    ``fwd_gemms`` forward GEMMs (both operands in ``fwd``) and ``bwd_gemms`` backward GEMMs (one
    operand in ``fwd``'s or ``bwd``'s format, the other in ``bwd``).

    Rounding to a format with unit roundoff u gives a relative error of rms at most
    sigma = u / sqrt(3) (uniform in +-u); a GEMM of independently rounded operands has a relative
    error of rms sqrt(sigma_a^2 + sigma_b^2), and independent GEMM errors add in quadrature. The
    bound is twice that rms, plus ``BF16_SLACK``:
    ``2 sqrt(fwd_gemms 2 sigma_f^2 + bwd_gemms (sigma_f^2 + sigma_b^2)) + 2^-7``. One E4M3 GEMM:
    0.10; one E2M1 (NVFP4) GEMM: 0.41; a wrong result (zeros, a wrong scale) is off by >= 1.
    """
    sf, sb = unit_roundoff(fwd) / 3 ** 0.5, unit_roundoff(bwd) / 3 ** 0.5
    return 2 * (fwd_gemms * 2 * sf ** 2 + bwd_gemms * (sf ** 2 + sb ** 2)) ** 0.5 + BF16_SLACK


def quantize_error_bound(*fmts: str) -> float:
    """Bound on the relative Frobenius error of a value rounded to each of ``fmts`` in turn (a
    quantized copy; a copy made from another's decode rounds twice): twice the rms of the chain,
    ``2 sqrt(sum sigma_f^2) + 2^-7`` with ``sigma_f = u_f / sqrt(3)`` (``error_bound``'s model).
    Two copies of one format with independent roundings (stochastic rounding's draws) differ by
    at most ``quantize_error_bound(f, f)``.

    Example
    -------
    >>> round(quantize_error_bound("e4m3"), 4)
    0.08
    """
    return 2 * sum((unit_roundoff(f) / 3 ** 0.5) ** 2 for f in fmts) ** 0.5 + BF16_SLACK


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ``||out - ref|| / ||ref||`` in FP32 (inf when ``ref`` is zero
    and ``out`` is not; NaN propagates)."""
    out, ref = out.detach().float(), ref.detach().float()
    if out.shape != ref.shape:
        raise ValueError(f"rel_error: result shape {tuple(out.shape)} differs from the reference's {tuple(ref.shape)}")
    den = ref.norm().item()
    num = (out - ref).norm().item()
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


#: largest |gain - 1| (``gain``) a correct result shows: rounding noise is unbiased, so it moves
#: the gain by ~ err / sqrt(elements) (measured on the CPU smoke sizes: <= 0.01 for every recipe,
#: NVFP4 with RHT and SR included); a dropped term of a sum of two (one branch of an MLP's dx)
#: moves it by ~0.5, one expert of eight by ~0.12, a 1.1x scale by 0.1
GAIN_TOLERANCE = 0.05


def gain(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Least-squares scale of ``out`` onto ``ref``, ``<out, ref> / <ref, ref>`` in FP32: 1 for a
    result that is the reference plus unbiased rounding noise, whatever the format's precision;
    a missing term or a wrong scale moves it (``check_result``). NaN when ``ref`` is zero.

    Example
    -------
    >>> r = torch.tensor([1.0, 2.0, 3.0])
    >>> gain(2 * r, r)
    2.0
    """
    out, ref = out.detach().float(), ref.detach().float()
    if out.shape != ref.shape:
        raise ValueError(f"gain: result shape {tuple(out.shape)} differs from the reference's {tuple(ref.shape)}")
    den = (ref * ref).sum().item()
    return (out * ref).sum().item() / den if den > 0 else float("nan")


def check_result(what: str, out: torch.Tensor, ref: torch.Tensor, bound: float) -> dict[str, float]:
    """``{"err": rel_error, "gain": gain}`` of ``out`` against the FP32 ``ref``; ``AccuracyError``
    naming ``what`` when the error is above ``bound`` or the gain is off 1 by more than
    ``GAIN_TOLERANCE``. The error bound alone is loose for 4-bit formats (NVFP4's is ~0.6: a dx
    missing one of its two branches is off by ~0.7); the gain is not, as rounding noise does
    not move it.

    Example
    -------
    >>> r = torch.linspace(1.0, 2.0, 64)
    >>> check_result("y", 0.5 * r, r, bound=0.6)
    Traceback (most recent call last):
    ...
    bench.common.AccuracyError: y: gain 0.5 (<result, reference> / <reference, reference>) is off 1 by more than 0.05: a term is missing or a scale is wrong
    """
    res = {"err": rel_error(out, ref), "gain": gain(out, ref)}
    failures = []
    for check, value, *rest in ((check_error, res["err"], bound), (check_gain, res["gain"])):
        try:
            check(what, value, *rest)
        except AccuracyError as e:
            failures.append(str(e))
    if failures:  # both said when both fail: the gain names a missing term, the error only its size
        raise AccuracyError("; ".join(failures))
    return res


def check_gain(what: str, g: float) -> None:
    """Raise ``AccuracyError`` naming ``what`` when ``g`` (``gain``) is off 1 by more than
    ``GAIN_TOLERANCE`` (or NaN)."""
    if not abs(g - 1) <= GAIN_TOLERANCE:
        raise AccuracyError(f"{what}: gain {g:.4g} (<result, reference> / <reference, reference>) is off 1 by more "
                            f"than {GAIN_TOLERANCE}: a term is missing or a scale is wrong")


def check_error(what: str, err: float, bound: float) -> None:
    """Raise ``AccuracyError`` naming ``what`` when ``err`` is above ``bound`` (or NaN)."""
    if not err <= bound:
        raise AccuracyError(f"{what}: relative error {err:.4g} vs the FP32 reference exceeds its bound "
                            f"{bound:.4g} (common.error_bound); the result is wrong, not just imprecise")


@contextlib.contextmanager
def ieee_fp32() -> Iterator[None]:
    """FP32 matmuls with FP32 products (no TF32 on CUDA, no reduced precision on oneDNN CPUs) for
    an FP32 reference, restored afterwards. torch's ``fp32_precision`` API: the legacy
    ``allow_tf32`` flag raises once TF32 was set through the new one.

    Example
    -------
    >>> with ieee_fp32():
    ...     torch.backends.cuda.matmul.fp32_precision
    'ieee'
    """
    from hybridfp.gemm.backends import _ieee_fp32  # the library's exact emulation uses the same setting

    with _ieee_fp32():
        yield


def finish(name: str, result: dict[str, Any], out: Optional[Path]) -> None:
    """Print the benchmark's Markdown and write its JSON (``out``; ``python -m bench`` reads it)."""
    result = {"name": name, **result}
    print(result.get("markdown", ""), flush=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, default=str))


def require_cuda() -> None:
    """Benchmarks need the GPU; say so plainly otherwise."""
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("bench: needs a CUDA GPU.")


#: ops that copy tensor data, listed by call stack with ``profile_step(stacks=True)``
COPY_OPS = ("aten::copy_", "aten::clone", "aten::cat", "aten::contiguous", "aten::_to_copy", "aten::index_put_")


def _copies_by_stack(prof: Any, depth: int = 8) -> str:
    """The copy ops of a profile (``COPY_OPS``) grouped by their Python call stack, by device time
    (CPU time without a GPU): which line of which file asked for each copy."""
    rows = []
    for ev in prof.key_averages(group_by_stack_n=depth):
        if ev.key in COPY_OPS:
            dev = getattr(ev, "device_time_total", 0.0) if DEVICE == "cuda" else ev.cpu_time_total
            rows.append((dev, ev.key, ev.count, [f for f in ev.stack if "torch/" not in f and "built-in" not in f]))
    rows.sort(key=lambda r: -r[0])
    lines = [f"- {key} x{n}: {dev / 1000:.3f} ms\n" + "".join(f"    {f}\n" for f in stack)
             for dev, key, n, stack in rows[:30]]
    return "\n### copies by call stack (device ms incl. children)\n" + "".join(lines)


def profile_step(step: Callable[[], Any], title: str, stacks: bool = False) -> str:
    """The kernels and ops of one step, by self device time (torch.profiler), as text;
    ``stacks``: also the copy ops by call stack (:func:`_copies_by_stack`)."""
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    # torch >= 2.11 records Python frames only with the verbose experimental config
    extra = {"with_stack": True, "experimental_config": torch._C._profiler._ExperimentalConfig(verbose=True)} \
        if stacks else {}
    with torch.profiler.profile(activities=acts, **extra) as prof:
        step()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if DEVICE == "cuda" else "self_cpu_time_total"
    avg = prof.key_averages()
    text = f"## {title}\n" + avg.table(sort_by=key, row_limit=25, max_name_column_width=70)
    if DEVICE == "cuda":  # host side too: runtime calls (launches, syncs, allocations) and ops
        text += "\n### by self CPU time\n" + avg.table(sort_by="self_cpu_time_total", row_limit=20,
                                                          max_name_column_width=70)
    if stacks:
        text += _copies_by_stack(prof)
    return text


def finish_rows(name: str, columns: list[tuple[str, str]], rows: list[dict[str, Any]], out: Optional[Path]) -> None:
    """``finish`` for a benchmark whose result is a list of row dicts: the table has one column
    per (header, key); a row that failed shows its ``error`` in place of its "ms"."""
    md = md_table([h for h, _ in columns],
                  [[r.get(k, r.get("error") if k == "ms" else None) for _, k in columns] for r in rows])
    finish(name, {"env": environment(), "rows": rows, "markdown": md}, out)


#: variant-name suffix of a recipe timed with its weight / grad_output copies kept as codes
CODES_SUFFIX = " [codes, decoded per GEMM]"


@contextlib.contextmanager
def decoded_mode(mode: str, inner: Any) -> Iterator[None]:
    """``inner`` (an autocast context) inside ``hybridfp.policy(decoded_copies=mode)`` (modules
    rebuild their quantizers when the mode changes)."""
    from hybridfp import policy
    with policy(decoded_copies=mode), inner:
        yield
