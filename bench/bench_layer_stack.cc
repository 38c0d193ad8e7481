// A forward pass's DSA layers on one GPU through the public API: one step plan, then `layers` planned decode runs
// (dsacp/step_plan.h) eagerly, against the same runs captured once into a CUDA graph and replayed. Times the whole
// pass (CUDA events on the backend's stream, median of reps), the host time of the eager launches per layer, and
// checks that the replay's outputs equal the eager ones bit for bit. KV caches are random bf16 (a device block of
// random values tiled over each pool); `distinct_caches` caches are allocated and layer l uses cache
// l % distinct_caches when 61 full caches do not fit (each layer's reads come from HBM either way: a layer reads
// hundreds of MB, the L2 holds 50).
#include "bench_layer_stack.h"
#include "launch_floor.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "dsacp/paged_cache.h"
#include "dsacp/random.h"
#include "dsacp/step.h"
#include "dsacp/step_plan.h"

namespace dsacp::bench {
namespace {

template <typename T>
T must(Result<T> r, const char* what) {
  if (!r.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, r.status().to_string().c_str());
    std::exit(2);
  }
  return std::move(r).value();
}

void must(const Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.to_string().c_str());
    std::exit(2);
  }
}

// `bytes` of device memory filled by tiling `block` (random bf16 already on the device).
void tile(Backend& be, void* dst, size_t bytes, const DeviceBuffer& block) {
  for (size_t off = 0; off < bytes; off += block.bytes()) {
    must(be.copy_on_device(static_cast<char*>(dst) + off, block.get(), std::min(block.bytes(), bytes - off)), "tile");
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

LayerStackTiming bench_layer_stack(int32_t b, int32_t ctx, int layers, int distinct_caches, int reps, bool call_trace) {
  CudaBackendOptions options;
  options.call_trace = call_trace;
  std::unique_ptr<Backend> be = must(make_cuda_backend(0, options), "make_cuda_backend");
  const StepConfig c = step_config_of(kDeepSeekV32Dims, kDeepSeekV32TopK, 0.0723f, DType::kBF16, DType::kBF16);
  const int32_t page = 64, pages = (ctx + page - 1) / page;
  const std::vector<Request> req(static_cast<size_t>(b), Request{1, ctx - 1});
  BlockTable table;
  table.num_requests = b;
  table.max_pages = pages;
  for (int32_t r = 0; r < b; ++r)
    for (int32_t p = 0; p < pages; ++p) table.data.push_back(p * b + r);
  const PagedCacheConfig cc{int64_t{b} * pages, page, c.Dl, c.Dr, c.Di, DType::kBF16};

  std::vector<uint16_t> host(size_t{16} << 20);  // 32 MiB of random bf16
  for (size_t i = 0; i < host.size(); ++i) {
    const float f = counter_uniform(7, 0, i);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    host[i] = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  DeviceBuffer block = must(be->allocate(host.size() * 2), "block");
  must(be->copy_to_device(block.get(), host.data(), host.size() * 2), "block upload");
  std::vector<PagedKvCache> caches;
  for (int i = 0; i < distinct_caches; ++i) {
    caches.push_back(must(PagedKvCache::create(*be, cc, false), "cache"));
    const PagedKvCache& k = caches.back();
    tile(*be, k.latent().data, static_cast<size_t>(cc.num_pages) * page * c.Dl * 2, block);
    tile(*be, k.rope().data, static_cast<size_t>(cc.num_pages) * page * c.Dr * 2, block);
    tile(*be, k.index_keys().data, static_cast<size_t>(cc.num_pages) * page * c.Di * 2, block);
  }
  struct Io {
    DeviceBuffer q_nope, q_rope, kv, kr, iq, iw, ik, topk[2], out[2], lse[2];
  };
  std::vector<Io> io(static_cast<size_t>(layers));
  const size_t T = static_cast<size_t>(b);
  std::vector<float> w(T * c.Hi, 0.75f);
  for (Io& x : io) {
    const std::pair<DeviceBuffer*, size_t> bufs[] = {{&x.q_nope, T * c.H * c.Dl}, {&x.q_rope, T * c.H * c.Dr},
                                                     {&x.kv, T * c.Dl},           {&x.kr, T * c.Dr},
                                                     {&x.iq, T * c.Hi * c.Di},    {&x.ik, T * c.Di}};
    for (auto [buf, n] : bufs) {
      *buf = must(be->allocate(n * 2), "input");
      tile(*be, buf->get(), n * 2, block);
    }
    x.iw = must(be->allocate(w.size() * 4), "idx_w");
    must(be->copy_to_device(x.iw.get(), w.data(), w.size() * 4), "idx_w upload");
    for (int k = 0; k < 2; ++k) {
      x.topk[k] = must(be->allocate(T * c.K * 4), "topk");
      x.out[k] = must(be->allocate(T * c.H * c.Dl * 2), "out");
      x.lse[k] = must(be->allocate(T * c.H * 4), "lse");
    }
  }
  auto inputs = [&](int l) {
    const Io& x = io[l];
    return StepInputs{x.q_nope.get(), x.q_rope.get(), x.kv.get(), x.kr.get(), x.iq.get(), x.iw.as<const float>(),
                      x.ik.get()};
  };
  auto outputs = [&](int l, int k) {
    return StepOutputs{io[l].topk[k].as<int32_t>(), io[l].out[k].get(), io[l].lse[k].as<float>()};
  };
  must(be->synchronize(), "setup");

  LayerStackTiming t;
  const auto p0 = std::chrono::steady_clock::now();
  StepPlan plan = must(step_plan(*be, c, req, table, cc), "step_plan");
  t.plan_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - p0).count();
  auto pass = [&](int k) {
    for (int l = 0; l < layers; ++l) must(step_run(*be, plan, caches[l % distinct_caches], inputs(l), outputs(l, k)), "run");
  };
  pass(0);  // warm-up (module loads, first launches)
  must(be->synchronize(), "warm-up");
  cudaStream_t stream = static_cast<cudaStream_t>(be->native_stream());
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<double> eager_ms, graph_ms, host_us;
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(e0, stream);
    const auto h0 = std::chrono::steady_clock::now();
    pass(0);
    host_us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - h0).count() / layers);
    cudaEventRecord(e1, stream);
    must(be->synchronize(), "eager pass");
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    eager_ms.push_back(ms);
  }
  must(be->begin_capture(), "begin_capture");
  pass(1);
  CapturedWork graph = must(be->end_capture(), "end_capture");
  must(be->replay(graph), "replay (warm-up)");
  must(be->synchronize(), "replay warm-up");
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(e0, stream);
    must(be->replay(graph), "replay");
    cudaEventRecord(e1, stream);
    must(be->synchronize(), "replay");
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    graph_ms.push_back(ms);
  }
  t.identical = true;
  for (int l = 0; l < layers && t.identical; ++l) {
    for (const DeviceBuffer* pair : {io[l].topk, io[l].out, io[l].lse}) {
      std::vector<char> a(pair[0].bytes()), g(pair[1].bytes());
      must(be->copy_to_host(a.data(), pair[0].get(), a.size()), "download");
      must(be->copy_to_host(g.data(), pair[1].get(), g.size()), "download");
      t.identical = t.identical && a == g;
    }
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  t.eager_ms = median(eager_ms);
  t.graph_ms = median(graph_ms);
  t.host_us_per_layer = median(host_us);
  t.empty_launch_us = empty_launch_host_us(stream);
  return t;
}

}  // namespace dsacp::bench
