"""FP8 per-tensor current scaling at the Llama-3-8B MLP's operand shapes: device time of the amax
pass (``_common.global_amax``) and of the cast pass (row + col, and row only, ``triton_fp8_tensorwise``)
per shape, element type and tile, against a device-to-device copy of the same bytes measured in the same process
("x copy" = copy time / kernel time). The quantize-kernel sweep measures one shape (16384x4096); the
MLP step quantizes four shapes, in E4M3 (x, W, h) and E5M2 (dy, d-gate, d-up).

    python -m bench.bench_fp8_shapes [--out results.json] [--quick] [--mxfp8] [--no-fp8]
"""

from __future__ import annotations

import torch

from bench.bench_quantize_kernels import graph_ms
from bench.common import environment, finish, md_table, parser, require_cuda

#: x / dy, h / d-gate / d-up, W1 / W3, W2
SHAPES = [(16384, 4096), (16384, 14336), (14336, 4096), (4096, 14336)]
#: MXFP8 1D row + col (tile, warps), the default first (the columnwise pass wants BC = 32 x warps)
MX_TILES = [((64, 128), 4), ((128, 64), 2), ((32, 128), 4), ((64, 64), 2), ((128, 128), 4), ((256, 64), 2),
            ((128, 32), 1)]
#: (tile, warps) for both copies, the default first; one copy (rowwise), the default first
TILES = [((128, 64), 4), ((64, 128), 8), ((64, 64), 4), ((32, 64), 2), ((64, 64), 2), ((32, 64), 4),
         ((128, 64), 8), ((64, 128), 4), ((128, 128), 8)]
ROW_TILES = [((32, 128), 4), ((64, 64), 4), ((32, 64), 2), ((64, 128), 8)]


def copy_ms(nbytes: int) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return graph_ms(lambda: dst.copy_(src))


def main(argv=None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--mxfp8", action="store_true", help="also the MXFP8 1D kernel's tiles")
    p.add_argument("--no-fp8", action="store_true", help="skip the FP8 per-tensor tiles")
    args = p.parse_args(argv)
    require_cuda()
    from hybridfp.kernels import triton_fp8_tensorwise
    from hybridfp.kernels._common import global_amax

    rows_out = []
    shapes = [(2048, 1024)] if args.quick else SHAPES
    for r, c in [] if args.no_fp8 else shapes:
        x = torch.randn(r, c, device="cuda", dtype=torch.bfloat16)
        n = r * c
        t_copy2, t_copy3, t_copy4 = copy_ms(2 * n), copy_ms(3 * n), copy_ms(4 * n)
        amax = global_amax(x)
        t_amax = graph_ms(lambda: global_amax(x))
        for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            row = {"shape": f"{r}x{c}", "dtype": str(dtype).split(".")[-1], "amax ms": t_amax,
                   "amax x copy": t_copy2 / t_amax}
            for tile, nw in TILES[:2] if args.quick else TILES:
                t = graph_ms(lambda: triton_fp8_tensorwise.quantize(x, dtype, amax=amax, block=tile, num_warps=nw))
                row[f"cast {tile[0]}x{tile[1]}/{nw} x copy"] = t_copy4 / t
            for tile, nw in ROW_TILES[:2] if args.quick else ROW_TILES:
                t = graph_ms(lambda: triton_fp8_tensorwise.quantize(x, dtype, amax=amax, block=tile, num_warps=nw,
                                                                    columnwise=False))
                row[f"row {tile[0]}x{tile[1]}/{nw} x copy"] = t_copy3 / t
            row["default cast ms"] = t_copy4 / row[f"cast {TILES[0][0][0]}x{TILES[0][0][1]}/{TILES[0][1]} x copy"]
            rows_out.append(row)
    mx_rows = []
    if args.mxfp8:
        from hybridfp.kernels import triton_mxfp8
        for r, c in shapes:
            x = torch.randn(r, c, device="cuda", dtype=torch.bfloat16)
            t_copy = copy_ms(4 * r * c)
            row = {"shape": f"{r}x{c}"}
            for tile, nw in MX_TILES[:2] if args.quick else MX_TILES:
                t = graph_ms(lambda: triton_mxfp8.quantize(x, torch.float8_e4m3fn, block=tile, num_warps=nw))
                row[f"mxfp8 {tile[0]}x{tile[1]}/{nw} x copy"] = t_copy / t
            mx_rows.append(row)
    cols = list(rows_out[0]) if rows_out else []
    md = ("### FP8 current scaling at the MLP's shapes (CUDA-graph device time; x copy = copy time / time)\n\n"
          + md_table(cols, [[r[k] for k in cols] for r in rows_out]) + "\n")
    if mx_rows:
        mc = list(mx_rows[0])
        md += ("\n### MXFP8 1D row + col at the MLP's shapes (E4M3; x copy = copy of 2 + 2 bytes / element)\n\n"
               + md_table(mc, [[r[k] for k in mc] for r in mx_rows]) + "\n")
    finish("fp8_shapes", {"env": environment(), "rows": rows_out, "mxfp8_rows": mx_rows, "markdown": md}, args.out)


if __name__ == "__main__":
    main()
