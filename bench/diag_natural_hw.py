"""Diagnosis (H200): MXFP8 "natural" columnwise copies with Triton's paired FP32 -> FP8
conversion (``fp8_encode`` HW 1) against one inline-PTX conversion per element (HW 2), per tile,
as differing bytes against the default "slices" method (BF16 and FP32 16384x4096 input with
specials, both element types). Prints one table row per (input, element type, HW, tile)."""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, "tests/kernels")
from quantize_kernel_cases import gpu_input  # noqa: E402

from hybridfp.kernels import triton_mxfp8  # noqa: E402

TILES = [((64, 128), 4), ((64, 128), 2), ((64, 256), 4), ((64, 256), 8), ((128, 128), 4), ((32, 128), 4)]


def _differing(got: tuple, want: tuple) -> int:
    """Bytes (codes and E8M0 scales) in which two copies differ."""
    return int((got[0].view(torch.uint8) != want[0].view(torch.uint8)).sum()) + int((got[1] != want[1]).sum())


def main() -> None:
    print("| input | element | HW | tile | row bytes differing | col bytes differing |")
    print("|---|---|---|---|---|---|")
    saved = triton_mxfp8.NATURAL_HW
    try:
        for xdt in (torch.bfloat16, torch.float32):
            x = gpu_input((16384, 4096), xdt, specials=True)
            for fdt in (torch.float8_e4m3fn, torch.float8_e5m2):
                for hw in (1, 2):
                    triton_mxfp8.NATURAL_HW = hw
                    for block, nw in TILES:
                        want = triton_mxfp8.quantize(x, fdt, block=block, num_warps=nw)
                        got = triton_mxfp8.quantize(x, fdt, block=block, num_warps=nw, method="natural")
                        n = [_differing(g, w) for g, w in zip(got, want)]
                        print(f"| {str(xdt)[6:]} | {str(fdt)[6:]} | {hw} | {block} / {nw} | {n[0]} | {n[1]} |",
                              flush=True)
    finally:
        triton_mxfp8.NATURAL_HW = saved


if __name__ == "__main__":
    main()
