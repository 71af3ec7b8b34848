#!/bin/bash
# A/B of bench_moe rows on one machine: an older tree's hybridfp (unpacked at _ab_old/, e.g.
# `git archive <sha> hybridfp | tar x -C _ab_old`) against this tree's, alternating twice, so
# host-bound rows are compared on the same host. Usage (device): bash bench/ab_moe.sh <sha> <bench_moe args>
export HYBRIDFP_COMMIT=$1; shift
# the old tree is an ignored folder: it reaches the device only when the run names it in `carry`
[ -d _ab_old/hybridfp ] || { echo "ab_moe: no _ab_old/hybridfp here (carry it: carry=[\"_ab_old\"])"; exit 2; }
ROOT=$PWD; R=${OUT:-/tmp/out}/r; mkdir -p "$R"
for i in 1 2; do
  for t in old new; do
    # `python -m` puts the working directory first on sys.path: run the old tree from its own folder
    if [ $t = old ]; then cd "$ROOT/_ab_old"; else cd "$ROOT"; fi
    PYTHONPATH=$PWD:$ROOT timeout 150 python3 -m bench.bench_moe "$@" --results-dir "$R/ab_${t}_$i" > "$R/ab_${t}_$i.log" 2>&1
    echo "== $t $i rc=$?"; grep "^| [0-9]" "$R/ab_${t}_$i.log" | grep -v "BF16 grouped |" | cut -d'|' -f3-10
  done
done
cd "$ROOT"
