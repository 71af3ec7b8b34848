"""Mixed-format GEMM throughput on Hopper: exact BF16 tensor-core path vs BF16 ``a @ b.t()``.

Pairs (operands quantized beforehand by the library's quantizers, on the GPU), each through
``hybridfp.gemm.gemm`` (the backend it selects is recorded):

| pair                           | layout | path                                          |
|--------------------------------|--------|-----------------------------------------------|
| MXFP8 x MXFP8                  | TN     | decode both + cuBLAS BF16                     |
| NVFP4 x NVFP4 (2D weight)      | TN     | decode both + cuBLAS BF16 + scale epilogue    |
| NVFP4 x MXFP8                  | TN     | decode both + cuBLAS BF16 + scale epilogue    |
| NVFP4-RHT x NVFP4-RHT (wgrad)  | NT     | decode both, RHT domain, + scale epilogue     |
| MXFP8 x NVFP4-RHT (wgrad)      | NT     | bf16_split_rht: inverse RHT, BF16 hi+mid(+lo) |
| FP8 per-tensor x MXFP8         | TN     | decode both + cuBLAS BF16 + scale epilogue    |
| BF16 Identity x MXFP8          | TN     | decode B + cuBLAS BF16                        |

Shapes: 8192^3 and the Llama-3-8B MLP up projection (16384 tokens, 4096 -> 14336): fprop
[m, n, k] = [16384, 14336, 4096] for TN pairs, wgrad [14336, 4096, 16384] for NT pairs.
"cold": every call decodes both operands (``cache_weight_decodes(False)``); "warm": operand
B's decode (the weight of fprop / dgrad) is cached, as in the micro-batches of a step.
Ratios are against BF16 ``a @ b.t()`` of the same shape in the same process, timed
alternately (``bench_pair``). The decode kernels' bandwidth (bytes read + written) is
compared with a device copy, at 8192^2, for a few tile shapes.

    python -m bench.bench_gemm_pairs [--out results.json] [--quick]
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

from bench import common
from bench.common import (bench_ms, bench_pair, copy_bandwidth, environment, finish, md_table, parser,
                          require_cuda, tflops)
from hybridfp import (Float8CurrentScalingQuantizer, IdentityQuantizer, MXFP8Quantizer, NVFP4Quantizer,
                      Quantizer)
from hybridfp.gemm import bf16_decode, bf16_tensorcore, gemm, operand_storage, select
from hybridfp.gemm.gemm import LAYOUTS
from hybridfp.kernels import triton_decode
from hybridfp.tensors.storage import COLUMNWISE, ROWWISE

E4M3 = torch.float8_e4m3fn
Maker = Callable[[], Quantizer]
PAIRS: list[tuple[str, str, Maker, Maker]] = [  # name, layout, A quantizer, B quantizer
    ("MXFP8 x MXFP8", "TN", MXFP8Quantizer, MXFP8Quantizer),
    ("NVFP4 x NVFP4-2D", "TN", NVFP4Quantizer, lambda: NVFP4Quantizer(with_2d_quantization=True)),
    ("NVFP4 x MXFP8", "TN", NVFP4Quantizer, MXFP8Quantizer),
    ("NVFP4-RHT x NVFP4-RHT wgrad", "NT", lambda: NVFP4Quantizer(with_rht=True),
     lambda: NVFP4Quantizer(with_rht=True)),
    ("MXFP8 x NVFP4-RHT wgrad", "NT", MXFP8Quantizer, lambda: NVFP4Quantizer(with_rht=True)),
    ("FP8 per-tensor x MXFP8", "TN", lambda: Float8CurrentScalingQuantizer(E4M3), MXFP8Quantizer),
    ("BF16 Identity x MXFP8", "TN", lambda: IdentityQuantizer(torch.bfloat16), MXFP8Quantizer),
]
SHAPES = {"TN": [("8192^3", 8192, 8192, 8192), ("llama3-8b up fprop", 16384, 14336, 4096)],
          "NT": [("8192^3", 8192, 8192, 8192), ("llama3-8b up wgrad", 14336, 4096, 16384)]}
QUICK_SHAPES = {"TN": [("2048^3", 2048, 2048, 2048)], "NT": [("2048^3", 2048, 2048, 2048)]}
#: decode kernels measured for bandwidth: name, quantizer
DECODES: list[tuple[str, Maker]] = [
    ("MXFP8 1x32", MXFP8Quantizer),
    ("MXFP8 32x32", lambda: MXFP8Quantizer(with_2d_quantization=True)),
    ("NVFP4 1x16", NVFP4Quantizer),
    ("NVFP4 16x16", lambda: NVFP4Quantizer(with_2d_quantization=True)),
    ("FP8 per-tensor", lambda: Float8CurrentScalingQuantizer(E4M3)),
]
#: tile shapes (rows, cols, warps) swept for the 1D decodes; the others run the first (the
#: kernels' default)
TILES = [(32, 256, 4), (64, 128, 4), (16, 256, 4), (8, 256, 4), (16, 512, 8), (8, 512, 4)]
SWEPT = ("MXFP8 1x32", "NVFP4 1x16")
#: an emulated pair runs an FP32 GEMM (~50 TFLOP/s): fewer timing rounds
SLOW_ROUNDS = 1


def _operands(layout: str, qa: Quantizer, qb: Quantizer, m: int, n: int, k: int):
    """Quantized A, B whose ``layout`` copies are [m, k] and [n, k] (only those copies made)."""
    da, db = LAYOUTS[layout]
    out = []
    for q, d, (r, c) in ((qa, da, (m, k)), (qb, db, (n, k))):
        shape = (r, c) if d == ROWWISE else (c, r)
        src = torch.randn(*shape, device=common.DEVICE, dtype=torch.bfloat16)
        q.set_usage(rowwise=d == ROWWISE, columnwise=d == COLUMNWISE)
        out.append(q.quantize(src))
        del src
    return out


def bench_pair_shape(name: str, layout: str, make_a: Maker, make_b: Maker,
                     shape: tuple[str, int, int, int]) -> dict[str, Any]:
    """TFLOP/s of one pair at one shape: BF16 baseline, hybridfp cold and warm."""
    sname, m, n, k = shape
    flops = 2.0 * m * n * k
    row: dict[str, Any] = {"pair": name, "layout": layout, "shape": sname, "m": m, "n": n, "k": k}
    A, B = _operands(layout, make_a(), make_b(), m, n, k)
    da, db = LAYOUTS[layout]
    sa, sb = operand_storage(A, da, "A"), operand_storage(B, db, "B")
    backend = select(sa.format_key(da), sb.format_key(db), layout, sa.device)
    row["backend"] = backend.name if backend else "emulation"
    a16 = torch.randn(m, k, device=common.DEVICE, dtype=torch.bfloat16)
    b16 = torch.randn(n, k, device=common.DEVICE, dtype=torch.bfloat16)
    base = lambda: a16 @ b16.t()  # noqa: E731
    lib = lambda: gemm(A, B, layout)  # noqa: E731
    rounds = 3 if backend is not None else SLOW_ROUNDS
    bf16_tensorcore.cache_weight_decodes(False)
    try:
        t_base, t_cold = bench_pair(base, lib, rounds)
    finally:
        bf16_tensorcore.cache_weight_decodes(True)
    bf16_decode.clear_decode_cache()
    lib()  # fills the cache (B of fprop / dgrad)
    t_base2, t_warm = bench_pair(base, lib, rounds)
    bf16_decode.clear_decode_cache()
    row["bf16"] = tflops(flops, min(t_base, t_base2))
    row["cold"], row["warm"] = tflops(flops, t_cold), tflops(flops, t_warm)
    row["cold_ratio"], row["warm_ratio"] = t_base / t_cold, t_base2 / t_warm
    return row


def bench_decode(name: str, make: Maker, rows: int, cols: int, copy_gbps: float) -> list[dict[str, Any]]:
    """Bandwidth of the rowwise decode at a few tile shapes, vs a device copy."""
    q = make()
    q.set_usage(rowwise=True, columnwise=False)
    s = q.quantize(torch.randn(rows, cols, device=common.DEVICE, dtype=torch.bfloat16)).qstorage
    p = s.payload(ROWWISE)
    nbytes = sum(t.numel() * t.element_size() for t in p.values()) + rows * cols * 2
    out = []
    two_d = bool(s.meta.get("block_2d", False))
    # NVFP4: the per-element store and the int32-pair store (triton_decode.PAIRS_BY_DEFAULT)
    variants = (False, True) if name.startswith("NVFP4") else (False,)
    for (br, bc, warps), pairs in ((t, v) for t in (TILES if name in SWEPT else TILES[:1]) for v in variants):
        launch = {"tile": (br, bc), "num_warps": warps}
        if name.startswith("MXFP8"):
            fn = lambda: triton_decode.decode_mxfp8(p["data"], p["scale"], block_2d=two_d, **launch)  # noqa: E731
        elif name.startswith("NVFP4"):
            fn = lambda: triton_decode.decode_nvfp4(p["data"], p["scale"], cols, block_2d=two_d,  # noqa: E731
                                                    pairs=pairs, **launch)
        else:
            fn = lambda: triton_decode.decode_fp8(p["data"], **launch)  # noqa: E731
        ms = bench_ms(fn)
        gbps = nbytes / ms / 1e6
        out.append({"decode": name + (" (int32 pairs)" if pairs else ""), "tile": f"{br}x{bc}/{warps}w",
                    "ms": ms, "GBps": gbps, "vs_copy": gbps / copy_gbps})
    return out


def main(argv=None) -> None:
    p = parser(__doc__.splitlines()[0])
    args = p.parse_args(argv)
    require_cuda()
    warnings.simplefilter("ignore")  # the emulated pair's report; what is measured is the time
    env = environment()
    copy = copy_bandwidth()
    shapes = QUICK_SHAPES if args.quick else SHAPES
    rows = []
    for name, layout, ma, mb in PAIRS:
        for shape in shapes[layout]:
            rows.append(bench_pair_shape(name, layout, ma, mb, shape))
            torch.cuda.empty_cache()  # the pair's operands are gone: return their memory
    n = 2048 if args.quick else 8192
    decodes = [r for name, make in DECODES for r in bench_decode(name, make, n, n, copy["GBps"])]
    gemm_table = md_table(
        ["pair", "layout", "shape", "backend", "BF16 TFLOP/s", "cold", "cold/BF16", "warm", "warm/BF16"],
        [(r["pair"], r["layout"], r["shape"], r["backend"], r["bf16"], r["cold"], r["cold_ratio"],
          r["warm"], r["warm_ratio"]) for r in rows])
    decode_table = md_table(["decode", "tile/warps", "ms", "GB/s", "vs copy"],
                            [(r["decode"], r["tile"], r["ms"], r["GBps"], r["vs_copy"]) for r in decodes])
    md = ("### Mixed-format GEMMs through hybridfp.gemm vs BF16 a @ b.t() (TFLOP/s, median)\n\n"
          "cold: both operands decoded per call; warm: B's decoded copy cached.\n\n" + gemm_table +
          f"\n\n### Decode kernels at {n}x{n} (bytes read + written; device copy "
          f"{copy['GBps']:.0f} GB/s)\n\n" + decode_table + "\n")
    finish("gemm_pairs", {"env": env, "copy_bandwidth": copy, "rows": rows, "decodes": decodes, "markdown": md},
           args.out)


if __name__ == "__main__":
    main()
