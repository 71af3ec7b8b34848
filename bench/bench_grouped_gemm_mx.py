"""The fused MXFP8-B TMA rows kernel (``kernels/triton_grouped_gemm_mx.py``, a prototype) against the
two-pass path it would replace and ``torch._grouped_mm``.

The 8-expert MoE's fc1 / fc2 fprop (bench_grouped_gemm_kernel's shapes, splits rounded to 16
rows), A BF16, B an MXFP8 rowwise copy (E4M3 code bytes without NaN codes, E8M0 bytes 118..127:
values like a quantized weight's), BF16 output, no epilogue factor. Variants, on the same operands:

- ``torch._grouped_mm`` on B's BF16 decode (decoded once, outside the timing): the baseline;
- the two-pass path: ``triton_decode.decode_mxfp8`` of all the experts' B, then the TMA kernel
  (``grouped_rows(kernel="tma")`` at ``TMA_CONFIG``), timed together (and each pass alone);
- the fused kernel at ``MX_CONFIGS``; its "bits" column says whether its output equals the TMA
  kernel's on the decode at the same tiles, bit for bit (what the GPU test asserts).

Median ms (``bench.common.bench_ms``), TFLOP/s and the ratio to ``torch._grouped_mm`` (> 1: faster).

    python -m bench.bench_grouped_gemm_mx [--out results.json] [--quick: fc2 only, two fused configs]
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from bench import common
from bench.common import finish_rows, parser, require_cuda

#: (name, rows per expert (multiples of 16), K, N)
SHAPES = [("fc1 fprop 8x(4096->28672)", [4096, 0, 16, 5088, 6000, 32, 8192, 9376], 4096, 28672),
          ("fc2 fprop 8x(14336->4096)", [4096, 0, 16, 5088, 6000, 32, 8192, 9376], 14336, 4096)]


def _mx_b(e: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8-like B: E4M3 code bytes (no NaN codes) [E, N, K] and E8M0 bytes [E, N, K / 32]."""
    codes = torch.randint(0, 256, (e, n, k), device=common.DEVICE, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes).to(torch.uint8)
    scales = torch.randint(118, 128, (e, n, k // 32), device=common.DEVICE, dtype=torch.int32).to(torch.uint8)
    return codes, scales


def _out_of_shared_memory(err: Exception) -> bool:
    """Whether a launch failed for want of shared memory (Triton's OutOfResources)."""
    return "shared memory" in str(err).lower() or "OutOfResources" in type(err).__name__


def _time(rows: list[dict[str, Any]], shape: str, variant: str, step, flop: float, base: Optional[float],
          **extra: Any) -> Optional[float]:
    try:
        ms = common.bench_ms(step, 100, 500)
    except Exception as e:  # noqa: BLE001 - a config that does not compile / fit is reported
        rows.append(dict(shape=shape, variant=variant, error=f"{type(e).__name__}: {str(e)[:100]}", **extra))
        return None
    rows.append(dict(shape=shape, variant=variant, ms=ms, tflops=flop / ms / 1e9,
                     vs_grouped_mm=(base / ms) if base else None, **extra))
    return ms


def run(quick: bool) -> list[dict[str, Any]]:
    from hybridfp.kernels import triton_grouped_gemm as tg
    from hybridfp.kernels import triton_grouped_gemm_mx as tgm
    from hybridfp.kernels.triton_decode import decode_mxfp8
    configs = dict(list(tgm.MX_CONFIGS.items())[:1]) if quick else tgm.MX_CONFIGS
    rows: list[dict[str, Any]] = []
    for name, splits, k, n in SHAPES[1:] if quick else SHAPES:
        e, m = len(splits), sum(splits)
        a = torch.randn(m, k, device=common.DEVICE, dtype=torch.bfloat16)
        codes, scales = _mx_b(e, n, k)
        f8, s2 = codes.view(torch.float8_e4m3fn).view(e * n, k), scales.view(e * n, k // 32)

        def decode() -> torch.Tensor:
            return decode_mxfp8(f8, s2).view(e, n, k)

        w = decode()
        offs = torch.tensor(splits, device=common.DEVICE).cumsum(0).to(torch.int32)
        flop = 2.0 * m * n * k
        base = _time(rows, name, "(a) torch._grouped_mm on the BF16 decode (decode not timed)",
                     lambda: torch._grouped_mm(a, w.transpose(1, 2), offs=offs), flop, None)
        if base:
            rows[-1]["vs_grouped_mm"] = 1.0
        _time(rows, name, "(b) decode_mxfp8 + tma grouped_rows (two passes)",
              lambda: tg.grouped_rows(a, decode(), splits, kernel="tma"),
              flop, base)
        _time(rows, name, "    decode_mxfp8 alone", decode, flop, base)
        _time(rows, name, f"    tma grouped_rows alone ({tg.TMA_CONFIG.bm}x{tg.TMA_CONFIG.bn}x{tg.TMA_CONFIG.bk})",
              lambda: tg.grouped_rows(a, w, splits, kernel="tma"), flop, base)
        for cname, cfg in configs.items():
            bits = "?"
            try:
                got = tgm.grouped_rows_mxfp8b(a, codes, scales, splits, tma=cfg)
                # the TMA kernel at the same tiles; fewer stages where its BF16 rings do not fit (the
                # ring depth only pipelines the loads)
                for stages in range(cfg.stages, 0, -1):
                    try:
                        want = tg.grouped_rows(a, w, splits, kernel="tma", tma=dataclasses.replace(cfg, stages=stages))
                        break
                    except Exception as err:  # noqa: BLE001
                        if not _out_of_shared_memory(err) or stages == 1:
                            raise
                same = torch.equal(got.view(torch.int16), want.view(torch.int16))
                bits = ("equal" if same else "DIFFER") + ("" if stages == cfg.stages else f" (ref s{stages})")
            except Exception as err:  # noqa: BLE001 - reported in the row
                bits = f"{type(err).__name__}"
            _time(rows, name, f"(c) fused mxfp8b {cname}",
                  lambda cfg=cfg: tgm.grouped_rows_mxfp8b(a, codes, scales, splits, tma=cfg), flop, base, bits=bits)
    return rows


def main(argv: Optional[list[str]] = None) -> None:
    p = parser(__doc__.splitlines()[0])
    args = p.parse_args(argv)
    require_cuda()
    columns = [("shape", "shape"), ("variant", "variant"), ("ms", "ms"), ("TFLOP/s", "tflops"),
               ("x torch._grouped_mm", "vs_grouped_mm"), ("bits = two-pass", "bits")]
    finish_rows("grouped_gemm_mx", columns, run(args.quick), args.out)


if __name__ == "__main__":
    main()
