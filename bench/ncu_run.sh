#!/bin/bash
# Nsight Compute on the quantize kernels that bench/ncu_quantize.py launches (three launches per case):
#   KERNEL=_mxfp8_1d bash bench/ncu_run.sh mxfp8 mxfp8_natural
# profiles every launch whose kernel name matches $KERNEL (clocks left as they are), writes the
# full report to $OUT/ncu.txt and prints, per launch, duration, throughputs, registers, occupancy
# and the warp-state lines (stall reasons).
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NCU=${NCU:-/usr/local/cuda/bin/ncu}
n=$(( 3 * $# ))
timeout "${NCU_TIMEOUT:-240}" "$NCU" --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats \
    -k "regex:${KERNEL:-.}" --launch-count "$n" python3 -m bench.ncu_quantize "$@" > "$OUT/ncu.txt" 2>&1
echo "ncu rc=$?"
grep -E "^  [_a-zA-Z].*\(|Duration|DRAM Throughput|Compute \(SM\) Throughput|Registers Per Thread|Achieved Occupancy|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Stall|stall" "$OUT/ncu.txt" \
    | grep -v "^    ----" | cut -c1-150 | head -"${NCU_LINES:-120}"
