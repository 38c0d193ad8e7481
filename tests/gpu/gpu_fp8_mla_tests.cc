// GPU checks of the fp8_ds_mla latent cache (contract section 6) against the CPU oracle: the record cache write
// byte for byte (hostile rows: a tile of zeros, NaN / Inf in the latent, values at +-448 scale and at the e4m3
// subnormal edges, e4m3 rows with their scales; both scale rules), and sparse MLA over records (decode, MTP-2,
// prefill; H = 1, 16, 32, 64, 128; page sizes 1, 61, 64; -1 holes and garbage after them; NaN in every unused
// record) within the bf16 bound (the GPU dequantizes to bf16 in shared memory), reruns bit-identical.
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

struct DevBuf {
  DeviceBuffer buf;
  void* get() const { return buf.get(); }
};

template <typename T>
bool upload(Backend& be, const std::vector<T>& v, DevBuf* d) {
  auto r = be.allocate(std::max<size_t>(1, v.size() * sizeof(T)));
  if (!r.ok()) return false;
  d->buf = std::move(r).value();
  return be.copy_to_device(d->buf.get(), v.data(), v.size() * sizeof(T)).ok();
}
template <typename T>
std::vector<T> download(Backend& be, const DevBuf& d, size_t n) {
  std::vector<T> v(n);
  if (!be.copy_to_host(v.data(), d.buf.get(), n * sizeof(T)).ok()) v.clear();
  return v;
}

PagedPoolView latent_view(void* data, int64_t num_pages, int32_t ps) {
  return PagedPoolView{data, DType::kF8E4M3, num_pages, ps, kDl, kRec};
}
PagedPoolView rope_view(void* data, int64_t num_pages, int32_t ps) {
  return PagedPoolView{data, DType::kBF16, num_pages, ps, kDr, kRec};
}

// Hostile latent row t (f32): tile kinds by t: all zero tile, NaN and Inf, values at the tile's +-amax (448 after
// scaling), tiny values at the e4m3 subnormal edges of the tile's scale, plain random.
float hostile_latent(uint64_t seed, int64_t t, int d) {
  const int tile = d / kFp8DsMlaTile, i = d % kFp8DsMlaTile;
  const float r = uniform_at(seed + t, static_cast<uint64_t>(d));
  switch ((t + tile) % 6) {
    case 0: return 0.f;                                            // amax 0: the 2^-126 scale
    case 1: return i == 3 ? NAN : i == 7 ? -INFINITY : i == 9 ? INFINITY : r;  // non-finite values
    case 2: return i == 0 ? 3.5f : i == 1 ? -3.5f : r * 3.5f;      // +-amax: +-448 after scaling
    case 3: {                                                       // subnormal edges: amax 448 -> scale 1
      static const float edge[] = {0.001953125f, 0.0009765625f, 0.00146484375f, 0.015625f, 0.0146484375f,
                                   0.01513671875f, 0.0029296875f, 0.000976562f};
      return i == 0 ? 448.f : edge[i % 8] * (i & 8 ? -1.f : 1.f);
    }
    case 4: return r * 1e-30f;                                      // tiny scale
    default: return r * 7.f;
  }
}

void check_cache_write(Backend& gpu, Backend& cpu, uint64_t seed, CheckLog& log) {
  const int32_t ps = 61;
  const int64_t num_pages = 5, slots_n = num_pages * ps;
  const int64_t T = 120;
  for (Fp8ScaleMode mode : {Fp8ScaleMode::kFp32, Fp8ScaleMode::kUe8m0}) {
    for (DType rows_dtype : {DType::kF32, DType::kBF16, DType::kF8E4M3}) {
      std::vector<float> lat32(T * kDl), rope32(T * kDr);
      for (int64_t t = 0; t < T; ++t) {
        for (int d = 0; d < kDl; ++d) lat32[t * kDl + d] = hostile_latent(seed, t, d);
        for (int d = 0; d < kDr; ++d) rope32[t * kDr + d] = uniform_at(seed + 77, t * kDr + d) * 3.f;
      }
      std::vector<uint8_t> lat_rows;
      std::vector<float> scales;
      if (rows_dtype == DType::kF8E4M3) {  // already-quantized rows: arbitrary bytes (NaN codes too) and scales
        lat_rows.resize(T * kDl);
        scales.resize(T * 4);
        for (size_t i = 0; i < lat_rows.size(); ++i) lat_rows[i] = static_cast<uint8_t>(splitmix64(seed + i) & 0xff);
        for (size_t i = 0; i < scales.size(); ++i) scales[i] = std::ldexp(1.f + uniform_at(seed, i) * 0.5f, int(i % 40) - 20);
      } else if (rows_dtype == DType::kBF16) {
        lat_rows.resize(T * kDl * 2);
        for (int64_t i = 0; i < T * kDl; ++i) {
          const uint16_t b = f32_to_bf16(lat32[i]).bits;
          std::memcpy(&lat_rows[i * 2], &b, 2);
        }
      } else {
        lat_rows.resize(T * kDl * 4);
        std::memcpy(lat_rows.data(), lat32.data(), lat_rows.size());
      }
      std::vector<int64_t> slots(T);
      std::iota(slots.begin(), slots.end(), int64_t{0});
      for (int64_t i = T - 1; i > 0; --i) std::swap(slots[i], slots[splitmix64(seed + 9 * i) % (i + 1)]);
      for (int64_t t = 0; t < T; ++t) slots[t] = slots[t] * 2 % slots_n;  // spread over the pages (distinct)
      slots[5] = -1;
      std::vector<uint8_t> pool(slots_n * kRec, 0xab);
      std::vector<uint8_t> pool_c = pool;
      CacheWriteParams p;
      p.rows_dtype = rows_dtype;
      p.record_scale_mode = mode;
      p.num_rows = T;
      p.more[0].rows_dtype = DType::kF32;
      CacheWriteParams pc = p;
      pc.rows = lat_rows.data();
      pc.row_scales = scales.empty() ? nullptr : scales.data();
      pc.slots = slots.data();
      pc.pool = latent_view(pool_c.data(), num_pages, ps);
      pc.more[0].rows = rope32.data();
      pc.more[0].slots = slots.data();
      pc.more[0].pool = rope_view(pool_c.data(), num_pages, ps);
      const Status sc = cache_write_run(cpu, pc);
      DevBuf d_rows, d_scales, d_slots, d_rope, d_pool;
      bool up = upload(gpu, lat_rows, &d_rows) && upload(gpu, scales, &d_scales) && upload(gpu, slots, &d_slots) &&
                upload(gpu, rope32, &d_rope) && upload(gpu, pool, &d_pool);
      CacheWriteParams pg = p;
      pg.rows = d_rows.get();
      pg.row_scales = scales.empty() ? nullptr : static_cast<const float*>(d_scales.get());
      pg.slots = static_cast<const int64_t*>(d_slots.get());
      pg.pool = latent_view(d_pool.get(), num_pages, ps);
      pg.more[0].rows = d_rope.get();
      pg.more[0].slots = static_cast<const int64_t*>(d_slots.get());
      pg.more[0].pool = rope_view(d_pool.get(), num_pages, ps);
      const Status sg = up ? cache_write_run(gpu, pg) : Status::ok_status();
      const std::vector<uint8_t> got = download<uint8_t>(gpu, d_pool, pool.size());
      int64_t first_diff = -1;
      for (size_t i = 0; i < got.size() && i < pool_c.size(); ++i) {
        if (got[i] != pool_c[i]) {
          first_diff = static_cast<int64_t>(i);
          break;
        }
      }
      const std::string name = std::string("fp8_ds_mla cache_write ") + dtype_name(rows_dtype) + " rows, " +
                               (mode == Fp8ScaleMode::kFp32 ? "fp32" : "ue8m0") + " scales, hostile tiles";
      char buf[160];
      std::snprintf(buf, sizeof buf, "%s; first differing byte %lld (record %lld, byte %lld)",
                    sg.ok() && sc.ok() ? "ok" : (sc.ok() ? sg : sc).to_string().c_str(),
                    static_cast<long long>(first_diff), static_cast<long long>(first_diff / kRec),
                    static_cast<long long>(first_diff % kRec));
      log.report(up && sc.ok() && sg.ok() && got.size() == pool_c.size() && first_diff < 0, name, buf);
    }
  }
}

struct Fp8MlaCase {
  std::string name;
  int H = 16, K = 2048, page_size = 64;
  std::vector<int64_t> ctx;
  std::vector<int> qlen;
  DType out_dtype = DType::kF32;
  Fp8ScaleMode mode = Fp8ScaleMode::kFp32;
  int head_blocks = 1;
  int64_t low_pages = 0;  // unused pages below the requests' (their records past 2^31 bytes from 52000 x 64 keys)
};

void run_case(Backend& gpu, Backend& cpu, const Fp8MlaCase& c, uint64_t seed, CheckLog& log) {
  const std::string name = "fp8_ds_mla sparse_mla " + c.name;
  auto [lens, request, key_len] = query_rows(c.ctx, c.qlen);
  const int64_t T = static_cast<int64_t>(request.size());
  // paging: the requests' pages from a shuffled range, 3 spare pages
  const int32_t ps = c.page_size;
  int64_t need = 0, maxp = 1;
  for (int64_t l : lens) {
    need += (l + ps - 1) / ps;
    maxp = std::max<int64_t>(maxp, (l + ps - 1) / ps);
  }
  const int64_t num_pages = need + 3 + c.low_pages;
  std::vector<int32_t> ids(static_cast<size_t>(need + 3));
  std::iota(ids.begin(), ids.end(), static_cast<int32_t>(c.low_pages));
  for (size_t i = ids.size(); i > 1; --i) std::swap(ids[i - 1], ids[splitmix64(seed + i) % i]);
  std::vector<int32_t> bt(lens.size() * maxp, -1);
  size_t next = 0;
  std::vector<int64_t> slots;
  for (size_t b = 0; b < lens.size(); ++b) {
    for (int64_t cpg = 0; cpg < (lens[b] + ps - 1) / ps; ++cpg) bt[b * maxp + cpg] = ids[next++];
    for (int64_t j = 0; j < lens[b]; ++j) slots.push_back(int64_t{bt[b * maxp + j / ps]} * ps + j % ps);
  }
  // the records: NaN bytes everywhere (e4m3 0xff, NaN scales and rope), the requests' keys quantized by the CPU
  const int64_t nkeys = static_cast<int64_t>(slots.size());
  std::vector<float> lat(nkeys * kDl), rope(nkeys * kDr);
  for (int64_t i = 0; i < nkeys; ++i) {
    const float amp = 0.25f + 2.f * (splitmix64(seed + 3 * i) % 8) / 8.f;  // tiles of different scales
    for (int d = 0; d < kDl; ++d) lat[i * kDl + d] = amp * uniform_at(seed + 100, i * kDl + d) * (1.f + (d / 128));
    for (int d = 0; d < kDr; ++d) rope[i * kDr + d] = uniform_at(seed + 200, i * kDr + d);
  }
  std::vector<uint8_t> pool(num_pages * ps * kRec, 0xff);
  CacheWriteParams w;
  w.rows = lat.data();
  w.rows_dtype = DType::kF32;
  w.record_scale_mode = c.mode;
  w.num_rows = nkeys;
  w.slots = slots.data();
  w.pool = latent_view(pool.data(), num_pages, ps);
  w.more[0].rows = rope.data();
  w.more[0].slots = slots.data();
  w.more[0].pool = rope_view(pool.data(), num_pages, ps);
  if (Status s = cache_write_run(cpu, w); !s.ok()) {
    log.report(false, name, "CPU cache write: " + s.to_string());
    return;
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
  pc.latent = latent_view(pool.data(), num_pages, ps);
  pc.rope = rope_view(pool.data(), num_pages, ps);
  pc.block_table.data = bt.data();
  pc.topk = topk.data();
  pc.out = out_c.data();
  pc.lse = lse_c.data();
  if (Status s = sparse_mla_run(cpu, pc); !s.ok()) {
    log.report(false, name, "CPU oracle: " + s.to_string());
    return;
  }
  DevBuf d_req, d_len, d_qn, d_qr, d_pool, d_bt, d_topk, d_out, d_lse;
  const size_t out_n = static_cast<size_t>(T * c.H * kDl);
  const size_t out_bytes = out_n * dtype_size(c.out_dtype);
  bool up = upload(gpu, request, &d_req) && upload(gpu, key_len, &d_len) && upload(gpu, qn, &d_qn) &&
            upload(gpu, qr, &d_qr) && upload(gpu, pool, &d_pool) && upload(gpu, bt, &d_bt) &&
            upload(gpu, topk, &d_topk) && upload(gpu, std::vector<uint8_t>(out_bytes, 0xff), &d_out) &&
            upload(gpu, std::vector<float>(T * c.H, NAN), &d_lse);
  if (!up) {
    log.report(false, name, "device upload failed");
    return;
  }
  SparseMlaParams pg = p;
  pg.rows.request = static_cast<const int32_t*>(d_req.get());
  pg.rows.key_len = static_cast<const int32_t*>(d_len.get());
  pg.q_nope = d_qn.get();
  pg.q_rope = d_qr.get();
  pg.latent = latent_view(d_pool.get(), num_pages, ps);
  pg.rope = rope_view(d_pool.get(), num_pages, ps);
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
    for (size_t i = 0; i < out_n; ++i) {
      uint16_t b;
      std::memcpy(&b, &raw[i * 2], 2);
      out_g[i] = bf16_to_f32(bf16{b});
    }
  } else {
    std::memcpy(out_g.data(), raw.data(), out_bytes);
  }
  bool mismatch = false;
  const double e_out = rel_error_finite(out_g, out_c, &mismatch), e_lse = rel_error_finite(lse_g, lse_c, &mismatch);
  const Status sg2 = sparse_mla_run(gpu, pg);
  const bool same = sg2.ok() && download<uint8_t>(gpu, d_out, out_bytes) == raw &&
                    download<float>(gpu, d_lse, T * c.H) == lse_g;
  // bf16 keys and values (dequantized once) on top of the bf16 path's bound
  const double tol = c.out_dtype == DType::kBF16 ? 1.5e-2 : 1e-2;
  char buf[200];
  std::snprintf(buf, sizeof buf, "T=%lld rel err out %.2e lse %.2e, non-finite %s, rerun %s",
                static_cast<long long>(T), e_out, e_lse, mismatch ? "MISMATCH" : "as the oracle",
                same ? "bit-identical" : "DIFFERS");
  log.report(!mismatch && e_out < tol && e_lse < 2e-3 && same, name, buf);
}

// The sparse MLA cases over records on the default kernels, or (forced_tag) those of one forced kernel.
void fp8_mla_cases(Backend& gpu, Backend& cpu, uint64_t seed, bool small, CheckLog& log, const std::string& forced_tag) {
  std::vector<Fp8MlaCase> cases;
  cases.push_back({"decode H=1 page64 K=2048", 1, 2048, 64, {3000, 2100, 900}, {1, 1, 1}});
  cases.push_back({"decode H=16 page64 K=2048", 16, 2048, 64, {3000, 2100, 900}, {1, 1, 1}, DType::kBF16});
  cases.push_back({"decode H=16 page1 K=512 ue8m0", 16, 512, 1, {1500, 700, 40}, {1, 1, 1}, DType::kF32,
                   Fp8ScaleMode::kUe8m0});
  cases.push_back({"MTP-2 H=32 page61 K=2048", 32, 2048, 61, {5000, 2500}, {2, 2}});
  cases.push_back({"decode H=64 page64 K=2048", 64, 2048, 64, {3000, 1500}, {1, 1}});
  cases.push_back({"MTP-2 H=128 page64 K=2048 bf16 out", 128, 2048, 64, {4096, 3000}, {2, 2}, DType::kBF16});
  cases.push_back({"decode H=128 page61 K=2048 head_blocks=2", 128, 2048, 61, {3000, 2100}, {1, 1}, DType::kF32,
                   Fp8ScaleMode::kFp32, 2});
  cases.push_back({"prefill H=16 page61 K=300 chunked", 16, 300, 61, {900, 0}, {small ? 40 : 200, 150}});
  cases.push_back({"prefill H=128 page64 K=2048", 128, 2048, 64, {0}, {small ? 100 : 500}});
  cases.push_back({"prefill H=64 page1 K=512 ue8m0", 64, 512, 1, {300}, {small ? 30 : 120}, DType::kBF16,
                   Fp8ScaleMode::kUe8m0});
  for (size_t i = 0; i < cases.size() && forced_tag.empty(); ++i) {
    if (small && i % 2 == 1) continue;
    run_case(gpu, cpu, cases[i], seed + 1000 * i, log);
  }
  // Each decode kernel over records forced by CudaBackendOptions::mla_kernel: the warp-specialized one whose
  // producer dequantizes (kWgmmaWs32: partial 64-head groups H = 8, 16, 48, 96; MTP 1..4; page sizes 1 / 61 / 64;
  // split-K with the cluster merge and with the workspace), and the mma.sync one dequantizing on its MMA warps.
  struct Forced {
    const char* tag;
    CudaBackendOptions::MlaKernel kernel;
    std::vector<Fp8MlaCase> cases;
    int32_t splits = 0;  // CudaBackendOptions::mla_splits (1: a CTA walks all 2048 keys, 32 pairs of tiles)
    CudaBackendOptions::Choice pair_dequant = CudaBackendOptions::Choice::kAuto;  // mla_fp8_pair_dequant
    CudaBackendOptions::Choice cluster_merge = CudaBackendOptions::Choice::kAuto;  // mla_cluster_merge
  };
  std::vector<Forced> forced;
  forced.push_back({"ws32", CudaBackendOptions::MlaKernel::kWgmmaWs32, {}});
  std::vector<Fp8MlaCase>& ws = forced.back().cases;
  ws.push_back({"decode H=16 page1 K=2048 b=5", 16, 2048, 1, {2500, 4000, 700, 2100, 65}, {1, 1, 1, 1, 1},
                DType::kBF16});
  ws.push_back({"decode H=8 page61 K=1024", 8, 1024, 61, {1900, 400}, {1, 1}});
  ws.push_back({"decode H=64 page64 K=2048", 64, 2048, 64, {3000, 1500}, {1, 1}});
  ws.push_back({"MTP-3 H=64 page61 K=2048 ue8m0", 64, 2048, 61, {6000, 2300}, {3, 3}, DType::kF32,
                Fp8ScaleMode::kUe8m0});
  ws.push_back({"MTP-4 H=128 page64 K=2048 bf16 out", 128, 2048, 64, {5000, 100}, {4, 4}, DType::kBF16});
  ws.push_back({"MTP-1..4 H=48 page64 K=512", 48, 512, 64, {3000, 800, 1200, 64}, {1, 2, 3, 4}});
  ws.push_back({"decode H=96 head_blocks=2 page1 K=2048", 96, 2048, 1, {3000, 2200}, {1, 1}, DType::kBF16,
                Fp8ScaleMode::kFp32, 2});
  ws.push_back({"decode H=128 page61 K=2048 head_blocks=2", 128, 2048, 61, {3000, 2100}, {1, 1}, DType::kF32,
                Fp8ScaleMode::kFp32, 2});
  ws.push_back({"decode H=16 page64 K=64 short", 16, 64, 64, {30, 200, 64}, {1, 1, 1}});
  // One split: the whole key list in one CTA (what b=64 runs: 128 CTAs, no split), and a pool whose records pass
  // 2^31 bytes (the byte offset of a record is 64-bit).
  forced.push_back({"ws32 splits=1", CudaBackendOptions::MlaKernel::kWgmmaWs32, {}, 1});
  std::vector<Fp8MlaCase>& w1 = forced.back().cases;
  w1.push_back({"decode H=128 page64 K=2048", 128, 2048, 64, {3000, 2100, 4100}, {1, 1, 1}});
  w1.push_back({"decode H=64 page1 K=2048 ue8m0", 64, 2048, 1, {2500, 2049}, {1, 1}, DType::kBF16,
                Fp8ScaleMode::kUe8m0});
  w1.push_back({"MTP-2 H=128 page61 K=2048 bf16 out", 128, 2048, 61, {4096, 3000}, {2, 2}, DType::kBF16});
  w1.push_back({"decode H=96 head_blocks=2 page64 K=1024", 96, 1024, 64, {1500, 3000}, {1, 1}, DType::kF32,
                Fp8ScaleMode::kFp32, 2});
  w1.push_back({"decode H=128 page64 K=2048 records past 2^31 bytes", 128, 2048, 64, {3000, 2500}, {1, 1},
                DType::kBF16, Fp8ScaleMode::kFp32, 1, 52000});
  // One split again, short key lists among long ones (1, 4, 2 pairs: the paired CTAs' last pairs), paired by
  // default for H = 128 and head_blocks = 2; then each CTA dequantizing alone (paired off), and paired CTAs with
  // split-K merged through the workspace (the cluster merge off: the pair takes the cluster).
  w1.push_back({"decode H=128 page64 K=2048 short lists", 128, 2048, 64, {30, 200, 64, 5000}, {1, 1, 1, 1}});
  using Choice = CudaBackendOptions::Choice;
  forced.push_back({"ws32 unpaired splits=1", CudaBackendOptions::MlaKernel::kWgmmaWs32, {}, 1, Choice::kOff});
  forced.back().cases.push_back({"decode H=128 page64 K=2048", 128, 2048, 64, {3000, 2100, 4100}, {1, 1, 1}});
  forced.back().cases.push_back({"MTP-2 H=128 page61 K=2048 bf16 out", 128, 2048, 61, {4096, 30}, {2, 2},
                                 DType::kBF16});
  forced.push_back({"ws32 paired splits=4", CudaBackendOptions::MlaKernel::kWgmmaWs32, {}, 4, Choice::kAuto,
                    Choice::kOff});
  std::vector<Fp8MlaCase>& w4 = forced.back().cases;
  w4.push_back({"decode H=128 page64 K=2048", 128, 2048, 64, {3000, 2100, 4100}, {1, 1, 1}});
  w4.push_back({"MTP-2 H=128 page1 K=2048 ue8m0 bf16 out", 128, 2048, 1, {4096, 3000}, {2, 2}, DType::kBF16,
                Fp8ScaleMode::kUe8m0});
  w4.push_back({"decode H=96 head_blocks=2 page61 K=1024", 96, 1024, 61, {1500, 100, 3000}, {1, 1, 1}, DType::kF32,
                Fp8ScaleMode::kFp32, 2});
  w4.push_back({"decode H=128 page64 K=2048 short lists", 128, 2048, 64, {30, 200, 64, 700}, {1, 1, 1, 1}});
  forced.push_back({"mma_sync", CudaBackendOptions::MlaKernel::kMmaSync, {}});
  forced.back().cases.push_back({"decode H=16 page64 K=2048", 16, 2048, 64, {3000, 2100, 900}, {1, 1, 1}, DType::kBF16});
  forced.back().cases.push_back({"MTP-2 H=128 page61 K=2048", 128, 2048, 61, {4096, 3000}, {2, 2}});
  for (size_t f = 0; f < forced.size(); ++f) {
    const Forced& fc = forced[f];
    const std::string prefix = std::string("fp8_ds_mla sparse_mla ") + fc.tag + " ";
    if (forced_tag != fc.tag) continue;
    CudaBackendOptions o;
    o.mla_kernel = fc.kernel;
    o.mla_splits = fc.splits;
    o.mla_fp8_pair_dequant = fc.pair_dequant;
    o.mla_cluster_merge = fc.cluster_merge;
    auto be = make_cuda_backend(0, o);
    if (!be.ok()) {
      log.report(false, prefix + "backend", be.status().to_string());
      continue;
    }
    for (size_t i = 0; i < fc.cases.size(); ++i) {
      if (small && i % 2 == 1) continue;
      Fp8MlaCase c = fc.cases[i];
      c.name = std::string(fc.tag) + " " + c.name;
      run_case(**be, cpu, c, seed + 7000 * (f + 1) + 1000 * i, log);
    }
  }
}

}  // namespace

// --sanitizer-subset: every other case, shorter prefills.
class Fp8DsMla : public GpuTest {
 protected:
  void run(const std::string& forced_tag) {
    const GpuTestOptions& o = gpu_test_options();
    fp8_mla_cases(gpu(), cpu(), o.seed, o.sanitizer_subset, check_log(), forced_tag);
  }
};

TEST_F(Fp8DsMla, CacheWrite) { check_cache_write(gpu(), cpu(), gpu_test_options().seed, check_log()); }
TEST_F(Fp8DsMla, SparseMla) { run(""); }
TEST_F(Fp8DsMla, SparseMlaWs32) { run("ws32"); }
TEST_F(Fp8DsMla, SparseMlaWs32OneSplit) { run("ws32 splits=1"); }
TEST_F(Fp8DsMla, SparseMlaWs32Unpaired) { run("ws32 unpaired splits=1"); }
TEST_F(Fp8DsMla, SparseMlaWs32PairedSplitK) { run("ws32 paired splits=4"); }
TEST_F(Fp8DsMla, SparseMlaMmaSync) { run("mma_sync"); }

}  // namespace dsacp::testing
