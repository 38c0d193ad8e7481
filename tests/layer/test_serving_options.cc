// The serving options (StepConfig::topk_form, lse_base; StepInputs::topk) against the default path worked by
// hand, on one device and in every CP layout: slot rows are the block table lookup of the canonical rows,
// base-2 LSE is the natural LSE times kLog2E, a precomputed top-k equal to the indexer's gives the indexer's
// outputs bit for bit; malformed precomputed rows are refused naming the row.
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dsacp/case_file.h"
#include "dsacp/cp_step.h"
#include "dsacp/safetensors.h"
#include "dsacp/step.h"
#include "support/layout_check.h"
#include "support/test_seed.h"

namespace dsacp {
namespace {

constexpr int32_t kPage = 16;

struct Named {
  const char* name;
  CpLayout layout;
};

std::vector<Named> layouts() {
  std::vector<Named> v;
  auto add = [&](const char* name, int32_t P, int32_t D, IndexerMode mode, bool dsa_cp, int32_t interleave) {
    CpLayout l;
    l.P = P;
    l.D = D;
    l.indexer = mode;
    l.dsa_cp = dsa_cp;
    l.interleave = interleave;
    v.push_back({name, l});
  };
  add("one device", 1, 1, IndexerMode::kSharded, false, 0);
  add("DCP 2 sharded", 1, 2, IndexerMode::kSharded, false, 0);
  add("DCP 2 replicated, interleave 5", 1, 2, IndexerMode::kReplicated, false, 5);
  add("PCP 2", 2, 1, IndexerMode::kSharded, false, 0);
  add("P2 x D2 sharded, interleave 3", 2, 2, IndexerMode::kSharded, false, 3);
  add("DSA-CP 2", 1, 2, IndexerMode::kSharded, true, 0);
  add("DSA-CP 2 replicated", 1, 2, IndexerMode::kReplicated, true, 0);
  return v;
}

// One step of a random batch through a cluster of `layout` (the replay's way: a shared block table of shuffled
// pages, NaN in unused slots), keeping the table for the checks.
struct Stepper {
  CaseFile c;
  std::vector<Request> reqs;
  std::unique_ptr<Backend> backend = make_cpu_backend(2);
  std::unique_ptr<LocalCpCluster> cluster;
  BlockTable table;
  KvSharding sharding;
  int64_t num_pages = 0;

  static Stepper make(const CpLayout& layout, uint64_t seed, bool decode_only) {
    Stepper s;
    CaseGenSpec spec;
    spec.topk = 24;
    spec.requests = testing::random_cp_batch(seed, layout.P, spec.topk, decode_only);
    spec.dims = CaseDims{4, 24, 8, 2, 16};
    spec.scale = 0.3f;
    spec.seed = seed;
    auto c = case_generate(spec);
    EXPECT_TRUE(c.ok()) << c.status().to_string();
    s.c = std::move(*c);
    s.reqs = s.c.requests;
    s.sharding = cp_kv_sharding(layout, kPage);
    PagedCacheConfig cc{0, kPage, 24, 8, 16, DType::kF32};
    cc.num_pages = 2;
    for (const Request& r : s.reqs) cc.num_pages += s.sharding.pages_needed(r.seq_len(), kPage);
    s.num_pages = cc.num_pages;
    auto cluster = LocalCpCluster::create(*s.backend, layout, cc);
    EXPECT_TRUE(cluster.ok()) << cluster.status().to_string();
    s.cluster = std::move(*cluster);
    PageAllocator alloc(cc.num_pages, seed | 1);
    std::vector<SequencePages> seqs(s.reqs.size());
    std::vector<const SequencePages*> ptrs;
    for (size_t i = 0; i < s.reqs.size(); ++i) {
      EXPECT_TRUE(seqs[i].reserve(alloc, s.sharding.local_len(s.reqs[i].seq_len(), 0), kPage).ok());
      ptrs.push_back(&seqs[i]);
    }
    s.table = BlockTable::from_sequences(ptrs);
    EXPECT_TRUE(s.cluster->load_context(s.reqs, s.table, s.c.ctx_kv_latent, s.c.ctx_k_rope, s.c.ctx_idx_k).ok());
    return s;
  }
  Result<StepResult> step(const StepConfig& config, const HostStepInputs& in) {
    return cluster->step(config, reqs, table, in);
  }
  // The request of each token, in token order.
  std::vector<int32_t> token_request() const {
    std::vector<int32_t> v;
    for (size_t b = 0; b < reqs.size(); ++b) v.insert(v.end(), reqs[b].query_len, static_cast<int32_t>(b));
    return v;
  }
};

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

class ServingOptions : public ::testing::TestWithParam<Named> {};

TEST_P(ServingOptions, SlotFormIsTheBlockTableLookupOfTheCanonicalRows) {
  Stepper s = Stepper::make(GetParam().layout, testing::test_seed(4101), /*decode_only=*/false);
  const StepConfig config = testing::f32_step_config(s.c);
  auto canonical = s.step(config, testing::case_inputs(s.c));
  ASSERT_TRUE(canonical.ok()) << canonical.status().to_string();
  StepConfig slot_config = config;
  slot_config.topk_form = TopkForm::kSlot;
  auto slots = s.step(slot_config, testing::case_inputs(s.c));
  ASSERT_TRUE(slots.ok()) << slots.status().to_string();
  EXPECT_EQ(slots->topk_form, TopkForm::kSlot);
  // By hand: position e of request b lives on its owner rank at local position l, in page table[b][l / B].
  const std::vector<int32_t> request = s.token_request();
  const int32_t K = config.K;
  int64_t checked = 0;
  for (size_t t = 0; t < request.size(); ++t) {
    for (int32_t i = 0; i < K; ++i) {
      const int32_t e = canonical->topk_indices.data_as<int32_t>()[t * K + i];
      const int32_t got = slots->topk_indices.data_as<int32_t>()[t * K + i];
      if (e < 0) {
        ASSERT_EQ(got, -1) << "token " << t << " entry " << i;
        continue;
      }
      const int64_t l = s.sharding.local_pos(e);
      const int64_t want = int64_t{s.table.page(request[t], l / kPage)} * kPage + l % kPage;
      ASSERT_EQ(got, want) << "token " << t << " entry " << i << " (position " << e << ")";
      ++checked;
    }
  }
  EXPECT_GT(checked, 0);
  // Only the top-k's form changes.
  EXPECT_TRUE(same_bytes(slots->out, canonical->out));
  EXPECT_TRUE(same_bytes(slots->lse, canonical->lse));
}

TEST_P(ServingOptions, Base2LseIsTheNaturalLseTimesLog2E) {
  Stepper s = Stepper::make(GetParam().layout, testing::test_seed(4202), /*decode_only=*/false);
  const StepConfig config = testing::f32_step_config(s.c);
  auto natural = s.step(config, testing::case_inputs(s.c));
  ASSERT_TRUE(natural.ok()) << natural.status().to_string();
  StepConfig base2 = config;
  base2.lse_base = LseBase::kTwo;
  auto two = s.step(base2, testing::case_inputs(s.c));
  ASSERT_TRUE(two.ok()) << two.status().to_string();
  EXPECT_EQ(two->lse_base, LseBase::kTwo);
  for (int64_t i = 0; i < natural->lse.numel(); ++i) {
    const float ln = natural->lse.data_as<float>()[i], l2 = two->lse.data_as<float>()[i];
    const float want = ln * kLog2E;  // the definition: one f32 multiply
    ASSERT_EQ(std::memcmp(&l2, &want, sizeof l2), 0) << "lse " << i << ": " << l2 << " vs " << want;
    if (std::isfinite(ln)) {
      // ... which is ln / ln 2 within rounding (two f32 roundings: at most 2 ulp).
      const double exact = static_cast<double>(ln) / std::log(2.0);
      ASSERT_LE(std::fabs(l2 - exact), 2.0 * std::fabs(std::nextafter(l2, INFINITY) - l2)) << "lse " << i;
    }
  }
  EXPECT_TRUE(same_bytes(two->topk_indices, natural->topk_indices));
  EXPECT_TRUE(same_bytes(two->out, natural->out));
}

TEST_P(ServingOptions, PrecomputedTopkEqualToTheIndexersGivesItsOutputs) {
  Stepper s = Stepper::make(GetParam().layout, testing::test_seed(4303), /*decode_only=*/false);
  const StepConfig config = testing::f32_step_config(s.c);
  auto own = s.step(config, testing::case_inputs(s.c));
  ASSERT_TRUE(own.ok()) << own.status().to_string();
  // With the indexer's inputs, and without any (a layer that reuses another layer's top-k).
  for (bool with_indexer_inputs : {true, false}) {
    HostStepInputs in = testing::case_inputs(s.c);
    in.topk = &own->topk_indices;
    if (!with_indexer_inputs) in.idx_q = in.idx_w = in.idx_k = nullptr;
    auto pre = s.step(config, in);
    ASSERT_TRUE(pre.ok()) << pre.status().to_string();
    EXPECT_TRUE(same_bytes(pre->topk_indices, own->topk_indices)) << "indexer inputs: " << with_indexer_inputs;
    EXPECT_TRUE(same_bytes(pre->out, own->out)) << "indexer inputs: " << with_indexer_inputs;
    EXPECT_TRUE(same_bytes(pre->lse, own->lse)) << "indexer inputs: " << with_indexer_inputs;
  }
  // Together with the other options: the same conversions of the same rows.
  StepConfig both = config;
  both.topk_form = TopkForm::kSlot;
  both.lse_base = LseBase::kTwo;
  auto converted = s.step(both, testing::case_inputs(s.c));
  ASSERT_TRUE(converted.ok()) << converted.status().to_string();
  HostStepInputs in = testing::case_inputs(s.c);
  in.topk = &own->topk_indices;
  auto pre = s.step(both, in);
  ASSERT_TRUE(pre.ok()) << pre.status().to_string();
  EXPECT_TRUE(same_bytes(pre->topk_indices, converted->topk_indices));
  EXPECT_TRUE(same_bytes(pre->lse, converted->lse));
}

TEST_P(ServingOptions, PrecomputedTopkWithFewerKeysIsAttendedAsGiven) {
  // A row may hold fewer positions than min(K, key_len): keep every other one of the indexer's.
  Stepper s = Stepper::make(GetParam().layout, testing::test_seed(4404), /*decode_only=*/true);
  const StepConfig config = testing::f32_step_config(s.c);
  auto own = s.step(config, testing::case_inputs(s.c));
  ASSERT_TRUE(own.ok()) << own.status().to_string();
  auto thin = own->topk_indices.clone();
  ASSERT_TRUE(thin.ok());
  const int32_t K = config.K;
  for (int64_t t = 0; t < thin->dim(0); ++t) {
    int32_t* row = thin->data_as<int32_t>() + t * K;
    int32_t n = 0;
    for (int32_t i = 0; i < K; i += 2) row[n++] = row[i];
    for (int32_t i = n; i < K; ++i) row[i] = -1;
  }
  HostStepInputs in = testing::case_inputs(s.c);
  in.topk = &*thin;
  auto pre = s.step(config, in);
  ASSERT_TRUE(pre.ok()) << pre.status().to_string();
  EXPECT_TRUE(same_bytes(pre->topk_indices, *thin));
  // Against one device given the same rows (the layouts agree on a precomputed top-k as on their own); the
  // same batch where P = 1 (random_cp_batch depends on P).
  if (GetParam().layout.P == 1) {
    Stepper one = Stepper::make(CpLayout{}, testing::test_seed(4404), /*decode_only=*/true);
    auto want = one.step(config, in);
    ASSERT_TRUE(want.ok()) << want.status().to_string();
    double err = 0;
    for (int64_t i = 0; i < want->out.numel(); ++i) err = std::max(err, std::fabs(double{pre->out.get_f32(i)} - want->out.get_f32(i)));
    EXPECT_LT(err, 1e-5);
  }
}

// A row of each kind of malformed precomputed top-k, refused in one line naming the row.
TEST_P(ServingOptions, MalformedPrecomputedRowsAreRefusedNamingTheRow) {
  Stepper s = Stepper::make(GetParam().layout, testing::test_seed(4505), /*decode_only=*/true);
  const StepConfig config = testing::f32_step_config(s.c);
  auto own = s.step(config, testing::case_inputs(s.c));
  ASSERT_TRUE(own.ok()) << own.status().to_string();
  const int32_t K = config.K;
  // Token 0 is a decode with context: its row holds at least two positions.
  ASSERT_GE(own->topk_indices.data_as<int32_t>()[1], 0);
  struct Bad {
    const char* what;
    std::function<void(int32_t*)> spoil;  // on row 0
    const char* message;
  } bads[] = {
      {"a position past the row's keys", [&](int32_t* r) { r[1] = 1 << 30; }, "outside the row's visible keys"},
      {"positions not ascending", [&](int32_t* r) { std::swap(r[0], r[1]); }, "ascending and distinct"},
      {"a repeated position", [&](int32_t* r) { r[1] = r[0]; }, "ascending and distinct"},
      {"a position after a -1", [&](int32_t* r) { r[0] = -1; }, "after a -1"},
      {"an entry below -1", [&](int32_t* r) { r[1] = -7; }, "outside the row's visible keys"},
  };
  for (const Bad& bad : bads) {
    auto rows = own->topk_indices.clone();
    ASSERT_TRUE(rows.ok());
    bad.spoil(rows->data_as<int32_t>());
    HostStepInputs in = testing::case_inputs(s.c);
    in.topk = &*rows;
    auto r = s.step(config, in);
    ASSERT_FALSE(r.ok()) << bad.what;
    const std::string m = r.status().to_string();
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << m;
    EXPECT_NE(m.find("precomputed top-k: row "), std::string::npos) << bad.what << ": " << m;
    EXPECT_NE(m.find(bad.message), std::string::npos) << bad.what << ": " << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
  // The wrong shape, named by the tensor.
  auto wide = Tensor::zeros(DType::kI32, {own->topk_indices.dim(0), K + 1});
  ASSERT_TRUE(wide.ok());
  HostStepInputs in = testing::case_inputs(s.c);
  in.topk = &*wide;
  auto r = s.step(config, in);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().to_string().find("topk: expected I32"), std::string::npos) << r.status().to_string();
  // Without a precomputed top-k the indexer's inputs are needed.
  in = testing::case_inputs(s.c);
  in.idx_k = nullptr;
  r = s.step(config, in);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().to_string().find("idx_k"), std::string::npos) << r.status().to_string();
}

INSTANTIATE_TEST_SUITE_P(Layouts, ServingOptions, ::testing::ValuesIn(layouts()),
                         [](const ::testing::TestParamInfo<Named>& i) {
                           std::string n;
                           for (const char* p = i.param.name; *p != '\0'; ++p) {
                             n += std::isalnum(static_cast<unsigned char>(*p)) ? *p : '_';
                           }
                           return n;
                         });

// The step's own entry point refuses a missing indexer input in one line (device pointers: here host memory).
TEST(ServingOptionsStep, StepRunWithoutIndexerInputsNeedsAPrecomputedTopk) {
  auto backend = make_cpu_backend(1);
  PagedCacheConfig cc{4, kPage, 24, 8, 16, DType::kF32};
  auto cache = PagedKvCache::create(*backend, cc);
  ASSERT_TRUE(cache.ok());
  const std::vector<Request> reqs = {{1, 3}};
  BlockTable table{1, 1, {2}};
  StepConfig config;
  config.H = 4;
  config.Dl = 24;
  config.Dr = 8;
  config.Hi = 2;
  config.Di = 16;
  config.K = 8;
  config.scale = 0.5f;
  config.act_dtype = DType::kF32;
  std::vector<float> q(4 * 24), qr(4 * 8), kv(24), kr(8), iq(2 * 16), iw(2), ik(16), out(4 * 24), lse(4);
  std::vector<int32_t> topk(8);
  StepInputs in{q.data(), qr.data(), kv.data(), kr.data(), iq.data(), iw.data(), nullptr};
  StepOutputs o{topk.data(), out.data(), lse.data()};
  Status st = step_run(*backend, config, reqs, table, *cache, in, o);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("idx_k is null"), std::string::npos) << st.to_string();
  // With a precomputed row it runs (keys 0..3 visible to the new token).
  std::vector<int32_t> pre = {0, 2, 3, -1, -1, -1, -1, -1};
  in.idx_q = nullptr;
  in.idx_w = nullptr;
  in.topk = pre.data();
  st = step_run(*backend, config, reqs, table, *cache, in, o);
  // (the context keys were never written: NaN; the step still runs and returns the rows)
  EXPECT_TRUE(st.ok()) << st.to_string();
  EXPECT_EQ(topk, pre);
}

// A result file says which forms it holds; a default result has no metadata (the same bytes as before).
TEST(ServingOptionsResult, TheResultFileRecordsItsForms) {
  StepResult r;
  r.topk_indices = std::move(Tensor::zeros(DType::kI32, {2, 3})).value();
  r.out = std::move(Tensor::zeros(DType::kF32, {2, 1, 4})).value();
  r.lse = std::move(Tensor::zeros(DType::kF32, {2, 1})).value();
  const std::string dir = ::testing::TempDir();
  const std::string plain = dir + "/serving_plain.safetensors", forms = dir + "/serving_forms.safetensors";
  ASSERT_TRUE(result_write(plain, r).ok());
  auto file = safetensors_read(plain);
  ASSERT_TRUE(file.ok());
  EXPECT_TRUE(file->metadata.empty());
  r.topk_form = TopkForm::kSlot;
  r.lse_base = LseBase::kTwo;
  ASSERT_TRUE(result_write(forms, r).ok());
  file = safetensors_read(forms);
  ASSERT_TRUE(file.ok());
  EXPECT_EQ(file->metadata["topk_form"], "slot");
  EXPECT_EQ(file->metadata["lse_base"], "2");
  auto back = result_read(forms);
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->topk_form, TopkForm::kSlot);
  EXPECT_EQ(back->lse_base, LseBase::kTwo);
  auto back_plain = result_read(plain);
  ASSERT_TRUE(back_plain.ok());
  EXPECT_EQ(back_plain->topk_form, TopkForm::kCanonical);
  EXPECT_EQ(back_plain->lse_base, LseBase::kNatural);
  // Other metadata, or another value, is refused naming the key.
  file->metadata["lse_base"] = "10";
  auto bytes = safetensors_serialize(*file);
  ASSERT_TRUE(bytes.ok());
  const std::string bad = dir + "/serving_bad.safetensors";
  ASSERT_TRUE(safetensors_write(bad, *file).ok());
  auto refused = result_read(bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().to_string().find("\"lse_base\" must be \"2\""), std::string::npos)
      << refused.status().to_string();
}

}  // namespace
}  // namespace dsacp
