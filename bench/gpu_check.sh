#!/bin/bash
# One device call: the `gpu` test suite in two shards (-v, so a cut-short run still names every
# result), the quantize-kernel sweep and profile, and (RUN_ALL=1) bench.run_all. With 4 GPUs
# all four run at once (tests on 0 and 1, run_all on 2, sweep + profile on 3); with 2 GPUs the
# benchmarks follow the tests on the same GPUs. Writes under $OUT/r, returned as $OUT/r.tgz.
#   RUN_ALL=1 TEST_TIMEOUT=300 SWEEP_TIMEOUT=150 BENCH_BUDGET=300 bash bench/gpu_check.sh
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; R=$OUT/r; mkdir -p "$R/bench"
python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.device_count(), "GPUs")'
if [ -d .whl ]; then  # torchao for bench_mlp's comparison
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=$PWD:/tmp/site TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1
fi
# Triton's compile cache across calls (each machine starts bare and the gpu suite is
# compile-bound): a carried .triton_cache.tgz is unpacked first, the cache comes back as
# $OUT/triton_cache.tgz when small enough (copy it to the repo root, carry it next time).
export TRITON_CACHE_DIR=/tmp/triton_cache; mkdir -p "$TRITON_CACHE_DIR"
[ -f .triton_cache.tgz ] && tar xzf .triton_cache.tgz -C "$TRITON_CACHE_DIR"
NG=$(python3 -c 'import torch; print(torch.cuda.device_count())')
SHARD_A="tests/nn tests/formats tests/kernels/test_kernels_cublas_fp8.py tests/gemm/test_gemm_grouped.py
 tests/kernels/test_kernels_grouped_gemm.py tests/kernels/test_kernels_gemm_epilogue.py"
SHARD_B="tests/kernels/test_kernels_decode.py tests/kernels/test_kernels_hybrid.py tests/kernels/test_kernels_fp8_block.py
 tests/kernels/test_kernels_mxfp8.py tests/kernels/test_kernels_nvfp4.py tests/gemm/test_gemm_bf16_tensorcore.py
 tests/kernels/test_kernels_fp8_tensorwise.py"
shard() {  # gpu name files...
    local g=$1 n=$2; shift 2
    CUDA_VISIBLE_DEVICES=$g timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -v -m gpu "$@" -p no:cacheprovider \
        --durations=8 --timeout=120 --junitxml="$R/tests_$n.xml" > "$R/tests_$n.log" 2>&1
    echo "shard $n rc=$?" >> "$R/tests_$n.log"
}
sweep() {  # gpu
    CUDA_VISIBLE_DEVICES=$1 timeout "${SWEEP_TIMEOUT:-150}" python3 -m bench.bench_quantize_kernels --sweep \
        --out "$R/quantize_kernels.json" > "$R/quantize_kernels.log" 2>&1
    [ "${PROFILE:-1}" = 1 ] && CUDA_VISIBLE_DEVICES=$1 timeout "${SWEEP_TIMEOUT:-150}" python3 -m bench.profile_quantize \
        --out "$R/bench/profile_quantize.json" > "$R/profile.log" 2>&1
}
run_all() {  # gpu
    [ "${RUN_ALL:-0}" = 1 ] && CUDA_VISIBLE_DEVICES=$1 python3 -m bench.run_all --results-dir "$R/bench" \
        --budget-s "${BENCH_BUDGET:-300}" > "$R/bench.log" 2>&1
}
if [ "$NG" -ge 4 ]; then
    shard 0 a $SHARD_A & shard 1 b $SHARD_B & run_all 2 & sweep 3 & wait
else
    ( shard 0 a $SHARD_A; sweep 0 ) & ( shard 1 b $SHARD_B; run_all 1 ) & wait
fi
for n in a b; do grep -E "(FAILED|ERROR)" "$R/tests_$n.log" | grep "::" | head -20; tail -2 "$R/tests_$n.log"; done
grep -E "^  (fp8 block|fp8 cast|hybrid nvfp4|mxfp8 trans)" "$R/quantize_kernels.log" | cut -c1-100
[ -f "$R/bench.log" ] && tail -40 "$R/bench.log"
tar czf "$OUT/r.tgz" -C "$OUT" r && rm -rf "$R"
tar czf /tmp/tc.tgz -C "$TRITON_CACHE_DIR" . && [ "$(stat -c %s /tmp/tc.tgz)" -lt 16000000 ] \
    && cp /tmp/tc.tgz "$OUT/triton_cache.tgz"
