// The planned steps' shared Python arguments (plan.cc: one device; cp.cc: a CP rank): the plan's configuration
// from its keyword arguments, a layer's input tensors and its caches (the caller's tensors wrapped as a
// PagedKvCache: nothing copied). Internal to the Python module.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dsacp/batch.h"
#include "dsacp/paged_cache.h"
#include "dsacp/step.h"
#include "tensor_args.h"

namespace dsacp::py {

namespace nb = nanobind;

[[noreturn]] void plan_value_error(const std::string& msg);

// "cpu", "cuda" (device 0) or "cuda:N".
void device_arg(const char* op, const std::string& s, int32_t* type, int32_t* id);

// A plan's batch from its arguments: the requests (query_lens[i], context_lens[i]) and the host block table (int32
// [num_requests >= requests, max_pages]); ValueError prefixed with `op` on a mismatch.
struct PlanBatch {
  std::vector<Request> requests;
  BlockTable table;
};
PlanBatch plan_batch(const char* op, const std::vector<int32_t>& query_lens, const std::vector<int32_t>& context_lens,
                     nb::handle block_table);

// The keyword arguments dsacp.plan and dsacp.cp_plan share (their docstrings say what each means).
struct PlanArgs {
  int64_t num_pages = 0;
  int32_t heads = 0;
  float scale = 0;
  int32_t topk = 0, page_size = 64, latent_dim = 512, rope_dim = 64, index_heads = 64, index_dim = 128;
  std::string dtype = "bf16", out_dtype = "f32";
  std::optional<std::string> cache_dtype, index_dtype;
  std::string latent_cache = "rows", index_scale_mode = "fp32", latent_scale_mode = "fp32";
  std::string topk_form = "canonical", lse_base = "e";
  int32_t decode_threshold = 16;
};
// The step's and the caches' configurations, checked (ValueError naming the field, prefixed with `op`).
void plan_configs(const char* op, const PlanArgs& a, StepConfig* c, PagedCacheConfig* cc);

// A layer's inputs (rows: the plan's rows, heads: its query heads) and the precomputed top-k, as StepInputs.
struct LayerTensors {
  nb::handle q_nope, q_rope, kv_latent, k_rope;
  std::optional<nb::handle> idx_q, idx_w, idx_k, idx_q_scale, idx_k_scale, precomputed_topk;
};
// Checks each tensor's dtype and shape; the first, q_nope, must be on (device_type, device_id) (`where` names the
// plan's device in the message; rows_name the rows: "the plan's batch").
StepInputs layer_inputs(Placement& pl, const StepConfig& c, int64_t rows, int32_t heads, const LayerTensors& t,
                        int32_t device_type, int32_t device_id, const std::string& where, const char* rows_name);

// One layer's caches in the plan's layout `cc` (index_page_factor included), the caller's tensors as they are:
// latent and rope pools; or latent vLLM's combined bf16 KV [num_pages, page_size, kv_row >= Dl + Dr] with rope
// None; or fp8_ds_mla records with rope None; and the indexer keys. Each must hold at least pages_needed pages
// (the indexer keys index_page_factor times that); the smallest is the layer's num_pages.
std::unique_ptr<PagedKvCache> layer_caches(Placement& pl, const PagedCacheConfig& cc, int64_t pages_needed,
                                           nb::handle latent, std::optional<nb::handle> rope, nb::handle index_keys);

}  // namespace dsacp::py
