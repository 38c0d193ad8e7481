// The planned steps' shared Python arguments (step_args.h).
#include "step_args.h"

#include <algorithm>
#include <stdexcept>

#include "dsacp/fp8.h"
#include "dsacp/step_plan.h"

namespace dsacp::py {
namespace {

DType act_dtype_arg(const char* op, const char* what, const std::string& s) {
  if (s == "bf16" || s == "bfloat16") return DType::kBF16;
  if (s == "f32" || s == "float32") return DType::kF32;
  plan_value_error(std::string(op) + ": " + what + "=\"" + s + "\", expected \"bf16\" or \"f32\"");
}

Fp8ScaleMode scale_mode_of(const char* op, const char* what, const std::string& s) {
  if (s == "fp32") return Fp8ScaleMode::kFp32;
  if (s == "ue8m0") return Fp8ScaleMode::kUe8m0;
  plan_value_error(std::string(op) + ": " + what + "=\"" + s + "\", expected \"fp32\" or \"ue8m0\"");
}

const char* py_dtype_name(DType d) { return d == DType::kBF16 ? "bfloat16" : "float32"; }

// A layer's pool tensor against the layout; returns its pages (divided by `factor`: the replicated indexer's).
int64_t check_pool(Placement& pl, const PagedCacheConfig& cc, int64_t pages_needed, const char* name, nb::handle obj,
                   int64_t dim, DType want, bool records, int32_t factor, PagedPoolView* view) {
  int32_t record_dr = 0;
  *view = paged_pool_arg(pl, name, obj, dim, /*writable=*/true, cc.page_size, records, &record_dr);
  const char* kind = want == DType::kF8E4M3 ? (records ? "fp8_ds_mla records (uint8)" : "FP8 pages (uint8)")
                                            : py_dtype_name(want);
  if (view->dtype != want || (records != view->records()) || view->page_size != cc.page_size ||
      (records && record_dr != cc.Dr)) {
    const std::string got = view->records() ? "fp8_ds_mla records of " + std::to_string(view->record_bytes) + " bytes"
                            : view->dtype == DType::kF8E4M3 ? "FP8 pages"
                                                             : std::string(py_dtype_name(view->dtype));
    plan_value_error(std::string(pl.op) + ": cache '" + name + "' holds " + got + " in pages of " +
                     std::to_string(view->page_size) + ", the plan's layout wants " + kind + " in pages of " +
                     std::to_string(cc.page_size) +
                     (records ? " (" + std::to_string(fp8_ds_mla_record_bytes(cc.Dl, cc.Dr)) + " bytes a token)" : ""));
  }
  if (view->num_pages < pages_needed * factor) {
    plan_value_error(std::string(pl.op) + ": cache '" + name + "' holds " + std::to_string(view->num_pages) +
                     " pages, the plan's block table uses page " + std::to_string(pages_needed * factor - 1) +
                     (factor > 1 ? " (the replicated indexer's " + std::to_string(factor) + " pages a page)" : ""));
  }
  return view->num_pages / factor;
}

}  // namespace

[[noreturn]] void plan_value_error(const std::string& msg) { throw nb::value_error(msg.c_str()); }

void device_arg(const char* op, const std::string& s, int32_t* type, int32_t* id) {
  const std::string bad = std::string(op) + ": device=\"" + s + "\", expected \"cpu\", \"cuda\" or \"cuda:N\"";
  if (s == "cpu") {
    *type = nb::device::cpu::value;
    *id = 0;
    return;
  }
  if (s != "cuda" && s.rfind("cuda:", 0) != 0) plan_value_error(bad);
  *type = nb::device::cuda::value;
  *id = 0;
  if (s.size() > 5) {
    try {
      size_t used = 0;
      *id = std::stoi(s.substr(5), &used);
      if (used + 5 != s.size() || *id < 0) throw std::invalid_argument(s);
    } catch (const std::exception&) {
      plan_value_error(bad);
    }
  }
}

void plan_configs(const char* op, const PlanArgs& a, StepConfig* out_c, PagedCacheConfig* out_cc) {
  StepConfig c = step_config_of(CaseDims{a.heads, a.latent_dim, a.rope_dim, a.index_heads, a.index_dim}, a.topk,
                                a.scale, act_dtype_arg(op, "dtype", a.dtype), act_dtype_arg(op, "out_dtype", a.out_dtype));
  if (a.decode_threshold < 1 || a.decode_threshold > kMaxDecodeThreshold) {
    plan_value_error(std::string(op) + ": decode_threshold=" + std::to_string(a.decode_threshold) + ", expected 1 .. " +
                     std::to_string(kMaxDecodeThreshold));
  }
  c.decode_threshold = a.decode_threshold;
  if (a.topk_form == "canonical") {
    c.topk_form = TopkForm::kCanonical;
  } else if (a.topk_form == "slots") {
    c.topk_form = TopkForm::kSlot;
  } else {
    plan_value_error(std::string(op) + ": topk_form=\"" + a.topk_form + "\", expected \"canonical\" or \"slots\"");
  }
  if (a.lse_base == "e") {
    c.lse_base = LseBase::kNatural;
  } else if (a.lse_base == "2") {
    c.lse_base = LseBase::kTwo;
  } else {
    plan_value_error(std::string(op) + ": lse_base=\"" + a.lse_base + "\", expected \"e\" or \"2\"");
  }
  PagedCacheConfig cc;
  if (a.num_pages < 1) {
    plan_value_error(std::string(op) + ": num_pages=" + std::to_string(a.num_pages) + ", expected >= 1 (the caches' pages)");
  }
  cc.num_pages = a.num_pages;
  cc.page_size = a.page_size;
  cc.Dl = a.latent_dim;
  cc.Dr = a.rope_dim;
  cc.Di = a.index_dim;
  cc.dtype = a.cache_dtype ? act_dtype_arg(op, "cache_dtype", *a.cache_dtype) : c.act_dtype;
  if (a.index_dtype) {
    if (*a.index_dtype != "fp8") {
      plan_value_error(std::string(op) + ": index_dtype=\"" + *a.index_dtype + "\", expected None or \"fp8\"");
    }
    // e4m3 idx_q / idx_k with their scales, into the FP8 indexer pages (132 bytes a key for Di = 128).
    c.index_dtype = DType::kF8E4M3;
    cc.index_dtype = DType::kF8E4M3;
  }
  cc.index_scale_mode = scale_mode_of(op, "index_scale_mode", a.index_scale_mode);
  if (a.latent_cache == "rows") {
    cc.latent_format = LatentFormat::kRows;
  } else if (a.latent_cache == "fp8_ds_mla") {
    cc.latent_format = LatentFormat::kFp8DsMla;
  } else {
    plan_value_error(std::string(op) + ": latent_cache=\"" + a.latent_cache + "\", expected \"rows\" or \"fp8_ds_mla\"");
  }
  cc.latent_scale_mode = scale_mode_of(op, "latent_scale_mode", a.latent_scale_mode);
  *out_c = c;
  *out_cc = cc;
}

StepInputs layer_inputs(Placement& pl, const StepConfig& c, int64_t T, int32_t H, const LayerTensors& lt,
                        int32_t device_type, int32_t device_id, const std::string& where, const char* rows_name) {
  const std::string op = pl.op;
  const Elem act = c.act_dtype == DType::kBF16 ? Elem::kBF16 : Elem::kF32;
  // Inputs: the plan's rows (T) and shapes.
  auto in = [&](const char* name, nb::handle h, std::initializer_list<Elem> elems, std::initializer_list<Dim> dims) {
    TensorArg t = tensor_arg(pl, name, h, elems, dims.size());
    if (t.shape[0] != T) {
      plan_value_error(op + ": tensor '" + name + "' has " + std::to_string(t.shape[0]) + " tokens, " + rows_name +
                       " " + std::to_string(T) + " (a plan of another batch?)");
    }
    check_dims(pl.op, name, t, dims);
    return t;
  };
  StepInputs si;
  TensorArg qn = in("q_nope", lt.q_nope, {act}, {{"T", T}, {"H", H}, {"Dl", c.Dl}});
  if (pl.device_type != device_type || pl.device_id != device_id) {
    plan_value_error(op + ": tensor 'q_nope' is on " + pl.where() + ", the plan was made for " + where +
                     " (make the plan with device= of the layer's tensors)");
  }
  si.q_nope = qn.data;
  si.q_rope = in("q_rope", lt.q_rope, {act}, {{"T", T}, {"H", H}, {"Dr", c.Dr}}).data;
  si.kv_latent = in("kv_latent", lt.kv_latent, {act}, {{"T", T}, {"Dl", c.Dl}}).data;
  si.k_rope = in("k_rope", lt.k_rope, {act}, {{"T", T}, {"Dr", c.Dr}}).data;
  const bool fp8_index = c.index_input_dtype() == DType::kF8E4M3;
  // e4m3 indexer inputs: float8_e4m3fn tensors or their uint8 bytes.
  const std::initializer_list<Elem> idx_elems = {Elem::kF8E4M3, Elem::kU8};
  const std::initializer_list<Elem> act_elems = {act};
  auto given = [](const std::optional<nb::handle>& h) { return h && !h->is_none(); };
  if (given(lt.idx_q)) {
    si.idx_q = in("idx_q", *lt.idx_q, fp8_index ? idx_elems : act_elems, {{"T", T}, {"Hi", c.Hi}, {"Di", c.Di}}).data;
  }
  if (given(lt.idx_w)) si.idx_w = static_cast<const float*>(in("idx_w", *lt.idx_w, {Elem::kF32}, {{"T", T}, {"Hi", c.Hi}}).data);
  if (given(lt.idx_k)) {
    si.idx_k = in("idx_k", *lt.idx_k, fp8_index ? idx_elems : act_elems, {{"T", T}, {"Di", c.Di}}).data;
  }
  const bool has_scale_q = given(lt.idx_q_scale), has_scale_k = given(lt.idx_k_scale);
  if (fp8_index) {
    if ((si.idx_q != nullptr && !has_scale_q) || (si.idx_k != nullptr && !has_scale_k)) {
      plan_value_error(op + ": the plan's indexer is FP8 (index_dtype=\"fp8\"): e4m3 idx_q and idx_k come with "
                       "idx_q_scale [T, Hi] and idx_k_scale [T] (float32)");
    }
    if (has_scale_q) si.idx_q_scale = static_cast<const float*>(in("idx_q_scale", *lt.idx_q_scale, {Elem::kF32}, {{"T", T}, {"Hi", c.Hi}}).data);
    if (has_scale_k) si.idx_k_scale = static_cast<const float*>(in("idx_k_scale", *lt.idx_k_scale, {Elem::kF32}, {{"T", T}}).data);
  } else if (has_scale_q || has_scale_k) {
    plan_value_error(op + ": idx_q_scale / idx_k_scale given, but the plan's indexer is not FP8 (plan with "
                     "index_dtype=\"fp8\")");
  }
  if (given(lt.precomputed_topk)) {
    si.topk = static_cast<const int32_t*>(in("precomputed_topk", *lt.precomputed_topk, {Elem::kI32}, {{"T", T}, {"K", c.K}}).data);
  } else if (si.idx_q == nullptr || si.idx_w == nullptr || si.idx_k == nullptr) {
    plan_value_error(op + ": '" + (si.idx_q == nullptr ? "idx_q" : si.idx_w == nullptr ? "idx_w" : "idx_k") +
                     "' is None; the indexer needs idx_q, idx_w and idx_k (only a layer given precomputed_topk runs "
                     "without them)");
  }
  return si;
}

std::unique_ptr<PagedKvCache> layer_caches(Placement& pl, const PagedCacheConfig& cc, int64_t pages_needed,
                                           nb::handle latent, std::optional<nb::handle> rope, nb::handle index_keys) {
  const std::string op = pl.op;
  PagedPoolView lv, rv, kv;
  const bool records = cc.fp8_latent();
  const bool no_rope = !rope || rope->is_none();
  ExternalPools pools;
  int64_t pages = 0;
  if (!records && no_rope) {
    // vLLM's combined bf16 KV: [num_pages, page_size, kv_row], each row latent then rope.
    lv = kv_rows_arg(pl, "latent", latent, cc.Dl, cc.Dr, /*writable=*/true, "cache 'rope' is None");
    if (lv.dtype != cc.dtype || lv.page_size != cc.page_size) {
      plan_value_error(op + ": cache 'latent' (the combined KV, rope=None) holds " + py_dtype_name(lv.dtype) +
                       " in pages of " + std::to_string(lv.page_size) + ", the plan's layout wants " +
                       py_dtype_name(cc.dtype) + " [num_pages, " + std::to_string(cc.page_size) + ", kv_row >= " +
                       std::to_string(cc.Dl + cc.Dr) + "]");
    }
    if (lv.num_pages < pages_needed) {
      plan_value_error(op + ": cache 'latent' (the combined KV) holds " + std::to_string(lv.num_pages) +
                       " pages, the plan's block table uses page " + std::to_string(pages_needed - 1));
    }
    pages = lv.num_pages;
    pools.kv = lv.data;
    pools.kv_row = static_cast<int32_t>(lv.row_stride);
    pools.kv_page_stride = lv.page_stride;
  } else {
    pages = check_pool(pl, cc, pages_needed, "latent", latent, cc.Dl, records ? DType::kF8E4M3 : cc.dtype, records, 1, &lv);
    pools.latent = lv.data;
    pools.latent_page_stride = lv.page_stride;
    if (records) {
      if (!no_rope) {
        plan_value_error(op + ": cache 'rope' given, but the plan's latent cache is fp8_ds_mla records (they hold "
                         "the rope): pass None");
      }
    } else {
      pages = std::min(pages, check_pool(pl, cc, pages_needed, "rope", *rope, cc.Dr, cc.dtype, false, 1, &rv));
      pools.rope = rv.data;
      pools.rope_page_stride = rv.page_stride;
    }
  }
  pages = std::min(pages, check_pool(pl, cc, pages_needed, "index_keys", index_keys, cc.Di, cc.index_key_dtype(),
                                     false, cc.index_page_factor, &kv));
  pools.index_keys = kv.data;
  pools.index_keys_page_stride = kv.page_stride;
  PagedCacheConfig layer = cc;
  layer.num_pages = pages;
  // Each tensor's own span (its pages, page_stride apart); wrap checks it against the layer's pages.
  if (pools.kv != nullptr) {
    pools.kv_bytes = static_cast<size_t>(pool_span_bytes(lv));
  } else {
    pools.latent_bytes = static_cast<size_t>(pool_span_bytes(lv));
    pools.rope_bytes = records ? 0 : static_cast<size_t>(pool_span_bytes(rv));
  }
  pools.index_keys_bytes = static_cast<size_t>(pool_span_bytes(kv));
  Result<PagedKvCache> cache = PagedKvCache::wrap(layer, pools);
  raise_if_error(cache.status());
  return std::make_unique<PagedKvCache>(std::move(cache).value());
}

PlanBatch plan_batch(const char* op, const std::vector<int32_t>& query_lens, const std::vector<int32_t>& context_lens,
                     nb::handle block_table) {
  if (query_lens.size() != context_lens.size()) {
    plan_value_error(std::string(op) + ": " + std::to_string(query_lens.size()) + " query_lens but " +
                     std::to_string(context_lens.size()) + " context_lens; expected one of each per request");
  }
  PlanBatch b;
  for (size_t i = 0; i < query_lens.size(); ++i) b.requests.push_back({query_lens[i], context_lens[i]});
  // The host block table (the plan reads it on the host: checks, slots, the fingerprint).
  TensorArg bt = host_tensor_arg(op, "block_table", block_table, {Elem::kI32}, {{"num_requests", -1}, {"max_pages", -1}});
  if (bt.shape[0] < static_cast<int64_t>(b.requests.size())) {
    plan_value_error(std::string(op) + ": block_table has " + std::to_string(bt.shape[0]) + " rows, the batch " +
                     std::to_string(b.requests.size()) + " requests; expected a row per request");
  }
  b.table.num_requests = static_cast<int32_t>(bt.shape[0]);
  b.table.max_pages = static_cast<int32_t>(bt.shape[1]);
  const auto* entries = static_cast<const int32_t*>(bt.data);
  b.table.data.assign(entries, entries + bt.shape[0] * bt.shape[1]);
  return b;
}

}  // namespace dsacp::py
