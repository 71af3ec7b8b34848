#!/bin/bash
# One device call on two GPUs: the `gpu` test suite split in two shards (one per GPU, -v so a
# cut-short run still names every result), then the quantize-kernel sweep (GPU 0) and the
# quantize profile (GPU 1). Writes under $OUT; TEST_TIMEOUT / SWEEP_TIMEOUT in seconds.
#   bash bench/gpu_check.sh
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/r"
python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.device_count(), "GPUs")'
SHARD_A="tests/nn tests/formats tests/kernels/test_kernels_cublas_fp8.py tests/gemm/test_gemm_grouped.py
 tests/kernels/test_kernels_grouped_gemm.py tests/kernels/test_kernels_gemm_epilogue.py"
SHARD_B="tests/kernels/test_kernels_decode.py tests/kernels/test_kernels_hybrid.py tests/kernels/test_kernels_fp8_block.py
 tests/kernels/test_kernels_mxfp8.py tests/kernels/test_kernels_nvfp4.py tests/gemm/test_gemm_bf16_tensorcore.py
 tests/kernels/test_kernels_fp8_tensorwise.py"
run_shard() {  # gpu name files...
    local g=$1 n=$2; shift 2
    CUDA_VISIBLE_DEVICES=$g timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -v -m gpu "$@" -p no:cacheprovider \
        --durations=8 --timeout=120 --junitxml="$OUT/r/tests_$n.xml" > "$OUT/r/tests_$n.log" 2>&1
    echo "shard $n rc=$?" >> "$OUT/r/tests_$n.log"
}
run_shard 0 a $SHARD_A &
run_shard 1 b $SHARD_B &
wait
( CUDA_VISIBLE_DEVICES=0 timeout "${SWEEP_TIMEOUT:-150}" python3 -m bench.bench_quantize_kernels --sweep \
    --out "$OUT/r/quantize_kernels.json" > "$OUT/r/quantize_kernels.log" 2>&1 ) &
CUDA_VISIBLE_DEVICES=1 timeout "${SWEEP_TIMEOUT:-150}" python3 -m bench.profile_quantize \
    --out "$OUT/r/profile_quantize.json" > "$OUT/r/profile.log" 2>&1
wait
for n in a b; do grep -E "(FAILED|ERROR)" "$OUT/r/tests_$n.log" | grep "::" | head -20; tail -2 "$OUT/r/tests_$n.log"; done
grep -E "^  (fp8 block|fp8 cast|hybrid nvfp4)" "$OUT/r/quantize_kernels.log" | cut -c1-100
tar czf "$OUT/r.tgz" -C "$OUT" r && rm -rf "$OUT/r"
