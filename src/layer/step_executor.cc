// The single-device step executor: cache write -> indexer + top-k -> sparse MLA attention.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "layer/step_checks.h"
#include "layer/step_timing_internal.h"

namespace dsacp {
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
  PhaseClock clock(backend);
  const PagedCacheConfig& cc = cache.config();
  DSACP_RETURN_IF_ERROR(check_step_config(config, cc));
  DSACP_ASSIGN_OR_RETURN(SingleDevicePlan plan,
                         single_device_plan(requests, table, cc.page_size, config.decode_threshold));
  std::vector<int64_t> pages, first_new;
  for (const Request& r : requests) {
    pages.push_back((r.seq_len() + cc.page_size - 1) / cc.page_size);
    first_new.push_back(r.context_len / cc.page_size);
  }
  // With the table on the device already, the host checks the pages it writes (the new tokens'); the kernels
  // check every page they read.
  DSACP_RETURN_IF_ERROR(check_block_table_pages(table, pages, cc, in.block_table != nullptr ? first_new
                                                                                           : std::vector<int64_t>{}));
  DSACP_RETURN_IF_ERROR(check_indexer_inputs(config, in));
  const int64_t T = plan.layout.num_tokens;
  // Kernels and uploads only enqueue; errors come back from the synchronize() at the end.
  DeferredErrors defer(backend);

  // The block table: the caller's device copy, or uploaded on its own straight from its vector; the small
  // vectors in one batch.
  DeviceBuffer uploaded_table;
  DSACP_ASSIGN_OR_RETURN(const int32_t* d_table, step_device_table(backend, table, in, &uploaded_table));
  UploadBatch batch;
  const size_t at_slots = batch.add(plan.slots), at_request = batch.add(plan.token_request),
               at_key_len = batch.add(plan.token_key_len);
  // (uploaded by the cache write below where it is small: one CUDA call less before the indexer launch)
  CacheWriteParams w;
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_rows, batch.upload_with(backend, w));

  // 1. The new tokens' KV goes into the caches first: every token sees its own key. One call writes the indexer
  //    keys, latent and rope rows (one launch on a GPU, before the indexer's: nothing of it waits on the path
  //    after the indexer).
  w.rows_dtype = config.index_input_dtype();
  w.row_scales = in.idx_k_scale;
  w.fp8_scale_mode = cache.config().index_scale_mode;
  w.record_scale_mode = cache.config().latent_scale_mode;  // an fp8_ds_mla latent: quantized per 128-value tile
  w.num_rows = T;
  w.slots = UploadBatch::at<int64_t>(d_rows, at_slots);
  w.rows = in.idx_k;
  w.pool = cache.index_keys();
  w.more[0] = {in.kv_latent, w.slots, cache.latent(), config.act_dtype};
  w.more[1] = {in.k_rope, w.slots, cache.rope(), config.act_dtype};
  if (in.idx_k == nullptr) {
    // A precomputed top-k without indexer keys: latent and rope only.
    w.rows_dtype = config.act_dtype;
    w.row_scales = nullptr;
    w.rows = in.kv_latent;
    w.pool = cache.latent();
    w.more[0] = {in.k_rope, w.slots, cache.rope(), config.act_dtype};
    w.more[1] = {};
  }
  DSACP_RETURN_IF_ERROR(cache_write_run(backend, w).with_context("cache write"));
  DSACP_RETURN_IF_ERROR(clock.mark(&StepPhaseTimes::kv_ms));

  QueryRowsView rows;
  rows.num_tokens = T;
  rows.request = UploadBatch::at<int32_t>(d_rows, at_request);
  rows.key_len = UploadBatch::at<int32_t>(d_rows, at_key_len);
  BlockTableView bt{d_table, table.num_requests, table.max_pages};

  // 2. Indexer scores and the exact top-k (or the caller's rows, checked), canonical.
  DeviceBuffer canonical;
  DSACP_ASSIGN_OR_RETURN(int32_t* topk, step_topk_buffer(backend, config, T, out.topk, &canonical));
  if (in.topk != nullptr) {
    TopkInputParams tp;
    tp.num_rows = T;
    tp.K = config.K;
    tp.key_len = rows.key_len;
    tp.topk = in.topk;
    tp.out = topk;
    DSACP_RETURN_IF_ERROR(topk_input_run(backend, tp));
  } else {
    IndexerTopkParams ip;
    ip.rows = rows;
    ip.Hi = config.Hi;
    ip.Di = config.Di;
    ip.K = config.K;
    ip.q = in.idx_q;
    ip.q_dtype = config.index_input_dtype();
    ip.q_scale = in.idx_q_scale;
    ip.w = in.idx_w;
    ip.keys = cache.index_keys();
    ip.block_table = bt;
    ip.topk = topk;
    ip.host_request = plan.token_request.data();
    ip.host_key_len = plan.token_key_len.data();
    DSACP_RETURN_IF_ERROR(indexer_topk_run(backend, ip).with_context("indexer top-k"));
  }
  clock.indexer_launched();
  DSACP_RETURN_IF_ERROR(clock.mark(&StepPhaseTimes::topk_ms));

  // 3. Sparse MLA attention over the chosen keys.
  SparseMlaParams ap;
  ap.rows = rows;
  ap.H = config.H;
  ap.Dl = config.Dl;
  ap.Dr = config.Dr;
  ap.K = config.K;
  ap.scale = config.scale;
  ap.q_nope = in.q_nope;
  ap.q_rope = in.q_rope;
  ap.q_dtype = config.act_dtype;
  ap.latent = cache.latent();
  ap.rope = cache.rope();
  ap.block_table = bt;
  ap.topk = topk;
  ap.out = out.out;
  ap.out_dtype = config.out_dtype;
  ap.lse = out.lse;
  DSACP_RETURN_IF_ERROR(sparse_mla_run(backend, ap).with_context("sparse MLA"));
  // 4. The outputs in the caller's forms (slots, base-2 LSE).
  OutputForms forms;
  forms.rows = T;
  forms.topk = topk;
  forms.request = rows.request;
  forms.block_table = bt;
  forms.page_size = cc.page_size;
  forms.num_pages = cc.num_pages;
  forms.out_topk = out.topk;
  forms.lse = out.lse;
  forms.lse_count = T * config.H;
  DSACP_RETURN_IF_ERROR(output_forms(backend, config, forms));
  DSACP_RETURN_IF_ERROR(backend.synchronize().with_context("step"));
  DSACP_RETURN_IF_ERROR(clock.mark(&StepPhaseTimes::attention_ms));
  clock.finish();
  return Status();
}

}  // namespace dsacp
