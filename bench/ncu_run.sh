#!/bin/bash
# Nsight Compute on the quantize kernels that bench/ncu_quantize.py launches (three launches per case):
#   KERNEL=_mxfp8_1d bash bench/ncu_run.sh mxfp8 mxfp8_natural
#   METRICS=lts__t_sectors_op_write.sum,dram__bytes_read.sum KERNEL=_mxfp8_1d bash bench/ncu_run.sh mxfp8
# profiles every launch whose kernel name matches $KERNEL (clocks left as they are), writes the
# full report to $OUT/ncu.txt and prints, per launch, duration, throughputs, registers, occupancy
# and the warp-state lines (stall reasons).
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NCU=${NCU:-/usr/local/cuda/bin/ncu}
n=${LAUNCHES:-$(( 3 * $# ))}  # LAUNCHES: when a case launches more than one kernel
# METRICS (comma-separated ncu metric names): those instead of the sections, one table per launch
if [ -n "${METRICS:-}" ]; then what=(--metrics "$METRICS"); else
    what=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy
          --section LaunchStats --section SchedulerStats); fi
timeout "${NCU_TIMEOUT:-240}" "$NCU" --clock-control none "${what[@]}" \
    -k "regex:${KERNEL:-.}" --launch-count "$n" python3 -m bench.ncu_quantize "$@" > "$OUT/ncu.txt" 2>&1
echo "ncu rc=$?"
if [ -n "${METRICS:-}" ]; then
    grep -E "^  [_a-zA-Z].*\(|^    [a-z]" "$OUT/ncu.txt" | cut -c1-150 | head -"${NCU_LINES:-120}"; exit 0; fi
grep -E "^  [_a-zA-Z].*\(|Duration|DRAM Throughput|Compute \(SM\) Throughput|Registers Per Thread|Achieved Occupancy|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Stall|stall" "$OUT/ncu.txt" \
    | grep -v "^    ----" | cut -c1-150 | head -"${NCU_LINES:-120}"
