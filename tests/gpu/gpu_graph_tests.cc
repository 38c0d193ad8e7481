// The planned step on one GPU (dsacp/step_plan.h) captured into a CUDA graph: 61 decode layers (61 caches, b = 8,
// 4K context, DeepSeek-V3.2 dims) planned once, run eagerly, captured as one graph and replayed 100 times: the
// replay's outputs equal the eager ones bit for bit; a bad block-table page planted after capture is reported by
// the next synchronize(), naming the kernel and the token; a call that is not a launch refuses to be captured.
// Also: planned runs equal step_run (the CPU-checked path) on the GPU; with 2 GPUs, a CP rank's layers captured
// over NCCL (gpu_cp_graph_checks.cc). Own binary, label gpu; exit 77 without a GPU.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "dsacp/backend.h"
#include "dsacp/paged_cache.h"
#include "dsacp/random.h"
#include "dsacp/step.h"
#include "dsacp/step_plan.h"
#include "gpu/check_log.h"
#include "gpu/gpu_cp_graph_checks.h"

namespace dsacp::testing {
namespace {

CheckLog g_log;
void report(bool ok, const std::string& name, const std::string& detail = "") { g_log.report(ok, name, detail); }

uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

std::vector<uint16_t> bf16_values(uint64_t seed, uint64_t stream, size_t n, float amp) {
  std::vector<uint16_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = bf16_bits(amp * counter_uniform(seed, stream, i));
  return v;
}

template <typename T>
Result<DeviceBuffer> upload(Backend& be, const std::vector<T>& v) {
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer b, be.allocate(std::max<size_t>(v.size() * sizeof(T), 4)));
  DSACP_RETURN_IF_ERROR(be.copy_to_device(b.get(), v.data(), v.size() * sizeof(T)));
  return b;
}

// One layer: its cache, its inputs and two sets of outputs (eager, graph).
struct Layer {
  PagedKvCache cache;
  DeviceBuffer q_nope, q_rope, kv, kr, iq, iw, ik;
  DeviceBuffer topk[2], out[2], lse[2];
  StepInputs in() const {
    return {q_nope.get(), q_rope.get(), kv.get(), kr.get(), iq.get(), iw.as<const float>(), ik.get()};
  }
  StepOutputs outs(int which) const { return {topk[which].as<int32_t>(), out[which].get(), lse[which].as<float>()}; }
};

struct Stack {
  StepConfig config;
  std::vector<Request> requests;
  BlockTable table;
  PagedCacheConfig cc;
  DeviceBuffer device_table;
  std::vector<Layer> layers;
  int64_t T = 0;
};

Result<Stack> make_stack(Backend& be, int num_layers, int32_t b, int32_t ctx) {
  Stack s;
  s.config = step_config_of(kDeepSeekV32Dims, kDeepSeekV32TopK, 0.0723f, DType::kBF16, DType::kBF16);
  const StepConfig& c = s.config;
  const int32_t page = 64;
  s.requests.assign(static_cast<size_t>(b), Request{1, ctx - 1});
  const int32_t pages = (ctx + page - 1) / page;
  s.table.num_requests = b;
  s.table.max_pages = pages;
  // Request r owns pages r, r + b, r + 2b, ...: interleaved, so paging mistakes show.
  for (int32_t r = 0; r < b; ++r)
    for (int32_t p = 0; p < pages; ++p) s.table.data.push_back(p * b + r);
  s.cc = PagedCacheConfig{int64_t{b} * pages + 8, page, c.Dl, c.Dr, c.Di, DType::kBF16};
  DSACP_ASSIGN_OR_RETURN(s.device_table, upload(be, s.table.data));
  s.T = b;
  // Four pool images (layer l takes image l % 4), inputs of every layer its own.
  const size_t slots = static_cast<size_t>(s.cc.num_pages) * page;
  std::vector<std::vector<uint16_t>> lat, rope, keys;
  for (int i = 0; i < 4; ++i) {
    lat.push_back(bf16_values(100 + i, 1, slots * c.Dl, 1.f));
    rope.push_back(bf16_values(100 + i, 2, slots * c.Dr, 1.f));
    keys.push_back(bf16_values(100 + i, 3, slots * c.Di, 1.f));
  }
  for (int l = 0; l < num_layers; ++l) {
    Layer L;
    DSACP_ASSIGN_OR_RETURN(L.cache, PagedKvCache::create(be, s.cc, false));
    DSACP_RETURN_IF_ERROR(be.copy_to_device(L.cache.latent().data, lat[l % 4].data(), lat[l % 4].size() * 2));
    DSACP_RETURN_IF_ERROR(be.copy_to_device(L.cache.rope().data, rope[l % 4].data(), rope[l % 4].size() * 2));
    DSACP_RETURN_IF_ERROR(be.copy_to_device(L.cache.index_keys().data, keys[l % 4].data(), keys[l % 4].size() * 2));
    const uint64_t seed = 1000 + l;
    const size_t T = static_cast<size_t>(s.T);
    DSACP_ASSIGN_OR_RETURN(L.q_nope, upload(be, bf16_values(seed, 1, T * c.H * c.Dl, 1.f)));
    DSACP_ASSIGN_OR_RETURN(L.q_rope, upload(be, bf16_values(seed, 2, T * c.H * c.Dr, 1.f)));
    DSACP_ASSIGN_OR_RETURN(L.kv, upload(be, bf16_values(seed, 3, T * c.Dl, 1.f)));
    DSACP_ASSIGN_OR_RETURN(L.kr, upload(be, bf16_values(seed, 4, T * c.Dr, 1.f)));
    DSACP_ASSIGN_OR_RETURN(L.iq, upload(be, bf16_values(seed, 5, T * c.Hi * c.Di, 1.f)));
    std::vector<float> w(T * c.Hi);
    for (size_t i = 0; i < w.size(); ++i) w[i] = 0.5f + 0.5f * counter_uniform(seed, 6, i);
    DSACP_ASSIGN_OR_RETURN(L.iw, upload(be, w));
    DSACP_ASSIGN_OR_RETURN(L.ik, upload(be, bf16_values(seed, 7, T * c.Di, 1.f)));
    for (int k = 0; k < 2; ++k) {
      DSACP_ASSIGN_OR_RETURN(L.topk[k], be.allocate(T * c.K * 4));
      DSACP_ASSIGN_OR_RETURN(L.out[k], be.allocate(T * c.H * c.Dl * 2));
      DSACP_ASSIGN_OR_RETURN(L.lse[k], be.allocate(T * c.H * 4));
    }
    s.layers.push_back(std::move(L));
  }
  DSACP_RETURN_IF_ERROR(be.synchronize());
  return s;
}

// Host copies of a layer's outputs set `which`, as bytes.
std::vector<char> download(Backend& be, const Stack& s, int which) {
  std::vector<char> all;
  for (const Layer& L : s.layers) {
    for (const DeviceBuffer* b : {&L.topk[which], &L.out[which], &L.lse[which]}) {
      std::vector<char> h(b->bytes());
      if (!be.copy_to_host(h.data(), b->get(), h.size()).ok()) return {};
      all.insert(all.end(), h.begin(), h.end());
    }
  }
  return all;
}

Status poison(Backend& be, const Stack& s, int which) {
  for (const Layer& L : s.layers) {
    DSACP_RETURN_IF_ERROR(be.fill(L.out[which].get(), DType::kBF16, static_cast<int64_t>(L.out[which].bytes() / 2), NAN));
    DSACP_RETURN_IF_ERROR(be.fill(L.lse[which].get(), DType::kF32, static_cast<int64_t>(L.lse[which].bytes() / 4), NAN));
    DSACP_RETURN_IF_ERROR(be.fill(L.topk[which].get(), DType::kF32, static_cast<int64_t>(L.topk[which].bytes() / 4), NAN));
  }
  return be.synchronize();
}

void test_graph(Backend& be) {
  auto made = make_stack(be, 61, 8, 4096);
  if (!made.ok()) {
    report(false, "61-layer stack (b=8, 4K)", made.status().to_string());
    return;
  }
  Stack& s = *made;
  StepPlanOptions po;
  po.device_block_table = s.device_table.as<const int32_t>();
  auto plan = step_plan(be, s.config, s.requests, s.table, s.cc, po);
  if (!plan.ok()) {
    report(false, "step_plan", plan.status().to_string());
    return;
  }
  // Eager: 61 planned runs, one synchronize.
  Status st;
  for (Layer& L : s.layers) {
    if (st.ok()) st = step_run(be, *plan, L.cache, L.in(), L.outs(0));
  }
  if (st.ok()) st = be.synchronize();
  report(st.ok(), "61 planned layers eagerly (b=8 decode, 4K context, H=128 K=2048 bf16)", st.to_string());
  if (!st.ok()) return;
  const std::vector<char> eager = download(be, s, 0);

  // Planned run equals step_run (the CPU-checked single-device path) on layer 0.
  {
    Layer& L = s.layers[0];
    Status a = poison(be, s, 1);
    if (a.ok()) a = step_run(be, s.config, s.requests, s.table, L.cache, L.in(), L.outs(1));
    std::vector<char> got, want;
    for (int which : {0, 1}) {
      for (const DeviceBuffer* b : {&L.topk[which], &L.out[which], &L.lse[which]}) {
        std::vector<char> h(b->bytes());
        if (a.ok()) a = be.copy_to_host(h.data(), b->get(), h.size());
        (which == 0 ? want : got).insert((which == 0 ? want : got).end(), h.begin(), h.end());
      }
    }
    report(a.ok() && got == want, "planned run == step_run on the GPU (layer 0, bit for bit)", a.to_string());
  }

  // A call that is not a launch cannot be captured; the backend stays usable.
  {
    Status b = be.begin_capture();
    auto alloc = be.allocate(64);
    auto bad = be.end_capture();
    const bool refused = b.ok() && !alloc.ok() && alloc.status().message().find("while capturing") != std::string::npos &&
                         !bad.ok();
    Status after = step_run(be, *plan, s.layers[0].cache, s.layers[0].in(), s.layers[0].outs(0));
    if (after.ok()) after = be.synchronize();
    report(refused && after.ok(), "an allocation inside a capture is refused, the capture dropped, the backend usable",
           (alloc.ok() ? std::string("allocation accepted") : alloc.status().to_string()) + " / " + after.to_string());
  }

  // Capture the 61 planned runs into one graph, replay it 100 times.
  if (!poison(be, s, 1).ok()) return;
  st = be.begin_capture();
  for (Layer& L : s.layers) {
    if (st.ok()) st = step_run(be, *plan, L.cache, L.in(), L.outs(1));
  }
  auto graph = be.end_capture();
  if (st.ok() && !graph.ok()) st = graph.status();
  report(st.ok(), "61 planned layers captured into one graph", st.to_string());
  if (!st.ok()) return;
  const std::vector<char> before = download(be, s, 1);
  // Capture records, it does not run: the poisoned outputs are still NaN.
  report(before != eager, "capture ran nothing (outputs still poisoned)");
  for (int i = 0; i < 100 && st.ok(); ++i) st = be.replay(*graph);
  if (st.ok()) st = be.synchronize();
  const std::vector<char> replayed = download(be, s, 1);
  report(st.ok() && !eager.empty() && replayed == eager, "100 graph replays == eager, bit for bit (topk, out, lse of 61 layers)",
         st.to_string());

  // A bad page planted in the block table the graph reads: the next synchronize names the kernel and the token.
  {
    std::vector<int32_t> bad = s.table.data;
    bad[3 * s.table.max_pages + 10] = 1 << 28;  // request 3's 11th page, a context page
    Status e = be.copy_to_device(s.device_table.get(), bad.data(), bad.size() * 4);
    if (e.ok()) e = be.replay(*graph);
    Status found = e.ok() ? be.synchronize() : e;
    const std::string m = found.message();
    const bool named = found.code() == StatusCode::kOutOfRange && m.find("indexer_topk") != std::string::npos &&
                       m.find("token 3") != std::string::npos;
    report(named, "a bad block-table page during a replay: reported by the next synchronize, naming kernel and token",
           found.to_string());
    Status fixed = be.copy_to_device(s.device_table.get(), s.table.data.data(), s.table.data.size() * 4);
    if (fixed.ok()) fixed = be.replay(*graph);
    if (fixed.ok()) fixed = be.synchronize();
    report(fixed.ok() && download(be, s, 1) == eager, "the table restored: the next replay is clean and equal again",
           fixed.to_string());
  }
}

}  // namespace
}  // namespace dsacp::testing

int main(int argc, char** argv) {
  using namespace dsacp;
  const char* json = nullptr;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], "--json") == 0) json = argv[i + 1];
  auto gr = make_cuda_backend(0);
  if (!gr.ok()) {
    std::printf("SKIP: %s\n", gr.status().to_string().c_str());
    return 77;
  }
  std::unique_ptr<Backend> gpu = std::move(gr).value();
  testing::test_graph(*gpu);
  testing::gpu_cp_graph_checks(testing::g_log);
  std::printf("%d checks, %d failures\n", testing::g_log.checks(), testing::g_log.failures());
  testing::g_log.write_json(json != nullptr ? json : "");
  return testing::g_log.failures() == 0 ? 0 : 1;
}
