// The Python module dsacp._dsacp: the step's kernels as functions over DLPack tensors (numpy, torch, jax, cupy:
// zero-copy, nothing is converted or copied on the way in), the case files and replay. Argument errors become
// ValueError with the library's one-line message; device and communication failures RuntimeError.
//
// CPU tensors run on the CPU backend (one per thread count). CUDA tensors (every tensor of a call on one device)
// run on a CUDA backend made for that (device, stream) on first use and kept for the process, issuing its work on
// the caller's stream (`stream`: a cudaStream_t as an int; 0 = the legacy default stream). Those backends defer
// their device-found data errors (a bad page id, slot or index): a call only enqueues work and returns, and
// check_errors() waits for the work and raises the first such error (no host synchronization per call).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "dsacp/backend.h"
#include "dsacp/case_file.h"
#include "dsacp/replay.h"
#include "backends.h"
#include "tensor_args.h"

namespace nb = nanobind;
using namespace dsacp;
using namespace dsacp::py;

namespace {

nb::object indexer_topk(nb::handle q, nb::handle w, const nb::object& keys, nb::handle block_table, nb::handle request,
                        nb::handle key_len, int32_t K, std::optional<nb::handle> q_scale, std::optional<nb::object> out,
                        bool return_scores, std::optional<nb::object> scores_out, std::optional<nb::handle> host_request,
                        std::optional<nb::handle> host_key_len, std::optional<uintptr_t> stream, int threads,
                        int32_t keys_page_size) {
  Placement pl("indexer_topk");
  const char* op = pl.op;
  // uint8 q: e4m3 bytes (a float8_e4m3fn tensor viewed as uint8, as the package wrappers pass it).
  TensorArg tq = tensor_arg(pl, "q", q, {Elem::kF32, Elem::kBF16, Elem::kF8E4M3, Elem::kU8}, 3);
  if (tq.elem == Elem::kU8) tq.dtype = DType::kF8E4M3;
  const int64_t T = tq.shape[0], Hi = tq.shape[1], Di = tq.shape[2];
  TensorArg tw = tensor_arg(pl, "w", w, {Elem::kF32}, {{"T", T}, {"Hi", Hi}});
  PagedPoolView pool = paged_pool_arg(pl, "keys", keys, Di, false, keys_page_size);
  BlockTableView table = block_table_arg(pl, block_table);
  TensorArg treq = tensor_arg(pl, "request", request, {Elem::kI32}, {{"T", T}});
  TensorArg tlen = tensor_arg(pl, "key_len", key_len, {Elem::kI32}, {{"T", T}});
  if (K < 1) throw nb::value_error((std::string(op) + ": K=" + std::to_string(K) + ", expected K >= 1").c_str());
  IndexerTopkParams p;
  p.rows = {T, static_cast<const int32_t*>(treq.data), static_cast<const int32_t*>(tlen.data)};
  p.Hi = static_cast<int32_t>(Hi);
  p.Di = static_cast<int32_t>(Di);
  p.K = K;
  p.q = tq.data;
  p.q_dtype = tq.dtype;
  p.w = static_cast<const float*>(tw.data);
  p.keys = pool;
  p.block_table = table;
  if (q_scale) p.q_scale = static_cast<const float*>(tensor_arg(pl, "q_scale", *q_scale, {Elem::kF32}, {{"T", T}, {"Hi", Hi}}).data);
  if (host_request.has_value() != host_key_len.has_value()) {
    throw nb::value_error("indexer_topk: host_request and host_key_len go together (host copies of request and key_len)");
  }
  if (host_request) {
    p.host_request = static_cast<const int32_t*>(host_tensor_arg(op, "host_request", *host_request, {Elem::kI32}, {{"T", T}}).data);
    p.host_key_len = static_cast<const int32_t*>(host_tensor_arg(op, "host_key_len", *host_key_len, {Elem::kI32}, {{"T", T}}).data);
  }
  OutArray topk = out_array(pl, "out", out, Elem::kI32, {T, K});
  p.topk = static_cast<int32_t*>(topk.data);
  OutArray scores;
  if (return_scores || (scores_out && !scores_out->is_none())) {
    scores = out_array(pl, "scores", scores_out, Elem::kF32, {T, K});
    p.topk_scores = static_cast<float*>(scores.data);
  }
  Backend& be = op_backend(pl, threads, stream);
  run_kernel([&] { return indexer_topk_run(be, p); });
  if (p.topk_scores != nullptr) return nb::make_tuple(topk.object(), scores.object());
  return topk.object();
}

nb::tuple sparse_mla(nb::handle q_nope, nb::handle q_rope, const nb::object& latent, const nb::object& rope,
                     nb::handle block_table, nb::handle request, nb::handle key_len, nb::handle topk, float scale,
                     std::optional<nb::object> out, std::optional<nb::object> lse, std::optional<uintptr_t> stream,
                     int threads) {
  Placement pl("sparse_mla");
  const char* op = pl.op;
  TensorArg qn = tensor_arg(pl, "q_nope", q_nope, {Elem::kF32, Elem::kBF16}, 3);
  const int64_t T = qn.shape[0], H = qn.shape[1], Dl = qn.shape[2];
  TensorArg qr = tensor_arg(pl, "q_rope", q_rope, {qn.elem}, 3);
  check_dims(op, "q_rope", qr, {{"T", T}, {"H", H}, {"Dr", qr.shape[2]}});
  const int64_t Dr = qr.shape[2];
  int32_t record_dr = 0;
  PagedPoolView lat, rp;
  if (rope.is_none() && !is_u8_tensor(latent)) {
    // vLLM's bf16 KV cache: one [num_pages, page_size, kv_row] tensor, each row latent then rope.
    lat = kv_rows_arg(pl, "latent", latent, Dl, Dr, false, "rope is None (or fp8_ds_mla records, uint8)");
    rp = kv_rope_view(lat, static_cast<int32_t>(Dl), static_cast<int32_t>(Dr));
  } else if (lat = paged_pool_arg(pl, "latent", latent, Dl, false, 0, /*records_ok=*/rope.is_none(), &record_dr);
             lat.records()) {
    // fp8_ds_mla records: latent and rope of a token in one record; rope=None.
    if (record_dr != Dr) {
      throw nb::value_error((std::string(op) + ": fp8_ds_mla records of " + std::to_string(lat.record_bytes) +
                             " bytes hold a rope of " + std::to_string(record_dr) + " values, but q_rope has Dr=" +
                             std::to_string(Dr) + "; expected records of " +
                             std::to_string(fp8_ds_mla_record_bytes(static_cast<int32_t>(Dl), static_cast<int32_t>(Dr))) +
                             " bytes")
                                .c_str());
    }
    rp = record_rope_view(lat, static_cast<int32_t>(Dr));
  } else {
    if (rope.is_none()) {
      throw nb::value_error((std::string(op) + ": rope=None needs latent as fp8_ds_mla records (uint8 [num_pages, "
                             "page_size, Dl + 4 * Dl / 128 + 2 * Dr]); pass the rope pool for a bf16/f32 latent pool")
                                .c_str());
    }
    rp = paged_pool_arg(pl, "rope", rope, Dr);
    if (lat.num_pages != rp.num_pages || lat.page_size != rp.page_size) {
      throw nb::value_error((std::string(op) + ": latent has " + std::to_string(lat.num_pages) + " pages of " +
                             std::to_string(lat.page_size) + ", rope " + std::to_string(rp.num_pages) + " of " +
                             std::to_string(rp.page_size) + "; expected the same paging")
                                .c_str());
    }
  }
  BlockTableView table = block_table_arg(pl, block_table);
  TensorArg treq = tensor_arg(pl, "request", request, {Elem::kI32}, {{"T", T}});
  TensorArg tlen = tensor_arg(pl, "key_len", key_len, {Elem::kI32}, {{"T", T}});
  TensorArg tk = tensor_arg(pl, "topk", topk, {Elem::kI32}, 2);
  check_dims(op, "topk", tk, {{"T", T}, {"K", tk.shape[1]}});
  SparseMlaParams p;
  p.rows = {T, static_cast<const int32_t*>(treq.data), static_cast<const int32_t*>(tlen.data)};
  p.H = static_cast<int32_t>(H);
  p.Dl = static_cast<int32_t>(Dl);
  p.Dr = static_cast<int32_t>(Dr);
  p.K = static_cast<int32_t>(tk.shape[1]);
  p.scale = scale;
  p.q_nope = qn.data;
  p.q_rope = qr.data;
  p.q_dtype = qn.dtype;
  p.latent = lat;
  p.rope = rp;
  p.block_table = table;
  p.topk = static_cast<const int32_t*>(tk.data);
  OutArray o = out_array(pl, "out", out, Elem::kF32, {T, H, Dl}, {Elem::kF32, Elem::kBF16});
  OutArray l = out_array(pl, "lse", lse, Elem::kF32, {T, H});
  p.out = o.data;
  p.out_dtype = o.dtype;
  p.lse = static_cast<float*>(l.data);
  Backend& be = op_backend(pl, threads, stream);
  run_kernel([&] { return sparse_mla_run(be, p); });
  return nb::make_tuple(o.object(), l.object());
}

// lse_merge's parameters (and its outputs) from the Python arguments.
LseMergeParams lse_merge_params(Placement& pl, nb::handle part_out, nb::handle part_lse, const std::optional<nb::object>& out,
                                const std::optional<nb::object>& lse, OutArray& o, OutArray& l) {
  TensorArg po = tensor_arg(pl, "part_out", part_out, {Elem::kF32, Elem::kBF16}, 3);
  const int64_t S = po.shape[0], R = po.shape[1], Dl = po.shape[2];
  TensorArg tl = tensor_arg(pl, "part_lse", part_lse, {Elem::kF32}, {{"S", S}, {"rows", R}});
  LseMergeParams p;
  p.num_parts = static_cast<int32_t>(S);
  p.num_rows = R;
  p.Dl = static_cast<int32_t>(Dl);
  p.part_out = po.data;
  p.part_lse = static_cast<const float*>(tl.data);
  p.part_dtype = po.dtype;
  o = out_array(pl, "out", out, Elem::kF32, {R, Dl}, {Elem::kF32, Elem::kBF16});
  l = out_array(pl, "lse", lse, Elem::kF32, {R});
  p.out = o.data;
  p.out_dtype = o.dtype;
  p.lse = static_cast<float*>(l.data);
  return p;
}

nb::tuple lse_merge(nb::handle part_out, nb::handle part_lse, std::optional<nb::object> out,
                    std::optional<nb::object> lse, std::optional<uintptr_t> stream, int threads) {
  Placement pl("lse_merge");
  OutArray o, l;
  const LseMergeParams p = lse_merge_params(pl, part_out, part_lse, out, lse, o, l);
  Backend& be = op_backend(pl, threads, stream);
  run_kernel([&] { return lse_merge_run(be, p); });
  return nb::make_tuple(o.object(), l.object());
}

// Host seconds per call of `n` lse_merge calls made in C++ with the arguments converted once (each call still
// validates and launches): the C++ side of the measure "Python overhead of one op call over the C++ call".
// Ends with the backend's work done.
double bench_lse_merge(nb::handle part_out, nb::handle part_lse, nb::object out, nb::object lse,
                       std::optional<uintptr_t> stream, int n) {
  Placement pl("lse_merge");
  OutArray o, l;
  const LseMergeParams p = lse_merge_params(pl, part_out, part_lse, out, lse, o, l);
  Backend& be = op_backend(pl, 1, stream);
  Status s;
  double secs = 0;
  {
    nb::gil_scoped_release release;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n && s.ok(); ++i) s = lse_merge_run(be, p);
    secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s.ok()) s = be.synchronize();
  }
  raise_if_error(s);
  return n > 0 ? secs / n : 0.0;
}

Fp8ScaleMode scale_mode_arg(const char* op, const std::string& scale_mode) {
  if (scale_mode == "fp32") return Fp8ScaleMode::kFp32;
  if (scale_mode == "ue8m0") return Fp8ScaleMode::kUe8m0;
  throw nb::value_error((std::string(op) + ": scale_mode=\"" + scale_mode + "\", expected \"fp32\" or \"ue8m0\"").c_str());
}

void cache_write(nb::handle rows, nb::handle slots, const nb::object& pool, std::optional<nb::handle> rope_rows,
                 std::optional<nb::handle> row_scales, const std::string& scale_mode, std::optional<uintptr_t> stream,
                 int threads) {
  Placement pl("cache_write");
  const char* op = pl.op;
  TensorArg tr = tensor_arg(pl, "rows", rows, {Elem::kF32, Elem::kBF16, Elem::kF8E4M3, Elem::kU8}, 2);
  if (tr.elem == Elem::kU8) tr.dtype = DType::kF8E4M3;  // e4m3 bytes
  const int64_t T = tr.shape[0], dim = tr.shape[1];
  TensorArg ts = tensor_arg(pl, "slots", slots, {Elem::kI64}, {{"T", T}});
  CacheWriteParams p;
  p.rows = tr.data;
  p.rows_dtype = tr.dtype;
  p.num_rows = T;
  p.slots = static_cast<const int64_t*>(ts.data);
  int32_t record_dr = 0;
  const bool combined = rope_rows && !is_u8_tensor(pool);
  if (combined) {
    // vLLM's bf16 KV cache [num_pages, page_size, kv_row]: rows into each slot's first dim values, rope_rows
    // after them.
    TensorArg trr = tensor_arg(pl, "rope_rows", *rope_rows, {Elem::kF32, Elem::kBF16}, 2);
    check_dims(op, "rope_rows", trr, {{"T", T}, {"Dr", -1}});
    record_dr = static_cast<int32_t>(trr.shape[1]);
    p.pool = kv_rows_arg(pl, "pool", pool, dim, record_dr, /*writable=*/true, "rope_rows is given (or fp8_ds_mla records, uint8)");
    p.more[0].rows = trr.data;
    p.more[0].rows_dtype = trr.dtype;
    p.more[0].slots = p.slots;
    p.more[0].pool = kv_rope_view(p.pool, static_cast<int32_t>(dim), record_dr);
  } else {
    p.pool = paged_pool_arg(pl, "pool", pool, dim, /*writable=*/true, 0, /*records_ok=*/true, &record_dr);
  }
  p.fp8_scale_mode = p.record_scale_mode = scale_mode_arg(op, scale_mode);
  if (row_scales) {
    // [T] for FP8 pages; [T, dim / 128] (a scale per 128-value tile) for fp8_ds_mla records.
    TensorArg tsc = p.pool.records() ? tensor_arg(pl, "row_scales", *row_scales, {Elem::kF32}, {{"T", T}, {"dim / 128", dim / kFp8DsMlaTile}})
                                     : tensor_arg(pl, "row_scales", *row_scales, {Elem::kF32}, {{"T", T}});
    p.row_scales = static_cast<const float*>(tsc.data);
  }
  if (rope_rows && !combined) {
    if (!p.pool.records()) {
      throw nb::value_error((std::string(op) + ": rope_rows given but 'pool' is not an fp8_ds_mla record pool (uint8 "
                             "[num_pages, page_size, Dl + 4 * Dl / 128 + 2 * Dr]); write a rope pool with its own call")
                                .c_str());
    }
    TensorArg trr = tensor_arg(pl, "rope_rows", *rope_rows, {Elem::kF32, Elem::kBF16}, {{"T", T}, {"Dr", record_dr}});
    p.more[0].rows = trr.data;
    p.more[0].rows_dtype = trr.dtype;
    p.more[0].slots = p.slots;
    p.more[0].pool = record_rope_view(p.pool, record_dr);
  }
  Backend& be = op_backend(pl, threads, stream);
  run_kernel([&] { return cache_write_run(be, p); });
}

// The result of a step as numpy arrays (f32 `out` whatever the stored dtype: every bf16 value is exact in f32).
nb::dict result_dict(StepResult r) {
  nb::dict d;
  d["topk_indices"] = tensor_to_numpy(std::move(r.topk_indices));
  if (r.out.dtype() == DType::kBF16) {
    Result<Tensor> f = r.out.to_dtype(DType::kF32);
    raise_if_error(f.status());
    r.out = std::move(f).value();
  }
  d["out"] = tensor_to_numpy(std::move(r.out));
  d["lse"] = tensor_to_numpy(std::move(r.lse));
  return d;
}

nb::dict replay(const std::string& case_path, std::optional<std::string> out_path, int32_t page_size,
                const std::string& out_dtype, int32_t pcp, int32_t dcp, int32_t interleave, const std::string& indexer,
                bool dsa_cp, int threads) {
  const char* op = "replay";
  ReplayOptions o;
  if (page_size < 1) throw nb::value_error(("replay: page_size=" + std::to_string(page_size) + ", expected >= 1").c_str());
  o.page_size = page_size;
  if (out_dtype == "f32") {
    o.out_dtype = DType::kF32;
  } else if (out_dtype == "bf16") {
    o.out_dtype = DType::kBF16;
  } else {
    throw nb::value_error(("replay: out_dtype=\"" + out_dtype + "\", expected \"f32\" or \"bf16\"").c_str());
  }
  if (pcp < 1 || dcp < 1 || int64_t{pcp} * dcp > 1024) {
    throw nb::value_error(("replay: pcp=" + std::to_string(pcp) + ", dcp=" + std::to_string(dcp) +
                           ", expected pcp >= 1, dcp >= 1 and pcp * dcp <= 1024")
                              .c_str());
  }
  if (interleave < 0) throw nb::value_error(("replay: interleave=" + std::to_string(interleave) + ", expected >= 0 (0 = the page size)").c_str());
  o.layout.P = pcp;
  o.layout.D = dcp;
  o.layout.interleave = interleave;
  if (indexer == "sharded") {
    o.layout.indexer = IndexerMode::kSharded;
  } else if (indexer == "replicated") {
    o.layout.indexer = IndexerMode::kReplicated;
  } else {
    throw nb::value_error(("replay: indexer=\"" + indexer + "\", expected \"sharded\" or \"replicated\"").c_str());
  }
  o.layout.dsa_cp = dsa_cp;
  (void)op;
  Backend& be = cpu_backend(threads);
  Result<StepResult> r = [&]() -> Result<StepResult> {
    nb::gil_scoped_release release;
    DSACP_ASSIGN_OR_RETURN(CaseFile c, case_read(case_path));
    DSACP_ASSIGN_OR_RETURN(StepResult res, replay_case(be, c, o));
    if (out_path) DSACP_RETURN_IF_ERROR(result_write(*out_path, res));
    return res;
  }();
  raise_if_error(r.status());
  return result_dict(std::move(r).value());
}

void make_case(const std::string& path, const std::vector<int32_t>& query_lens, const std::vector<int32_t>& context_lens,
               int32_t heads, int32_t latent_dim, int32_t rope_dim, int32_t index_heads, int32_t index_dim,
               int32_t topk, float scale, const std::string& dtype, uint64_t seed) {
  if (query_lens.size() != context_lens.size()) {
    throw nb::value_error(("make_case: " + std::to_string(query_lens.size()) + " query_lens but " +
                           std::to_string(context_lens.size()) + " context_lens; expected one of each per request")
                              .c_str());
  }
  CaseGenSpec spec;
  for (size_t i = 0; i < query_lens.size(); ++i) spec.requests.push_back({query_lens[i], context_lens[i]});
  spec.dims = {heads, latent_dim, rope_dim, index_heads, index_dim};
  spec.topk = topk;
  spec.scale = scale;
  if (dtype == "f32") {
    spec.dtype = DType::kF32;
  } else if (dtype == "bf16") {
    spec.dtype = DType::kBF16;
  } else {
    throw nb::value_error(("make_case: dtype=\"" + dtype + "\", expected \"f32\" or \"bf16\"").c_str());
  }
  spec.seed = seed;
  Status s;
  {
    nb::gil_scoped_release release;
    Result<CaseFile> c = case_generate(spec);
    s = c.ok() ? case_write(path, c.value()) : c.status();
  }
  raise_if_error(s);
}

}  // namespace

NB_MODULE(_dsacp, m) {
  m.doc() = "dsacp: DeepSeek Sparse Attention with context parallelism (the C++ library's kernels and replay)";
  const char* cuda_note = R"(

Tensors: all on the CPU (numpy, torch, ...) or all on one CUDA device (torch, cupy, jax: used in place). CUDA
calls run on the stream `stream` (a cudaStream_t as an int; None: torch's current stream for torch tensors, else
the legacy default stream, as 0 is), write into the caller's outputs (out=, lse=, scores=: the package
wrappers allocate them on the inputs' device when not given) and return without waiting for the GPU: a data error
the device finds (a bad page id, slot or index) is raised by the next check_errors(). Argument errors (shape,
dtype, device, contiguity) raise ValueError at the call. Cache pools may have padded pages (a dim-0 stride wider
than a page, a multiple of 16 bytes: an engine's pages padded to one size); every other tensor is contiguous.)";
  m.def("indexer_topk", &indexer_topk, nb::arg("q"), nb::arg("w"), nb::arg("keys"), nb::arg("block_table"),
        nb::arg("request"), nb::arg("key_len"), nb::arg("K"), nb::kw_only(), nb::arg("q_scale") = nb::none(),
        nb::arg("out") = nb::none(), nb::arg("return_scores") = false, nb::arg("scores") = nb::none(),
        nb::arg("host_request") = nb::none(), nb::arg("host_key_len") = nb::none(), nb::arg("stream") = nb::none(),
        nb::arg("threads") = 0, nb::arg("keys_page_size") = 0,
        (std::string(R"(Lightning indexer scores and the exact canonical top-k.

s(t, j) = sum_h w[t, h] * relu(q[t, h, :] . k[j, :]) over the keys j < key_len[t] of request request[t]; the K
highest, ties to the lower position, ascending, -1 padded (NaN lowest). FP8: q float8_e4m3fn with q_scale [T, Hi],
keys as uint8 two-plane pages.

q [T, Hi, Di] f32/bf16/float8_e4m3fn; w [T, Hi] f32; keys [num_pages, page_size, Di] f32/bf16, or uint8
[num_pages, page_size, Di + 4] / [num_pages, page_size * (Di + 4)] (FP8 pages; keys_page_size names the page size
of the 2-D form when it is ambiguous); block_table [R, max_pages] int32; request, key_len [T] int32.
Returns topk [T, K] int32 (into out= when given), and the chosen scores [T, K] f32 with return_scores=True (or
into scores=). host_request / host_key_len: CPU int32 [T] copies of request / key_len, from which a CUDA call plans
its launch; without them it reads the two rows back (a host wait behind the stream's work, not allowed inside a
CUDA graph capture; a captured call replays the plan of the lengths it was captured with).)") + cuda_note).c_str());
  m.def("sparse_mla", &sparse_mla, nb::arg("q_nope"), nb::arg("q_rope"), nb::arg("latent"), nb::arg("rope").none(),
        nb::arg("block_table"), nb::arg("request"), nb::arg("key_len"), nb::arg("topk"), nb::arg("scale"),
        nb::kw_only(), nb::arg("out") = nb::none(), nb::arg("lse") = nb::none(), nb::arg("stream") = nb::none(),
        nb::arg("threads") = 0,
        (std::string(R"(Sparse MLA attention over the chosen keys, with natural-log LSE.

l(h, j) = scale * (q_nope[t, h] . latent[j] + q_rope[t, h] . rope[j]) for the entries j of topk[t] that are in
[0, key_len[t]) (front-packed, -1 padded); out = softmax(l) @ latent, lse = ln sum exp l; a row with no key
gives out = 0, lse = -inf. q_nope [T, H, Dl], q_rope [T, H, Dr] (f32 or bf16, one dtype); latent [num_pages,
page_size, Dl], rope [num_pages, page_size, Dr]; or latent the fp8_ds_mla record cache as vLLM holds it (uint8
[num_pages, page_size, Dl + 4 * Dl / 128 + 2 * Dr]: 656 bytes a token for Dl 512, Dr 64) and rope None;
block_table, request, key_len as indexer_topk; topk [T, K] int32. Returns (out [T, H, Dl], lse [T, H]); out= may
be f32 or bf16.)") + cuda_note).c_str());
  m.def("lse_merge", &lse_merge, nb::arg("part_out"), nb::arg("part_lse"), nb::kw_only(), nb::arg("out") = nb::none(),
        nb::arg("lse") = nb::none(), nb::arg("stream") = nb::none(), nb::arg("threads") = 0,
        (std::string(R"(Exact merge of S partial attention results over disjoint key sets by their LSE.

part_out [S, rows, Dl] f32/bf16, part_lse [S, rows] f32 -> (out [rows, Dl], lse [rows]); a part whose lse is
not finite counts as empty; all empty -> out 0, lse -inf.)") + cuda_note).c_str());
  m.def("cache_write", &cache_write, nb::arg("rows"), nb::arg("slots"), nb::arg("pool"), nb::kw_only(),
        nb::arg("rope_rows") = nb::none(), nb::arg("row_scales") = nb::none(), nb::arg("scale_mode") = "fp32",
        nb::arg("stream") = nb::none(), nb::arg("threads") = 0,
        (std::string(R"(Scatters rows into flat slots of a paged pool, in place: pool[slot // page_size, slot % page_size] = rows[t].

rows [T, dim] f32/bf16 (or float8_e4m3fn with row_scales [T]); slots [T] int64 (-1 skips a row); pool
[num_pages, page_size, dim] f32/bf16, or uint8 FP8 pages (rows are quantized with scale_mode "fp32" or
"ue8m0"), or uint8 fp8_ds_mla records [num_pages, page_size, dim + 4 * dim / 128 + 2 * Dr] (the latent rows
quantized per 128-value tile, or float8_e4m3fn rows with row_scales [T, dim / 128]; rope_rows [T, Dr] f32/bf16
stored as bf16 in the same records); or, with rope_rows, vLLM's bf16 KV cache [num_pages, page_size, kv_row >= dim +
Dr] (f32/bf16: each slot's row gets rows[t], then rope_rows[t]; the values past dim + Dr are left as they are).)") + cuda_note).c_str());
  m.def("_bench_lse_merge", &bench_lse_merge, nb::arg("part_out"), nb::arg("part_lse"), nb::arg("out"), nb::arg("lse"),
        nb::arg("stream").none(), nb::arg("n"),
        "Host seconds per lse_merge call made n times from C++ with the arguments converted once (benchmarks).");
  m.def("_torch_dlpack_exchange", &torch_dlpack_exchange,
        "Whether torch tensors are read through DLPack's C exchange table (tests, benchmarks).");
  register_plan(m);
  register_cp(m);
  m.def("check_errors", &check_errors,
        R"(Waits for the CUDA work of every op so far and raises the first data error a kernel found since the last
check (ValueError naming the kernel and the row). Does nothing when no op ran on CUDA tensors.)");
  m.def("replay", &replay, nb::arg("case_path"), nb::arg("out_path") = nb::none(), nb::kw_only(),
        nb::arg("page_size") = 64, nb::arg("out_dtype") = "f32", nb::arg("pcp") = 1, nb::arg("dcp") = 1,
        nb::arg("interleave") = 0, nb::arg("indexer") = "sharded", nb::arg("dsa_cp") = false, nb::arg("threads") = 0,
        R"(Runs the batch step stored in a case file (the contract's section 4) in a context-parallel layout on the CPU
backend; writes the result file when out_path is given. Returns {"topk_indices", "out" (f32), "lse"} as numpy
arrays, the same whatever the layout.)");
  m.def("make_case", &make_case, nb::arg("path"), nb::arg("query_lens"), nb::arg("context_lens"), nb::kw_only(),
        nb::arg("heads") = 4, nb::arg("latent_dim") = 32, nb::arg("rope_dim") = 16, nb::arg("index_heads") = 4,
        nb::arg("index_dim") = 32, nb::arg("topk") = 64, nb::arg("scale") = 0.125f, nb::arg("dtype") = "f32",
        nb::arg("seed") = 1,
        R"(Writes a random case file (counter-based values: the same seed gives the same file).)");
}
