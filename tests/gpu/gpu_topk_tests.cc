// GPU top-k on given scores (launch_topk_rows): every form (the default pick, the cluster kernel with 1, 2, 4, 8 CTAs a
// row, its slices cached in shared memory or read again, the one-CTA kernel, the register form with its cluster
// chosen or 1, 2, 4, 8 CTAs and its candidate buffer's edge) against a host reference of the
// contract's canonical rows (K highest by the CPU oracle's rank key: NaN lowest, -0 == +0, ties to the lower
// position; ascending; -1 padded). Row lengths 0 .. 1M around every boundary (K +- 1, the cache and slice sizes),
// K 1 .. 4096, random rows from a fresh seed, heavy ties, NaN / +-inf / -0 rows, 1, 64 and 4096 rows a launch,
// bit-identical reruns, and the optional topk_scores.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "dsacp/random.h"
#include "gpu/gpu_test.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cuda/indexer_topk/cluster_topk.h"

namespace dsacp::testing {
namespace {

using cuda::TopkLaunchOptions;

enum class Kind { kRandom, kNarrow, kAllEqual, kSixty, kHostile, kAllNaN, kZeros, kHalfTied };

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kRandom: return "random";
    case Kind::kNarrow: return "narrow";
    case Kind::kAllEqual: return "all-equal";
    case Kind::kSixty: return "60-values";
    case Kind::kHostile: return "nan-inf-zero";
    case Kind::kAllNaN: return "all-nan";
    case Kind::kZeros: return "+-0";
    case Kind::kHalfTied: return "half-tied";
  }
  return "?";
}

float score(Kind kind, uint64_t seed, uint64_t row, uint64_t i) {
  const uint64_t h = counter_hash(seed, row, i);
  const float u = static_cast<float>((h >> 40) * (1.0 / 16777216.0));  // [0, 1)
  switch (kind) {
    case Kind::kRandom:  // signed, over 16 octaves
      return (u - 0.5f) * std::ldexp(1.f, static_cast<int>((h >> 8) % 16) - 8);
    case Kind::kNarrow:  // [1, 2): every key shares the first digit's sign and exponent
      return 1.f + u;
    case Kind::kAllEqual:
      return 0.375f;
    case Kind::kSixty:
      return static_cast<float>(h % 60) * 0.25f - 7.f;
    case Kind::kHostile: {
      switch (h % 10) {
        case 0: return std::numeric_limits<float>::quiet_NaN();
        case 1: return std::numeric_limits<float>::infinity();
        case 2: return -std::numeric_limits<float>::infinity();
        case 3: return -0.f;
        case 4: return 0.f;
        case 5: return std::numeric_limits<float>::denorm_min() * static_cast<float>(h % 7);
        default: return u - 0.5f;
      }
    }
    case Kind::kAllNaN:
      return std::numeric_limits<float>::quiet_NaN();
    case Kind::kZeros:
      return (h & 1) ? -0.f : 0.f;
    case Kind::kHalfTied:  // every other key 0.375, the rest spread around it: a crowded boundary bin
      return (h & 1) ? 0.375f : 0.25f + u * 0.25f;
  }
  return 0.f;
}

// The canonical row of scores s[0, n) for K.
void reference_row(const float* s, int32_t n, int32_t K, int32_t* out) {
  if (n <= K) {
    for (int32_t i = 0; i < K; ++i) out[i] = i < n ? i : -1;
    return;
  }
  std::vector<uint64_t> keys(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) keys[i] = cpu::topk_rank_key(s[i], i);
  std::nth_element(keys.begin(), keys.begin() + (K - 1), keys.end(), std::greater<uint64_t>());
  for (int32_t i = 0; i < K; ++i) out[i] = cpu::topk_rank_key_position(keys[i]);
  std::sort(out, out + K);
}

struct Batch {  // rows of scores on the device, as the indexer's score buffer lays them out
  int32_t K = 0, max_len = 0;
  std::vector<int32_t> len;
  std::vector<int64_t> offset;
  std::vector<float> scores;
  std::vector<int32_t> ref;
  float* d_scores = nullptr;
  int64_t* d_offset = nullptr;
  int32_t *d_len = nullptr, *d_topk = nullptr;
  float* d_topk_scores = nullptr;
};

bool ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) std::printf("%s: %s\n", what, cudaGetErrorString(e));
  return e == cudaSuccess;
}

bool make_batch(Batch& b, int32_t K, const std::vector<int32_t>& lens, const std::vector<Kind>& kinds, uint64_t seed) {
  b.K = K;
  b.len = lens;
  b.max_len = lens.empty() ? 0 : *std::max_element(lens.begin(), lens.end());
  int64_t total = 0;
  for (int32_t n : lens) {
    b.offset.push_back(total);
    total += (int64_t{n} + 3) / 4 * 4;
  }
  b.scores.assign(static_cast<size_t>(std::max<int64_t>(total, 4)), 0.f);
  b.ref.assign(lens.size() * K, -1);
  for (size_t r = 0; r < lens.size(); ++r) {
    float* s = b.scores.data() + b.offset[r];
    for (int32_t i = 0; i < lens[r]; ++i) s[i] = score(kinds[r % kinds.size()], seed, r, static_cast<uint64_t>(i));
    reference_row(s, lens[r], K, b.ref.data() + r * K);
  }
  const size_t rows = std::max<size_t>(lens.size(), 1);
  bool ok = ck(cudaMalloc(&b.d_scores, b.scores.size() * 4), "cudaMalloc scores") &&
            ck(cudaMalloc(&b.d_offset, rows * 8), "cudaMalloc offset") &&
            ck(cudaMalloc(&b.d_len, rows * 4), "cudaMalloc len") &&
            ck(cudaMalloc(&b.d_topk, rows * K * 4), "cudaMalloc topk") &&
            ck(cudaMalloc(&b.d_topk_scores, rows * K * 4), "cudaMalloc topk_scores");
  ok = ok && ck(cudaMemcpy(b.d_scores, b.scores.data(), b.scores.size() * 4, cudaMemcpyHostToDevice), "upload");
  ok = ok && ck(cudaMemcpy(b.d_offset, b.offset.data(), lens.size() * 8, cudaMemcpyHostToDevice), "upload");
  ok = ok && ck(cudaMemcpy(b.d_len, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice), "upload");
  return ok;
}

void free_batch(Batch& b) {
  for (void* p : {static_cast<void*>(b.d_scores), static_cast<void*>(b.d_offset), static_cast<void*>(b.d_len),
                  static_cast<void*>(b.d_topk), static_cast<void*>(b.d_topk_scores)}) {
    if (p != nullptr) cudaFree(p);
  }
}

struct Form {
  std::string name;
  TopkLaunchOptions opt;
  bool default_path = false;  // through launch_radix_select_topk, as the indexer calls it
};

std::vector<Form> all_forms() {
  std::vector<Form> f;
  f.push_back({"default", {}, true});
  for (int c : {1, 2, 4, 8}) {
    for (int cache : {0, 1}) {
      TopkLaunchOptions o;
      o.form = cuda::TopkForm::kCluster;
      o.cluster = c;
      o.cache = cache;
      f.push_back({"C=" + std::to_string(c) + (cache ? " cached" : " uncached"), o});
    }
  }
  TopkLaunchOptions one;
  one.one_cta = true;
  f.push_back({"one-CTA", one});
  for (int c : {0, 1, 2, 4, 8}) {  // the register form, its cluster chosen (0) or given
    TopkLaunchOptions o;
    o.form = cuda::TopkForm::kRegister;
    o.cluster = c;
    f.push_back({c == 0 ? std::string("reg") : "reg C=" + std::to_string(c), o});
  }
  // the filter form, its threads and cluster chosen (0) or given
  for (const auto& [th, c] : std::vector<std::pair<int, int>>{{0, 0}, {1024, 1}, {1024, 2}, {1024, 8}, {512, 4},
                                                              {256, 1}, {256, 8}}) {
    TopkLaunchOptions o;
    o.form = cuda::TopkForm::kFilter;
    o.threads = th;
    o.cluster = c;
    f.push_back({th == 0 ? std::string("filter") : "filter T=" + std::to_string(th) + " C=" + std::to_string(c), o});
  }
  return f;
}

// The forms named (a subset of all_forms, in its order).
std::vector<Form> pick_forms(const std::vector<Form>& all, const std::vector<std::string>& names) {
  std::vector<Form> f;
  for (const Form& x : all) {
    if (std::find(names.begin(), names.end(), x.name) != names.end()) f.push_back(x);
  }
  return f;
}

// Runs one form on the batch; returns the rows (and scores) it wrote, or an empty vector on a failure (reported).
bool run_form(Batch& b, const Form& f, std::vector<int32_t>& topk, std::vector<float>& scores, std::string& err) {
  const size_t rows = b.len.size();
  cudaMemset(b.d_topk, 0x7e, rows * b.K * 4);
  cudaMemset(b.d_topk_scores, 0x7e, rows * b.K * 4);
  IndexerTopkParams p;
  p.rows.num_tokens = static_cast<int64_t>(rows);
  p.rows.key_len = b.d_len;
  p.K = b.K;
  p.topk = b.d_topk;
  p.topk_scores = b.d_topk_scores;
  cuda::LaunchContext ctx;
  int dev = 0, sms = 132;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  ctx.num_sms = sms;
  static cuda::InlinePlan inl;  // num_groups 0: the device score offsets
  const Status s = f.default_path
                       ? cuda::launch_radix_select_topk(p, 0, static_cast<int64_t>(rows), b.max_len, b.d_offset,
                                                        b.d_scores, inl, ctx)
                       : cuda::launch_topk_rows(p, 0, static_cast<int64_t>(rows), b.max_len, b.d_offset, b.d_scores,
                                                inl, ctx, f.opt);
  if (!s.ok()) {
    err = s.to_string();
    return false;
  }
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    err = cudaGetErrorString(e);
    return false;
  }
  topk.resize(rows * b.K);
  scores.resize(rows * b.K);
  cudaMemcpy(topk.data(), b.d_topk, topk.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(scores.data(), b.d_topk_scores, scores.size() * 4, cudaMemcpyDeviceToHost);
  return true;
}

// Checks every form (or the ones named) on the batch against the reference; reruns the default once.
void check_batch(CheckLog& log, const std::string& name, Batch& b, const std::vector<Form>& forms, uint64_t seed) {
  for (const Form& f : forms) {
    std::vector<int32_t> topk;
    std::vector<float> sc;
    std::string err;
    const std::string what = "topk_rows " + name + " [" + f.name + "]";
    // the filter form refuses a cluster whose slices' bitmaps do not fit shared memory (the default never asks)
    const bool refuse = f.opt.form == cuda::TopkForm::kFilter && f.opt.cluster > 0 &&
                        !cuda::filter_topk_fits(b.max_len, f.opt.cluster, f.opt.threads);
    if (!run_form(b, f, topk, sc, err)) {
      const bool as_expected = refuse && err.rfind("unsupported: filter top-k", 0) == 0;
      log.report(as_expected, what, (as_expected ? "refused as expected: " : "") + err + " (seed " +
                                        std::to_string(seed) + ")");
      continue;
    }
    if (refuse) {
      log.report(false, what, "expected a refusal (slices too long for the filter form's bitmaps)");
      continue;
    }
    int64_t bad = 0, bad_scores = 0;
    std::string first;
    for (size_t r = 0; r < b.len.size(); ++r) {
      const int32_t* g = &topk[r * b.K];
      const int32_t* w = &b.ref[r * b.K];
      for (int32_t i = 0; i < b.K; ++i) {
        if (g[i] != w[i]) {
          if (bad == 0) {
            first = ", first: row " + std::to_string(r) + " (len " + std::to_string(b.len[r]) + ") [" +
                    std::to_string(i) + "] = " + std::to_string(g[i]) + ", expected " + std::to_string(w[i]);
          }
          ++bad;
          break;
        }
      }
      for (int32_t i = 0; i < b.K; ++i) {  // the scores of the taken positions, bit for bit; -inf after them
        const float want = w[i] >= 0 ? b.scores[b.offset[r] + w[i]] : -std::numeric_limits<float>::infinity();
        if (std::memcmp(&sc[r * b.K + i], &want, 4) != 0) {
          ++bad_scores;
          break;
        }
      }
    }
    bool rerun_same = true;
    if (f.default_path) {
      std::vector<int32_t> topk2;
      std::vector<float> sc2;
      rerun_same = run_form(b, f, topk2, sc2, err) && topk2 == topk &&
                   std::memcmp(sc2.data(), sc.data(), sc.size() * 4) == 0;
    }
    char buf[160];
    std::snprintf(buf, sizeof buf, "rows %zu K=%d bad rows %lld, bad score rows %lld%s, seed %llu", b.len.size(), b.K,
                  static_cast<long long>(bad), static_cast<long long>(bad_scores),
                  f.default_path ? (rerun_same ? ", rerun identical" : ", RERUN DIFFERS") : "",
                  static_cast<unsigned long long>(seed));
    log.report(bad == 0 && bad_scores == 0 && rerun_same, what, buf + first);
  }
}

void run_case(CheckLog& log, const std::string& name, int32_t K, const std::vector<int32_t>& lens,
              const std::vector<Kind>& kinds, uint64_t seed, const std::vector<Form>& forms) {
  Batch b;
  std::string kn;
  for (Kind k : kinds) kn += std::string(kn.empty() ? "" : "+") + kind_name(k);
  if (make_batch(b, K, lens, kinds, seed)) {
    check_batch(log, name + " " + kn, b, forms, seed);
  } else {
    log.report(false, "topk_rows " + name, "device buffers");
  }
  free_batch(b);
}

void test_topk_rows(CheckLog& log, uint64_t seed, bool small) {
  const std::vector<Form> forms = all_forms();
  const std::vector<Form> main_forms = pick_forms(
      forms, {"default", "C=1 cached", "C=8 uncached", "C=8 cached", "one-CTA", "reg", "reg C=1", "reg C=8", "filter",
              "filter T=1024 C=2", "filter T=256 C=1", "filter T=256 C=8"});
  // Every K over the row lengths around its boundaries and the cache / slice sizes.
  const std::vector<int32_t> ks = small ? std::vector<int32_t>{7, 2048}
                                        : std::vector<int32_t>{1, 7, 512, 1000, 2048, 2049, 4096};
  for (int32_t K : ks) {
    std::vector<int32_t> lens = {0, 1, K - 1, K, K + 1, 2048, 4097, 32768};
    if (!small) {
      for (int32_t n : {49151, 49152, 49153, 65536}) lens.push_back(n);
    }
    lens.erase(std::remove_if(lens.begin(), lens.end(), [](int32_t n) { return n < 0; }), lens.end());
    run_case(log, "lengths", K, lens, {Kind::kRandom, Kind::kNarrow}, seed + K, small ? main_forms : forms);
  }
  // The register form's candidate buffer at its edge: a boundary bin of kRegisterTopkCandidates - 1, exactly that
  // many, and more keys (the fallback), all tied or half tied around distinct keys.
  {
    const int32_t cap = cuda::kRegisterTopkCandidates;
    const std::vector<Form> reg = pick_forms(forms, {"reg", "reg C=1", "reg C=2", "reg C=8"});
    for (int32_t K : {7, 2048}) {
      run_case(log, "candidates", K, {cap - 1, cap, cap + 1, 20000}, {Kind::kAllEqual}, seed + 10 + K, reg);
      if (!small) run_case(log, "candidates", K, {2 * cap - 2, 2 * cap, 2 * cap + 2, 40001}, {Kind::kHalfTied},
                           seed + 11 + K, reg);
    }
  }
  // The filter form's candidate buffer at its edge (4096 keys of the boundary bin at 512 and 1024 threads, 2048 at
  // 256): all tied rows of that many keys and one more or less (the fallback's radix passes), one CTA and a cluster.
  {
    const std::vector<Form> fil = pick_forms(
        forms, {"filter", "filter T=1024 C=1", "filter T=1024 C=2", "filter T=512 C=4", "filter T=256 C=1",
                "filter T=256 C=8"});
    for (int32_t K : {7, 1000}) {
      run_case(log, "filter candidates", K, {2047, 2048, 2049, 4095, 4096, 4097, 9000}, {Kind::kAllEqual},
               seed + 12 + K, fil);
      run_case(log, "filter candidates", K, {4095, 8192, 8194, 12000}, {Kind::kHalfTied, Kind::kNarrow},
               seed + 13 + K, fil);
    }
  }
  if (small) {
    run_case(log, "ties", 512, {5000, 20000}, {Kind::kAllEqual, Kind::kSixty, Kind::kHostile}, seed + 1, main_forms);
    return;
  }
  // Long rows: 128K and 1M (the slices too long for shared memory), K 2048 and 4096.
  run_case(log, "long", 2048, {131072, 1 << 20, 300000}, {Kind::kRandom}, seed + 2, forms);
  run_case(log, "long", 4096, {1 << 20, 131071}, {Kind::kRandom, Kind::kHostile}, seed + 3, main_forms);
  // Slices longer than shared memory holds (partly cached, the rest read again) with heavy ties.
  run_case(log, "long ties", 2048, {1 << 20, 600000}, {Kind::kAllEqual, Kind::kSixty}, seed + 9, main_forms);
  // Heavy ties and the hostile values, short and long rows, small and large K.
  for (int32_t K : {7, 2048}) {
    run_case(log, "ties", K, {5000, 32768, 131072}, {Kind::kAllEqual, Kind::kSixty}, seed + 4 + K, forms);
    run_case(log, "hostile", K, {3000, 32768, 131072, 40000},
             {Kind::kHostile, Kind::kAllNaN, Kind::kZeros, Kind::kRandom}, seed + 5 + K, forms);
  }
  // One row; b = 64 rows of a 32K decode; 4096 rows of a causal prefill (lengths 1 .. 8192).
  run_case(log, "b=1", 2048, {70000}, {Kind::kRandom}, seed + 6, forms);
  run_case(log, "b=64", 2048, std::vector<int32_t>(64, 32768), {Kind::kRandom, Kind::kSixty}, seed + 7, forms);
  {
    std::vector<int32_t> lens(4096);
    for (size_t i = 0; i < lens.size(); ++i) lens[i] = static_cast<int32_t>(1 + counter_hash(seed, 8, i) % 8192);
    run_case(log, "b=4096 prefill", 2048, lens, {Kind::kRandom}, seed + 8, main_forms);
  }
}

}  // namespace

class TopK : public GpuTest {};

// --sanitizer-subset: K 7 and 2048 over the main forms, no long rows.
TEST_F(TopK, Rows) {
  const GpuTestOptions& o = gpu_test_options();
  test_topk_rows(check_log(), o.seed, o.sanitizer_subset);
}

}  // namespace dsacp::testing
