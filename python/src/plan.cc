// The planned step from Python: plan(...) once per forward pass (dsacp::step_plan over the batch: slots, key
// lengths, the backend's schedules, the workspace, uploaded once), run_layer(plan, caches, ...) per layer
// (dsacp::step_run over the plan: kernels only, on the plan's stream, no host synchronization, no allocation),
// with the layer's caches the caller's own tensors (PagedKvCache::wrap: nothing copied) and the outputs the
// caller's tensors or new ones.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backends.h"
#include "dsacp/fp8.h"
#include "dsacp/paged_cache.h"
#include "dsacp/step.h"
#include "dsacp/step_plan.h"
#include "tensor_args.h"

namespace nb = nanobind;

namespace dsacp::py {
namespace {

[[noreturn]] void value_error(const std::string& msg) { throw nb::value_error(msg.c_str()); }

// One batch's plan, with where it runs: the backend (CPU threads, or a CUDA device and the stream the plan was
// made on: every run must be on that stream, since the plan's tables were uploaded in its order).
struct PyStepPlan {
  StepPlan plan;
  PagedCacheConfig cache;  // the pools' layout (num_pages: the plan's; a layer's caches may hold more)
  Backend* backend = nullptr;
  int32_t device_type = nb::device::cpu::value, device_id = 0;
  uintptr_t stream = 0;
  nb::object device_table;  // the caller's device block table, alive as long as the plan reads it
  std::string where() const {
    return device_type == nb::device::cuda::value ? "cuda:" + std::to_string(device_id) : "cpu";
  }
};

DType act_dtype_arg(const char* what, const std::string& s) {
  if (s == "bf16" || s == "bfloat16") return DType::kBF16;
  if (s == "f32" || s == "float32") return DType::kF32;
  value_error(std::string("plan: ") + what + "=\"" + s + "\", expected \"bf16\" or \"f32\"");
}

Fp8ScaleMode scale_mode_of(const char* what, const std::string& s) {
  if (s == "fp32") return Fp8ScaleMode::kFp32;
  if (s == "ue8m0") return Fp8ScaleMode::kUe8m0;
  value_error(std::string("plan: ") + what + "=\"" + s + "\", expected \"fp32\" or \"ue8m0\"");
}

// "cpu", "cuda" (device 0) or "cuda:N".
void device_arg(const std::string& s, int32_t* type, int32_t* id) {
  if (s == "cpu") {
    *type = nb::device::cpu::value;
    *id = 0;
    return;
  }
  if (s == "cuda" || s.rfind("cuda:", 0) == 0) {
    *type = nb::device::cuda::value;
    *id = 0;
    if (s.size() > 5) {
      try {
        size_t used = 0;
        *id = std::stoi(s.substr(5), &used);
        if (used + 5 != s.size() || *id < 0) throw std::invalid_argument(s);
      } catch (const std::exception&) {
        value_error("plan: device=\"" + s + "\", expected \"cpu\", \"cuda\" or \"cuda:N\"");
      }
    }
    return;
  }
  value_error("plan: device=\"" + s + "\", expected \"cpu\", \"cuda\" or \"cuda:N\"");
}

PyStepPlan* make_plan(const std::vector<int32_t>& query_lens, const std::vector<int32_t>& context_lens,
                      nb::handle block_table, int64_t num_pages, int32_t heads, float scale, int32_t topk,
                      int32_t page_size, int32_t latent_dim, int32_t rope_dim, int32_t index_heads, int32_t index_dim,
                      const std::string& dtype, const std::string& out_dtype, std::optional<std::string> cache_dtype,
                      std::optional<std::string> index_dtype, const std::string& latent_cache,
                      const std::string& index_scale_mode, const std::string& latent_scale_mode,
                      const std::string& topk_form, const std::string& lse_base, int32_t decode_threshold,
                      const std::string& device, std::optional<nb::object> device_block_table,
                      std::optional<uintptr_t> stream, int threads, bool fingerprint) {
  if (query_lens.size() != context_lens.size()) {
    value_error("plan: " + std::to_string(query_lens.size()) + " query_lens but " + std::to_string(context_lens.size()) +
                " context_lens; expected one of each per request");
  }
  std::vector<Request> requests;
  for (size_t i = 0; i < query_lens.size(); ++i) requests.push_back({query_lens[i], context_lens[i]});
  // The host block table (the plan reads it on the host: checks, slots, the fingerprint).
  TensorArg bt = host_tensor_arg("plan", "block_table", block_table, {Elem::kI32}, {{"num_requests", -1}, {"max_pages", -1}});
  if (bt.shape[0] < static_cast<int64_t>(requests.size())) {
    value_error("plan: block_table has " + std::to_string(bt.shape[0]) + " rows, the batch " +
                std::to_string(requests.size()) + " requests; expected a row per request");
  }
  BlockTable table;
  table.num_requests = static_cast<int32_t>(bt.shape[0]);
  table.max_pages = static_cast<int32_t>(bt.shape[1]);
  const auto* entries = static_cast<const int32_t*>(bt.data);
  table.data.assign(entries, entries + bt.shape[0] * bt.shape[1]);

  auto p = std::make_unique<PyStepPlan>();
  device_arg(device, &p->device_type, &p->device_id);
  StepConfig c = step_config_of(CaseDims{heads, latent_dim, rope_dim, index_heads, index_dim}, topk, scale,
                                act_dtype_arg("dtype", dtype), act_dtype_arg("out_dtype", out_dtype));
  if (decode_threshold < 1 || decode_threshold > kMaxDecodeThreshold) {
    value_error("plan: decode_threshold=" + std::to_string(decode_threshold) + ", expected 1 .. " +
                std::to_string(kMaxDecodeThreshold));
  }
  c.decode_threshold = decode_threshold;
  if (topk_form == "canonical") {
    c.topk_form = TopkForm::kCanonical;
  } else if (topk_form == "slots") {
    c.topk_form = TopkForm::kSlot;
  } else {
    value_error("plan: topk_form=\"" + topk_form + "\", expected \"canonical\" or \"slots\"");
  }
  if (lse_base == "e") {
    c.lse_base = LseBase::kNatural;
  } else if (lse_base == "2") {
    c.lse_base = LseBase::kTwo;
  } else {
    value_error("plan: lse_base=\"" + lse_base + "\", expected \"e\" or \"2\"");
  }
  PagedCacheConfig cc;
  if (num_pages < 1) value_error("plan: num_pages=" + std::to_string(num_pages) + ", expected >= 1 (the caches' pages)");
  cc.num_pages = num_pages;
  cc.page_size = page_size;
  cc.Dl = latent_dim;
  cc.Dr = rope_dim;
  cc.Di = index_dim;
  cc.dtype = cache_dtype ? act_dtype_arg("cache_dtype", *cache_dtype) : c.act_dtype;
  if (index_dtype) {
    if (*index_dtype != "fp8") value_error("plan: index_dtype=\"" + *index_dtype + "\", expected None or \"fp8\"");
    // e4m3 idx_q / idx_k with their scales, into the FP8 indexer pages (132 bytes a key for Di = 128).
    c.index_dtype = DType::kF8E4M3;
    cc.index_dtype = DType::kF8E4M3;
  }
  cc.index_scale_mode = scale_mode_of("index_scale_mode", index_scale_mode);
  if (latent_cache == "rows") {
    cc.latent_format = LatentFormat::kRows;
  } else if (latent_cache == "fp8_ds_mla") {
    cc.latent_format = LatentFormat::kFp8DsMla;
  } else {
    value_error("plan: latent_cache=\"" + latent_cache + "\", expected \"rows\" or \"fp8_ds_mla\"");
  }
  cc.latent_scale_mode = scale_mode_of("latent_scale_mode", latent_scale_mode);

  StepPlanOptions o;
  o.fingerprint = fingerprint;
  if (p->device_type == nb::device::cuda::value) {
    Placement pl("plan");
    pl.device_type = p->device_type;
    pl.device_id = p->device_id;
    pl.first = "device";
    if (device_block_table && !device_block_table->is_none()) {
      TensorArg dt = tensor_arg(pl, "device_block_table", *device_block_table, {Elem::kI32},
                                {{"num_requests", table.num_requests}, {"max_pages", table.max_pages}});
      o.device_block_table = static_cast<const int32_t*>(dt.data);
      p->device_table = *device_block_table;
    }
    pl.torch = pl.torch || is_torch_tensor(block_table);
    p->stream = call_stream(pl, stream);
    p->backend = &cuda_backend(p->device_id, p->stream);
  } else {
    if (device_block_table && !device_block_table->is_none()) {
      value_error("plan: device_block_table is for a plan on a CUDA device (device=\"cuda:N\"); a CPU plan reads "
                  "block_table itself");
    }
    p->backend = &cpu_backend(threads);
  }
  p->cache = cc;
  Result<StepPlan> made = [&] {
    nb::gil_scoped_release release;
    return step_plan(*p->backend, c, requests, table, cc, o);
  }();
  raise_if_error(made.status());
  p->plan = std::move(made).value();
  return p.release();
}

// A layer's pool tensor against the plan's layout; returns its pages.
int64_t check_pool(const PyStepPlan& p, Placement& pl, const char* name, nb::handle obj, int64_t dim, DType want,
                   bool records, PagedPoolView* view) {
  int32_t record_dr = 0;
  const PagedCacheConfig& cc = p.cache;
  *view = paged_pool_arg(pl, name, obj, dim, /*writable=*/true, cc.page_size, records, &record_dr);
  auto py_name = [](DType d) { return d == DType::kBF16 ? "bfloat16" : "float32"; };
  const char* kind = want == DType::kF8E4M3 ? (records ? "fp8_ds_mla records (uint8)" : "FP8 pages (uint8)")
                                            : py_name(want);
  if (view->dtype != want || (records != view->records()) || view->page_size != cc.page_size ||
      (records && record_dr != cc.Dr)) {
    const std::string got = view->records() ? "fp8_ds_mla records of " + std::to_string(view->record_bytes) + " bytes"
                            : view->dtype == DType::kF8E4M3 ? "FP8 pages"
                                                             : std::string(py_name(view->dtype));
    value_error(std::string("run_layer: cache '") + name + "' holds " + got + " in pages of " +
                std::to_string(view->page_size) + ", the plan's layout wants " + kind + " in pages of " +
                std::to_string(cc.page_size) +
                (records ? " (" + std::to_string(fp8_ds_mla_record_bytes(cc.Dl, cc.Dr)) + " bytes a token)" : ""));
  }
  if (view->num_pages < p.plan.pages_needed()) {
    value_error(std::string("run_layer: cache '") + name + "' holds " + std::to_string(view->num_pages) +
                " pages, the plan's block table uses page " + std::to_string(p.plan.pages_needed() - 1));
  }
  return view->num_pages;
}

// One run_layer call's arguments as the C++ step takes them (checked against the plan).
struct LayerCall {
  StepInputs si;
  StepOutputs so;
  StepWorkspace ws;
  std::unique_ptr<PagedKvCache> cache;
  OutArray o, l, k;
};

#define DSACP_LAYER_PARAMS                                                                                       \
  const PyStepPlan &p, nb::handle latent, std::optional<nb::handle> rope, nb::handle index_keys, nb::handle q_nope, \
      nb::handle q_rope, nb::handle kv_latent, nb::handle k_rope, std::optional<nb::handle> idx_q,                 \
      std::optional<nb::handle> idx_w, std::optional<nb::handle> idx_k, std::optional<nb::handle> idx_q_scale,     \
      std::optional<nb::handle> idx_k_scale, std::optional<nb::handle> precomputed_topk,                          \
      std::optional<nb::object> out, std::optional<nb::object> lse, std::optional<nb::object> topk,               \
      std::optional<nb::handle> workspace, std::optional<uintptr_t> stream, uint64_t fingerprint
#define DSACP_LAYER_ARGS                                                                                      \
  p, latent, rope, index_keys, q_nope, q_rope, kv_latent, k_rope, idx_q, idx_w, idx_k, idx_q_scale, idx_k_scale, \
      precomputed_topk, out, lse, topk, workspace, stream, fingerprint

LayerCall layer_call(DSACP_LAYER_PARAMS) {
  Placement pl("run_layer");
  const StepConfig& c = p.plan.config();
  const PagedCacheConfig& cc = p.cache;
  const int64_t T = p.plan.num_tokens();
  const Elem act = c.act_dtype == DType::kBF16 ? Elem::kBF16 : Elem::kF32;
  // Inputs: the plan's batch (T tokens) and shapes.
  auto in = [&](const char* name, nb::handle h, std::initializer_list<Elem> elems, std::initializer_list<Dim> dims) {
    TensorArg t = tensor_arg(pl, name, h, elems, dims.size());
    if (t.shape[0] != T) {
      value_error(std::string("run_layer: tensor '") + name + "' has " + std::to_string(t.shape[0]) +
                  " tokens, the plan's batch " + std::to_string(T) + " (a plan of another batch?)");
    }
    check_dims(pl.op, name, t, dims);
    return t;
  };
  StepInputs si;
  TensorArg qn = in("q_nope", q_nope, {act}, {{"T", T}, {"H", c.H}, {"Dl", c.Dl}});
  if (pl.device_type != p.device_type || pl.device_id != p.device_id) {
    value_error("run_layer: tensor 'q_nope' is on " + pl.where() + ", the plan was made for " + p.where() +
                " (make the plan with device= of the layer's tensors)");
  }
  si.q_nope = qn.data;
  si.q_rope = in("q_rope", q_rope, {act}, {{"T", T}, {"H", c.H}, {"Dr", c.Dr}}).data;
  si.kv_latent = in("kv_latent", kv_latent, {act}, {{"T", T}, {"Dl", c.Dl}}).data;
  si.k_rope = in("k_rope", k_rope, {act}, {{"T", T}, {"Dr", c.Dr}}).data;
  const bool fp8_index = c.index_input_dtype() == DType::kF8E4M3;
  // e4m3 indexer inputs: float8_e4m3fn tensors or their uint8 bytes.
  const std::initializer_list<Elem> idx_elems = {Elem::kF8E4M3, Elem::kU8};
  const std::initializer_list<Elem> act_elems = {act};
  if (idx_q && !idx_q->is_none()) {
    si.idx_q = in("idx_q", *idx_q, fp8_index ? idx_elems : act_elems, {{"T", T}, {"Hi", c.Hi}, {"Di", c.Di}}).data;
  }
  if (idx_w && !idx_w->is_none()) si.idx_w = static_cast<const float*>(in("idx_w", *idx_w, {Elem::kF32}, {{"T", T}, {"Hi", c.Hi}}).data);
  if (idx_k && !idx_k->is_none()) {
    si.idx_k = in("idx_k", *idx_k, fp8_index ? idx_elems : act_elems, {{"T", T}, {"Di", c.Di}}).data;
  }
  const bool has_scale_q = idx_q_scale && !idx_q_scale->is_none(), has_scale_k = idx_k_scale && !idx_k_scale->is_none();
  if (fp8_index) {
    if ((si.idx_q != nullptr && !has_scale_q) || (si.idx_k != nullptr && !has_scale_k)) {
      value_error("run_layer: the plan's indexer is FP8 (index_dtype=\"fp8\"): e4m3 idx_q and idx_k come with "
                  "idx_q_scale [T, Hi] and idx_k_scale [T] (float32)");
    }
    if (has_scale_q) si.idx_q_scale = static_cast<const float*>(in("idx_q_scale", *idx_q_scale, {Elem::kF32}, {{"T", T}, {"Hi", c.Hi}}).data);
    if (has_scale_k) si.idx_k_scale = static_cast<const float*>(in("idx_k_scale", *idx_k_scale, {Elem::kF32}, {{"T", T}}).data);
  } else if (has_scale_q || has_scale_k) {
    value_error("run_layer: idx_q_scale / idx_k_scale given, but the plan's indexer is not FP8 (plan with "
                "index_dtype=\"fp8\")");
  }
  if (precomputed_topk && !precomputed_topk->is_none()) {
    si.topk = static_cast<const int32_t*>(in("precomputed_topk", *precomputed_topk, {Elem::kI32}, {{"T", T}, {"K", c.K}}).data);
  } else if (si.idx_q == nullptr || si.idx_w == nullptr || si.idx_k == nullptr) {
    value_error(std::string("run_layer: '") + (si.idx_q == nullptr ? "idx_q" : si.idx_w == nullptr ? "idx_w" : "idx_k") +
                "' is None; the indexer needs idx_q, idx_w and idx_k (only a layer given precomputed_topk runs "
                "without them)");
  }
  si.plan_fingerprint = fingerprint;

  // The layer's caches, the caller's tensors as they are.
  PagedPoolView lv, rv, kv;
  const bool records = cc.fp8_latent();
  int64_t pages = check_pool(p, pl, "latent", latent, cc.Dl, records ? DType::kF8E4M3 : cc.dtype, records, &lv);
  ExternalPools pools;
  pools.latent = lv.data;
  if (records) {
    if (rope && !rope->is_none()) {
      value_error("run_layer: cache 'rope' given, but the plan's latent cache is fp8_ds_mla records (they hold the "
                  "rope): pass None");
    }
  } else {
    if (!rope || rope->is_none()) value_error("run_layer: cache 'rope' is None; the plan's latent cache is rows (bf16/f32), with a rope pool");
    pages = std::min(pages, check_pool(p, pl, "rope", *rope, cc.Dr, cc.dtype, false, &rv));
    pools.rope = rv.data;
  }
  pages = std::min(pages, check_pool(p, pl, "index_keys", index_keys, cc.Di, cc.index_key_dtype(), false, &kv));
  pools.index_keys = kv.data;
  PagedCacheConfig layer = cc;
  layer.num_pages = pages;
  pools.latent_bytes = PagedKvCache::latent_bytes(layer);
  pools.rope_bytes = records ? 0 : PagedKvCache::rope_bytes(layer);
  pools.index_keys_bytes = PagedKvCache::index_keys_bytes(layer);
  Result<PagedKvCache> cache = PagedKvCache::wrap(layer, pools);
  raise_if_error(cache.status());

  // Outputs.
  StepOutputs so;
  OutArray o = out_array(pl, "out", out, c.out_dtype == DType::kBF16 ? Elem::kBF16 : Elem::kF32, {T, c.H, c.Dl});
  OutArray l = out_array(pl, "lse", lse, Elem::kF32, {T, c.H});
  OutArray k = out_array(pl, "topk", topk, Elem::kI32, {T, c.K});
  so.out = o.data;
  so.lse = static_cast<float*>(l.data);
  so.topk = static_cast<int32_t*>(k.data);
  StepWorkspace ws;
  if (workspace && !workspace->is_none()) {
    TensorArg w = tensor_arg(pl, "workspace", *workspace, {Elem::kU8}, 1, /*writable=*/true);
    ws.data = const_cast<void*>(w.data);
    ws.bytes = static_cast<size_t>(w.shape[0]);
    if (ws.bytes < p.plan.workspace_bytes()) {
      value_error("run_layer: workspace has " + std::to_string(ws.bytes) + " bytes, the plan needs " +
                  std::to_string(p.plan.workspace_bytes()));
    }
  }
  if (p.device_type == nb::device::cuda::value) {
    const uintptr_t s = call_stream(pl, stream);
    if (s != p.stream) {
      value_error("run_layer: this call runs on stream " + std::to_string(s) + ", the plan was made on stream " +
                  std::to_string(p.stream) + " of " + p.where() +
                  " (its tables were uploaded in that stream's order): make the plan on the stream that runs the "
                  "layers (for CUDA-graph capture: under torch.cuda.stream(capture_stream))");
    }
  }
  LayerCall call;
  call.si = si;
  call.so = so;
  call.ws = ws;
  call.cache = std::make_unique<PagedKvCache>(std::move(cache).value());
  call.o = std::move(o);
  call.l = std::move(l);
  call.k = std::move(k);
  return call;
}

nb::tuple run_layer(DSACP_LAYER_PARAMS) {
  LayerCall c = layer_call(DSACP_LAYER_ARGS);
  Backend& be = *p.backend;
  run_kernel([&] { return step_run(be, p.plan, *c.cache, c.si, c.so, c.ws); });
  return nb::make_tuple(c.o.object(), c.l.object(), c.k.object());
}

// Host seconds per run_layer made n times from C++ with the arguments converted once (each still a whole planned
// step_run: its checks and its kernels' launches; on the CPU the kernels themselves): the C++ side of the
// planned layer's Python overhead. Ends with the backend's work done.
double bench_run_layer(DSACP_LAYER_PARAMS, int n) {
  LayerCall c = layer_call(DSACP_LAYER_ARGS);
  Backend& be = *p.backend;
  Status s;
  double secs = 0;
  {
    nb::gil_scoped_release release;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n && s.ok(); ++i) s = step_run(be, p.plan, *c.cache, c.si, c.so, c.ws);
    secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s.ok()) s = be.synchronize();
  }
  raise_if_error(s);
  return n > 0 ? secs / n : 0.0;
}

}  // namespace

void register_plan(nb::module_& m) {
  nb::class_<PyStepPlan>(m, "StepPlan", R"(The plan of one batch step (dsacp.plan): build it once per forward pass and
pass it to run_layer for each layer. It holds the batch's device tables and workspace; keep it alive while runs,
or CUDA graphs that captured them, use it.)")
      .def_prop_ro("num_tokens", [](const PyStepPlan& p) { return p.plan.num_tokens(); }, "T, the batch's new tokens")
      .def_prop_ro("fingerprint", [](const PyStepPlan& p) { return p.plan.fingerprint(); },
                   "A hash of the config, the requests, the block table and the cache layout (0: not computed)")
      .def_prop_ro("pages_needed", [](const PyStepPlan& p) { return p.plan.pages_needed(); },
                   "Pages each layer's cache must hold (one past the highest page id the plan checked)")
      .def_prop_ro("workspace_bytes", [](const PyStepPlan& p) { return p.plan.workspace_bytes(); },
                   "Device scratch bytes of a run (the plan owns a workspace of this size; workspace= lends another)")
      .def_prop_ro("device", [](const PyStepPlan& p) { return p.where(); }, "\"cpu\" or \"cuda:N\"")
      .def_prop_ro("stream", [](const PyStepPlan& p) { return p.stream; }, "The CUDA stream the plan runs on (0 on the CPU)")
      .def_prop_ro("heads", [](const PyStepPlan& p) { return p.plan.config().H; })
      .def_prop_ro("latent_dim", [](const PyStepPlan& p) { return p.plan.config().Dl; })
      .def_prop_ro("rope_dim", [](const PyStepPlan& p) { return p.plan.config().Dr; })
      .def_prop_ro("index_heads", [](const PyStepPlan& p) { return p.plan.config().Hi; })
      .def_prop_ro("index_dim", [](const PyStepPlan& p) { return p.plan.config().Di; })
      .def_prop_ro("topk", [](const PyStepPlan& p) { return p.plan.config().K; })
      .def_prop_ro("page_size", [](const PyStepPlan& p) { return p.cache.page_size; })
      .def_prop_ro("out_dtype", [](const PyStepPlan& p) {
        return std::string(p.plan.config().out_dtype == DType::kBF16 ? "bf16" : "f32");
      })
      .def_prop_ro("dtype", [](const PyStepPlan& p) {
        return std::string(p.plan.config().act_dtype == DType::kBF16 ? "bf16" : "f32");
      }, "The activations' dtype (q_nope, q_rope, kv_latent, k_rope; idx_q, idx_k unless index_dtype is fp8)")
      .def_prop_ro("cache_dtype", [](const PyStepPlan& p) { return std::string(p.cache.dtype == DType::kBF16 ? "bf16" : "f32"); },
                   "The latent / rope rows' and (unless FP8) the indexer keys' storage")
      .def_prop_ro("latent_cache", [](const PyStepPlan& p) { return std::string(p.cache.fp8_latent() ? "fp8_ds_mla" : "rows"); },
                   "\"rows\" (latent and rope pools of cache_dtype) or \"fp8_ds_mla\" (656-byte records)")
      .def_prop_ro("index_dtype", [](const PyStepPlan& p) -> std::optional<std::string> {
        if (p.cache.index_key_dtype() == DType::kF8E4M3) return std::string("fp8");
        return std::nullopt;
      })
      .def_prop_ro("slots", [](const PyStepPlan& p) { return p.plan.host().slots; }, "The new tokens' cache slots")
      .def_prop_ro("key_len", [](const PyStepPlan& p) { return p.plan.host().token_key_len; },
                   "Each new token's key count (context_len + i + 1)")
      .def_prop_ro("token_request", [](const PyStepPlan& p) { return p.plan.host().token_request; });
  m.def("plan", &make_plan, nb::arg("query_lens"), nb::arg("context_lens"), nb::arg("block_table"), nb::kw_only(),
        nb::arg("num_pages"), nb::arg("heads"), nb::arg("scale"), nb::arg("topk") = kDeepSeekV32TopK,
        nb::arg("page_size") = 64, nb::arg("latent_dim") = 512, nb::arg("rope_dim") = 64, nb::arg("index_heads") = 64,
        nb::arg("index_dim") = 128, nb::arg("dtype") = "bf16", nb::arg("out_dtype") = "f32",
        nb::arg("cache_dtype") = nb::none(), nb::arg("index_dtype") = nb::none(), nb::arg("latent_cache") = "rows",
        nb::arg("index_scale_mode") = "fp32", nb::arg("latent_scale_mode") = "fp32",
        nb::arg("topk_form") = "canonical", nb::arg("lse_base") = "e", nb::arg("decode_threshold") = kMaxDecodeThreshold,
        nb::arg("device") = "cpu", nb::arg("device_block_table") = nb::none(), nb::arg("stream") = nb::none(),
        nb::arg("threads") = 0, nb::arg("fingerprint") = true, nb::rv_policy::take_ownership,
        "The step's plan for one batch (see dsacp.plan).");
  m.def("run_layer", &run_layer, nb::arg("plan"), nb::arg("latent"), nb::arg("rope").none(), nb::arg("index_keys"),
        nb::arg("q_nope"), nb::arg("q_rope"), nb::arg("kv_latent"), nb::arg("k_rope"), nb::arg("idx_q").none() = nb::none(),
        nb::arg("idx_w").none() = nb::none(), nb::arg("idx_k").none() = nb::none(), nb::kw_only(),
        nb::arg("idx_q_scale").none() = nb::none(), nb::arg("idx_k_scale").none() = nb::none(),
        nb::arg("precomputed_topk").none() = nb::none(), nb::arg("out") = nb::none(), nb::arg("lse") = nb::none(),
        nb::arg("topk") = nb::none(), nb::arg("workspace").none() = nb::none(), nb::arg("stream") = nb::none(),
        nb::arg("fingerprint") = 0, "One layer's step under a plan (see dsacp.run_layer).");
  m.def("_bench_run_layer", &bench_run_layer, nb::arg("plan"), nb::arg("latent"), nb::arg("rope").none(),
        nb::arg("index_keys"), nb::arg("q_nope"), nb::arg("q_rope"), nb::arg("kv_latent"), nb::arg("k_rope"),
        nb::arg("idx_q").none(), nb::arg("idx_w").none(), nb::arg("idx_k").none(), nb::arg("idx_q_scale").none(),
        nb::arg("idx_k_scale").none(), nb::arg("precomputed_topk").none(), nb::arg("out").none(),
        nb::arg("lse").none(), nb::arg("topk").none(), nb::arg("workspace").none(), nb::arg("stream").none(),
        nb::arg("fingerprint"), nb::arg("n"),
        "Host seconds per run_layer call made n times from C++ with the arguments converted once (benchmarks).");
}

}  // namespace dsacp::py
