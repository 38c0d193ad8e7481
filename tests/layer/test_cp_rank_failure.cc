// A CP rank that fails in the middle of a step (an allocation refused) must leave every buffer it handed to a
// collective alive until the collective is done with it: the thread communicator's last poster copies into
// every rank's buffers, also into those of a rank that is already unwinding. Each rank's backend here keeps
// freed buffers mapped and poisoned (a quarantine), so a copy into a freed buffer shows as a changed byte,
// deterministically and without a sanitizer; the other ranks are slowed so they post after the failing rank
// has unwound.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "dsacp/case_file.h"
#include "dsacp/cp_step.h"
#include "support/layout_check.h"

namespace dsacp {
namespace {

constexpr unsigned char kPoison = 0xA5;

// Forwards to a CPU backend; freed buffers are poisoned and kept; allocation number `fail_at` (counted from
// arm()) is refused; gather_rows (the packing before each gathered view) can be slowed.
class QuarantineBackend final : public Backend {
 public:
  QuarantineBackend() : inner_(make_cpu_backend(1)) {}
  ~QuarantineBackend() override = default;

  void arm(int64_t fail_at, std::chrono::milliseconds slow_gather) {
    std::lock_guard<std::mutex> lock(mu_);
    allocations_ = 0;
    fail_at_ = fail_at;
    slow_gather_ = slow_gather;
  }
  int64_t allocations() const {
    std::lock_guard<std::mutex> lock(mu_);
    return allocations_;
  }
  // The first byte of a freed buffer that no longer holds the poison, or -1.
  int64_t first_write_after_free() const {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Freed& f : freed_) {
      const auto* p = static_cast<const unsigned char*>(f.buffer.get());
      for (size_t i = 0; i < f.bytes; ++i) {
        if (p[i] != kPoison) return static_cast<int64_t>(i);
      }
    }
    return -1;
  }

  std::string name() const override { return "quarantine " + inner_->name(); }
  Result<DeviceBuffer> allocate(size_t bytes) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (++allocations_ == fail_at_) return resource_exhausted("test: allocation refused");
    }
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer inner, inner_->allocate(bytes));
    void* ptr = inner.get();
    auto held = std::make_shared<DeviceBuffer>(std::move(inner));
    return DeviceBuffer(ptr, bytes, [this, held, bytes](void* q) {
      std::memset(q, kPoison, bytes);
      std::lock_guard<std::mutex> lock(mu_);
      freed_.push_back({std::move(*held), bytes});
    });
  }
  Status copy_to_device(void* d, const void* s, size_t n) override { return inner_->copy_to_device(d, s, n); }
  Status copy_to_host(void* d, const void* s, size_t n) override { return inner_->copy_to_host(d, s, n); }
  Status copy_on_device(void* d, const void* s, size_t n) override { return inner_->copy_on_device(d, s, n); }
  Status fill(void* d, DType t, int64_t n, float v) override { return inner_->fill(d, t, n, v); }
  Status synchronize() override { return inner_->synchronize(); }
  Status cache_write(const CacheWriteParams& p) override { return inner_->cache_write(p); }
  Status indexer_topk(const IndexerTopkParams& p) override { return inner_->indexer_topk(p); }
  Status sparse_mla(const SparseMlaParams& p) override { return inner_->sparse_mla(p); }
  Status lse_merge(const LseMergeParams& p) override { return inner_->lse_merge(p); }
  Status gather_rows(const GatherRowsParams& p) override {
    std::chrono::milliseconds wait{0};
    {
      std::lock_guard<std::mutex> lock(mu_);
      wait = slow_gather_;
    }
    if (wait.count() > 0) std::this_thread::sleep_for(wait);
    return inner_->gather_rows(p);
  }
  Status topk_remap(const TopkRemapParams& p) override { return inner_->topk_remap(p); }
  Status topk_merge(const TopkMergeParams& p) override { return inner_->topk_merge(p); }

 private:
  struct Freed {
    DeviceBuffer buffer;
    size_t bytes;
  };
  std::unique_ptr<Backend> inner_;
  mutable std::mutex mu_;
  int64_t allocations_ = 0;
  int64_t fail_at_ = -1;
  std::chrono::milliseconds slow_gather_{0};
  std::vector<Freed> freed_;
};

struct LayoutCase {
  const char* name;
  CpLayout layout;
};

std::vector<LayoutCase> layouts() {
  std::vector<LayoutCase> v;
  auto add = [&v](const char* name, int32_t P, int32_t D, IndexerMode mode, bool dsa_cp) {
    CpLayout l;
    l.P = P;
    l.D = D;
    l.indexer = mode;
    l.dsa_cp = dsa_cp;
    v.push_back({name, l});
  };
  add("P2", 2, 1, IndexerMode::kSharded, false);
  add("D2 sharded", 1, 2, IndexerMode::kSharded, false);
  add("D2 replicated", 1, 2, IndexerMode::kReplicated, false);
  add("P2 x D2", 2, 2, IndexerMode::kReplicated, false);
  add("DSA-CP D2", 1, 2, IndexerMode::kSharded, true);
  return v;
}

// Rank 0 fails at each of its step's allocations in turn while the other ranks pack slowly (so they post their
// collectives after rank 0 has unwound); a batch with prefill rows (PCP's gathered views: latent and rope
// gathered as one group) and decode rows (DCP's head gathers and partial exchanges).
TEST(CpRankFailure, AFailingRankNeverFreesBuffersAPendingCollectiveStillWrites) {
  const std::vector<Request> reqs = {{24, 40}, {1, 9}, {1, 30}};
  CaseGenSpec spec;
  spec.requests = reqs;
  spec.dims = CaseDims{4, 8, 4, 2, 8};
  spec.topk = 6;
  auto c = case_generate(spec);
  ASSERT_TRUE(c.ok());
  const int32_t B = 4;
  const StepConfig sc = testing::f32_step_config(*c, /*decode_threshold=*/1);
  const HostStepInputs in = testing::case_inputs(*c);
  for (const LayoutCase& lc : layouts()) {
    SCOPED_TRACE(lc.name);
    const int32_t ranks = lc.layout.num_ranks();
    const KvSharding sh{ranks, B};
    PagedCacheConfig cc{0, B, 8, 4, 8, DType::kF32};
    for (const Request& r : reqs) cc.num_pages += sh.pages_needed(r.seq_len(), B);
    int64_t step_allocations = 0;  // rank 0's, counted in a run that succeeds
    for (int64_t fail_at = 0; fail_at <= step_allocations; ++fail_at) {
      std::vector<std::unique_ptr<QuarantineBackend>> backends;
      std::vector<Backend*> ptrs;
      for (int32_t r = 0; r < ranks; ++r) {
        backends.push_back(std::make_unique<QuarantineBackend>());
        ptrs.push_back(backends.back().get());
      }
      auto cluster = LocalCpCluster::create(ptrs, lc.layout, cc);
      ASSERT_TRUE(cluster.ok()) << cluster.status().message();
      PageAllocator alloc(cc.num_pages);
      std::vector<SequencePages> seqs(reqs.size());
      std::vector<const SequencePages*> seq_ptrs;
      for (size_t i = 0; i < reqs.size(); ++i) {
        ASSERT_TRUE(seqs[i].reserve(alloc, sh.local_len(reqs[i].seq_len(), 0), B).ok());
        seq_ptrs.push_back(&seqs[i]);
      }
      const BlockTable table = BlockTable::from_sequences(seq_ptrs);
      ASSERT_TRUE((*cluster)->load_context(reqs, table, c->ctx_kv_latent, c->ctx_k_rope, c->ctx_idx_k).ok());
      for (int32_t r = 0; r < ranks; ++r) {
        const bool failing = r == 0 && fail_at > 0;
        backends[r]->arm(failing ? fail_at : -1, std::chrono::milliseconds(r == 0 || fail_at == 0 ? 0 : 10));
      }
      auto result = (*cluster)->step(sc, reqs, table, in);
      if (fail_at == 0) {
        ASSERT_TRUE(result.ok()) << result.status().message();
        step_allocations = backends[0]->allocations();
        ASSERT_GT(step_allocations, 4);
        continue;
      }
      EXPECT_FALSE(result.ok()) << "rank 0's allocation " << fail_at << " was refused, yet the step succeeded";
      if (!result.ok()) {
        EXPECT_NE(result.status().message().find("allocation refused"), std::string::npos) << result.status().message();
      }
      for (int32_t r = 0; r < ranks; ++r) {
        EXPECT_EQ(backends[r]->first_write_after_free(), -1)
            << "a collective wrote into a buffer rank " << r << " had freed (rank 0's allocation " << fail_at
            << " of " << step_allocations << " refused)";
      }
    }
  }
}

}  // namespace
}  // namespace dsacp
