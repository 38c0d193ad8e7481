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
#include "step_args.h"
#include "tensor_args.h"

namespace nb = nanobind;

namespace dsacp::py {
namespace {

void value_error(const std::string& msg) { plan_value_error(msg); }

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

PyStepPlan* make_plan(const std::vector<int32_t>& query_lens, const std::vector<int32_t>& context_lens,
                      nb::handle block_table, int64_t num_pages, int32_t heads, float scale, int32_t topk,
                      int32_t page_size, int32_t latent_dim, int32_t rope_dim, int32_t index_heads, int32_t index_dim,
                      const std::string& dtype, const std::string& out_dtype, std::optional<std::string> cache_dtype,
                      std::optional<std::string> index_dtype, const std::string& latent_cache,
                      const std::string& index_scale_mode, const std::string& latent_scale_mode,
                      const std::string& topk_form, const std::string& lse_base, int32_t decode_threshold,
                      const std::string& device, std::optional<nb::object> device_block_table,
                      std::optional<uintptr_t> stream, int threads, bool fingerprint) {
  const PlanBatch batch = plan_batch("plan", query_lens, context_lens, block_table);
  const std::vector<Request>& requests = batch.requests;
  const BlockTable& table = batch.table;

  auto p = std::make_unique<PyStepPlan>();
  device_arg("plan", device, &p->device_type, &p->device_id);
  PlanArgs a;
  a.num_pages = num_pages;
  a.heads = heads;
  a.scale = scale;
  a.topk = topk;
  a.page_size = page_size;
  a.latent_dim = latent_dim;
  a.rope_dim = rope_dim;
  a.index_heads = index_heads;
  a.index_dim = index_dim;
  a.dtype = dtype;
  a.out_dtype = out_dtype;
  a.cache_dtype = cache_dtype;
  a.index_dtype = index_dtype;
  a.latent_cache = latent_cache;
  a.index_scale_mode = index_scale_mode;
  a.latent_scale_mode = latent_scale_mode;
  a.topk_form = topk_form;
  a.lse_base = lse_base;
  a.decode_threshold = decode_threshold;
  StepConfig c;
  PagedCacheConfig cc;
  plan_configs("plan", a, &c, &cc);

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
  const int64_t T = p.plan.num_tokens();
  StepInputs si = layer_inputs(pl, c, T, c.H,
                               LayerTensors{q_nope, q_rope, kv_latent, k_rope, idx_q, idx_w, idx_k, idx_q_scale,
                                            idx_k_scale, precomputed_topk},
                               p.device_type, p.device_id, p.where(), "the plan's batch");
  si.plan_fingerprint = fingerprint;
  // The layer's caches, the caller's tensors as they are.
  std::unique_ptr<PagedKvCache> cache = layer_caches(pl, p.cache, p.plan.pages_needed(), latent, rope, index_keys);

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
  call.cache = std::move(cache);
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
