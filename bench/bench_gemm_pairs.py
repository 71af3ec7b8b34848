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
"cold": every call decodes both operands (``policy(cache_weight_decodes=False)``); "warm": operand
B's decode (the weight of fprop / dgrad) is cached, as in the micro-batches of a step.
Every ratio is paired (``bench.protocol.paired_ratio``: median of per-round ratios over
alternating rounds, with its ≥ 95 % interval) against two BF16 ``a @ b.t()`` baselines of the
same shape in the same process: one on ``randn`` operands, one on the very values the quantized
GEMM multiplies (the operands' BF16 decodes, RHT domain where the copy is): a GEMM's speed
moves with its operand values under the GPU's power cap, and decoded values (3-4-bit
mantissas) run faster than ``randn``, so only the second ratio isolates the path's cost. Each
pair's output is checked against the FP32 product of the unquantized operands
(``common.error_bound`` of its element formats); a pair beyond its bound fails the run.
The decode kernels' bandwidth (bytes read + written) is compared with a device copy, at
8192^2, for a few tile shapes.

    python -m bench.bench_gemm_pairs [--out results.json] [--quick] [--rounds N] [--samples N]
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

from bench import common
from bench.common import (AccuracyError, bench_ms, check_error, copy_bandwidth, environment, error_bound,
                          finish, md_table, parser, protocol_from, protocol_record, rel_error, require_cuda,
                          tflops)
from bench.protocol import Protocol, paired_ratio
from hybridfp import (Float8CurrentScalingQuantizer, IdentityQuantizer, MXFP8Quantizer, NVFP4Quantizer, policy,
                      Quantizer)
from hybridfp.gemm import bf16_decode, gemm, operand_storage, select
from hybridfp.gemm.bf16_decode import decode_bf16
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
#: element format of each pair's A and B copies (``common.MANTISSA_BITS`` keys): the error bound
FORMATS: dict[str, tuple[str, str]] = {
    "MXFP8 x MXFP8": ("e4m3", "e4m3"), "NVFP4 x NVFP4-2D": ("e2m1", "e2m1"), "NVFP4 x MXFP8": ("e2m1", "e4m3"),
    "NVFP4-RHT x NVFP4-RHT wgrad": ("e2m1", "e2m1"), "MXFP8 x NVFP4-RHT wgrad": ("e4m3", "e2m1"),
    "FP8 per-tensor x MXFP8": ("e4m3", "e4m3"), "BF16 Identity x MXFP8": ("bf16", "e4m3"),
}
SHAPES = {"TN": [("8192^3", 8192, 8192, 8192), ("llama3-8b up fprop", 16384, 14336, 4096)],
          "NT": [("8192^3", 8192, 8192, 8192), ("llama3-8b up wgrad", 14336, 4096, 16384)]}
QUICK_SHAPES = {"TN": [("2048^3", 2048, 2048, 2048)], "NT": [("2048^3", 2048, 2048, 2048)]}
#: decode-bandwidth matrix side (rows = cols), full and --quick
DECODE_N, QUICK_DECODE_N = 8192, 2048
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


def _operands(layout: str, qa: Quantizer, qb: Quantizer, m: int, n: int, k: int):
    """Quantized A, B whose ``layout`` copies are [m, k] and [n, k] (only those copies made), and
    the FP32 product of their unquantized sources, [m, n] (the reference)."""
    da, db = LAYOUTS[layout]
    out, mk = [], []
    for q, d, (r, c) in ((qa, da, (m, k)), (qb, db, (n, k))):
        shape = (r, c) if d == ROWWISE else (c, r)
        src = torch.randn(*shape, device=common.DEVICE, dtype=torch.bfloat16)
        q.set_usage(rowwise=d == ROWWISE, columnwise=d == COLUMNWISE)
        out.append(q.quantize(src))
        mk.append(src if d == ROWWISE else src.t())
    ref = mk[0].float() @ mk[1].float().t()
    return out[0], out[1], ref


def _decoded(storage: Any, direction: str, k: int) -> torch.Tensor:
    """The BF16 values a GEMM multiplies for this copy, [rows, k], row-major."""
    return decode_bf16(storage, direction).values[:, :k].contiguous()


def bench_pair_shape(name: str, layout: str, make_a: Maker, make_b: Maker,
                     shape: tuple[str, int, int, int], protocol: Protocol = Protocol()) -> dict[str, Any]:
    """One pair at one shape: its output error, cold and warm (weight decodes cached), each
    checked against ``FORMATS``' bound, and paired ratios, cold and warm, against BF16 on randn
    and on the decoded values.

    Raises ``AccuracyError`` when the output is beyond its bound."""
    sname, m, n, k = shape
    flops = 2.0 * m * n * k
    row: dict[str, Any] = {"pair": name, "layout": layout, "shape": sname, "m": m, "n": n, "k": k}
    A, B, ref = _operands(layout, make_a(), make_b(), m, n, k)
    da, db = LAYOUTS[layout]
    sa, sb = operand_storage(A, da, "A"), operand_storage(B, db, "B")
    backend = select(sa.format_key(da), sb.format_key(db), layout, sa.device)
    row["backend"] = backend.name if backend else "emulation"
    fa, fb = FORMATS[name]
    row["err_bound"] = error_bound(fa, fb, 0, 1)  # one GEMM of an fa and an fb operand
    a16 = torch.randn(m, k, device=common.DEVICE, dtype=torch.bfloat16)
    b16 = torch.randn(n, k, device=common.DEVICE, dtype=torch.bfloat16)
    a_dec, b_dec = _decoded(sa, da, k), _decoded(sb, db, k)
    baselines = {"randn": lambda: a16 @ b16.t(), "decoded": lambda: a_dec @ b_dec.t()}
    lib = lambda: gemm(A, B, layout)  # noqa: E731
    for mode in ("cold", "warm"):
        bf16_decode.clear_decode_cache()
        with policy(cache_weight_decodes=mode == "warm"):
            lib()  # warm: fills the cache (B of fprop / dgrad)
            # each mode's output checked: the warm one reads the cached decodes
            row[f"{mode}_rel_err"] = rel_error(lib(), ref)
            check_error(f"gemm_pairs {name} {layout} {sname}: output ({mode})", row[f"{mode}_rel_err"],
                        row["err_bound"])
            for base_name, base in baselines.items():
                r = paired_ratio(base, lib, protocol)
                row[f"{mode}_vs_{base_name}"] = r.as_dict()
                row[f"{mode}_ratio_{base_name}"] = r.ratio
                row[f"bf16_{base_name}"] = tflops(flops, r.baseline_ms)
            row[mode] = tflops(flops, r.candidate_ms)
        bf16_decode.clear_decode_cache()
    del ref
    row["rel_err"] = max(row["cold_rel_err"], row["warm_rel_err"])
    # the earlier names: the ratio against BF16 on the decoded values (the path's own cost)
    row["cold_ratio"], row["warm_ratio"] = row["cold_ratio_decoded"], row["warm_ratio_decoded"]
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


def _ci(r: dict[str, Any]) -> str:
    """A paired ratio as "ratio [low, high]"."""
    return f"{r['ratio']:.3f} [{r['low']:.3f}, {r['high']:.3f}]"


def main(argv=None) -> None:
    p = parser(__doc__.splitlines()[0])
    args = p.parse_args(argv)
    require_cuda()
    protocol = protocol_from(args)
    warnings.simplefilter("ignore")  # the emulated pair's report; what is measured is the time
    env = environment()
    copy = copy_bandwidth()
    shapes = QUICK_SHAPES if args.quick else SHAPES
    rows, failures = [], []
    for name, layout, ma, mb in PAIRS:
        for shape in shapes[layout]:
            try:
                rows.append(bench_pair_shape(name, layout, ma, mb, shape, protocol))
            except AccuracyError as e:  # reported with the others, then the run fails
                failures.append(str(e))
                rows.append({"pair": name, "layout": layout, "shape": shape[0], "error": str(e)})
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the pair's operands are gone: return their memory
    n = QUICK_DECODE_N if args.quick else DECODE_N
    decodes = [r for name, make in DECODES for r in bench_decode(name, make, n, n, copy["GBps"])]
    ok = [r for r in rows if "error" not in r]
    gemm_table = md_table(
        ["pair", "layout", "shape", "backend", "rel err (bound)", "BF16 TFLOP/s randn / decoded", "cold",
         "cold / BF16 randn", "cold / BF16 decoded", "warm", "warm / BF16 randn", "warm / BF16 decoded"],
        [(r["pair"], r["layout"], r["shape"], r["backend"], f"{r['rel_err']:.3g} ({r['err_bound']:.3g})",
          f"{r['bf16_randn']:.0f} / {r['bf16_decoded']:.0f}", r["cold"], _ci(r["cold_vs_randn"]),
          _ci(r["cold_vs_decoded"]), r["warm"], _ci(r["warm_vs_randn"]), _ci(r["warm_vs_decoded"])) for r in ok]
        + [(r["pair"], r["layout"], r["shape"], "FAILED", r["error"]) + ("",) * 7 for r in rows if "error" in r])
    decode_table = md_table(["decode", "tile/warps", "ms", "GB/s", "vs copy"],
                            [(r["decode"], r["tile"], r["ms"], r["GBps"], r["vs_copy"]) for r in decodes])
    md = ("### Mixed-format GEMMs through hybridfp.gemm vs BF16 a @ b.t() (TFLOP/s; paired ratios)\n\n"
          "cold: both operands decoded per call; warm: B's decoded copy cached. Ratios: median over "
          f"{protocol.rounds} alternating rounds ({protocol.samples} calls a side each) of BF16 time / "
          "hybridfp time, [≥ 95 % interval]; \"BF16 decoded\" multiplies the same decoded values as "
          "hybridfp (the like-for-like baseline), \"BF16 randn\" fresh randn values. rel err: output "
          "vs the FP32 product of the unquantized operands (bound from the element formats)."
          + ("" if protocol.reportable else " NOT REPORTABLE (fewer than 10 rounds or samples).")
          + "\n\n" + gemm_table +
          f"\n\n### Decode kernels at {n}x{n} (bytes read + written; device copy "
          f"{copy['GBps']:.0f} GB/s)\n\n" + decode_table + "\n")
    finish("gemm_pairs", {"env": env, "protocol": protocol_record(protocol), "copy_bandwidth": copy, "rows": rows,
                          "decodes": decodes, "failures": failures, "markdown": md}, args.out)
    if failures:
        raise SystemExit("gemm_pairs: " + "; ".join(failures))


if __name__ == "__main__":
    main()
