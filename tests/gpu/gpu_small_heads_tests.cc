// GPU checks of the memory-streaming sparse MLA kernel for 16-head groups (sparse_mla_small_heads.cu, forced with
// CudaBackendOptions::MlaKernel::kSmallHeads) against the CPU oracle: H = 1, 2, 4, 8, 16 and the DCP head-block
// layouts (blocks of 8 and 16 heads), bf16 pools and fp8_ds_mla records, page sizes 1 / 61 / 64, -1 holes with
// garbage after them, short rows, a row with no key, key lengths below top-k, NaN in every unused cache slot,
// split-K through the merge kernel (the rule, and forced) and through the cluster merge, 1..8 splits, f32 and bf16
// out; reruns
// bit-identical; a bad page id reported as out_of_range.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "dsacp/backend.h"
#include "dsacp/dtype.h"
#include "dsacp/fp8.h"
#include "gpu/gpu_kernel_data.h"
#include "gpu/gpu_test.h"
#include "support/compare.h"
#include "support/random_values.h"

namespace dsacp::testing {
namespace {

constexpr int kDl = 512, kDr = 64;
const int kRec = fp8_ds_mla_record_bytes(kDl, kDr);

template <typename T>
bool upload(Backend& be, const std::vector<T>& v, DeviceBuffer* d) {
  auto r = be.allocate(std::max<size_t>(1, v.size() * sizeof(T)));
  if (!r.ok()) return false;
  *d = std::move(r).value();
  return be.copy_to_device(d->get(), v.data(), v.size() * sizeof(T)).ok();
}
template <typename T>
std::vector<T> download(Backend& be, const DeviceBuffer& d, size_t n) {
  std::vector<T> v(n);
  if (!be.copy_to_host(v.data(), d.get(), n * sizeof(T)).ok()) v.clear();
  return v;
}

struct SmallCase {
  std::string name;
  int H = 16, K = 2048, page_size = 64;
  std::vector<int64_t> ctx;
  std::vector<int> qlen;
  DType out_dtype = DType::kF32;
  int head_blocks = 1;
  int splits = 0;         // CudaBackendOptions::mla_splits (0: the rule)
  int merge = -1;  // split-K: -1 the rule (the merge kernel for 16-head groups), 1 in a cluster, 0 the merge
                   // kernel forced
};

void run_case(Backend& cpu, const SmallCase& c, bool fp8, uint64_t seed, CheckLog& log) {
  const std::string name = std::string("small_heads ") + (fp8 ? "fp8_ds_mla " : "bf16 ") + c.name;
  CudaBackendOptions o;
  o.mla_kernel = CudaBackendOptions::MlaKernel::kSmallHeads;
  o.mla_splits = c.splits;
  o.mla_cluster_merge = c.merge < 0    ? CudaBackendOptions::Choice::kAuto
                        : c.merge == 1 ? CudaBackendOptions::Choice::kOn
                                       : CudaBackendOptions::Choice::kOff;
  auto be = make_cuda_backend(0, o);
  if (!be.ok()) {
    log.report(false, name, "backend: " + be.status().to_string());
    return;
  }
  Backend& gpu = **be;
  auto [lens, request, key_len] = query_rows(c.ctx, c.qlen);
  const int64_t T = static_cast<int64_t>(request.size());
  const int32_t ps = c.page_size;
  int64_t need = 0, maxp = 1;
  for (int64_t l : lens) {
    need += (l + ps - 1) / ps;
    maxp = std::max<int64_t>(maxp, (l + ps - 1) / ps);
  }
  const int64_t num_pages = need + 3;  // shuffled pages, 3 spare
  std::vector<int32_t> ids(static_cast<size_t>(num_pages));
  std::iota(ids.begin(), ids.end(), 0);
  for (size_t i = ids.size(); i > 1; --i) std::swap(ids[i - 1], ids[splitmix64(seed + i) % i]);
  std::vector<int32_t> bt(lens.size() * maxp, -1);
  size_t next = 0;
  std::vector<int64_t> slots;
  for (size_t b = 0; b < lens.size(); ++b) {
    for (int64_t cpg = 0; cpg < (lens[b] + ps - 1) / ps; ++cpg) bt[b * maxp + cpg] = ids[next++];
    for (int64_t j = 0; j < lens[b]; ++j) slots.push_back(int64_t{bt[b * maxp + j / ps]} * ps + j % ps);
  }
  const int64_t nkeys = static_cast<int64_t>(slots.size());
  std::vector<float> lat(nkeys * kDl), rope(nkeys * kDr);
  for (int64_t i = 0; i < nkeys; ++i) {
    const float amp = 0.25f + 2.f * (splitmix64(seed + 3 * i) % 8) / 8.f;  // keys (and tiles) of different scales
    for (int d = 0; d < kDl; ++d) lat[i * kDl + d] = amp * uniform_at(seed + 100, i * kDl + d) * (1.f + (d / 128));
    for (int d = 0; d < kDr; ++d) rope[i * kDr + d] = uniform_at(seed + 200, i * kDr + d);
  }
  // the pools: NaN in every unused slot; bf16 latent + rope, or records quantized by the CPU cache write
  std::vector<uint8_t> pool;                 // fp8 records
  std::vector<uint16_t> lat_pool, rope_pool;  // bf16
  PagedPoolView lv, rv;
  if (fp8) {
    pool.assign(num_pages * ps * kRec, 0xff);
    CacheWriteParams w;
    w.rows = lat.data();
    w.rows_dtype = DType::kF32;
    w.num_rows = nkeys;
    w.slots = slots.data();
    w.pool = PagedPoolView{pool.data(), DType::kF8E4M3, num_pages, ps, kDl, kRec};
    w.more[0].rows = rope.data();
    w.more[0].slots = slots.data();
    w.more[0].pool = PagedPoolView{pool.data(), DType::kBF16, num_pages, ps, kDr, kRec};
    if (Status s = cache_write_run(cpu, w); !s.ok()) {
      log.report(false, name, "CPU cache write: " + s.to_string());
      return;
    }
    lv = w.pool;
    rv = w.more[0].pool;
  } else {
    lat_pool.assign(num_pages * ps * kDl, 0x7fc0);
    rope_pool.assign(num_pages * ps * kDr, 0x7fc0);
    for (int64_t i = 0; i < nkeys; ++i) {
      for (int d = 0; d < kDl; ++d) lat_pool[slots[i] * kDl + d] = f32_to_bf16(lat[i * kDl + d]).bits;
      for (int d = 0; d < kDr; ++d) rope_pool[slots[i] * kDr + d] = f32_to_bf16(rope[i * kDr + d]).bits;
    }
    lv = PagedPoolView{lat_pool.data(), DType::kBF16, num_pages, ps, kDl};
    rv = PagedPoolView{rope_pool.data(), DType::kBF16, num_pages, ps, kDr};
  }
  const std::vector<uint16_t> qn = random_bf16(T * c.H * kDl, seed + 300), qr = random_bf16(T * c.H * kDr, seed + 301);
  // short rows (-1, then garbage) and a row with no key at all
  const std::vector<int32_t> topk = stride_walk_topk(key_len, c.K, seed, /*hostile=*/true);
  SparseMlaParams p;
  p.rows.num_tokens = T;
  p.H = c.H;
  p.Dl = kDl;
  p.Dr = kDr;
  p.K = c.K;
  p.scale = 0.0721f;
  p.q_dtype = DType::kBF16;
  p.block_table = {nullptr, static_cast<int32_t>(lens.size()), static_cast<int32_t>(maxp)};
  p.out_dtype = DType::kF32;
  p.head_blocks = c.head_blocks;
  std::vector<float> out_c(T * c.H * kDl), lse_c(T * c.H);
  SparseMlaParams pc = p;
  pc.rows.request = request.data();
  pc.rows.key_len = key_len.data();
  pc.q_nope = qn.data();
  pc.q_rope = qr.data();
  pc.latent = lv;
  pc.rope = rv;
  pc.block_table.data = bt.data();
  pc.topk = topk.data();
  pc.out = out_c.data();
  pc.lse = lse_c.data();
  if (Status s = sparse_mla_run(cpu, pc); !s.ok()) {
    log.report(false, name, "CPU oracle: " + s.to_string());
    return;
  }
  DeviceBuffer d_req, d_len, d_qn, d_qr, d_pool, d_lat, d_rope, d_bt, d_topk, d_out, d_lse;
  const size_t out_n = static_cast<size_t>(T * c.H * kDl);
  const size_t out_bytes = out_n * dtype_size(c.out_dtype);
  bool up = upload(gpu, request, &d_req) && upload(gpu, key_len, &d_len) && upload(gpu, qn, &d_qn) &&
            upload(gpu, qr, &d_qr) && upload(gpu, bt, &d_bt) && upload(gpu, topk, &d_topk) &&
            upload(gpu, std::vector<uint8_t>(out_bytes, 0xff), &d_out) &&
            upload(gpu, std::vector<float>(T * c.H, NAN), &d_lse);
  up = up && (fp8 ? upload(gpu, pool, &d_pool) : upload(gpu, lat_pool, &d_lat) && upload(gpu, rope_pool, &d_rope));
  if (!up) {
    log.report(false, name, "device upload failed");
    return;
  }
  SparseMlaParams pg = p;
  pg.rows.request = static_cast<const int32_t*>(d_req.get());
  pg.rows.key_len = static_cast<const int32_t*>(d_len.get());
  pg.q_nope = d_qn.get();
  pg.q_rope = d_qr.get();
  pg.latent = lv;
  pg.rope = rv;
  pg.latent.data = fp8 ? d_pool.get() : d_lat.get();
  pg.rope.data = fp8 ? d_pool.get() : d_rope.get();
  pg.block_table.data = static_cast<const int32_t*>(d_bt.get());
  pg.topk = static_cast<const int32_t*>(d_topk.get());
  pg.out = d_out.get();
  pg.out_dtype = c.out_dtype;
  pg.lse = static_cast<float*>(d_lse.get());
  const Status sg = sparse_mla_run(gpu, pg);
  if (!sg.ok()) {
    log.report(false, name, sg.to_string());
    return;
  }
  const std::vector<uint8_t> raw = download<uint8_t>(gpu, d_out, out_bytes);
  const std::vector<float> lse_g = download<float>(gpu, d_lse, T * c.H);
  std::vector<float> out_g(out_n);
  if (c.out_dtype == DType::kBF16) {
    for (size_t i = 0; i < out_n && raw.size() == out_bytes; ++i) {
      uint16_t b;
      std::memcpy(&b, &raw[i * 2], 2);
      out_g[i] = bf16_to_f32(bf16{b});
    }
  } else if (raw.size() == out_bytes) {
    std::memcpy(out_g.data(), raw.data(), out_bytes);
  }
  bool mismatch = raw.size() != out_bytes;
  const double e_out = rel_error_finite(out_g, out_c, &mismatch), e_lse = rel_error_finite(lse_g, lse_c, &mismatch);
  const Status sg2 = sparse_mla_run(gpu, pg);
  const bool same = sg2.ok() && download<uint8_t>(gpu, d_out, out_bytes) == raw &&
                    download<float>(gpu, d_lse, T * c.H) == lse_g;
  const double tol = c.out_dtype == DType::kBF16 ? 1e-2 : 5e-3;
  char buf[200];
  std::snprintf(buf, sizeof buf, "T=%lld rel err out %.2e lse %.2e, non-finite %s, rerun %s",
                static_cast<long long>(T), e_out, e_lse, mismatch ? "MISMATCH" : "as the oracle",
                same ? "bit-identical" : "DIFFERS");
  log.report(!mismatch && e_out < tol && e_lse < 1e-3 && same, name, buf);

  if (c.page_size == 61) {  // a block-table entry outside the cache: out_of_range (or unused), never a crash
    std::vector<int32_t> bad = bt;
    bad[0] = static_cast<int32_t>(num_pages + 3);
    DeviceBuffer d_bad;
    if (upload(gpu, bad, &d_bad)) {
      SparseMlaParams pb = pg;
      pb.block_table.data = static_cast<const int32_t*>(d_bad.get());
      const Status s = sparse_mla_run(gpu, pb);
      log.report(s.ok() || s.code() == StatusCode::kOutOfRange, name + ": bad page id -> out_of_range or unused",
                 s.to_string());
    }
  }
}

// The cases on bf16 pools (fp8 false) or fp8_ds_mla records; small: every other case, a shorter prefill.
void small_heads_cases(Backend& cpu, uint64_t seed, bool small, CheckLog& log, bool fp8) {
  std::vector<SmallCase> cases;
  cases.push_back({"decode H=1 page64 K=2048", 1, 2048, 64, {3000, 2100, 900}, {1, 1, 1}});
  cases.push_back({"decode H=2 page61 K=2048", 2, 2048, 61, {2500, 4100}, {1, 1}});
  cases.push_back({"decode H=4 page1 K=512", 4, 512, 1, {1500, 700, 40}, {1, 1, 1}});
  cases.push_back({"decode H=8 page64 K=2048 bf16 out", 8, 2048, 64, {3000, 2100, 900}, {1, 1, 1}, DType::kBF16});
  cases.push_back({"decode H=16 page64 K=2048 key_len<K", 16, 2048, 64, {9000, 2100, 1000, 300}, {1, 1, 1, 1}});
  cases.push_back({"MTP-2 H=16 page61 K=2048 bf16 out", 16, 2048, 61, {5000, 2500}, {2, 2}, DType::kBF16});
  cases.push_back({"decode H=16 head_blocks=2 page64 K=2048", 16, 2048, 64, {3000, 2100}, {1, 1}, DType::kF32, 2});
  cases.push_back({"decode H=32 head_blocks=2 page61 K=2048 bf16 out", 32, 2048, 61, {3000, 2100}, {1, 1},
                   DType::kBF16, 2});
  cases.push_back({"decode H=16 page64 K=2048 splits=1", 16, 2048, 64, {3000, 900}, {1, 1}, DType::kF32, 1, 1});
  cases.push_back({"decode H=16 page64 K=2048 splits=3 cluster", 16, 2048, 64, {3000, 2100}, {1, 1}, DType::kF32, 1,
                   3, 1});
  cases.push_back({"decode H=8 page61 K=2048 splits=8 cluster bf16 out", 8, 2048, 61, {4000, 2100}, {1, 1},
                   DType::kBF16, 1, 8, 1});
  cases.push_back({"decode H=16 page1 K=2048 splits=2 cluster", 16, 2048, 1, {2600, 3100}, {1, 1}, DType::kF32, 1, 2,
                   1});
  cases.push_back({"decode H=16 page64 K=2048 splits=4 merge kernel", 16, 2048, 64, {3000, 2100, 700}, {1, 1, 1},
                   DType::kF32, 1, 4, 0});
  cases.push_back({"decode H=4 page61 K=2048 splits=3 bf16 out", 4, 2048, 61, {3000, 2100}, {1, 1},
                   DType::kBF16, 1, 3, -1});
  cases.push_back({"prefill H=16 page61 K=300 chunked", 16, 300, 61, {900, 0}, {small ? 30 : 120, 90}});
  const int f = fp8 ? 1 : 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    if (small && (i + f) % 2 == 1) continue;
    run_case(cpu, cases[i], fp8, seed + 1000 * i + 17 * f, log);
  }
}

}  // namespace

// The streaming kernel forced on every case (--sanitizer-subset: every other case).
class SmallHeads : public GpuTest {
 protected:
  void run(bool fp8) {
    const GpuTestOptions& o = gpu_test_options();
    small_heads_cases(cpu(), o.seed, o.sanitizer_subset, check_log(), fp8);
  }
};

TEST_F(SmallHeads, Bf16) { run(false); }
TEST_F(SmallHeads, Fp8DsMla) { run(true); }

}  // namespace dsacp::testing
