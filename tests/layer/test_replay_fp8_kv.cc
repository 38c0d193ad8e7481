// fp8_ds_mla cases (contract section 6): the case file's F8_E4M3 ctx_kv_latent with its tile scales (round trip,
// every refusal in one line naming the tensor and row), replay over the record cache (equal to the replay of a float
// case holding the dequantized latent, to a float case quantized on load, the same for every page size), and every
// CP layout with FP8 KV matching one device (the gathered views move the 656-byte records).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "dsacp/backend.h"
#include "dsacp/case_file.h"
#include "dsacp/fp8.h"
#include "dsacp/replay.h"
#include "support/layout_check.h"
#include "support/test_seed.h"

namespace dsacp {
namespace {

// T = 2 + 1 + 3 = 6, sumC = 70 + 0 + 9 = 79; Dl = 256 (two tiles), Dr = 16.
CaseGenSpec kv_spec(DType dtype = DType::kBF16) {
  CaseGenSpec s;
  s.requests = {{2, 70}, {1, 0}, {3, 9}};
  s.dims = CaseDims{3, 256, 16, 2, 16};
  s.topk = 12;
  s.scale = 0.05f;
  s.dtype = dtype;
  s.seed = testing::test_seed(91);
  return s;
}

CaseFile kv_case(DType dtype = DType::kBF16) {
  CaseFile c = case_generate(kv_spec(dtype)).value();
  EXPECT_TRUE(case_quantize_latent(c).ok());
  return c;
}

void expect_refused(SafetensorsFile f, const std::string& substring) {
  Result<CaseFile> c = case_from_safetensors(std::move(f));
  ASSERT_FALSE(c.ok()) << "expected: " << substring;
  const std::string& msg = c.status().message();
  EXPECT_NE(msg.find(substring), std::string::npos) << "message: " << msg << "\nexpected: " << substring;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && a.nbytes() == b.nbytes() &&
         (a.nbytes() == 0 || std::memcmp(a.data(), b.data(), a.nbytes()) == 0);
}

bool same_result(const StepResult& a, const StepResult& b) {
  return same_bytes(a.topk_indices, b.topk_indices) && same_bytes(a.out, b.out) && same_bytes(a.lse, b.lse);
}

TEST(Fp8KvCaseFile, QuantizedCaseRoundTripsAndBadScalesAreRefused) {
  const CaseFile c = kv_case();
  ASSERT_TRUE(c.latent_fp8());
  EXPECT_EQ(c.ctx_kv_latent.shape(), (Shape{79, 256}));
  EXPECT_EQ(c.ctx_kv_latent_scale.shape(), (Shape{79, 2}));
  EXPECT_EQ(c.kv_latent.dtype(), DType::kBF16);  // the new tokens' latent stays float
  // The scales follow the fp32 rule of each tile (the rule itself is checked against fp64 elsewhere).
  const CaseFile raw = case_generate(kv_spec()).value();
  for (int64_t r : {int64_t{0}, int64_t{78}}) {
    for (int64_t g = 0; g < 2; ++g) {
      float amax = 0.f;
      for (int64_t i = 0; i < 128; ++i)
        amax = std::max(amax, std::fabs(raw.ctx_kv_latent.get_f32(r * 256 + g * 128 + i)));
      EXPECT_EQ(c.ctx_kv_latent_scale.data_as<float>()[r * 2 + g], fp8_scale_from_amax(amax, Fp8ScaleMode::kFp32));
    }
  }
  const CaseFile back = case_from_safetensors(case_to_safetensors(c).value()).value();
  EXPECT_TRUE(same_bytes(back.ctx_kv_latent, c.ctx_kv_latent));
  EXPECT_TRUE(same_bytes(back.ctx_kv_latent_scale, c.ctx_kv_latent_scale));

  for (const float bad :
       {0.f, -2.f, std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
    SafetensorsFile g = case_to_safetensors(c).value();
    g.tensors["ctx_kv_latent_scale"].data_as<float>()[5 * 2 + 1] = bad;
    expect_refused(std::move(g), "ctx_kv_latent_scale[5, 1] = ");
  }
  {
    SafetensorsFile g = case_to_safetensors(c).value();
    g.tensors.erase("ctx_kv_latent_scale");
    expect_refused(std::move(g), "missing tensor \"ctx_kv_latent_scale\"");
  }
  {
    SafetensorsFile g = case_to_safetensors(raw).value();
    g.tensors["ctx_kv_latent_scale"] = c.ctx_kv_latent_scale.clone().value();
    expect_refused(std::move(g), "unexpected tensor \"ctx_kv_latent_scale\"");
  }
  {
    SafetensorsFile g = case_to_safetensors(c).value();
    g.tensors["ctx_kv_latent_scale"] = Tensor::zeros(DType::kF32, {79, 3}).value();
    expect_refused(std::move(g), "ctx_kv_latent_scale");
  }
  // Dl not a multiple of 128 cannot be quantized.
  CaseGenSpec odd = kv_spec();
  odd.dims.Dl = 100;
  CaseFile o = case_generate(odd).value();
  EXPECT_EQ(case_quantize_latent(o).code(), StatusCode::kInvalidArgument);
}

// The replay over fp8_ds_mla records equals, bit for bit, the replay of a float case whose latent is the
// contract's dequantized one (scale * value in f32; the rope bf16 already): the cache and attention read exactly
// those values. The same result for every page size, and for the float case quantized on load.
TEST(Fp8KvReplay, EqualsTheDequantizedFloatCaseOnEveryPageSize) {
  auto backend = make_cpu_backend(3);
  const CaseFile c = kv_case();
  // The dequantized float case: ctx_kv_latent and the new tokens' kv_latent (quantized by the step's write).
  CaseFile deq = case_generate(kv_spec()).value();
  Tensor ctx = Tensor::zeros(DType::kF32, {79, 256}).value();
  for (int64_t i = 0; i < ctx.numel(); ++i) {
    const uint8_t code = static_cast<const uint8_t*>(c.ctx_kv_latent.data())[i];
    ctx.set_f32(i, fp8_dequantize(code, c.ctx_kv_latent_scale.data_as<float>()[i / 128]));
  }
  Tensor fresh = Tensor::zeros(DType::kF32, {6, 256}).value();
  for (int64_t t = 0; t < 6; ++t) {
    for (int64_t g = 0; g < 2; ++g) {
      float amax = 0.f;
      for (int64_t i = 0; i < 128; ++i)
        amax = std::max(amax, fp8_amax_term(c.kv_latent.get_f32(t * 256 + g * 128 + i)));
      const float s = fp8_scale_from_amax(amax, Fp8ScaleMode::kFp32);
      for (int64_t i = 0; i < 128; ++i) {
        const int64_t at = t * 256 + g * 128 + i;
        fresh.set_f32(at, fp8_dequantize(fp8_quantize(c.kv_latent.get_f32(at), s), s));
      }
    }
  }
  deq.ctx_kv_latent = std::move(ctx);
  deq.kv_latent = std::move(fresh);

  ReplayOptions o;
  o.page_size = 64;
  const StepResult want = replay_case(*backend, deq, o).value();
  for (int32_t ps : {1, 3, 61, 64}) {
    SCOPED_TRACE("page_size " + std::to_string(ps));
    o.page_size = ps;
    Result<StepResult> got = replay_case(*backend, c, o);
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    EXPECT_TRUE(same_result(*got, want));
    ReplayOptions q = o;
    q.latent_fp8 = true;
    Result<StepResult> on_load = replay_case(*backend, case_generate(kv_spec()).value(), q);
    ASSERT_TRUE(on_load.ok()) << on_load.status().to_string();
    EXPECT_TRUE(same_result(*on_load, want));
  }
  // An FP8 latent with the FP8 indexer too.
  CaseFile both = kv_case();
  ASSERT_TRUE(case_quantize_index(both).ok());
  ReplayOptions p;
  EXPECT_TRUE(replay_case(*backend, both, p).ok());
  // The ue8m0 rule on load differs from fp32 (powers of two) but runs.
  ReplayOptions u;
  u.latent_fp8 = true;
  u.latent_scale_mode = Fp8ScaleMode::kUe8m0;
  EXPECT_TRUE(replay_case(*backend, case_generate(kv_spec()).value(), u).ok());
}

// A random CP batch with Dl = 128 (one tile), Dr = 8, for P PCP ranks, its context latent in fp8_ds_mla.
CaseFile cp_kv_case(uint64_t seed, int32_t P, bool decode_only) {
  CaseGenSpec spec;
  spec.topk = 24;
  spec.requests = testing::random_cp_batch(seed, P, spec.topk, decode_only);
  spec.dims = CaseDims{8, 128, 8, 2, 16};
  spec.scale = 0.1f;
  spec.dtype = DType::kF32;
  spec.seed = seed;
  CaseFile c = case_generate(spec).value();
  EXPECT_TRUE(case_quantize_latent(c).ok());
  return c;
}

// Every layout with FP8 KV: PCP (prefill rows attend over a gathered view of the records), DCP (each rank over
// its own records), hybrid, DSA-CP, both indexer modes, odd page sizes: top-k identical to one device, out within
// fp32 rounding; and the result of one layout identical whether the case is quantized or quantized on load.
TEST(CpLayoutFp8Kv, LayoutsMatchOneDevice) {
  const uint64_t seed = testing::test_seed(0xf8c);
  struct L {
    int32_t P, D, I;
    bool dsa_cp, sharded, decode_only;
    int32_t page_size;
  };
  for (const L& l :
       {L{2, 1, 0, false, false, false, 4}, L{2, 1, 0, false, true, false, 61}, L{1, 2, 0, false, false, true, 3},
        L{1, 2, 0, false, true, false, 1}, L{2, 2, 1, false, true, false, 1}, L{2, 2, 1, false, false, false, 5},
        L{1, 2, 0, true, true, false, 5}, L{3, 1, 2, false, true, false, 64}}) {
    SCOPED_TRACE("P" + std::to_string(l.P) + " D" + std::to_string(l.D) + (l.dsa_cp ? " dsa_cp" : "") +
                 (l.sharded ? " sharded" : " replicated") + " ps" + std::to_string(l.page_size));
    const CaseFile c = cp_kv_case(seed + l.P * 10 + l.D + l.page_size, l.P, l.decode_only);
    ReplayOptions one;
    one.page_size = l.page_size;
    ReplayOptions cp = one;
    cp.layout.P = l.P;
    cp.layout.D = l.D;
    cp.layout.interleave = l.I;
    cp.layout.dsa_cp = l.dsa_cp;
    cp.layout.indexer = l.sharded ? IndexerMode::kSharded : IndexerMode::kReplicated;
    cp.page_shuffle_seed = seed * 7 + 1;
    testing::expect_same_as_one_device(c, one, cp);
  }
}

}  // namespace
}  // namespace dsacp
