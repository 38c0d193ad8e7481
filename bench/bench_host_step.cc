// The host side of a step, alone: step_run (one device) and cp_step_run (DCP, ranks as threads) for the decode
// shape of dsacp_bench_cp (b=64, one query each, 128K context, H=128, K=2048, page 64) with a backend whose
// kernels do nothing. Its memory is untouched address space (so an 11 GiB cache costs nothing) and its copies
// are memcpy, which is what a device backend's host does with an upload too (into its pinned ring). What is
// left is planning, validation, host vectors, allocations and the thread communicator: the host work that a
// GPU step cannot hide (docs/design/gpu-notes.md, session 3). Run it under `perf record` to see where it goes.
// --device-table: the steps read a block table kept in backend memory (StepInputs::block_table).
// Also: the same steps as a plan once per forward pass and 61 planned runs (dsacp/step_plan.h, dsacp/cp_step_plan.h).
// Usage: dsacp_bench_host_step [--S TOKENS] [--reps N] [--D ranks] [--device-table]
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dsacp/backend.h"
#include "dsacp/communicator.h"
#include "dsacp/cp_step.h"
#include "dsacp/cp_step_plan.h"
#include "dsacp/step.h"
#include "dsacp/step_plan.h"
#include "step_shape.h"

namespace {

using namespace dsacp;
using Clock = std::chrono::steady_clock;

// Memory from the address space (pages appear only where written), kept in a pool by size once freed, as the
// CUDA backend's stream-ordered pool keeps it (so later steps touch no new pages); kernels return at once.
class NullBackend final : public Backend {
 public:
  ~NullBackend() override {
    for (auto& [n, list] : *pool_)
      for (void* p : list) munmap(p, n);
  }
  std::string name() const override { return "null"; }
  Result<DeviceBuffer> allocate(size_t bytes) override {
    const size_t n = std::max<size_t>(bytes, 1);
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(*mu_);
      auto& list = (*pool_)[n];
      if (!list.empty()) {
        p = list.back();
        list.pop_back();
      }
    }
    if (p == nullptr) {
      p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) return resource_exhausted("null backend: mmap of " + std::to_string(n) + " bytes");
    }
    auto pool = pool_;
    auto mu = mu_;
    return DeviceBuffer(p, bytes, [pool, mu, n](void* q) {
      std::lock_guard<std::mutex> lock(*mu);
      (*pool)[n].push_back(q);
    });
  }
  Status copy_to_device(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
    return Status();
  }
  Status copy_to_host(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
    return Status();
  }
  Status copy_on_device(void* dst, const void* src, size_t bytes) override {
    std::memmove(dst, src, bytes);
    return Status();
  }
  Status fill(void*, DType, int64_t, float) override { return Status(); }
  Status synchronize() override { return Status(); }
  Status cache_write(const CacheWriteParams&) override { return Status(); }
  Status indexer_topk(const IndexerTopkParams&) override {
    if (until_indexer_us < 0) until_indexer_us = std::chrono::duration<double, std::micro>(Clock::now() - step_start).count();
    return Status();
  }
  Status sparse_mla(const SparseMlaParams&) override { return Status(); }
  Status lse_merge(const LseMergeParams&) override { return Status(); }
  Status gather_rows(const GatherRowsParams&) override { return Status(); }
  Status topk_remap(const TopkRemapParams&) override { return Status(); }
  Status topk_merge(const TopkMergeParams&) override { return Status(); }

 public:
  // Host time from step_start to the step's first indexer launch: what a GPU waits before its longest kernel.
  void start_step() {
    step_start = Clock::now();
    until_indexer_us = -1;
  }
  Clock::time_point step_start;
  double until_indexer_us = -1;

 private:
  std::shared_ptr<std::map<size_t, std::vector<void*>>> pool_ = std::make_shared<std::map<size_t, std::vector<void*>>>();
  std::shared_ptr<std::mutex> mu_ = std::make_shared<std::mutex>();
};

template <typename T>
T take(Result<T> r, const char* what) {
  if (!r.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, r.status().to_string().c_str());
    std::exit(1);
  }
  return std::move(r).value();
}

void check(const Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.to_string().c_str());
    std::exit(1);
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int64_t S = 131072;
  int reps = 50;
  int D = 2;
  bool device_table = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--device-table") device_table = true;
    if (i + 1 >= argc) continue;
    if (a == "--S") S = std::atoll(argv[++i]);
    if (a == "--reps") reps = std::atoi(argv[++i]);
    if (a == "--D") D = std::atoi(argv[++i]);
  }
  const StepConfig c = bench::decode_step_config();
  const std::vector<Request> req(64, Request{1, static_cast<int32_t>(S - 1)});
  const int32_t page = 64;

  // One device.
  {
    NullBackend be;
    const int32_t pages = static_cast<int32_t>((S + page - 1) / page);
    const BlockTable table = bench::ordered_table(64, pages);
    PagedCacheConfig cc{int64_t{64} * pages, page, c.Dl, c.Dr, c.Di, DType::kBF16};
    PagedKvCache cache = take(PagedKvCache::create(be, cc, false), "cache");
    bench::StepBuffers b = take(bench::allocate_step_buffers(be, c, 64, c.H, 64), "buffers");
    if (device_table) check(bench::keep_table_on_device(be, table, b), "device table");
    std::vector<double> ms, pre;
    for (int i = 0; i <= reps; ++i) {
      const auto t0 = Clock::now();
      be.start_step();
      check(step_run(be, c, req, table, cache, b.in(), b.outs()), "step_run");
      if (i > 0) ms.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      if (i > 0) pre.push_back(be.until_indexer_us);
    }
    std::printf("host side of step_run, b=64 decode, %lldK context, block table %s: %.1f us, %.1f us of it before the "
                "indexer launch (medians of %d)\n",
                static_cast<long long>(S / 1024), device_table ? "on the device" : "uploaded", median(ms), median(pre),
                reps);

    // The same step as plan + run: the plan once per forward pass, then one planned run per layer (61 a forward).
    StepPlanOptions po;
    po.device_block_table = device_table ? b.table.as<const int32_t>() : nullptr;
    std::vector<double> plan_us, run_us;
    for (int i = 0; i <= reps; ++i) {
      const auto t0 = Clock::now();
      StepPlan plan = take(step_plan(be, c, req, table, cc, po), "step_plan");
      const auto t1 = Clock::now();
      for (int layer = 0; layer < 61; ++layer) check(step_run(be, plan, cache, b.in(), b.outs()), "planned step_run");
      check(be.synchronize(), "synchronize");
      const auto t2 = Clock::now();
      if (i > 0) plan_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      if (i > 0) run_us.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count() / 61);
    }
    std::printf("plan + run, b=64 decode, %lldK context, block table %s: step_plan %.1f us once per forward, planned "
                "step_run %.2f us a layer (61 layers, medians of %d)\n",
                static_cast<long long>(S / 1024), device_table ? "on the device" : "uploaded", median(plan_us),
                median(run_us), reps);
  }

  // DCP over D ranks as threads (sharded indexer), each with its own null backend.
  {
    CpLayout layout;
    layout.D = D;
    const KvSharding sharding = cp_kv_sharding(layout, page);
    const int32_t pages = static_cast<int32_t>(sharding.pages_needed(S, page));
    const BlockTable table = bench::ordered_table(64, pages);
    PagedCacheConfig per_rank{int64_t{64} * pages, page, c.Dl, c.Dr, c.Di, DType::kBF16};
    const PagedCacheConfig cc = cp_rank_cache_config(layout, per_rank);
    std::vector<NullBackend> be(static_cast<size_t>(D));
    std::vector<PagedKvCache> caches;
    std::vector<CpRankPlan> plans;
    std::vector<bench::StepBuffers> bufs;
    for (int d = 0; d < D; ++d) {
      caches.push_back(take(PagedKvCache::create(be[d], cc, false), "cache"));
      plans.push_back(take(cp_rank_plan(req, layout, 0, d, table, page, c.decode_threshold, c.H), "plan"));
      bufs.push_back(take(bench::allocate_step_buffers(be[d], c, plans[d].num_rows, plans[d].num_heads, plans[d].output_rows), "buffers"));
      if (device_table) check(bench::keep_table_on_device(be[d], table, bufs[d]), "device table");
    }
    // Thread groups whose copies do nothing: the collectives' synchronization stays, their bytes do not move
    // (NCCL moves them on the GPUs, not on the host).
    const CopyFn no_copy = [](void*, const void*, size_t) { return Status(); };
    const auto timeout = std::chrono::seconds(60);
    auto world = LocalGroup::create(D, timeout, no_copy), dcp = LocalGroup::create(D, timeout, no_copy);
    std::vector<std::shared_ptr<LocalGroup>> pcp;
    std::vector<OwnedCpComms> comms(static_cast<size_t>(D));
    for (int d = 0; d < D; ++d) {
      pcp.push_back(LocalGroup::create(1, timeout, no_copy));
      comms[d].world = world->make_communicator(d);
      comms[d].pcp = pcp[d]->make_communicator(0);
      comms[d].dcp = dcp->make_communicator(d);
    }
    std::vector<std::vector<double>> ms(static_cast<size_t>(D)), pre(static_cast<size_t>(D));
    std::vector<std::thread> threads;
    for (int d = 0; d < D; ++d) {
      threads.emplace_back([&, d] {
        for (int i = 0; i <= reps; ++i) {
          check(comms[d].world->barrier(), "barrier");
          const auto t0 = Clock::now();
          be[d].start_step();
          check(cp_step_run(be[d], comms[d].view(), c, req, plans[d], layout, sharding, table, caches[d], bufs[d].in(),
                            bufs[d].outs()),
                "cp_step_run");
          if (i > 0) ms[d].push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
          if (i > 0) pre[d].push_back(be[d].until_indexer_us);
        }
      });
    }
    for (auto& t : threads) t.join();
    for (int d = 0; d < D; ++d) {
      std::printf("host side of cp_step_run, D=%d sharded, rank %d: %.1f us, %.1f us of it before the indexer launch "
                  "(medians of %d)\n",
                  D, d, median(ms[d]), median(pre[d]), reps);
    }
    // The same step as plan + run (dsacp/cp_step_plan.h): each rank plans once per forward pass, then 61 planned
    // runs (one a layer).
    std::vector<std::vector<double>> plan_us(static_cast<size_t>(D)), run_us(static_cast<size_t>(D));
    threads.clear();
    for (int d = 0; d < D; ++d) {
      threads.emplace_back([&, d] {
        CpStepPlanOptions po;
        po.device_block_table = device_table ? bufs[d].table.as<const int32_t>() : nullptr;
        for (int i = 0; i <= reps; ++i) {
          check(comms[d].world->barrier(), "barrier");
          const auto t0 = Clock::now();
          CpStepPlan plan = take(cp_step_plan(be[d], c, req, plans[d], layout, sharding, table, cc, po), "cp_step_plan");
          const auto t1 = Clock::now();
          for (int layer = 0; layer < 61; ++layer) {
            check(cp_step_run(be[d], comms[d].view(), plan, caches[d], bufs[d].in(), bufs[d].outs()), "planned cp_step_run");
          }
          const auto t2 = Clock::now();
          if (i > 0) plan_us[d].push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
          if (i > 0) run_us[d].push_back(std::chrono::duration<double, std::micro>(t2 - t1).count() / 61);
        }
      });
    }
    for (auto& t : threads) t.join();
    for (int d = 0; d < D; ++d) {
      std::printf("plan + run, D=%d sharded, rank %d: cp_step_plan %.1f us once per forward, planned cp_step_run "
                  "%.2f us a layer (61 layers, medians of %d)\n",
                  D, d, median(plan_us[d]), median(run_us[d]), reps);
    }
  }
  return 0;
}
