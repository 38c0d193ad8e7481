// The single-device step's checks and helpers, and step_run as one plan and one planned run (step_plan.cc).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "dsacp/step_plan.h"
#include "layer/step_checks.h"

namespace dsacp {

StepConfig step_config_of(const CaseDims& dims, int32_t K, float scale, DType act_dtype, DType out_dtype) {
  StepConfig c;
  c.H = dims.H;
  c.Dl = dims.Dl;
  c.Dr = dims.Dr;
  c.Hi = dims.Hi;
  c.Di = dims.Di;
  c.K = K;
  c.scale = scale;
  c.act_dtype = act_dtype;
  c.out_dtype = out_dtype;
  return c;
}

StepConfig step_config_of(const CaseFile& c, DType act_dtype, DType out_dtype) {
  StepConfig config = step_config_of(c.dims, c.topk, c.scale, act_dtype, out_dtype);
  if (c.idx_q.dtype() == DType::kF8E4M3) config.index_dtype = DType::kF8E4M3;
  return config;
}

std::string cache_layout_name(const PagedCacheConfig& c) {
  return "page_size=" + std::to_string(c.page_size) + " Dl=" + std::to_string(c.Dl) + " Dr=" + std::to_string(c.Dr) +
         " Di=" + std::to_string(c.Di) + " dtype=" + dtype_name(c.dtype) + " index=" + dtype_name(c.index_key_dtype()) +
         " latent=" + latent_format_name(c.latent_format);
}

bool same_cache_layout(const PagedCacheConfig& a, const PagedCacheConfig& b) {
  return a.page_size == b.page_size && a.Dl == b.Dl && a.Dr == b.Dr && a.Di == b.Di && a.dtype == b.dtype &&
         a.index_key_dtype() == b.index_key_dtype() && a.index_page_factor == b.index_page_factor &&
         a.index_scale_mode == b.index_scale_mode && a.latent_format == b.latent_format &&
         a.latent_scale_mode == b.latent_scale_mode;
}

Status check_step_config(const StepConfig& c, const PagedCacheConfig& cache) {
  auto bad = [](const char* what, int64_t v) {
    return invalid_argument(std::string("step config: ") + what + " must be >= 1, got " + std::to_string(v));
  };
  if (c.H < 1) return bad("H", c.H);
  if (c.Dl < 1) return bad("Dl", c.Dl);
  if (c.Dr < 1) return bad("Dr", c.Dr);
  if (c.Hi < 1) return bad("Hi", c.Hi);
  if (c.Di < 1) return bad("Di", c.Di);
  if (c.K < 1) return bad("K (topk)", c.K);
  if (c.Dl != cache.Dl || c.Dr != cache.Dr || c.Di != cache.Di) {
    return invalid_argument("step config dims Dl=" + std::to_string(c.Dl) + " Dr=" + std::to_string(c.Dr) +
                            " Di=" + std::to_string(c.Di) + " do not match the cache's Dl=" + std::to_string(cache.Dl) +
                            " Dr=" + std::to_string(cache.Dr) + " Di=" + std::to_string(cache.Di));
  }
  if (c.act_dtype == DType::kI32 || c.out_dtype == DType::kI32) {
    return invalid_argument("step config: activation and output dtypes must be F32 or BF16");
  }
  // FP8 indexer inputs (e4m3 q and keys) go with an FP8 indexer-key pool, and the reverse.
  if ((c.index_input_dtype() == DType::kF8E4M3) != (cache.index_key_dtype() == DType::kF8E4M3)) {
    return invalid_argument(std::string("step config: indexer inputs of ") + dtype_name(c.index_input_dtype()) +
                            " with an indexer-key cache of " + dtype_name(cache.index_key_dtype()) +
                            " (F8_E4M3 inputs need an F8_E4M3 cache and the reverse)");
  }
  return Status();
}

Status check_block_table_pages(const BlockTable& table, const std::vector<int64_t>& pages_per_request,
                               const PagedCacheConfig& cache, const std::vector<int64_t>& first_page) {
  if (table.num_requests < static_cast<int64_t>(pages_per_request.size()) ||
      table.data.size() < static_cast<size_t>(table.num_requests) * std::max(table.max_pages, 0)) {
    return invalid_argument("block table: " + std::to_string(table.num_requests) + " rows of " +
                            std::to_string(table.max_pages) + " pages need " +
                            std::to_string(int64_t{table.num_requests} * table.max_pages) + " entries, it holds " +
                            std::to_string(table.data.size()) + " (and the batch has " +
                            std::to_string(pages_per_request.size()) + " requests)");
  }
  for (size_t b = 0; b < pages_per_request.size(); ++b) {
    const int64_t pages = pages_per_request[b];
    const int64_t first = first_page.empty() ? 0 : std::max<int64_t>(0, first_page[b]);
    if (pages > table.max_pages) {
      return out_of_range("request " + std::to_string(b) + " needs " + std::to_string(pages) +
                          " pages, the block table has " + std::to_string(table.max_pages) + " columns");
    }
    const int32_t* row = table.data.data() + b * static_cast<size_t>(table.max_pages);
    // One unsigned compare per entry (a negative id wraps above the limit), no branch: the loop vectorizes.
    // This runs over every page of every request each step (65K-130K entries at 128K contexts).
    const uint32_t limit = static_cast<uint32_t>(std::min<int64_t>(cache.num_pages, INT32_MAX));
    uint32_t out_of_range_seen = 0;
    for (int64_t c = first; c < pages; ++c) out_of_range_seen |= static_cast<uint32_t>(static_cast<uint32_t>(row[c]) >= limit);
    if (out_of_range_seen == 0) continue;
    for (int64_t c = first; c < pages; ++c) {
      const int32_t p = row[c];
      if (p < 0 || p >= cache.num_pages) {
        return out_of_range("block table row " + std::to_string(b) + " column " + std::to_string(c) + " holds page " +
                            std::to_string(p) + ", outside [0, " + std::to_string(cache.num_pages) + ")");
      }
    }
  }
  return Status();
}

Status check_indexer_inputs(const StepConfig& c, const StepInputs& in) {
  if (in.topk != nullptr) return Status();
  const std::pair<const char*, const void*> needed[] = {{"idx_q", in.idx_q}, {"idx_w", in.idx_w}, {"idx_k", in.idx_k}};
  for (const auto& [name, ptr] : needed) {
    if (ptr == nullptr) {
      return invalid_argument(std::string("step inputs: ") + name +
                              " is null (only a step with a precomputed top-k, StepInputs::topk, runs without the indexer)");
    }
  }
  return Status();
}

Result<int32_t*> step_topk_buffer(Backend& backend, const StepConfig& c, int64_t rows, int32_t* out_topk,
                                  DeviceBuffer* storage) {
  if (c.topk_form == TopkForm::kCanonical) return out_topk;
  DSACP_ASSIGN_OR_RETURN(*storage, backend.allocate(std::max<size_t>(static_cast<size_t>(rows * c.K) * sizeof(int32_t), 1)));
  return storage->as<int32_t>();
}

Status output_forms(Backend& backend, const StepConfig& c, const OutputForms& f) {
  if (c.topk_form == TopkForm::kCanonical && c.lse_base == LseBase::kNatural) return Status();
  OutputFormParams p;
  p.num_rows = f.rows;
  p.K = c.K;
  if (c.topk_form == TopkForm::kSlot) {
    p.topk = f.topk;
    p.request = f.request;
    p.block_table = f.block_table;
    p.page_size = f.page_size;
    p.num_pages = f.num_pages;
    p.Pt = f.Pt;
    p.I = f.I;
    p.slots = f.out_topk;
  }
  if (c.lse_base == LseBase::kTwo) {
    p.lse = f.lse;
    p.lse_count = f.lse_count;
  }
  return output_form_run(backend, p).with_context("step outputs (serving forms)");
}

Status step_run(Backend& backend, const StepConfig& config, const std::vector<Request>& requests,
                const BlockTable& table, PagedKvCache& cache, const StepInputs& in, const StepOutputs& out) {
  // One path: a plan of this batch (the caller's device table, if any, read in place), one planned run, and the
  // synchronize() that returns what the kernels found.
  StepPlanOptions options;
  options.device_block_table = in.block_table;
  options.fingerprint = false;  // one plan, one run: nothing to pair
  // The plan's allocations and uploads only enqueue too (the synchronize() below covers them).
  DeferredErrors defer(backend);
  DSACP_ASSIGN_OR_RETURN(StepPlan plan, step_plan(backend, config, requests, table, cache.config(), options));
  DSACP_RETURN_IF_ERROR(step_run(backend, plan, cache, in, out));
  return backend.synchronize().with_context("step");
}

}  // namespace dsacp
