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

// Caches in the caller's memory (PagedKvCache::wrap, as a serving engine hands over its own tensors): the planned
// step writes the new tokens into the caller's buffers and gives the results of library-allocated pools, bit for
// bit, in the row layout and in the FP8 layouts (fp8_ds_mla records, two-plane indexer pages).
TEST(ExternalCache, WrappedPoolsEqualCreatedPools) {
  for (const bool fp8 : {false, true}) {
    Example ex;
    PagedCacheConfig cc = ex.cc;
    cc.Dl = 128;  // fp8_ds_mla takes 128-value tiles
    if (fp8) {
      cc.latent_format = LatentFormat::kFp8DsMla;
      cc.index_dtype = DType::kF8E4M3;
    }
    CaseGenSpec spec;
    spec.dims = CaseDims{4, 128, 8, 2, 8};
    spec.topk = 6;
    spec.scale = 0.25f;
    spec.requests = ex.requests;
    spec.seed = testing::test_seed(77);
    auto made = case_generate(spec);
    ASSERT_TRUE(made.ok());
    CaseFile c = std::move(*made);
    if (fp8) {
      ASSERT_TRUE(case_quantize_index(c).ok());
    }
    StepConfig config = testing::f32_step_config(c);
    if (fp8) config.index_dtype = DType::kF8E4M3;
    auto backend = make_cpu_backend(1);
    // The caller's memory: 16-byte aligned vectors of the sizes the config needs.
    std::vector<float> latent(PagedKvCache::latent_bytes(cc) / 4 + 4), rope(PagedKvCache::rope_bytes(cc) / 4 + 4),
        index(PagedKvCache::index_keys_bytes(cc) / 4 + 4);
    ExternalPools pools{latent.data(), latent.size() * 4, fp8 ? nullptr : rope.data(), rope.size() * 4, index.data(),
                        index.size() * 4};
    auto wrapped = PagedKvCache::wrap(cc, pools);
    ASSERT_TRUE(wrapped.ok()) << wrapped.status().to_string();
    EXPECT_EQ(wrapped->latent().data, latent.data());
    EXPECT_EQ(wrapped->index_keys().data, index.data());
    auto created = PagedKvCache::create(*backend, cc, /*poison_unused=*/false);  // zeros, as the caller's vectors
    ASSERT_TRUE(created.ok());
    const Tensor* key_scales = fp8 ? &c.ctx_idx_k_scale : nullptr;
    for (PagedKvCache* cache : {&*wrapped, &*created}) {
      ASSERT_TRUE(cache_load_context(*backend, *cache, c.requests, ex.table, c.ctx_kv_latent, c.ctx_k_rope, c.ctx_idx_k,
                                     key_scales).ok());
    }
    const std::vector<float> latent_before = latent;
    auto plan = step_plan(*backend, config, ex.requests, ex.table, cc);
    ASSERT_TRUE(plan.ok()) << plan.status().to_string();
    Outs a(3, 4, 128, 6), b(3, 4, 128, 6);
    StepInputs in{c.q_nope.data(), c.q_rope.data(), c.kv_latent.data(), c.k_rope.data(), c.idx_q.data(),
                  c.idx_w.data_as<float>(), c.idx_k.data()};
    if (fp8) {
      in.idx_q_scale = c.idx_q_scale.data_as<float>();
      in.idx_k_scale = c.idx_k_scale.data_as<float>();
    }
    ASSERT_TRUE(step_run(*backend, *plan, *wrapped, in, a.view()).ok());
    ASSERT_TRUE(step_run(*backend, *plan, *created, in, b.view()).ok());
    ASSERT_TRUE(backend->synchronize().ok());
    EXPECT_TRUE(a == b) << (fp8 ? "fp8" : "rows");
    EXPECT_NE(std::memcmp(latent.data(), latent_before.data(), latent.size() * 4), 0)
        << "the step's new keys went into the caller's latent pool";
    EXPECT_EQ(std::memcmp(created->latent().data, latent.data(), PagedKvCache::latent_bytes(cc)), 0)
        << "the caller's pool holds what the library's holds";
  }
}

// The latent and rope rows of a token in one row of a caller's buffer ([num_pages, page_size, kv_row]: vLLM's and
// FlashMLA's bf16 KV layout, latent then rope, here with and without padding at the row's end): the step reads and
// writes it as the library's two pools, bit for bit, and leaves the padding as it was.
TEST(ExternalCache, CombinedKvRowsEqualSeparatePools) {
  Example ex;
  const PagedCacheConfig& cc = ex.cc;
  const int32_t row = cc.Dl + cc.Dr;
  const float kPad = -12345.f;
  for (const int32_t kv_row : {row, row + 8}) {
    auto backend = make_cpu_backend(1);
    // Zeros where the rows go (as the library's pools without poison), kPad in the padding.
    std::vector<float> kv(PagedKvCache::kv_bytes(cc, kv_row) / 4, 0.f), index(PagedKvCache::index_keys_bytes(cc) / 4);
    for (size_t i = 0; i < kv.size(); ++i) {
      if (static_cast<int32_t>(i % kv_row) >= row) kv[i] = kPad;
    }
    ExternalPools pools;
    pools.kv = kv.data();
    pools.kv_bytes = kv.size() * 4;
    pools.kv_row = kv_row;
    pools.index_keys = index.data();
    pools.index_keys_bytes = index.size() * 4;
    auto wrapped = PagedKvCache::wrap(cc, pools);
    ASSERT_TRUE(wrapped.ok()) << wrapped.status().to_string();
    EXPECT_EQ(wrapped->latent().data, kv.data());
    EXPECT_EQ(wrapped->rope().data, kv.data() + cc.Dl);
    EXPECT_EQ(wrapped->latent().row_stride, kv_row);
    auto created = PagedKvCache::create(*backend, cc, /*poison_unused=*/false);
    ASSERT_TRUE(created.ok());
    for (PagedKvCache* cache : {&*wrapped, &*created}) {
      ASSERT_TRUE(cache_load_context(*backend, *cache, ex.requests, ex.table, ex.c.ctx_kv_latent, ex.c.ctx_k_rope,
                                     ex.c.ctx_idx_k).ok());
    }
    auto plan = step_plan(*backend, ex.config, ex.requests, ex.table, cc);
    ASSERT_TRUE(plan.ok()) << plan.status().to_string();
    Outs a(3, 4, cc.Dl, 6), b(3, 4, cc.Dl, 6);
    ASSERT_TRUE(step_run(*backend, *plan, *wrapped, ex.inputs(), a.view()).ok());
    ASSERT_TRUE(step_run(*backend, *plan, *created, ex.inputs(), b.view()).ok());
    ASSERT_TRUE(backend->synchronize().ok());
    EXPECT_TRUE(a == b) << "kv_row " << kv_row;
    // Slot by slot: the row holds the library's latent row, then its rope row, then the untouched padding.
    const float* lat = static_cast<const float*>(created->latent().data);
    const float* rope = static_cast<const float*>(created->rope().data);
    int64_t mismatches = 0, written = 0;
    for (int64_t slot = 0; slot < cc.num_pages * cc.page_size; ++slot) {
      const float* r = kv.data() + slot * kv_row;
      written += r[0] != 0.f;
      mismatches += std::memcmp(r, lat + slot * cc.Dl, cc.Dl * 4) != 0;
      mismatches += std::memcmp(r + cc.Dl, rope + slot * cc.Dr, cc.Dr * 4) != 0;
      for (int32_t d = row; d < kv_row; ++d) mismatches += r[d] != kPad;
    }
    EXPECT_EQ(mismatches, 0) << "kv_row " << kv_row;
    EXPECT_GT(written, 0);
  }
  // Refusals: a row shorter than Dl + Dr, both forms at once, too few bytes, an fp8_ds_mla cache.
  auto msg = [&](const PagedCacheConfig& config, const ExternalPools& p) {
    auto r = PagedKvCache::wrap(config, p);
    return r.ok() ? std::string("ok") : r.status().message();
  };
  std::vector<float> buf(PagedKvCache::kv_bytes(cc, row + 8) / 4 + 1024);
  std::vector<float> idx(PagedKvCache::index_keys_bytes(cc) / 4);
  ExternalPools p;
  p.kv = buf.data();
  p.kv_bytes = PagedKvCache::kv_bytes(cc, row);
  p.kv_row = row;
  p.index_keys = idx.data();
  p.index_keys_bytes = idx.size() * 4;
  EXPECT_EQ(msg(cc, p), "ok");
  ExternalPools short_row = p;
  short_row.kv_row = row - 4;
  EXPECT_NE(msg(cc, short_row).find("kv_row 20 is less than Dl + Dr = 24"), std::string::npos) << msg(cc, short_row);
  ExternalPools odd = p;
  odd.kv_row = row + 1;
  EXPECT_NE(msg(cc, odd).find("must each be a multiple of 16 bytes"), std::string::npos) << msg(cc, odd);
  ExternalPools small = p;
  small.kv_bytes -= 4;
  EXPECT_NE(msg(cc, small).find("the kv pool has"), std::string::npos) << msg(cc, small);
  ExternalPools both = p;
  both.latent = buf.data();
  EXPECT_NE(msg(cc, both).find("pass one"), std::string::npos) << msg(cc, both);
  PagedCacheConfig fp8 = cc;
  fp8.Dl = 128;
  fp8.latent_format = LatentFormat::kFp8DsMla;
  EXPECT_NE(msg(fp8, p).find("the cache is fp8_ds_mla"), std::string::npos) << msg(fp8, p);
}

// A pool's row stride is checked by the kernels: shorter than the row, or on a pool that takes none.
TEST(ExternalCache, BadRowStridesAreRefused) {
  auto backend = make_cpu_backend(1);
  std::vector<float> pool(4 * 4 * 32), rows(2 * 16);
  std::vector<int64_t> slots{0, 5};
  CacheWriteParams w;
  w.rows = rows.data();
  w.rows_dtype = DType::kF32;
  w.num_rows = 2;
  w.slots = slots.data();
  w.pool = PagedPoolView{pool.data(), DType::kF32, 4, 4, 16};
  w.pool.row_stride = 8;
  Status s = cache_write_run(*backend, w);
  EXPECT_NE(s.message().find("pool.row_stride 8 is less than its dim 16"), std::string::npos) << s.message();
  w.pool.row_stride = 32;
  EXPECT_TRUE(cache_write_run(*backend, w).ok());
  EXPECT_EQ(pool[5 * 32], rows[16]);
  IndexerTopkParams ip;
  ip.keys = PagedPoolView{pool.data(), DType::kF32, 4, 4, 16};
  ip.keys.row_stride = 32;
  ip.Hi = 1;
  ip.Di = 16;
  ip.K = 2;
  ip.q_dtype = DType::kF32;
  ip.block_table = {nullptr, 1, 1};
  s = indexer_topk_run(*backend, ip);
  EXPECT_NE(s.message().find("keys.row_stride must be 0 here (this pool is dense)"), std::string::npos) << s.message();
}

TEST(ExternalCache, BadPoolsAreRefused) {
  const PagedCacheConfig cc{4, 4, 16, 8, 8, DType::kF32};
  std::vector<float> buf(1024);
  const size_t lat = PagedKvCache::latent_bytes(cc), rope = PagedKvCache::rope_bytes(cc),
               idx = PagedKvCache::index_keys_bytes(cc);
  EXPECT_EQ(lat, 4u * 4 * 16 * 4);
  auto msg = [&](const ExternalPools& p) {
    auto r = PagedKvCache::wrap(cc, p);
    return r.ok() ? std::string("ok") : r.status().message();
  };
  float* b = buf.data();
  EXPECT_NE(msg({nullptr, lat, b + 256, rope, b + 512, idx}).find("the latent pool is null"), std::string::npos);
  EXPECT_NE(msg({b, lat - 4, b + 256, rope, b + 512, idx}).find("the latent pool has 1020 bytes, the config (4 pages of 4) needs 1024"),
            std::string::npos);
  EXPECT_NE(msg({b, lat, b + 257, rope, b + 512, idx}).find("the rope pool's address is not 16-byte aligned"),
            std::string::npos);
  EXPECT_NE(msg({b, lat, b + 256, rope, b + 512, idx - 1}).find("indexer-key pool has"), std::string::npos);
  EXPECT_EQ(msg({b, lat, b + 256, rope, b + 512, idx}), "ok");
  PagedCacheConfig fp8 = cc;
  fp8.Dl = 128;
  fp8.latent_format = LatentFormat::kFp8DsMla;
  std::vector<float> big(PagedKvCache::latent_bytes(fp8) / 4 + 1024);
  auto r = PagedKvCache::wrap(fp8, {big.data(), PagedKvCache::latent_bytes(fp8), b, rope, b + 512, idx});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("fp8_ds_mla records hold the rope"), std::string::npos) << r.status().message();
  PagedCacheConfig bad = cc;
  bad.page_size = 0;
  EXPECT_NE(PagedKvCache::wrap(bad, {b, lat, b + 256, rope, b + 512, idx}).status().message().find("page_size must be >= 1"),
            std::string::npos);
}

}  // namespace
}  // namespace dsacp
