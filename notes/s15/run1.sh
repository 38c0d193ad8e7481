#!/usr/bin/env bash
# Session 15 run 1: the diagnostic stamps (notes/s15/diag) on the DCP decode, b=64, 128K and 32K.
set -uo pipefail
export NCCL_NVLS_ENABLE=0
O=/tmp/o; mkdir -p $O
rm -rf /tmp/diag && mkdir /tmp/diag
tar --exclude=./build -cf - . | tar -xf - -C /tmp/diag
notes/s15/diag/apply.sh /tmp/diag > $O/apply.log 2>&1 || { cat $O/apply.log; exit 1; }
cd /tmp/diag
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSACP_ENABLE_CUDA=ON -DDSACP_BUILD_TESTS=OFF > $O/cmake.log 2>&1
cmake --build build -j32 --target dsacp_bench_cp > $O/build.log 2>&1 || { tail -30 $O/build.log; exit 1; }
nvidia-smi --query-gpu=index,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > $O/smi.txt
for r in 1 2 3; do
  timeout 120 build/dsacp_bench_cp --only dcp --mode sharded --S 131072 --reps 30 --timeout-ms 20000 > $O/diag128k_$r.log 2>&1
  grep -E "dcp decode" $O/diag128k_$r.log
done
timeout 120 build/dsacp_bench_cp --only dcp --mode sharded --S 32768 --reps 30 --timeout-ms 20000 > $O/diag32k.log 2>&1
grep -E "dcp decode" $O/diag32k.log
cat $O/diag128k_1.log | grep -A80 "diag stamps" | head -120
tar czf $OUT/run.tgz -C $O .
