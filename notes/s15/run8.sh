#!/usr/bin/env bash
# Session 15 run 8: DCP 128K b=64 rounds of the final code alternated with the session's start (ab_old, from git
# archive of bb06266), each round with its own one-GPU step; summaries per side. New: 4a0458e.
set -uo pipefail
export NCCL_NVLS_ENABLE=0
O=/tmp/o; mkdir -p $O/new $O/old
cfg() { cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSACP_ENABLE_CUDA=ON -DDSACP_BUILD_TESTS=OFF > "$O/cmake_$3.log" 2>&1; }
cfg . build/gpu new; cfg ab_old /tmp/bold old
( cmake --build build/gpu -j20 --target dsacp_bench_cp > $O/build_new.log 2>&1 ) &
( cmake --build /tmp/bold -j12 --target dsacp_bench_cp > $O/build_old.log 2>&1 ) &
wait
B="--only dcp --mode sharded --S 131072 --reps 30 --timeout-ms 20000"
for r in 1 2 3 4 5 6 7 8; do
  if [ $r -le 5 ]; then
    timeout 120 /tmp/bold/dsacp_bench_cp $B --json $O/old/round_$r.json > $O/old/round_$r.log 2>&1; echo "old $(grep 'dcp decode' $O/old/round_$r.log | cut -c1-90)"
  fi
  timeout 120 build/gpu/dsacp_bench_cp $B --json $O/new/round_$r.json > $O/new/round_$r.log 2>&1; echo "new $(grep 'dcp decode' $O/new/round_$r.log | cut -c1-90)"
done
echo "== new"; python3 scripts/dcp_rounds_summary.py $O/new $O/new/round_*.json
echo "== old"; python3 scripts/dcp_rounds_summary.py $O/old $O/old/round_*.json
tar czf $OUT/run.tgz -C $O .
