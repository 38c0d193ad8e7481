// Arguments shared by the sparse MLA kernels (mma.sync for any head group, wgmma for 64-head groups), their
// shared prologue, their output rows, and the wgmma kernels' shared epilogue. The split-K cluster merge and the
// ranks' peer merge: sparse_mla_merge.cuh.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/cuda/common/smem_attribute.h"
#include "kernels/cuda/comm/peer_sync.cuh"
#include "kernels/cuda/common/cluster_sm90.cuh"
#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/device_error.cuh"
#include "kernels/cuda/common/device_error.h"
#include "kernels/cuda/common/mma_sm80.cuh"
#include "kernels/cuda/common/wgmma_sm90.cuh"
#include "kernels/cuda/cuda_kernels.h"

namespace dsacp::cuda {

struct MlaArgs {
  const int32_t* request;   // [T]
  const int32_t* key_len;   // [T]
  const __nv_bfloat16* q_nope;  // [T, H, 512]
  const __nv_bfloat16* q_rope;  // [T, H, 64]
  const __nv_bfloat16* latent;  // [num_pages * page_size, 512]
  const __nv_bfloat16* rope;    // [num_pages * page_size, 64]
  int64_t latent_stride, rope_stride;  // elements from one key row to the next (512 / 64 when dense)
  // Key rows as the kernels address them (MlaRowUnits, mla_entry_row): row = page * page_units + offset *
  // key_units; the latent row at latent + row * latent_unit elements, the rope at rope + row * rope_unit, a record
  // at records + row * record_unit bytes.
  int32_t page_units, key_units;
  int64_t latent_unit, rope_unit, record_unit;
  const int32_t* block_table;   // [num_requests, max_pages]
  const int32_t* topk;          // [T, K]
  void* out;                    // [T, H, 512] f32 or bf16 (splits == 1)
  float* lse;                   // [T, H]
  float* part_out;              // [S, T, H, 512] (splits > 1)
  float* part_lse;              // [S, T, H]
  int64_t T;
  int32_t H, K, page_size, max_pages, num_requests, splits, split_len;
  int32_t block_heads;          // heads per block of the q / out / lse layout (H: the plain [T, H] layout)
  int32_t block_groups;         // the kernel's head groups a head block takes: ceil(block_heads / head group); the
                                // last one is partial (masked) where block_heads is not a multiple of the group
  int32_t groups;               // head groups a token takes: head_blocks * block_groups
  int64_t num_pages;
  float scale_log2;             // scale * log2(e)
  bool out_bf16;
  bool cluster_merge;           // splits > 1 merged inside the kernel: the splits of a (token, head group) are one
                                // cluster and combine through shared memory (mla_cluster_merge); else part_out
  bool pair_dequant;            // fp8_ds_mla on the ws32 kernel: CTAs 2i, 2i + 1 (the same token and keys, other
                                // heads) are a cluster and each dequantizes half of every tile into both
  DeviceErrorWord err;
  SparseMlaParams::PeerMerge peer;  // the ranks' partials merged in the kernel (peer.sync.seq != 0; splits == 1)
  // fp8_ds_mla records (record_bytes > 0; latent / rope unused): key row r's record at records + r * record_bytes
  // (512 e4m3, 4 f32 tile scales, 64 bf16 rope).
  const unsigned char* records;
  int32_t record_bytes;
};

// How the kernels count key rows (MlaArgs::page_units ...): a dense pool in its rows (page_size rows a page, units
// the row strides); a padded pool (PagedPoolView::page_stride) in its rows where a page stride is a whole number
// of them (the latent's and the rope's the same number), else in 16-byte units (one pool of records, or the latent
// and rope rows of one combined buffer: one stride). So a key's address is one multiply, as for a dense pool (a
// division by page_size per copy, even behind a uniform branch, cost the FP8 producers 3-15%). Separate latent
// and rope pools padded by different numbers of rows have no common count: refused (false, with why).
struct MlaRowUnits {
  int32_t page_units = 0, key_units = 1;
  int64_t latent_unit = 0, rope_unit = 0, record_unit = 0;
};
bool mla_row_units(const SparseMlaParams& p, MlaRowUnits* u, std::string* why);

// Key row `row`'s latent row, rope row, or record (row 0's for an absent key, row < 0, whose copies are
// zero-filled). 64-bit: num_pages * page_size * 656 passes 2^31 from 3.3M keys.
__device__ __forceinline__ const __nv_bfloat16* mla_latent_row(const MlaArgs& a, int32_t row) {
  return a.latent + static_cast<int64_t>(row < 0 ? 0 : row) * a.latent_unit;
}
__device__ __forceinline__ const __nv_bfloat16* mla_rope_row(const MlaArgs& a, int32_t row) {
  return a.rope + static_cast<int64_t>(row < 0 ? 0 : row) * a.rope_unit;
}
__device__ __forceinline__ const unsigned char* mla_record(const MlaArgs& a, int32_t row) {
  return a.records + static_cast<int64_t>(row < 0 ? 0 : row) * a.record_unit;
}

// Eight e4m3 values (two 32-bit words, value 0 in the low byte) dequantized as scale * value in f32 and rounded to
// bf16 once (the contract's bf16 bound; e4m3 -> f32 is exact), as four packed bf16 pairs.
__device__ __forceinline__ uint4 mla_dequant8(uint32_t w0, uint32_t w1, float scale) {
  auto pair = [scale](uint32_t w) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
    return pack_bf16x2(f.x * scale, f.y * scale);
  };
  return make_uint4(pair(w0), pair(w0 >> 16), pair(w1), pair(w1 >> 16));
}

// Key splits: a CTA handles at most kMlaMaxSplitKeys top-k entries; a split's length is a whole number of the
// mma.sync kernel's 32-key tiles (sparse_mla_num_splits picks the count, launch_sparse_mla the length).
constexpr int kMlaMaxSplitKeys = 2048;
constexpr int kMlaSplitKeyTile = 32;
__host__ __device__ constexpr int mla_split_len(int K, int splits) {
  return ((K + splits - 1) / splits + kMlaSplitKeyTile - 1) / kMlaSplitKeyTile * kMlaSplitKeyTile;
}
// CTAs per SM of the mma.sync kernel: two for 16-head groups (one CTA's barriers and waits hide behind the other's
// work), else one; the split count fills that many CTA slots.
__host__ __device__ constexpr int mla_mma_ctas_per_sm(int head_group) { return head_group == 16 ? 2 : 1; }

// The row of (token t, head h) in the caller's q / out / lse layout (SparseMlaParams::head_blocks blocks of
// [T, block_heads]); the split-K workspace keeps the plain t * H + h.
__device__ __forceinline__ int64_t mla_head_row(const MlaArgs& a, int64_t t, int h) {
  return (static_cast<int64_t>(h / a.block_heads) * a.T + t) * a.block_heads + h % a.block_heads;
}

// The Hopper warpgroup-MMA kernels for 64-head groups (H = 64, 128): one CTA per (token, head group, split).
// wgmma_ws: warp-specialized, a producer warpgroup and a pair of 64-key tiles per step (prefill); wgmma_ws32: the
// same with 32-key tiles and two pairs in flight (decode). sparse_mla_kernel_choice picks.
Status launch_sparse_mla_wgmma_ws(const MlaArgs& args, int groups, const LaunchContext& ctx);
Status launch_sparse_mla_wgmma_ws32(const MlaArgs& args, int groups, const LaunchContext& ctx);
// The memory-streaming kernel for 16-head groups (sparse_mla_small_heads.cu): bulk copies into a ring of 32-key
// tiles, four math warps each on a quarter of the latent; bf16 pools or fp8_ds_mla records.
Status launch_sparse_mla_small_heads(const MlaArgs& args, int groups, const LaunchContext& ctx);

// The grid is (T x head groups, 1, splits) with a token's head groups next to each other in launch order, so that
// they run together and the second reads the token's rows from L2 (H = 128, and more CTAs than the GPU holds at
// once: MTP decode, prefill). blockIdx.x = t * groups + g; group g is group g % block_groups of head block
// g / block_groups (a group never straddles a head block: its heads are h0 .. h0 + mla_cta_heads - 1).
__device__ __forceinline__ int64_t mla_cta_token(const MlaArgs& a, int /*head_group*/) {
  return blockIdx.x / static_cast<unsigned>(a.groups);
}
__device__ __forceinline__ int mla_cta_head0(const MlaArgs& a, int head_group) {
  const int g = static_cast<int>(blockIdx.x % static_cast<unsigned>(a.groups));
  return (g / a.block_groups) * a.block_heads + (g % a.block_groups) * head_group;
}
// The heads this CTA stores: head_group, or fewer in a head block's last, partial group (its other rows of the
// tile run on zero queries and are never stored).
__device__ __forceinline__ int mla_cta_heads(const MlaArgs& a, int head_group) {
  const int g = static_cast<int>(blockIdx.x % static_cast<unsigned>(a.groups));
  return min(head_group, a.block_heads - (g % a.block_groups) * head_group);
}

// Launches MLA kernel `name` on that grid with smem_bytes of dynamic shared memory (the attribute is set first);
// with a.cluster_merge the splits of a (token, head group) form one cluster (dims (1, 1, splits)) and merge in the
// kernel; with a.pair_dequant two head groups of a token form one (dims (2, 1, 1)). Any failure comes back as a
// Status naming the kernel.
inline Status launch_mla_grid(void (*kernel)(MlaArgs), const char* name, const MlaArgs& a, int groups, int threads,
                              int smem_bytes, cudaStream_t stream) {
  const std::string what = std::string("launch of ") + name;
  DSACP_RETURN_IF_ERROR(cuda_status(
      ensure_dynamic_smem_limit(kernel, smem_bytes), what.c_str(), __FILE__,
      __LINE__));
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(a.T * groups), 1, static_cast<unsigned>(a.splits));
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  if (a.cluster_merge) {
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = 1;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = static_cast<unsigned>(a.splits);
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  } else if (a.pair_dequant) {
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = 2;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  DSACP_RETURN_IF_ERROR(cuda_status(cudaLaunchKernelEx(&cfg, kernel, a), what.c_str(), __FILE__, __LINE__));
  return cuda_status(cudaGetLastError(), what.c_str(), __FILE__, __LINE__);
}

// The prologue both sparse MLA kernels share, for token t and key split `split`: checks the token's request
// row and key length (a bad one is reported through a.err and the token uses no key), finds how many leading
// top-k entries are used (the first entry outside [0, key_len) ends the list) and returns this split's
// entries. Every thread of the block must call it; smem_word is one int32 of shared memory.
struct MlaSplitKeys {
  int32_t request;         // the token's block-table row
  const int32_t* entries;  // this split's first used top-k entry
  int nkeys;               // used entries in this split
};

template <int kThreads>
__device__ __forceinline__ MlaSplitKeys mla_split_keys(const MlaArgs& a, int64_t t, int split, int32_t* smem_word) {
  const int tid = threadIdx.x;
  const int32_t b = a.request[t];
  const int32_t len = a.key_len[t];
  const bool row_ok = b >= 0 && b < a.num_requests && len >= 0;
  if (tid == 0) {
    *smem_word = a.K;
    if (!row_ok) report_device_error(a.err, b < 0 || b >= a.num_requests ? kDevBadRequest : kDevBadKeyLen, t);
  }
  __syncthreads();
  const int32_t* trow = a.topk + t * a.K;
  if (row_ok) {
    for (int i = tid; i < a.K; i += kThreads) {
      const int32_t e = trow[i];
      if (e < 0 || e >= len) atomicMin(smem_word, i);
    }
  }
  __syncthreads();
  const int n_used = row_ok ? *smem_word : 0;
  // The used entries are split evenly (in whole 64-key tiles) between the splits, so a row with fewer used
  // entries than K (a short context, or a CP rank's remapped top-k: its own keys first, then -1) still gives
  // every split work. Both chunk and split_len times splits cover n_used <= K.
  const int chunk = a.splits == 1 ? a.split_len : min(a.split_len, ((n_used + a.splits - 1) / a.splits + 63) / 64 * 64);
  const int kb = split * chunk;
  const int ke = min(n_used, kb + chunk);
  return MlaSplitKeys{b, trow + min(kb, a.K), max(0, ke - kb)};
}

// The cache row of split-local key `key` (-1: past the split's used entries, or a key whose page lies outside the
// block table or the cache, which is reported), in three steps so that a caller can keep the two dependent loads in
// flight behind other work: the top-k entry (-1 past the used ones), its page, then the row.
__device__ __forceinline__ int32_t mla_key_entry(const MlaSplitKeys& keys, int key) {
  return key < keys.nkeys ? keys.entries[key] : -1;
}
__device__ __forceinline__ int32_t mla_entry_page(const MlaArgs& a, const MlaSplitKeys& keys, int32_t e) {
  if (e < 0) return -1;
  const int32_t c = e / a.page_size;
  return c < a.max_pages ? a.block_table[static_cast<int64_t>(keys.request) * a.max_pages + c] : -1;
}
__device__ __forceinline__ int32_t mla_entry_row(const MlaArgs& a, int64_t t, int32_t e, int32_t page) {
  if (e < 0) return -1;
  if (page < 0 || page >= a.num_pages) {
    report_device_error(a.err, kDevBadPage, t);
    return -1;
  }
  return page * a.page_units + e % a.page_size * a.key_units;
}
__device__ __forceinline__ int32_t mla_cache_row(const MlaArgs& a, const MlaSplitKeys& keys, int64_t t, int key) {
  const int32_t e = mla_key_entry(keys, key);
  return mla_entry_row(a, t, e, mla_entry_page(a, keys, e));
}

// Q rows [h0, h0 + kRows) of token t, 72 16-byte chunks a row (512 latent + 64 rope bf16), copied by cp.async from
// kThreadsQ threads (index tid) to sQ + smem_off(r, c), the kernel's swizzled layout; the caller commits and waits.
// Rows from `valid_rows` on (a partial head group) are zero-filled, nothing read for them.
template <int kRows, int kThreadsQ, typename SmemOff>
__device__ __forceinline__ void mla_load_q(const MlaArgs& a, int64_t t, int h0, int tid, uint32_t sQ, SmemOff smem_off,
                                           int valid_rows = kRows) {
  for (int idx = tid; idx < kRows * 72; idx += kThreadsQ) {
    const int r = idx / 72, c = idx % 72;
    const bool valid = r < valid_rows;
    const int64_t qrow = mla_head_row(a, t, h0 + (valid ? r : 0));
    const void* src = c < 64 ? static_cast<const void*>(a.q_nope + qrow * 512 + c * 8)
                             : static_cast<const void*>(a.q_rope + qrow * 64 + (c - 64) * 8);
    cp_async_16(sQ + smem_off(r, c), src, valid ? 16 : 0);
  }
}

// The epilogue has begun: a kernel launched as this one's programmatic dependent (launch_lse_merge's split-K
// combine) may be scheduled once every CTA got here; it waits for this grid's writes itself (griddepcontrol.wait).
__device__ __forceinline__ void mla_allow_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

// Two adjacent output values at p: bf16 (the caller's bf16 out) or f32 (its f32 out, or split-K partials).
__device__ __forceinline__ void mla_store_pair(__nv_bfloat16* p, float v0, float v1) {
  *reinterpret_cast<uint32_t*>(p) = pack_bf16x2(v0, v1);
}
__device__ __forceinline__ void mla_store_pair(float* p, float v0, float v1) {
  *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
}

// Where a CTA's result rows go. splits == 1: the caller's out / lse in its layout. Split-K merged in the cluster:
// this CTA's shared memory from `smem_part` ([rows, 512] f32 partial rows, then [rows] f32 LSE; row = the head's
// index in the group). Otherwise: this split's f32 partials in the workspace (plain t * H + h rows).
// With a.peer (the ranks' partials merged in the kernel, splits == 1) the rows go to shared memory as the
// cluster merge's do, and mla_peer_merge takes them from there.
__device__ __forceinline__ bool mla_peer_on(const MlaArgs& a) { return a.peer.sync.seq != 0; }
__device__ __forceinline__ int64_t mla_out_row(const MlaArgs& a, int64_t t, int h0, int r) {
  if (mla_peer_on(a)) return r;
  if (a.splits == 1) return mla_head_row(a, t, h0 + r);
  return a.cluster_merge ? r : t * a.H + h0 + r;
}
__device__ __forceinline__ float* mla_lse_rows(const MlaArgs& a, int split, float* smem_part, int rows) {
  if (mla_peer_on(a)) return smem_part + rows * 512;
  if (a.splits == 1) return a.lse;
  return a.cluster_merge ? smem_part + rows * 512 : a.part_lse + static_cast<int64_t>(split) * a.T * a.H;
}
// Calls body(out) once with the base of this CTA's output rows ([rows, 512], indexed by mla_out_row): the caller's
// out (bf16 or f32), the cluster merge's shared memory or the workspace. The type is chosen once, outside the
// caller's store loop.
template <typename Body>
__device__ __forceinline__ void mla_with_out_rows(const MlaArgs& a, int split, float* smem_part, Body body) {
  if (mla_peer_on(a)) {
    body(smem_part);
  } else if (a.splits == 1 && a.out_bf16) {
    body(static_cast<__nv_bfloat16*>(a.out));
  } else if (a.splits == 1) {
    body(static_cast<float*>(a.out));
  } else {
    body(a.cluster_merge ? smem_part : a.part_out + static_cast<int64_t>(split) * a.T * a.H * 512);
  }
}

// O (the m64n256 accumulator of this thread's rows r0, r1) times a0 / a1, skipped when no row of the warp moves
// (the running max rarely moves after a few tiles).
__device__ __forceinline__ void mla_scale_o_rows(float (&o)[128], float a0, float a1) {
  if (__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f)) {
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      o[j * 4 + 0] *= a0;
      o[j * 4 + 1] *= a0;
      o[j * 4 + 2] *= a1;
      o[j * 4 + 3] *= a1;
    }
  }
}

// The wgmma kernels whose shared memory must start 1024-byte aligned (swizzle atoms, and no slack left to align
// it): false (reported as kDevSmemAlign by thread 0) when it does not. Every thread gets the same answer, so the
// block leaves before any barrier.
__device__ __forceinline__ bool mla_smem_aligned(const MlaArgs& a, const void* smem) {
  if ((smem_u32(smem) & 1023) == 0) return true;
  if (threadIdx.x == 0) report_device_error(a.err, kDevSmemAlign, mla_cta_token(a, 64));
  return false;
}

// The epilogue of the wgmma kernels: each of the two warpgroups holds its tiles' share of the row sums (l0, l1 of
// rows r0 = 16 (warp % 4) + lane / 4 and r1 = r0 + 8); they are added through sL ([2][64] f32 in shared memory,
// after `sync`, a barrier of both warpgroups). Then warpgroup wg's O [64 heads, 256 columns] in the m64n256
// accumulator layout (o[4j], o[4j+1]: row r0, columns 256 wg + 8 j + 2 (lane % 4) and +1; o[4j+2], o[4j+3]: row
// r1), divided by the row sums (0 where a row has no key), goes to the caller's layout (splits == 1: bf16 or f32)
// or the split-K partials (f32: the workspace, or smem_part for the cluster merge, which must not overlap sL);
// warpgroup 0 stores the LSE too (m0, m1: the rows' max in the log2 domain, -inf without keys). Rows from nh on
// (a partial head group's) are not stored.
template <typename Sync>
__device__ __forceinline__ void store_wgmma64_rows(const MlaArgs& a, int64_t t, int h0, int split, int wg, int lane,
                                                   int r0, int r1, const float (&o)[128], float l0, float l1,
                                                   float* sL, Sync sync, float m0, float m1, float* smem_part,
                                                   int nh = 64) {
  constexpr float kLn2 = 0.6931471805599453f;
  mla_allow_dependents();
  if ((lane & 3) == 0) {
    sL[wg * 64 + r0] = l0;
    sL[wg * 64 + r1] = l1;
  }
  sync();
  const float L0 = sL[r0] + sL[64 + r0], L1 = sL[r1] + sL[64 + r1];
  const float inv0 = L0 > 0.f ? 1.f / L0 : 0.f, inv1 = L1 > 0.f ? 1.f / L1 : 0.f;
  const bool st0 = r0 < nh, st1 = r1 < nh;
  const int64_t row0 = mla_out_row(a, t, h0, st0 ? r0 : 0), row1 = mla_out_row(a, t, h0, st1 ? r1 : 0);
  mla_with_out_rows(a, split, smem_part, [&](auto* out) {
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int c = wg * 256 + j * 8 + (lane & 3) * 2;
      if (st0) mla_store_pair(out + row0 * 512 + c, o[j * 4 + 0] * inv0, o[j * 4 + 1] * inv0);
      if (st1) mla_store_pair(out + row1 * 512 + c, o[j * 4 + 2] * inv1, o[j * 4 + 3] * inv1);
    }
  });
  if (wg == 0 && (lane & 3) == 0) {
    const float v0 = L0 > 0.f ? (m0 + log2f(L0)) * kLn2 : -INFINITY;
    const float v1 = L1 > 0.f ? (m1 + log2f(L1)) * kLn2 : -INFINITY;
    float* dst = mla_lse_rows(a, split, smem_part, 64);
    if (st0) dst[row0] = v0;
    if (st1) dst[row1] = v1;
  }
}

}  // namespace dsacp::cuda
