// The sparse MLA dispatch rules, one place for every kernel of the family: which kernel a launch runs
// (sparse_mla_kernel_choice, sparse_mla_shape: head groups, fp8_ds_mla records, the streaming 16-head kernel), what
// it supports (sparse_mla_supported, answered with what is), and how split-K is done (sparse_mla_num_splits,
// sparse_mla_cluster_merge, sparse_mla_workspace_floats). launch_sparse_mla (sparse_mla_mma.cu) follows them.
#include <algorithm>
#include <cstdint>
#include <string>

#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/sparse_mla/sparse_mla_args.cuh"
#include "kernels/cuda/sparse_mla/sparse_mla_merge.cuh"

namespace dsacp::cuda {
namespace {

constexpr int kDl = 512, kDr = 64;

}  // namespace

MlaKernel sparse_mla_kernel_choice(int64_t num_tokens, int32_t num_requests, const CudaBackendOptions& o) {
  switch (o.mla_kernel) {
    case CudaBackendOptions::MlaKernel::kMmaSync: return MlaKernel::kMmaSync;
    case CudaBackendOptions::MlaKernel::kWgmmaWs: return MlaKernel::kWgmmaWs;
    case CudaBackendOptions::MlaKernel::kWgmmaWs32: return MlaKernel::kWgmmaWs32;
    case CudaBackendOptions::MlaKernel::kSmallHeads:  // (16-head groups only: sparse_mla_shape)
    case CudaBackendOptions::MlaKernel::kAuto: break;
  }
  // Decode (few tokens per request: every gather is new) runs the 32-key-tile kernel, whose two pairs of tiles in
  // flight hide the gathers; prefill (many tokens share a request's keys, the gathers hit L2) runs the 64-key-tile
  // kernel, whose QK^T reads less shared memory per key (one H200: decode h=128 0.1016 against 0.1060 ms,
  // prefill 413 against 424 TFLOP/s).
  return num_tokens >= 8 * std::max<int64_t>(1, num_requests) ? MlaKernel::kWgmmaWs : MlaKernel::kWgmmaWs32;
}

// The one rule for how a launch covers the heads. A head block of bh heads runs in groups of 16 (bh <= 16), 32
// (bh <= 32) or 64 heads; the block's last group is partial where bh is not a multiple (its missing rows run on
// zero queries and are not stored), so H = 1..8 reads the keys H = 16 reads, once a token, and 24 reads them as 32
// does. Whole 64-head groups (H = 64, 128, their head blocks) run the wgmma kernels (sparse_mla_kernel_choice);
// partial ones (bh = 48, 96, ...: one key pass a 64-head group) the mma.sync kernel, whose rows are masked.
int mla_head_group(int block_heads) { return block_heads <= 16 ? 16 : block_heads <= 32 ? 32 : 64; }

// fp8_ds_mla records: the warp-specialized 32-key-tile kernel, whose producer warpgroup dequantizes the records in
// place (sparse_mla_wgmma_ws32.cu), runs 64-head groups: head blocks of more than 32 heads (a partial last group,
// bh = 48, 96, as a 64-head group with its missing rows masked), or any block when o.mla_kernel asks for a wgmma
// kernel. Blocks of up to 32 heads keep the mma.sync kernel (16 / 32-head groups: the wgmma tile is 64 rows).
// One H200, b=64 ctx 32K top-k 2048: docs/design/2026-12-03-fp8-mla-decode.md.
bool sparse_mla_fp8_ws32(const SparseMlaParams& p, const CudaBackendOptions& o) {
  if (!p.latent.records()) return false;
  switch (o.mla_kernel) {
    case CudaBackendOptions::MlaKernel::kWgmmaWs32:
    case CudaBackendOptions::MlaKernel::kWgmmaWs: return true;
    case CudaBackendOptions::MlaKernel::kMmaSync:
    case CudaBackendOptions::MlaKernel::kSmallHeads: return false;
    case CudaBackendOptions::MlaKernel::kAuto: break;
  }
  const int bh = p.head_blocks >= 1 ? p.H / p.head_blocks : p.H;
  return mla_head_group(bh) == 64;
}

// 16-head groups: the streaming kernel (sparse_mla_small_heads.cu) when forced, and by default for decode-like
// shapes (fewer than 8 tokens a request: every gather is a new row from HBM) over fp8_ds_mla records (one H200,
// b=64 ctx 32K h=16: 0.0541 against 0.0681 ms); over bf16 pools it ran 0.0641 against 0.0613 ms (both at the
// random-gather DRAM rate), so the mma.sync kernel stays there (and for prefill, or forced with kMmaSync).
static bool small_heads_choice(const SparseMlaParams& p, const CudaBackendOptions& o) {
  if (o.mla_kernel == CudaBackendOptions::MlaKernel::kSmallHeads) return true;
  if (o.mla_kernel != CudaBackendOptions::MlaKernel::kAuto) return false;
  return p.latent.records() && p.rows.num_tokens < 8 * std::max<int64_t>(1, p.block_table.num_requests);
}

MlaShape sparse_mla_shape(const SparseMlaParams& p, const CudaBackendOptions& o) {
  MlaShape s;
  const int bh = p.head_blocks >= 1 ? p.H / p.head_blocks : p.H;
  if (sparse_mla_fp8_ws32(p, o)) {
    s.head_group = 64;
    s.block_groups = std::max(1, (bh + 63) / 64);
    s.groups = std::max(1, p.head_blocks) * s.block_groups;
    s.kernel = MlaKernel::kWgmmaWs32;
    return s;
  }
  s.head_group = mla_head_group(bh);
  s.block_groups = std::max(1, (bh + s.head_group - 1) / s.head_group);
  s.groups = std::max(1, p.head_blocks) * s.block_groups;
  s.kernel = s.head_group < 64 || bh % 64 != 0 || p.latent.records()
                 ? MlaKernel::kMmaSync
                 : sparse_mla_kernel_choice(p.rows.num_tokens, p.block_table.num_requests, o);
  if (s.head_group == 16 && small_heads_choice(p, o)) s.kernel = MlaKernel::kSmallHeads;
  return s;
}

Status sparse_mla_supported(const SparseMlaParams& p, const CudaBackendOptions& o) {
  const std::string supported =
      " (CUDA sparse_mla supports H >= 1 in head blocks of any size, Dl = 512, Dr = 64, bf16 q_nope/q_rope/latent/"
      "rope or one pool of fp8_ds_mla records, f32 or bf16 out, page_size 1..1024, num_pages * page_size < 2^31)";
  if (p.H < 1) return unsupported("sparse_mla: H=" + std::to_string(p.H) + supported);
  const bool records = p.latent.records() || p.rope.records();
  if (records && (!p.latent.records() || !p.rope.records() || p.latent.data != p.rope.data ||
                  p.latent.record_bytes != p.rope.record_bytes || p.latent.dtype != DType::kF8E4M3 ||
                  p.rope.dtype != DType::kBF16 || p.latent.record_bytes != fp8_ds_mla_record_bytes(kDl, kDr))) {
    return unsupported("sparse_mla: an fp8_ds_mla cache needs the F8_E4M3 latent and BF16 rope views of one pool of "
                       "656-byte records (latent record_bytes " + std::to_string(p.latent.record_bytes) +
                       ", rope record_bytes " + std::to_string(p.rope.record_bytes) + ")");
  }
  for (const PagedPoolView* v : {&p.latent, &p.rope}) {
    if (pool_row_stride(*v) % 8 != 0 || reinterpret_cast<uintptr_t>(v->data) % 16 != 0) {
      return unsupported(std::string("sparse_mla: the ") + (v == &p.latent ? "latent" : "rope") + " pool's rows start " +
                         "every " + std::to_string(pool_row_stride(*v)) + " elements from an address " +
                         (reinterpret_cast<uintptr_t>(v->data) % 16 != 0 ? "not " : "") +
                         "16-byte aligned (the CUDA kernels load rows 16 bytes at a time: a row stride a multiple of 8 "
                         "bf16 elements and a 16-byte aligned pool)");
    }
  }
  if (p.head_blocks < 1 || p.H % p.head_blocks != 0) {
    return unsupported("sparse_mla: head_blocks=" + std::to_string(p.head_blocks) + " with H=" + std::to_string(p.H) +
                       " (H must be a multiple of head_blocks)");
  }
  if (p.Dl != kDl || p.Dr != kDr) {
    return unsupported("sparse_mla: Dl=" + std::to_string(p.Dl) + ", Dr=" + std::to_string(p.Dr) + supported);
  }
  if (p.q_dtype != DType::kBF16 || (!records && (p.latent.dtype != DType::kBF16 || p.rope.dtype != DType::kBF16))) {
    return unsupported(std::string("sparse_mla: q ") + dtype_name(p.q_dtype) + ", latent " +
                       dtype_name(p.latent.dtype) + ", rope " + dtype_name(p.rope.dtype) + supported);
  }
  if (p.out_dtype != DType::kF32 && p.out_dtype != DType::kBF16) {
    return unsupported(std::string("sparse_mla: out ") + dtype_name(p.out_dtype) + supported);
  }
  if (p.latent.page_size < 1 || p.latent.page_size > 1024) {
    return unsupported("sparse_mla: page_size=" + std::to_string(p.latent.page_size) + supported);
  }
  if (p.latent.num_pages * p.latent.page_size >= (int64_t{1} << 31)) {
    return unsupported("sparse_mla: num_pages * page_size=" + std::to_string(p.latent.num_pages * p.latent.page_size) +
                       supported);
  }
  MlaRowUnits units;
  std::string why;
  if (!mla_row_units(p, &units, &why)) return unsupported("sparse_mla: " + why);
  const MlaShape shape = sparse_mla_shape(p, o);
  if (p.rows.num_tokens * shape.groups >= (int64_t{1} << 31)) {
    return unsupported("sparse_mla: T * head groups >= 2^31 (CUDA grid limit)" + supported);
  }
  const int hg = shape.head_group;
  if (p.peer.sync.active()) {
    // The ranks' partials merged in the kernel: one head block per rank, each a whole 64-head group of a
    // wgmma kernel (its epilogue stages the rows in shared memory), every row with a flag.
    const WindowRowSync& w = p.peer.sync;
    if (hg != 64 || p.H / p.head_blocks != 64 || p.head_blocks != w.size || w.size < 2 || w.size > kMaxPartBuffers ||
        w.rank < 0 || w.rank >= w.size || p.rows.num_tokens > w.num_rows || mla_split_len(p.K, 1) > kMlaMaxSplitKeys ||
        (p.peer.part_dtype != DType::kF32 && p.peer.part_dtype != DType::kBF16) ||
        shape.kernel == MlaKernel::kMmaSync) {
      return unsupported("sparse_mla: partials merged across ranks need 64 heads a rank with head_blocks = the " +
                         std::string("window's ranks (2..8), a wgmma kernel, f32 or bf16 partials and a flag a row "
                                     "(H=") + std::to_string(p.H) + ", head_blocks=" + std::to_string(p.head_blocks) +
                         ", ranks " + std::to_string(w.size) + ", T=" + std::to_string(p.rows.num_tokens) + ", flags for " +
                         std::to_string(w.num_rows) + " rows)");
    }
    for (int k = 0; k < w.size; ++k) {
      if (k == w.rank) continue;
      // (the flags come from the communicator, Communicator::window_rows)
      if (p.peer.part_out_to[k] == nullptr || p.peer.part_lse_to[k] == nullptr || p.peer.part_out_from[k] == nullptr ||
          p.peer.part_lse_from[k] == nullptr) {
        return invalid_argument("sparse_mla: partials merged across ranks: rank " + std::to_string(k) +
                                "'s buffers or flags are missing");
      }
    }
  }
  return Status::ok_status();
}

bool mla_row_units(const SparseMlaParams& p, MlaRowUnits* u, std::string* why) {
  const int64_t ps = p.latent.page_size;
  const int64_t pages = p.latent.num_pages;
  if (ps < 1 || pool_row_stride(p.latent) < 1 || pool_row_stride(p.rope) < 1 || (p.latent.records() && p.latent.record_bytes < 16)) {
    *why = "empty pools (page_size " + std::to_string(ps) + ")";
    return false;
  }
  if (p.latent.records()) {
    const int64_t rec = p.latent.record_bytes, stride = pool_page_stride(p.latent);
    const bool rows = stride % rec == 0;  // dense, or padded by whole records
    u->record_unit = rows ? rec : 16;
    u->page_units = static_cast<int32_t>(std::min<int64_t>(stride / u->record_unit, INT32_MAX));
    u->key_units = static_cast<int32_t>(rows ? 1 : rec / 16);
  } else {
    const int64_t ls = pool_row_stride(p.latent) * 2, rs = pool_row_stride(p.rope) * 2;  // bytes a row
    const int64_t lp = pool_page_stride(p.latent), rp = pool_page_stride(p.rope);
    if (lp % ls == 0 && rp % rs == 0 && lp / ls == rp / rs) {  // dense, or both padded by as many whole rows
      u->latent_unit = ls / 2;
      u->rope_unit = rs / 2;
      u->page_units = static_cast<int32_t>(std::min<int64_t>(lp / ls, INT32_MAX));
      u->key_units = 1;
    } else if (lp == rp && ls == rs) {  // one combined buffer (or pools alike): 16-byte units
      u->latent_unit = u->rope_unit = 8;
      u->page_units = static_cast<int32_t>(std::min<int64_t>(lp / 16, INT32_MAX));
      u->key_units = static_cast<int32_t>(ls / 16);
    } else {
      *why = "the latent and rope pools' pages are padded unlike (page strides " + std::to_string(lp) + " and " +
             std::to_string(rp) + " bytes: " + std::to_string(static_cast<double>(lp) / ls) + " and " +
             std::to_string(static_cast<double>(rp) / rs) + " rows); the CUDA kernels take separate pools padded by " +
             "the same number of rows, or one combined latent + rope buffer";
      return false;
    }
  }
  // Rows counted in int32: the last page's last row.
  if ((pages - 1) * u->page_units + (ps - 1) * u->key_units >= (int64_t{1} << 31)) {
    *why = "the pool spans " + std::to_string(pages) + " pages of " + std::to_string(u->page_units) +
           " row units: past the 2^31 rows the CUDA kernels count";
    return false;
  }
  return true;
}

int sparse_mla_num_splits(const SparseMlaParams& p, const LaunchContext& ctx) {
  if (p.peer.sync.active()) return 1;  // the merge across ranks runs in the CTA of the whole key list
  const MlaShape shape = sparse_mla_shape(p, ctx.options);
  const int num_sms = ctx.num_sms;
  const int64_t ctas = p.rows.num_tokens * shape.groups;
  const int64_t slots = static_cast<int64_t>(num_sms) * (shape.head_group == 16 ? mla_mma_ctas_per_sm(16) : 1);  // CTAs at once
  int splits = 1;
  if (ctas > 0 && ctas * 3 / 2 < slots) splits = static_cast<int>((slots + ctas / 2) / ctas);
  if (ctx.options.mla_splits > 0) splits = ctx.options.mla_splits;
  // at least 64 keys per split, at most kMlaMaxSplitKeys
  splits = std::max(1, std::min(splits, std::max(1, p.K / 64)));
  splits = std::min(splits, 64);
  while (mla_split_len(p.K, splits) > kMlaMaxSplitKeys) ++splits;
  return splits;
}

// Split-K merged inside the kernel by a cluster of the token's splits: by default for 64-head groups (the wgmma
// kernels, one CTA an SM: decode h=64 0.0698 -> 0.0679 ms), not for the mma.sync kernel of 16 / 32-head groups
// (two CTAs an SM for h=16, where clusters of 4 ran 0.063 -> 0.084 ms: the merge kernel stays). Never past a
// portable cluster (8 splits). o.mla_cluster_merge forces it on / off (tests, comparisons).
bool sparse_mla_cluster_merge(int splits, int head_group, const CudaBackendOptions& o) {
  if (splits < 2 || splits > kMlaMaxClusterSplits) return false;
  if (o.mla_cluster_merge != CudaBackendOptions::Choice::kAuto) {
    return o.mla_cluster_merge == CudaBackendOptions::Choice::kOn;
  }
  return head_group == 64;
}

// Two CTAs of a token (its head groups 2i, 2i + 1: the same keys) share each tile's dequantization, each
// converting 16 of the 32 rows into both CTAs' shared memory (FlashMLA's way for 128 heads): half the producer's
// copies and conversions a CTA. It needs the cluster, so not with the split-K cluster merge.
bool sparse_mla_fp8_pair_dequant(const SparseMlaParams& p, int splits, const CudaBackendOptions& o) {
  if (o.mla_fp8_pair_dequant == CudaBackendOptions::Choice::kOff) return false;
  const MlaShape shape = sparse_mla_shape(p, o);
  if (!p.latent.records() || shape.kernel != MlaKernel::kWgmmaWs32 || shape.groups % 2 != 0) return false;
  return !sparse_mla_cluster_merge(std::max(1, splits), shape.head_group, o);
}

int64_t sparse_mla_workspace_floats(const SparseMlaParams& p, int splits, const CudaBackendOptions& o) {
  if (splits <= 1 || sparse_mla_cluster_merge(splits, sparse_mla_shape(p, o).head_group, o)) return 0;
  return static_cast<int64_t>(splits) * p.rows.num_tokens * p.H * (kDl + 1);
}

}  // namespace dsacp::cuda
