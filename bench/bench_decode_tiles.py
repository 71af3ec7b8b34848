"""Tile sweep of the BF16 decode kernels (``hybridfp.kernels.triton_decode``), which Hopper's
MXFP8 / NVFP4 GEMMs run on every operand (the MoE MXFP8 step spent 7.4 ms of 72 in them, s12).

For the rowwise and the (transposed) columnwise copy of a 16384 x 4096 BF16 tensor quantized
to MXFP8 1D and NVFP4 1D: each tile's device time (CUDA-graph replay), its bandwidth against a
device-to-device copy of this process (bytes read: codes + scales; written: 2 per element), and
whether its output equals the default tile's bit for bit (a tile that differs is a bug).

    python -m bench.bench_decode_tiles [--out results.json]
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from bench.bench_quantize_kernels import copy_gbps, graph_ms
from bench.common import finish_rows, parser, require_cuda

#: (tile rows, tile cols, warps[, register cap: 0 none]); None: the kernel's default (MXFP8: capped at
#: triton_decode._MAXNREG_E8M0_1D). Uncapped, (4, 512) / 2 holds 128 registers a thread (offline, s17).
TILES: list[Optional[tuple[int, ...]]] = [
    None, (4, 512, 2, 0), (8, 512, 4), (4, 1024, 4), (2, 512, 1), (4, 512, 2, 96), (4, 512, 2, 80),
    (4, 512, 2, 72), (4, 512, 2, 64), (4, 512, 2, 56), (4, 512, 2, 48), (2, 512, 1, 64), (2, 512, 1, 48),
    (8, 512, 4, 64), (4, 1024, 4, 64)]


def _copies(x: torch.Tensor) -> list[tuple[str, Any, int, int]]:
    """(name, decode call taking launch options, bytes read, elements) of each copy to decode."""
    from hybridfp.kernels import triton_decode, triton_mxfp8, triton_nvfp4
    out = []
    row, col = triton_mxfp8.quantize(x, torch.float8_e4m3fn)
    for what, (data, scale) in (("mxfp8 row", row), ("mxfp8 col", col)):
        out.append((what, lambda d=data, s=scale, **kw: triton_decode.decode_mxfp8(d, s, **kw),
                    data.nbytes + scale.nbytes, data.numel()))
    amax = x.abs().amax().float()
    for what, (packed, scale) in zip(("nvfp4 row", "nvfp4 col"), triton_nvfp4.quantize_1d(x, amax, amax)):
        cols = packed.shape[1] * 2
        out.append((what, lambda p=packed, s=scale, n=cols, **kw: triton_decode.decode_nvfp4(p, s, n, **kw),
                    packed.nbytes + scale.nbytes, packed.shape[0] * cols))
    return out


def run() -> list[dict[str, Any]]:
    torch.manual_seed(0)
    x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
    copy = copy_gbps(x)
    rows: list[dict[str, Any]] = []
    for name, decode, read, n in _copies(x):
        want = decode()
        for tile in TILES:
            kw = {} if tile is None else {"tile": tile[:2], "num_warps": tile[2], "maxnreg": (tile[3:] or (0,))[0]}
            label = "default" if tile is None else f"{tile[:2]} nw{tile[2]}" + (f" maxnreg{tile[3]}" if tile[3:] else "")
            try:
                got = decode(**kw)
                same = torch.equal(got.view(torch.int16), want.view(torch.int16))
                ms = graph_ms(lambda kw=kw: decode(**kw))
            except Exception as e:  # noqa: BLE001 - a tile that does not compile is reported
                rows.append(dict(copy=name, tile=label, error=f"{type(e).__name__}: {str(e)[:100]}"))
                continue
            gbps = (read + 2 * n) / ms / 1e6
            rows.append(dict(copy=name, tile=label, ms=ms, pct_of_copy=100 * gbps / copy, bitwise_default=same))
    return rows


def main(argv: Optional[list[str]] = None) -> None:
    p = parser(__doc__.splitlines()[0])
    args = p.parse_args(argv)
    require_cuda()
    columns = [("copy", "copy"), ("tile", "tile"), ("ms", "ms"), ("% of copy", "pct_of_copy"),
               ("= default", "bitwise_default")]
    finish_rows("decode_tiles", columns, run(), args.out)


if __name__ == "__main__":
    main()
