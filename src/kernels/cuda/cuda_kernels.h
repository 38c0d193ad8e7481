// Host-side launch API of the CUDA kernels (internal to dsacp; the public entry is make_cuda_backend).
// The backend validates, launches through these, then reads the launch's device error word. Benchmarks call the
// launch functions directly so that the timed region holds only device work.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "dsacp/backend.h"
#include "dsacp/kernel_params.h"
#include "dsacp/status.h"
#include "kernels/cuda/common/device_error.h"

namespace dsacp::cuda {

struct LaunchContext {
  cudaStream_t stream = nullptr;
  int num_sms = 132;
  DeviceErrorWord error;  // where kernels record data-dependent errors
  CudaBackendOptions options;  // the backend's kernel choices
};

// ---- cache write, fill, merge --------------------------------------------------------------------------------
Status cache_write_supported(const CacheWriteParams& p);
Status launch_cache_write(const CacheWriteParams& p, const LaunchContext& ctx);
// Whether launch_cache_write carries p.upload in its parameters (one launch, rows to write); else the caller
// copies it first and launches without it.
bool cache_write_carries_upload(const CacheWriteParams& p);
Status launch_fill(void* dst, DType dtype, int64_t count, float value, const LaunchContext& ctx);
// Where merged row r = t * H + h goes in out / lse: head blocks of [T, block_heads] (sparse MLA's head_blocks
// layout); the default (block_heads == H == 1, T = rows) is row r itself.
struct LseMergeRows {
  int64_t T = 0;
  int32_t H = 1, block_heads = 1;
};
// out (f32 or bf16) = LSE merge of num_parts partial (f32) results; lse may be null. after_producer: the parts
// were written by the kernel launched just before on the same stream, and the merge may launch as its programmatic
// dependent (it starts while that kernel's last CTAs finish and waits for its writes on the device).
Status launch_lse_merge(const LseMergeParams& p, void* out, DType out_dtype, const LaunchContext& ctx,
                        const LseMergeRows& rows = LseMergeRows{}, bool after_producer = false);

// ---- context-parallel helpers ----
Status launch_gather_rows(const GatherRowsParams& p, const LaunchContext& ctx);
Status launch_topk_remap(const TopkRemapParams& p, const LaunchContext& ctx);
// The device merge takes Pt <= 64 parts with next_pow2(Pt * K) 8-byte keys in 200 KB of shared memory
// (Pt * K <= 16384); larger merges run on the host.
bool topk_merge_on_device(const TopkMergeParams& p);
// The most candidates (parts x K) of a row that the small merge takes: the DCP decode's 2 x 2048, and the limit of
// the top-k's fused merge (IndexerTopkParams::merge).
int64_t merge_row_max_candidates();
Status launch_topk_merge(const TopkMergeParams& p, const LaunchContext& ctx);

// ---- serving options (serving/output_form.cu) ----
Status launch_topk_input(const TopkInputParams& p, const LaunchContext& ctx);
Status launch_output_form(const OutputFormParams& p, const LaunchContext& ctx);

// ---- sparse MLA ----------------------------------------------------------------------------------------------
// "unsupported" with the supported set when the parameters are outside it.
Status sparse_mla_supported(const SparseMlaParams& p, const CudaBackendOptions& o);
// How many key splits the launch uses (1 = no split-K): enough CTAs to fill the GPU for small batches
// (ctx.num_sms; ctx.options.mla_splits forces a count).
int sparse_mla_num_splits(const SparseMlaParams& p, const LaunchContext& ctx);
// The heads one sparse MLA CTA's tile holds for a head block of block_heads heads: 16 (1..16), 32 (17..32) or 64;
// a block's last group is partial (masked) where block_heads is not a multiple.
int mla_head_group(int block_heads);
// Whether the splits are merged inside the kernel (a cluster of each token's splits: 2..8 splits, 64-head groups
// unless o.mla_cluster_merge says otherwise); else partials go to a workspace and a merge kernel follows.
bool sparse_mla_cluster_merge(int splits, int head_group, const CudaBackendOptions& o);
// fp8_ds_mla on the 64-head decode kernel (ws32): a token's head groups dequantize each tile in pairs (a cluster of
// two CTAs), where the token has an even number of groups and no split-K cluster merge takes the cluster.
bool sparse_mla_fp8_pair_dequant(const SparseMlaParams& p, int splits, const CudaBackendOptions& o);
// f32 workspace for split partials: splits * T * H * (Dl + 1) floats (0 when splits == 1 or merged in the kernel).
int64_t sparse_mla_workspace_floats(const SparseMlaParams& p, int splits, const CudaBackendOptions& o);
Status launch_sparse_mla(const SparseMlaParams& p, int splits, float* workspace, const LaunchContext& ctx);
// Prefill over fp8_ds_mla records (sparse_mla_fp8_prefill.cu): true where p reads records with a prefill's shape
// (8 tokens a request or more) and the dequantized pages fit the scratch bound; then the records the block table
// reaches are dequantized into scratch (sparse_mla_fp8_scratch_bytes) by launch_fp8_records_to_bf16 and the bf16
// kernels run on sparse_mla_fp8_bf16_view(p, scratch) (bf16 views and a block table of the scratch).
bool sparse_mla_fp8_via_bf16(const SparseMlaParams& p);
int64_t sparse_mla_fp8_scratch_bytes(const SparseMlaParams& p);
SparseMlaParams sparse_mla_fp8_bf16_view(const SparseMlaParams& p, void* scratch);
Status launch_fp8_records_to_bf16(const SparseMlaParams& p, void* scratch, const LaunchContext& ctx);
// The kernel for 64-head groups (H = 64, 128), both warp-specialized wgmma kernels: 32-key tiles with two pairs in
// flight for decode (num_tokens < 8 x num_requests), 64-key tiles refilled in parts for prefill; o.mla_kernel
// forces one, or the mma.sync kernel (for comparison).
enum class MlaKernel { kWgmmaWs, kWgmmaWs32, kMmaSync, kSmallHeads };
MlaKernel sparse_mla_kernel_choice(int64_t num_tokens, int32_t num_requests, const CudaBackendOptions& o);
// How a launch covers p's heads (p.H in p.head_blocks blocks), chosen by one rule (sparse_mla_mma.cu): the head
// group (mla_head_group of a block's heads), the groups a block and a token take, and the kernel (the mma.sync
// kernel for 16 / 32-head groups and for partial 64-head groups, sparse_mla_kernel_choice for whole ones; 16-head
// groups run the streaming kernel, sparse_mla_small_heads.cu, where sparse_mla_small_heads_choice says so).
struct MlaShape {
  int head_group = 16;
  int block_groups = 1;
  int groups = 1;
  MlaKernel kernel = MlaKernel::kMmaSync;
};
MlaShape sparse_mla_shape(const SparseMlaParams& p, const CudaBackendOptions& o);

// ---- indexer + top-k -----------------------------------------------------------------------------------------
Status indexer_topk_supported(const IndexerTopkParams& p);
// OK when p.merge is unset, or a merge the top-k can fuse (see IndexerTopkParams::merge); else why not.
Status indexer_topk_merge_supported(const IndexerTopkParams& p);

// One CTA of the score kernel: tokens [t0, t0 + nt) of one request against keys [k0, k0 + kScoreKeys).
struct ScoreItem {
  int32_t t0;
  int32_t nt;
  int32_t k0;
  int32_t pad;
};

// A token group and where its items start: items [item_begin, next group's item_begin) cover keys
// k0 = 0, kScoreKeys, 2 * kScoreKeys, ... of the group's visible range.
struct ScoreGroup {
  int32_t t0;
  int32_t nt;
  int64_t item_begin;
};

// Host plan of one indexer call: tokens are cut into chunks whose scores fit the score budget; each chunk's
// tokens are grouped (consecutive tokens of one request), and each group's visible key range cut into items.
// The plan lists groups only (O(T) host work and upload); the items are expanded on the device.
struct IndexerPlan {
  struct Chunk {
    int64_t t0, t1;                 // tokens [t0, t1)
    int64_t item_begin, item_end;   // items of the chunk
    int64_t score_floats;           // floats of the chunk's score rows
    int32_t max_group_tokens;       // largest token group of the chunk (sizes the score kernel's smem)
    int32_t max_len;                // longest key_len of the chunk (sizes the top-k kernel's row cache)
  };
  std::vector<Chunk> chunks;
  std::vector<ScoreGroup> groups;
  int64_t num_items = 0;
  std::vector<int64_t> score_offset;  // [T] start of token t's row in its chunk's buffer (multiple of 4 floats)
  int64_t max_score_floats = 0;
};
inline constexpr int64_t kIndexerScoreBudgetFloats = int64_t{1} << 25;  // 128 MiB of fp32 scores per chunk
// request/key_len are host copies of p.rows; validates them as the CPU oracle does.
Result<IndexerPlan> indexer_plan(const IndexerTopkParams& p, const int32_t* request, const int32_t* key_len,
                                 int64_t score_budget_floats = kIndexerScoreBudgetFloats);

// The plan's items, expanded on the host (tests and benchmarks).
std::vector<ScoreItem> indexer_plan_items(const IndexerPlan& plan);
// Expands the plan's groups (device copy, plan.groups.size() entries) into items[plan.num_items] on the device.
Status launch_expand_score_items(const ScoreGroup* groups, int64_t num_groups, ScoreItem* items, int64_t num_items,
                                 const LaunchContext& ctx);

// A plan small enough to travel in the kernels' parameters: one chunk of at most kInlinePlanRows tokens (hence
// groups). The indexer then needs neither the plan's upload nor the item expansion's launch (two CUDA calls before
// the score kernel's launch: 5-30 us of host time on a decode step's critical path).
inline constexpr int kInlinePlanRows = 128;
struct InlinePlan {
  int32_t num_groups = 0;  // 0: the plan is in device memory (IndexerPlanDevice::items, score_offset)
  int32_t group_t0[kInlinePlanRows];
  int32_t group_nt[kInlinePlanRows];
  int32_t group_item_begin[kInlinePlanRows];
  int32_t score_offset[kInlinePlanRows];  // [T]
};
bool inline_plan_fits(const IndexerPlan& plan, int64_t num_tokens);
InlinePlan make_inline_plan(const IndexerPlan& plan);

// Device copies of the plan plus the score buffer (max_score_floats); or the plan inline (inl.num_groups > 0:
// items and score_offset unused).
struct IndexerPlanDevice {
  const ScoreItem* items = nullptr;
  const int64_t* score_offset = nullptr;
  float* scores = nullptr;
  InlinePlan inl;
};
Status launch_indexer_topk(const IndexerTopkParams& p, const IndexerPlan& plan, const IndexerPlanDevice& dev,
                           const LaunchContext& ctx);

}  // namespace dsacp::cuda
