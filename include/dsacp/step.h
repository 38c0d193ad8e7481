// The single-device DSA step: write the new tokens' KV into the paged caches, then indexer + exact top-k,
// then sparse MLA attention, for a mixed batch (decodes, MTP decodes, fresh and chunked prefills).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "dsacp/backend.h"
#include "dsacp/batch.h"
#include "dsacp/case_file.h"
#include "dsacp/paged_cache.h"
#include "dsacp/status.h"

namespace dsacp {

struct StepConfig {
  int32_t H = 0, Dl = 0, Dr = 0, Hi = 0, Di = 0;
  int32_t K = 0;            // top-k
  float scale = 0.f;        // softmax scale, given by the caller
  DType act_dtype = DType::kBF16;   // q_nope, q_rope, kv_latent, k_rope, idx_q, idx_k
  DType out_dtype = DType::kF32;
  // idx_q and idx_k's dtype when it is not act_dtype: F8_E4M3 (contract section 6), with StepInputs::idx_q_scale
  // and idx_k_scale; the cache's indexer pool must then be F8_E4M3.
  std::optional<DType> index_dtype = std::nullopt;
  DType index_input_dtype() const { return index_dtype.value_or(act_dtype); }
  int32_t decode_threshold = kMaxDecodeThreshold;
  // Serving options: the form of StepOutputs::topk (the step's own top-k stays canonical; the slots are the
  // KV cache's: under CP, each position's slot on the rank that stores it, through the shared block table) and
  // the base of StepOutputs::lse.
  TopkForm topk_form = TopkForm::kCanonical;
  LseBase lse_base = LseBase::kNatural;
};

// A StepConfig of these shapes (H, Dl, Dr, Hi, Di), top-k K, softmax scale and dtypes; every other field at its
// default. The one place a StepConfig is built from shapes: replay, the CLI, the planner, the benchmarks and the
// tests all call it (or the case form below).
StepConfig step_config_of(const CaseDims& dims, int32_t K, float scale, DType act_dtype, DType out_dtype = DType::kF32);
// A case's: its dims, topk and scale, with the FP8 indexer (index_dtype F8_E4M3) when its idx_q is e4m3.
StepConfig step_config_of(const CaseFile& c, DType act_dtype, DType out_dtype = DType::kF32);
// DeepSeek-V3.2's layer shapes (the benchmarks' and many tests' default), with its top-k of 2048.
inline constexpr CaseDims kDeepSeekV32Dims{128, 512, 64, 64, 128};
inline constexpr int32_t kDeepSeekV32TopK = 2048;

// The step's inputs, in the backend's memory, requests' tokens consecutive in request order.
struct StepInputs {
  const void* q_nope = nullptr;     // [T, H, Dl], act_dtype
  const void* q_rope = nullptr;     // [T, H, Dr], act_dtype
  const void* kv_latent = nullptr;  // [T, Dl], act_dtype
  const void* k_rope = nullptr;     // [T, Dr], act_dtype
  const void* idx_q = nullptr;      // [T, Hi, Di], act_dtype
  const float* idx_w = nullptr;     // [T, Hi], f32
  const void* idx_k = nullptr;      // [T, Di], act_dtype
  // Optional: the step's block table already in the backend's memory ([num_requests, max_pages] int32, the
  // same entries as the host BlockTable passed with it), as a serving engine keeps it between steps and
  // layers. When set, the step reads it instead of uploading the host table, and the host checks only the
  // pages of the step's new tokens (the pages it writes); every other page is checked by the kernels that read
  // it (an entry outside the pool fails the step at its end, naming the kernel and the token).
  const int32_t* block_table = nullptr;
  const float* idx_q_scale = nullptr;  // [T, Hi], f32: with F8_E4M3 idx_q (StepConfig::index_dtype)
  const float* idx_k_scale = nullptr;  // [T], f32: with F8_E4M3 idx_k (each positive and finite)
  // Optional: a precomputed top-k ([T, K] int32, canonical request-relative positions: a layer that reuses another
  // layer's top-k, an MTP draft that reuses its target's). The step then runs no indexer: idx_q and idx_w are not
  // read and may be null, and idx_k, when null, leaves the indexer-key pool as it is. Each row must hold distinct
  // positions visible to its token, ascending, then -1 (fewer than min(K, key_len) allowed); a row that does not
  // fails the step, naming it. The step's top-k output is these rows (in config.topk_form).
  const int32_t* topk = nullptr;
  // Optional: the fingerprint of the batch these inputs belong to (step_fingerprint, dsacp/step_plan.h); a planned
  // run refuses a plan with another one. 0: not checked.
  uint64_t plan_fingerprint = 0;
};

struct StepOutputs {
  int32_t* topk = nullptr;  // [T, K]
  void* out = nullptr;      // [T, H, Dl], out_dtype
  float* lse = nullptr;     // [T, H]
};

// The single-device plan: pure host data.
struct SingleDevicePlan {
  BatchLayout layout;
  std::vector<int64_t> slots;          // [T] cache slot of each new token
  std::vector<int32_t> token_request;  // [T]
  std::vector<int32_t> token_key_len;  // [T] context_len + i + 1
};
Result<SingleDevicePlan> single_device_plan(const std::vector<Request>& requests, const BlockTable& table,
                                            int32_t page_size, int32_t decode_threshold = kMaxDecodeThreshold);

// Checks the config against the cache and the block table against the batch (every position of every
// request has a page in range; with inputs.block_table, the new tokens' positions), then runs the step: a
// plan (step_plan, dsacp/step_plan.h) and one planned run, then synchronize() (errors found on the device).
Status step_run(Backend& backend, const StepConfig& config, const std::vector<Request>& requests,
                const BlockTable& table, PagedKvCache& cache, const StepInputs& inputs, const StepOutputs& outputs);

// Host-memory conveniences over step_run (used by the CLI and tests): upload, run, download.

// Host tensors of the step's inputs: act_dtype for all but idx_w (F32). Shapes are checked.
struct HostStepInputs {
  const Tensor* q_nope = nullptr;     // [T, H, Dl]
  const Tensor* q_rope = nullptr;     // [T, H, Dr]
  const Tensor* kv_latent = nullptr;  // [T, Dl]
  const Tensor* k_rope = nullptr;     // [T, Dr]
  const Tensor* idx_q = nullptr;      // [T, Hi, Di]
  const Tensor* idx_w = nullptr;      // [T, Hi]
  const Tensor* idx_k = nullptr;      // [T, Di]
  // Upload the block table once and pass it as StepInputs::block_table (the serving path: the table kept
  // in the backend's memory) instead of letting the step upload it.
  bool device_block_table = false;
  // With config.index_dtype F8_E4M3: F32 [T, Hi] and [T].
  const Tensor* idx_q_scale = nullptr;
  const Tensor* idx_k_scale = nullptr;
  // Optional: a precomputed top-k, I32 [T, K] (StepInputs::topk); idx_q, idx_w and idx_k may then be null.
  const Tensor* topk = nullptr;
};
Result<StepResult> step_run_host(Backend& backend, const StepConfig& config, const std::vector<Request>& requests,
                                 const BlockTable& table, PagedKvCache& cache, const HostStepInputs& inputs);

// Writes the requests' context rows (positions [0, context_len), request after request) into the cache.
// Rows are [sum C, dim] host tensors of the cache's dims; their dtype is converted to the cache's. F8_E4M3
// index keys come with their scales (ctx_index_key_scales, F32 [sum C]) and go into an F8_E4M3 pool as they are.
// Into an fp8_ds_mla cache, f32/bf16 latent rows are quantized by the cache's latent_scale_mode, and an F8_E4M3
// ctx_latent (only there) is stored as it is with its tile scales (ctx_latent_scales, F32 [sum C, Dl / 128]).
Status cache_load_context(Backend& backend, PagedKvCache& cache, const std::vector<Request>& requests,
                          const BlockTable& table, const Tensor& ctx_latent, const Tensor& ctx_rope,
                          const Tensor& ctx_index_keys, const Tensor* ctx_index_key_scales = nullptr,
                          const Tensor* ctx_latent_scales = nullptr);

// The context latent's checks shared by every context load: ctx_latent [rows, Dl] F32/BF16, or F8_E4M3 with
// ctx_latent_scales [rows, Dl / 128] F32, only into an fp8_ds_mla cache.
Status check_context_latent(const PagedCacheConfig& cc, int64_t rows, const Tensor& ctx_latent,
                            const Tensor* ctx_latent_scales);

}  // namespace dsacp
