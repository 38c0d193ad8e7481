#!/usr/bin/env bash
# Session 14, the final code on the pair: scripts/gpu-cp-check --quick (CP tests, churn, kernel tests, the CLI
# across GPUs, replay layouts, --launcher env, mpirun, a lonely rank, the CP bench), then the #6 confirmation:
# scripts/gpu-dcp-rounds --rounds ROUNDS (b=64 128K sharded), then b=96.
set -uo pipefail
O=/tmp/o; mkdir -p $O/check $O/rounds $O/b96
export NCCL_NVLS_ENABLE=0
OUT=$O/check scripts/gpu-cp-check --quick > $O/check.txt 2>&1
grep -E "^==|checks|FAIL|failed|match|PASS|rc=" $O/check.txt | head -50
OUT=$O/rounds scripts/gpu-dcp-rounds --rounds ${ROUNDS:-8} 2>&1 | cut -c1-220
OUT=$O/b96 scripts/gpu-dcp-rounds --rounds 2 --batch 96 2>&1 | cut -c1-220
tar czf $OUT/run.tgz -C $O .
