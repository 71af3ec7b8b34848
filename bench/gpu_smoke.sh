#!/bin/bash
# GPU check run through the device tool: the `gpu` test suite, then a few steps of every
# convergence-study recipe (dense and MoE) so that a crash shows before a long run.
#   bash bench/gpu_smoke.sh   (writes under $OUT)
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.device_count())'
timeout "${TEST_TIMEOUT:-220}" python3 -m pytest -q -m gpu tests -p no:cacheprovider --durations=15 \
    > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; grep -E '^(FAILED|ERROR)' "$OUT/gpu_tests.log" | head -40; tail -25 "$OUT/gpu_tests.log"
D="bf16,fp8,fp8-block,mxfp8,nvfp4,per_gemm:fprop=nvfp4,dgrad=mxfp8,wgrad=mxfp8,mxfp8-fwd-nvfp4-bwd"
( timeout 150 python3 -m hybridfp.train --preset gpt-50m --compare "$D" --jobs 7 --device cuda --steps 12 \
    --eval-interval 12 --eval-iters 1 --no-progress --out "$OUT/smoke-dense" > "$OUT/smoke-dense.log" 2>&1;
  echo "dense smoke rc=$?" ) &
( timeout 150 python3 -m hybridfp.train --preset moe-small --compare bf16,nvfp4-row-scaled-fwd-mxfp8-bwd,fp8,mxfp8 \
    --jobs 4 --device cuda --steps 12 --eval-interval 12 --eval-iters 1 --no-progress --out "$OUT/smoke-moe" \
    > "$OUT/smoke-moe.log" 2>&1; echo "moe smoke rc=$?" ) &
wait
tail -22 "$OUT/smoke-dense.log"; tail -14 "$OUT/smoke-moe.log"
