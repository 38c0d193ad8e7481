// Context parallelism from Python: a CP group (one rank per process, or per thread), a rank's plan of a batch
// (cp_step_plan) and its per-layer run (cp_step_run) over the caller's tensors.
//
// A group's communicators are either dsacp's NCCL communicators (CUDA ranks; the ncclUniqueId made by
// nccl_make_id on one rank and carried to the others by the caller: dsacp/cp.py broadcasts it through a
// torch.distributed process group), or a Python object's collectives (CPU ranks; dsacp/cp.py's is
// torch.distributed over gloo): PyCommunicator calls its all_gather / all_to_all / broadcast / barrier methods
// with numpy views of the host buffers, holding the GIL only for the call.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "backends.h"
#include "dsacp/cp_step.h"
#include "dsacp/cp_step_plan.h"
#include "dsacp/nccl_communicator.h"
#include "step_args.h"
#include "tensor_args.h"

namespace nb = nanobind;

namespace dsacp::py {
namespace {

class DoneHandle final : public CollectiveHandle {
 public:
  explicit DoneHandle(Status s) : s_(std::move(s)) {}
  Status wait() override { return s_; }

 private:
  Status s_;
};

// Collectives by a Python object's methods, each blocking until done (the handle it returns is complete):
//   all_gather(send, recv), all_to_all(send, recv), broadcast(buf, root), barrier(), and optionally abort(reason)
// with send / recv / buf writable 1-D uint8 numpy arrays over the caller's host buffers (valid for the call).
class PyCommunicator final : public Communicator {
 public:
  PyCommunicator(nb::object impl, int rank, int size, std::string name)
      : impl_(std::move(impl)), rank_(rank), size_(size), name_(std::move(name)) {}
  ~PyCommunicator() override {
    nb::gil_scoped_acquire gil;
    impl_.reset();
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Result<std::unique_ptr<CollectiveHandle>> all_gather_async(const void* send, void* recv, size_t bytes) override {
    return done(call("all_gather", bytes, [&] {
      impl_.attr("all_gather")(view(send, bytes), view(recv, bytes * size_));
    }));
  }
  Result<std::unique_ptr<CollectiveHandle>> all_to_all_async(const void* send, void* recv, size_t bytes) override {
    return done(call("all_to_all", bytes * size_, [&] {
      impl_.attr("all_to_all")(view(send, bytes * size_), view(recv, bytes * size_));
    }));
  }
  Result<std::unique_ptr<CollectiveHandle>> broadcast_async(void* buf, size_t bytes, int root) override {
    return done(call("broadcast", rank_ == root ? bytes : 0, [&] { impl_.attr("broadcast")(view(buf, bytes), root); }));
  }
  Status barrier() override {
    return call("barrier", 0, [&] { impl_.attr("barrier")(); }, /*always=*/true);
  }
  void abort(const std::string& reason) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!failed_.empty()) return;
      failed_ = reason.empty() ? "aborted" : reason;
    }
    nb::gil_scoped_acquire gil;
    if (nb::hasattr(impl_, "abort")) {
      try {
        impl_.attr("abort")(reason);
      } catch (nb::python_error& e) {
        e.discard_as_unraisable("dsacp: the CP group's abort");
      }
    }
  }
  CommStats stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }
  void reset_stats() override {
    std::lock_guard<std::mutex> lock(mu_);
    stats_ = {};
  }

 private:
  static nb::object view(const void* p, size_t bytes) {
    const size_t shape[1] = {bytes};
    // rv_policy::reference: a view of the buffer (an ndarray without an owner is copied by default).
    return nb::cast(nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(const_cast<void*>(p), 1, shape, nb::handle()),
                    nb::rv_policy::reference);
  }
  static Result<std::unique_ptr<CollectiveHandle>> done(Status s) {
    if (!s.ok()) return s;
    return std::unique_ptr<CollectiveHandle>(new DoneHandle(Status()));
  }
  // Runs f under the GIL (collectives of 0 bytes skip the call: every rank passes the same sizes).
  template <typename F>
  Status call(const char* what, size_t sent, F&& f, bool always = false) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!failed_.empty()) {
        return Status(StatusCode::kBackendError, name_ + " " + what + ": the group was aborted (" + failed_ + ")");
      }
      ++stats_.collectives;
      stats_.bytes += static_cast<int64_t>(sent);
    }
    if (sent == 0 && !always && std::string(what) != "broadcast") return Status();
    nb::gil_scoped_acquire gil;
    try {
      f();
    } catch (nb::python_error& e) {
      // One line: the exception's type and message (not its traceback).
      std::string text = nb::type_name(e.type()).c_str();
      if (PyObject* v = PyObject_Str(e.value().ptr()); v != nullptr) {
        if (const char* u = PyUnicode_AsUTF8(v); u != nullptr) text += std::string(": ") + u;
        Py_DECREF(v);
      }
      PyErr_Clear();
      return Status(StatusCode::kBackendError, name_ + " " + what + " (rank " + std::to_string(rank_) + "): " + text);
    } catch (const std::exception& e) {
      return Status(StatusCode::kBackendError, name_ + " " + what + ": " + e.what());
    }
    return Status();
  }
  nb::object impl_;
  int rank_, size_;
  std::string name_;
  mutable std::mutex mu_;
  std::string failed_;
  CommStats stats_;
};

// A CP rank's group: its layout, its rank, its three communicators and the backend its plans run on.
struct PyCpGroup {
  CpLayout layout;
  int32_t cr = 0;
  OwnedCpComms comms;
  std::string transport;
  Backend* backend = nullptr;
  int32_t device_type = nb::device::cpu::value, device_id = 0;
  uintptr_t stream = 0;
  std::string where() const {
    return device_type == nb::device::cuda::value ? "cuda:" + std::to_string(device_id) : "cpu";
  }
};

CpLayout layout_of(int32_t P, int32_t D, int32_t interleave, const std::string& indexer, bool dsa_cp,
                   const std::string& decode_mode, int64_t graph_bucket_tokens, int64_t timeout_ms) {
  CpLayout l;
  if (P < 1 || D < 1) plan_value_error("cp_group: P=" + std::to_string(P) + ", D=" + std::to_string(D) + ", expected >= 1");
  l.P = P;
  l.D = D;
  if (interleave < 0) plan_value_error("cp_group: interleave=" + std::to_string(interleave) + ", expected >= 0 (0: the page size)");
  l.interleave = interleave;
  if (indexer == "sharded") {
    l.indexer = IndexerMode::kSharded;
  } else if (indexer == "replicated") {
    l.indexer = IndexerMode::kReplicated;
  } else {
    plan_value_error("cp_group: indexer=\"" + indexer + "\", expected \"sharded\" or \"replicated\"");
  }
  l.dsa_cp = dsa_cp;
  if (decode_mode == "local_merge") {
    l.decode_mode = DecodeMode::kLocalMerge;
  } else if (decode_mode == "gathered") {
    l.decode_mode = DecodeMode::kGathered;
  } else {
    plan_value_error("cp_group: decode_mode=\"" + decode_mode + "\", expected \"local_merge\" or \"gathered\"");
  }
  l.graph_bucket_tokens = graph_bucket_tokens;
  l.comm_timeout_ms = timeout_ms;
  return l;
}

#define DSACP_LAYOUT_PARAMS                                                                                     \
  int32_t P, int32_t D, int32_t interleave, const std::string &indexer, bool dsa_cp, const std::string &decode_mode, \
      int64_t graph_bucket_tokens, int64_t timeout_ms
#define DSACP_LAYOUT_ARGS P, D, interleave, indexer, dsa_cp, decode_mode, graph_bucket_tokens, timeout_ms

PyCpGroup* group_of_collectives(nb::object world, nb::object pcp, nb::object dcp, int32_t rank, DSACP_LAYOUT_PARAMS,
                                int threads) {
  auto g = std::make_unique<PyCpGroup>();
  g->layout = layout_of(DSACP_LAYOUT_ARGS);
  const int32_t Pt = g->layout.num_ranks();
  if (rank < 0 || rank >= Pt) {
    plan_value_error("cp_group: rank " + std::to_string(rank) + " of a layout of " + std::to_string(Pt) + " ranks");
  }
  g->cr = rank;
  g->comms.world = std::make_unique<PyCommunicator>(std::move(world), rank, Pt, "CP world");
  g->comms.pcp = std::make_unique<PyCommunicator>(std::move(pcp), rank / D, P, "PCP group");
  g->comms.dcp = std::make_unique<PyCommunicator>(std::move(dcp), rank % D, D, "DCP group");
  g->transport = "python collectives";
  g->backend = &cpu_backend(threads);
  return g.release();
}

nb::bytes make_nccl_id() {
  Result<NcclId> id = nccl_make_id();
  raise_if_error(id.status());
  return nb::bytes(id->bytes.data(), id->bytes.size());
}

PyCpGroup* group_of_nccl(nb::bytes id_bytes, int32_t rank, DSACP_LAYOUT_PARAMS, int32_t device,
                         std::optional<uintptr_t> stream, int64_t window_bytes) {
  auto g = std::make_unique<PyCpGroup>();
  g->layout = layout_of(DSACP_LAYOUT_ARGS);
  const int32_t Pt = g->layout.num_ranks();
  if (rank < 0 || rank >= Pt) {
    plan_value_error("cp_group: rank " + std::to_string(rank) + " of a layout of " + std::to_string(Pt) + " ranks");
  }
  NcclId id;
  if (id_bytes.size() != id.bytes.size()) {
    plan_value_error("cp_group: the NCCL id has " + std::to_string(id_bytes.size()) + " bytes, expected " +
                     std::to_string(id.bytes.size()) + " (from dsacp.nccl_make_id)");
  }
  std::memcpy(id.bytes.data(), id_bytes.c_str(), id.bytes.size());
  if (window_bytes >= 0) g->layout.nccl_window_bytes = static_cast<size_t>(window_bytes);
  g->cr = rank;
  g->device_type = nb::device::cuda::value;
  g->device_id = device;
  Placement pl("cp_group");
  pl.device_type = g->device_type;
  pl.device_id = device;
  pl.torch = torch_current_stream(device).has_value();
  g->stream = call_stream(pl, stream);
  g->backend = &cuda_backend(device, g->stream);
  NcclOptions o;
  o.device = device;
  o.producer_stream = g->backend->native_stream();
  o.timeout = std::chrono::milliseconds(g->layout.comm_timeout_ms);
  o.window_bytes = g->layout.nccl_window_bytes;
  o.peer_exchange_bytes = g->layout.nccl_peer_exchange_bytes;
  Result<OwnedCpComms> comms = [&] {
    nb::gil_scoped_release release;
    return nccl_cp_comms(id, g->layout, rank, o);
  }();
  raise_if_error(comms.status());
  g->comms = std::move(comms).value();
  g->transport = "nccl";
  return g.release();
}

// One batch's plan on one CP rank.
struct PyCpPlan {
  CpStepPlan plan;
  PagedCacheConfig cache;  // the rank's pools' layout (index_page_factor: Pt under the replicated indexer)
  PyCpGroup* group = nullptr;
  nb::object group_ref, device_table;
};

PyCpPlan* make_cp_plan(nb::object group_obj, const std::vector<int32_t>& query_lens,
                       const std::vector<int32_t>& context_lens, nb::handle block_table, int64_t num_pages,
                       int32_t heads, float scale, int32_t topk, int32_t page_size, int32_t latent_dim,
                       int32_t rope_dim, int32_t index_heads, int32_t index_dim, const std::string& dtype,
                       const std::string& out_dtype, std::optional<std::string> cache_dtype,
                       std::optional<std::string> index_dtype, const std::string& latent_cache,
                       const std::string& index_scale_mode, const std::string& latent_scale_mode,
                       const std::string& topk_form, const std::string& lse_base, int32_t decode_threshold,
                       std::optional<nb::object> device_block_table) {
  PyCpGroup& g = *nb::cast<PyCpGroup*>(group_obj);
  const PlanBatch batch = plan_batch("cp_plan", query_lens, context_lens, block_table);
  const std::vector<Request>& requests = batch.requests;
  const BlockTable& table = batch.table;
  PlanArgs a{num_pages, heads, scale, topk, page_size, latent_dim, rope_dim, index_heads, index_dim, dtype,
             out_dtype, cache_dtype, index_dtype, latent_cache, index_scale_mode, latent_scale_mode, topk_form,
             lse_base, decode_threshold};
  StepConfig c;
  PagedCacheConfig cc;
  plan_configs("cp_plan", a, &c, &cc);
  raise_if_error(validate_layout(g.layout, c.H));
  auto p = std::make_unique<PyCpPlan>();
  p->group = &g;
  p->group_ref = group_obj;
  CpStepPlanOptions o;
  if (device_block_table && !device_block_table->is_none()) {
    if (g.device_type != nb::device::cuda::value) {
      plan_value_error("cp_plan: device_block_table is for a group on a CUDA device; a CPU rank reads block_table");
    }
    Placement pl("cp_plan");
    pl.device_type = g.device_type;
    pl.device_id = g.device_id;
    pl.first = "device";
    TensorArg dt = tensor_arg(pl, "device_block_table", *device_block_table, {Elem::kI32},
                              {{"num_requests", table.num_requests}, {"max_pages", table.max_pages}});
    o.device_block_table = static_cast<const int32_t*>(dt.data);
    p->device_table = *device_block_table;
  }
  const CpLayout& l = g.layout;
  const int32_t r = g.cr / l.D, d = g.cr % l.D;
  Result<CpStepPlan> made = [&]() -> Result<CpStepPlan> {
    nb::gil_scoped_release release;
    DSACP_ASSIGN_OR_RETURN(CpRankPlan rank_plan,
                           cp_rank_plan(requests, l, r, d, table, cc.page_size, c.decode_threshold, c.H));
    const KvSharding sharding = cp_kv_sharding(l, cc.page_size);
    return cp_step_plan(*g.backend, c, requests, rank_plan, l, sharding, table, cp_rank_cache_config(l, cc), o);
  }();
  raise_if_error(made.status());
  p->plan = std::move(made).value();
  p->cache = cp_rank_cache_config(l, cc);
  return p.release();
}

nb::tuple cp_run_layer(PyCpPlan& p, nb::handle latent, std::optional<nb::handle> rope, nb::handle index_keys,
                       nb::handle q_nope, nb::handle q_rope, nb::handle kv_latent, nb::handle k_rope,
                       std::optional<nb::handle> idx_q, std::optional<nb::handle> idx_w, std::optional<nb::handle> idx_k,
                       std::optional<nb::handle> idx_q_scale, std::optional<nb::handle> idx_k_scale,
                       std::optional<nb::handle> precomputed_topk, std::optional<nb::object> out,
                       std::optional<nb::object> lse, std::optional<nb::object> topk, std::optional<uintptr_t> stream) {
  Placement pl("cp_run_layer");
  PyCpGroup& g = *p.group;
  const StepConfig& c = p.plan.config();
  const CpRankPlan& rp = p.plan.rank_plan();
  StepInputs si = layer_inputs(pl, c, rp.num_rows, rp.num_heads,
                               LayerTensors{q_nope, q_rope, kv_latent, k_rope, idx_q, idx_w, idx_k, idx_q_scale,
                                            idx_k_scale, precomputed_topk},
                               g.device_type, g.device_id, g.where(), "the rank's rows");
  std::unique_ptr<PagedKvCache> cache = layer_caches(pl, p.cache, p.plan.pages_needed(), latent, rope, index_keys);
  const int64_t rows = rp.output_rows, H = rp.num_heads;
  OutArray o = out_array(pl, "out", out, c.out_dtype == DType::kBF16 ? Elem::kBF16 : Elem::kF32, {rows, H, c.Dl});
  OutArray l = out_array(pl, "lse", lse, Elem::kF32, {rows, H});
  OutArray k = out_array(pl, "topk", topk, Elem::kI32, {rows, c.K});
  StepOutputs so;
  so.out = o.data;
  so.lse = static_cast<float*>(l.data);
  so.topk = static_cast<int32_t*>(k.data);
  if (g.device_type == nb::device::cuda::value && call_stream(pl, stream) != g.stream) {
    plan_value_error("cp_run_layer: this call runs on stream " + std::to_string(call_stream(pl, stream)) +
                     ", the group was made on stream " + std::to_string(g.stream) + " of " + g.where() +
                     " (its NCCL communicators order themselves after that stream's work)");
  }
  Status s;
  {
    nb::gil_scoped_release release;
    s = cp_step_run(*g.backend, g.comms.view(), p.plan, *cache, si, so);
    if (!s.ok() && s.code() != StatusCode::kInvalidArgument && s.code() != StatusCode::kOutOfRange) {
      // A failure past the checks may leave peers inside a collective: the group fails, so none waits on.
      for (Communicator* comm : {g.comms.world.get(), g.comms.pcp.get(), g.comms.dcp.get()}) {
        comm->abort("CP rank " + std::to_string(g.cr) + ": " + s.message());
      }
    }
  }
  raise_if_error(s.with_context("CP rank " + std::to_string(g.cr)));
  return nb::make_tuple(o.object(), l.object(), k.object());
}

}  // namespace

void register_cp(nb::module_& m) {
  nb::class_<PyCpGroup>(m, "CpGroup", "A CP rank's group (dsacp.cp_group): its layout, rank and communicators.")
      .def_prop_ro("rank", [](const PyCpGroup& g) { return g.cr; }, "cr = r * D + d")
      .def_prop_ro("P", [](const PyCpGroup& g) { return g.layout.P; })
      .def_prop_ro("D", [](const PyCpGroup& g) { return g.layout.D; })
      .def_prop_ro("r", [](const PyCpGroup& g) { return g.cr / g.layout.D; })
      .def_prop_ro("d", [](const PyCpGroup& g) { return g.cr % g.layout.D; })
      .def_prop_ro("transport", [](const PyCpGroup& g) { return g.transport; }, "\"nccl\" or \"python collectives\"")
      .def_prop_ro("device", [](const PyCpGroup& g) { return g.where(); })
      .def_prop_ro("stream", [](const PyCpGroup& g) { return g.stream; })
      .def("comm_stats", [](const PyCpGroup& g) {
        const CommStats s = g.comms.world->stats();
        return nb::make_tuple(s.collectives, s.bytes);
      }, "(collectives, bytes sent) of the world communicator");
  m.def("_cp_group_collectives", &group_of_collectives, nb::arg("world"), nb::arg("pcp"), nb::arg("dcp"),
        nb::arg("rank"), nb::arg("P"), nb::arg("D"), nb::arg("interleave"), nb::arg("indexer"), nb::arg("dsa_cp"),
        nb::arg("decode_mode"), nb::arg("graph_bucket_tokens"), nb::arg("timeout_ms"), nb::arg("threads"),
        nb::rv_policy::take_ownership, "A CPU CP group over Python collectives objects (see dsacp.cp_group).");
  m.def("_cp_group_nccl", &group_of_nccl, nb::arg("nccl_id"), nb::arg("rank"), nb::arg("P"), nb::arg("D"),
        nb::arg("interleave"), nb::arg("indexer"), nb::arg("dsa_cp"), nb::arg("decode_mode"),
        nb::arg("graph_bucket_tokens"), nb::arg("timeout_ms"), nb::arg("device"), nb::arg("stream").none(),
        nb::arg("window_bytes"), nb::rv_policy::take_ownership,
        "A CUDA CP group over dsacp's NCCL communicators (collective over the ranks; see dsacp.cp_group).");
  m.def("nccl_make_id", &make_nccl_id, "A new ncclUniqueId (128 bytes) for the ranks of one NCCL group.");
  m.def("nccl_available", &nccl_available, "Whether this build has the NCCL communicator.");
  nb::class_<PyCpPlan>(m, "CpStepPlan", "A CP rank's plan of one batch (dsacp.cp_plan).")
      .def_prop_ro("num_rows", [](const PyCpPlan& p) { return p.plan.rank_plan().num_rows; },
                   "The rank's input rows (its tokens and padding rows)")
      .def_prop_ro("output_rows", [](const PyCpPlan& p) { return p.plan.rank_plan().output_rows; })
      .def_prop_ro("num_shared_rows", [](const PyCpPlan& p) { return p.plan.rank_plan().num_shared_rows; })
      .def_prop_ro("row_token", [](const PyCpPlan& p) { return p.plan.rank_plan().row_token; },
                   "The batch token of each input row (-1: a padding row)")
      .def_prop_ro("head_begin", [](const PyCpPlan& p) { return p.plan.rank_plan().head_begin; })
      .def_prop_ro("num_heads", [](const PyCpPlan& p) { return p.plan.rank_plan().num_heads; })
      .def_prop_ro("pages_needed", [](const PyCpPlan& p) { return p.plan.pages_needed(); })
      .def_prop_ro("index_page_factor", [](const PyCpPlan& p) { return p.cache.index_page_factor; })
      .def_prop_ro("topk", [](const PyCpPlan& p) { return p.plan.config().K; })
      .def_prop_ro("heads", [](const PyCpPlan& p) { return p.plan.config().H; })
      .def_prop_ro("latent_dim", [](const PyCpPlan& p) { return p.plan.config().Dl; })
      .def_prop_ro("rope_dim", [](const PyCpPlan& p) { return p.plan.config().Dr; })
      .def_prop_ro("out_dtype", [](const PyCpPlan& p) {
        return std::string(p.plan.config().out_dtype == DType::kBF16 ? "bf16" : "f32");
      })
      .def_prop_ro("run_scratch_bytes", [](const PyCpPlan& p) { return p.plan.run_scratch_bytes(); });
  m.def("cp_plan", &make_cp_plan, nb::arg("group"), nb::arg("query_lens"), nb::arg("context_lens"),
        nb::arg("block_table"), nb::kw_only(), nb::arg("num_pages"), nb::arg("heads"), nb::arg("scale"),
        nb::arg("topk") = kDeepSeekV32TopK, nb::arg("page_size") = 64, nb::arg("latent_dim") = 512,
        nb::arg("rope_dim") = 64, nb::arg("index_heads") = 64, nb::arg("index_dim") = 128, nb::arg("dtype") = "bf16",
        nb::arg("out_dtype") = "f32", nb::arg("cache_dtype") = nb::none(), nb::arg("index_dtype") = nb::none(),
        nb::arg("latent_cache") = "rows", nb::arg("index_scale_mode") = "fp32", nb::arg("latent_scale_mode") = "fp32",
        nb::arg("topk_form") = "canonical", nb::arg("lse_base") = "e", nb::arg("decode_threshold") = kMaxDecodeThreshold,
        nb::arg("device_block_table") = nb::none(), nb::rv_policy::take_ownership,
        "A CP rank's plan of one batch (see dsacp.cp_plan).");
  m.def("cp_run_layer", &cp_run_layer, nb::arg("plan"), nb::arg("latent"), nb::arg("rope").none(),
        nb::arg("index_keys"), nb::arg("q_nope"), nb::arg("q_rope"), nb::arg("kv_latent"), nb::arg("k_rope"),
        nb::arg("idx_q").none() = nb::none(), nb::arg("idx_w").none() = nb::none(),
        nb::arg("idx_k").none() = nb::none(), nb::kw_only(), nb::arg("idx_q_scale").none() = nb::none(),
        nb::arg("idx_k_scale").none() = nb::none(), nb::arg("precomputed_topk").none() = nb::none(),
        nb::arg("out") = nb::none(), nb::arg("lse") = nb::none(), nb::arg("topk") = nb::none(),
        nb::arg("stream") = nb::none(), "One layer's step on a CP rank (see dsacp.cp_run_layer).");
}

}  // namespace dsacp::py
