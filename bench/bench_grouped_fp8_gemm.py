"""The Triton FP8 grouped GEMM (``kernels/triton_grouped_fp8_gemm.py``) at the 64-expert MoE
layer's shapes (hidden 4096, ffn 1408, 32768 routed rows, uneven counts), per GEMM, against:
the per-expert cuBLAS ``_scaled_mm`` loop it replaces (what ``grouped_gemm`` ran before),
``torch._scaled_grouped_mm`` where it applies (E4M3 fprop / dgrad) and ``torch._grouped_mm`` on
BF16 operands of the same shape (the MoE benchmark's baseline). Tiles swept; ``promote`` 2**30
(no FP32 promotion: fast accumulation, not used by hybridfp) shows what the promotion costs.
Median ms (do_bench, L2 flushed) and TFLOP/s.

    python -m bench.bench_grouped_fp8_gemm [--out results.json] [--quick: default tile only] [--wgrad]
        [--tma: the pointer kernel's defaults against the TMA kernel's configs, every GEMM]
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from bench import common
from bench.bench_grouped_fp8 import splits_for
from bench.common import finish_rows, parser, require_cuda

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HIDDEN, FFN, ROWS, EXPERTS = 4096, 1408, 32768, 64
#: ((BM, BN, BK, warps, stages), group_m, promote)
TILES = [((128, 128, 128, 8, 4), 8, 128), ((128, 128, 128, 8, 4), 8, 1 << 30), ((128, 256, 128, 8, 3), 8, 128),
         ((128, 128, 128, 4, 4), 8, 128), ((128, 128, 64, 4, 5), 8, 64), ((64, 128, 128, 4, 4), 8, 128),
         ((128, 64, 128, 4, 4), 8, 128), ((128, 128, 128, 8, 3), 1, 128)]
#: ``--wgrad``: the reduction-grouped GEMMs only (short K loops: each expert's few hundred
#: tokens), over shallower / smaller tiles that let more programs share an SM
WGRAD_TILES = [((128, 128, 64, 4, 5), 8, 64), ((128, 128, 64, 4, 3), 8, 64), ((128, 128, 64, 4, 4), 8, 64),
               ((64, 128, 64, 4, 4), 8, 64), ((128, 64, 64, 4, 4), 8, 64), ((128, 128, 32, 4, 6), 8, 32),
               ((128, 256, 64, 8, 3), 8, 64), ((256, 128, 64, 8, 3), 8, 64), ((128, 128, 64, 8, 4), 8, 64),
               ((128, 128, 64, 4, 5), 16, 64), ((128, 128, 64, 4, 5), 2, 64), ((64, 64, 64, 4, 4), 8, 64)]


def _fp8(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * 4).to(dtype)


def _cases(splits: list[int]) -> list[tuple[str, dict[str, Any]]]:
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


def _cublas_loop(c: dict[str, Any], sa: torch.Tensor, sb: torch.Tensor) -> Callable[[], Any]:
    one = torch.ones((), device="cuda")

    def run() -> None:
        for a, b in zip(c["a"], c["b"]):
            if a.shape[0] and a.shape[1]:
                torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16)
    return run


def run(tiles: list[tuple[tuple[int, int, int, int, int], int, int]], only: str = "",
        tma: bool = False, tma_configs: Optional[list[str]] = None) -> list[dict[str, Any]]:
    from hybridfp.kernels import triton_grouped_fp8_gemm as tk
    from hybridfp.kernels.triton_grouped_fp8_tma import CONFIGS
    splits = splits_for(ROWS, EXPERTS)
    rows: list[dict[str, Any]] = []
    sa = torch.rand(EXPERTS, device="cuda") + 0.5
    sb = torch.rand(EXPERTS, device="cuda") + 0.5
    for name, c in _cases(splits):
        if only not in name:
            continue
        flop = 2.0 * c["m"] * c["n"] * c["k"] if c["rows"] else 2.0 * EXPERTS * c["m"] * c["n"] * (c["k"] / EXPERTS)
        out_rows = [sum(splits[:i]) for i in range(EXPERTS)] if c["rows"] else [i * c["m"] for i in range(EXPERTS)]
        out = torch.empty((c["m"] if c["rows"] else EXPERTS * c["m"], c["n"]), device="cuda", dtype=torch.bfloat16)

        def add(variant: str, fn: Callable[[], Any], base: Optional[float] = None) -> float:
            ms = common.bench_ms(fn, 100, 500)
            rows.append(dict(gemm=name, variant=variant, ms=ms, tflops=flop / ms / 1e9,
                             vs_cublas=None if base is None else base / ms))
            return ms
        base = add("cuBLAS _scaled_mm per expert", _cublas_loop(c, sa, sb))
        if not c["rows"]:  # BF16 wgrad as the MoE baseline runs it: 2D x 2D, groups along K
            # (CUTLASS needs 16-byte aligned group offsets: the 16-padded token counts, +0.4 % work)
            lds = c["ks"]
            bf_a = torch.randn(c["m"], sum(lds), device="cuda", dtype=torch.bfloat16)
            bf_b = torch.randn(sum(lds), c["n"], device="cuda", dtype=torch.bfloat16)
            offs = torch.tensor(lds, device="cuda").cumsum(0).to(torch.int32)
            add("BF16 torch._grouped_mm", lambda: torch._grouped_mm(bf_a, bf_b, offs=offs), base)
        if c["rows"]:
            bf_a = torch.randn(c["m"], c["k"], device="cuda", dtype=torch.bfloat16)
            bf_b = torch.randn(EXPERTS, c["k"], c["n"], device="cuda", dtype=torch.bfloat16)
            offs = torch.tensor(splits, device="cuda").cumsum(0).to(torch.int32)
            add("BF16 torch._grouped_mm", lambda: torch._grouped_mm(bf_a, bf_b, offs=offs), base)
            if c["a"][0].dtype == E4M3:
                whole = torch.cat(c["a"])
                stacked = torch.stack(c["b"]).transpose(1, 2)
                ra = torch.ones(c["m"], device="cuda")
                rb = torch.ones(EXPERTS, c["n"], device="cuda")
                add("torch._scaled_grouped_mm", lambda: torch._scaled_grouped_mm(
                    whole, stacked, ra, rb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=False), base)
        if tma:
            default = tk.TILE if c["rows"] else tk.WGRAD_TILE
            tiles = [(default, tk.GROUP_M, tk.PROMOTE)]
            for cname, cfg in CONFIGS.items():
                if tma_configs and cname not in tma_configs:
                    continue
                def step_tma(cfg=cfg):
                    return tk.grouped_fp8(c["a"], c["b"], c["ks"], sa, sb, out, out_rows, tma=cfg)
                try:
                    add(f"triton TMA {cname}", step_tma, base)
                except Exception as e:  # noqa: BLE001 - a config that does not fit is reported
                    rows.append(dict(gemm=name, variant=f"triton TMA {cname}", error=f"{type(e).__name__}: {str(e)[:100]}"))
        for t, g, p in tiles:
            def step(t=t, g=g, p=p):
                return tk.grouped_fp8(c["a"], c["b"], c["ks"], sa, sb, out, out_rows, tile=t, group_m=g, promote=p)
            try:
                add(f"triton {t} g{g} promote {p}", step, base)
            except Exception as e:  # noqa: BLE001 - a tile that does not fit (shared memory) is reported
                rows.append(dict(gemm=name, variant=f"triton {t} g{g} promote {p}",
                                 error=f"{type(e).__name__}: {str(e)[:100]}"))
    return rows


def main(argv: Optional[list[str]] = None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--wgrad", action="store_true", help="the wgrad GEMMs only, over WGRAD_TILES")
    p.add_argument("--tma", action="store_true", help="every GEMM: the pointer kernel's default tile against "
                   "the TMA kernel's configs (triton_grouped_fp8_tma.CONFIGS)")
    p.add_argument("--tma-configs", default=None, help="with --tma: only these '|'-separated config names")
    args = p.parse_args(argv)
    require_cuda()
    columns = [("GEMM", "gemm"), ("variant", "variant"), ("ms", "ms"), ("TFLOP/s", "tflops"),
               ("x cuBLAS loop", "vs_cublas")]
    finish_rows("grouped_fp8_gemm", columns, run(WGRAD_TILES if args.wgrad else TILES[:1] if args.quick else TILES,
                                                       "wgrad" if args.wgrad else "", tma=args.tma,
                                                       tma_configs=args.tma_configs.split("|") if args.tma_configs else None),
                args.out)


if __name__ == "__main__":
    main()
