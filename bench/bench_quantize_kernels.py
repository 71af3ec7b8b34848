"""Bandwidth of the Triton quantize kernels (hybridfp/kernels) against a device copy.

Input: BF16 [16384, 4096] by default (``--shape``; random normal values with a per-row
magnitude spread). At that size one call's GPU time is close to the Python / launch overhead
of ``q.encode`` (tens of microseconds), so kernel bandwidth is measured at a larger shape
(e.g. ``--shape 32768 8192``, 512 MiB) where the GPU, not the host, is the bottleneck. For each
quantizer configuration the time of ``q.encode(x, rowwise, columnwise)`` (the registered
kernel, all its launches and allocations) is the median of ``triton.testing.do_bench``.
Bytes: "min" = input read once + payloads written (the least any implementation moves);
"moved" adds one more input read for the two-pass kernels (current scaling, NVFP4: an amax
pass, then the cast pass). Stochastic rounding draws its random numbers inside the kernel
(Philox, hybridfp/kernels/triton_sr.py): no extra traffic. GB/s and % of copy are given for both; the copy bandwidth
(read + write of a same-size tensor) is measured in the same process.

Fused hybrids (``HYBRID_CASES``): ``q.encode`` (the fused kernel) against the same hybrid
quantized child by child (``q.reference_encode``: each child's own kernel, one more input read)
and against the larger of its single-format quantizes (target: fused <= 1.10x).

    python -m bench.bench_quantize_kernels [--out results.json] [--quick] [--shape M N] [--dtype bfloat16]
"""

from __future__ import annotations

from typing import Optional

import torch
import triton

from bench.common import environment, finish, md_table, parser, require_cuda
from hybridfp.quantizers import (Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer,
                                 HybridQuantizer, MXFP8Quantizer, NVFP4Quantizer)
from hybridfp.quantizers.backends import select_quantize_kernel

E4M3 = torch.float8_e4m3fn
SHAPE = (16384, 4096)
DEVICE = "cuda"
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


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def copy_gbps(x: torch.Tensor) -> float:
    y = torch.empty_like(x)
    return 2 * x.nbytes / median_ms(lambda: y.copy_(x)) / 1e6


def payload_bytes(storage) -> int:
    return sum(t.nbytes for t in {id(t): t for t in storage.tensors()}.values())


def main(argv: Optional[list[str]] = None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=2, default=SHAPE)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="input dtype (FP32 master weights / activations take other kernel branches)")
    args = p.parse_args(argv)
    require_cuda()
    torch.manual_seed(0)
    shape = (2048, 4096) if args.quick else tuple(args.shape)
    x = (torch.randn(shape, device=DEVICE) * torch.exp2(torch.randint(-4, 4, (shape[0], 1), device=DEVICE))
         ).to(getattr(torch, args.dtype))
    env = environment()
    copy = copy_gbps(x)
    rows = []
    for name, make, r, c, passes in CASES:
        q = make()
        kernel = select_quantize_kernel(q, x, r, c)
        st = q.encode(x, r, c)
        ms = median_ms(lambda: q.encode(x, r, c))
        mn = x.nbytes + payload_bytes(st)
        moved = mn + (passes - 1) * x.nbytes
        row = dict(case=name, kernel=kernel.name if kernel else "REFERENCE", ms=ms,
                   min_gbps=mn / ms / 1e6, moved_gbps=moved / ms / 1e6)
        row["min_pct"], row["moved_pct"] = 100 * row["min_gbps"] / copy, 100 * row["moved_gbps"] / copy
        rows.append(row)
    rows += run_hybrid(x, copy, {r_["case"]: r_["ms"] for r_ in rows})
    table = md_table(["case", "kernel", "ms", "GB/s (min)", "% copy (min)", "GB/s (moved)", "% copy (moved)",
                      "separate ms", "x max(single)"],
                     [(r["case"], r["kernel"], r["ms"], r["min_gbps"], r["min_pct"], r["moved_gbps"], r["moved_pct"],
                       r.get("separate_ms"), r.get("vs_max_single")) for r in rows])
    md = (f"### Quantize kernels, {args.dtype} input {list(shape)} (q.encode, median, do_bench)\n\n"
          f"Copy bandwidth (same process): {copy:.0f} GB/s (read + write). \"min\": input read once + "
          "payloads written; \"moved\": one more input read for two-pass kernels. Fused hybrids: "
          "\"separate\" = child by child, \"x max(single)\" = fused / the slower single-format quantize "
          "(target <= 1.10).\n\n" + table + "\n")
    finish("quantize_kernels", {"env": env, "copy_gbps": copy, "shape": list(shape), "dtype": args.dtype,
                                "rows": rows, "markdown": md}, args.out)


def run_hybrid(x: torch.Tensor, copy: float, single_ms: dict[str, float]) -> list[dict]:
    """Fused hybrids vs child-by-child and vs the larger single-format quantize."""
    out = []
    for name, make, r, c, passes, singles in HYBRID_CASES:
        q = make()
        kernel = select_quantize_kernel(q, x, r, c)
        st = q.encode(x, r, c)
        ms = median_ms(lambda: q.encode(x, r, c))
        sep = median_ms(lambda: q.reference_encode(x, r, c))
        ref = max(single_ms[s_] for s_ in singles)
        mn = x.nbytes + payload_bytes(st)
        moved = mn + (passes - 1) * x.nbytes
        row = dict(case=name, kernel=kernel.name if kernel else "SEPARATE", ms=ms, separate_ms=sep,
                   vs_max_single=ms / ref, min_gbps=mn / ms / 1e6, moved_gbps=moved / ms / 1e6)
        row["min_pct"], row["moved_pct"] = 100 * row["min_gbps"] / copy, 100 * row["moved_gbps"] / copy
        out.append(row)
    return out


if __name__ == "__main__":
    main()
