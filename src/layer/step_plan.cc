// The single-device step as plan + run: step_plan does the batch's host work once (checks, slots, key lengths,
// the backend's indexer schedule, the workspace layout) and uploads its tables; step_run only enqueues kernels.
#include "dsacp/step_plan.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "dsacp/fp8.h"
#include "layer/step_checks.h"
#include "layer/step_timing_internal.h"

namespace dsacp {

struct StepPlan::Impl {
  Backend* backend = nullptr;
  StepConfig config;
  PagedCacheConfig cache;
  SingleDevicePlan host;
  uint64_t fingerprint = 0;
  int64_t pages_needed = 0;
  // Device tables: [slots (i64) | token request (i32) | key length (i32)], and the block table.
  DeviceBuffer rows;
  size_t at_slots = 0, at_request = 0, at_key_len = 0;
  DeviceBuffer table;
  BlockTableView block_table;
  // The backend's schedules and the workspace: [canonical top-k | indexer scores | sparse MLA partials].
  std::shared_ptr<const KernelPlan> indexer;
  size_t at_topk = 0, at_indexer = 0, at_mla = 0, workspace_bytes = 0;
  bool needs_topk_buffer = false;
  DeviceBuffer own_workspace;
};

StepPlan::StepPlan() : impl_(std::make_unique<Impl>()) {}
StepPlan::~StepPlan() = default;
StepPlan::StepPlan(StepPlan&&) noexcept = default;
StepPlan& StepPlan::operator=(StepPlan&&) noexcept = default;
const StepConfig& StepPlan::config() const { return impl_->config; }
const SingleDevicePlan& StepPlan::host() const { return impl_->host; }
int64_t StepPlan::num_tokens() const { return impl_->host.layout.num_tokens; }
uint64_t StepPlan::fingerprint() const { return impl_->fingerprint; }
int64_t StepPlan::pages_needed() const { return impl_->pages_needed; }
size_t StepPlan::workspace_bytes() const { return impl_->workspace_bytes; }

namespace {

// FNV-1a over the bytes of each value, in order.
struct Fnv {
  uint64_t h = 1469598103934665603ull;
  void bytes(const void* p, size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
  template <typename T>
  void add(const T& v) {
    bytes(&v, sizeof(T));
  }
};

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// The query rows of the plan's batch in device memory (what every kernel of the run reads).
QueryRowsView device_rows(const StepPlan::Impl& p) {
  QueryRowsView rows;
  rows.num_tokens = p.host.layout.num_tokens;
  rows.request = UploadBatch::at<int32_t>(p.rows, p.at_request);
  rows.key_len = UploadBatch::at<int32_t>(p.rows, p.at_key_len);
  return rows;
}

// The sparse MLA call of the plan's shape (pointers of a layer filled in by the run).
SparseMlaParams mla_shape(const StepPlan::Impl& p) {
  SparseMlaParams ap;
  ap.rows = device_rows(p);
  ap.H = p.config.H;
  ap.Dl = p.config.Dl;
  ap.Dr = p.config.Dr;
  ap.K = p.config.K;
  ap.scale = p.config.scale;
  ap.q_dtype = p.config.act_dtype;
  ap.out_dtype = p.config.out_dtype;
  ap.block_table = p.block_table;
  // The pools' layout as PagedKvCache gives it (no data: the shape decides the kernel and its workspace).
  const PagedCacheConfig& cc = p.cache;
  const bool fp8 = cc.fp8_latent();
  const int32_t record = fp8 ? fp8_ds_mla_record_bytes(cc.Dl, cc.Dr) : 0;
  ap.latent = {nullptr, fp8 ? DType::kF8E4M3 : cc.dtype, cc.num_pages, cc.page_size, cc.Dl, record};
  ap.rope = {nullptr, fp8 ? DType::kBF16 : cc.dtype, cc.num_pages, cc.page_size, cc.Dr, record};
  return ap;
}

}  // namespace

uint64_t step_fingerprint(const StepConfig& c, const std::vector<Request>& requests, const BlockTable& table,
                          const PagedCacheConfig& cc) {
  Fnv f;
  for (int32_t v : {c.H, c.Dl, c.Dr, c.Hi, c.Di, c.K, c.decode_threshold}) f.add(v);
  f.add(c.scale);
  for (DType d : {c.act_dtype, c.out_dtype, c.index_input_dtype()}) f.add(static_cast<int32_t>(d));
  f.add(static_cast<int32_t>(c.topk_form));
  f.add(static_cast<int32_t>(c.lse_base));
  f.add(requests.size());
  for (const Request& r : requests) {
    f.add(r.query_len);
    f.add(r.context_len);
  }
  f.add(table.num_requests);
  f.add(table.max_pages);
  // The table's entries in four independent lanes of 64-bit words (vectorizes; 130K entries at 128K contexts).
  uint64_t lane[4] = {1, 2, 3, 4};
  const size_t n = table.data.size(), words = n / 2;
  for (size_t i = 0; i + 8 <= 2 * words; i += 8) {
    for (int k = 0; k < 4; ++k) {
      uint64_t w;
      std::memcpy(&w, table.data.data() + i + 2 * k, 8);
      lane[k] = (lane[k] ^ w) * 0x9e3779b97f4a7c15ull;
      lane[k] ^= lane[k] >> 29;
    }
  }
  for (uint64_t l : lane) f.add(l);
  for (size_t i = words / 4 * 8; i < n; ++i) f.add(table.data[i]);
  for (int32_t v : {cc.page_size, cc.Dl, cc.Dr, cc.Di, cc.index_page_factor}) f.add(v);
  for (DType d : {cc.dtype, cc.index_key_dtype()}) f.add(static_cast<int32_t>(d));
  f.add(static_cast<int32_t>(cc.latent_format));
  const uint64_t h = f.h;
  return h == 0 ? 1 : h;  // 0 means "not checked" in StepInputs
}

Result<StepPlan> step_plan(Backend& backend, const StepConfig& config, const std::vector<Request>& requests,
                           const BlockTable& table, const PagedCacheConfig& cc, const StepPlanOptions& options) {
  StepPlan plan;
  StepPlan::Impl& p = *plan.impl_;
  p.backend = &backend;
  p.config = config;
  p.cache = cc;
  DSACP_RETURN_IF_ERROR(check_step_config(config, cc));
  DSACP_ASSIGN_OR_RETURN(p.host, single_device_plan(requests, table, cc.page_size, config.decode_threshold));
  std::vector<int64_t> pages, first_new;
  for (const Request& r : requests) {
    pages.push_back((r.seq_len() + cc.page_size - 1) / cc.page_size);
    first_new.push_back(r.context_len / cc.page_size);
  }
  const bool device_table = options.device_block_table != nullptr;
  // With the table on the device already, the host checks the pages the run writes (the new tokens'); the
  // kernels check every page they read.
  DSACP_RETURN_IF_ERROR(check_block_table_pages(table, pages, cc, device_table ? first_new : std::vector<int64_t>{}));
  for (size_t b = 0; b < requests.size(); ++b) {
    const int32_t* row = table.data.data() + b * static_cast<size_t>(table.max_pages);
    int32_t top = -1;  // (entries are in [0, num_pages) by now)
    for (int64_t c = device_table ? first_new[b] : 0; c < pages[b]; ++c) top = std::max(top, row[c]);
    p.pages_needed = std::max<int64_t>(p.pages_needed, int64_t{top} + 1);
  }
  if (options.fingerprint) p.fingerprint = step_fingerprint(config, requests, table, cc);

  UploadBatch batch;
  p.at_slots = batch.add(p.host.slots);
  p.at_request = batch.add(p.host.token_request);
  p.at_key_len = batch.add(p.host.token_key_len);
  DSACP_ASSIGN_OR_RETURN(p.rows, batch.upload(backend));
  const int32_t* d_table = options.device_block_table;
  if (!device_table) {
    DSACP_ASSIGN_OR_RETURN(p.table, upload_vector(backend, table.data));
    d_table = p.table.as<const int32_t>();
  }
  p.block_table = {d_table, table.num_requests, table.max_pages};

  // The backend's schedules, for the rows every layer's kernels read.
  const int64_t T = p.host.layout.num_tokens;
  size_t indexer_bytes = 0, mla_bytes = 0;
  if (T > 0) {
    IndexerTopkParams ip;
    ip.rows = device_rows(p);
    ip.Hi = config.Hi;
    ip.Di = config.Di;
    ip.K = config.K;
    ip.q_dtype = config.index_input_dtype();
    ip.keys.num_pages = cc.num_pages * cc.index_page_factor;
    ip.keys.page_size = cc.page_size;
    ip.keys.dim = cc.Di;
    ip.keys.dtype = cc.index_key_dtype();
    ip.block_table = p.block_table;
    ip.host_request = p.host.token_request.data();
    ip.host_key_len = p.host.token_key_len.data();
    DSACP_ASSIGN_OR_RETURN(p.indexer, backend.plan_indexer_topk(ip));
    if (p.indexer != nullptr) indexer_bytes = p.indexer->workspace_bytes;
    mla_bytes = backend.sparse_mla_workspace_bytes(mla_shape(p));
  }
  p.needs_topk_buffer = config.topk_form != TopkForm::kCanonical;
  size_t at = 0;
  p.at_topk = at;
  if (p.needs_topk_buffer) at += align256(static_cast<size_t>(T) * config.K * sizeof(int32_t));
  p.at_indexer = at;
  at += align256(indexer_bytes);
  p.at_mla = at;
  at += align256(mla_bytes);
  p.workspace_bytes = at;
  if (options.own_workspace && p.workspace_bytes > 0) {
    DSACP_ASSIGN_OR_RETURN(p.own_workspace, backend.allocate(p.workspace_bytes));
  }
  return plan;
}

Status step_run(Backend& backend, const StepPlan& plan, PagedKvCache& cache, const StepInputs& in,
                const StepOutputs& out, const StepWorkspace& workspace) {
  const StepPlan::Impl& p = plan.impl();
  const StepConfig& config = p.config;
  const PagedCacheConfig& cc = cache.config();
  if (p.backend != &backend) {
    return invalid_argument("step run: the plan was made for backend " +
                            (p.backend != nullptr ? p.backend->name() : std::string("(none)")) + ", not this " +
                            backend.name() + " (a plan's tables live in its backend's memory)");
  }
  if (in.plan_fingerprint != 0 && p.fingerprint != 0 && in.plan_fingerprint != p.fingerprint) {
    return invalid_argument("step run: the plan is of another batch (plan fingerprint " + std::to_string(p.fingerprint) +
                            ", the inputs' " + std::to_string(in.plan_fingerprint) + ")");
  }
  if (!same_cache_layout(cc, p.cache)) {
    return invalid_argument("step run: the cache (" + cache_layout_name(cc) + ") is not of the plan's layout (" +
                            cache_layout_name(p.cache) + ")");
  }
  if (cc.num_pages < p.pages_needed) {
    return out_of_range("step run: the cache holds " + std::to_string(cc.num_pages) + " pages, the plan's block table uses page " +
                        std::to_string(p.pages_needed - 1));
  }
  char* ws = static_cast<char*>(p.own_workspace.get());
  if (workspace.data != nullptr) {
    if (workspace.bytes < p.workspace_bytes) {
      return invalid_argument("step run: the workspace has " + std::to_string(workspace.bytes) + " bytes, the plan needs " +
                              std::to_string(p.workspace_bytes));
    }
    ws = static_cast<char*>(workspace.data);
  } else if (ws == nullptr && p.workspace_bytes > 0) {
    return invalid_argument("step run: no workspace given and the plan owns none (it needs " +
                            std::to_string(p.workspace_bytes) + " bytes)");
  }
  DSACP_RETURN_IF_ERROR(check_indexer_inputs(config, in));
  const int64_t T = p.host.layout.num_tokens;
  if (T == 0) return Status();
  PhaseClock clock(backend);
  // Kernels only enqueue; errors come back from the caller's next synchronize().
  PendingErrors defer(backend);
  const QueryRowsView rows = device_rows(p);
  const BlockTableView bt = p.block_table;

  // 1. The new tokens' KV goes into the caches first: every token sees its own key. One call writes the indexer
  //    keys, latent and rope rows (one launch on a GPU).
  CacheWriteParams w;
  w.rows_dtype = config.index_input_dtype();
  w.row_scales = in.idx_k_scale;
  w.fp8_scale_mode = cc.index_scale_mode;
  w.record_scale_mode = cc.latent_scale_mode;  // an fp8_ds_mla latent: quantized per 128-value tile
  w.num_rows = T;
  w.slots = UploadBatch::at<int64_t>(p.rows, p.at_slots);
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

  // 2. Indexer scores and the exact top-k (or the caller's rows, checked), canonical.
  int32_t* topk = p.needs_topk_buffer ? reinterpret_cast<int32_t*>(ws + p.at_topk) : out.topk;
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
    ip.host_request = p.host.token_request.data();
    ip.host_key_len = p.host.token_key_len.data();
    ip.plan = p.indexer.get();
    ip.workspace = p.indexer != nullptr ? ws + p.at_indexer : nullptr;
    DSACP_RETURN_IF_ERROR(indexer_topk_run(backend, ip).with_context("indexer top-k"));
  }
  clock.indexer_launched();
  DSACP_RETURN_IF_ERROR(clock.mark(&StepPhaseTimes::topk_ms));

  // 3. Sparse MLA attention over the chosen keys.
  SparseMlaParams ap = mla_shape(p);
  ap.q_nope = in.q_nope;
  ap.q_rope = in.q_rope;
  ap.latent = cache.latent();
  ap.rope = cache.rope();
  ap.topk = topk;
  ap.out = out.out;
  ap.lse = out.lse;
  ap.workspace = ws != nullptr ? ws + p.at_mla : nullptr;
  if (ap.workspace != nullptr && backend.sparse_mla_workspace_bytes(ap) > p.workspace_bytes - p.at_mla) {
    return internal_error("step run: sparse MLA needs more workspace for this cache than the plan reserved (" +
                          std::to_string(backend.sparse_mla_workspace_bytes(ap)) + " bytes)");
  }
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
  DSACP_RETURN_IF_ERROR(clock.mark(&StepPhaseTimes::attention_ms));
  clock.finish();
  return Status();
}

}  // namespace dsacp
