// Graph-replayed decode layers for dsacp_bench_cp (bench_cp_graph.h). Every layer of a pass runs over the same
// cache and inputs (a decode layer's work is the same at every layer; the replay time is what is measured).
#include "bench_cp_graph.h"

#include <cuda_runtime.h>

#include <optional>

#include "cp_bench_support.h"
#include "dsacp/cp_step_plan.h"
#include "dsacp/step_plan.h"

namespace dsacp::bench::cp {
namespace {

// Replays `graph` on `be`'s stream between two events: device milliseconds.
double replay_ms(Backend& be, const CapturedWork& graph) {
  die_if(cudaSetDevice(be.cuda_device()) == cudaSuccess ? Status() : internal_error("cudaSetDevice"), "device");
  cudaStream_t stream = static_cast<cudaStream_t>(be.native_stream());
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0, stream);
  die_if(be.replay(graph), "replay");
  cudaEventRecord(e1, stream);
  die_if(be.synchronize(), "replay");
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return ms;
}

}  // namespace

double one_gpu_graph_layer_ms(Backend& be, const StepConfig& c, const std::vector<Request>& requests, int layers,
                              int reps) {
  int64_t T = 0;
  int32_t max_pages = 0;
  for (const Request& r : requests) {
    T += r.query_len;
    max_pages = std::max<int32_t>(max_pages, static_cast<int32_t>((r.seq_len() + 63) / 64));
  }
  const BlockTable table = ordered_table(static_cast<int32_t>(requests.size()), max_pages);
  const PagedCacheConfig cc = bench_cache_config(static_cast<int64_t>(requests.size()) * max_pages, c);
  std::vector<double> times;
  on_ranks(1, [&](int) {  // on rank 0's thread: the capture records the launches of the thread that begins it
    PagedKvCache cache = take(PagedKvCache::create(be, cc, false), "cache");
    fill_cache(be, cache);
    StepBuffers b = step_buffers(be, c, T, c.H, T);
    die_if(bench::keep_table_on_device(be, table, b), "device block table");
    StepPlanOptions po;
    po.device_block_table = b.in().block_table;
    StepPlan plan = take(step_plan(be, c, requests, table, cc, po), "step_plan");
    die_if(step_run(be, plan, cache, b.in(), b.outs()), "step_run (warm-up)");
    die_if(be.synchronize(), "warm-up");
    die_if(be.begin_capture(), "begin_capture");
    for (int l = 0; l < layers; ++l) die_if(step_run(be, plan, cache, b.in(), b.outs()), "step_run (capture)");
    CapturedWork graph = take(be.end_capture(), "end_capture");
    replay_ms(be, graph);  // warm-up
    for (int i = 0; i < reps; ++i) times.push_back(replay_ms(be, graph) / layers);
  });
  return median(times);
}

double cp_graph_layer_ms(std::vector<std::unique_ptr<Backend>>& gpus, const StepConfig& c,
                         const std::vector<Request>& requests, const CpLayout& layout, int layers, int reps) {
  const int Pt = layout.num_ranks();
  const CpBatch batch = cp_batch(c, requests, layout);
  const KvSharding& sharding = batch.sharding;
  const BlockTable& table = batch.table;
  const PagedCacheConfig& cc = batch.cc;
  const std::vector<CpRankPlan>& rank_plans = batch.plans;
  std::vector<OwnedCpComms> comms = make_comms(gpus, layout);
  std::vector<std::optional<PagedKvCache>> caches(static_cast<size_t>(Pt));
  std::vector<StepBuffers> bufs(static_cast<size_t>(Pt));
  std::vector<std::optional<CpStepPlan>> plans(static_cast<size_t>(Pt));
  std::vector<CapturedWork> graphs(static_cast<size_t>(Pt));
  // Every rank plans (enqueue only), warms up, then captures its layers: the ranks' collectives are recorded
  // together (each rank's capture holds its side of every collective).
  on_ranks(Pt, [&](int cr) {
    Backend& be = *gpus[cr];
    caches[cr] = take(PagedKvCache::create(be, cc, false), "cache");
    fill_cache(be, *caches[cr]);
    bufs[cr] = step_buffers(be, c, rank_plans[cr].num_rows, rank_plans[cr].num_heads, rank_plans[cr].output_rows);
    die_if(bench::keep_table_on_device(be, table, bufs[cr]), "device block table");
    CpStepPlanOptions po;
    po.device_block_table = bufs[cr].in().block_table;
    po.enqueue_only = true;
    plans[cr] = take(cp_step_plan(be, c, requests, rank_plans[cr], layout, sharding, table, cc, po), "cp_step_plan");
    const CpComms view = comms[cr].view();
    die_if(cp_step_run(be, view, *plans[cr], *caches[cr], bufs[cr].in(), bufs[cr].outs()), "cp_step_run (warm-up)");
    die_if(be.synchronize(), "warm-up");
    die_if(be.begin_capture(), "begin_capture");
    for (int l = 0; l < layers; ++l) {
      die_if(cp_step_run(be, view, *plans[cr], *caches[cr], bufs[cr].in(), bufs[cr].outs()), "cp_step_run (capture)");
    }
    graphs[cr] = take(be.end_capture(), "end_capture");
  });
  SpinBarrier together(Pt);
  std::vector<double> rank_ms(static_cast<size_t>(Pt)), times;
  for (int i = 0; i <= reps; ++i) {  // replay 0 warms up
    on_ranks(Pt, [&](int cr) {
      die_if(comms[cr].world->barrier(), "barrier");
      together.arrive_and_wait();
      rank_ms[cr] = replay_ms(*gpus[cr], graphs[cr]);
    });
    if (i > 0) times.push_back(*std::max_element(rank_ms.begin(), rank_ms.end()) / layers);
  }
  on_ranks(Pt, [&](int cr) {
    graphs[cr] = CapturedWork{};
    plans[cr].reset();
    caches[cr].reset();
    bufs[cr] = StepBuffers{};
    comms[cr] = OwnedCpComms{};
  });
  return median(times);
}

}  // namespace dsacp::bench::cp
