"""The Triton grouped GEMM (``kernels/triton_grouped_gemm.py``) against ``torch._grouped_mm``.

MoE fprop / dgrad shapes (8 experts' routed rows, awkward counts, an empty expert): BF16
operands, the per-row / per-column FP32 epilogue of row-scaled NVFP4 on (what the kernel is for),
several tiles. Median ms (``bench.common.bench_ms``: do_bench) and TFLOP/s, with the ratio to
``torch._grouped_mm`` on the same operands (no epilogue: the speed the kernel should approach).

    python -m bench.bench_grouped_gemm_kernel [--out results.json] [--quick: the first two tiles only]
    python -m bench.bench_grouped_gemm_kernel --tma   # the TMA kernel's configs (TMA_CONFIGS) against
        torch._grouped_mm, the pointer kernel at its default tile, and cuBLAS (grouped, else per expert)
        with an FP32 output plus the epilogue as torch ops, on the same operands
    python -m bench.bench_grouped_gemm_kernel --tma-f32   # its FP32-output configs (TMA_F32_CONFIGS)
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from bench import common
from bench.common import finish_rows, parser, require_cuda

#: (name, rows per expert, K, N): fc1 and fc2 of the 8-expert MoE layer of bench_moe
SHAPES = [("fc1 fprop 8x(4096->28672)", [4099, 0, 1, 5077, 6000, 31, 8192, 9368], 4096, 28672),
          ("fc2 fprop 8x(14336->4096)", [4099, 0, 1, 5077, 6000, 31, 8192, 9368], 14336, 4096)]
#: ((BM, BN, BK, warps, stages), group_m: the L2 swizzle's row tiles per group, 1 = none)
TILES = [((128, 256, 64, 8, 3), 1), ((128, 128, 64, 8, 3), 8), ((128, 256, 64, 8, 3), 8),
         ((128, 256, 64, 8, 3), 16), ((128, 256, 64, 8, 4), 8), ((256, 128, 64, 8, 3), 8),
         ((256, 128, 64, 8, 4), 8), ((128, 256, 32, 8, 5), 8), ((128, 128, 64, 4, 4), 8)]


Variants = Callable[..., dict[str, Callable[[], Any]]]


def _sweep(variants: Variants) -> list[dict[str, Any]]:
    """One row per (shape, variant): ms, TFLOP/s and the ratio to ``torch._grouped_mm`` (no
    epilogue) on the same operands; ``variants(tg, a, b, sa, sb, splits)`` names the calls to time
    (a call that fails, e.g. a tile whose shared memory does not fit, is reported as its error)."""
    from hybridfp.kernels import triton_grouped_gemm as tg
    rows: list[dict[str, Any]] = []
    for name, splits, k, n in SHAPES:
        m = sum(splits)
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(len(splits), n, k, device="cuda", dtype=torch.bfloat16)
        sa = torch.rand(m, device="cuda") + 0.5
        sb = torch.rand(len(splits), n, device="cuda") + 0.5
        offs = torch.tensor(splits, device="cuda").cumsum(0).to(torch.int32)
        flop = 2.0 * m * n * k
        base = common.bench_ms(lambda: torch._grouped_mm(a, b.transpose(1, 2), offs=offs), 100, 500)
        rows.append(dict(shape=name, variant="torch._grouped_mm (no epilogue)", ms=base,
                         tflops=flop / base / 1e9, vs_grouped_mm=1.0))
        for variant, step in variants(tg, a, b, sa, sb, splits).items():
            try:
                ms = common.bench_ms(step, 100, 500)
            except Exception as e:  # noqa: BLE001 - reported in the table, the sweep goes on
                rows.append(dict(shape=name, variant=variant, error=f"{type(e).__name__}: {str(e)[:100]}"))
                continue
            rows.append(dict(shape=name, variant=variant, ms=ms, tflops=flop / ms / 1e9, vs_grouped_mm=base / ms))
    return rows


def run(tiles: list[tuple[tuple[int, int, int, int, int], int]]) -> list[dict[str, Any]]:
    """The pointer kernel at each (tile, swizzle group) of ``tiles``."""
    def variants(tg, a, b, sa, sb, splits):
        return {f"triton {t} g{g}": (lambda t=t, g=g: tg.grouped_rows(a, b, splits, scale_a=sa, scale_b=sb, tile=t,
                                                                      group_m=g, kernel="pointer"))
                for t, g in tiles}
    return _sweep(variants)


def _per_expert_fp32_epilogue(a: torch.Tensor, b: torch.Tensor, splits: list[int], sa: torch.Tensor,
                              sb: torch.Tensor) -> list[torch.Tensor]:
    """The alternative the kernel must beat, per expert: cuBLAS BF16 GEMM to FP32
    (``torch.mm(out_dtype=)``, as ``gemm/bf16_tensorcore.py`` calls it), the scales and the cast
    as torch ops."""
    outs, r = [], 0
    for e, m in enumerate(splits):
        if m:
            out = torch.mm(a[r:r + m], b[e].t(), out_dtype=torch.float32)
            outs.append(out.mul_(sa[r:r + m, None]).mul_(sb[e]).bfloat16())
        r += m
    return outs


def run_tma_f32() -> list[dict[str, Any]]:
    """The TMA kernel's FP32-output configs (TMA_F32_CONFIGS) with the same epilogue, against
    cuBLAS per expert with an FP32 output (``torch.mm(out_dtype=)``, no epilogue)."""
    def variants(tg, a, b, sa, sb, splits):
        def per_expert():
            r = 0
            for e, m in enumerate(splits):
                if m:
                    torch.mm(a[r:r + m], b[e].t(), out_dtype=torch.float32)
                r += m
        out = {"per-expert torch.mm FP32 out (no epilogue)": per_expert}
        for cname, cfg in tg.TMA_F32_CONFIGS.items():
            out[f"tma f32 {cname}"] = (lambda cfg=cfg: tg.grouped_rows(
                a, b, splits, scale_a=sa, scale_b=sb, kernel="tma", tma=cfg, out_dtype=torch.float32))
        return out
    return _sweep(variants)


def run_tma() -> list[dict[str, Any]]:
    """The TMA kernel at every TMA_CONFIGS entry next to the baselines, all with the row-scaled
    NVFP4 epilogue (per-row and per-column FP32 scales, BF16 output). (torch._grouped_mm with an
    FP32 output would be the other baseline; torch 2.11 refuses it for BF16 inputs: "Grouped gemm
    output dtype must match `mat_a` dtype", s21.)"""
    def variants(tg, a, b, sa, sb, splits):
        out = {"per-expert torch.mm FP32 out + epilogue as 3 torch passes":
               lambda: _per_expert_fp32_epilogue(a, b, splits, sa, sb),
               f"pointer {tg.TILE} g{tg.GROUP_M}":
               lambda: tg.grouped_rows(a, b, splits, scale_a=sa, scale_b=sb, kernel="pointer")}
        for cname, cfg in tg.TMA_CONFIGS.items():
            out[f"tma {cname}" + ("" if " g" in cname else f" g{cfg.group_m}")] = (
                lambda cfg=cfg: tg.grouped_rows(a, b, splits, scale_a=sa, scale_b=sb, kernel="tma", tma=cfg))
        return out
    return _sweep(variants)


def main(argv: Optional[list[str]] = None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--tma", action="store_true", help="the TMA kernel's configs against the baselines instead")
    p.add_argument("--tma-f32", action="store_true", help="the TMA kernel's FP32-output configs instead")
    args = p.parse_args(argv)
    require_cuda()
    columns = [("shape", "shape"), ("variant", "variant"), ("ms", "ms"), ("TFLOP/s", "tflops"),
               ("x torch._grouped_mm", "vs_grouped_mm")]
    if args.tma_f32:
        finish_rows("grouped_gemm_kernel_tma_f32", columns, run_tma_f32(), args.out)
    elif args.tma:
        finish_rows("grouped_gemm_kernel_tma", columns, run_tma(), args.out)
    else:
        finish_rows("grouped_gemm_kernel", columns, run(TILES[:2] if args.quick else TILES), args.out)


if __name__ == "__main__":
    main()
