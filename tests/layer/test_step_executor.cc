// The single-device step (cache write -> indexer + top-k -> sparse MLA) on mixed batches, through the case
// replay path (shuffled pages, NaN in every unused slot), against direct fp64 math per token.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>

#include "dsacp/case_file.h"
#include "dsacp/paged_cache.h"
#include "dsacp/replay.h"
#include "support/layout_check.h"
#include "support/test_seed.h"
#include "dsacp/step.h"
#include "support/reference_math.h"

namespace dsacp {
namespace {

struct StepCase {
  std::string name;
  std::vector<Request> requests;
  CaseDims dims;
  int32_t topk;
  DType dtype;
  int32_t page_size;
};

std::string case_name(const StepCase& c) {
  std::string s = c.name + "_H" + std::to_string(c.dims.H) + "_Dl" + std::to_string(c.dims.Dl) + "_Dr" +
                  std::to_string(c.dims.Dr) + "_Hi" + std::to_string(c.dims.Hi) + "_Di" + std::to_string(c.dims.Di) +
                  "_K" + std::to_string(c.topk) + "_ps" + std::to_string(c.page_size) + "_" + dtype_name(c.dtype);
  return s;
}

// Dense f32 rows of request b's keys: its context rows then its new rows.
std::vector<float> request_keys(const CaseFile& c, const Tensor& ctx, const Tensor& fresh, int32_t b, int32_t dim) {
  int64_t ctx_start = 0, new_start = 0;
  for (int32_t i = 0; i < b; ++i) {
    ctx_start += c.requests[i].context_len;
    new_start += c.requests[i].query_len;
  }
  std::vector<float> rows;
  for (int64_t j = 0; j < c.requests[b].context_len; ++j)
    for (int32_t d = 0; d < dim; ++d) rows.push_back(ctx.get_f32((ctx_start + j) * dim + d));
  for (int64_t j = 0; j < c.requests[b].query_len; ++j)
    for (int32_t d = 0; d < dim; ++d) rows.push_back(fresh.get_f32((new_start + j) * dim + d));
  return rows;
}

std::vector<float> token_rows(const Tensor& t, int64_t token, int64_t width) {
  std::vector<float> v(static_cast<size_t>(width));
  for (int64_t i = 0; i < width; ++i) v[i] = t.get_f32(token * width + i);
  return v;
}

class StepExecutorTest : public ::testing::TestWithParam<StepCase> {};

TEST_P(StepExecutorTest, MatchesFp64AndIsLayoutIndependent) {
  const StepCase& sc = GetParam();
  CaseGenSpec spec;
  spec.requests = sc.requests;
  spec.dims = sc.dims;
  spec.topk = sc.topk;
  spec.scale = 0.3f;
  spec.dtype = sc.dtype;
  spec.seed = testing::test_seed(1000 + sc.page_size);
  auto c = case_generate(spec);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  auto backend = make_cpu_backend(2);
  ReplayOptions opt;
  opt.page_size = sc.page_size;
  auto res = replay_case(*backend, *c, opt);
  ASSERT_TRUE(res.ok()) << res.status().to_string();
  const CaseDims& d = c->dims;
  const int32_t K = c->topk;

  int64_t t = 0;
  for (int32_t b = 0; b < static_cast<int32_t>(c->requests.size()); ++b) {
    const Request& r = c->requests[b];
    const auto idx_keys = request_keys(*c, c->ctx_idx_k, c->idx_k, b, d.Di);
    const auto latent = request_keys(*c, c->ctx_kv_latent, c->kv_latent, b, d.Dl);
    const auto rope = request_keys(*c, c->ctx_k_rope, c->k_rope, b, d.Dr);
    for (int32_t i = 0; i < r.query_len; ++i, ++t) {
      const int64_t visible = int64_t{r.context_len} + i + 1;
      const auto q = token_rows(c->idx_q, t, int64_t{d.Hi} * d.Di);
      const auto w = token_rows(c->idx_w, t, d.Hi);
      const auto scores = ref::index_scores(q, w, idx_keys, d.Hi, d.Di, visible);
      std::span<const int32_t> row(res->topk_indices.data_as<int32_t>() + t * K, static_cast<size_t>(K));
      const std::string why = ref::check_topk_row(row, scores, K);
      ASSERT_EQ(why, "") << "request " << b << " token " << i;
      const auto qn = token_rows(c->q_nope, t, int64_t{d.H} * d.Dl);
      const auto qr = token_rows(c->q_rope, t, int64_t{d.H} * d.Dr);
      for (int32_t h = 0; h < d.H; ++h) {
        const auto want = ref::attention(std::span<const float>(qn).subspan(static_cast<size_t>(h) * d.Dl, d.Dl),
                                         std::span<const float>(qr).subspan(static_cast<size_t>(h) * d.Dr, d.Dr), latent, rope,
                                         row, c->scale, d.Dl, d.Dr);
        std::span<const float> got(res->out.data_as<float>() + (t * d.H + h) * d.Dl, static_cast<size_t>(d.Dl));
        EXPECT_LT(ref::rel_norm_error(got, want.out), 1e-5) << "request " << b << " token " << i << " head " << h;
        EXPECT_NEAR(res->lse.data_as<float>()[t * d.H + h], want.lse, 1e-4 * std::max(1.0, std::fabs(want.lse)));
      }
    }
  }

  // Another page size, page order and thread count: bit-identical.
  auto backend1 = make_cpu_backend(1);
  ReplayOptions other;
  other.page_size = sc.page_size == 1 ? 5 : 1;
  other.page_shuffle_seed = 77;
  auto again = replay_case(*backend1, *c, other);
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  EXPECT_EQ(0, std::memcmp(again->topk_indices.data(), res->topk_indices.data(), res->topk_indices.nbytes()));
  EXPECT_EQ(0, std::memcmp(again->out.data(), res->out.data(), res->out.nbytes()));
  EXPECT_EQ(0, std::memcmp(again->lse.data(), res->lse.data(), res->lse.nbytes()));
}

const CaseDims kOdd{3, 13, 7, 3, 17};
const CaseDims kDeepSeekish{4, 64, 16, 4, 32};

INSTANTIATE_TEST_SUITE_P(
    Batches, StepExecutorTest,
    ::testing::Values(
        // decodes, MTP decodes of unequal lengths, a 1-token prefill, a fresh prefill, chunked prefills
        StepCase{"mixed", {{1, 40}, {3, 25}, {2, 9}, {1, 0}, {23, 0}, {17, 30}}, kOdd, 16, DType::kF32, 4},
        StepCase{"mixed", {{1, 40}, {3, 25}, {2, 9}, {1, 0}, {23, 0}, {17, 30}}, kOdd, 16, DType::kBF16, 61},
        // contexts below and above K, K larger than every context
        StepCase{"shortctx", {{4, 2}, {5, 0}}, kDeepSeekish, 64, DType::kBF16, 1},
        StepCase{"longctx", {{1, 300}, {16, 200}, {40, 100}}, kDeepSeekish, 32, DType::kBF16, 64},
        StepCase{"prefillonly", {{57, 0}, {33, 0}}, kOdd, 8, DType::kF32, 3}),
    [](const auto& info) { return case_name(info.param) + "_" + std::to_string(info.index); });

TEST(StepExecutor, BlockTableThatMissesAPageIsAnError) {
  auto backend = make_cpu_backend(1);
  PagedCacheConfig cc{4, 4, 8, 4, 8, DType::kF32};
  auto cache = PagedKvCache::create(*backend, cc);
  ASSERT_TRUE(cache.ok());
  BlockTable t;
  t.num_requests = 1;
  t.max_pages = 2;
  t.data = {0, 9};  // page 9 is outside the 4-page pool
  StepConfig sc;
  sc.H = 1;
  sc.Dl = 8;
  sc.Dr = 4;
  sc.Hi = 1;
  sc.Di = 8;
  sc.K = 4;
  sc.scale = 1;
  sc.act_dtype = DType::kF32;
  StepInputs in;
  StepOutputs out;
  Status s = step_run(*backend, sc, {{2, 4}}, t, *cache, in, out);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("holds page 9, outside [0, 4)"), std::string::npos) << s.message();
  t.data = {-2, 1};  // a negative id is out of range too
  s = step_run(*backend, sc, {{2, 4}}, t, *cache, in, out);
  EXPECT_NE(s.message().find("column 0 holds page -2, outside [0, 4)"), std::string::npos) << s.message();
  t.data = {0, 9};
  sc.Dl = 9;
  s = step_run(*backend, sc, {{2, 4}}, t, *cache, in, out);
  EXPECT_NE(s.message().find("do not match the cache"), std::string::npos) << s.message();
}

// StepInputs::block_table: the same step over a table already in the backend's memory gives the same bits; the
// host then checks only the new tokens' pages, and a bad page elsewhere is caught by the kernels that read it.
TEST(StepExecutor, DeviceBlockTableMatchesTheHostTableAndIsCheckedWhereRead) {
  auto backend = make_cpu_backend(2);
  CaseGenSpec spec;
  spec.dims = CaseDims{4, 16, 8, 2, 8};
  spec.topk = 6;
  spec.scale = 0.25f;
  spec.dtype = DType::kF32;
  spec.seed = testing::test_seed(4242);
  spec.requests = {{2, 10}, {1, 5}};
  auto c = case_generate(spec);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  PagedCacheConfig cc{8, 4, 16, 8, 8, DType::kF32};
  auto cache = PagedKvCache::create(*backend, cc);
  ASSERT_TRUE(cache.ok());
  BlockTable t;
  t.num_requests = 2;
  t.max_pages = 3;
  t.data = {5, 2, 0, 7, 1, -1};  // request 0: 12 positions on pages 5, 2, 0; request 1: 6 on pages 7, 1
  ASSERT_TRUE(cache_load_context(*backend, *cache, c->requests, t, c->ctx_kv_latent, c->ctx_k_rope, c->ctx_idx_k).ok());
  const StepConfig sc = testing::f32_step_config(*c);
  const int64_t T = 3;
  struct Out {
    std::vector<int32_t> topk = std::vector<int32_t>(T * 6);
    std::vector<float> out = std::vector<float>(T * 4 * 16), lse = std::vector<float>(T * 4);
    StepOutputs view() { return {topk.data(), out.data(), lse.data()}; }
  } host_run, device_run, bad_run;
  StepInputs in{c->q_nope.data(), c->q_rope.data(), c->kv_latent.data(), c->k_rope.data(), c->idx_q.data(),
                c->idx_w.data_as<float>(), c->idx_k.data()};
  ASSERT_TRUE(step_run(*backend, sc, c->requests, t, *cache, in, host_run.view()).ok());
  const std::vector<int32_t> device_table = t.data;  // "device" memory of the CPU backend
  in.block_table = device_table.data();
  ASSERT_TRUE(step_run(*backend, sc, c->requests, t, *cache, in, device_run.view()).ok());
  EXPECT_EQ(host_run.topk, device_run.topk);
  EXPECT_EQ(0, std::memcmp(host_run.out.data(), device_run.out.data(), host_run.out.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(host_run.lse.data(), device_run.lse.data(), host_run.lse.size() * sizeof(float)));

  // A context page of the device table outside the pool: the indexer reading it fails the step.
  std::vector<int32_t> bad_device = t.data;
  bad_device[0] = 99;
  in.block_table = bad_device.data();
  Status s = step_run(*backend, sc, c->requests, t, *cache, in, bad_run.view());
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange) << s.to_string();
  EXPECT_NE(s.message().find("block_table"), std::string::npos) << s.to_string();
  // A new token's page (request 0's positions 10 and 11 are on its third page) is checked on the host.
  in.block_table = device_table.data();
  BlockTable bad_host = t;
  bad_host.data[2] = 8;
  s = step_run(*backend, sc, c->requests, bad_host, *cache, in, bad_run.view());
  EXPECT_NE(s.message().find("block table row 0 column 2 holds page 8, outside [0, 8)"), std::string::npos)
      << s.to_string();
}

// step_config_of: a case's shapes, K and scale, its FP8 indexer, and every other field at its default.
TEST(StepConfigOf, CaseShapesAndTheFp8Indexer) {
  CaseGenSpec spec;
  spec.dims = CaseDims{4, 16, 8, 2, 8};
  spec.topk = 6;
  spec.scale = 0.25f;
  spec.dtype = DType::kF32;
  spec.requests = {{3, 2}};
  auto c = case_generate(spec);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  StepConfig s = step_config_of(*c, DType::kBF16);
  EXPECT_EQ(s.H, 4);
  EXPECT_EQ(s.Dl, 16);
  EXPECT_EQ(s.Dr, 8);
  EXPECT_EQ(s.Hi, 2);
  EXPECT_EQ(s.Di, 8);
  EXPECT_EQ(s.K, 6);
  EXPECT_EQ(s.scale, 0.25f);
  EXPECT_EQ(s.act_dtype, DType::kBF16);
  EXPECT_EQ(s.out_dtype, DType::kF32);
  EXPECT_FALSE(s.index_dtype.has_value());
  EXPECT_EQ(s.decode_threshold, StepConfig{}.decode_threshold);
  ASSERT_TRUE(case_quantize_index(*c, Fp8ScaleMode::kFp32).ok());
  s = step_config_of(*c, DType::kF32);
  EXPECT_EQ(s.index_input_dtype(), DType::kF8E4M3);
}

}  // namespace
}  // namespace dsacp
