// The planned step (dsacp/step_plan.h): the plan's contents on a worked example, planned runs over several
// layers equal to step_run per layer bit for bit (every output form), and the bad pairings refused.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "dsacp/case_file.h"
#include "dsacp/paged_cache.h"
#include "dsacp/step.h"
#include "dsacp/step_plan.h"
#include "support/layout_check.h"
#include "support/test_seed.h"

namespace dsacp {
namespace {

// Two requests on 4-token pages: request 0 has 10 context tokens and 2 new ones on pages 5, 2, 0; request 1 has
// 5 context tokens and 1 new one on pages 7, 1.
struct Example {
  std::vector<Request> requests{{2, 10}, {1, 5}};
  PagedCacheConfig cc{8, 4, 16, 8, 8, DType::kF32};
  BlockTable table{2, 3, {5, 2, 0, 7, 1, -1}};
  CaseFile c;
  StepConfig config;
  Example() {
    CaseGenSpec spec;
    spec.dims = CaseDims{4, 16, 8, 2, 8};
    spec.topk = 6;
    spec.scale = 0.25f;
    spec.dtype = DType::kF32;
    spec.requests = requests;
    auto made = case_generate(spec);
    EXPECT_TRUE(made.ok()) << made.status().to_string();
    c = std::move(*made);
    config = testing::f32_step_config(c);
  }
  StepInputs inputs() const {
    return StepInputs{c.q_nope.data(), c.q_rope.data(), c.kv_latent.data(), c.k_rope.data(), c.idx_q.data(),
                      c.idx_w.data_as<float>(), c.idx_k.data()};
  }
};

struct Outs {
  explicit Outs(int64_t T, int32_t H, int32_t Dl, int32_t K) : topk(T * K), out(T * H * Dl), lse(T * H) {}
  std::vector<int32_t> topk;
  std::vector<float> out, lse;
  StepOutputs view() { return {topk.data(), out.data(), lse.data()}; }
  bool operator==(const Outs& o) const {
    return topk == o.topk && std::memcmp(out.data(), o.out.data(), out.size() * sizeof(float)) == 0 &&
           std::memcmp(lse.data(), o.lse.data(), lse.size() * sizeof(float)) == 0;
  }
};

TEST(StepPlan, WorkedExampleContents) {
  Example ex;
  auto backend = make_cpu_backend(1);
  auto plan = step_plan(*backend, ex.config, ex.requests, ex.table, ex.cc);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  // Request 0's positions 10, 11 are on its third page (page 0): slots 2, 3; request 1's position 5 is on its
  // second page (page 1): slot 4 + 1 = 5.
  EXPECT_EQ(plan->host().slots, (std::vector<int64_t>{2, 3, 5}));
  EXPECT_EQ(plan->host().token_request, (std::vector<int32_t>{0, 0, 1}));
  EXPECT_EQ(plan->host().token_key_len, (std::vector<int32_t>{11, 12, 6}));
  EXPECT_EQ(plan->num_tokens(), 3);
  EXPECT_EQ(plan->host().layout.num_decodes, 2);
  EXPECT_EQ(plan->pages_needed(), 8);  // page 7 is the highest the batch reads
  EXPECT_EQ(plan->workspace_bytes(), 0u);  // the CPU backend needs none with canonical outputs
  EXPECT_EQ(plan->fingerprint(), step_fingerprint(ex.config, ex.requests, ex.table, ex.cc));

  // With the table in device memory the host checks (and counts) only the new tokens' pages: 0 and 1.
  StepPlanOptions dev;
  dev.device_block_table = ex.table.data.data();
  auto plan_dev = step_plan(*backend, ex.config, ex.requests, ex.table, ex.cc, dev);
  ASSERT_TRUE(plan_dev.ok()) << plan_dev.status().to_string();
  EXPECT_EQ(plan_dev->pages_needed(), 2);

  // Slot top-k: the canonical rows need a workspace of T * K int32 (256-byte aligned).
  StepConfig slots = ex.config;
  slots.topk_form = TopkForm::kSlot;
  auto plan_slots = step_plan(*backend, slots, ex.requests, ex.table, ex.cc);
  ASSERT_TRUE(plan_slots.ok());
  EXPECT_EQ(plan_slots->workspace_bytes(), 256u);
  EXPECT_NE(plan_slots->fingerprint(), plan->fingerprint());
}

// Three layers (three caches, different inputs) run under one plan equal step_run on each layer, in every output
// form, with the plan's own workspace and with a caller's.
TEST(StepPlan, PlannedLayersEqualStepRunPerLayer) {
  for (const TopkForm form : {TopkForm::kCanonical, TopkForm::kSlot}) {
    for (const LseBase base : {LseBase::kNatural, LseBase::kTwo}) {
      auto backend = make_cpu_backend(2);
      std::vector<Example> layers(3);
      StepConfig config = layers[0].config;
      config.topk_form = form;
      config.lse_base = base;
      std::vector<PagedKvCache> planned, direct;
      for (size_t l = 0; l < layers.size(); ++l) {
        CaseGenSpec spec;
        spec.dims = CaseDims{4, 16, 8, 2, 8};
        spec.topk = 6;
        spec.scale = 0.25f;
        spec.dtype = DType::kF32;
        spec.requests = layers[l].requests;
        spec.seed = testing::test_seed(900 + l);
        auto made = case_generate(spec);
        ASSERT_TRUE(made.ok());
        layers[l].c = std::move(*made);
        for (auto* caches : {&planned, &direct}) {
          auto cache = PagedKvCache::create(*backend, layers[l].cc);
          ASSERT_TRUE(cache.ok());
          const CaseFile& c = layers[l].c;
          ASSERT_TRUE(cache_load_context(*backend, *cache, c.requests, layers[l].table, c.ctx_kv_latent, c.ctx_k_rope,
                                         c.ctx_idx_k).ok());
          caches->push_back(std::move(*cache));
        }
      }
      const Example& ex = layers[0];
      auto plan = step_plan(*backend, config, ex.requests, ex.table, ex.cc);
      ASSERT_TRUE(plan.ok()) << plan.status().to_string();
      std::vector<char> caller_ws(plan->workspace_bytes() + 1);
      for (size_t l = 0; l < layers.size(); ++l) {
        Outs a(3, 4, 16, 6), b(3, 4, 16, 6);
        StepInputs in = layers[l].inputs();
        in.plan_fingerprint = step_fingerprint(config, ex.requests, ex.table, ex.cc);
        const StepWorkspace ws = l == 1 ? StepWorkspace{caller_ws.data(), caller_ws.size()} : StepWorkspace{};
        ASSERT_TRUE(step_run(*backend, *plan, planned[l], in, a.view(), ws).ok());
        ASSERT_TRUE(backend->synchronize().ok());
        ASSERT_TRUE(step_run(*backend, config, ex.requests, ex.table, direct[l], layers[l].inputs(), b.view()).ok());
        EXPECT_TRUE(a == b) << "layer " << l << " form " << static_cast<int>(form) << " base " << static_cast<int>(base);
      }
    }
  }
}

TEST(StepPlan, BadPairingsAreRefused) {
  Example ex;
  auto backend = make_cpu_backend(1);
  auto cache = PagedKvCache::create(*backend, ex.cc);
  ASSERT_TRUE(cache.ok());
  StepConfig slots = ex.config;
  slots.topk_form = TopkForm::kSlot;
  StepPlanOptions no_ws;
  no_ws.own_workspace = false;
  auto plan = step_plan(*backend, slots, ex.requests, ex.table, ex.cc, no_ws);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  Outs o(3, 4, 16, 6);
  StepInputs in = ex.inputs();

  // A plan of another batch.
  in.plan_fingerprint = step_fingerprint(slots, {{1, 10}, {1, 5}}, ex.table, ex.cc);
  Status s = step_run(*backend, *plan, *cache, in, o.view());
  EXPECT_NE(s.message().find("the plan is of another batch (plan fingerprint"), std::string::npos) << s.message();
  in.plan_fingerprint = plan->fingerprint();

  // No workspace, then one too small.
  s = step_run(*backend, *plan, *cache, in, o.view());
  EXPECT_NE(s.message().find("no workspace given and the plan owns none (it needs 256 bytes)"), std::string::npos)
      << s.message();
  std::vector<char> small(100);
  s = step_run(*backend, *plan, *cache, in, o.view(), {small.data(), small.size()});
  EXPECT_NE(s.message().find("the workspace has 100 bytes, the plan needs 256"), std::string::npos) << s.message();
  std::vector<char> enough(256);
  EXPECT_TRUE(step_run(*backend, *plan, *cache, in, o.view(), {enough.data(), enough.size()}).ok());

  // A cache with fewer pages than the plan's table uses, and one of another page size.
  PagedCacheConfig few = ex.cc;
  few.num_pages = 6;
  auto small_cache = PagedKvCache::create(*backend, few);
  ASSERT_TRUE(small_cache.ok());
  s = step_run(*backend, *plan, *small_cache, in, o.view(), {enough.data(), enough.size()});
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange);
  EXPECT_NE(s.message().find("the cache holds 6 pages, the plan's block table uses page 7"), std::string::npos)
      << s.message();
  PagedCacheConfig other = ex.cc;
  other.page_size = 8;
  auto other_cache = PagedKvCache::create(*backend, other);
  ASSERT_TRUE(other_cache.ok());
  s = step_run(*backend, *plan, *other_cache, in, o.view(), {enough.data(), enough.size()});
  EXPECT_NE(s.message().find("is not of the plan's layout"), std::string::npos) << s.message();

  // A plan of another backend.
  auto other_backend = make_cpu_backend(1);
  s = step_run(*other_backend, *plan, *cache, in, o.view(), {enough.data(), enough.size()});
  EXPECT_NE(s.message().find("the plan was made for backend"), std::string::npos) << s.message();

  // Missing indexer inputs.
  in.idx_q = nullptr;
  s = step_run(*backend, *plan, *cache, in, o.view(), {enough.data(), enough.size()});
  EXPECT_NE(s.message().find("idx_q is null"), std::string::npos) << s.message();

  // The plan's own checks: a page outside the pool.
  BlockTable bad = ex.table;
  bad.data[3] = 8;
  auto refused = step_plan(*backend, slots, ex.requests, bad, ex.cc);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("block table row 1 column 0 holds page 8, outside [0, 8)"),
            std::string::npos)
      << refused.status().message();
}

// Capture needs a device backend: the CPU backend says so in one line.
TEST(StepPlan, CaptureIsUnsupportedOnTheCpu) {
  auto backend = make_cpu_backend(1);
  Status s = backend->begin_capture();
  EXPECT_EQ(s.code(), StatusCode::kUnsupported);
  EXPECT_NE(s.message().find("CUDA graphs need the CUDA backend"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace dsacp
