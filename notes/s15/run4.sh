#!/usr/bin/env bash
# Session 15 run 4: the peer merge staged in shared memory (bulk copies). CP tests on the new code; DCP 128K b=64 rounds alternated
# with HEAD (ab_old, from git archive); the diagnostic stamps on the new code, also with NCCL_MAX_CTAS=1.
set -uo pipefail
export NCCL_NVLS_ENABLE=0
O=/tmp/o; mkdir -p $O
ROOT=$PWD
cfg() { cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSACP_ENABLE_CUDA=ON -DDSACP_BUILD_TESTS=OFF > "$O/cmake_$3.log" 2>&1; }
rm -rf /tmp/diag && mkdir /tmp/diag && tar --exclude=./build --exclude=./ab_old -cf - . | tar -xf - -C /tmp/diag
python3 notes/s15/diag/apply.py /tmp/diag > $O/apply.log 2>&1 || { cat $O/apply.log; exit 1; }
cfg . build/gpu new; cfg ab_old /tmp/bold old; cfg /tmp/diag /tmp/bdiag diag
( cmake --build build/gpu -j16 --target dsacp_bench_cp dsacp_gpu_cp_tests > $O/build_new.log 2>&1 ) &
( cmake --build /tmp/bold -j8 --target dsacp_bench_cp > $O/build_old.log 2>&1 ) &
( cmake --build /tmp/bdiag -j8 --target dsacp_bench_cp > $O/build_diag.log 2>&1 ) &
wait
for b in build/gpu/dsacp_bench_cp build/gpu/dsacp_gpu_cp_tests /tmp/bold/dsacp_bench_cp /tmp/bdiag/dsacp_bench_cp; do
  [ -x $b ] || { echo "missing $b"; tail -20 $O/build_*.log; exit 1; }
done
echo "built at $(date +%T)"
timeout 150 build/gpu/dsacp_gpu_cp_tests --json $O/cp_tests.json > $O/cp_tests.log 2>&1; echo "cp tests rc=$?"
grep -E "FAIL|checks" $O/cp_tests.log | head -20; tail -1 $O/cp_tests.log
B="--only dcp --mode sharded --S 131072 --reps 30 --timeout-ms 20000"
for r in 1 2 3 4; do
  timeout 120 /tmp/bold/dsacp_bench_cp $B --json $O/old_$r.json > $O/old_$r.log 2>&1; echo "old $(grep 'dcp decode' $O/old_$r.log)"
  timeout 120 build/gpu/dsacp_bench_cp $B --json $O/new_$r.json > $O/new_$r.log 2>&1; echo "new $(grep 'dcp decode' $O/new_$r.log)"
done
timeout 120 /tmp/bdiag/dsacp_bench_cp $B > $O/diag_1.log 2>&1

echo "diag $(grep "dcp decode" $O/diag_1.log)"
grep -E "^  cp r" $O/diag_1.log

tar czf $OUT/run.tgz -C $O .
