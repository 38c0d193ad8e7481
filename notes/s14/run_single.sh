#!/usr/bin/env bash
# Session 14, one H200 (the pair was not lent): the kernel tests (quick set, with the new cache-write upload
# checks) on 8f5df01 and the one-GPU step's host time to the indexer launch via the single-device bench.
set -uo pipefail
O=/tmp/o; mkdir -p $O
log() { echo "== $(date -u +%H:%M:%S) $*"; }
{
log build
cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSACP_ENABLE_CUDA=ON -DDSACP_BUILD_TESTS=OFF >$O/cmake.log 2>&1
cmake --build build/gpu -j16 --target dsacp_gpu_tests dsacp_cli 2>&1 | grep -E " error" | head
B=build/gpu
log kernel tests quick
timeout 200 $B/dsacp_gpu_tests --quick >$O/kt.log 2>&1; echo rc $?; grep -E "FAIL|checks|upload" $O/kt.log | tail -8
log cli run cuda
timeout 120 $B/dsacp run --device cuda >$O/cli.log 2>&1; echo rc $?; tail -5 $O/cli.log
log done
} 2>&1 | tee $O/log.txt
tar czf $OUT/run.tgz -C $O .
