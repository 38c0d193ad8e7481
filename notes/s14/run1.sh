#!/usr/bin/env bash
# Session 14, run 1: the post-581a425 code on the GPUs (CP tests, quick kernel tests), the #6 confirmation
# (scripts/gpu-dcp-rounds, 8 rounds), and one CP step's and one GPU step's timelines.
set -uo pipefail
O=/tmp/o; mkdir -p $O
export NCCL_NVLS_ENABLE=0
log() { echo "== $(date -u +%H:%M:%S) $*"; }
{
log build
cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSACP_ENABLE_CUDA=ON -DDSACP_BUILD_TESTS=OFF >$O/cmake.log 2>&1
cmake --build build/gpu -j32 --target dsacp_gpu_tests dsacp_gpu_cp_tests dsacp_bench_cp 2>&1 | grep -E " error" | head
B=build/gpu
log cp tests
timeout 200 $B/dsacp_gpu_cp_tests >$O/cp.log 2>&1; echo rc $?; grep -E "FAIL|checks" $O/cp.log | tail -5
log kernel tests
timeout 120 $B/dsacp_gpu_tests --quick >$O/kt.log 2>&1; echo rc $?; grep -E "FAIL|checks" $O/kt.log | tail -5
log rounds
OUT=$O/rounds scripts/gpu-dcp-rounds --rounds ${ROUNDS:-8}
log timeline
DSACP_CUDA_TIMELINE=1 timeout 120 $B/dsacp_bench_cp --only dcp --S 131072 --mode sharded --reps 2 --timeout-ms 20000 >$O/timeline.log 2>&1
DSACP_CUDA_TIMELINE=1 timeout 120 $B/dsacp_bench_cp --only dcp --S 131072 --mode sharded --reps 2 --one-gpu-only --timeout-ms 20000 >$O/timeline1.log 2>&1
log done
} 2>&1 | tee $O/log.txt
tar czf $OUT/run.tgz -C $O .
