"""Diagnosis of the FP32 miscompile of the packed "natural" FP8-block column pass (session 11).

Runs ``triton_fp8_block.quantize`` (1D) at several configurations on FP32 input, forcing
``pack`` on and off (``natural_pack`` is bypassed by patching it), and prints per configuration
the mismatching bytes / scales of each copy against ``formats.fp8_block`` and where the bad
bytes sit (input column and row mod 8). On the H200 with Triton 3.6 the packed stores were
wrong at odd input columns; the kernels therefore store bytes for FP32 input.

    python -m bench.diag_natural_fp32        # on the GPU machine
"""
from __future__ import annotations

import torch

from hybridfp.formats import fp8_block
from hybridfp.kernels import triton_fp8_block

E4M3 = torch.float8_e4m3fn


def check(x: torch.Tensor, tag: str, **kw) -> None:
    """Print the mismatches of one kernel call against the reference."""
    row, col = triton_fp8_block.quantize(x, E4M3, block_dim=1, **kw)
    d, s = fp8_block.quantize_1d(x, E4M3)
    dc, sc = fp8_block.quantize_1d(x.t(), E4M3)
    rd = int((row[0].view(torch.uint8) != d.view(torch.uint8)).sum())
    rs = int((row[1].view(torch.int32) != s.view(torch.int32)).sum())
    bad = col[0].view(torch.uint8) != dc.contiguous().view(torch.uint8)
    cs = int((col[1].view(torch.int32) != sc.contiguous().view(torch.int32)).sum())
    where = ""
    if bad.any():
        pos = bad.nonzero()
        where = (f" first={pos[:2].tolist()} input col%8={torch.bincount(pos[:, 0] % 8, minlength=8).tolist()}"
                 f" input row%8={torch.bincount(pos[:, 1] % 8, minlength=8).tolist()}")
    print(f"{tag:48s} row bytes/scales {rd}/{rs}  col bytes/scales {int(bad.sum())}/{cs}{where}", flush=True)


def main() -> None:
    import sys
    torch.manual_seed(1)
    triton_fp8_block.natural_pack = lambda pack, x2: pack and x2.shape[0] % 4 == 0  # force the packed path
    if "--asm" in sys.argv:  # one inline-PTX FP8 conversion per element (fp8_encode HW=2), session 13's fix
        triton_fp8_block.hw_fp8 = lambda device: 2 if torch.device(device).type == "cuda" else False
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for shape in [(4096, 4096), (256, 256), (260, 256)]:
        x = torch.randn(shape, device=dev) * torch.exp(torch.randn(shape, device=dev))
        for m, nw, cw, rw in [("natural", 4, 128, 32), ("natural", 4, 64, 32), ("natural", 4, 32, 16),
                              ("natural", 1, 16, 8), ("slices", 4, None, 16)]:
            for pack in (True, False):
                check(x, f"{shape} {m} {nw}w {cw}/{rw} pack={pack}", method=m, num_warps=nw, chunk=cw,
                      row_slice=rw, pack=pack)
        check(x.to(torch.bfloat16).float(), f"{shape} BF16-valued FP32, default")
        check(x.t().contiguous().t(), f"{shape} column-major FP32, default")
        check(x.to(torch.bfloat16), f"{shape} BF16, default")


if __name__ == "__main__":
    main()
