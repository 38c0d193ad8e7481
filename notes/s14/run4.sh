#!/usr/bin/env bash
# Session 14, the pair: the 32 MiB window default. CP tests, then DCP 128K b=128 sharded with the default window
# against DSACP_NCCL_WINDOW_MB=16 (session 13's default: b=128's partials did not fit), 2 rounds each, alternated.
set -uo pipefail
O=/tmp/o; mkdir -p $O/w32 $O/w16
export NCCL_NVLS_ENABLE=0
log() { echo "== $(date -u +%H:%M:%S) $*"; }
{
log build
cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSACP_ENABLE_CUDA=ON -DDSACP_BUILD_TESTS=OFF >/dev/null 2>&1
cmake --build build/gpu -j32 --target dsacp_gpu_cp_tests dsacp_bench_cp 2>&1 | grep -E " error" | head
B=build/gpu
log cp tests
timeout 240 $B/dsacp_gpu_cp_tests >$O/cp.log 2>&1; echo rc $?; grep -E "FAIL|checks" $O/cp.log | tail -4
for r in 1 2; do
  for side in w32 w16; do
    log "b=128 round $r $side"
    if [ $side = w16 ]; then export DSACP_NCCL_WINDOW_MB=16; else unset DSACP_NCCL_WINDOW_MB; fi
    timeout 150 $B/dsacp_bench_cp --only dcp --mode sharded --S 131072 --batch 128 --reps 20 --timeout-ms 20000 --json $O/$side/round_$r.json 2>&1 | grep -E "dcp decode|failed" | cut -c1-240
  done
done
unset DSACP_NCCL_WINDOW_MB
for side in w32 w16; do echo "-- $side"; python3 scripts/dcp_rounds_summary.py $O/$side $O/$side/round_*.json | tail -1; done
log done
} 2>&1 | tee $O/log.txt
tar czf $OUT/run.tgz -C $O .
