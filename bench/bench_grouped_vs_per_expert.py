"""BF16 grouped GEMM (``torch._grouped_mm``, CUTLASS) against cuBLAS per expert (``torch.mm``), the
8-expert MoE's GEMMs, on operands of three kinds of values.

Both compute each output once from an FP32 accumulator rounded to BF16, so either is an exact
path for the BF16-decoded copies of MXFP8 / NVFP4 (``gemm/grouped.py`` path 1); the question is
which is faster for large experts. The operands' values change the tensor cores' power and so
the clock: "randn" (full BF16 mantissas), "mxfp8" (E4M3 values times powers of two: 3 mantissa
bits) and "nvfp4" (E2M1 times E4M3 scales: at most 5 significant bits), the last two like the
decoded copies a hybridfp MoE step multiplies.

Per shape and value kind: median ms (``do_bench``) of the grouped call and of the per-expert loop
writing into slices of one output, and their ratio (>1: per expert is faster).

    python -m bench.bench_grouped_vs_per_expert [--experts 8 16 32 64] [--out results.json] [--quick]
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from bench import common
from bench.common import finish_rows, parser, require_cuda

#: rows per expert (top-2 of 16384 tokens): uneven with an empty expert, and even. Multiples of 16:
#: ``torch._grouped_mm`` asserts 16-row aligned groups (hybridfp's grouped_bf16 path pads to them).
SPLITS = {"uneven": [4096, 0, 16, 5072, 6000, 32, 8192, 9360], "even": [4096] * 8}
#: 64 experts, ffn 1408 (bench_moe's other config): 512 rows per expert on average
SPLITS64 = {"uneven": [16 * ((i * 37) % 61) for i in range(64)], "even": [512] * 64}
#: experts -> ffn of the other configs (the 32768 routed rows spread over more, smaller experts):
#: where ``grouped.per_group_wins``'s bounds lie (16 experts of 2048 rows, 32 of 1024)
FFN = {8: 14336, 16: 4096, 32: 2048, 64: 1408}


def gemms(ffn: int) -> list[tuple[str, str, int, int]]:
    """The MoE layer's GEMMs at expert FFN width ``ffn`` (hidden 4096, SwiGLU: fc1 is 2 * ffn
    wide), as (name, layout, K of x or dy, N)."""
    return [("fc1 fprop", "TN", 4096, 2 * ffn), ("fc2 fprop", "TN", ffn, 4096),
            ("fc1 dgrad", "NN", 2 * ffn, 4096), ("fc1 wgrad", "NT", 2 * ffn, 4096)]


def split_sets(experts: int) -> dict[str, list[int]]:
    """Uneven (multiples of 16, an empty expert) and even row counts summing to 32768."""
    if experts == 8:
        return SPLITS
    if experts == 64:
        return SPLITS64
    mean = 32768 // experts
    uneven = [16 * (((i * 37) % 61) * mean // (30 * 16)) for i in range(experts)]
    uneven[-1] += 32768 - sum(uneven)
    return {"uneven": uneven, "even": [mean] * experts}


def values(kind: str, shape: tuple[int, ...]) -> torch.Tensor:
    """BF16 operand of ``shape`` whose values are those of ``kind`` (see the module docstring)."""
    x = torch.randn(shape, device="cuda")
    if kind == "mxfp8":
        x = x.to(torch.float8_e4m3fn).float() * 2.0 ** torch.randint(-3, 3, shape[:-1] + (1,), device="cuda")
    elif kind == "nvfp4":
        grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], device="cuda")
        codes = grid[torch.randint(0, 8, shape, device="cuda")] * torch.where(torch.rand(shape, device="cuda") < 0.5, -1, 1)
        scale = (torch.rand(shape[:-1] + (1,), device="cuda") * 4 + 0.5).to(torch.float8_e4m3fn).float()
        x = codes * scale
    return x.bfloat16()


def case(layout: str, k_in: int, n: int, splits: list[int], kind: str
         ) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(grouped call, per-expert loop) for one GEMM of the layer on fresh operands."""
    m, e = sum(splits), len(splits)
    starts = [sum(splits[:i]) for i in range(e)]
    offs = torch.tensor(splits, device="cuda").cumsum(0).to(torch.int32)
    if layout in ("TN", "NN"):  # rows grouped: x [M, K] and W stored [E, N, K] (TN) / [E, K, N] (NN)
        x = values(kind, (m, k_in))
        w = values(kind, (e, n, k_in) if layout == "TN" else (e, k_in, n))
        wt = w.transpose(1, 2) if layout == "TN" else w
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

        def loop() -> torch.Tensor:
            for i, (r, s) in enumerate(zip(starts, splits)):
                if s:
                    torch.mm(x[r:r + s], wt[i], out=out[r:r + s])
            return out
        return (lambda: torch._grouped_mm(x, wt, offs=offs)), loop
    # wgrad: dW_e [N, K] = dy_e^T x_e; dy stored transposed [N, M] as the columnwise copy is
    dyt, x = values(kind, (k_in, m)), values(kind, (m, n))
    out = torch.empty(e, k_in, n, device="cuda", dtype=torch.bfloat16)

    def loop_w() -> torch.Tensor:
        for i, (r, s) in enumerate(zip(starts, splits)):
            if s:
                torch.mm(dyt[:, r:r + s], x[r:r + s], out=out[i])
            else:
                out[i].zero_()
        return out
    return (lambda: torch._grouped_mm(dyt, x, offs=offs)), loop_w


def run(quick: bool, experts: int = 8) -> list[dict[str, Any]]:
    """One row per (GEMM, split, value kind) of the ``experts`` config (a key of FFN)."""
    rows: list[dict[str, Any]] = []
    kinds = ["randn", "nvfp4"] if quick else ["randn", "mxfp8", "nvfp4"]
    sets = split_sets(experts)
    for name, layout, k_in, n in gemms(FFN[experts]):
        for sname, splits in sets.items():
            if quick:
                splits = [-(-s // 256) * 16 for s in splits]  # still multiples of 16
            kk, nn = (k_in // 16, n // 16) if quick else (k_in, n)
            for kind in kinds:
                grouped, loop = case(layout, kk, nn, splits, kind)
                g, p = common.bench_ms(grouped, 50, 300), common.bench_ms(loop, 50, 300)
                flop = 2.0 * sum(splits) * kk * nn
                rows.append(dict(experts=experts, gemm=name, splits=sname, values=kind, grouped_ms=g, per_expert_ms=p,
                                 grouped_tflops=flop / g / 1e9, per_expert_tflops=flop / p / 1e9,
                                 grouped_over_per_expert=g / p))
                torch.cuda.empty_cache()
    return rows


def main(argv: Optional[list[str]] = None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, choices=sorted(FFN), nargs="+", default=[8],
                   help="the MoE's GEMMs at these expert counts (ffn: FFN)")
    args = p.parse_args(argv)
    require_cuda()
    finish_rows("grouped_vs_per_expert", [
        ("experts", "experts"), ("GEMM", "gemm"), ("splits", "splits"), ("values", "values"), ("grouped ms", "grouped_ms"),
        ("per-expert ms", "per_expert_ms"), ("grouped TFLOP/s", "grouped_tflops"),
        ("per-expert TFLOP/s", "per_expert_tflops"), ("grouped / per-expert time", "grouped_over_per_expert")],
        [r for e in args.experts for r in run(args.quick, e)], args.out)


if __name__ == "__main__":
    main()
