"""The grouped FP8 current-scaling kernels (``kernels/triton_grouped_fp8.py``) at MoE shapes:
device time of the segmented amax and of the cast pass (row + col, each expert's own transpose)
against a device-to-device copy of the same bytes measured in the same process ("x copy" = copy
time of bytes read + written / kernel time). (A scalar-base transposed store for tiles inside
one group measured no faster than the per-row-base store on the H200, 2026-11-29: 0.255 vs
0.252 ms at 32768x4096, 8 experts; it was dropped.)

    python -m bench.bench_grouped_fp8 [--out results.json]
"""

from __future__ import annotations

import torch

from bench.common import bench_ms, environment, finish, md_table, parser, require_cuda

#: (rows, cols, experts): an MoE layer's activations (16384 tokens x top-2) at hidden 4096 and
#: at ffn 14336, routed unevenly over 8 experts; 64 experts of a small ffn
SHAPES = [(32768, 4096, 8), (32768, 14336, 8), (32768, 4096, 64)]


def splits_for(rows: int, experts: int) -> list[int]:
    """Uneven positive counts that sum to ``rows`` (every 3rd expert weighted 1.25, not multiples
    of 32)."""
    w = [1.25 if e % 3 == 0 else 1.0 for e in range(experts)]
    base = [int(rows * x / sum(w)) for x in w]
    base[-1] += rows - sum(base)
    assert min(base) > 0 and sum(base) == rows
    return base


def copy_ms(nbytes: int) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return bench_ms(lambda: dst.copy_(src))


def main(argv=None) -> None:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    require_cuda()
    from hybridfp.kernels.triton_grouped_fp8 import group_amax, quantize
    from hybridfp.quantizers.grouped_scaled import _row_groups, column_starts, padded_ld

    rows_out = []
    for r, c, e in ([(4096, 1024, 8)] if args.quick else SHAPES):
        x = torch.randn(r, c, device="cuda", dtype=torch.bfloat16)
        splits = splits_for(r, e)
        group = _row_groups(splits, x.device)
        lds = [padded_ld(m) for m in splits]
        starts, width = column_starts(splits)  # the joined [c, width] columnwise matrix
        amax = group_amax(x, group, e)
        n = r * c
        t_amax = bench_ms(lambda: group_amax(x, group, e))
        row = {"shape": f"{r}x{c}, {e} experts", "amax ms": t_amax, "amax x copy": copy_ms(2 * n) / t_amax}
        t = bench_ms(lambda: quantize(x, amax, splits, torch.float8_e4m3fn, col_offsets=starts, col_lds=lds,
                                      col_numel=c * width, col_stride=width))
        row["cast row+col ms"] = t
        row["cast x copy"] = copy_ms(4 * n) / t  # 2 bytes read, 1 + 1 written
        rows_out.append(row)
    cols = list(rows_out[0])
    md = ("### Grouped FP8 current-scaling kernels (device time, do_bench median)\n\n"
          + md_table(cols, [[r[k] for k in cols] for r in rows_out]) + "\n")
    finish("grouped_fp8", {"env": environment(), "rows": rows_out, "markdown": md}, args.out)


if __name__ == "__main__":
    main()
