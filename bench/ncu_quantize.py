"""Launch each quantize kernel a few times at one shape, for Nsight Compute to profile.

The bandwidth sweep (``bench_quantize_kernels``) says how far each kernel is from the copy;
this gives ncu (hardware counters: achieved DRAM throughput, issue-slot use, stall reasons,
occupancy, registers) one launch of each, named by an NVTX-free kernel-name filter:

    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section WarpStateStats --section Occupancy --section LaunchStats \\
        --launch-skip 2 --launch-count 1 -k regex:_fp8_block_1d python -m bench.ncu_quantize fp8_block

Cases: the names of ``CASES`` (default: all, each launched three times).
"""

from __future__ import annotations

import sys
from typing import Callable

import torch

from hybridfp.kernels import (_common, triton_fp8_block, triton_fp8_tensorwise, triton_hybrid_fp8,
                              triton_hybrid_nvfp4, triton_mxfp8, triton_nvfp4)

ROWS, COLS = 16384, 4096


def _cases(x: torch.Tensor) -> dict[str, Callable[[], object]]:
    amax = _common.global_amax(x)
    row_amax = x.float().abs().amax()
    row_amaxes = x.float().abs().amax(dim=1)
    return {
        "copy": lambda: x.clone(),
        "fp8_cast": lambda: triton_fp8_tensorwise.quantize(x, torch.float8_e4m3fn, amax=amax),
        "fp8_block": lambda: triton_fp8_block.quantize(x, torch.float8_e4m3fn),
        "fp8_block_row": lambda: triton_fp8_block.quantize(x, torch.float8_e4m3fn, columnwise=False),
        "fp8_block_col": lambda: triton_fp8_block.quantize(x, torch.float8_e4m3fn, rowwise=False),
        "mxfp8": lambda: triton_mxfp8.quantize(x, torch.float8_e4m3fn),
        # "natural" row+col: both copies from one read of 32-row natural slices
        "mxfp8_natural": lambda: triton_mxfp8.quantize(x, torch.float8_e4m3fn, method="natural", block=(64, 128),
                                                       num_warps=2),
        "mxfp8_natural_col": lambda: triton_mxfp8.quantize(x, torch.float8_e4m3fn, rowwise=False),
        "mxfp8_row": lambda: triton_mxfp8.quantize(x, torch.float8_e4m3fn, columnwise=False),
        "nvfp4": lambda: triton_nvfp4.quantize_1d(x, row_amax, row_amax),
        "hybrid_fp8": lambda: triton_hybrid_fp8.quantize(x, amax, torch.float8_e4m3fn, torch.float8_e4m3fn),
        # Composer-2's operand: NVFP4 row-scaled rowwise + MXFP8 columnwise of its dequantized value
        "nvfp4_mxfp8_rd": lambda: triton_hybrid_nvfp4.quantize(x, row_amaxes, torch.float8_e4m3fn),
        "nvfp4_mxfp8_orig": lambda: triton_hybrid_nvfp4.quantize(x, row_amaxes, torch.float8_e4m3fn,
                                                                 source="original"),
    }


def main(argv: list[str]) -> None:
    x = torch.randn(ROWS, COLS, device="cuda", dtype=torch.bfloat16)
    cases = _cases(x)
    names = argv or list(cases)
    for name in names:
        for _ in range(3):
            cases[name]()
    torch.cuda.synchronize()
    print("launched", names)


if __name__ == "__main__":
    main(sys.argv[1:])
