"""The Triton grouped GEMM kernels against ``torch._grouped_mm`` and cuBLAS, at the MoE layer's shapes.

- ``bf16``: ``kernels/moe/triton_grouped_gemm.py`` (BF16 operands, the per-row / per-column FP32
  epilogue of row-scaled NVFP4) at the 8-expert MoE's fc1 / fc2 fprop (awkward counts, an empty
  expert). Every TMA config (``TMA_CONFIGS``) against ``torch._grouped_mm`` without an epilogue
  (the speed the kernel should approach), the pointer kernel at its default tile, and cuBLAS per
  expert with an FP32 output plus the epilogue as torch ops. ``torch._grouped_mm`` with an FP32
  output is no baseline: torch refuses it for BF16 inputs.
- ``fp8``: ``kernels/moe/triton_grouped_fp8_gemm.py`` / ``triton_grouped_fp8_tma.py`` at the
  64-expert MoE's six GEMMs (hidden 4096, ffn 1408, 32768 routed rows, uneven counts): the
  pointer kernel's default tile and the TMA configs (``CONFIGS``) against the per-expert cuBLAS
  ``_scaled_mm`` loop, ``torch._scaled_grouped_mm`` where it applies (E4M3 fprop / dgrad) and
  ``torch._grouped_mm`` on BF16 operands of the same shape (the MoE benchmark's baseline).

Median ms (``bench.common.bench_ms``: do_bench, L2 flushed), TFLOP/s and ratios (> 1: faster
than the baseline). A config that does not fit (shared memory) is reported as its error.

    python -m bench.bench_grouped_gemm [--out results.json] [--quick] [--part bf16|fp8]
        [--configs 'NAME|NAME']           # only these TMA configs
        [--f32]                           # bf16: the FP32-output configs (TMA_F32_CONFIGS)
        [--pointer-tiles [--wgrad]]       # the pointer kernels' tile sweeps instead
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from bench import common
from bench.common import finish_rows, parser, require_cuda

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# --- BF16 grouped GEMM, the 8-expert MoE's fprop ---------------------------------------------

#: (name, rows per expert, K, N): fc1 and fc2 of the 8-expert MoE layer of bench_moe
BF16_SHAPES = [("fc1 fprop 8x(4096->28672)", [4099, 0, 1, 5077, 6000, 31, 8192, 9368], 4096, 28672),
               ("fc2 fprop 8x(14336->4096)", [4099, 0, 1, 5077, 6000, 31, 8192, 9368], 14336, 4096)]
#: ((BM, BN, BK, warps, stages), group_m: the L2 swizzle's row tiles per group, 1 = none)
BF16_TILES = [((128, 256, 64, 8, 3), 1), ((128, 128, 64, 8, 3), 8), ((128, 256, 64, 8, 3), 8),
              ((128, 256, 64, 8, 3), 16), ((128, 256, 64, 8, 4), 8), ((256, 128, 64, 8, 3), 8),
              ((256, 128, 64, 8, 4), 8), ((128, 256, 32, 8, 5), 8), ((128, 128, 64, 4, 4), 8)]

Variants = Callable[..., dict[str, Callable[[], Any]]]


def _bf16_sweep(variants: Variants) -> list[dict[str, Any]]:
    """One row per (shape, variant); ``variants(tg, a, b, sa, sb, splits)`` names the calls to time."""
    from hybridfp.kernels.moe import triton_grouped_gemm as tg
    rows: list[dict[str, Any]] = []
    for name, splits, k, n in BF16_SHAPES:
        m = sum(splits)
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(len(splits), n, k, device="cuda", dtype=torch.bfloat16)
        sa = torch.rand(m, device="cuda") + 0.5
        sb = torch.rand(len(splits), n, device="cuda") + 0.5
        offs = torch.tensor(splits, device="cuda").cumsum(0).to(torch.int32)
        flop = 2.0 * m * n * k
        base = common.bench_ms(lambda: torch._grouped_mm(a, b.transpose(1, 2), offs=offs), 100, 500)
        rows.append(dict(part="bf16", gemm=name, variant="torch._grouped_mm (no epilogue)", ms=base,
                         tflops=flop / base / 1e9, vs_grouped_mm=1.0))
        for variant, step in variants(tg, a, b, sa, sb, splits).items():
            try:
                ms = common.bench_ms(step, 100, 500)
            except Exception as e:  # noqa: BLE001 - reported in the table, the sweep goes on
                rows.append(dict(part="bf16", gemm=name, variant=variant, error=f"{type(e).__name__}: {str(e)[:100]}"))
                continue
            rows.append(dict(part="bf16", gemm=name, variant=variant, ms=ms, tflops=flop / ms / 1e9,
                             vs_grouped_mm=base / ms))
    return rows


def bf16_pointer_tiles(tiles: list[tuple[tuple[int, int, int, int, int], int]]) -> list[dict[str, Any]]:
    """The pointer kernel at each (tile, swizzle group) of ``tiles``."""
    def variants(tg, a, b, sa, sb, splits):
        return {f"pointer {t} g{g}": (lambda t=t, g=g: tg.grouped_rows(a, b, splits, scale_a=sa, scale_b=sb, tile=t,
                                                                       group_m=g, kernel="pointer"))
                for t, g in tiles}
    return _bf16_sweep(variants)


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


def bf16_tma(configs: Optional[list[str]] = None) -> list[dict[str, Any]]:
    """The TMA kernel at every ``TMA_CONFIGS`` entry next to the baselines, all with the row-scaled
    NVFP4 epilogue (per-row and per-column FP32 scales, BF16 output)."""
    def variants(tg, a, b, sa, sb, splits):
        out = {"per-expert torch.mm FP32 out + epilogue as 3 torch passes":
               lambda: _per_expert_fp32_epilogue(a, b, splits, sa, sb),
               f"pointer {tg.TILE} g{tg.GROUP_M}":
               lambda: tg.grouped_rows(a, b, splits, scale_a=sa, scale_b=sb, kernel="pointer")}
        for cname, cfg in tg.TMA_CONFIGS.items():
            if configs and cname not in configs:
                continue
            out[f"tma {cname}" + ("" if " g" in cname else f" g{cfg.group_m}")] = (
                lambda cfg=cfg: tg.grouped_rows(a, b, splits, scale_a=sa, scale_b=sb, kernel="tma", tma=cfg))
        return out
    return _bf16_sweep(variants)


def bf16_tma_f32(configs: Optional[list[str]] = None) -> list[dict[str, Any]]:
    """The TMA kernel's FP32-output configs (``TMA_F32_CONFIGS``) with the same epilogue, against
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
            if configs and cname not in configs:
                continue
            out[f"tma f32 {cname}"] = (lambda cfg=cfg: tg.grouped_rows(
                a, b, splits, scale_a=sa, scale_b=sb, kernel="tma", tma=cfg, out_dtype=torch.float32))
        return out
    return _bf16_sweep(variants)


# --- FP8 grouped GEMM, the 64-expert MoE's six GEMMs -----------------------------------------

HIDDEN, FFN, ROWS, EXPERTS = 4096, 1408, 32768, 64
#: ((BM, BN, BK, warps, stages), group_m, promote)
FP8_TILES = [((128, 128, 128, 8, 4), 8, 128), ((128, 128, 128, 8, 4), 8, 1 << 30), ((128, 256, 128, 8, 3), 8, 128),
             ((128, 128, 128, 4, 4), 8, 128), ((128, 128, 64, 4, 5), 8, 64), ((64, 128, 128, 4, 4), 8, 128),
             ((128, 64, 128, 4, 4), 8, 128), ((128, 128, 128, 8, 3), 1, 128)]
#: ``--pointer-tiles --wgrad``: the reduction-grouped GEMMs only (short K loops: each expert's few
#: hundred tokens), over shallower / smaller tiles that let more programs share an SM
FP8_WGRAD_TILES = [((128, 128, 64, 4, 5), 8, 64), ((128, 128, 64, 4, 3), 8, 64), ((128, 128, 64, 4, 4), 8, 64),
                   ((64, 128, 64, 4, 4), 8, 64), ((128, 64, 64, 4, 4), 8, 64), ((128, 128, 32, 4, 6), 8, 32),
                   ((128, 256, 64, 8, 3), 8, 64), ((256, 128, 64, 8, 3), 8, 64), ((128, 128, 64, 8, 4), 8, 64),
                   ((128, 128, 64, 4, 5), 16, 64), ((128, 128, 64, 4, 5), 2, 64), ((64, 64, 64, 4, 4), 8, 64)]


def splits_for(rows: int, experts: int) -> list[int]:
    """Uneven positive counts that sum to ``rows`` (every 3rd expert weighted 1.25, not multiples
    of 32)."""
    w = [1.25 if e % 3 == 0 else 1.0 for e in range(experts)]
    base = [int(rows * x / sum(w)) for x in w]
    base[-1] += rows - sum(base)
    assert min(base) > 0 and sum(base) == rows
    return base


def _fp8(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * 4).to(dtype)


def _fp8_cases(splits: list[int]) -> list[tuple[str, dict[str, Any]]]:
    """(name, operands) per GEMM of one GroupedLinear pair (fc1 4096 -> 2x1408 gate/up, fc2 1408
    -> 4096): fprop / dgrad rows grouped, wgrad reduction grouped over the experts' tokens."""
    e = len(splits)
    lds = [-(-m // 16) * 16 for m in splits]
    out = []
    for name, k, n in (("fc1", HIDDEN, 2 * FFN), ("fc2", FFN, HIDDEN)):
        x = _fp8((sum(splits), k), E4M3)
        w = _fp8((e, n, k), E4M3)
        wt = _fp8((e, k, n), E4M3)
        dy = _fp8((sum(splits), n), E5M2)
        dyc = [_fp8((n, ld), E5M2) for ld in lds]
        xc = [_fp8((k, ld), E4M3) for ld in lds]
        out.append((f"{name} fprop", dict(a=list(torch.split(x, splits)), b=list(w.unbind(0)), ks=[k] * e,
                                          m=sum(splits), n=n, k=k, rows=True)))
        out.append((f"{name} dgrad (E5M2 dy)", dict(a=list(torch.split(dy, splits)), b=list(wt.unbind(0)), ks=[n] * e,
                                                    m=sum(splits), n=k, k=n, rows=True)))
        out.append((f"{name} wgrad", dict(a=dyc, b=xc, ks=lds, m=n, n=k, k=sum(splits), rows=False)))
    return out


def _cublas_loop(c: dict[str, Any]) -> Callable[[], Any]:
    one = torch.ones((), device="cuda")

    def run() -> None:
        for a, b in zip(c["a"], c["b"]):
            if a.shape[0] and a.shape[1]:
                torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16)
    return run


def fp8(tiles: list[tuple[tuple[int, int, int, int, int], int, int]], only: str = "",
        tma: bool = False, configs: Optional[list[str]] = None) -> list[dict[str, Any]]:
    """One row per (GEMM, variant); ``tma``: the pointer kernel at its default tile and the TMA
    configs (``tiles`` ignored), else the pointer kernel at each of ``tiles``."""
    from hybridfp.kernels.moe import triton_grouped_fp8_gemm as tk
    from hybridfp.kernels.moe.triton_grouped_fp8_tma import CONFIGS
    splits = splits_for(ROWS, EXPERTS)
    rows: list[dict[str, Any]] = []
    sa = torch.rand(EXPERTS, device="cuda") + 0.5
    sb = torch.rand(EXPERTS, device="cuda") + 0.5
    for name, c in _fp8_cases(splits):
        if only not in name:
            continue
        flop = 2.0 * c["m"] * c["n"] * c["k"] if c["rows"] else 2.0 * EXPERTS * c["m"] * c["n"] * (c["k"] / EXPERTS)
        out_rows = [sum(splits[:i]) for i in range(EXPERTS)] if c["rows"] else [i * c["m"] for i in range(EXPERTS)]
        out = torch.empty((c["m"] if c["rows"] else EXPERTS * c["m"], c["n"]), device="cuda", dtype=torch.bfloat16)
        ref: dict[str, float] = {}

        def add(variant: str, fn: Callable[[], Any]) -> float:
            ms = common.bench_ms(fn, 100, 500)
            rows.append(dict(part="fp8", gemm=name, variant=variant, ms=ms, tflops=flop / ms / 1e9,
                             vs_cublas=ref["cublas"] / ms if "cublas" in ref else None,
                             vs_grouped_mm=ref["bf16"] / ms if "bf16" in ref else None))
            return ms

        def add_or_error(variant: str, fn: Callable[[], Any]) -> None:
            try:
                add(variant, fn)
            except Exception as e:  # noqa: BLE001 - a config that does not fit (shared memory) is reported
                rows.append(dict(part="fp8", gemm=name, variant=variant, error=f"{type(e).__name__}: {str(e)[:100]}"))

        ref["cublas"] = add("cuBLAS _scaled_mm per expert", _cublas_loop(c))
        if c["rows"]:
            bf_a = torch.randn(c["m"], c["k"], device="cuda", dtype=torch.bfloat16)
            bf_b = torch.randn(EXPERTS, c["k"], c["n"], device="cuda", dtype=torch.bfloat16)
            offs = torch.tensor(splits, device="cuda").cumsum(0).to(torch.int32)
        else:  # BF16 wgrad as the MoE baseline runs it: 2D x 2D, groups along K
            # (CUTLASS needs 16-byte aligned group offsets: the 16-padded token counts, +0.4 % work)
            bf_a = torch.randn(c["m"], sum(c["ks"]), device="cuda", dtype=torch.bfloat16)
            bf_b = torch.randn(sum(c["ks"]), c["n"], device="cuda", dtype=torch.bfloat16)
            offs = torch.tensor(c["ks"], device="cuda").cumsum(0).to(torch.int32)
        ref["bf16"] = add("BF16 torch._grouped_mm", lambda: torch._grouped_mm(bf_a, bf_b, offs=offs))
        if c["rows"] and c["a"][0].dtype == E4M3:
            whole = torch.cat(c["a"])
            stacked = torch.stack(c["b"]).transpose(1, 2)
            ra = torch.ones(c["m"], device="cuda")
            rb = torch.ones(EXPERTS, c["n"], device="cuda")
            add("torch._scaled_grouped_mm", lambda: torch._scaled_grouped_mm(
                whole, stacked, ra, rb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=False))
        if tma:
            tiles = [(tk.TILE if c["rows"] else tk.WGRAD_TILE, tk.GROUP_M, tk.PROMOTE)]
            for cname, cfg in CONFIGS.items():
                if configs and cname not in configs:
                    continue
                add_or_error(f"tma {cname}", lambda cfg=cfg: tk.grouped_fp8(c["a"], c["b"], c["ks"], sa, sb, out,
                                                                           out_rows, tma=cfg))
        for t, g, p in tiles:
            add_or_error(f"pointer {t} g{g} promote {p}",
                         lambda t=t, g=g, p=p: tk.grouped_fp8(c["a"], c["b"], c["ks"], sa, sb, out, out_rows,
                                                              tile=t, group_m=g, promote=p))
    return rows


def main(argv: Optional[list[str]] = None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--part", choices=["bf16", "fp8"], default=None, help="one kernel family only")
    p.add_argument("--configs", default=None, help="only these '|'-separated TMA config names")
    p.add_argument("--f32", action="store_true", help="bf16: the FP32-output TMA configs")
    p.add_argument("--pointer-tiles", action="store_true", help="the pointer kernels' tile sweeps instead")
    p.add_argument("--wgrad", action="store_true", help="with --pointer-tiles: fp8 wgrad GEMMs over FP8_WGRAD_TILES")
    args = p.parse_args(argv)
    require_cuda()
    configs = args.configs.split("|") if args.configs else None
    if args.quick and configs is None:  # the kernels' defaults only
        from hybridfp import current_policy
        from hybridfp.kernels.moe import triton_grouped_gemm as tg
        pol = current_policy()
        configs = [k for k, v in tg.TMA_CONFIGS.items() if v == tg.TMA_CONFIG] + [
            c for c in (pol.grouped_fp8_tma_rows, pol.grouped_fp8_tma_wgrad) if c]
    rows: list[dict[str, Any]] = []
    if args.part in (None, "bf16"):
        if args.pointer_tiles:
            rows += bf16_pointer_tiles(BF16_TILES[:2] if args.quick else BF16_TILES)
        else:
            rows += (bf16_tma_f32 if args.f32 else bf16_tma)(configs)
    if args.part in (None, "fp8"):
        if args.pointer_tiles:
            rows += fp8(FP8_WGRAD_TILES if args.wgrad else FP8_TILES[:1] if args.quick else FP8_TILES,
                        "wgrad" if args.wgrad else "")
        else:
            rows += fp8([], tma=True, configs=configs)
    columns = [("kernel", "part"), ("GEMM", "gemm"), ("variant", "variant"), ("ms", "ms"), ("TFLOP/s", "tflops"),
               ("x torch._grouped_mm", "vs_grouped_mm"), ("x cuBLAS per expert (fp8)", "vs_cublas")]
    finish_rows("grouped_gemm", columns, rows, args.out)


if __name__ == "__main__":
    main()
