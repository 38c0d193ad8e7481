// FP8 indexer cases (contract section 6): the case file's F8_E4M3 tensors and scales (round trip, every refusal
// in one line naming the tensor), and replay of FP8 cases on one device: the top-k equals the contract's f32
// formula over the case's own bytes, the result is the same for every page size and for a float case quantized
// on load, and CP layouts refuse FP8 as unsupported.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "dsacp/backend.h"
#include "dsacp/case_file.h"
#include "dsacp/fp8.h"
#include "dsacp/replay.h"
#include "support/reference_math.h"

namespace dsacp {
namespace {

// Requests (query, context): T = 2 + 1 + 3 = 6, sumC = 70 + 0 + 9 = 79; K = 8, so some rows are shorter than K.
CaseGenSpec fp8_spec() {
  CaseGenSpec s;
  s.requests = {{2, 70}, {1, 0}, {3, 9}};
  s.dims = CaseDims{2, 16, 8, 3, 13};
  s.topk = 8;
  s.scale = 0.1f;
  s.dtype = DType::kBF16;
  s.seed = 77;
  return s;
}

CaseFile fp8_case() {
  CaseFile c = case_generate(fp8_spec()).value();
  EXPECT_TRUE(case_quantize_index(c).ok());
  return c;
}

void expect_refused(SafetensorsFile f, const std::string& substring) {
  Result<CaseFile> c = case_from_safetensors(std::move(f));
  ASSERT_FALSE(c.ok()) << "expected: " << substring;
  const std::string& msg = c.status().message();
  EXPECT_NE(msg.find(substring), std::string::npos) << "message: " << msg << "\nexpected: " << substring;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

TEST(Fp8CaseFile, QuantizedCaseRoundTrips) {
  const CaseFile c = fp8_case();
  EXPECT_TRUE(c.index_fp8());
  EXPECT_EQ(c.idx_q.dtype(), DType::kF8E4M3);
  EXPECT_EQ(c.idx_q_scale.shape(), (Shape{6, 3}));
  EXPECT_EQ(c.idx_k_scale.shape(), (Shape{6}));
  EXPECT_EQ(c.ctx_idx_k_scale.shape(), (Shape{79}));
  // The scales follow the fp32 rule of each group (checked against fp64 in test_fp8.cc).
  const CaseFile raw = case_generate(fp8_spec()).value();
  for (int64_t t = 0; t < 6; ++t) {
    float amax = 0.f;
    for (int64_t d = 0; d < 13; ++d)
      amax = std::max(amax, std::fabs(load_as_f32(raw.idx_k.data(), DType::kBF16, t * 13 + d)));
    EXPECT_EQ(c.idx_k_scale.data_as<float>()[t], fp8_scale_from_amax(amax, Fp8ScaleMode::kFp32));
  }
  SafetensorsFile f = case_to_safetensors(c).value();
  EXPECT_EQ(f.tensors.at("idx_k").dtype(), DType::kF8E4M3);
  Result<CaseFile> d = case_from_safetensors(std::move(f));
  ASSERT_TRUE(d.ok()) << d.status().message();
  for (auto [a, b] : {std::pair{&c.idx_q, &d->idx_q},
                      {&c.idx_k, &d->idx_k},
                      {&c.ctx_idx_k, &d->ctx_idx_k},
                      {&c.idx_q_scale, &d->idx_q_scale},
                      {&c.idx_k_scale, &d->idx_k_scale},
                      {&c.ctx_idx_k_scale, &d->ctx_idx_k_scale}}) {
    ASSERT_EQ(a->nbytes(), b->nbytes());
    EXPECT_EQ(a->dtype(), b->dtype());
    EXPECT_EQ(std::memcmp(a->data(), b->data(), a->nbytes()), 0);
  }
}

TEST(Fp8CaseFile, RefusesMissingBadAndMixedScales) {
  const SafetensorsFile good = case_to_safetensors(fp8_case()).value();
  auto copy = [&] {
    SafetensorsFile f;
    f.metadata = good.metadata;
    for (const auto& [n, t] : good.tensors) f.tensors[n] = t.clone().value();
    return f;
  };
  SafetensorsFile f = copy();
  f.tensors.erase("idx_k_scale");
  expect_refused(std::move(f), "missing tensor \"idx_k_scale\"");
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  f = copy();
  f.tensors["idx_k_scale"].data_as<float>()[2] = 0.f;
  expect_refused(std::move(f), "idx_k_scale[2] = 0");
  f = copy();
  f.tensors["idx_q_scale"].data_as<float>()[1 * 3 + 2] = nan;
  expect_refused(std::move(f), "idx_q_scale[1, 2] = nan");
  f = copy();
  f.tensors["ctx_idx_k_scale"].data_as<float>()[78] = -inf;
  expect_refused(std::move(f), "ctx_idx_k_scale[78]");
  f = copy();
  f.tensors["ctx_idx_k_scale"].data_as<float>()[5] = -1.f;
  expect_refused(std::move(f), "ctx_idx_k_scale[5] = -1");
  f = copy();
  f.tensors["idx_k_scale"] = Tensor::zeros(DType::kF32, {5}).value();
  expect_refused(std::move(f), "tensor \"idx_k_scale\" has shape [5]");
  f = copy();
  f.tensors["idx_k"] = Tensor::zeros(DType::kBF16, {6, 13}).value();  // the FP8 tensors go together
  expect_refused(std::move(f), "tensor \"idx_k\" has dtype BF16, expected F8_E4M3");
  // A float case with a scale tensor: refused, nothing silently ignored.
  f = case_to_safetensors(case_generate(fp8_spec()).value()).value();
  f.tensors["idx_k_scale"] = Tensor::zeros(DType::kF32, {6}).value();
  expect_refused(std::move(f), "unexpected tensor \"idx_k_scale\"");
}

// The contract's f32 score of token t (request b, key_len n) over the case's bytes: keys are the request's
// context rows, then its new tokens' rows.
std::vector<double> case_scores(const CaseFile& c, int64_t t, int32_t b, int64_t first_token, int64_t ctx_begin) {
  const Request& r = c.requests[b];
  const int64_t n = r.context_len + (t - first_token) + 1;
  const int32_t hi = c.dims.Hi, di = c.dims.Di;
  const uint8_t* q = static_cast<const uint8_t*>(c.idx_q.data());
  std::vector<double> s;
  for (int64_t j = 0; j < n; ++j) {
    const bool ctx = j < r.context_len;
    const uint8_t* k = static_cast<const uint8_t*>(ctx ? c.ctx_idx_k.data() : c.idx_k.data()) +
                       (ctx ? ctx_begin + j : first_token + (j - r.context_len)) * di;
    const float sk = ctx ? c.ctx_idx_k_scale.data_as<float>()[ctx_begin + j]
                         : c.idx_k_scale.data_as<float>()[first_token + (j - r.context_len)];
    float acc = 0.f;
    for (int32_t h = 0; h < hi; ++h) {
      float dot = 0.f;
      for (int32_t d = 0; d < di; ++d) dot += e4m3_to_f32(q[(t * hi + h) * di + d]) * e4m3_to_f32(k[d]);
      acc +=
          c.idx_w.data_as<float>()[t * hi + h] * std::max((c.idx_q_scale.data_as<float>()[t * hi + h] * sk) * dot, 0.f);
    }
    s.push_back(acc);
  }
  return s;
}

TEST(Fp8Replay, TopkIsTheFormulaAndLayoutOfPagesDoesNotMatter) {
  auto backend = make_cpu_backend(2);
  const CaseFile c = fp8_case();
  ReplayOptions o;
  o.page_size = 64;
  Result<StepResult> r64 = replay_case(*backend, c, o);
  ASSERT_TRUE(r64.ok()) << r64.status().message();
  const int32_t K = c.topk;
  int64_t t = 0, ctx = 0;
  for (int32_t b = 0; b < static_cast<int32_t>(c.requests.size()); ++b) {
    const int64_t first = t;
    for (int32_t i = 0; i < c.requests[b].query_len; ++i, ++t) {
      const std::vector<double> s = case_scores(c, t, b, first, ctx);
      const int32_t* row = r64->topk_indices.data_as<int32_t>() + t * K;
      EXPECT_EQ(std::vector<int32_t>(row, row + K), ref::canonical_topk(s, K)) << "token " << t;
    }
    ctx += c.requests[b].context_len;
  }
  for (int32_t ps : {1, 3, 61}) {
    o.page_size = ps;
    Result<StepResult> r = replay_case(*backend, c, o);
    ASSERT_TRUE(r.ok()) << r.status().message();
    for (auto [a, b] : {std::pair{&r64->topk_indices, &r->topk_indices}, {&r64->out, &r->out}, {&r64->lse, &r->lse}}) {
      ASSERT_EQ(a->nbytes(), b->nbytes());
      EXPECT_EQ(std::memcmp(a->data(), b->data(), a->nbytes()), 0) << "page_size " << ps;
    }
  }
  // A float case replayed with index_fp8 quantizes on load: the same result as the quantized case.
  o.page_size = 64;
  o.index_fp8 = true;
  Result<StepResult> rq = replay_case(*backend, case_generate(fp8_spec()).value(), o);
  ASSERT_TRUE(rq.ok()) << rq.status().message();
  EXPECT_EQ(std::memcmp(rq->topk_indices.data(), r64->topk_indices.data(), r64->topk_indices.nbytes()), 0);
  EXPECT_EQ(std::memcmp(rq->out.data(), r64->out.data(), r64->out.nbytes()), 0);
}

TEST(Fp8Replay, ContextParallelLayoutsRefuseFp8AsUnsupported) {
  auto backend = make_cpu_backend(1);
  const CaseFile c = fp8_case();
  ReplayOptions o;
  o.layout.P = 2;
  Result<StepResult> r = replay_case(*backend, c, o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(r.status().message().find("FP8 indexer"), std::string::npos) << r.status().message();
}

}  // namespace
}  // namespace dsacp
