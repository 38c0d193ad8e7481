#!/usr/bin/env bash
# Session 14, the pair: CP tests + quick kernel tests on the working tree (new), then DCP 128K b=64 sharded in
# ROUNDS rounds of three builds alternated: new (the tree), mid (ab_mid: 8f5df01, the carried upload only) and
# old (ab_old: 11d0657, the session's start); each round 30 steps with its own one-GPU step; summaries per build.
set -uo pipefail
O=/tmp/o; mkdir -p $O/new $O/mid $O/old
export NCCL_NVLS_ENABLE=0
ROUNDS=${ROUNDS:-4}
log() { echo "== $(date -u +%H:%M:%S) $*"; }
{
log build
cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSACP_ENABLE_CUDA=ON -DDSACP_BUILD_TESTS=OFF >$O/cmake.log 2>&1
cmake --build build/gpu -j32 --target dsacp_gpu_tests dsacp_gpu_cp_tests dsacp_bench_cp 2>&1 | grep -E " error" | head
for side in mid old; do
  [ -d ab_$side ] || continue
  cmake -S ab_$side -B build/$side -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSACP_ENABLE_CUDA=ON -DDSACP_BUILD_TESTS=OFF >/dev/null 2>&1
  cmake --build build/$side -j32 --target dsacp_bench_cp 2>&1 | grep -E " error" | head
done
B=build/gpu
if [ "${TESTS:-1}" = 1 ]; then
  log cp tests
  timeout 240 $B/dsacp_gpu_cp_tests >$O/cp.log 2>&1; echo rc $?; grep -E "FAIL|checks|window rows" $O/cp.log | tail -8
  log kernel tests
  timeout 120 $B/dsacp_gpu_tests --quick >$O/kt.log 2>&1; echo rc $?; grep -E "FAIL|checks" $O/kt.log | tail -3
fi
for ((r = 1; r <= ROUNDS; ++r)); do
  for side in new mid old; do
    bin=$B/dsacp_bench_cp; [ $side != new ] && bin=build/$side/dsacp_bench_cp
    [ -x $bin ] || continue
    log "round $r $side"
    timeout 120 $bin --only dcp --mode sharded --S 131072 --reps 30 --timeout-ms 20000 --json $O/$side/round_$r.json 2>&1 | grep -E "dcp decode|failed" | cut -c1-200
  done
done
for side in new mid old; do echo "-- $side"; python3 scripts/dcp_rounds_summary.py $O/$side $O/$side/round_*.json | tail -1; done
log timeline
DSACP_CUDA_TIMELINE=1 timeout 120 $B/dsacp_bench_cp --only dcp --S 131072 --mode sharded --reps 2 --timeout-ms 20000 >$O/timeline.log 2>&1
log done
} 2>&1 | tee $O/log.txt
tar czf $OUT/run.tgz -C $O .
