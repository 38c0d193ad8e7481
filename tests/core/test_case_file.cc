// The case file (contract §4) and the result file: generator, round trips, and every refusal with its
// one-line message.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "dsacp/case_file.h"
#include "dsacp/random.h"

namespace dsacp {
namespace {

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("dsacp_test_" + name + ".safetensors")).string();
}

// Requests (query, context): T = 2 + 1 + 3 = 6, sumC = 5 + 0 + 7 = 12.
CaseGenSpec small_spec(DType dtype = DType::kF32) {
  CaseGenSpec s;
  s.requests = {{2, 5}, {1, 0}, {3, 7}};
  s.dims = CaseDims{2, 16, 8, 3, 12};
  s.topk = 4;
  s.scale = 0.1f;
  s.dtype = dtype;
  s.seed = 42;
  return s;
}

SafetensorsFile small_case_file(DType dtype = DType::kF32) {
  CaseFile c = case_generate(small_spec(dtype)).value();
  return case_to_safetensors(c).value();
}

void expect_bit_identical(const char* name, const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.dtype(), b.dtype()) << name;
  EXPECT_EQ(a.shape(), b.shape()) << name;
  ASSERT_EQ(a.nbytes(), b.nbytes()) << name;
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0) << name;
}

void expect_same_case(const CaseFile& a, const CaseFile& b) {
  ASSERT_EQ(a.requests.size(), b.requests.size());
  for (size_t r = 0; r < a.requests.size(); ++r) {
    EXPECT_EQ(a.requests[r].query_len, b.requests[r].query_len);
    EXPECT_EQ(a.requests[r].context_len, b.requests[r].context_len);
  }
  EXPECT_EQ(a.topk, b.topk);
  EXPECT_EQ(std::memcmp(&a.scale, &b.scale, sizeof(float)), 0);
  EXPECT_EQ(a.dims.H, b.dims.H);
  EXPECT_EQ(a.dims.Dl, b.dims.Dl);
  EXPECT_EQ(a.dims.Dr, b.dims.Dr);
  EXPECT_EQ(a.dims.Hi, b.dims.Hi);
  EXPECT_EQ(a.dims.Di, b.dims.Di);
  expect_bit_identical("q_nope", a.q_nope, b.q_nope);
  expect_bit_identical("q_rope", a.q_rope, b.q_rope);
  expect_bit_identical("kv_latent", a.kv_latent, b.kv_latent);
  expect_bit_identical("k_rope", a.k_rope, b.k_rope);
  expect_bit_identical("idx_q", a.idx_q, b.idx_q);
  expect_bit_identical("idx_w", a.idx_w, b.idx_w);
  expect_bit_identical("idx_k", a.idx_k, b.idx_k);
  expect_bit_identical("ctx_kv_latent", a.ctx_kv_latent, b.ctx_kv_latent);
  expect_bit_identical("ctx_k_rope", a.ctx_k_rope, b.ctx_k_rope);
  expect_bit_identical("ctx_idx_k", a.ctx_idx_k, b.ctx_idx_k);
}

// Loads `f` as a case and expects a one-line refusal containing `substring`.
void expect_case_refused(SafetensorsFile f, const std::string& substring) {
  Result<CaseFile> c = case_from_safetensors(std::move(f));
  ASSERT_FALSE(c.ok()) << "expected: " << substring;
  const std::string& msg = c.status().message();
  EXPECT_NE(msg.find(substring), std::string::npos) << "message: " << msg << "\nexpected: " << substring;
  EXPECT_EQ(msg.rfind("case: ", 0), 0u) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

Tensor i32_tensor(std::vector<int32_t> values) {
  Tensor t = Tensor::zeros(DType::kI32, {static_cast<int64_t>(values.size())}).value();
  for (size_t i = 0; i < values.size(); ++i) t.data_as<int32_t>()[i] = values[i];
  return t;
}

TEST(CaseFile, GenerateIsDeterministicAndCounterBased) {
  CaseFile a = case_generate(small_spec()).value();
  CaseFile b = case_generate(small_spec()).value();
  expect_same_case(a, b);
  EXPECT_EQ(a.num_tokens(), 6);
  EXPECT_EQ(a.ctx_kv_latent.dim(0), 12);
  // Element i of a tensor is counter_uniform(seed, tensor id, i): regenerate one without the rest.
  EXPECT_EQ(a.q_nope.get_f32(37), counter_uniform(42, 2, 37));
  EXPECT_EQ(a.ctx_idx_k.get_f32(100), counter_uniform(42, 11, 100));
  // Another seed, other values; all within [-1, 1).
  CaseGenSpec s = small_spec();
  s.seed = 43;
  CaseFile c = case_generate(s).value();
  EXPECT_NE(std::memcmp(a.q_nope.data(), c.q_nope.data(), a.q_nope.nbytes()), 0);
  for (int64_t i = 0; i < a.idx_q.numel(); ++i) {
    ASSERT_GE(a.idx_q.get_f32(i), -1.f);
    ASSERT_LT(a.idx_q.get_f32(i), 1.f);
  }
}

TEST(CaseFile, GenerateBf16StoresRoundedValues) {
  CaseFile c = case_generate(small_spec(DType::kBF16)).value();
  EXPECT_EQ(c.q_nope.dtype(), DType::kBF16);
  EXPECT_EQ(c.idx_w.dtype(), DType::kF32);  // always F32
  EXPECT_EQ(c.kv_latent.get_f32(5), round_to_bf16(counter_uniform(42, 4, 5)));
}

TEST(CaseFile, GenerateRefusesBadSpecs) {
  CaseGenSpec s = small_spec();
  s.requests.clear();
  EXPECT_FALSE(case_generate(s).ok());
  s = small_spec();
  s.requests[1].query_len = 0;
  EXPECT_FALSE(case_generate(s).ok());
  s = small_spec();
  s.dims.Hi = 0;
  EXPECT_FALSE(case_generate(s).ok());
  s = small_spec();
  s.topk = 0;
  EXPECT_FALSE(case_generate(s).ok());
  s = small_spec();
  s.scale = NAN;
  EXPECT_FALSE(case_generate(s).ok());
}

TEST(CaseFile, RoundTripOnDisk) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const std::string path = temp_path("case_rt");
    CaseFile c = case_generate(small_spec(dtype)).value();
    c.scale = 0.07216878f;  // a value with no short decimal form must still round trip exactly
    ASSERT_TRUE(case_write(path, c).ok());
    Result<CaseFile> d = case_read(path);
    ASSERT_TRUE(d.ok()) << d.status().message();
    expect_same_case(c, *d);
    // The metadata as stored.
    SafetensorsFile f = safetensors_read(path).value();
    EXPECT_EQ(f.metadata.at("topk"), "4");
    EXPECT_EQ(f.metadata.size(), 2u);
    std::filesystem::remove(path);
  }
}

TEST(CaseFile, AcceptsEmptyContextAndMixedDtypes) {
  CaseGenSpec s = small_spec();
  s.requests = {{3, 0}};
  CaseFile c = case_generate(s).value();
  c.q_rope = c.q_rope.to_dtype(DType::kBF16).value();
  SafetensorsFile f = case_to_safetensors(c).value();
  Result<CaseFile> d = case_from_safetensors(std::move(f));
  ASSERT_TRUE(d.ok()) << d.status().message();
  EXPECT_EQ(d->ctx_kv_latent.shape(), (Shape{0, 16}));
}

TEST(CaseFile, RefusesMissingAndExtraTensors) {
  SafetensorsFile f = small_case_file();
  f.tensors.erase("k_rope");
  expect_case_refused(std::move(f), "case: missing tensor \"k_rope\"");
  f = small_case_file();
  f.tensors["bias"] = i32_tensor({1});
  expect_case_refused(std::move(f), "case: unexpected tensor \"bias\"");
}

TEST(CaseFile, RefusesWrongDtype) {
  SafetensorsFile f = small_case_file();
  f.tensors["idx_w"] = f.tensors["idx_w"].to_dtype(DType::kBF16).value();
  expect_case_refused(std::move(f), "case: tensor \"idx_w\" has dtype BF16, expected F32");
  f = small_case_file();
  f.tensors["query_lens"] = Tensor::zeros(DType::kF32, {3}).value();
  expect_case_refused(std::move(f), "tensor \"query_lens\" has dtype F32, expected I32");
  f = small_case_file();
  f.tensors["q_nope"] = Tensor::zeros(DType::kI32, {6, 2, 16}).value();
  expect_case_refused(std::move(f), "tensor \"q_nope\" has dtype I32, expected BF16 or F32");
}

TEST(CaseFile, RefusesWrongShape) {
  SafetensorsFile f = small_case_file();
  f.tensors["q_rope"] = Tensor::zeros(DType::kF32, {5, 2, 8}).value();
  expect_case_refused(std::move(f), "case: tensor \"q_rope\" has shape [5, 2, 8], expected [T=6, H=2, Dr=8]");
  f = small_case_file();
  f.tensors["k_rope"] = Tensor::zeros(DType::kF32, {6, 9}).value();  // the queries' Dr comes from k_rope
  expect_case_refused(std::move(f), "tensor \"q_rope\" has shape [6, 2, 8], expected [T=6, H=2, Dr=9]");
  // Issue #30: a transposed q_nope ([T, Dl, H]) is reported as itself, not as q_rope's shape.
  f = small_case_file();
  f.tensors["q_nope"] = Tensor::zeros(DType::kF32, {6, 16, 2}).value();
  expect_case_refused(std::move(f), "case: tensor \"q_nope\" has shape [6, 16, 2], expected [T=6, H, Dl=16]");
  f = small_case_file();
  f.tensors["ctx_idx_k"] = Tensor::zeros(DType::kF32, {11, 12}).value();
  expect_case_refused(std::move(f), "tensor \"ctx_idx_k\" has shape [11, 12], expected [sumC=12, Di=12]");
  f = small_case_file();
  f.tensors["idx_w"] = Tensor::zeros(DType::kF32, {6, 3, 1}).value();
  expect_case_refused(std::move(f), "tensor \"idx_w\" has shape [6, 3, 1], expected [T=6, Hi=3]");
  f = small_case_file();
  f.tensors["q_nope"] = Tensor::zeros(DType::kF32, {6, 0, 16}).value();
  expect_case_refused(std::move(f), "tensor \"q_nope\" has shape [6, 0, 16]: H must be in [1, 2^31), got 0");
  f = small_case_file();
  f.tensors["context_lens"] = i32_tensor({5, 0});
  expect_case_refused(std::move(f), "tensor \"context_lens\" has shape [2], expected [R=3]");
  f = small_case_file();
  f.tensors["query_lens"] = i32_tensor({});
  f.tensors["context_lens"] = i32_tensor({});
  expect_case_refused(std::move(f), "R must be in [1, 2^31), got 0");
}

TEST(CaseFile, RefusesBadLengths) {
  SafetensorsFile f = small_case_file();
  f.tensors["query_lens"] = i32_tensor({2, 0, 4});
  expect_case_refused(std::move(f), "case: query_lens[1] must be >= 1, got 0");
  f = small_case_file();
  f.tensors["context_lens"] = i32_tensor({5, -1, 8});
  expect_case_refused(std::move(f), "case: context_lens[1] must be >= 0, got -1");
  // Lengths that do not add up with T (7 query tokens, q_nope has 6 rows).
  f = small_case_file();
  f.tensors["query_lens"] = i32_tensor({2, 2, 3});
  expect_case_refused(std::move(f), "tensor \"kv_latent\" has shape [6, 16], expected [T=7, Dl]");
  // Context lengths that do not add up with the context rows.
  f = small_case_file();
  f.tensors["context_lens"] = i32_tensor({5, 0, 6});
  expect_case_refused(std::move(f), "tensor \"ctx_kv_latent\" has shape [12, 16], expected [sumC=11, Dl=16]");
  // seq_len and T beyond int32.
  f = small_case_file();
  f.tensors["context_lens"] = i32_tensor({2147483647, 0, 7});
  expect_case_refused(std::move(f), "request 0 has seq_len 2147483649");
  f = small_case_file();
  f.tensors["query_lens"] = i32_tensor({2147483647, 2147483647, 2});
  f.tensors["context_lens"] = i32_tensor({0, 0, 0});
  expect_case_refused(std::move(f), "sum of query_lens is 4294967296, more than 2^31 - 1");
}

TEST(CaseFile, RefusesBadMetadata) {
  SafetensorsFile f = small_case_file();
  f.metadata.erase("topk");
  expect_case_refused(std::move(f), "case: __metadata__ has no \"topk\"");
  f = small_case_file();
  f.metadata.erase("scale");
  expect_case_refused(std::move(f), "case: __metadata__ has no \"scale\"");
  for (const char* bad : {"12abc", "1.5", "-3", "0", "", " 4", "+4", "2147483648", "99999999999999999999999"}) {
    f = small_case_file();
    f.metadata["topk"] = bad;
    expect_case_refused(std::move(f), "\"topk\" must be an integer in [1, 2^31)");
  }
  for (const char* bad : {"inf", "-inf", "nan", "1e400", "", "0.1x", " 0.1", "abc"}) {
    f = small_case_file();
    f.metadata["scale"] = bad;
    expect_case_refused(std::move(f), "\"scale\" must be a finite number");
  }
  // Issue #30: finite as a number but not as an f32 is refused as such; a magnitude below f32's range
  // (1e-50, even 1e-400) is a finite number and becomes 0 (or a denormal), as any f32 conversion does.
  for (const char* bad : {"1e39", "-3.5e38"}) {
    f = small_case_file();
    f.metadata["scale"] = bad;
    expect_case_refused(std::move(f), "is not finite as an f32");
  }
  for (const auto& [text, want] : {std::pair{"1e-50", 0.f}, std::pair{"-1e-400", -0.f}, std::pair{"1e-40", 1e-40f}}) {
    f = small_case_file();
    f.metadata["scale"] = text;
    Result<CaseFile> tiny = case_from_safetensors(std::move(f));
    ASSERT_TRUE(tiny.ok()) << text << ": " << tiny.status().message();
    EXPECT_EQ(tiny->scale, want) << text;
  }
  f = small_case_file();
  f.metadata["format"] = "pt";  // notes that writers add are allowed
  EXPECT_TRUE(case_from_safetensors(std::move(f)).ok());
  f = small_case_file();
  f.metadata["topk"] = "2147483647";
  f.metadata["scale"] = "-1e-3";
  Result<CaseFile> c = case_from_safetensors(std::move(f));
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->topk, 2147483647);
  EXPECT_EQ(c->scale, -1e-3f);
}

TEST(CaseFile, ReadRefusesMalformedFilesWithThePath) {
  const std::string path = temp_path("case_bad");
  CaseFile c = case_generate(small_spec()).value();
  ASSERT_TRUE(case_write(path, c).ok());
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  auto write_bytes = [&](const std::string& b) { std::ofstream(path, std::ios::binary) << b; };
  // Truncated.
  write_bytes(bytes.substr(0, bytes.size() / 2));
  Result<CaseFile> r = case_read(path);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message().rfind(path + ": safetensors: ", 0), 0u) << r.status().message();
  // Bad JSON: break the header's first brace.
  std::string broken = bytes;
  broken[8] = '(';
  write_bytes(broken);
  r = case_read(path);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("invalid JSON at byte 0"), std::string::npos) << r.status().message();
  // Case-level errors carry the path too.
  SafetensorsFile f = case_to_safetensors(c).value();
  f.tensors.erase("idx_k");
  ASSERT_TRUE(safetensors_write(path, f).ok());
  r = case_read(path);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), path + ": case: missing tensor \"idx_k\"");
  std::filesystem::remove(path);
}

TEST(CaseFile, WriteRefusesInconsistentCases) {
  CaseFile c = case_generate(small_spec()).value();
  c.dims.H = 3;
  EXPECT_FALSE(case_to_safetensors(c).ok());
  c = case_generate(small_spec()).value();
  c.requests[0].query_len = 3;
  Result<SafetensorsFile> f = case_to_safetensors(c);
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("expected [T=7, Dl]"), std::string::npos) << f.status().message();
  c = case_generate(small_spec()).value();
  c.idx_k = Tensor();
  EXPECT_FALSE(case_to_safetensors(c).ok());
}

// Mutated case files (truncations and bit flips) go through the full loader: an error or a valid case,
// never a crash; a case that loads has tensors consistent with its lengths.
TEST(CaseFile, MutationsNeverCrash) {
  const std::string valid = *safetensors_serialize(small_case_file(DType::kBF16));
  int loaded = 0;
  for (uint64_t it = 0; it < 2000; ++it) {
    std::string m = valid;
    const uint64_t h = counter_hash(5, 0, it);
    if (h % 3 == 0) {
      m.resize(counter_hash(5, 1, it) % m.size());
    } else {
      for (uint64_t k = 0; k < 1 + (h >> 8) % 3; ++k) {
        const uint64_t r = counter_hash(5, 2 + k, it);
        m[r % m.size()] = static_cast<char>(m[r % m.size()] ^ (1u << ((r >> 32) % 8)));
      }
    }
    Result<SafetensorsFile> f = safetensors_parse(m);
    if (!f.ok()) continue;
    Result<CaseFile> c = case_from_safetensors(std::move(f).value());
    if (!c.ok()) {
      ASSERT_EQ(c.status().message().find('\n'), std::string::npos) << c.status().message();
      continue;
    }
    ++loaded;
    int64_t T = 0;
    for (const Request& r : c->requests) T += r.query_len;
    ASSERT_EQ(c->num_tokens(), T);
  }
  EXPECT_GT(loaded, 0);  // flips inside float data still load
}

StepResult make_result(int64_t T, int64_t H, int64_t Dl, int64_t K, DType out_dtype) {
  StepResult r;
  r.topk_indices = Tensor::zeros(DType::kI32, {T, K}).value();
  for (int64_t i = 0; i < T * K; ++i) r.topk_indices.data_as<int32_t>()[i] = i % 3 == 2 ? -1 : static_cast<int32_t>(i);
  r.out = Tensor::zeros(out_dtype, {T, H, Dl}).value();
  for (int64_t i = 0; i < r.out.numel(); ++i) r.out.set_f32(i, counter_uniform(3, 0, i));
  r.lse = Tensor::zeros(DType::kF32, {T, H}).value();
  for (int64_t i = 0; i < r.lse.numel(); ++i) r.lse.set_f32(i, i == 0 ? -INFINITY : counter_uniform(3, 1, i));
  return r;
}

TEST(CaseFile, ResultRoundTrip) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const std::string path = temp_path("result_rt");
    StepResult r = make_result(6, 2, 16, 4, dtype);
    ASSERT_TRUE(result_write(path, r).ok());
    Result<StepResult> s = result_read(path);
    ASSERT_TRUE(s.ok()) << s.status().message();
    expect_bit_identical("topk_indices", r.topk_indices, s->topk_indices);
    expect_bit_identical("out", r.out, s->out);
    expect_bit_identical("lse", r.lse, s->lse);
    std::filesystem::remove(path);
  }
}

TEST(CaseFile, ResultRefusesInconsistentTensors) {
  const std::string path = temp_path("result_bad");
  auto refused = [&](SafetensorsFile f, const std::string& substring) {
    ASSERT_TRUE(safetensors_write(path, f).ok());
    Result<StepResult> s = result_read(path);
    ASSERT_FALSE(s.ok()) << substring;
    EXPECT_NE(s.status().message().find(substring), std::string::npos) << s.status().message();
    EXPECT_EQ(s.status().message().find('\n'), std::string::npos);
  };
  auto file = [](StepResult r) {
    SafetensorsFile f;
    f.tensors["topk_indices"] = std::move(r.topk_indices);
    f.tensors["out"] = std::move(r.out);
    f.tensors["lse"] = std::move(r.lse);
    return f;
  };
  SafetensorsFile f = file(make_result(6, 2, 16, 4, DType::kF32));
  f.tensors["lse"] = Tensor::zeros(DType::kF32, {6, 3}).value();
  refused(std::move(f), "result: tensor \"lse\" has shape [6, 3], expected [T=6, H=2]");
  f = file(make_result(6, 2, 16, 4, DType::kF32));
  f.tensors["out"] = Tensor::zeros(DType::kF32, {5, 2, 16}).value();
  refused(std::move(f), "result: tensor \"out\" has shape [5, 2, 16], expected [T=6, H, Dl]");
  f = file(make_result(6, 2, 16, 4, DType::kF32));
  f.tensors.erase("lse");
  refused(std::move(f), "result: missing tensor \"lse\"");
  f = file(make_result(6, 2, 16, 4, DType::kF32));
  f.tensors["topk_indices"].data_as<int32_t>()[5] = -2;
  refused(std::move(f), "result: topk_indices[1, 1] is -2, expected a position or -1");
  f = file(make_result(6, 2, 16, 4, DType::kF32));
  f.tensors["lse"] = f.tensors["lse"].to_dtype(DType::kBF16).value();
  refused(std::move(f), "result: tensor \"lse\" has dtype BF16, expected F32");
  // The writer checks the same.
  StepResult r = make_result(6, 2, 16, 4, DType::kF32);
  r.lse = Tensor::zeros(DType::kF32, {6}).value();
  EXPECT_FALSE(result_write(path, r).ok());
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace dsacp
