// The sparse MLA kernels' merges of partial rows inside a launch: split-K merged by the cluster of a token's
// splits through distributed shared memory (mla_cluster_merge), and the ranks' partials merged inside attention
// (mla_peer_merge, SparseMlaParams::PeerMerge), with their shared-memory sizes and merge weights.
#pragma once

#include "kernels/cuda/sparse_mla/sparse_mla_args.cuh"

namespace dsacp::cuda {

// Bytes of shared memory the cluster merge and the peer merge use from smem_part: the partial rows, their LSE, the
// merge weights (and one word of the peer merge's).
__host__ __device__ constexpr int mla_cluster_merge_bytes(int rows) {
  return rows * 512 * 4 + rows * 4 + rows * 8 * 4 + 16;
}
constexpr int kMlaMaxClusterSplits = 8;  // the portable cluster size
static_assert(kMaxPartBuffers <= kMlaMaxClusterSplits, "mla_merge_weights takes the peer merge's parts too");

// The weights of an exact merge of up to 8 parts by their LSE l[s] (-inf for an absent part) into w[0, 8):
// w_s = exp(l_s - max) / sum over the parts with a finite LSE (0 for the others, all 0 when none has one), in a
// fixed order (bit-identical reruns). Returns the merged LSE: max + log(sum), -inf when no part has a finite one.
__device__ __forceinline__ float mla_merge_weights(float (&l)[kMlaMaxClusterSplits], float* w) {
  constexpr float kInf = INFINITY;
  float mx = -kInf;
#pragma unroll
  for (int s = 0; s < kMlaMaxClusterSplits; ++s) {
    if (isfinite(l[s])) mx = fmaxf(mx, l[s]);
  }
  float sum = 0.f;
#pragma unroll
  for (int s = 0; s < kMlaMaxClusterSplits; ++s) {
    l[s] = mx != -kInf && isfinite(l[s]) ? expf(l[s] - mx) : 0.f;
    sum += l[s];
  }
#pragma unroll
  for (int s = 0; s < kMlaMaxClusterSplits; ++s) w[s] = sum > 0.f ? l[s] / sum : 0.f;
  return sum > 0.f ? mx + logf(sum) : -kInf;
}

// The split-K merge inside a cluster (a.cluster_merge): the a.splits CTAs of (token t, heads h0 ..) are one
// cluster (ranks = splits), each with its normalized partial rows and their LSE in its own shared memory at
// smem_part (mla_with_out_rows / mla_lse_rows). CTA rank k merges rows k, k + splits, ... reading every peer's
// rows through distributed shared memory: out = sum_s w_s O_s, w_s = exp(lse_s - max) / sum exp(lse_j - max)
// over the parts with a finite LSE (a fixed order: bit-identical reruns), lse = max + log(sum); no part with a key
// gives out = 0, lse = -inf. Every thread of every CTA calls it after its rows are stored (it has two cluster
// barriers and a __syncthreads); without a.cluster_merge it returns at once.
// Rows from `valid_rows` on (a partial head group's) are not merged.
template <int kRows, int kThreads>
__device__ __forceinline__ void mla_cluster_merge(const MlaArgs& a, int64_t t, int h0, float* smem_part,
                                                  int valid_rows = kRows) {
  constexpr float kInf = INFINITY;
  if (!a.cluster_merge) return;
  cluster_sync();  // every CTA's partial rows and LSE written
  const int n = a.splits, rank = static_cast<int>(cluster_cta_rank()), tid = threadIdx.x;
  const int my_rows = rank < valid_rows ? (valid_rows - rank + n - 1) / n : 0;
  const uint32_t part = smem_u32(smem_part), lse_off = kRows * 512 * 4;
  float* weights = smem_part + kRows * 512 + kRows;  // [my_rows][8]
  for (int i = tid; i < my_rows; i += kThreads) {
    const int r = rank + n * i;
    float l[kMlaMaxClusterSplits];
#pragma unroll
    for (int s = 0; s < kMlaMaxClusterSplits; ++s) l[s] = s < n ? ld_cluster_f32(cluster_map(part + lse_off + r * 4, s)) : -kInf;
    a.lse[mla_head_row(a, t, h0 + r)] = mla_merge_weights(l, weights + i * 8);
  }
  __syncthreads();  // the weights
  for (int idx = tid; idx < my_rows * 128; idx += kThreads) {
    const int i = idx >> 7, c = (idx & 127) * 4, r = rank + n * i;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < n; ++s) {
      const float w = weights[i * 8 + s];
      if (w == 0.f) continue;
      const float4 v = ld_cluster_f32x4(cluster_map(part + (r * 512 + c) * 4, s));
      acc.x += w * v.x;
      acc.y += w * v.y;
      acc.z += w * v.z;
      acc.w += w * v.w;
    }
    const int64_t row = mla_head_row(a, t, h0 + r);
    if (a.out_bf16) {
      __nv_bfloat16* o = static_cast<__nv_bfloat16*>(a.out) + row * 512 + c;
      *reinterpret_cast<uint2*>(o) = make_uint2(pack_bf16x2(acc.x, acc.y), pack_bf16x2(acc.z, acc.w));
    } else {
      *reinterpret_cast<float4*>(static_cast<float*>(a.out) + row * 512 + c) = acc;
    }
  }
  cluster_sync();  // the peers are done reading this CTA's rows
}

// mla_peer_merge's sum over the parts (rank order) of rows [row0, row0 + kRows) into a.out, from global memory,
// by threads [0, kThreads) of the CTA: 8 columns a chunk, kBatch chunks a thread at a time, every load of a
// part's batch issued before any of them is used (one dependent 8-byte load at a time took the merge 13 us of the
// 2-GPU DCP decode step). A part whose weight is 0 is not read. The sums are the same, in the same
// order, as one column at a time.
template <int kRows, int kThreads>
__device__ __forceinline__ void mla_peer_merge_rows(const MlaArgs& a, const SparseMlaParams::PeerMerge& pm,
                                                    const float* rows, const float* weights, int64_t row0, int n,
                                                    int me, int tid) {
  constexpr int kChunks = kRows * 64;  // [kRows, 512] in 8-column chunks; thread tid takes tid + j * kThreads
  constexpr int kBatch = 8;
  const bool part_bf16 = pm.part_dtype == DType::kBF16;
  const bool out16 = (reinterpret_cast<uintptr_t>(a.out) & 15) == 0;
  for (int base = 0; base < kChunks; base += kBatch * kThreads) {
    float acc[kBatch][8];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[b][j] = 0.f;
    }
    auto add = [&](int b, float w, const float (&v)[8]) {
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[b][j] += w * v[j];
    };
    for (int s = 0; s < n; ++s) {
      if (s == me) {
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int idx = base + b * kThreads + tid, r = idx >> 6, c = (idx & 63) * 8;
          if (idx >= kChunks || weights[r * 8 + s] == 0.f) continue;
          const float4 x = *reinterpret_cast<const float4*>(rows + r * 512 + c);
          const float4 y = *reinterpret_cast<const float4*>(rows + r * 512 + c + 4);
          const float v[8] = {x.x, x.y, x.z, x.w, y.x, y.y, y.z, y.w};
          add(b, weights[r * 8 + s], v);
        }
      } else if (part_bf16) {
        const __nv_bfloat16* part = static_cast<const __nv_bfloat16*>(pm.part_out_from[s]) + row0 * 512;
        uint4 raw[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int idx = base + b * kThreads + tid, r = idx >> 6, c = (idx & 63) * 8;
          raw[b] = idx < kChunks && weights[r * 8 + s] != 0.f ? *reinterpret_cast<const uint4*>(part + r * 512 + c)
                                                               : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int idx = base + b * kThreads + tid, r = idx >> 6;
          if (idx >= kChunks || weights[r * 8 + s] == 0.f) continue;
          const float2 p0 = bf16x2_to_float2(raw[b].x), p1 = bf16x2_to_float2(raw[b].y);
          const float2 p2 = bf16x2_to_float2(raw[b].z), p3 = bf16x2_to_float2(raw[b].w);
          const float v[8] = {p0.x, p0.y, p1.x, p1.y, p2.x, p2.y, p3.x, p3.y};
          add(b, weights[r * 8 + s], v);
        }
      } else {
        const float* part = static_cast<const float*>(pm.part_out_from[s]) + row0 * 512;
        float4 lo[kBatch], hi[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int idx = base + b * kThreads + tid, r = idx >> 6, c = (idx & 63) * 8;
          const bool take = idx < kChunks && weights[r * 8 + s] != 0.f;
          lo[b] = take ? *reinterpret_cast<const float4*>(part + r * 512 + c) : make_float4(0.f, 0.f, 0.f, 0.f);
          hi[b] = take ? *reinterpret_cast<const float4*>(part + r * 512 + c + 4) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int idx = base + b * kThreads + tid, r = idx >> 6;
          if (idx >= kChunks || weights[r * 8 + s] == 0.f) continue;
          const float v[8] = {lo[b].x, lo[b].y, lo[b].z, lo[b].w, hi[b].x, hi[b].y, hi[b].z, hi[b].w};
          add(b, weights[r * 8 + s], v);
        }
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int idx = base + b * kThreads + tid, r = idx >> 6, c = (idx & 63) * 8;
      if (idx >= kChunks) continue;
      const int64_t row = row0 + r;
      const float* v = acc[b];
      if (a.out_bf16) {
        __nv_bfloat16* o = static_cast<__nv_bfloat16*>(a.out) + row * 512 + c;
        const uint32_t w0 = pack_bf16x2(v[0], v[1]), w1 = pack_bf16x2(v[2], v[3]);
        const uint32_t w2 = pack_bf16x2(v[4], v[5]), w3 = pack_bf16x2(v[6], v[7]);
        if (out16) {
          *reinterpret_cast<uint4*>(o) = make_uint4(w0, w1, w2, w3);
        } else {
          reinterpret_cast<uint2*>(o)[0] = make_uint2(w0, w1);
          reinterpret_cast<uint2*>(o)[1] = make_uint2(w2, w3);
        }
      } else {
        float* o = static_cast<float*>(a.out) + row * 512 + c;
        *reinterpret_cast<float4*>(o) = make_float4(v[0], v[1], v[2], v[3]);
        *reinterpret_cast<float4*>(o + 4) = make_float4(v[4], v[5], v[6], v[7]);
      }
    }
  }
}

// The peer merge's staging area in the kernels that have one (mla_peer_merge's `stage`): a [64, 512] bf16 block
// (64 KiB) past the rows of smem_part, 1024-byte aligned.
constexpr int kMlaPeerStageBytes = 64 * 512 * 2;
__host__ __device__ constexpr int mla_peer_stage_offset(int rows) {
  return (mla_cluster_merge_bytes(rows) + 1023) / 1024 * 1024;
}

// A bulk copy shared -> global (the async proxy: no per-thread stores), in pieces of at most 16 KiB, one group, by
// one thread, which waits until the copy has read `src` (the kernel's end completes the writes). Writes of the
// CTA's threads to `src` must be fenced to the async proxy (fence_proxy_async_smem by each writer) and ordered
// before it by a barrier.
__device__ __forceinline__ void bulk_store(void* dst, const void* src, uint32_t bytes) {
  constexpr uint32_t kPiece = 16384;
  for (uint32_t at = 0; at < bytes; at += kPiece) {
    const uint32_t n = bytes - at < kPiece ? bytes - at : kPiece;
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(static_cast<char*>(dst) + at),
                 "r"(smem_u32(static_cast<const char*>(src) + at)), "r"(n)
                 : "memory");
  }
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}

// The ranks' partials merged inside attention (a.peer, SparseMlaParams::PeerMerge), after the CTA's normalized
// rows [kRows, 512] f32 and their LSE [kRows] were staged at smem_part (mla_with_out_rows / mla_lse_rows). The
// CTA of head block k = h0 / block_heads:
//   k != peer.sync.rank: stores its rows (as part_dtype) and LSE into rank k's window (this rank's slot there,
//     row t * kRows + r), then raises row t's flag in rank k (peer::window_row_signal); nothing when a wait of
//     this rank failed (peer::rank_failed), so that a failed rank never writes into a peer's window;
//   k == peer.sync.rank: waits for every peer's flag of row t, then merges, parts in rank order, its own staged
//     rows with the peers' rows of its block in this rank's window (as mla_cluster_merge: w_s = exp(lse_s - max) /
//     sum over the parts with a finite LSE; none: out = 0, lse = -inf) into out / lse rows t * kRows + r (this
//     rank's head slice). A failed wait leaves them unwritten (the communicator reports the error).
// With `stage` (64 KiB of free shared memory, mla_peer_stage_offset; every call site of a kernel passes the same),
// 2 ranks, bf16 parts and a bf16 out at 16-byte aligned addresses, the receiver copies the peer's rows into
// `stage` (cp.async, while the weights are computed), merges in shared memory and stores the merged rows with one
// bulk copy. (On 2 x H200 the merge of a 64-row block took 13 us with per-thread global loads one
// at a time, 11.7 with 8 loads in flight a thread, ~6 staged.) Otherwise the rows are summed from global memory by threads
// [0, kMergeThreads) of the call site (the warp-specialized kernels: their consumer warpgroups, 256 threads; their
// producer's call site passes 0: it has 56 registers after setmaxnreg).
// Every thread of the CTA calls it (it has barriers); without a.peer it returns at once.
template <int kRows, int kThreads, int kMergeThreads = kThreads>
__device__ __forceinline__ void mla_peer_merge(const MlaArgs& a, int64_t t, int h0, float* smem_part,
                                               unsigned char* stage = nullptr) {
  constexpr float kInf = INFINITY;
  const SparseMlaParams::PeerMerge& pm = a.peer;
  if (!mla_peer_on(a)) return;
  static_assert(kRows * 512 * 2 <= kMlaPeerStageBytes, "the staged block fits");
  // (no __shared__ variable: static shared memory would move the kernels' 1024-byte-aligned dynamic block)
  int& s_ok = *reinterpret_cast<int*>(smem_part + kRows * 512 + kRows + kRows * 8);
  const int tid = threadIdx.x, k = h0 / a.block_heads, me = pm.sync.rank;
  const float* rows = smem_part;
  const float* lse = smem_part + kRows * 512;
  const int64_t row0 = t * kRows;  // this token's first row in a [T, kRows] slot
  const bool part_bf16 = pm.part_dtype == DType::kBF16;
  auto aligned16 = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  __nv_bfloat16* stage_bf16 = reinterpret_cast<__nv_bfloat16*>(stage);
  if (k != me) {
    if (tid == 0) s_ok = !peer::rank_failed(peer::words_of(pm.sync));
    __syncthreads();  // the staged rows and s_ok
    if (s_ok) {
      float* dst_lse = pm.part_lse_to[k] + row0;
      if (part_bf16) {
        __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(pm.part_out_to[k]) + row0 * 512;
        for (int idx = tid; idx < kRows * 64; idx += kThreads) {  // 8 columns (16 bytes of bf16) each
          const float4 x = *reinterpret_cast<const float4*>(rows + idx * 8);
          const float4 y = *reinterpret_cast<const float4*>(rows + idx * 8 + 4);
          *reinterpret_cast<uint4*>(dst + idx * 8) =
              make_uint4(pack_bf16x2(x.x, x.y), pack_bf16x2(x.z, x.w), pack_bf16x2(y.x, y.y), pack_bf16x2(y.z, y.w));
        }
      } else {
        float* dst = static_cast<float*>(pm.part_out_to[k]) + row0 * 512;
        for (int idx = tid; idx < kRows * 128; idx += kThreads) {
          *reinterpret_cast<float4*>(dst + idx * 4) = *reinterpret_cast<const float4*>(rows + idx * 4);
        }
      }
      for (int r = tid; r < kRows; r += kThreads) dst_lse[r] = lse[r];
      peer::window_row_signal(pm.sync, t);
    }
    return;
  }
  if (!peer::window_row_wait(pm.sync, t, &s_ok)) return;  // (its barriers order the staged rows too)
  const int n = pm.sync.size;
  const int other = 1 - me;  // (the staged path's one peer)
  __nv_bfloat16* out_block = static_cast<__nv_bfloat16*>(a.out) + row0 * 512;  // (the staged path's: a bf16 out)
  const bool staged = stage != nullptr && part_bf16 && a.out_bf16 && n == 2 &&
                      aligned16(static_cast<const __nv_bfloat16*>(pm.part_out_from[other]) + row0 * 512) &&
                      aligned16(out_block);
  if (staged) {  // the peer's rows into the stage while the weights are computed
    const char* src = reinterpret_cast<const char*>(static_cast<const __nv_bfloat16*>(pm.part_out_from[other]) + row0 * 512);
    for (int i = tid; i < kRows * 64; i += kThreads) cp_async_16(smem_u32(stage + i * 16), src + i * 16, 16);
    cp_async_commit();
  }
  float* weights = smem_part + kRows * 512 + kRows;  // [kRows][8]
  for (int r = tid; r < kRows; r += kThreads) {
    float l[kMlaMaxClusterSplits];
#pragma unroll
    for (int s = 0; s < kMlaMaxClusterSplits; ++s) l[s] = s >= n ? -kInf : s == me ? lse[r] : pm.part_lse_from[s][row0 + r];
    a.lse[row0 + r] = mla_merge_weights(l, weights + r * 8);
  }
  if (!staged) {
    __syncthreads();  // the weights
    if constexpr (kMergeThreads > 0) {
      if (tid < kMergeThreads) mla_peer_merge_rows<kRows, kMergeThreads>(a, pm, rows, weights, row0, n, me, tid);
    }
    return;
  }
  cp_async_wait<0>();
  __syncthreads();  // the weights and the staged peer rows
  // In shared memory, parts in rank order; each chunk is read and written back, as bf16, over the staged peer rows
  // by one thread.
  for (int idx = tid; idx < kRows * 64; idx += kThreads) {
    const int r = idx >> 6;
    const float w_me = weights[r * 8 + me], w_other = weights[r * 8 + other];
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    const uint4 raw = *reinterpret_cast<const uint4*>(stage_bf16 + idx * 8);
    const float2 p0 = bf16x2_to_float2(raw.x), p1 = bf16x2_to_float2(raw.y);
    const float2 p2 = bf16x2_to_float2(raw.z), p3 = bf16x2_to_float2(raw.w);
    const float theirs[8] = {p0.x, p0.y, p1.x, p1.y, p2.x, p2.y, p3.x, p3.y};
    const float4* own = reinterpret_cast<const float4*>(rows + idx * 8);
    const float4 o0 = own[0], o1 = own[1];
    const float mine[8] = {o0.x, o0.y, o0.z, o0.w, o1.x, o1.y, o1.z, o1.w};
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const float w = s == me ? w_me : w_other;
      if (w == 0.f) continue;
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] += w * (s == me ? mine[j] : theirs[j]);
    }
    *reinterpret_cast<uint4*>(stage_bf16 + idx * 8) = make_uint4(
        pack_bf16x2(acc[0], acc[1]), pack_bf16x2(acc[2], acc[3]), pack_bf16x2(acc[4], acc[5]), pack_bf16x2(acc[6], acc[7]));
  }
  fence_proxy_async_smem();
  __syncthreads();
  if (tid == 0) {
    bulk_store(out_block, stage, kRows * 512 * 2);
  }
}

}  // namespace dsacp::cuda
