"""Quantize throughput: each quantizer's quantize() time and achieved bandwidth vs copy.

Input: a BF16 activation [16384, 4096] (Llama-3-8B hidden size, 16384 tokens). Bytes = the
input read once + the payloads written (``storage.nbytes()``): the least any implementation
moves. "x copy" is a paired ratio (``bench.protocol.paired_ratio``): the median over alternating
rounds of the time of ``dst.copy_(src)`` moving the same bytes (``common.copy_step``) / the
quantize's time, with its ≥ 95 % interval: how close a path is to a memory-bound kernel. Each
row says which path the quantize-kernel registry picked (a registered kernel, or the PyTorch
reference) per copy, and its output is checked first against the reference quantizer
(``bench_quantize_kernels.check_encode``: bit for bit; stochastic rounding within its format's
bound); a row that fails its check fails the run.

    python -m bench.bench_quantize [--out results.json] [--quick] [--rounds N] [--samples N]
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterator

import torch

from bench import common
from bench.bench_quantize_kernels import check_encode
from bench.common import (AccuracyError, MissingBaselineError, copy_bandwidth, copy_step, environment, finish, md_table, parser,
                          protocol_from, protocol_record, require_baseline, require_cuda)
from bench.protocol import Protocol, paired_ratio
from hybridfp.quantizers import (Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer,
                                 HybridQuantizer, IdentityQuantizer, MXFP8Quantizer, NVFP4Quantizer, Quantizer)
from hybridfp.quantizers.backends import select_quantize_kernel

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
QUANTIZERS: list[tuple[str, Callable[[], Quantizer]]] = [
    ("FP8 current E4M3", lambda: Float8CurrentScalingQuantizer(E4M3)),
    ("FP8 current E5M2", lambda: Float8CurrentScalingQuantizer(E5M2)),
    ("FP8 delayed E4M3", lambda: Float8Quantizer(E4M3)),
    ("FP8 block 1x128", lambda: Float8BlockQuantizer(E4M3, block_scaling_dim=1)),
    ("FP8 block 128x128", lambda: Float8BlockQuantizer(E4M3, block_scaling_dim=2)),
    ("MXFP8", lambda: MXFP8Quantizer()),
    ("NVFP4 1D", lambda: NVFP4Quantizer()),
    ("NVFP4 1D, RHT col", lambda: NVFP4Quantizer(with_rht=True)),
    ("NVFP4 grad (RHT col + SR)", lambda: NVFP4Quantizer(with_rht=True, stochastic_rounding=True)),
    ("NVFP4 2D", lambda: NVFP4Quantizer(with_2d_quantization=True)),
    ("Hybrid FP8 current / FP8 block 1x128",
     lambda: HybridQuantizer(Float8CurrentScalingQuantizer(E4M3), Float8BlockQuantizer(E4M3, block_scaling_dim=1))),
    ("Hybrid MXFP8 / NVFP4 RHT",
     lambda: HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(with_rht=True))),
    ("Hybrid MXFP8 / NVFP4 (rowwise_dequantized)",
     lambda: HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(), "rowwise_dequantized")),
    # The fused NVFP4-forward / MXFP8-backward pairs (per_gemm nvfp4/mxfp8 input, Composer-2
    # expert input and weight).
    ("Hybrid NVFP4 / MXFP8", lambda: HybridQuantizer(NVFP4Quantizer(), MXFP8Quantizer())),
    ("Hybrid NVFP4 / MXFP8 (rowwise_dequantized)",
     lambda: HybridQuantizer(NVFP4Quantizer(), MXFP8Quantizer(), "rowwise_dequantized")),
    ("Hybrid NVFP4 row-scaled / MXFP8 (rowwise_dequantized)",
     lambda: HybridQuantizer(NVFP4Quantizer(row_scaled_nvfp4=True), MXFP8Quantizer(), "rowwise_dequantized")),
    ("Hybrid Identity / MXFP8 (rowwise_dequantized)",
     lambda: HybridQuantizer(IdentityQuantizer(), MXFP8Quantizer(), "rowwise_dequantized")),
]
#: An Identity copy is the input itself (no bytes move): those rows would be meaningless.
SKIP = {("Hybrid Identity / MXFP8 (rowwise_dequantized)", "row")}
DIRECTIONS = [("row", True, False), ("col", False, True), ("row+col", True, True)]
#: the input's shape, full and --quick
SHAPE, QUICK_SHAPE = (16384, 4096), (2048, 4096)


def path_of(q: Quantizer, x: torch.Tensor, rowwise: bool, columnwise: bool) -> str:
    """Which implementation the registry picks: a kernel's name (a fused hybrid kernel's
    included) or 'reference', per child."""
    k = select_quantize_kernel(q, x, rowwise, columnwise)
    if k is not None:
        return k.name
    if isinstance(q, HybridQuantizer):
        parts = []
        if rowwise or (columnwise and q.columnwise_source == "rowwise_dequantized"):
            parts.append("row:" + path_of(q.rowwise_quantizer, x, True, False))
        if columnwise:
            parts.append("col:" + path_of(q.columnwise_quantizer, x, False, True))
        return " ".join(parts)
    return "reference"


def cases(name: str, make: Callable[[], Quantizer]) -> Iterator[tuple[str, bool, bool, Quantizer]]:
    """(copies, rowwise, columnwise, a fresh quantizer with that usage) of one QUANTIZERS row."""
    for dname, rowwise, columnwise in DIRECTIONS:
        if (name, dname) not in SKIP:
            q = make()
            q.set_usage(rowwise=rowwise, columnwise=columnwise)
            yield dname, rowwise, columnwise, q


def bench_one(name: str, make: Callable[[], Quantizer], x: torch.Tensor,
              protocol: Protocol = Protocol()) -> list[dict[str, Any]]:
    """One QUANTIZERS row's copies: each checked against the reference quantizer, then paired
    against a copy of the same bytes. A failed check is a row with ``error`` and ``check_failed``;
    any other exception a row with ``error`` (``main`` fails the run on either: every listed
    copy of every format is to run on this GPU).

    Raises ``MissingBaselineError`` when the copy baseline cannot run."""
    rows = []
    for dname, rowwise, columnwise, q in cases(name, make):
        what = f"quantize {name} {dname}"
        try:
            with torch.no_grad():
                st = check_encode(what, q, x, rowwise, columnwise)
                nbytes = x.numel() * x.element_size() + st.nbytes()
                del st
                copy = require_baseline(what, f"copy of {nbytes} bytes", lambda: copy_step(nbytes))
                r = paired_ratio(copy, lambda: q.quantize(x), protocol)
        except AccuracyError as e:
            rows.append({"quantizer": name, "directions": dname, "error": str(e), "check_failed": True})
            continue
        except MissingBaselineError:
            raise
        except Exception as e:  # noqa: BLE001 - a benchmark row records a failure and goes on
            rows.append({"quantizer": name, "directions": dname, "error": f"{type(e).__name__}: {e}"})
            continue
        ms = r.candidate_ms
        rows.append({"quantizer": name, "directions": dname, "path": path_of(q, x, rowwise, columnwise),
                     "ms": ms, "bytes": nbytes, "GBps": nbytes / ms / 1e6, "x_copy": r.ratio,
                     "vs_copy": r.as_dict()})
    return rows


def _ci(p: dict[str, Any]) -> str:
    return f"{p['ratio']:.3f} [{p['low']:.3f}, {p['high']:.3f}]"


def main(argv=None) -> None:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    require_cuda()
    protocol = protocol_from(args)
    warnings.simplefilter("ignore")  # the registry's "no fast kernel" notices; the path column says it
    env = environment()
    copy = copy_bandwidth()
    shape = QUICK_SHAPE if args.quick else SHAPE
    x = torch.randn(*shape, device=common.DEVICE, dtype=torch.bfloat16)
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    try:
        for name, make in QUANTIZERS:
            rows += bench_one(name, make, x, protocol)
    except MissingBaselineError as e:
        failures.append(str(e))
    failures += [r["error"] if r.get("check_failed") else f"quantize {r['quantizer']} {r['directions']}: {r['error']}"
                 for r in rows if "error" in r]
    table = md_table(["quantizer", "copies", "path", "ms", "GB/s", "x copy [interval]"], [
        (r["quantizer"], r["directions"], r.get("path", r.get("error")), r.get("ms"), r.get("GBps"),
         _ci(r["vs_copy"]) if "vs_copy" in r else None) for r in rows])
    md = (f"### Quantize, BF16 input {list(shape)} (paired ratios vs a copy of the same bytes)\n\n"
          f"Copy bandwidth (same process, do_bench median): {copy['GBps']:.0f} GB/s. Bytes = input read once + "
          f"payloads written. x copy: median over {protocol.rounds} alternating rounds ({protocol.samples} calls a "
          "side each) of copy time / quantize time, [≥ 95 % interval]. Every output equals the reference "
          "quantizer's bit for bit (stochastic rounding: within its format's bound)."
          + ("" if protocol.reportable else " NOT REPORTABLE (fewer than 10 rounds or samples).")
          + "\n\n" + table + "\n")
    finish("quantize", {"env": env, "protocol": protocol_record(protocol), "copy_bandwidth": copy,
                        "shape": list(shape), "rows": rows, "failures": failures, "markdown": md}, args.out)
    if failures:
        raise SystemExit("quantize failed:\n" + "\n".join(failures))


if __name__ == "__main__":
    main()
