"""MXFP8 quantize writing the BF16-decoded copies in the same pass (``triton_mxfp8.quantize_decoded``)
against quantize + one decode pass per copy (``triton_decode.decode_mxfp8``), the work a GEMM on
the BF16 tensor-core path needs (Hopper has no MXFP8 MMA), at the Llama-3-8B MLP's shapes.
Times are do_bench medians (ms, L2 flushed); "x copy" = the time a device-to-device copy of the
same bytes takes / the time.

    python -m bench.bench_decoded_copies [--out results.json]
"""

from __future__ import annotations

import torch

from bench.common import bench_ms, environment, finish, md_table, parser, require_cuda

#: (rows, cols): x / dy (16384 tokens x 4096), h / d-gate / d-up (16384 x 14336), W13 / W2
SHAPES = [(16384, 4096), (16384, 14336), (14336, 4096), (4096, 14336)]


def copy_ms(nbytes: int) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return bench_ms(lambda: dst.copy_(src))


def main(argv=None) -> None:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    require_cuda()
    from hybridfp.kernels import triton_decode, triton_mxfp8

    e4m3 = torch.float8_e4m3fn
    rows_out = []
    for r, c in ([(2048, 1024)] if args.quick else SHAPES):
        x = torch.randn(r, c, device="cuda", dtype=torch.bfloat16)
        n = r * c
        (rd, rs), (cd, cs) = triton_mxfp8.quantize(x, e4m3)

        def separate() -> None:
            (a, b), (c_, d) = triton_mxfp8.quantize(x, e4m3)
            triton_decode.decode_mxfp8(a, b)
            triton_decode.decode_mxfp8(c_, d)

        t_q = bench_ms(lambda: triton_mxfp8.quantize(x, e4m3))
        t_dec = bench_ms(lambda: triton_decode.decode_mxfp8(rd, rs))
        t_sep = bench_ms(separate)
        t_fused = bench_ms(lambda: triton_mxfp8.quantize_decoded(x, e4m3, decoded_rowwise=True,
                                                                 decoded_columnwise=True))
        t_row = bench_ms(lambda: triton_mxfp8.quantize_decoded(x, e4m3, decoded_rowwise=True))
        rows_out.append({
            "shape": f"{r}x{c}", "quantize row+col ms": t_q, "quantize x copy": copy_ms(4 * n) / t_q,
            "one decode ms": t_dec, "decode x copy": copy_ms(3 * n) / t_dec,
            "quantize + 2 decodes ms": t_sep, "fused (both decoded) ms": t_fused,
            "fused x copy": copy_ms(8 * n) / t_fused, "fused (row decoded) ms": t_row,
            "fused / separate": t_fused / t_sep})
    cols = list(rows_out[0])
    md = ("### MXFP8 quantize with decoded copies vs quantize + decode passes\n\n"
          + md_table(cols, [[r[k] for k in cols] for r in rows_out]) + "\n")
    finish("decoded_copies", {"env": environment(), "rows": rows_out, "markdown": md}, args.out)


if __name__ == "__main__":
    main()
