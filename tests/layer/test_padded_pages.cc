// Pages padded past their dense size (ExternalPools' page strides: an engine's pages padded to one size for every
// layer's caches, vLLM's page_size_padded): the planned step over padded caller pools gives the results of
// library-allocated pools bit for bit, each page of the caller's pools holds the library pool's page, and the
// padding keeps its bytes. The padding is NaN, so a kernel that read it would show in the results.
#include <gtest/gtest.h>

#include <cmath>
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

enum class Layout { kRowsF32, kRowsBf16, kCombinedKv, kFp8 };
const char* layout_name(Layout l) {
  switch (l) {
    case Layout::kRowsF32: return "rows_f32";
    case Layout::kRowsBf16: return "rows_bf16";
    case Layout::kCombinedKv: return "combined_kv";
    case Layout::kFp8: return "fp8";
  }
  return "?";
}

// One caller pool of `pages` pages, `dense` bytes each, `stride` bytes apart, every byte 0xff (a NaN in f32, bf16
// and e4m3) until the step writes it; 16-byte aligned.
struct PaddedPool {
  PaddedPool(int64_t pages, int64_t dense, int64_t stride)
      : pages(pages), dense(dense), stride(stride), words(static_cast<size_t>((pages * stride + 15) / 16 * 4)) {
    std::memset(words.data(), 0xff, words.size() * 4);
  }
  int64_t pages, dense, stride;
  std::vector<float> words;
  void* data() { return words.data(); }
  size_t bytes() const { return static_cast<size_t>((pages - 1) * stride + dense); }
  const uint8_t* page(int64_t p) const { return reinterpret_cast<const uint8_t*>(words.data()) + p * stride; }
  // Pages equal to a dense pool's (bytes of each page's dense part), padding still 0xff.
  std::string compare(const void* dense_pool) const {
    int64_t bad_pages = 0, bad_pad = 0;
    for (int64_t p = 0; p < pages; ++p) {
      bad_pages += std::memcmp(page(p), static_cast<const uint8_t*>(dense_pool) + p * dense, dense) != 0;
      for (int64_t b = dense; b < stride && p + 1 < pages; ++b) bad_pad += page(p)[b] != 0xff;
    }
    return std::to_string(bad_pages) + " pages differ, " + std::to_string(bad_pad) + " padding bytes changed";
  }
};

TEST(PaddedPages, PlannedStepOverPaddedPoolsEqualsDensePools) {
  for (const Layout layout : {Layout::kRowsF32, Layout::kRowsBf16, Layout::kCombinedKv, Layout::kFp8}) {
    SCOPED_TRACE(layout_name(layout));
    const bool fp8 = layout == Layout::kFp8;
    const std::vector<Request> requests{{2, 10}, {1, 5}};
    const BlockTable table{2, 3, {5, 2, 0, 7, 1, -1}};
    PagedCacheConfig cc{8, 4, 128, 8, 8, layout == Layout::kRowsBf16 ? DType::kBF16 : DType::kF32};
    if (fp8) {
      cc.latent_format = LatentFormat::kFp8DsMla;
      cc.index_dtype = DType::kF8E4M3;
    }
    CaseGenSpec spec;
    spec.dims = CaseDims{4, 128, 8, 2, 8};
    spec.topk = 6;
    spec.scale = 0.25f;
    spec.requests = requests;
    spec.seed = testing::test_seed(913);
    auto made = case_generate(spec);
    ASSERT_TRUE(made.ok()) << made.status().to_string();
    CaseFile c = std::move(*made);
    if (fp8) {
      ASSERT_TRUE(case_quantize_index(c).ok());
    }
    StepConfig config = testing::f32_step_config(c);
    if (fp8) config.index_dtype = DType::kF8E4M3;
    auto backend = make_cpu_backend(1);

    // Every pool padded by a different amount (multiples of 16 bytes).
    const int32_t kv_row = cc.Dl + cc.Dr + 4;
    const int64_t lat_dense = layout == Layout::kCombinedKv ? PagedKvCache::kv_page_bytes(cc, kv_row)
                                                            : PagedKvCache::latent_page_bytes(cc);
    PaddedPool lat(cc.num_pages, lat_dense, lat_dense + 48);
    PaddedPool rope(cc.num_pages, PagedKvCache::rope_page_bytes(cc), PagedKvCache::rope_page_bytes(cc) + 16);
    PaddedPool idx(cc.num_pages, PagedKvCache::index_keys_page_bytes(cc), PagedKvCache::index_keys_page_bytes(cc) + 32);
    ExternalPools pools;
    if (layout == Layout::kCombinedKv) {
      pools.kv = lat.data();
      pools.kv_bytes = lat.bytes();
      pools.kv_row = kv_row;
      pools.kv_page_stride = lat.stride;
    } else {
      pools.latent = lat.data();
      pools.latent_bytes = lat.bytes();
      pools.latent_page_stride = lat.stride;
      if (!fp8) {
        pools.rope = rope.data();
        pools.rope_bytes = rope.bytes();
        pools.rope_page_stride = rope.stride;
      }
    }
    pools.index_keys = idx.data();
    pools.index_keys_bytes = idx.bytes();
    pools.index_keys_page_stride = idx.stride;
    auto wrapped = PagedKvCache::wrap(cc, pools);
    ASSERT_TRUE(wrapped.ok()) << wrapped.status().to_string();
    EXPECT_EQ(wrapped->latent().page_stride, lat.stride);
    EXPECT_EQ(wrapped->index_keys().page_stride, idx.stride);
    auto created = PagedKvCache::create(*backend, cc);
    ASSERT_TRUE(created.ok());
    // 0xff where nothing is written, as the caller's pools.
    std::memset(created->latent().data, 0xff, static_cast<size_t>(pool_span_bytes(created->latent())));
    std::memset(created->index_keys().data, 0xff, static_cast<size_t>(pool_span_bytes(created->index_keys())));
    if (!fp8) std::memset(created->rope().data, 0xff, static_cast<size_t>(pool_span_bytes(created->rope())));
    const Tensor* key_scales = fp8 ? &c.ctx_idx_k_scale : nullptr;
    for (PagedKvCache* cache : {&*wrapped, &*created}) {
      ASSERT_TRUE(cache_load_context(*backend, *cache, requests, table, c.ctx_kv_latent, c.ctx_k_rope, c.ctx_idx_k,
                                     key_scales).ok());
    }
    auto plan = step_plan(*backend, config, requests, table, cc);
    ASSERT_TRUE(plan.ok()) << plan.status().to_string();
    StepInputs in{c.q_nope.data(), c.q_rope.data(), c.kv_latent.data(), c.k_rope.data(), c.idx_q.data(),
                  c.idx_w.data_as<float>(), c.idx_k.data()};
    if (fp8) {
      in.idx_q_scale = c.idx_q_scale.data_as<float>();
      in.idx_k_scale = c.idx_k_scale.data_as<float>();
    }
    const int64_t T = 3, H = 4, K = 6;
    std::vector<int32_t> topk_a(T * K), topk_b(T * K);
    std::vector<float> out_a(T * H * cc.Dl), out_b(T * H * cc.Dl), lse_a(T * H), lse_b(T * H);
    ASSERT_TRUE(step_run(*backend, *plan, *wrapped, in, {topk_a.data(), out_a.data(), lse_a.data()}).ok());
    ASSERT_TRUE(step_run(*backend, *plan, *created, in, {topk_b.data(), out_b.data(), lse_b.data()}).ok());
    ASSERT_TRUE(backend->synchronize().ok());
    EXPECT_EQ(topk_a, topk_b);
    EXPECT_EQ(std::memcmp(out_a.data(), out_b.data(), out_a.size() * 4), 0);
    EXPECT_EQ(std::memcmp(lse_a.data(), lse_b.data(), lse_a.size() * 4), 0);
    for (float v : out_a) ASSERT_TRUE(std::isfinite(v)) << "a NaN of the padding was read";

    // The library's pools (the combined rows: its latent then rope rows, then the row's 4 unused values as the
    // caller left them: 0xff).
    if (layout == Layout::kCombinedKv) {
      const int64_t rows = cc.num_pages * cc.page_size;
      std::vector<float> dense(static_cast<size_t>(rows * kv_row));
      std::memset(dense.data(), 0xff, dense.size() * 4);
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(&dense[r * kv_row], static_cast<const float*>(created->latent().data) + r * cc.Dl, cc.Dl * 4);
        std::memcpy(&dense[r * kv_row + cc.Dl], static_cast<const float*>(created->rope().data) + r * cc.Dr, cc.Dr * 4);
      }
      EXPECT_EQ(lat.compare(dense.data()), "0 pages differ, 0 padding bytes changed");
    } else {
      EXPECT_EQ(lat.compare(created->latent().data), "0 pages differ, 0 padding bytes changed");
      if (!fp8) {
        EXPECT_EQ(rope.compare(created->rope().data), "0 pages differ, 0 padding bytes changed");
      }
    }
    EXPECT_EQ(idx.compare(created->index_keys().data), "0 pages differ, 0 padding bytes changed");
  }
}

// A page stride smaller than a page, not a multiple of 16, given for the wrong form, or with too few bytes for
// it, is refused in one line naming the pool; so is a kernel's pool view with a bad page stride.
TEST(PaddedPages, BadPageStridesAreRefused) {
  const PagedCacheConfig cc{4, 4, 16, 8, 8, DType::kF32};
  std::vector<float> buf(4096);
  float* b = buf.data();
  const size_t lat = PagedKvCache::latent_bytes(cc), rope = PagedKvCache::rope_bytes(cc),
               idx = PagedKvCache::index_keys_bytes(cc);
  auto msg = [&](const PagedCacheConfig& config, const ExternalPools& p) {
    auto r = PagedKvCache::wrap(config, p);
    return r.ok() ? std::string("ok") : r.status().message();
  };
  ExternalPools p{b, lat, b + 512, rope, b + 1024, idx};
  EXPECT_EQ(msg(cc, p), "ok");
  ExternalPools small = p;
  small.latent_page_stride = 240;  // a page is 256 bytes
  EXPECT_EQ(msg(cc, small), "external KV cache: the latent pool's page stride 240 must be 0 (dense) or a multiple of "
                            "16 bytes of at least a page's 256 bytes");
  ExternalPools odd = p;
  odd.rope_page_stride = 136;
  EXPECT_NE(msg(cc, odd).find("the rope pool's page stride 136 must be"), std::string::npos) << msg(cc, odd);
  ExternalPools short_bytes = p;
  short_bytes.latent_page_stride = 272;  // 3 * 272 + 256 = 1072 bytes needed
  EXPECT_EQ(msg(cc, short_bytes), "external KV cache: the latent pool has 1024 bytes, the config (4 pages of 4) needs 1072");
  short_bytes.latent_bytes = 1072;
  EXPECT_EQ(msg(cc, short_bytes), "ok");
  ExternalPools kv_stride = p;
  kv_stride.kv_page_stride = 512;
  EXPECT_NE(msg(cc, kv_stride).find("kv_page_stride was given without a combined kv buffer"), std::string::npos);
  PagedCacheConfig fp8 = cc;
  fp8.Dl = 128;
  fp8.latent_format = LatentFormat::kFp8DsMla;
  ExternalPools rec{b, PagedKvCache::latent_bytes(fp8), nullptr, 0, b + 3072, idx};
  EXPECT_EQ(msg(fp8, rec), "ok");
  rec.rope_page_stride = 64;
  EXPECT_NE(msg(fp8, rec).find("fp8_ds_mla records hold the rope"), std::string::npos) << msg(fp8, rec);

  auto backend = make_cpu_backend(1);
  std::vector<float> rows(16);
  std::vector<int64_t> slots{5};
  CacheWriteParams w;
  w.rows = rows.data();
  w.rows_dtype = DType::kF32;
  w.num_rows = 1;
  w.slots = slots.data();
  w.pool = PagedPoolView{buf.data(), DType::kF32, 4, 4, 16};
  w.pool.page_stride = 264;
  Status s = cache_write_run(*backend, w);
  EXPECT_EQ(s.message(), "cache_write: pool.page_stride 264 must be 0 (dense) or a multiple of 16 bytes of at least a "
                         "page's 256 bytes");
  w.pool.page_stride = 272;
  ASSERT_TRUE(cache_write_run(*backend, w).ok());
  EXPECT_EQ(std::memcmp(&buf[272 / 4 + 16], rows.data(), 64), 0) << "slot 5 = page 1, row 1: at 272 + 64 bytes";
}

}  // namespace
}  // namespace dsacp
