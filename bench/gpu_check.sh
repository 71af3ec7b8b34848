#!/bin/bash
# One device call: the `gpu` test suite in four shards (-v, so a cut-short run still names every
# result; TESTS=0 skips it), then the quantize-kernel sweep and profile (SWEEP=0 skips them) and
# (RUN_ALL=1) bench.run_all, on different GPUs when there are two. Benchmarks never run beside
# the tests: the host-bound ones would measure the test processes' CPU load. Writes under
# $OUT/r, returned as $OUT/r.tgz.
#   RUN_ALL=1 TEST_TIMEOUT=300 SWEEP_TIMEOUT=150 BENCH_BUDGET=300 [RUN_ONLY=mlp,moe] bash bench/gpu_check.sh
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
# Four shards covering every file with `gpu` tests; each GPU takes two when fewer than four
# (the suite is compile-bound on a fresh machine, so two processes per GPU use the host's cores).
SHARDS=("tests/nn"
 "tests/kernels/test_kernels_hybrid.py tests/kernels/test_kernels_nvfp4.py"
 "tests/formats tests/kernels/test_kernels_decode.py tests/kernels/test_kernels_fp8_block.py
  tests/kernels/test_kernels_mxfp8.py tests/kernels/test_kernels_fp8_tensorwise.py tests/kernels/test_kernels_grouped_fp8.py
  tests/kernels/test_kernels_pad_rows.py tests/kernels/test_kernels_grouped_hybrid.py"
 "tests/gemm tests/kernels/test_kernels_cublas_fp8.py tests/kernels/test_kernels_grouped_gemm.py
  tests/kernels/test_kernels_gemm_epilogue.py")
shard() {  # gpu name files...
    local g=$1 n=$2; shift 2
    CUDA_VISIBLE_DEVICES=$g timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -v -rf -m gpu "$@" -p no:cacheprovider \
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
        --budget-s "${BENCH_BUDGET:-300}" ${RUN_ONLY:+--only "$RUN_ONLY"} > "$R/bench.log" 2>&1
}
if [ "${TESTS:-1}" = 1 ]; then
    for i in 0 1 2 3; do shard $((i % NG)) $i ${SHARDS[$i]} & done; wait
fi
extra() {  # gpu: EXTRA_BENCH=name runs bench.bench_<name> (its table lands in $R/extra.log)
    [ -n "${EXTRA_BENCH:-}" ] && CUDA_VISIBLE_DEVICES=$1 timeout "${SWEEP_TIMEOUT:-150}" python3 -m \
        "bench.bench_${EXTRA_BENCH}" --out "$R/bench/${EXTRA_BENCH}.json" > "$R/extra.log" 2>&1
}
if [ "$NG" -ge 2 ]; then
    ( [ "${SWEEP:-1}" = 1 ] && sweep 0; extra 0 ) & run_all 1 & wait
else
    [ "${SWEEP:-1}" = 1 ] && sweep 0; extra 0; run_all 0
fi
for n in 0 1 2 3; do [ -f "$R/tests_$n.log" ] || continue; grep -E "(FAILED|ERROR)" "$R/tests_$n.log" | grep "::" | head -20; tail -2 "$R/tests_$n.log"; done
grep -E "^  (fp8 block|fp8 cast|hybrid nvfp4|mxfp8 trans)" "$R/quantize_kernels.log" | cut -c1-100
[ -f "$R/extra.log" ] && tail -8 "$R/extra.log"
[ -f "$R/bench.log" ] && tail -40 "$R/bench.log"
tar czf "$OUT/r.tgz" -C "$OUT" r && rm -rf "$R"
tar czf /tmp/tc.tgz -C "$TRITON_CACHE_DIR" . && [ "$(stat -c %s /tmp/tc.tgz)" -lt 16000000 ] \
    && cp /tmp/tc.tgz "$OUT/triton_cache.tgz"
