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
and against the larger of its single-format quantizes (the issue #4 target: fused <= 1.10x).

``--sweep`` also times a few tile / warp configurations of each kernel entry point.

    python -m bench.bench_quantize_kernels [--sweep] [--out file.json]
"""

from __future__ import annotations

import argparse
import json
from typing import Optional

import torch
import triton

from hybridfp.kernels import (_common, triton_fp8_block, triton_fp8_tensorwise, triton_hybrid_fp8,
                              triton_hybrid_mxfp8_nvfp4, triton_hybrid_nvfp4, triton_mxfp8, triton_nvfp4)
from hybridfp.quantizers import (Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer,
                                 HybridQuantizer, MXFP8Quantizer, NVFP4Quantizer)
from hybridfp.quantizers.backends import select_quantize_kernel

E4M3 = torch.float8_e4m3fn
SHAPE = (16384, 4096)
DEVICE = "cuda"  # "cpu" only to smoke-test the script under TRITON_INTERPRET=1
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


def graph_ms(fn) -> float:
    """Median ms of ``fn`` replayed from a CUDA graph: the kernels' device time without the
    Python wrapper's launch overhead (the sweep compares kernel variants)."""
    return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")


def copy_gbps(x: torch.Tensor) -> float:
    y = torch.empty_like(x)
    return 2 * x.nbytes / median_ms(lambda: y.copy_(x)) / 1e6


def payload_bytes(storage) -> int:
    return sum(t.nbytes for t in {id(t): t for t in storage.tensors()}.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--shape", type=int, nargs=2, default=SHAPE)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                    help="input dtype (FP32 master weights / activations take other kernel branches)")
    ap.add_argument("--only", default=None, help="sweep only: variants whose name contains one of these "
                    "'|'-separated texts (names hold commas), and skip the quantizer table")
    args = ap.parse_args()
    torch.manual_seed(0)
    shape = tuple(args.shape)
    x = (torch.randn(shape, device=DEVICE) * torch.exp2(torch.randint(-4, 4, (shape[0], 1), device=DEVICE))
         ).to(getattr(torch, args.dtype))
    copy = copy_gbps(x)
    print(f"copy: {copy:.0f} GB/s (read + write, {x.nbytes / 2**20:.0f} MiB {args.dtype})")
    if args.only:  # a quick A/B of kernel variants
        sweep = run_sweep(x, copy, args.only.split("|"))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"copy_gbps": copy, "rows": [], "sweep": sweep}, f, indent=1)
        return
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
    print(f"{'case':28s} {'kernel':20s} {'ms':>7s} {'GB/s(min)':>10s} {'%copy':>6s} {'GB/s(moved)':>11s} {'%copy':>6s}")
    for r_ in rows:
        print(f"{r_['case']:28s} {r_['kernel']:20s} {r_['ms']:7.3f} {r_['min_gbps']:10.0f} {r_['min_pct']:6.1f} "
              f"{r_['moved_gbps']:11.0f} {r_['moved_pct']:6.1f}")
    hybrid = run_hybrid(x, copy, {r_["case"]: r_["ms"] for r_ in rows})
    rows += hybrid
    sweep = []
    if args.sweep:
        sweep = run_sweep(x, copy)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"copy_gbps": copy, "rows": rows, "sweep": sweep}, f, indent=1)


def run_hybrid(x: torch.Tensor, copy: float, single_ms: dict[str, float]) -> list[dict]:
    """Fused hybrids vs child-by-child and vs the larger single-format quantize."""
    out = []
    print(f"{'hybrid case':42s} {'kernel':32s} {'fused ms':>8s} {'%copy':>6s} {'separate':>8s} "
          f"{'/max(single)':>12s}")
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
        print(f"{name:42s} {row['kernel']:32s} {ms:8.3f} {row['min_pct']:6.1f} {sep:8.3f} {ms / ref:12.2f}")
    return out


def run_sweep(x: torch.Tensor, copy: float, only: Optional[list[str]] = None) -> list[dict]:
    """Direct entry points at a few tiles / warps / store variants (min bytes, one pass each;
    CUDA-graph timing: device time only); ``only``: the variants whose name contains one of these."""
    g = _common.global_amax(x)
    variants = []
    for blk, nw in [((64, 128), 4), ((32, 128), 4), ((128, 128), 4), ((64, 256), 8), ((64, 64), 2),
                    ((128, 64), 2)]:
        variants.append((f"mxfp8 row+col {blk} nw{nw}",
                         lambda b=blk, n=nw: triton_mxfp8.quantize(x, E4M3, block=b, num_warps=n)))
        variants.append((f"mxfp8 col {blk} nw{nw}", lambda b=blk, n=nw: triton_mxfp8.quantize(
            x, E4M3, block=b, num_warps=n, rowwise=False)))
        variants.append((f"mxfp8 row {blk} nw{nw}", lambda b=blk, n=nw: triton_mxfp8.quantize(
            x, E4M3, block=b, num_warps=n, columnwise=False)))
    # MXFP8 1D method="natural" (columnwise copy from natural [rs, BC] slices, triton_mxfp8.col_copy_natural)
    # against the "slices" rows above; (64, 256) / 4 and (64, 128) / 2 hold fewer replicated column scales
    # per element (offline SASS), so "slices" is timed there too
    for blk, nw in [((64, 256), 4), ((64, 128), 2)]:
        variants.append((f"mxfp8 row+col {blk} nw{nw}",
                         lambda b=blk, n=nw: triton_mxfp8.quantize(x, E4M3, block=b, num_warps=n)))
        variants.append((f"mxfp8 col {blk} nw{nw}", lambda b=blk, n=nw: triton_mxfp8.quantize(
            x, E4M3, block=b, num_warps=n, rowwise=False)))
    for blk, nw in [((64, 128), 4), ((128, 128), 4), ((32, 128), 4), ((64, 256), 8), ((64, 256), 4), ((64, 128), 2)]:
        for rs in (8, 16, 32):
            variants.append((f"mxfp8 natural row+col {blk} rs{rs} nw{nw}",
                             lambda b=blk, n=nw, r=rs: triton_mxfp8.quantize(x, E4M3, block=b, num_warps=n,
                                                                             method="natural", row_slice=r)))
            variants.append((f"mxfp8 natural col {blk} rs{rs} nw{nw}", lambda b=blk, n=nw, r=rs: triton_mxfp8.quantize(
                x, E4M3, block=b, num_warps=n, method="natural", row_slice=r, rowwise=False)))
    for blk, nw in [((64, 64), 8), ((64, 128), 8), ((128, 128), 8), ((32, 128), 4)]:
        variants.append((f"fp8 cast pass row+col {blk} nw{nw}", lambda b=blk, n=nw: triton_fp8_tensorwise.quantize(
            x, E4M3, amax=g, block=b, num_warps=n)))
    # "natural": chunk = rows per columnwise slice; "slices" (the old kernel): columns per pass
    for m, cw, rw, nw in [("natural", 32, 16, 4), ("natural", 16, 16, 2), ("natural", 32, 16, 2),
                          ("natural", 16, 8, 1), ("natural", 64, 32, 4), ("natural", 128, 32, 4),
                          ("natural", 128, 32, 8), ("natural", 64, 64, 4), ("natural", 64, 32, 8),
                          ("natural", 128, 64, 8), ("slices", 128, 16, 4)]:
        for r, c in [(True, True), (True, False), (False, True)]:
            variants.append((f"fp8 block 1d {m} chunk{cw} rows{rw} nw{nw} {'row' * r}{'+' * (r and c)}{'col' * c}",
                             lambda m=m, c_=cw, r_=rw, n=nw, r=r, c=c: triton_fp8_block.quantize(
                                 x, E4M3, block_dim=1, chunk=c_, row_slice=r_, num_warps=n, method=m,
                                 rowwise=r, columnwise=c)))
    for dim in (1, 2):
        for nw in (4, 8, 16):
            for r, c in [(True, True), (True, False), (False, True)]:
                variants.append((f"fp8 block {dim}d tile nw{nw} {'row' * r}{'+' * (r and c)}{'col' * c}",
                                 lambda d=dim, n=nw, r=r, c=c: triton_fp8_block.quantize(
                                     x, E4M3, block_dim=d, num_warps=n, rowwise=r, columnwise=c, method="tile")))
    variants.append(("fp8 block 2d chunk16 nw4 (default)", lambda: triton_fp8_block.quantize(x, E4M3, block_dim=2)))
    variants.append(("fp8 cast pass col only (32, 128) nw4", lambda: triton_fp8_tensorwise.quantize(
        x, E4M3, amax=g, rowwise=False)))
    variants.append(("fp8 cast pass col only, no anchor", lambda: triton_fp8_tensorwise.quantize(
        x, E4M3, amax=g, rowwise=False, anchor=False)))
    for m, cw, rw, nw in [("natural", 32, 16, 4), ("natural", 16, 16, 2), ("natural", 16, 8, 1),
                          ("natural", 64, 32, 4), ("natural", 128, 32, 4), ("natural", 128, 32, 8),
                          ("natural", 64, 32, 8), ("slices", 128, 16, 4)]:
        variants.append((f"hybrid fp8 current+block cast {m} chunk{cw} rows{rw} nw{nw}",
                         lambda m=m, c=cw, r=rw, n=nw: triton_hybrid_fp8.quantize(
                             x, g, E4M3, E4M3, chunk=c, row_slice=r, num_warps=n, method=m)))
    for blk, nw in [((32, 64), 2), ((32, 64), 1), ((32, 128), 2), ((32, 128), 4), ((32, 32), 1), ((64, 64), 2)]:
        # the "trans" method these rows were first timed with (the "method" rows below compare both)
        variants.append((f"hybrid nvfp4+mxfp8 rd cast {blk} nw{nw}",
                         lambda b=blk, n=nw: triton_hybrid_nvfp4.quantize(x, g, E4M3, block=b, num_warps=n,
                                                                          method="trans")))
        variants.append((f"hybrid nvfp4+mxfp8 orig cast {blk} nw{nw}",
                         lambda b=blk, n=nw: triton_hybrid_nvfp4.quantize(x, g, E4M3, block=b, num_warps=n,
                                                                          source="original", method="trans")))
        variants.append((f"hybrid nvfp4->mxfp8 rd col only {blk} nw{nw}",
                         lambda b=blk, n=nw: triton_hybrid_nvfp4.quantize(x, g, E4M3, block=b, num_warps=n,
                                                                          rowwise=False, method="trans")))
    for blk, nw in [((4, 64), 8), ((2, 64), 4), ((4, 128), 8), ((8, 64), 8), ((2, 128), 4), ((1, 256), 4),
                    ((1, 128), 2), ((2, 256), 8), ((2, 256), 4)]:
        variants.append((f"nvfp4 1d cast {blk} nw{nw}", lambda b=blk, n=nw: triton_nvfp4.quantize_1d(
            x, g, g, block=b, num_warps=n)))
        variants.append((f"nvfp4 rht cast {blk} nw{nw}", lambda b=blk, n=nw: triton_nvfp4.quantize_1d(
            x, g, g, rht=True, block=b, num_warps=n)))
        variants.append((f"nvfp4 rht+sr cast {blk} nw{nw}", lambda b=blk, n=nw: triton_nvfp4.quantize_1d(
            x, g, g, rht=True, seed=1, block=b, num_warps=n)))
    for blk, nw in [((2, 64), 4), ((2, 128), 4), ((4, 64), 8), ((1, 128), 4), ((1, 256), 4)]:
        variants.append((f"hybrid mxfp8+nvfp4 rht cast {blk} nw{nw}",
                         lambda b=blk, n=nw: triton_hybrid_mxfp8_nvfp4.quantize(x, g, E4M3, rht=True, block=b,
                                                                                num_warps=n)))
    variants.append(("amax pass 64x128", lambda: _common.global_amax(x)))
    variants.append(("nvfp4 amax+rht-amax pass", lambda: triton_nvfp4.amaxes(x, rht_amax=True)))
    for blk, nw in [((2, 256), 4), ((4, 256), 8), ((1, 512), 4), ((2, 512), 8)]:
        variants.append((f"nvfp4 amax+rht-amax pass {blk} nw{nw}",
                         lambda b=blk, n=nw: triton_nvfp4.amaxes(x, rht_amax=True, block=b, num_warps=n)))
    # MoE: 8 experts' routed rows (awkward counts) -> their MXFP8 rowwise copy and the 32-padded
    # groups' columnwise copy: three passes (rowwise, pad_rows, columnwise) or one through the row map
    from hybridfp.kernels import triton_pad_rows
    from hybridfp.quantizers.grouped import _offsets, _padded_total, _row_map
    rows = x.shape[0]  # 8 groups with awkward counts (an empty one) covering x's rows
    splits = [rows // 8 + 3, 0, 1, rows // 8 + 29, rows // 8 + 952, 31, rows // 4]
    splits.append(rows - sum(splits))
    starts = _offsets(splits, 32)
    total = _padded_total(splits, 32, starts)
    rmap = _row_map(splits, starts, total, x)
    variants.append(("grouped mxfp8 row+col, 8 experts: row, pad, col (3 passes)", lambda: (
        triton_mxfp8.quantize(x, E4M3, columnwise=False),
        triton_mxfp8.quantize(triton_pad_rows.pad_rows(x, rmap), E4M3, rowwise=False, method="slices"))))
    variants.append(("grouped mxfp8 row+col, 8 experts: row map (1 pass)", lambda: triton_mxfp8.quantize(
        x, E4M3, row_map=rmap)))
    variants.append(("grouped mxfp8 col, 8 experts: row map, slices", lambda: triton_mxfp8.quantize(
        x, E4M3, rowwise=False, row_map=rmap, method="slices")))
    variants.append(("grouped mxfp8 col, 8 experts: row map, default", lambda: triton_mxfp8.quantize(
        x, E4M3, rowwise=False, row_map=rmap)))
    for blk, nw, rs in [((64, 128), 4, 32), ((64, 128), 4, 16), ((64, 256), 4, 32), ((64, 128), 2, 32),
                        ((128, 128), 4, 32)]:
        variants.append((f"grouped mxfp8 natural row map row+col, 8 experts {blk} rs{rs} nw{nw}",
                         lambda b=blk, n=nw, r=rs: triton_mxfp8.quantize(x, E4M3, row_map=rmap, block=b, num_warps=n,
                                                                         method="natural", row_slice=r)))
        variants.append((f"grouped mxfp8 natural row map col, 8 experts {blk} rs{rs} nw{nw}",
                         lambda b=blk, n=nw, r=rs: triton_mxfp8.quantize(x, E4M3, row_map=rmap, block=b, num_warps=n,
                                                                         method="natural", row_slice=r, rowwise=False)))
    # copies written as their BF16 decodes (decoded=True, "slices") against codes plus the decodes the GEMMs
    # would run (triton_decode.decode_mxfp8 of each copy): the A/B of hybridfp.nn.set_decoded_copies
    from hybridfp.kernels import triton_decode

    def codes_then_decodes(**kw):
        row, col = triton_mxfp8.quantize(x, E4M3, **kw)
        return [triton_decode.decode_mxfp8(*c) for c in (row, col) if c is not None]
    for what, kw in [("row+col", {}), ("row", {"columnwise": False}), ("col", {"rowwise": False}),
                     ("grouped row+col, 8 experts", {"row_map": rmap})]:
        variants.append((f"mxfp8 {what}: codes + decodes", lambda k=kw: codes_then_decodes(**k)))
        variants.append((f"mxfp8 {what}: decoded", lambda k=kw: triton_mxfp8.quantize(x, E4M3, decoded=True, **k)))
    for blk, nw in [((64, 128), 4), ((32, 128), 4), ((64, 64), 2), ((32, 64), 2), ((32, 256), 8), ((32, 128), 2)]:
        variants.append((f"mxfp8 row+col: decoded {blk} nw{nw}", lambda b=blk, n=nw: triton_mxfp8.quantize(
            x, E4M3, decoded=True, block=b, num_warps=n)))
        variants.append((f"mxfp8 grouped row+col, 8 experts: decoded {blk} nw{nw}",
                         lambda b=blk, n=nw: triton_mxfp8.quantize(x, E4M3, decoded=True, row_map=rmap, block=b,
                                                                   num_warps=n)))
    # register caps (more programs per SM; ncu s17: the row+col kernel is register-limited to 43.75 %
    # occupancy at 72 registers, the natural columnwise one to 25 % at 118)
    for mr in (64, 56):
        variants.append((f"mxfp8 row+col (64, 128) nw4 maxnreg{mr}", lambda m=mr: triton_mxfp8.quantize(
            x, E4M3, maxnreg=m)))
        variants.append((f"grouped mxfp8 row+col, 8 experts: row map maxnreg{mr}", lambda m=mr: triton_mxfp8.quantize(
            x, E4M3, row_map=rmap, maxnreg=m)))
    for mr in (104, 96):
        variants.append((f"mxfp8 natural col (64, 128) rs32 nw2 maxnreg{mr}", lambda m=mr: triton_mxfp8.quantize(
            x, E4M3, rowwise=False, maxnreg=m)))
        variants.append((f"grouped mxfp8 col, 8 experts: row map, default maxnreg{mr}",
                         lambda m=mr: triton_mxfp8.quantize(x, E4M3, rowwise=False, row_map=rmap, maxnreg=m)))
    # "slices" store widths (ncu s17: L2 write requests of the transposed copies bound the kernel)
    for w, mr in [(0, None), (1, None), (1, 72), (2, None), (2, 72)]:
        tag = f"wide{w}" + (f" maxnreg{mr}" if mr else "")
        variants.append((f"mxfp8 row+col (64, 128) nw4 {tag}", lambda w=w, m=mr: triton_mxfp8.quantize(
            x, E4M3, wide_stores=w, maxnreg=m, method="slices")))
        variants.append((f"mxfp8 col slices (64, 128) nw4 {tag}", lambda w=w, m=mr: triton_mxfp8.quantize(
            x, E4M3, rowwise=False, wide_stores=w, maxnreg=m, method="slices")))
        variants.append((f"grouped mxfp8 row+col, 8 experts: row map {tag}", lambda w=w, m=mr: triton_mxfp8.quantize(
            x, E4M3, row_map=rmap, wide_stores=w, maxnreg=m)))
    # the natural columnwise pass with paired scale bytes, and the fused NVFP4 + MXFP8 kernel's wide stores
    for w in (0, 2):
        variants.append((f"mxfp8 natural col (64, 128) rs32 nw2 wide{w}", lambda w=w: triton_mxfp8.quantize(
            x, E4M3, rowwise=False, wide_stores=w)))
        variants.append((f"grouped mxfp8 col, 8 experts: row map, natural wide{w}", lambda w=w: triton_mxfp8.quantize(
            x, E4M3, rowwise=False, row_map=rmap, wide_stores=w)))
    rs_amax = x.float().abs().amax(1)
    for w in (False, True):
        for src in ("rowwise_dequantized", "original"):
            for blk in ((32, 64), (64, 64)):
                variants.append((f"hybrid nvfp4+mxfp8 {src[:4]} row-scaled {blk} nw2 wide{int(w)} (trans)",
                                 lambda w=w, s=src, b=blk: triton_hybrid_nvfp4.quantize(
                                     x, rs_amax, E4M3, source=s, block=b, num_warps=2, wide_stores=w,
                                     method="trans")))
    # the fused NVFP4 + MXFP8 kernel's methods ("trans": tl.trans of each 32-row block; "natural": four
    # [8, BC] slices of rows 4i + k), row-scaled as Composer-2 runs it
    for m in ("trans", "natural"):
        for src in ("rowwise_dequantized", "original"):
            for blk, nw in [((32, 64), 2), ((32, 128), 2), ((64, 64), 2), ((64, 128), 4), ((32, 128), 4),
                            ((32, 256), 4), ((32, 64), 1), ((32, 32), 1)]:
                variants.append((f"hybrid nvfp4+mxfp8 {src[:4]} row-scaled {blk} nw{nw} method {m}",
                                 lambda m=m, s=src, b=blk, n=nw: triton_hybrid_nvfp4.quantize(
                                     x, rs_amax, E4M3, source=s, block=b, num_warps=n, method=m)))
    # the same kernel with one global amax (Composer-2's weights) at its default method and tile
    g_amax = rs_amax.amax()
    for src in ("rowwise_dequantized", "original"):
        variants.append((f"hybrid nvfp4+mxfp8 {src[:4]} global default",
                         lambda s=src: triton_hybrid_nvfp4.quantize(x, g_amax, E4M3, source=s)))
    # the fused NVFP4 + MXFP8 kernel (Composer-2's inputs and weights) at its default method and tile, capped
    for mr in (0, 96, 64):
        for src in ("rowwise_dequantized", "original"):
            variants.append((f"hybrid nvfp4+mxfp8 {src[:4]} row-scaled default maxnreg{mr}",
                             lambda m=mr, s=src: triton_hybrid_nvfp4.quantize(x, rs_amax, E4M3, source=s, maxnreg=m)))
    # the natural columnwise-only pass at more tiles, and capped
    for blk, nw, mr in [((128, 128), 2, 0), ((64, 64), 1, 0), ((128, 64), 1, 0), ((64, 128), 2, 112),
                        ((32, 128), 2, 0), ((64, 256), 4, 0)]:
        variants.append((f"mxfp8 natural col {blk} rs32 nw{nw} maxnreg{mr}", lambda b=blk, n=nw, m=mr: triton_mxfp8.quantize(
            x, E4M3, rowwise=False, block=b, num_warps=n, method="natural", maxnreg=m or None)))
    out = []
    for name, fn in variants:
        if only and not any(o in name for o in only):
            continue
        try:
            res = fn()
            outs = [t for t in _flatten(res) if isinstance(t, torch.Tensor)]
            nbytes = x.nbytes + sum(t.nbytes for t in outs)
            ms = graph_ms(fn)
        except Exception as e:  # noqa: BLE001 - a variant that cannot be captured is reported, not fatal
            out.append(dict(variant=name, error=f"{type(e).__name__}: {e}"))
            print(f"  {name:52s} not timed: {type(e).__name__}: {str(e)[:120]}")
            continue
        gbps = nbytes / ms / 1e6
        out.append(dict(variant=name, ms=ms, gbps=gbps, pct=100 * gbps / copy))
        print(f"  {name:52s} {ms:7.3f} ms {gbps:6.0f} GB/s {100 * gbps / copy:5.1f}% of copy")
    return out


def _flatten(obj):
    if isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _flatten(o)
    elif obj is not None:
        yield obj


if __name__ == "__main__":
    main()
