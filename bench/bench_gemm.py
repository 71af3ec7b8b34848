"""GEMM throughput: hybridfp.gemm (FP8 per-tensor, FP8 block) vs raw torch._scaled_mm and BF16.

Shapes: 4096^3 and 8192^3 (fprop layout), and the three GEMMs of a Llama-3-8B MLP up
projection (16384 tokens, 4096 -> 14336): fprop TN [16384,14336,4096], dgrad NN
[16384,4096,14336], wgrad NT [14336,4096,16384] (m, n, k). Operands are quantized by the
library's quantizers (E4M3 forward, E5M2 gradients for per-tensor; E4M3 1x128 / 128x128
blocks); "raw" calls torch._scaled_mm on the same stored tensors with the scale layouts
prepared beforehand and the same accumulation mode, so hybridfp/raw is the cost of dispatch
(and of laying out block scales per call). Every ratio is paired
(``bench.protocol.paired_ratio``: median over alternating rounds of raw time / hybridfp time,
with its ≥ 95 % interval); rows below ``TARGET`` are marked in the table. The BF16 TFLOP/s are
one unpaired ``do_bench`` median (context, not a ratio). hybridfp's output must equal raw
``torch._scaled_mm``'s bit for bit (the same stored operands and accumulation): a shape where it
does not fails the run (non-zero exit, after the results are written).

    python -m bench.bench_gemm [--out results.json] [--quick] [--rounds N] [--samples N]
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from bench import common
from bench.common import (bench_ms, copy_bandwidth, environment, finish, md_table, parser, protocol_from,
                          protocol_record, require_cuda, tflops)
from bench.protocol import PairedRatio, Protocol, paired_ratio
from hybridfp.gemm import gemm, operand_storage, select
from hybridfp.gemm.gemm import LAYOUTS
from hybridfp.kernels import cublas_fp8
from hybridfp.quantizers import Float8BlockQuantizer, Float8CurrentScalingQuantizer
from hybridfp.tensors.storage import COLUMNWISE, ROWWISE

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SHAPES = [  # name, m, n, k, layout
    ("4096^3 fprop", 4096, 4096, 4096, "TN"),
    ("8192^3 fprop", 8192, 8192, 8192, "TN"),
    ("llama3-8b up fprop", 16384, 14336, 4096, "TN"),
    ("llama3-8b up dgrad", 16384, 4096, 14336, "NN"),
    ("llama3-8b up wgrad", 14336, 4096, 16384, "NT"),
]
QUICK_SHAPES = [("2048^3 fprop", 2048, 2048, 2048, "TN"), ("1024x2048x4096 wgrad", 1024, 2048, 4096, "NT")]
# Operand formats per layout: (A quantizer, B quantizer) as the recipes make them.
TENSORWISE = {"TN": (E4M3, E4M3), "NN": (E5M2, E4M3), "NT": (E5M2, E4M3)}
BLOCK_DIMS = {"TN": (1, 2), "NN": (1, 2), "NT": (1, 1)}
#: hybridfp.gemm / raw torch._scaled_mm below this is marked: dispatch should cost < 3 %
TARGET = 0.97


def marked(ratio: dict[str, Any]) -> str:
    """A paired ratio (``PairedRatio.as_dict``) as "ratio [low, high]", marked below ``TARGET``.

    Example: ``marked({"ratio": 0.955, "low": 0.95, "high": 0.96})`` ends in "below 0.97 target"."""
    text = f"{ratio['ratio']:.3f} [{ratio['low']:.3f}, {ratio['high']:.3f}]"
    return text + (f" **below {TARGET} target**" if ratio["ratio"] < TARGET else "")


def _record(row: dict[str, Any], key: str, flops: float, r: PairedRatio) -> None:
    """A paired raw-vs-hybridfp measurement into ``row``: TFLOP/s of each side and the ratio."""
    row[f"{key}_raw"], row[f"{key}_hybridfp"] = tflops(flops, r.baseline_ms), tflops(flops, r.candidate_ms)
    row[f"{key}_paired"] = r.as_dict()
    row[f"{key}_ratio"] = r.ratio


def _operands(layout: str, qa, qb, m: int, n: int, k: int):
    """Quantized A, B whose ``layout`` copies are [m, k] and [n, k]."""
    da, db = LAYOUTS[layout]
    src_a = torch.randn(*((m, k) if da == ROWWISE else (k, m)), device=common.DEVICE, dtype=torch.bfloat16)
    src_b = torch.randn(*((n, k) if layout == "TN" else (k, n)), device=common.DEVICE, dtype=torch.bfloat16)
    out = []
    for q, src, d in ((qa, src_a, da), (qb, src_b, db)):
        q.set_usage(rowwise=d == ROWWISE, columnwise=d == COLUMNWISE)
        out.append(q.quantize(src))
    del src_a, src_b
    return out


def _payloads(A, B, layout: str):
    """Storages, payloads, and the payloads' data made row-major for the raw call (done once,
    outside the timing; hybridfp.gemm copies a non-contiguous stored copy on every call)."""
    da, db = LAYOUTS[layout]
    sa, sb = operand_storage(A, da, "A"), operand_storage(B, db, "B")
    pa, pb = sa.payload(da), sb.payload(db)
    return sa, sb, pa, pb, pa["data"].contiguous(), pb["data"].contiguous()


def bench_shape(name: str, m: int, n: int, k: int, layout: str, protocol: Protocol = Protocol()) -> dict[str, Any]:
    """BF16, raw and hybridfp TFLOP/s at one shape; hybridfp / raw as paired ratios."""
    flops = 2.0 * m * n * k
    row: dict[str, Any] = {"shape": name, "m": m, "n": n, "k": k, "layout": layout}
    a = torch.randn(m, k, device=common.DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=common.DEVICE, dtype=torch.bfloat16)
    row["bf16"] = tflops(flops, bench_ms(lambda: a @ b.t()))
    a = b = None  # free before the FP8 operands are made

    # FP8 per-tensor
    ta, tb = TENSORWISE[layout]
    A, B = _operands(layout, Float8CurrentScalingQuantizer(ta), Float8CurrentScalingQuantizer(tb), m, n, k)
    sa, sb, pa, pb, a8, b8 = _payloads(A, B, layout)
    backend = select(sa.format_key(LAYOUTS[layout][0]), sb.format_key(LAYOUTS[layout][1]), layout, sa.device)
    row["tensorwise_backend"] = backend.name if backend else "emulation"

    def raw(fast: bool = False) -> torch.Tensor:
        return torch._scaled_mm(a8, b8.t(), pa["scale_inv"], pb["scale_inv"], out_dtype=torch.bfloat16,
                                use_fast_accum=fast)
    lib = lambda: gemm(A, B, layout)  # noqa: E731 - the default: FP32 promotion (docs/numerics.md §1)
    row["tensorwise_equal_to_raw"] = bool(torch.equal(raw(), lib()))
    _record(row, "tensorwise", flops, paired_ratio(raw, lib, protocol))
    if layout == "TN":  # what a recipe's fprop_fast_accumulation=True runs (TE's / torchao's fprop)
        lib_fast = lambda: gemm(A, B, layout, fast_accumulation=True)  # noqa: E731
        row["tensorwise_fast_equal_to_raw"] = bool(torch.equal(raw(True), lib_fast()))
        _record(row, "tensorwise_fast", flops, paired_ratio(lambda: raw(True), lib_fast, protocol))
    row["tensorwise_stored_contiguous"] = pa["data"].is_contiguous() and pb["data"].is_contiguous()
    del A, B, sa, sb, pa, pb, a8, b8

    # FP8 block
    bda, bdb = BLOCK_DIMS[layout]
    A, B = _operands(layout, Float8BlockQuantizer(E4M3, block_scaling_dim=bda),
                     Float8BlockQuantizer(E4M3, block_scaling_dim=bdb), m, n, k)
    sa, sb, pa, pb, a8, b8 = _payloads(A, B, layout)
    row["block_stored_contiguous"] = pa["data"].is_contiguous() and pb["data"].is_contiguous()
    backend = select(sa.format_key(LAYOUTS[layout][0]), sb.format_key(LAYOUTS[layout][1]), layout, sa.device)
    row["block_backend"] = backend.name if backend else "emulation"
    row["block_pair"] = f"{'1x128' if bda == 1 else '128x128'} x {'1x128' if bdb == 1 else '128x128'}"
    scale_a = cublas_fp8.block_scale_a(pa["scale_inv"], bda)
    scale_b = cublas_fp8.block_scale_b(pb["scale_inv"], bdb)
    raw = lambda: torch._scaled_mm(a8, b8.t(), scale_a, scale_b,  # noqa: E731
                                   out_dtype=torch.bfloat16)
    lib = lambda: gemm(A, B, layout)  # noqa: E731
    row["block_equal_to_raw"] = bool(torch.equal(raw(), lib()))
    _record(row, "block", flops, paired_ratio(raw, lib, protocol))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> None:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    require_cuda()
    protocol = protocol_from(args)
    warnings.simplefilter("ignore")  # reference-quantizer notices; not what is measured here
    env = environment()
    copy = copy_bandwidth()
    rows = [bench_shape(*s, protocol=protocol) for s in (QUICK_SHAPES if args.quick else SHAPES)]
    headers = ["shape (m,n,k)", "layout", "BF16", "FP8 raw", "FP8 hybridfp", "ratio",
               "block", "block raw", "block hybridfp", "ratio", "bitwise = raw", "stored row-major"]
    fast_rows = [(f"{r['shape']} ({r['m']},{r['n']},{r['k']})", r["tensorwise_fast_raw"], r["tensorwise_fast_hybridfp"],
                  marked(r["tensorwise_fast_paired"]), r["tensorwise_fast_equal_to_raw"])
                 for r in rows if "tensorwise_fast_raw" in r]
    table = md_table(headers, [
        (f"{r['shape']} ({r['m']},{r['n']},{r['k']})", r["layout"], r["bf16"], r["tensorwise_raw"],
         r["tensorwise_hybridfp"], marked(r["tensorwise_paired"]), r["block_pair"], r["block_raw"],
         r["block_hybridfp"], marked(r["block_paired"]),
         f"{r['tensorwise_equal_to_raw']}/{r['block_equal_to_raw']}",
         f"{r['tensorwise_stored_contiguous']}/{r['block_stored_contiguous']}") for r in rows])
    md = ("### GEMM TFLOP/s and paired ratios\n\n"
          f"ratio: median over {protocol.rounds} alternating rounds ({protocol.samples} calls a side each, L2 "
          f"flushed before each) of raw time / hybridfp time, [≥ 95 % interval]; below {TARGET}: marked. BF16: "
          "one unpaired do_bench median." + ("" if protocol.reportable else " NOT REPORTABLE (fewer than 10 "
                                                                              "rounds or samples).") + "\n\n"
          f"Copy bandwidth (same process): {copy['GBps']:.0f} GB/s. FP8 per-tensor: E4M3 x E4M3 "
          "fprop, E5M2 x E4M3 dgrad/wgrad, FP32 promotion (gemm()'s default); block: E4M3. ratio = hybridfp.gemm / "
          "raw torch._scaled_mm on the same stored operands (made row-major once beforehand where the "
          "quantizer stored a copy column-major: \"stored row-major\" False; hybridfp then copies it per call).\n\n" + table
          + "\n\nfprop with cuBLAS fast accumulation (`gemm(fast_accumulation=True)`, a recipe's "
          "`fprop_fast_accumulation=True`; TE's and torchao's fprop setting), TFLOP/s:\n\n"
          + md_table(["shape (m,n,k)", "FP8 raw fast", "FP8 hybridfp fast", "ratio", "bitwise = raw"], fast_rows) + "\n")
    failures = mismatches(rows)
    finish("gemm", {"env": env, "protocol": protocol_record(protocol), "copy_bandwidth": copy, "rows": rows,
                    "failures": failures, "markdown": md}, args.out)
    if failures:
        raise SystemExit("gemm failed:\n" + "\n".join(failures))


def mismatches(rows: list[dict[str, Any]]) -> list[str]:
    """One line per row and GEMM whose hybridfp output differs from raw ``torch._scaled_mm``'s
    (the ``*_equal_to_raw`` flags ``bench_shape`` records)."""
    return [f"gemm {r['shape']}: hybridfp.gemm {key[:-len('_equal_to_raw')]} differs from raw torch._scaled_mm "
            "on the same stored operands" for r in rows for key in sorted(r)
            if key.endswith("_equal_to_raw") and not r[key]]


if __name__ == "__main__":
    main()
