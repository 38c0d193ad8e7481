#!/usr/bin/env bash
# Session 15 run 5: diagnostic stamps of the staged peer merge (the in-shared-memory loop run twice: cold / warm).
set -uo pipefail
export NCCL_NVLS_ENABLE=0
O=/tmp/o; mkdir -p $O
rm -rf /tmp/diag && mkdir /tmp/diag && tar --exclude=./build --exclude=./ab_old -cf - . | tar -xf - -C /tmp/diag
python3 notes/s15/diag/apply.py /tmp/diag > $O/apply.log 2>&1 || { cat $O/apply.log; exit 1; }
cmake -S /tmp/diag -B /tmp/bdiag -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSACP_ENABLE_CUDA=ON -DDSACP_BUILD_TESTS=OFF > $O/cmake.log 2>&1
cmake --build /tmp/bdiag -j32 --target dsacp_bench_cp > $O/build.log 2>&1 || { tail -20 $O/build.log; exit 1; }
B="--only dcp --mode sharded --S 131072 --reps 30 --timeout-ms 20000"
timeout 120 /tmp/bdiag/dsacp_bench_cp $B > $O/diag_1.log 2>&1; echo "diag $(grep 'dcp decode' $O/diag_1.log)"
grep -E "^  cp r0 mla" $O/diag_1.log
tar czf $OUT/run.tgz -C $O .
