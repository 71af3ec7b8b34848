"""Bandwidth of the Triton quantize kernels (hybridfp/kernels) against a device copy.

Input: BF16 [16384, 4096] by default (``--shape``; random normal values with a per-row
magnitude spread). At that size one call's GPU time is close to the Python / launch overhead
of ``q.encode`` (tens of microseconds), so kernel bandwidth is measured at a larger shape
(e.g. ``--shape 32768 8192``, 512 MiB) where the GPU, not the host, is the bottleneck. Each
quantizer configuration's ``q.encode(x, rowwise, columnwise)`` (the registered kernel, all its
launches and allocations) is timed against ``dst.copy_(src)`` of the same bytes
(``common.copy_step``) with ``bench.protocol.paired_ratio``: the median of per-round ratios
copy time / encode time, with its ≥ 95 % interval, is the fraction of copy bandwidth reached.
Bytes: "min" = input read once + payloads written (the least any implementation moves; the
copy moves these); "moved" adds one more input read for the two-pass kernels (current scaling,
NVFP4: an amax pass, then the cast pass): its fraction is the min one times moved / min.
Stochastic rounding draws its random numbers inside the kernel (Philox,
hybridfp/kernels/triton_sr.py): no extra traffic.

Every case's output is checked first (``check_encode``): the storage ``q.encode`` writes equals
``q.reference_encode``'s (the PyTorch reference) bit for bit, codes and scales; stochastic
rounding draws another random stream in the reference, so there each copy's decode is within
``common.quantize_error_bound`` of the reference's instead. A case that fails its check fails
the run.

Fused hybrids (``HYBRID_CASES``): ``q.encode`` (the fused kernel) paired against the same hybrid
quantized child by child (``q.reference_encode``: each child's own kernel, one more input read)
and against the slower of its single-format quantizes (target: fused <= 1.10x its time, i.e. a
paired ratio >= 1 / 1.10). A single-format case it needs that was not measured fails the run
by name (``MissingBaselineError``).

    python -m bench.bench_quantize_kernels [--out results.json] [--quick] [--shape M N] [--dtype bfloat16]
        [--rounds N] [--samples N]
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from bench import common
from bench.common import (AccuracyError, MissingBaselineError, copy_step, environment, finish, md_table, parser,
                          protocol_from, protocol_record, quantize_error_bound, rel_error, require_baseline,
                          require_cuda)
from bench.protocol import Protocol, paired_ratio
from hybridfp.quantizers import (Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer,
                                 HybridQuantizer, MXFP8Quantizer, NVFP4Quantizer, Quantizer)
from hybridfp.quantizers.backends import select_quantize_kernel
from hybridfp.tensors import QuantizedStorage

E4M3 = torch.float8_e4m3fn
SHAPE = (16384, 4096)
#: fused / slower single-format quantize time at most this (paired ratio >= 1 / it)
FUSED_TARGET = 1.10
CASES = [  # name, factory, rowwise, columnwise, passes over the input
    ("fp8 current row+col", lambda: Float8CurrentScalingQuantizer(), True, True, 2),
    ("fp8 current row", lambda: Float8CurrentScalingQuantizer(), True, False, 2),
    ("fp8 delayed row+col", lambda: Float8Quantizer(), True, True, 1),
    ("fp8 block 1x128 row+col", lambda: Float8BlockQuantizer(block_scaling_dim=1), True, True, 1),
    ("fp8 block 1x128 row", lambda: Float8BlockQuantizer(block_scaling_dim=1), True, False, 1),
    ("fp8 block 128x128 row+col", lambda: Float8BlockQuantizer(block_scaling_dim=2), True, True, 1),
    ("mxfp8 row+col", lambda: MXFP8Quantizer(), True, True, 1),
    ("mxfp8 row", lambda: MXFP8Quantizer(), True, False, 1),
    ("mxfp8 col", lambda: MXFP8Quantizer(), False, True, 1),
    ("mxfp8 2d row+col", lambda: MXFP8Quantizer(with_2d_quantization=True), True, True, 1),
    ("nvfp4 row+col", lambda: NVFP4Quantizer(), True, True, 2),
    ("nvfp4 row", lambda: NVFP4Quantizer(), True, False, 2),
    ("nvfp4 rht row+col", lambda: NVFP4Quantizer(with_rht=True), True, True, 2),
    ("nvfp4 rht col", lambda: NVFP4Quantizer(with_rht=True), False, True, 2),
    ("nvfp4 2d row+col", lambda: NVFP4Quantizer(with_2d_quantization=True), True, True, 2),
    ("nvfp4 grad (rht+sr) row+col", lambda: NVFP4Quantizer(with_rht=True, stochastic_rounding=True), True, True, 2),
    ("nvfp4 grad (rht+sr) col", lambda: NVFP4Quantizer(with_rht=True, stochastic_rounding=True), False, True, 2),
    ("nvfp4 sr row", lambda: NVFP4Quantizer(stochastic_rounding=True), True, False, 2),
    ("fp8 block 1x128 col", lambda: Float8BlockQuantizer(block_scaling_dim=1), False, True, 1),
    ("nvfp4 row-scaled row", lambda: NVFP4Quantizer(row_scaled_nvfp4=True), True, False, 2),
]
RD = "rowwise_dequantized"
#: name, factory, rowwise, columnwise, passes, the single-format cases it must stay within 1.10x of.
HYBRID_CASES = [
    ("hybrid fp8 current row + fp8 block col",
     lambda: HybridQuantizer(Float8CurrentScalingQuantizer(), Float8BlockQuantizer(block_scaling_dim=1)),
     True, True, 2, ("fp8 current row", "fp8 block 1x128 col")),
    ("hybrid nvfp4 row + mxfp8 col (rd)", lambda: HybridQuantizer(NVFP4Quantizer(), MXFP8Quantizer(), RD),
     True, True, 2, ("nvfp4 row", "mxfp8 col")),
    ("hybrid nvfp4 row-scaled + mxfp8 col (rd)",
     lambda: HybridQuantizer(NVFP4Quantizer(row_scaled_nvfp4=True), MXFP8Quantizer(), RD),
     True, True, 2, ("nvfp4 row-scaled row", "mxfp8 col")),
    ("hybrid nvfp4 row + mxfp8 col (orig)", lambda: HybridQuantizer(NVFP4Quantizer(), MXFP8Quantizer()),
     True, True, 2, ("nvfp4 row", "mxfp8 col")),
    ("hybrid nvfp4 -> mxfp8 col only (rd)", lambda: HybridQuantizer(NVFP4Quantizer(), MXFP8Quantizer(), RD),
     False, True, 2, ("nvfp4 row", "mxfp8 col")),
    ("hybrid mxfp8 row + nvfp4 rht col", lambda: HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(with_rht=True)),
     True, True, 2, ("mxfp8 row", "nvfp4 rht col")),
]


#: element format of a quantizer's elements (``common.MANTISSA_BITS`` keys) by its ``dtype``
_FORMAT_OF_DTYPE = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2", torch.bfloat16: "bf16"}


def element_formats(q: Quantizer, direction: str) -> tuple[str, ...]:
    """The formats one copy's values are rounded to, in turn: one, or two for a hybrid's
    columnwise copy made from its rowwise decode (``rowwise_dequantized``); none for a copy that
    is the input itself (Identity)."""
    if isinstance(q, HybridQuantizer):
        if direction == "rowwise":
            return element_formats(q.rowwise_quantizer, "rowwise")
        first = element_formats(q.rowwise_quantizer, "rowwise") if q.columnwise_source == "rowwise_dequantized" else ()
        return first + element_formats(q.columnwise_quantizer, "columnwise")
    if isinstance(q, NVFP4Quantizer):
        return ("e2m1",)
    dtype = getattr(q, "dtype", None)
    return (_FORMAT_OF_DTYPE[dtype],) if dtype in _FORMAT_OF_DTYPE else ()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def check_encode(what: str, q: Quantizer, x: torch.Tensor, rowwise: bool, columnwise: bool,
                 seed: int = 1234) -> QuantizedStorage:
    """``q.encode``'s storage against ``q.reference_encode``'s (on a copy of ``q``, so a stateful
    quantizer starts from the same state; one seed for both): bit for bit, every payload tensor
    of every copy; with stochastic rounding (another random stream in the reference) each copy's
    decode within ``quantize_error_bound(f, f, ...)`` of the reference's. Returns the storage.

    Raises ``AccuracyError`` naming ``what``, the copy and the payload that differ."""
    want = q.copy().reference_encode(x, rowwise, columnwise, seed)
    got = q.encode(x, rowwise, columnwise, seed)
    for d in want.directions():
        if d not in got.directions():
            raise AccuracyError(f"{what}: q.encode wrote no {d} copy (the reference holds one)")
        if q.uses_randomness():
            fmts = element_formats(q, d)
            bound = quantize_error_bound(*(fmts + fmts)) if fmts else 0.0
            err = rel_error(got.decode(d), want.decode(d))
            if not err <= bound:
                raise AccuracyError(f"{what}: {d} decode differs from the reference quantizer's by a relative "
                                    f"error {err:.4g}, beyond two independent roundings to {'/'.join(fmts)} "
                                    f"({bound:.4g}, common.quantize_error_bound)")
            continue
        gp, wp = got.payload(d), want.payload(d)
        for name, ref in wp.items():
            out = gp.get(name)
            if out is None or out.shape != ref.shape or out.dtype != ref.dtype or not torch.equal(_bits(out), _bits(ref)):
                found = "missing" if out is None else f"{tuple(out.shape)} {out.dtype}"
                raise AccuracyError(f"{what}: {d}[{name}] differs from the reference quantizer's bit for bit "
                                    f"(got {found}, reference {tuple(ref.shape)} {ref.dtype}); the kernel is wrong")
    return got


def payload_bytes(storage: QuantizedStorage) -> int:
    """Bytes of the distinct payload tensors (a tensor both copies share counted once)."""
    return sum(t.nbytes for t in {id(t): t for t in storage.tensors()}.values())


def bandwidth_row(name: str, kernel: str, r: Any, min_bytes: int, passes: int, in_bytes: int) -> dict[str, Any]:
    """One case's row from its paired ratio against the copy of ``min_bytes``: ms, GB/s and the
    fraction of copy (paired, "min" bytes; "moved" scales it by moved / min)."""
    ms = r.candidate_ms
    moved = min_bytes + (passes - 1) * in_bytes
    scale = moved / min_bytes
    return dict(case=name, kernel=kernel, ms=ms, bytes_min=min_bytes, bytes_moved=moved,
                min_gbps=min_bytes / ms / 1e6, moved_gbps=moved / ms / 1e6, vs_copy=r.as_dict(),
                min_pct=100 * r.ratio, moved_pct=100 * r.ratio * scale)


def run_case(name: str, q: Quantizer, x: torch.Tensor, r: bool, c: bool, passes: int,
             protocol: Protocol) -> tuple[dict[str, Any], Callable[[], Any]]:
    """(row, the timed step) of one case: its output checked, then paired against the copy."""
    kernel = select_quantize_kernel(q, x, r, c)
    st = check_encode(name, q, x, r, c)
    mn = x.nbytes + payload_bytes(st)
    del st
    copy = require_baseline(f"quantize_kernels {name}", f"copy of {mn} bytes", lambda: copy_step(mn))
    step = lambda: q.encode(x, r, c)  # noqa: E731
    row = bandwidth_row(name, kernel.name if kernel else "REFERENCE", paired_ratio(copy, step, protocol),
                        mn, passes, x.nbytes)
    return row, step


def run_hybrid(x: torch.Tensor, singles: dict[str, tuple[float, Callable[[], Any]]],
               protocol: Protocol, failures: list[str]) -> list[dict[str, Any]]:
    """Fused hybrids: checked, vs the copy, vs child by child and vs the slower single-format
    quantize (``singles``: case -> (its encode ms, its step)). Raises ``MissingBaselineError``
    when a single-format case a hybrid needs was not measured."""
    out = []
    for name, make, r, c, passes, names in HYBRID_CASES:
        missing = [n for n in names if n not in singles]
        if missing:
            raise MissingBaselineError(f"quantize_kernels {name}: baseline single-format case(s) {missing} not "
                                       "measured (failed or left out); the fused / single ratio cannot be measured")
        q = make()
        try:
            row, fused = run_case(name, q, x, r, c, passes, protocol)
        except AccuracyError as e:
            failures.append(str(e))
            out.append(dict(case=name, error=str(e)))
            continue
        separate = require_baseline(f"quantize_kernels {name}", "child by child (q.reference_encode)",
                                    lambda: (lambda: q.reference_encode(x, r, c)))
        slower = max(names, key=lambda n: singles[n][0])
        sep = paired_ratio(separate, fused, protocol)
        single = paired_ratio(singles[slower][1], fused, protocol)
        row.update(kernel=row["kernel"] if row["kernel"] != "REFERENCE" else "SEPARATE", separate_ms=sep.baseline_ms,
                   vs_separate=sep.as_dict(), slower_single=slower, vs_slower_single=single.as_dict(),
                   vs_max_single=1.0 / single.ratio)
        out.append(row)
    return out


def _ci(p: Optional[dict[str, Any]]) -> str:
    """A paired ratio as "ratio [low, high]" ("" when absent)."""
    return f"{p['ratio']:.3f} [{p['low']:.3f}, {p['high']:.3f}]" if p else ""


def main(argv: Optional[list[str]] = None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=2, default=SHAPE)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="input dtype (FP32 master weights / activations take other kernel branches)")
    args = p.parse_args(argv)
    require_cuda()
    protocol = protocol_from(args)
    torch.manual_seed(0)
    dev = common.DEVICE
    shape = (2048, 4096) if args.quick else tuple(args.shape)
    x = (torch.randn(shape, device=dev) * torch.exp2(torch.randint(-4, 4, (shape[0], 1), device=dev))
         ).to(getattr(torch, args.dtype))
    env = environment()
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    singles: dict[str, tuple[float, Callable[[], Any]]] = {}
    for name, make, r, c, passes in CASES:
        try:
            row, step = run_case(name, make(), x, r, c, passes, protocol)
        except AccuracyError as e:
            failures.append(str(e))
            rows.append(dict(case=name, error=str(e)))
            continue
        rows.append(row)
        singles[name] = (row["ms"], step)
    try:
        rows += run_hybrid(x, singles, protocol, failures)
    except MissingBaselineError as e:
        failures.append(str(e))
    ok = [r for r in rows if "error" not in r]
    table = md_table(["case", "kernel", "ms", "GB/s (min)", "x copy (min) [interval]", "x copy (moved)",
                      "x child by child", "x slower single (target >= 0.91)"],
                     [(r["case"], r["kernel"], r["ms"], r["min_gbps"], _ci(r["vs_copy"]), r["moved_pct"] / 100,
                       _ci(r.get("vs_separate")), _ci(r.get("vs_slower_single"))) for r in ok]
                     + [(r["case"], "FAILED", r["error"]) + ("",) * 5 for r in rows if "error" in r])
    md = (f"### Quantize kernels, {args.dtype} input {list(shape)} (q.encode; paired ratios)\n\n"
          "x copy: median over {0} alternating rounds ({1} calls a side each) of the time of a device copy of "
          "the same bytes (\"min\": input read once + payloads written) / the encode's time, [≥ 95 % interval]: "
          "the fraction of copy bandwidth. x copy (moved): the same with one more input read for two-pass "
          "kernels. Fused hybrids: x child by child = separate time / fused time; x slower single = the slower "
          "single-format quantize's time / fused time (fused <= 1.10x its time: >= 0.91). Every output equals "
          "the reference quantizer's bit for bit (stochastic rounding: within its format's bound)."
          .format(protocol.rounds, protocol.samples)
          + ("" if protocol.reportable else " NOT REPORTABLE (fewer than 10 rounds or samples).") + "\n\n"
          + table + "\n")
    finish("quantize_kernels", {"env": env, "protocol": protocol_record(protocol), "shape": list(shape),
                                "dtype": args.dtype, "rows": rows, "failures": failures, "markdown": md}, args.out)
    if failures:
        raise SystemExit("quantize_kernels failed:\n" + "\n".join(failures))


if __name__ == "__main__":
    main()
