#!/usr/bin/env python3
"""Session 15 diagnostic stamps: applied to a COPY of the tree (argv[1]); never committed to src/bench."""
import os, shutil, sys
root = sys.argv[1]
here = os.path.dirname(os.path.abspath(__file__))
shutil.copy(os.path.join(here, 'diag_stamps.cuh'), os.path.join(root, 'src/kernels/cuda/common/'))
shutil.copy(os.path.join(here, 'diag_collect.h'), os.path.join(root, 'bench/'))
def edit(path, pairs, dump=None, include=True):
    p = os.path.join(root, path)
    s = open(p).read()
    for old, new in pairs:
        assert s.count(old) >= 1, (path, old[:60])
        s = s.replace(old, new, 1)
    if include:
        s = s.replace('#include', '#include "kernels/cuda/common/diag_stamps.cuh"\n#include', 1)
    if dump:
        s = s.rstrip('\n') + '\nDSACP_DIAG_DUMP_FN(%s)\n' % dump
    open(p, 'w').write(s)
p0 = os.path.join(root, 'src/kernels/cuda/indexer_topk/radix_select_topk.cu'); s0 = open(p0).read()
s0 = s0.replace('#include "kernels/cuda/cp_kernels/topk_merge_row.cuh"', '#include "kernels/cuda/common/diag_stamps.cuh"\n#define DSACP_MERGE_STAMPS (reinterpret_cast<long long*>(dsacp::cuda::diag::g_stamps) + 8 * 256)\n#include "kernels/cuda/cp_kernels/topk_merge_row.cuh"', 1)
open(p0, 'w').write(s0)
edit('src/kernels/cuda/indexer_topk/radix_select_topk.cu', [
    ('  const int64_t t = t0 + blockIdx.x;\n  const int32_t n = key_len[t];',
     '  const int64_t t = t0 + blockIdx.x;\n  diag::stamp(0, t);\n  const int32_t n = key_len[t];'),
    ('  }\n  peer::window_row_signal(signal, t);\n  merge_after_topk<kMerge>(merge, t, s_cache, err);\n}',
     '  }\n  diag::stamp(1, t);\n  peer::window_row_signal(signal, t);\n  merge_after_topk<kMerge>(merge, t, s_cache, err);\n  diag::stamp(3, t);\n}'),
], dump='dsacp_diag_dump_topk')
edit('src/kernels/cuda/cp_kernels/topk_merge_row.cuh', [
    ('#define DSACP_MERGE_STAMP(i) \\\n  if (threadIdx.x == 0) DSACP_MERGE_STAMPS[blockIdx.x * 16 + (i)] = clock64()',
     '#define DSACP_MERGE_STAMP(i) \\\n  if (threadIdx.x == 0) DSACP_MERGE_STAMPS[blockIdx.x * 16 + (i)] = dsacp::cuda::diag::now_ns()'),
    ('  if (!peer::window_row_wait(p.wait, t, &s_done)) return;\n',
     '  if (!peer::window_row_wait(p.wait, t, &s_done)) return;\n  diag::stamp(2, t);\n'),
])
edit('src/kernels/cuda/sparse_mla/sparse_mla_args.cuh', [
    ('  if (!mla_peer_on(a)) return;\n', '  if (!mla_peer_on(a)) return;\n  diag::stamp(1, t * 2 + h0 / a.block_heads);\n'),
    ('      for (int r = tid; r < kRows; r += kThreads) dst_lse[r] = lse[r];\n      peer::window_row_signal(pm.sync, t);\n    }\n    return;\n',
     '      for (int r = tid; r < kRows; r += kThreads) dst_lse[r] = lse[r];\n      diag::stamp(4, t * 2 + k);\n      peer::window_row_signal(pm.sync, t);\n    }\n    diag::stamp(2, t * 2 + k);\n    return;\n'),
    ('  if (!peer::window_row_wait(pm.sync, t, &s_ok)) return;  // (its barriers order the staged rows too)\n',
     '  if (!peer::window_row_wait(pm.sync, t, &s_ok)) return;  // (its barriers order the staged rows too)\n  diag::stamp(2, t * 2 + k);\n'),
    ('  __syncthreads();  // the weights and the staged peer rows\n',
     '  __syncthreads();  // the weights and the staged peer rows\n  diag::stamp(4, t * 2 + k);\n'),
    ('  fence_proxy_async_smem();\n  __syncthreads();\n  if (tid == 0) {\n    bulk_store(const_cast',
     '  diag::stamp(5, t * 2 + k);\n  fence_proxy_async_smem();\n  __syncthreads();\n  if (tid == 0) {\n    bulk_store(const_cast'),
    ('                        kRows * 512 * (a.out_bf16 ? 2 : 4));\n  }\n}',
     '                        kRows * 512 * (a.out_bf16 ? 2 : 4));\n  }\n  diag::stamp(3, t * 2 + k);\n}'),
])
edit('src/kernels/cuda/sparse_mla/sparse_mla_wgmma_ws32.cu', [
    ('  const uint32_t bars = smem_u32(smem + kOffBar);\n',
     '  const uint32_t bars = smem_u32(smem + kOffBar);\n  diag::stamp(0, mla_cta_token(a, 64) * 2 + mla_cta_head0(a, 64) / a.block_heads);\n'),
    ('  mla_peer_merge<64, kThreads, 256>(a, t, h0, smem_part, peer_stage);\n}',
     '  mla_peer_merge<64, kThreads, 256>(a, t, h0, smem_part, peer_stage);\n  diag::stamp(7, t * 2 + h0 / a.block_heads);\n}'),
], dump='dsacp_diag_dump_mla', include=False)
edit('src/kernels/cuda/cache_write/cache_write.cu', [
    ('  if (up.bytes != 0) store_upload(up);\n  const int y = blockIdx.y;',
     '  if (blockIdx.x == 0 && blockIdx.y == 0) diag::stamp(0, 0);\n  if (up.bytes != 0) store_upload(up);\n  const int y = blockIdx.y;'),
], dump='dsacp_diag_dump_cw')
p = os.path.join(root, 'src/kernels/cuda/cache_write/cache_write.cu'); s = open(p).read()
open(p, 'w').write(s + 'DSACP_DIAG_OFFSET_FN(dsacp_diag_offset)\n')
edit('src/kernels/cuda/indexer_topk/indexer_scores_mma.cu', [
    ('indexer_scores_mma_kernel(const __grid_constant__ ScoreArgs a) {\n',
     'indexer_scores_mma_kernel(const __grid_constant__ ScoreArgs a) {\n  if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) diag::stamp(0, 0);\n'),
], dump='dsacp_diag_dump_scores')
edit('bench/bench_cp.cc', [
    ('      die_if(be.synchronize(), "synchronize");\n      const auto t0 = Clock::now();',
     '      die_if(be.synchronize(), "synchronize");\n      const unsigned long long h0 = diagc::host_ns();\n      const auto t0 = Clock::now();'),
    ('      ms = ms_since(t0);\n    });',
     '      ms = ms_since(t0);\n      const unsigned long long h1 = diagc::host_ns();\n      if (!phase_pass && i > 0) diagc::collect("1gpu", 0, 0, static_cast<int>(T), h0, false, h1);\n    });'),
    ('  scale_phases(m.phases, reps);\n  m.step_ms = median(times);\n  return m;\n}',
     '  scale_phases(m.phases, reps);\n  m.step_ms = median(times);\n  diagc::print();\n  return m;\n}'),
    ('      StepLaunchTimes launch;\n      const auto t0 = Clock::now();',
     '      StepLaunchTimes launch;\n      const unsigned long long h0 = diagc::host_ns();\n      const auto t0 = Clock::now();'),
    ('      rank_end[cr] = Clock::now();\n      rank_start[cr] = t0;',
     '      rank_end[cr] = Clock::now();\n      const unsigned long long h1 = diagc::host_ns();\n      rank_start[cr] = t0;\n      if (!phase_pass && i > 0) diagc::collect("cp", cr, cr, static_cast<int>(plans[cr].num_rows), h0, true, h1);'),
    ('  m.step_ms = median(times);\n  on_ranks(Pt, [&](int cr) { comms[cr] = OwnedCpComms{}; });',
     '  m.step_ms = median(times);\n  diagc::print();\n  on_ranks(Pt, [&](int cr) { comms[cr] = OwnedCpComms{}; });'),
], include=False)
bp = os.path.join(root, 'bench/bench_cp.cc')
s = open(bp).read(); s = s.replace('#include', '#include "diag_collect.h"\n#include', 1); open(bp, 'w').write(s)
print('diag applied to', root)
