// The planned CP step (dsacp/cp_step_plan.h): one plan per rank made once, then several layers run under it,
// each layer equal bit for bit to the one-shot step over the same inputs, in every kind of layout; and the
// pairings a run refuses.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "dsacp/case_file.h"
#include "dsacp/cp_step.h"
#include "dsacp/cp_step_plan.h"
#include "support/layout_check.h"
#include "support/test_seed.h"

namespace dsacp {
namespace {

// Every rank's three communicators over thread groups (memcpy), as LocalCpCluster makes them.
struct ThreadRanks {
  std::vector<std::shared_ptr<LocalGroup>> groups;
  std::vector<OwnedCpComms> comms;  // index cr = r * D + d
};

ThreadRanks thread_ranks(const CpLayout& l) {
  ThreadRanks t;
  const auto timeout = std::chrono::seconds(60);
  auto world = LocalGroup::create(l.P * l.D, timeout);
  std::vector<std::shared_ptr<LocalGroup>> pcp, dcp;
  for (int32_t d = 0; d < l.D; ++d) pcp.push_back(LocalGroup::create(l.P, timeout));
  for (int32_t r = 0; r < l.P; ++r) dcp.push_back(LocalGroup::create(l.D, timeout));
  t.comms.resize(static_cast<size_t>(l.P * l.D));
  for (int32_t r = 0; r < l.P; ++r) {
    for (int32_t d = 0; d < l.D; ++d) {
      OwnedCpComms& c = t.comms[static_cast<size_t>(r * l.D + d)];
      c.world = world->make_communicator(r * l.D + d);
      c.pcp = pcp[d]->make_communicator(r);
      c.dcp = dcp[r]->make_communicator(d);
    }
  }
  t.groups.push_back(world);
  t.groups.insert(t.groups.end(), pcp.begin(), pcp.end());
  t.groups.insert(t.groups.end(), dcp.begin(), dcp.end());
  return t;
}

// Request b owns pages [b * pages, (b + 1) * pages) of every rank's pools.
BlockTable ordered_table(int32_t R, int32_t pages) {
  BlockTable t;
  t.num_requests = R;
  t.max_pages = pages;
  for (int32_t i = 0; i < R * pages; ++i) t.data.push_back(i);
  return t;
}

void expect_same_bytes(const Tensor& a, const Tensor& b, const std::string& what) {
  ASSERT_EQ(a.nbytes(), b.nbytes()) << what;
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0) << what << " differs";
}

struct PlannedLayout {
  std::string name;
  CpLayout layout;
  bool decode_only;
};

class CpStepPlanTest : public ::testing::TestWithParam<PlannedLayout> {};

// A random CP batch for layout l (f32 case dims, top-k 12, page 4): the case spec (its seed the caller's), the KV
// sharding, the block table (request b's pages in order) and the per-rank cache configuration.
struct PlannedBatch {
  CaseGenSpec spec;
  KvSharding sharding;
  BlockTable table;
  PagedCacheConfig per_rank;
};
PlannedBatch planned_batch(const PlannedLayout& pl, uint64_t seed) {
  const int32_t page = 4;
  PlannedBatch b;
  b.spec.topk = 12;
  b.spec.requests = testing::random_cp_batch(seed, pl.layout.P, b.spec.topk, pl.decode_only);
  b.spec.dims = CaseDims{8, 16, 8, 2, 16};
  b.spec.scale = 0.3f;
  b.sharding = cp_kv_sharding(pl.layout, page);
  int32_t pages = 1;
  for (const Request& r : b.spec.requests) {
    pages = std::max<int32_t>(pages, static_cast<int32_t>(b.sharding.pages_needed(r.seq_len(), page)));
  }
  const int32_t R = static_cast<int32_t>(b.spec.requests.size());
  b.table = ordered_table(R, pages);
  b.per_rank = PagedCacheConfig{int64_t{R} * pages, page, b.spec.dims.Dl, b.spec.dims.Dr, b.spec.dims.Di, DType::kF32};
  return b;
}

// Two layers (two caches per rank, different inputs and contexts; the second in the caller's memory, its pages
// padded, with latent and rope in one padded row) under one plan per rank: each layer's assembled result is the one-shot cluster
// step's, bit for bit.
TEST_P(CpStepPlanTest, LayersUnderOnePlanEqualOneShotSteps) {
  const PlannedLayout& pl = GetParam();
  const CpLayout& l = pl.layout;
  const uint64_t seed = testing::test_seed(4242);
  const int32_t Pt = l.P * l.D;
  PlannedBatch batch = planned_batch(pl, seed);
  const int32_t page = batch.per_rank.page_size;
  CaseGenSpec& spec = batch.spec;
  std::vector<CaseFile> layers;
  for (uint64_t k = 0; k < 2; ++k) {
    spec.seed = seed * 3 + k;
    auto c = case_generate(spec);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    layers.push_back(std::move(*c));
  }
  const std::vector<Request>& requests = spec.requests;
  const StepConfig config = testing::f32_step_config(layers[0]);
  const KvSharding& sharding = batch.sharding;
  const BlockTable& table = batch.table;
  const PagedCacheConfig& per_rank = batch.per_rank;
  std::unique_ptr<Backend> cpu = make_cpu_backend(2);

  // The one-shot steps: a fresh cluster a layer.
  std::vector<StepResult> one_shot;
  for (const CaseFile& c : layers) {
    auto cluster = LocalCpCluster::create(*cpu, l, per_rank);
    ASSERT_TRUE(cluster.ok()) << cluster.status().to_string();
    ASSERT_TRUE((*cluster)->load_context(requests, table, c.ctx_kv_latent, c.ctx_k_rope, c.ctx_idx_k).ok());
    auto r = (*cluster)->step(config, requests, table, testing::case_inputs(c));
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    one_shot.push_back(std::move(*r));
  }

  // The planned steps: each rank plans once, then runs both layers over its own two caches.
  auto plans = cp_all_rank_plans(config, requests, l, table, page);
  ASSERT_TRUE(plans.ok()) << plans.status().to_string();
  ThreadRanks ranks = thread_ranks(l);
  const PagedCacheConfig rank_cc = cp_rank_cache_config(l, per_rank);
  std::vector<std::vector<StepResult>> results(2);
  for (auto& r : results) r.resize(static_cast<size_t>(Pt));
  std::vector<Status> status(static_cast<size_t>(Pt));
  std::vector<int64_t> allocations(static_cast<size_t>(Pt), -1);
  std::vector<char> exchanged(static_cast<size_t>(Pt), 0);
  std::vector<std::thread> threads;
  for (int32_t cr = 0; cr < Pt; ++cr) {
    threads.emplace_back([&, cr] {
      Status& st = status[static_cast<size_t>(cr)];
      auto plan = cp_step_plan(*cpu, config, requests, (*plans)[cr], l, sharding, table, rank_cc);
      if (!plan.ok()) {
        st = plan.status();
        return;
      }
      for (size_t k = 0; k < layers.size() && st.ok(); ++k) {
        const CaseFile& c = layers[k];
        // Layer 1's cache is the caller's memory in the combined layout (latent then rope in each token's row,
        // padded) with padded pages (NaN between pages): the gathered views pack its strided rows.
        std::vector<float> kv, keys;
        Result<PagedKvCache> cache = Status(StatusCode::kInternal, "unset");
        if (k == 1) {
          const int32_t kv_row = rank_cc.Dl + rank_cc.Dr + 8;
          const int64_t kv_stride = PagedKvCache::kv_page_bytes(rank_cc, kv_row) + 64;
          const int64_t key_stride = PagedKvCache::index_keys_page_bytes(rank_cc) + 32;
          const int64_t key_pages = rank_cc.num_pages * rank_cc.index_page_factor;
          kv.assign(static_cast<size_t>(rank_cc.num_pages * kv_stride / 4), std::nanf(""));
          keys.assign(static_cast<size_t>(key_pages * key_stride / 4), std::nanf(""));
          ExternalPools pools;
          pools.kv = kv.data();
          pools.kv_bytes = kv.size() * 4;
          pools.kv_row = kv_row;
          pools.kv_page_stride = kv_stride;
          pools.index_keys = keys.data();
          pools.index_keys_bytes = keys.size() * 4;
          pools.index_keys_page_stride = key_stride;
          cache = PagedKvCache::wrap(rank_cc, pools);
        } else {
          cache = PagedKvCache::create(*cpu, rank_cc);
        }
        if (!cache.ok()) {
          st = cache.status();
          return;
        }
        st = cp_load_context_rank(*cpu, l, sharding, cr, requests, table, c.ctx_kv_latent, c.ctx_k_rope, c.ctx_idx_k,
                                  *cache);
        if (!st.ok()) return;
        auto r = cp_rank_step_host(*cpu, ranks.comms[static_cast<size_t>(cr)].view(), *plan, *cache,
                                   testing::case_inputs(c));
        if (!r.ok()) {
          st = r.status();
          return;
        }
        results[k][static_cast<size_t>(cr)] = std::move(*r);
        // The run's buffers come from the plan: the first layer's run allocates them, the next one nothing.
        if (k == 0) allocations[static_cast<size_t>(cr)] = plan->run_scratch_allocations();
      }
      if (st.ok() && plan->run_scratch_allocations() != allocations[static_cast<size_t>(cr)]) {
        st = internal_error("rank " + std::to_string(cr) + ": the second layer's run allocated " +
                            std::to_string(plan->run_scratch_allocations() - allocations[static_cast<size_t>(cr)]) +
                            " buffers");
      }
      exchanged[static_cast<size_t>(cr)] = plan->run_scratch_bytes() > 0;
    });
  }
  for (auto& t : threads) t.join();
  for (const Status& st : status) ASSERT_TRUE(st.ok()) << st.to_string();
  // Every layout exchanges something through the plan's buffers (KV rows, candidates, partials or queries).
  for (int32_t cr = 0; cr < Pt; ++cr) EXPECT_TRUE(exchanged[static_cast<size_t>(cr)]) << pl.name << " rank " << cr;
  for (size_t k = 0; k < layers.size(); ++k) {
    auto assembled = cp_assemble_result(config, l, layers[k].num_tokens(), *plans, results[k]);
    ASSERT_TRUE(assembled.ok()) << assembled.status().to_string();
    const std::string what = pl.name + " layer " + std::to_string(k);
    expect_same_bytes(assembled->topk_indices, one_shot[k].topk_indices, what + " top-k");
    expect_same_bytes(assembled->out, one_shot[k].out, what + " out");
    expect_same_bytes(assembled->lse, one_shot[k].lse, what + " lse");
  }
}

// What an enqueue-only run did (CpStepPlanOptions::enqueue_only), counted over every rank.
struct EnqueueCounts {
  std::atomic<int64_t> synchronizes{0}, host_waits{0}, ordered{0}, released{0};
};

// A CPU backend that claims a stream (as a device backend has): the enqueue-only plan's backend here.
class StreamedCpu final : public Backend {
 public:
  StreamedCpu(Backend& inner, EnqueueCounts& n) : inner_(inner), n_(n) {}
  std::string name() const override { return "streamed " + inner_.name(); }
  void* native_stream() const override { return const_cast<char*>(&stream_); }
  Result<DeviceBuffer> allocate(size_t bytes) override { return inner_.allocate(bytes); }
  Status copy_to_device(void* d, const void* s, size_t n) override { return inner_.copy_to_device(d, s, n); }
  Status copy_to_host(void* d, const void* s, size_t n) override { return inner_.copy_to_host(d, s, n); }
  Status copy_on_device(void* d, const void* s, size_t n) override { return inner_.copy_on_device(d, s, n); }
  Status fill(void* d, DType t, int64_t n, float v) override { return inner_.fill(d, t, n, v); }
  Status synchronize() override {
    ++n_.synchronizes;
    return inner_.synchronize();
  }
  Status cache_write(const CacheWriteParams& p) override { return inner_.cache_write(p); }
  Status indexer_topk(const IndexerTopkParams& p) override { return inner_.indexer_topk(p); }
  Status sparse_mla(const SparseMlaParams& p) override { return inner_.sparse_mla(p); }
  Status lse_merge(const LseMergeParams& p) override { return inner_.lse_merge(p); }
  Status gather_rows(const GatherRowsParams& p) override { return inner_.gather_rows(p); }
  Status topk_remap(const TopkRemapParams& p) override { return inner_.topk_remap(p); }
  Status topk_merge(const TopkMergeParams& p) override { return inner_.topk_merge(p); }
  Status topk_input(const TopkInputParams& p) override { return inner_.topk_input(p); }
  Status output_form(const OutputFormParams& p) override { return inner_.output_form(p); }

 private:
  Backend& inner_;
  EnqueueCounts& n_;
  char stream_ = 0;
};

// A thread group's communicator that says it orders its collectives on the device: order_before completes the
// collective (the CPU's "device order"); wait() and release_ordered() are counted.
class DeviceOrderedComm final : public Communicator {
  class Handle final : public CollectiveHandle {
   public:
    Handle(std::unique_ptr<CollectiveHandle> inner, EnqueueCounts& n) : inner_(std::move(inner)), n_(n) {}
    Status wait() override {
      ++n_.host_waits;
      return inner_->wait();
    }
    bool order_before(void*) override {
      ++n_.ordered;
      return inner_->wait().ok();
    }
    void release_ordered() override { ++n_.released; }

   private:
    std::unique_ptr<CollectiveHandle> inner_;
    EnqueueCounts& n_;
  };
  using HandleResult = Result<std::unique_ptr<CollectiveHandle>>;
  HandleResult wrap(HandleResult h) {
    if (!h.ok()) return h;
    return std::unique_ptr<CollectiveHandle>(new Handle(std::move(h).value(), n_));
  }

 public:
  DeviceOrderedComm(std::unique_ptr<Communicator> inner, EnqueueCounts& n) : inner_(std::move(inner)), n_(n) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  bool orders_on_device() const override { return true; }
  HandleResult all_gather_async(const void* s, void* r, size_t b) override { return wrap(inner_->all_gather_async(s, r, b)); }
  HandleResult all_to_all_async(const void* s, void* r, size_t b) override { return wrap(inner_->all_to_all_async(s, r, b)); }
  HandleResult broadcast_async(void* buf, size_t b, int root) override { return wrap(inner_->broadcast_async(buf, b, root)); }
  HandleResult all_gather_group_async(const std::vector<Part>& p) override { return wrap(inner_->all_gather_group_async(p)); }
  HandleResult all_to_all_group_async(const std::vector<Part>& p) override { return wrap(inner_->all_to_all_group_async(p)); }
  Status barrier() override { return inner_->barrier(); }
  void abort(const std::string& reason) override { inner_->abort(reason); }

 private:
  std::unique_ptr<Communicator> inner_;
  EnqueueCounts& n_;
};

// An enqueue-only plan's run (what a CUDA graph capture records) gives the eager run's results bit for bit, and
// neither synchronizes nor waits on the host for a collective: each one is ordered before its consumers and let go.
TEST_P(CpStepPlanTest, EnqueueOnlyRunsWaitForNothingAndEqualEagerRuns) {
  const PlannedLayout& pl = GetParam();
  const CpLayout& l = pl.layout;
  const uint64_t seed = testing::test_seed(977);
  const int32_t Pt = l.P * l.D;
  PlannedBatch batch = planned_batch(pl, seed);
  const int32_t page = batch.per_rank.page_size;
  batch.spec.seed = seed;
  auto c = case_generate(batch.spec);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  const std::vector<Request>& requests = batch.spec.requests;
  const StepConfig config = testing::f32_step_config(*c);
  const KvSharding& sharding = batch.sharding;
  const BlockTable& table = batch.table;
  const PagedCacheConfig& per_rank = batch.per_rank;
  std::unique_ptr<Backend> cpu = make_cpu_backend(2);
  auto cluster = LocalCpCluster::create(*cpu, l, per_rank);
  ASSERT_TRUE(cluster.ok()) << cluster.status().to_string();
  ASSERT_TRUE((*cluster)->load_context(requests, table, c->ctx_kv_latent, c->ctx_k_rope, c->ctx_idx_k).ok());
  auto eager = (*cluster)->step(config, requests, table, testing::case_inputs(*c));
  ASSERT_TRUE(eager.ok()) << eager.status().to_string();

  auto plans = cp_all_rank_plans(config, requests, l, table, page);
  ASSERT_TRUE(plans.ok()) << plans.status().to_string();
  const PagedCacheConfig rank_cc = cp_rank_cache_config(l, per_rank);
  CpStepPlanOptions options;
  options.enqueue_only = true;
  // A backend without a stream cannot take the plan.
  auto no_stream = cp_step_plan(*cpu, config, requests, (*plans)[0], l, sharding, table, rank_cc, options);
  ASSERT_FALSE(no_stream.ok());
  EXPECT_NE(no_stream.status().message().find("enqueue_only needs a device backend"), std::string::npos)
      << no_stream.status().to_string();

  EnqueueCounts n;
  StreamedCpu streamed(*cpu, n);
  ThreadRanks ranks = thread_ranks(l);
  std::vector<OwnedCpComms> ordered(static_cast<size_t>(Pt));
  for (int32_t cr = 0; cr < Pt; ++cr) {
    OwnedCpComms& from = ranks.comms[static_cast<size_t>(cr)];
    OwnedCpComms& to = ordered[static_cast<size_t>(cr)];
    to.world = std::make_unique<DeviceOrderedComm>(std::move(from.world), n);
    to.pcp = std::make_unique<DeviceOrderedComm>(std::move(from.pcp), n);
    to.dcp = std::make_unique<DeviceOrderedComm>(std::move(from.dcp), n);
  }
  ThreadRanks host_ranks = thread_ranks(l);  // communicators that wait on the host: refused
  std::vector<StepResult> results(static_cast<size_t>(Pt));
  std::vector<Status> status(static_cast<size_t>(Pt));
  std::vector<Status> refused(static_cast<size_t>(Pt));
  std::atomic<int32_t> planned{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int32_t cr = 0; cr < Pt; ++cr) {
    threads.emplace_back([&, cr] {
      Status& st = status[static_cast<size_t>(cr)];
      auto plan = cp_step_plan(streamed, config, requests, (*plans)[cr], l, sharding, table, rank_cc, options);
      auto cache = PagedKvCache::create(streamed, rank_cc);
      st = !plan.ok() ? plan.status() : !cache.ok() ? cache.status() : Status();
      if (st.ok()) {
        st = cp_load_context_rank(streamed, l, sharding, cr, requests, table, c->ctx_kv_latent, c->ctx_k_rope,
                                  c->ctx_idx_k, *cache);
      }
      // Every rank's planning (and its synchronizes) done before any run: the last one zeroes the count.
      if (planned.fetch_add(1) == Pt - 1) {
        n.synchronizes = 0;
        go = true;
      }
      while (!go.load()) std::this_thread::yield();
      if (!st.ok()) return;
      refused[static_cast<size_t>(cr)] = cp_step_run(streamed, host_ranks.comms[static_cast<size_t>(cr)].view(), *plan,
                                                     *cache, StepInputs{}, StepOutputs{});
      auto r = cp_rank_step_host(streamed, ordered[static_cast<size_t>(cr)].view(), *plan, *cache,
                                 testing::case_inputs(*c));
      if (!r.ok()) {
        st = r.status();
        return;
      }
      results[static_cast<size_t>(cr)] = std::move(*r);
    });
  }
  for (auto& t : threads) t.join();
  for (const Status& st : status) ASSERT_TRUE(st.ok()) << st.to_string();
  for (const Status& st : refused) {
    EXPECT_NE(st.message().find("needs communicators that order their collectives on the device"), std::string::npos)
        << pl.name << ": " << st.to_string();
  }
  // The runs: no synchronize (the planning's came before the runs began), no host wait; every collective
  // ordered before its consumers and let go.
  EXPECT_EQ(n.synchronizes.load(), 0) << pl.name;
  EXPECT_EQ(n.host_waits.load(), 0) << pl.name;
  EXPECT_GT(n.ordered.load(), 0) << pl.name;
  EXPECT_EQ(n.released.load(), n.ordered.load()) << pl.name;
  auto assembled = cp_assemble_result(config, l, c->num_tokens(), *plans, results);
  ASSERT_TRUE(assembled.ok()) << assembled.status().to_string();
  expect_same_bytes(assembled->topk_indices, eager->topk_indices, pl.name + " top-k");
  expect_same_bytes(assembled->out, eager->out, pl.name + " out");
  expect_same_bytes(assembled->lse, eager->lse, pl.name + " lse");
}

CpLayout layout_of(int32_t P, int32_t D, IndexerMode mode, bool dsa_cp) {
  CpLayout l;
  l.P = P;
  l.D = D;
  l.indexer = mode;
  l.dsa_cp = dsa_cp;
  return l;
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, CpStepPlanTest,
    ::testing::Values(PlannedLayout{"D2_sharded_decodes", layout_of(1, 2, IndexerMode::kSharded, false), true},
                      PlannedLayout{"D2_sharded_mixed", layout_of(1, 2, IndexerMode::kSharded, false), false},
                      PlannedLayout{"D2_replicated_mixed", layout_of(1, 2, IndexerMode::kReplicated, false), false},
                      PlannedLayout{"P2_sharded_mixed", layout_of(2, 1, IndexerMode::kSharded, false), false},
                      PlannedLayout{"P2xD2_sharded_mixed", layout_of(2, 2, IndexerMode::kSharded, false), false},
                      PlannedLayout{"P2xD2_replicated_mixed", layout_of(2, 2, IndexerMode::kReplicated, false), false},
                      PlannedLayout{"D2_dsacp_decodes", layout_of(1, 2, IndexerMode::kSharded, true), true},
                      PlannedLayout{"D2_dsacp_mixed", layout_of(1, 2, IndexerMode::kSharded, true), false}),
    [](const ::testing::TestParamInfo<PlannedLayout>& i) { return i.param.name; });

// A run refuses, before any collective and with one line naming the mismatch: a plan of another backend, a
// cache of another layout or with too few pages, communicators of another rank; a plan refuses a table of
// another batch.
TEST(CpStepPlanPairing, MismatchesAreRefused) {
  const CpLayout l = layout_of(1, 2, IndexerMode::kSharded, false);
  CaseGenSpec spec;
  spec.topk = 4;
  spec.requests = {{1, 9}, {1, 5}};
  spec.dims = CaseDims{4, 8, 4, 1, 8};
  auto c = case_generate(spec);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  const StepConfig config = testing::f32_step_config(*c);
  const KvSharding sharding = cp_kv_sharding(l, 4);
  const BlockTable table = ordered_table(2, 2);
  const PagedCacheConfig rank_cc = cp_rank_cache_config(l, PagedCacheConfig{4, 4, 8, 4, 8, DType::kF32});
  auto rank_plans = cp_all_rank_plans(config, spec.requests, l, table, 4);
  ASSERT_TRUE(rank_plans.ok());
  std::unique_ptr<Backend> cpu = make_cpu_backend(1), other = make_cpu_backend(1);
  auto plan = cp_step_plan(*cpu, config, spec.requests, (*rank_plans)[0], l, sharding, table, rank_cc);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_EQ(plan->pages_needed(), 3);  // request 0: pages 0, 1; request 1 (6 tokens, 4 on rank 0): page 2
  ThreadRanks ranks = thread_ranks(l);
  StepInputs in;
  StepOutputs out;
  auto cache = PagedKvCache::create(*cpu, rank_cc);
  ASSERT_TRUE(cache.ok());

  Status st = cp_step_run(*other, ranks.comms[0].view(), *plan, *cache, in, out);
  EXPECT_NE(st.message().find("the plan was made for backend"), std::string::npos) << st.to_string();

  PagedCacheConfig small = rank_cc;
  small.num_pages = 2;
  auto small_cache = PagedKvCache::create(*cpu, small);
  ASSERT_TRUE(small_cache.ok());
  st = cp_step_run(*cpu, ranks.comms[0].view(), *plan, *small_cache, in, out);
  EXPECT_NE(st.message().find("the cache holds 2 pages, the plan's block table uses page 2"), std::string::npos)
      << st.to_string();

  PagedCacheConfig paged8 = rank_cc;
  paged8.page_size = 8;
  auto other_layout = PagedKvCache::create(*cpu, paged8);
  ASSERT_TRUE(other_layout.ok());
  st = cp_step_run(*cpu, ranks.comms[0].view(), *plan, *other_layout, in, out);
  EXPECT_NE(st.message().find("is not of the plan's layout"), std::string::npos) << st.to_string();

  st = cp_step_run(*cpu, ranks.comms[1].view(), *plan, *cache, in, out);
  EXPECT_NE(st.message().find("world communicator is rank 1 of 2, the plan expects 0 of 2"), std::string::npos)
      << st.to_string();

  const BlockTable one_row = ordered_table(1, 2);
  auto refused = cp_step_plan(*cpu, config, spec.requests, (*rank_plans)[0], l, sharding, one_row, rank_cc);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("block table has 1 rows, the batch has 2 requests"), std::string::npos)
      << refused.status().to_string();
}

}  // namespace
}  // namespace dsacp
