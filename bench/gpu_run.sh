#!/bin/bash
# One device call for a focused check: `gpu` test shards in parallel (the suite is compile-bound,
# so several pytest processes share the host's cores), then benchmarks one after another (never
# beside the tests: the host-bound ones would measure the test processes' CPU load).
#   SHARDS='tests/a.py tests/b.py -k "not slow"|tests/nn/test_x.py' TEST_TIMEOUT=300 \
#     bash bench/gpu_run.sh "bench_moe --experts 8" "bench_grouped_gemm_kernel --quick"
# Each benchmark argument is `bench.<name> [args]`, run with a BENCH_TIMEOUT (default 200 s) and
# its log tail printed. Logs and JSON land in $OUT (at most 8 files come back: one tarball).
export PYTHONPATH=$PWD HYBRIDFP_COMMIT=${HYBRIDFP_COMMIT:-unknown}
OUT=${OUT:-/tmp/out}; R=$OUT/r; mkdir -p "$R"
python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())'
export TRITON_CACHE_DIR=/tmp/triton_cache; mkdir -p "$TRITON_CACHE_DIR"
t0=$(date +%s)
IFS='|' read -r -a SH <<< "${SHARDS:-}"
for i in "${!SH[@]}"; do
    # eval: a shard is a space-separated list of test paths and options, which may quote their own
    # words (-k "not wide"); pytest's rc 5 (nothing selected) is reported as such
    ( eval "timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -rf -m gpu ${SH[$i]} -p no:cacheprovider" \
        > "$R/tests_$i.log" 2>&1; rc=$?; [ $rc = 5 ] && rc="5 (no test selected)"; echo "shard $i rc=$rc" >> "$R/tests_$i.log" ) &
done
wait
echo "tests: $(( $(date +%s) - t0 )) s"
for i in "${!SH[@]}"; do grep -E "^(FAILED|ERROR)" "$R/tests_$i.log" | head -15; tail -2 "$R/tests_$i.log"; done
n=0
for b in "$@"; do
    n=$((n + 1)); t1=$(date +%s)
    # eval: an argument may quote its own words (--only "a|b c")
    eval "timeout ${BENCH_TIMEOUT:-200} python3 -m bench.$b" > "$R/bench_$n.log" 2>&1
    echo "== bench.$b rc=$? $(( $(date +%s) - t1 )) s"; tail -n "${TAIL:-25}" "$R/bench_$n.log" | cut -c1-160
done
tar czf "$OUT/r.tgz" -C "$OUT" r && rm -rf "$R"
