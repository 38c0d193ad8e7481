#!/usr/bin/env bash
# Session 14, the pair: the CP tests and quick kernel tests on this session's code, then the #6 measurement:
# DCP 128K b=64 sharded, this session's code (new) alternated with the session's start (old, 11d0657, built
# from ab_old/ beside it), ROUNDS rounds each of 30 steps, each round with its own one-GPU step; the rounds
# summarized by scripts/dcp_rounds_summary.py; then one CP step's and one GPU step's timelines (new).
set -uo pipefail
O=/tmp/o; mkdir -p $O/new $O/old
export NCCL_NVLS_ENABLE=0
ROUNDS=${ROUNDS:-5}
log() { echo "== $(date -u +%H:%M:%S) $*"; }
{
log build
cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSACP_ENABLE_CUDA=ON -DDSACP_BUILD_TESTS=OFF >$O/cmake.log 2>&1
cmake --build build/gpu -j32 --target dsacp_gpu_tests dsacp_gpu_cp_tests dsacp_bench_cp 2>&1 | grep -E " error" | head
if [ -d ab_old ]; then
  cmake -S ab_old -B build/old -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSACP_ENABLE_CUDA=ON -DDSACP_BUILD_TESTS=OFF >$O/cmake_old.log 2>&1
  cmake --build build/old -j32 --target dsacp_bench_cp 2>&1 | grep -E " error" | head
fi
B=build/gpu
if [ "${TESTS:-1}" = 1 ]; then
  log cp tests
  timeout 240 $B/dsacp_gpu_cp_tests >$O/cp.log 2>&1; echo rc $?; grep -E "FAIL|checks" $O/cp.log | tail -5
  log kernel tests
  timeout 120 $B/dsacp_gpu_tests --quick >$O/kt.log 2>&1; echo rc $?; grep -E "FAIL|checks" $O/kt.log | tail -3
fi
for ((r = 1; r <= ROUNDS; ++r)); do
  for side in new old; do
    bin=$B/dsacp_bench_cp; [ $side = old ] && bin=build/old/dsacp_bench_cp
    [ -x $bin ] || continue
    log "round $r $side"
    timeout 120 $bin --only dcp --mode sharded --S 131072 --reps 30 --timeout-ms 20000 --json $O/$side/round_$r.json 2>&1 | grep -E "dcp decode|failed"
  done
done
for side in new old; do echo "-- $side"; python3 scripts/dcp_rounds_summary.py $O/$side $O/$side/round_*.json | tail -2; done
log timeline
DSACP_CUDA_TIMELINE=1 timeout 120 $B/dsacp_bench_cp --only dcp --S 131072 --mode sharded --reps 2 --timeout-ms 20000 >$O/timeline.log 2>&1
DSACP_CUDA_TIMELINE=1 timeout 120 $B/dsacp_bench_cp --only dcp --S 131072 --mode sharded --reps 2 --one-gpu-only --timeout-ms 20000 >$O/timeline1.log 2>&1
log done
} 2>&1 | tee $O/log.txt
tar czf $OUT/run.tgz -C $O .
