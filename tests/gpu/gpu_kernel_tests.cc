// GPU kernel tests: every CUDA kernel against the CPU oracle on random and hostile inputs (shuffled pages, NaN in
// unused cache slots, -1 rows and garbage after them, page sizes 1/61/64, a 140K-key context, a latent pool whose
// element offsets pass 2^31), bit-identical reruns, error statuses for bad indices and unsupported shapes.
// Self-contained (no GoogleTest, so it builds on the GPU machine as is). Exit 0 = all passed, 1 = a failure,
// 77 = no usable GPU (ctest SKIP_RETURN_CODE). Usage: dsacp_gpu_tests [--quick] [--json FILE] [--only TEXT]
// [--seed N]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "dsacp/backend.h"
#include "dsacp/dtype.h"
#include "gpu/check_log.h"
#include "kernels/cuda/indexer_topk/indexer_kernels.h"
#include "gpu/crash_trace.h"
#include "gpu/gpu_serving_checks.h"

using namespace dsacp;

namespace dsacp::testing {
// gpu_topk_tests.cc: the top-k on given scores in every form (small: the subset for a sanitizer run).
void test_topk_rows(CheckLog& log, uint64_t seed, bool small);
// gpu_fp8_mla_tests.cc: the fp8_ds_mla cache write and sparse MLA over records (small: the sanitizer subset).
void gpu_fp8_mla_checks(Backend& gpu, Backend& cpu, uint64_t seed, bool small, CheckLog& log,
                        const std::function<bool(const std::string&)>& selected);
// gpu_small_heads_tests.cc: the streaming kernel for 16-head groups, forced (small: the sanitizer subset).
void gpu_small_heads_checks(Backend& cpu, uint64_t seed, bool small, CheckLog& log,
                            const std::function<bool(const std::string&)>& selected);
}  // namespace dsacp::testing

namespace {

testing::CheckLog g_log;

void report(bool ok, const std::string& name, const std::string& detail = "") { g_log.report(ok, name, detail); }

// Counter-based generator: value = f(seed, index).
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
float uni(uint64_t seed, uint64_t i) {  // [-1, 1)
  return static_cast<float>((mix(seed * 0x100000001b3ull + i) >> 40) * (2.0 / 16777216.0) - 1.0);
}

constexpr uint16_t kBf16NaN = 0x7fc0;

struct Dev {  // device copy of a host vector
  DeviceBuffer buf;
  template <typename T>
  T* ptr() const { return buf.as<T>(); }
};

template <typename T>
Dev upload(Backend& be, const std::vector<T>& v) {
  Dev d;
  auto r = be.allocate(std::max<size_t>(1, v.size() * sizeof(T)));
  if (!r.ok()) {
    std::printf("allocate failed: %s\n", r.status().to_string().c_str());
    std::exit(1);
  }
  d.buf = std::move(r).value();
  Status s = be.copy_to_device(d.buf.get(), v.data(), v.size() * sizeof(T));
  if (!s.ok()) {
    std::printf("upload failed: %s\n", s.to_string().c_str());
    std::exit(1);
  }
  return d;
}
template <typename T>
std::vector<T> download(Backend& be, const Dev& d, size_t n) {
  std::vector<T> v(n);
  Status s = be.copy_to_host(v.data(), d.buf.get(), n * sizeof(T));
  if (!s.ok()) {
    std::printf("download failed: %s\n", s.to_string().c_str());
    std::exit(1);
  }
  return v;
}

// A paged layout: requests' pages drawn from a shuffled range of physical pages [first_page, num_pages).
struct Paging {
  int32_t page_size = 64;
  int64_t num_pages = 0;
  int32_t num_requests = 0, max_pages = 0;
  std::vector<int32_t> bt;  // [num_requests, max_pages], -1 unused
  int64_t row_of(int32_t b, int64_t j) const {
    return static_cast<int64_t>(bt[static_cast<size_t>(b) * max_pages + j / page_size]) * page_size + j % page_size;
  }
};

Paging make_paging(const std::vector<int64_t>& lens, int32_t page_size, int64_t extra_pages, uint64_t seed,
                   int64_t first_page = 0) {
  Paging p;
  p.page_size = page_size;
  p.num_requests = static_cast<int32_t>(lens.size());
  int64_t need = 0;
  int64_t maxp = 1;
  for (int64_t l : lens) {
    need += (l + page_size - 1) / page_size;
    maxp = std::max<int64_t>(maxp, (l + page_size - 1) / page_size);
  }
  p.max_pages = static_cast<int32_t>(maxp);
  p.num_pages = first_page + need + extra_pages;
  std::vector<int32_t> ids(static_cast<size_t>(need + extra_pages));
  std::iota(ids.begin(), ids.end(), static_cast<int32_t>(first_page));
  for (size_t i = ids.size(); i > 1; --i) std::swap(ids[i - 1], ids[mix(seed + i) % i]);
  p.bt.assign(static_cast<size_t>(p.num_requests) * p.max_pages, -1);
  size_t next = 0;
  for (int32_t b = 0; b < p.num_requests; ++b) {
    for (int64_t c = 0; c < (lens[b] + page_size - 1) / page_size; ++c) p.bt[b * p.max_pages + c] = ids[next++];
  }
  return p;
}

// A bf16 pool [num_pages * page_size, dim]: NaN everywhere, random values in the requests' rows.
std::vector<uint16_t> make_pool(const Paging& pg, const std::vector<int64_t>& lens, int dim, uint64_t seed) {
  std::vector<uint16_t> pool(static_cast<size_t>(pg.num_pages * pg.page_size * dim), kBf16NaN);
  for (int32_t b = 0; b < pg.num_requests; ++b) {
    for (int64_t j = 0; j < lens[b]; ++j) {
      const int64_t r = pg.row_of(b, j);
      for (int d = 0; d < dim; ++d) {
        pool[r * dim + d] = f32_to_bf16(uni(seed + b, static_cast<uint64_t>(j) * dim + d)).bits;
      }
    }
  }
  return pool;
}

std::vector<uint16_t> random_bf16(size_t n, uint64_t seed, float amp = 1.f) {
  std::vector<uint16_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = f32_to_bf16(amp * uni(seed, i)).bits;
  return v;
}

double rel_norm(const std::vector<float>& a, const std::vector<float>& ref, bool* nan_mismatch) {
  double num = 0, den = 0;
  *nan_mismatch = false;
  for (size_t i = 0; i < a.size(); ++i) {
    const bool fa = std::isfinite(a[i]), fr = std::isfinite(ref[i]);
    if (fa != fr) {
      *nan_mismatch = true;
      continue;
    }
    if (!fa) continue;
    num += (static_cast<double>(a[i]) - ref[i]) * (static_cast<double>(a[i]) - ref[i]);
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

std::vector<float> to_f32(const std::vector<uint16_t>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = bf16_to_f32(bf16{v[i]});
  return f;
}

// ------------------------------------------------------------------------------------------------------------
void test_cache_write(Backend& gpu, Backend& cpu) {
  for (DType src : {DType::kBF16, DType::kF32}) {
    const int dim = 576 - 64;  // latent
    const int64_t T = 37;
    Paging pg = make_paging({200}, 61, 3, 11);
    std::vector<int64_t> slots(T);
    for (int64_t t = 0; t < T; ++t) slots[t] = (t % 7 == 3) ? -1 : pg.row_of(0, 150 - 4 * t > 0 ? 150 - 4 * t : t);
    std::vector<uint16_t> rows_b = random_bf16(T * dim, 5);
    std::vector<float> rows_f(T * dim);
    for (size_t i = 0; i < rows_f.size(); ++i) rows_f[i] = uni(6, i) * 3.f;
    const int64_t pool_elems = pg.num_pages * pg.page_size * dim;
    std::vector<uint16_t> pool_cpu(pool_elems, kBf16NaN);
    Dev pool_gpu = upload(gpu, pool_cpu);
    Dev slots_gpu = upload(gpu, slots);
    Dev rows_gpu = src == DType::kBF16 ? upload(gpu, rows_b) : upload(gpu, rows_f);
    CacheWriteParams p;
    p.rows_dtype = src;
    p.num_rows = T;
    p.pool = {nullptr, DType::kBF16, pg.num_pages, pg.page_size, dim};
    CacheWriteParams pc = p, pgp = p;
    pc.rows = src == DType::kBF16 ? static_cast<const void*>(rows_b.data()) : rows_f.data();
    pc.slots = slots.data();
    pc.pool.data = pool_cpu.data();
    pgp.rows = rows_gpu.buf.get();
    pgp.slots = slots_gpu.ptr<int64_t>();
    pgp.pool.data = pool_gpu.buf.get();
    Status sc = cache_write_run(cpu, pc), sg = cache_write_run(gpu, pgp);
    std::vector<uint16_t> got = download<uint16_t>(gpu, pool_gpu, pool_elems);
    const bool same = sc.ok() && sg.ok() && std::memcmp(got.data(), pool_cpu.data(), pool_elems * 2) == 0;
    report(same, std::string("cache_write ") + dtype_name(src) + "->BF16 page 61, -1 slots",
           sg.ok() ? "bit-exact vs CPU" : sg.to_string());
    // Three pools in one launch (the steps' indexer key, latent and rope rows): dims 128 / 512 / 64, the third
    // pool with its own slots; bit-exact against the CPU writing them one by one.
    {
      const int dims[3] = {128, 512, 64};
      std::vector<std::vector<float>> r3(3);
      std::vector<std::vector<uint16_t>> pools_cpu(3);
      std::vector<Dev> rows3, pools3;
      std::vector<int64_t> slots_b(T);
      for (int64_t t = 0; t < T; ++t) slots_b[t] = t % 5 == 1 ? -1 : pg.row_of(0, t + 3);
      Dev slots_b_gpu = upload(gpu, slots_b);
      CacheWriteParams mc, mg;
      mc.rows_dtype = mg.rows_dtype = DType::kF32;
      mc.num_rows = mg.num_rows = T;
      for (int i = 0; i < 3; ++i) {
        r3[i].resize(T * dims[i]);
        for (size_t j = 0; j < r3[i].size(); ++j) r3[i][j] = uni(40 + i, j) * 2.f;
        pools_cpu[i].assign(pg.num_pages * pg.page_size * dims[i], kBf16NaN);
        rows3.push_back(upload(gpu, r3[i]));
        pools3.push_back(upload(gpu, pools_cpu[i]));
      }
      const PagedPoolView v0{nullptr, DType::kBF16, pg.num_pages, pg.page_size, 0};
      auto view = [&](void* d, int dim) { PagedPoolView v = v0; v.data = d; v.dim = dim; return v; };
      mc.rows = r3[0].data();
      mc.slots = slots.data();
      mc.pool = view(pools_cpu[0].data(), dims[0]);
      mc.more[0] = {r3[1].data(), slots.data(), view(pools_cpu[1].data(), dims[1])};
      mc.more[1] = {r3[2].data(), slots_b.data(), view(pools_cpu[2].data(), dims[2])};
      mg.rows = rows3[0].buf.get();
      mg.slots = slots_gpu.ptr<int64_t>();
      mg.pool = view(pools3[0].buf.get(), dims[0]);
      mg.more[0] = {rows3[1].buf.get(), slots_gpu.ptr<int64_t>(), view(pools3[1].buf.get(), dims[1])};
      mg.more[1] = {rows3[2].buf.get(), slots_b_gpu.ptr<int64_t>(), view(pools3[2].buf.get(), dims[2])};
      const Status s3c = cache_write_run(cpu, mc), s3g = cache_write_run(gpu, mg);
      bool all = s3c.ok() && s3g.ok();
      for (int i = 0; i < 3 && all; ++i) {
        const std::vector<uint16_t> g3 = download<uint16_t>(gpu, pools3[i], pools_cpu[i].size());
        all = std::memcmp(g3.data(), pools_cpu[i].data(), g3.size() * 2) == 0;
      }
      report(all, "cache_write three pools in one launch (F32->BF16, dims 128/512/64, own slots)",
             s3g.ok() ? (all ? "bit-exact vs CPU" : "differs") : s3g.to_string());
    }
    // a bad slot is an error
    slots[5] = pg.num_pages * pg.page_size;
    Dev bad = upload(gpu, slots);
    pgp.slots = bad.ptr<int64_t>();
    Status sb = cache_write_run(gpu, pgp);
    report(!sb.ok() && sb.code() == StatusCode::kOutOfRange, "cache_write bad slot -> out_of_range", sb.to_string());
  }
}

// CacheWriteParams::upload (the steps' small vectors carried by the cache write's launch): the write reads its
// slots from the upload (the device buffer holds stale bytes before it), the bytes land at `device` (also the
// bytes past the slots, and when there are no rows), pools of mixed dtypes (several launches: the backend copies
// first) give the same, and a bad slot inside the upload is still reported.
void test_cache_write_upload(Backend& gpu, Backend& cpu) {
  const int64_t T = 45;
  const int dims[2] = {128, 512};
  Paging pg = make_paging({200}, 40, 3, 17);
  std::vector<int64_t> slots(T);
  for (int64_t t = 0; t < T; ++t) slots[t] = t % 6 == 2 ? -1 : pg.row_of(0, 3 * t + 1);
  std::vector<int32_t> extra(29);
  for (size_t i = 0; i < extra.size(); ++i) extra[i] = static_cast<int32_t>(mix(70 + i));
  // [slots | extra], as UploadBatch lays them out (16-byte aligned)
  std::vector<char> host((T * sizeof(int64_t) + 15) / 16 * 16 + extra.size() * sizeof(int32_t));
  std::memcpy(host.data(), slots.data(), T * sizeof(int64_t));
  const size_t extra_at = (T * sizeof(int64_t) + 15) / 16 * 16;
  std::memcpy(host.data() + extra_at, extra.data(), extra.size() * sizeof(int32_t));
  for (bool mixed : {false, true}) {
    std::vector<std::vector<float>> rows(2);
    std::vector<std::vector<uint16_t>> pools_cpu(2);
    std::vector<Dev> rows_g, pools_g;
    for (int i = 0; i < 2; ++i) {
      rows[i].resize(T * dims[i]);
      for (size_t j = 0; j < rows[i].size(); ++j) rows[i][j] = uni(80 + i, j) * 4.f;
      pools_cpu[i].assign(pg.num_pages * pg.page_size * dims[i] * (mixed && i == 1 ? 2 : 1), kBf16NaN);
      rows_g.push_back(upload(gpu, rows[i]));
      pools_g.push_back(upload(gpu, pools_cpu[i]));
    }
    const std::vector<char> stale(host.size(), 0x55);
    Dev dev = upload(gpu, stale);
    const DType pool1 = mixed ? DType::kF32 : DType::kBF16;
    CacheWriteParams pc, pgp;
    pc.rows_dtype = pgp.rows_dtype = DType::kF32;
    pc.num_rows = pgp.num_rows = T;
    pc.rows = rows[0].data();
    pc.slots = slots.data();
    pc.pool = {pools_cpu[0].data(), DType::kBF16, pg.num_pages, pg.page_size, dims[0]};
    pc.more[0] = {rows[1].data(), slots.data(), {pools_cpu[1].data(), pool1, pg.num_pages, pg.page_size, dims[1]}};
    pgp.rows = rows_g[0].buf.get();
    pgp.slots = dev.ptr<int64_t>();
    pgp.pool = {pools_g[0].buf.get(), DType::kBF16, pg.num_pages, pg.page_size, dims[0]};
    pgp.more[0] = {rows_g[1].buf.get(), dev.ptr<int64_t>(), {pools_g[1].buf.get(), pool1, pg.num_pages, pg.page_size, dims[1]}};
    pgp.upload = {host.data(), dev.buf.get(), host.size()};
    const Status sc = cache_write_run(cpu, pc), sg = cache_write_run(gpu, pgp);
    bool same = sc.ok() && sg.ok();
    for (int i = 0; i < 2 && same; ++i) {
      const std::vector<uint16_t> got = download<uint16_t>(gpu, pools_g[i], pools_cpu[i].size());
      same = std::memcmp(got.data(), pools_cpu[i].data(), got.size() * 2) == 0;
    }
    const std::vector<char> landed = download<char>(gpu, dev, host.size());
    const bool bytes_ok = landed == host;
    report(same && bytes_ok,
           std::string("cache_write carrying its slots' upload (") + (mixed ? "BF16 + F32 pools: copied first" : "one launch") + ")",
           !sg.ok() ? sg.to_string() : !same ? "pools differ from the CPU" : !bytes_ok ? "uploaded bytes differ" : "bit-exact vs CPU");
    if (mixed) continue;
    // no rows: the upload is still made
    Dev dev0 = upload(gpu, stale);
    CacheWriteParams none = pgp;
    none.num_rows = 0;
    none.upload.device = dev0.buf.get();
    const Status s0 = cache_write_run(gpu, none);
    report(s0.ok() && download<char>(gpu, dev0, host.size()) == host, "cache_write with no rows still uploads",
           s0.to_string());
    // a bad slot inside the upload
    std::vector<char> bad = host;
    const int64_t out = pg.num_pages * pg.page_size;
    std::memcpy(bad.data() + 7 * sizeof(int64_t), &out, sizeof out);
    CacheWriteParams b = pgp;
    b.upload.host = bad.data();
    const Status sb = cache_write_run(gpu, b);
    report(!sb.ok() && sb.code() == StatusCode::kOutOfRange, "cache_write bad slot inside its upload -> out_of_range",
           sb.to_string());
  }
}

void test_lse_merge(Backend& gpu, Backend& cpu) {
  const int S = 3, Dl = 512;
  const int64_t rows = 77;
  std::vector<float> part_out(S * rows * Dl), part_lse(S * rows);
  for (size_t i = 0; i < part_out.size(); ++i) part_out[i] = uni(21, i);
  for (int64_t i = 0; i < S * rows; ++i) {
    const int k = static_cast<int>(mix(22 + i) % 8);
    part_lse[i] = k == 0 ? -std::numeric_limits<float>::infinity() : k == 1 ? NAN : 5.f * uni(23, i);
    if (k <= 1) {
      for (int d = 0; d < Dl; ++d) part_out[i * Dl + d] = NAN;  // never read
    }
  }
  for (int s = 0; s < S; ++s) part_lse[s * rows + 4] = -std::numeric_limits<float>::infinity();  // empty row
  std::vector<float> out_c(rows * Dl), lse_c(rows);
  LseMergeParams p;
  p.num_parts = S;
  p.num_rows = rows;
  p.Dl = Dl;
  LseMergeParams pc = p;
  pc.part_out = part_out.data();
  pc.part_lse = part_lse.data();
  pc.out = out_c.data();
  pc.lse = lse_c.data();
  Status sc = lse_merge_run(cpu, pc);
  Dev po = upload(gpu, part_out), pl = upload(gpu, part_lse), o = upload(gpu, out_c), l = upload(gpu, lse_c);
  LseMergeParams pg = p;
  pg.part_out = po.ptr<float>();
  pg.part_lse = pl.ptr<float>();
  pg.out = o.ptr<float>();
  pg.lse = l.ptr<float>();
  Status sg = lse_merge_run(gpu, pg);
  bool nm1 = false, nm2 = false;
  const double e1 = rel_norm(download<float>(gpu, o, rows * Dl), out_c, &nm1);
  const double e2 = rel_norm(download<float>(gpu, l, rows), lse_c, &nm2);
  report(sc.ok() && sg.ok() && !nm1 && !nm2 && e1 < 1e-6 && e2 < 1e-6, "lse_merge 3 parts, -inf/NaN parts, empty row",
         "rel err out " + std::to_string(e1) + " lse " + std::to_string(e2) + (sg.ok() ? "" : " " + sg.to_string()));
  // bf16 parts (DCP's partials when the output is bf16), bf16 out: against the CPU oracle on the same parts.
  std::vector<bf16> part_bf(part_out.size());
  for (size_t i = 0; i < part_out.size(); ++i) part_bf[i] = f32_to_bf16(part_out[i]);
  std::vector<bf16> outb_c(rows * Dl);
  std::vector<float> lseb_c(rows);
  LseMergeParams qc = pc;
  qc.part_out = part_bf.data();
  qc.part_dtype = DType::kBF16;
  qc.out = outb_c.data();
  qc.out_dtype = DType::kBF16;
  qc.lse = lseb_c.data();
  Status sbc = lse_merge_run(cpu, qc);
  Dev pob = upload(gpu, part_bf), ob = upload(gpu, outb_c), lb = upload(gpu, lseb_c);
  LseMergeParams qg = qc;
  qg.part_out = pob.ptr<bf16>();
  qg.out = ob.ptr<bf16>();
  qg.lse = lb.ptr<float>();
  qg.part_lse = pl.ptr<float>();
  Status sbg = lse_merge_run(gpu, qg);
  const std::vector<bf16> got_b = download<bf16>(gpu, ob, rows * Dl);
  int64_t differ = 0;
  for (size_t i = 0; i < got_b.size(); ++i) {
    const float a = bf16_to_f32(got_b[i]), b = bf16_to_f32(outb_c[i]);
    if (!(a == b || std::fabs(a - b) <= 1e-2f * std::fabs(b))) ++differ;  // one bf16 ulp at most
  }
  bool nm3 = false;
  const double e3 = rel_norm(download<float>(gpu, lb, rows), lseb_c, &nm3);
  report(sbc.ok() && sbg.ok() && differ == 0 && !nm3 && e3 < 1e-6, "lse_merge bf16 parts -> bf16 out",
         std::to_string(differ) + " elements beyond one bf16 ulp, lse rel err " + std::to_string(e3) +
             (sbg.ok() ? "" : " " + sbg.to_string()));
  // The same parts in one buffer each (the DCP step's window: every rank's block read in place): bit-identical
  // to the contiguous merge on the GPU.
  std::vector<Dev> own_o, own_l;
  LseMergeParams qq = qg;
  qq.part_out = nullptr;
  qq.part_lse = nullptr;
  for (int s = 0; s < S; ++s) {
    own_o.push_back(upload(gpu, std::vector<bf16>(part_bf.begin() + s * rows * Dl, part_bf.begin() + (s + 1) * rows * Dl)));
    own_l.push_back(upload(gpu, std::vector<float>(part_lse.begin() + s * rows, part_lse.begin() + (s + 1) * rows)));
    qq.part_out_of[s] = own_o.back().ptr<bf16>();
    qq.part_lse_of[s] = own_l.back().ptr<float>();
  }
  Dev ob2 = upload(gpu, outb_c), lb2 = upload(gpu, lseb_c);
  qq.out = ob2.ptr<bf16>();
  qq.lse = lb2.ptr<float>();
  const Status sq = lse_merge_run(gpu, qq);
  const std::vector<bf16> got_q = download<bf16>(gpu, ob2, rows * Dl);
  const std::vector<float> lse_q = download<float>(gpu, lb2, rows), lse_b = download<float>(gpu, lb, rows);
  report(sq.ok() && std::memcmp(got_q.data(), got_b.data(), got_b.size() * sizeof(bf16)) == 0 &&
             std::memcmp(lse_q.data(), lse_b.data(), lse_b.size() * sizeof(float)) == 0,
         "lse_merge bf16 parts in separate buffers", sq.ok() ? "bit-identical to the contiguous parts" : sq.to_string());
}

// ------------------------------------------------------------------------------------------------------------
struct MlaCase {
  std::string name;
  int H = 16;
  int K = 2048;
  int page_size = 64;
  std::vector<int64_t> ctx;      // per request: keys visible to its first token
  std::vector<int> qlen;         // per request: query tokens (token i sees ctx + i + 1 keys... here ctx + i)
  DType out_dtype = DType::kF32;
  bool hostile_rows = true;      // -1 rows, garbage after -1, an all-invalid row
  int64_t first_page = 0;        // pages from this id up (to push offsets past 2^31)
  int64_t extra_pages = 5;
  int head_blocks = 1;           // SparseMlaParams::head_blocks (the CPU oracle takes the same layout)
  int splits = 0;                // CudaBackendOptions::mla_splits for this case (0: the backend's choice)
  float scale = 0.0721f;         // softmax scale (the kernels fold a positive one into the exponent)
  int cluster_merge = -1;        // CudaBackendOptions::mla_cluster_merge: 1 / 0 forces the split-K merge in a cluster / through
                                 // the workspace and the merge kernel (-1: the default, cluster for 64-head groups)
};

void run_mla_case(Backend& gpu, Backend& cpu, const MlaCase& c) {
  const int Dl = 512, Dr = 64;
  std::vector<int64_t> lens;
  std::vector<int32_t> request, key_len;
  for (size_t b = 0; b < c.ctx.size(); ++b) {
    lens.push_back(c.ctx[b] + c.qlen[b]);
    for (int i = 0; i < c.qlen[b]; ++i) {
      request.push_back(static_cast<int32_t>(b));
      key_len.push_back(static_cast<int32_t>(c.ctx[b] + i + 1));
    }
  }
  const int64_t T = static_cast<int64_t>(request.size());
  Paging pg = make_paging(lens, c.page_size, c.extra_pages, 31 + c.H, c.first_page);
  std::vector<uint16_t> latent = make_pool(pg, lens, Dl, 100);
  std::vector<uint16_t> rope = make_pool(pg, lens, Dr, 200);
  std::vector<uint16_t> qn = random_bf16(T * c.H * Dl, 300), qr = random_bf16(T * c.H * Dr, 301);
  std::vector<int32_t> topk(T * c.K, -1);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t len = key_len[t];
    int64_t n = std::min<int64_t>(c.K, len);
    if (c.hostile_rows && t % 5 == 2) n = n / 3;          // short row: -1 then garbage
    if (c.hostile_rows && t == T - 1 && T > 1) n = 0;     // all-invalid row
    // n distinct positions: stride walk from a random start (gcd-free stride)
    int64_t stride = 1 + static_cast<int64_t>(mix(400 + t) % 97);
    while (std::gcd(stride, len) != 1) ++stride;
    int64_t pos = static_cast<int64_t>(mix(500 + t) % len);
    for (int64_t i = 0; i < n; ++i) {
      topk[t * c.K + i] = static_cast<int32_t>(pos);
      pos = (pos + stride) % len;
    }
    if (c.hostile_rows && n < c.K) {
      for (int64_t i = n + 1; i < c.K; i += 3) topk[t * c.K + i] = static_cast<int32_t>(i % len);  // garbage after -1
    }
  }
  const float scale = c.scale;
  std::vector<float> out_c(T * c.H * Dl), lse_c(T * c.H);
  SparseMlaParams p;
  p.rows.num_tokens = T;
  p.H = c.H;
  p.Dl = Dl;
  p.Dr = Dr;
  p.K = c.K;
  p.scale = scale;
  p.q_dtype = DType::kBF16;
  p.latent = {nullptr, DType::kBF16, pg.num_pages, pg.page_size, Dl};
  p.rope = {nullptr, DType::kBF16, pg.num_pages, pg.page_size, Dr};
  p.block_table = {nullptr, pg.num_requests, pg.max_pages};
  p.out_dtype = DType::kF32;
  p.head_blocks = c.head_blocks;
  SparseMlaParams pc = p;
  pc.rows.request = request.data();
  pc.rows.key_len = key_len.data();
  pc.q_nope = qn.data();
  pc.q_rope = qr.data();
  pc.latent.data = latent.data();
  pc.rope.data = rope.data();
  pc.block_table.data = pg.bt.data();
  pc.topk = topk.data();
  pc.out = out_c.data();
  pc.lse = lse_c.data();
  const auto t0 = std::chrono::steady_clock::now();
  Status sc = sparse_mla_run(cpu, pc);
  const double cpu_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!sc.ok()) {
    report(false, "sparse_mla " + c.name, "CPU oracle failed: " + sc.to_string());
    return;
  }
  Dev d_req = upload(gpu, request), d_len = upload(gpu, key_len), d_qn = upload(gpu, qn), d_qr = upload(gpu, qr);
  Dev d_lat = upload(gpu, latent), d_rope = upload(gpu, rope), d_bt = upload(gpu, pg.bt), d_topk = upload(gpu, topk);
  const size_t out_bytes = T * c.H * Dl * dtype_size(c.out_dtype);
  std::vector<uint8_t> poison(out_bytes, 0xff);  // NaN pattern: every element must be written
  Dev d_out = upload(gpu, poison);
  Dev d_lse = upload(gpu, std::vector<float>(T * c.H, NAN));
  SparseMlaParams pgp = p;
  pgp.rows.request = d_req.ptr<int32_t>();
  pgp.rows.key_len = d_len.ptr<int32_t>();
  pgp.q_nope = d_qn.buf.get();
  pgp.q_rope = d_qr.buf.get();
  pgp.latent.data = d_lat.buf.get();
  pgp.rope.data = d_rope.buf.get();
  pgp.block_table.data = d_bt.ptr<int32_t>();
  pgp.topk = d_topk.ptr<int32_t>();
  pgp.out = d_out.buf.get();
  pgp.out_dtype = c.out_dtype;
  pgp.lse = d_lse.ptr<float>();
  Status sg = sparse_mla_run(gpu, pgp);
  if (!sg.ok()) {
    report(false, "sparse_mla " + c.name, sg.to_string());
    return;
  }
  std::vector<float> out_g;
  std::vector<uint8_t> raw1 = download<uint8_t>(gpu, d_out, out_bytes);
  if (c.out_dtype == DType::kBF16) {
    std::vector<uint16_t> b(T * c.H * Dl);
    std::memcpy(b.data(), raw1.data(), out_bytes);
    out_g = to_f32(b);
  } else {
    out_g.resize(T * c.H * Dl);
    std::memcpy(out_g.data(), raw1.data(), out_bytes);
  }
  std::vector<float> lse_g = download<float>(gpu, d_lse, T * c.H);
  bool nm_out = false, nm_lse = false;
  const double e_out = rel_norm(out_g, out_c, &nm_out);
  const double e_lse = rel_norm(lse_g, lse_c, &nm_lse);
  bool neg_inf_ok = true;
  for (int64_t i = 0; i < T * c.H; ++i) {
    if (std::isinf(lse_c[i]) != std::isinf(lse_g[i])) neg_inf_ok = false;
  }
  // rerun: bit-identical
  Status sg2 = sparse_mla_run(gpu, pgp);
  std::vector<uint8_t> raw2 = download<uint8_t>(gpu, d_out, out_bytes);
  std::vector<float> lse_g2 = download<float>(gpu, d_lse, T * c.H);
  const bool same = sg2.ok() && raw1 == raw2 && std::memcmp(lse_g.data(), lse_g2.data(), lse_g.size() * 4) == 0;
  const double tol = c.out_dtype == DType::kBF16 ? 1e-2 : 5e-3;
  char buf[256];
  std::snprintf(buf, sizeof buf, "T=%lld rel err out %.2e lse %.2e, rerun %s, cpu %.2fs", static_cast<long long>(T),
                e_out, e_lse, same ? "bit-identical" : "DIFFERS", cpu_s);
  report(!nm_out && !nm_lse && neg_inf_ok && e_out < tol && e_lse < 1e-3 && same, "sparse_mla " + c.name, buf);

  // hostile: a block-table entry out of range -> out_of_range, never a crash
  if (c.name.find("page61") != std::string::npos) {
    std::vector<int32_t> bt = pg.bt;
    for (int32_t& v : bt) {
      if (v >= 0) {
        v = static_cast<int32_t>(pg.num_pages + 3);
        break;
      }
    }
    Dev d_bad = upload(gpu, bt);
    SparseMlaParams pb = pgp;
    pb.block_table.data = d_bad.ptr<int32_t>();
    Status s = sparse_mla_run(gpu, pb);
    // only an error if some chosen key of request 0 lands on logical page 0; a pass is also acceptable then
    report(s.ok() || s.code() == StatusCode::kOutOfRange, "sparse_mla bad page id -> out_of_range or unused",
           s.to_string());
    std::vector<int32_t> bad_req = request;
    bad_req[0] = pg.num_requests + 2;
    Dev d_br = upload(gpu, bad_req);
    pb = pgp;
    pb.rows.request = d_br.ptr<int32_t>();
    s = sparse_mla_run(gpu, pb);
    report(s.code() == StatusCode::kOutOfRange, "sparse_mla bad request row -> out_of_range", s.to_string());
  }
}

// ------------------------------------------------------------------------------------------------------------
struct IdxCase {
  std::string name;
  int K = 2048;
  int page_size = 64;
  std::vector<int64_t> ctx;
  std::vector<int> qlen;
  int64_t first_page = 0;  // pages from this id up (to push key element offsets past 2^31)
  int distinct_keys = 0;   // > 0: every request's keys repeat this many distinct rows (scores tie in bulk)
  int Hi = 64;
};

void run_indexer_case(Backend& gpu, Backend& cpu, const IdxCase& c) {
  const int Hi = c.Hi, Di = 128;
  std::vector<int64_t> lens;
  std::vector<int32_t> request, key_len;
  for (size_t b = 0; b < c.ctx.size(); ++b) {
    lens.push_back(c.ctx[b] + c.qlen[b]);
    for (int i = 0; i < c.qlen[b]; ++i) {
      request.push_back(static_cast<int32_t>(b));
      key_len.push_back(static_cast<int32_t>(c.ctx[b] + i + 1));
    }
  }
  const int64_t T = static_cast<int64_t>(request.size());
  Paging pg = make_paging(lens, c.page_size, 4, 77, c.first_page);
  std::vector<uint16_t> keys = make_pool(pg, lens, Di, 600);
  // duplicate a few key rows so exact ties occur (ties must go to the lower position)
  for (int32_t b = 0; b < pg.num_requests; ++b) {
    for (int64_t j = 7; j + 100 < lens[b]; j += 997) {
      std::memcpy(&keys[pg.row_of(b, j + 100) * Di], &keys[pg.row_of(b, j) * Di], Di * 2);
    }
    for (int64_t j = c.distinct_keys; c.distinct_keys > 0 && j < lens[b]; ++j) {
      std::memcpy(&keys[pg.row_of(b, j) * Di], &keys[pg.row_of(b, j % c.distinct_keys) * Di], Di * 2);
    }
  }
  std::vector<uint16_t> q = random_bf16(T * Hi * Di, 700);
  std::vector<float> w(T * Hi);
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0.125f * uni(701, i);
  std::vector<int32_t> topk_c(T * c.K);
  std::vector<float> scores_c(T * c.K);
  IndexerTopkParams p;
  p.rows.num_tokens = T;
  p.Hi = Hi;
  p.Di = Di;
  p.K = c.K;
  p.q_dtype = DType::kBF16;
  p.keys = {nullptr, DType::kBF16, pg.num_pages, pg.page_size, Di};
  p.block_table = {nullptr, pg.num_requests, pg.max_pages};
  IndexerTopkParams pc = p;
  pc.rows.request = request.data();
  pc.rows.key_len = key_len.data();
  pc.q = q.data();
  pc.w = w.data();
  pc.keys.data = keys.data();
  pc.block_table.data = pg.bt.data();
  pc.topk = topk_c.data();
  pc.topk_scores = scores_c.data();
  const auto t0 = std::chrono::steady_clock::now();
  Status sc = indexer_topk_run(cpu, pc);
  const double cpu_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!sc.ok()) {
    report(false, "indexer_topk " + c.name, "CPU oracle failed: " + sc.to_string());
    return;
  }
  Dev d_req = upload(gpu, request), d_len = upload(gpu, key_len), d_q = upload(gpu, q), d_w = upload(gpu, w);
  Dev d_keys = upload(gpu, keys), d_bt = upload(gpu, pg.bt);
  Dev d_topk = upload(gpu, std::vector<int32_t>(T * c.K, 0x7eadbeef));
  IndexerTopkParams pgp = p;
  pgp.rows.request = d_req.ptr<int32_t>();
  pgp.rows.key_len = d_len.ptr<int32_t>();
  pgp.q = d_q.buf.get();
  pgp.w = d_w.ptr<float>();
  pgp.keys.data = d_keys.buf.get();
  pgp.block_table.data = d_bt.ptr<int32_t>();
  pgp.topk = d_topk.ptr<int32_t>();
  Dev d_scores = upload(gpu, std::vector<float>(T * c.K, 12345.f));
  pgp.topk_scores = d_scores.ptr<float>();
  Status sg = indexer_topk_run(gpu, pgp);
  if (!sg.ok()) {
    report(false, "indexer_topk " + c.name, sg.to_string());
    return;
  }
  std::vector<int32_t> topk_g = download<int32_t>(gpu, d_topk, T * c.K);
  std::vector<float> scores_g = download<float>(gpu, d_scores, T * c.K);
  // topk_scores on rows equal to the CPU's: same -inf padding, values within fp32 rounding of the CPU's
  double score_err = 0, score_max = 0;
  bool score_pad_ok = true;
  for (int64_t t = 0; t < T; ++t) {
    if (!std::equal(&topk_g[t * c.K], &topk_g[t * c.K] + c.K, &topk_c[t * c.K])) continue;
    for (int64_t i = 0; i < c.K; ++i) {
      const float a = scores_g[t * c.K + i], r = scores_c[t * c.K + i];
      if (std::isinf(a) || std::isinf(r)) {
        if (a != r) score_pad_ok = false;
        continue;
      }
      score_err = std::max(score_err, static_cast<double>(std::abs(a - r)));
      score_max = std::max(score_max, static_cast<double>(std::abs(r)));
    }
  }
  const bool scores_ok = score_pad_ok && score_err <= 1e-4 * score_max + 1e-6;
  Status sg2 = indexer_topk_run(gpu, pgp);
  std::vector<int32_t> topk_g2 = download<int32_t>(gpu, d_topk, T * c.K);
  const bool rerun_same = sg2.ok() && topk_g == topk_g2;

  // Validate each GPU row: canonical form, and a set that is a correct top-k under fp64 scores up to near-ties.
  int64_t rows_exact = 0, bad_rows = 0, swaps = 0;
  std::string first_bad;
  std::vector<double> ref;
  std::vector<float> kf(Di);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t n = key_len[t];
    const int32_t* g = &topk_g[t * c.K];
    const int32_t* cr = &topk_c[t * c.K];
    if (std::equal(g, g + c.K, cr)) {
      ++rows_exact;
      continue;
    }
    const int64_t want = std::min<int64_t>(c.K, n);
    bool ok = true;
    for (int64_t i = 0; i < c.K; ++i) {
      if (i < want && (g[i] < 0 || g[i] >= n || (i > 0 && g[i] <= g[i - 1]))) ok = false;
      if (i >= want && g[i] != -1) ok = false;
    }
    if (ok) {
      // fp64 scores of the row
      const int32_t b = request[t];
      ref.assign(static_cast<size_t>(n), 0.0);
      double max_abs = 0;
      for (int64_t j = 0; j < n; ++j) {
        const uint16_t* kr = &keys[pg.row_of(b, j) * Di];
        double s = 0;
        for (int h = 0; h < Hi; ++h) {
          double dot = 0;
          const uint16_t* qr = &q[(t * Hi + h) * Di];
          for (int d = 0; d < Di; ++d) dot += static_cast<double>(bf16_to_f32(bf16{qr[d]})) * bf16_to_f32(bf16{kr[d]});
          s += static_cast<double>(w[t * Hi + h]) * std::max(dot, 0.0);
        }
        ref[j] = s;
        max_abs = std::max(max_abs, std::abs(s));
      }
      std::vector<uint8_t> chosen(static_cast<size_t>(n), 0);
      double min_chosen = std::numeric_limits<double>::infinity();
      for (int64_t i = 0; i < want; ++i) {
        chosen[g[i]] = 1;
        min_chosen = std::min(min_chosen, ref[g[i]]);
      }
      double max_unchosen = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        if (!chosen[j]) max_unchosen = std::max(max_unchosen, ref[j]);
      }
      const double tol = 2e-5 * max_abs + 1e-6;
      if (max_unchosen > min_chosen + tol) ok = false;
      for (int64_t i = 0; i < want; ++i) swaps += std::find(cr, cr + want, g[i]) == cr + want;
    }
    if (!ok) {
      ++bad_rows;
      if (first_bad.empty()) first_bad = " first bad row t=" + std::to_string(t);
    }
  }
  char buf[256];
  std::snprintf(buf, sizeof buf, "T=%lld rows identical to CPU %lld, near-tie swaps %lld, bad rows %lld, rerun %s, cpu %.2fs",
                static_cast<long long>(T), static_cast<long long>(rows_exact), static_cast<long long>(swaps),
                static_cast<long long>(bad_rows), rerun_same ? "bit-identical" : "DIFFERS", cpu_s);
  char sbuf[96];
  std::snprintf(sbuf, sizeof sbuf, ", topk_scores max abs err %.1e of %.1e%s", score_err, score_max,
                score_pad_ok ? "" : " (padding differs)");
  report(bad_rows == 0 && rerun_same && scores_ok, "indexer_topk " + c.name, std::string(buf) + sbuf + first_bad);
}

// ------------------------------------------------------------------------------------------------------------
// FP8 indexer (e4m3 q + q_scale, two-plane FP8 key pages) against direct host math: the pool is written by the GPU
// cache write from f32/bf16 rows (bytes compared with dsacp/fp8.h run on the host), then scores + top-k are
// checked against fp64 scores of the dequantized values (canonical form, the set up to near-ties, exact duplicates
// tie to the lower position, NaN keys lowest) and rerun bit-identical.
struct Fp8Case {
  std::string name;
  int Hi = 64;
  int K = 2048;
  int page_size = 64;
  std::vector<int64_t> ctx;
  std::vector<int> qlen;
  Fp8ScaleMode mode = Fp8ScaleMode::kFp32;
  DType rows_dtype = DType::kF32;
  bool hostile = false;  // NaN / Inf / zero / tiny / large keys
};

void run_fp8_indexer_case(Backend& gpu, const Fp8Case& c) {
  const int Hi = c.Hi, Di = 128;
  const std::string name = "indexer_topk fp8 " + c.name;
  std::vector<int64_t> lens;
  std::vector<int32_t> request, key_len;
  for (size_t b = 0; b < c.ctx.size(); ++b) {
    lens.push_back(c.ctx[b] + c.qlen[b]);
    for (int i = 0; i < c.qlen[b]; ++i) {
      request.push_back(static_cast<int32_t>(b));
      key_len.push_back(static_cast<int32_t>(c.ctx[b] + i + 1));
    }
  }
  const int64_t T = static_cast<int64_t>(request.size());
  const uint64_t seed = 900 + static_cast<uint64_t>(std::hash<std::string>{}(c.name) % 1000);
  Paging pg = make_paging(lens, c.page_size, 3, seed);
  // Key rows (f32, rounded to bf16 for bf16 rows), their slots, and the host's expected pool bytes.
  int64_t nrows = 0;
  for (int64_t l : lens) nrows += l;
  std::vector<float> rows(static_cast<size_t>(nrows * Di));
  std::vector<int64_t> slots(static_cast<size_t>(nrows));
  std::vector<int64_t> row_base(lens.size());
  for (int32_t b = 0, r = 0; b < pg.num_requests; ++b) {
    row_base[b] = r;
    for (int64_t j = 0; j < lens[b]; ++j, ++r) {
      // duplicates: key j + 100 repeats key j (j = 7 mod 997), an exact tie
      const int64_t src = (j % 997 == 107) ? j - 100 : j;
      float amp = 1.f;
      if (c.hostile) {
        if (src % 97 == 5) amp = 0.f;        // zero key: scale 2^-126, every value 0
        if (src % 79 == 11) amp = 1e-37f;    // tiny key: the smallest scale, subnormal e4m3 values
        if (src % 73 == 13) amp = 30.f;      // large key
      }
      for (int d = 0; d < Di; ++d) {
        float v = amp * uni(seed + 1 + b, static_cast<uint64_t>(src) * Di + d);
        if (c.hostile && src % 89 == 3 && d == 17) v = std::numeric_limits<float>::quiet_NaN();
        if (c.hostile && src % 83 == 7 && d == 5) v = -std::numeric_limits<float>::infinity();  // saturates
        if (c.rows_dtype == DType::kBF16) v = round_to_bf16(v);
        rows[r * Di + d] = v;
      }
      slots[r] = pg.row_of(b, j);
    }
  }
  const int64_t pool_bytes = pg.num_pages * fp8_index_page_bytes(pg.page_size, Di);
  std::vector<uint8_t> pool_h(static_cast<size_t>(pool_bytes), 0xff);
  for (int64_t r = 0; r < nrows; ++r) {
    float amax = 0.f;
    for (int d = 0; d < Di; ++d) amax = std::max(amax, fp8_amax_term(rows[r * Di + d]));
    const float sc = fp8_scale_from_amax(amax, c.mode);
    const int64_t page = slots[r] / pg.page_size;
    const int32_t off = static_cast<int32_t>(slots[r] % pg.page_size);
    for (int d = 0; d < Di; ++d) {
      pool_h[fp8_index_value_offset(page, off, pg.page_size, Di) + d] = fp8_quantize(rows[r * Di + d], sc);
    }
    std::memcpy(&pool_h[fp8_index_scale_offset(page, off, pg.page_size, Di)], &sc, 4);
  }
  // GPU cache write into a pool filled like the host's
  Dev d_pool = upload(gpu, pool_h);  // (overwritten below except the unused slots)
  {
    std::vector<uint8_t> fill(static_cast<size_t>(pool_bytes), 0xff);
    Status s0 = gpu.copy_to_device(d_pool.buf.get(), fill.data(), fill.size());
    Dev d_rows = c.rows_dtype == DType::kBF16 ? [&] {
      std::vector<uint16_t> rb(rows.size());
      for (size_t i = 0; i < rows.size(); ++i) rb[i] = f32_to_bf16(rows[i]).bits;
      return upload(gpu, rb);
    }() : upload(gpu, rows);
    Dev d_slots = upload(gpu, slots);
    CacheWriteParams cw;
    cw.rows = d_rows.buf.get();
    cw.rows_dtype = c.rows_dtype;
    cw.fp8_scale_mode = c.mode;
    cw.num_rows = nrows;
    cw.slots = d_slots.ptr<int64_t>();
    cw.pool = {d_pool.buf.get(), DType::kF8E4M3, pg.num_pages, pg.page_size, Di};
    Status s = s0.ok() ? gpu.cache_write(cw) : s0;
    if (s.ok()) s = gpu.synchronize();
    const std::vector<uint8_t> got = download<uint8_t>(gpu, d_pool, pool_h.size());
    int64_t diff = 0;
    for (size_t i = 0; i < got.size(); ++i) diff += got[i] != pool_h[i];
    report(s.ok() && diff == 0, "cache_write fp8 " + c.name + " bit-exact vs dsacp/fp8.h on the host",
           s.ok() ? std::to_string(diff) + " bytes differ of " + std::to_string(got.size()) : s.to_string());
  }
  // queries: e4m3 values, positive scales over a wide range, signed head weights
  std::vector<uint8_t> q(static_cast<size_t>(T * Hi * Di));
  for (size_t i = 0; i < q.size(); ++i) q[i] = f32_to_e4m3(6.f * uni(seed + 2, i));
  std::vector<float> qs(static_cast<size_t>(T * Hi)), w(static_cast<size_t>(T * Hi));
  for (size_t i = 0; i < qs.size(); ++i) {
    qs[i] = std::ldexp(1.f + 0.5f * uni(seed + 3, i), static_cast<int>(mix(seed + 4 + i) % 9) - 6);
    w[i] = 0.125f * uni(seed + 5, i);
  }
  Dev d_req = upload(gpu, request), d_len = upload(gpu, key_len), d_q = upload(gpu, q), d_qs = upload(gpu, qs);
  Dev d_w = upload(gpu, w), d_bt = upload(gpu, pg.bt);
  Dev d_topk = upload(gpu, std::vector<int32_t>(T * c.K, 0x7eadbeef));
  Dev d_scores = upload(gpu, std::vector<float>(T * c.K, 12345.f));
  IndexerTopkParams p;
  p.rows = {T, d_req.ptr<int32_t>(), d_len.ptr<int32_t>()};
  p.Hi = Hi;
  p.Di = Di;
  p.K = c.K;
  p.q = d_q.buf.get();
  p.q_dtype = DType::kF8E4M3;
  p.q_scale = d_qs.ptr<float>();
  p.w = d_w.ptr<float>();
  p.keys = {d_pool.buf.get(), DType::kF8E4M3, pg.num_pages, pg.page_size, Di};
  p.block_table = {d_bt.ptr<int32_t>(), pg.num_requests, pg.max_pages};
  p.topk = d_topk.ptr<int32_t>();
  p.topk_scores = d_scores.ptr<float>();
  p.host_request = request.data();
  p.host_key_len = key_len.data();
  Status sg = gpu.indexer_topk(p);
  if (sg.ok()) sg = gpu.synchronize();
  if (!sg.ok()) {
    report(false, name, sg.to_string());
    return;
  }
  const std::vector<int32_t> topk_g = download<int32_t>(gpu, d_topk, T * c.K);
  const std::vector<float> scores_g = download<float>(gpu, d_scores, T * c.K);
  Status sg2 = gpu.indexer_topk(p);
  if (sg2.ok()) sg2 = gpu.synchronize();
  const std::vector<float> scores_g2 = download<float>(gpu, d_scores, T * c.K);  // (bits: NaN scores of NaN keys)
  const bool rerun_same = sg2.ok() && download<int32_t>(gpu, d_topk, T * c.K) == topk_g &&
                          std::memcmp(scores_g2.data(), scores_g.data(), scores_g.size() * sizeof(float)) == 0;
  // fp64 reference from the host's bytes
  int64_t bad_rows = 0, nan_keys = 0;
  double score_err = 0, score_max = 0;
  std::string first_bad;
  std::vector<double> ref, kdq;
  for (int64_t t = 0; t < T; ++t) {
    const int32_t b = request[t];
    const int64_t n = key_len[t];
    ref.assign(static_cast<size_t>(n), 0.0);
    double max_abs = 0;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t slot = pg.row_of(b, j), page = slot / pg.page_size;
      const int32_t off = static_cast<int32_t>(slot % pg.page_size);
      const uint8_t* kv = &pool_h[fp8_index_value_offset(page, off, pg.page_size, Di)];
      float sk;
      std::memcpy(&sk, &pool_h[fp8_index_scale_offset(page, off, pg.page_size, Di)], 4);
      double s = 0;
      for (int h = 0; h < Hi; ++h) {
        double dot = 0;
        const uint8_t* qr = &q[(t * Hi + h) * Di];
        for (int d = 0; d < Di; ++d) dot += static_cast<double>(e4m3_to_f32(qr[d])) * e4m3_to_f32(kv[d]);
        const double x = static_cast<double>(qs[t * Hi + h]) * sk * dot;
        s += static_cast<double>(w[t * Hi + h]) * (x < 0 ? 0.0 : x);
      }
      ref[j] = s;
      if (std::isnan(s)) {
        nan_keys += t == 0;
      } else {
        max_abs = std::max(max_abs, std::abs(s));
      }
    }
    const double tol = 2e-5 * max_abs + 1e-6;
    auto rk = [&](int64_t j) { return std::isnan(ref[j]) ? -std::numeric_limits<double>::infinity() : ref[j]; };
    const int32_t* g = &topk_g[t * c.K];
    const int64_t want = std::min<int64_t>(c.K, n);
    bool ok = true;
    for (int64_t i = 0; i < c.K; ++i) {
      if (i < want && (g[i] < 0 || g[i] >= n || (i > 0 && g[i] <= g[i - 1]))) ok = false;
      if (i >= want && g[i] != -1) ok = false;
    }
    if (ok) {
      std::vector<uint8_t> chosen(static_cast<size_t>(n), 0);
      double min_chosen = std::numeric_limits<double>::infinity();
      for (int64_t i = 0; i < want; ++i) {
        chosen[g[i]] = 1;
        min_chosen = std::min(min_chosen, rk(g[i]));
        const float sgv = scores_g[t * c.K + i];
        if (std::isnan(ref[g[i]]) != std::isnan(sgv)) ok = false;
        if (!std::isnan(sgv)) {
          score_err = std::max(score_err, std::abs(sgv - ref[g[i]]) / (max_abs + 1e-30));
          score_max = std::max(score_max, std::abs(ref[g[i]]));
        }
      }
      for (int64_t i = want; i < c.K; ++i) ok = ok && scores_g[t * c.K + i] == -std::numeric_limits<float>::infinity();
      double max_unchosen = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        if (!chosen[j]) max_unchosen = std::max(max_unchosen, rk(j));
        // an exact duplicate (same bytes, same score) ties to the lower position
        if (j % 997 == 107 && chosen[j] && !chosen[j - 100]) ok = false;
      }
      if (max_unchosen > min_chosen + tol) ok = false;
    }
    if (!ok) {
      ++bad_rows;
      if (first_bad.empty()) first_bad = " first bad row t=" + std::to_string(t);
    }
  }
  char buf[256];
  std::snprintf(buf, sizeof buf, "T=%lld bad rows %lld, rerun %s, topk_scores max rel err %.1e (of the row's max), "
                "NaN keys in row 0: %lld", static_cast<long long>(T), static_cast<long long>(bad_rows),
                rerun_same ? "bit-identical" : "DIFFERS", score_err, static_cast<long long>(nan_keys));
  report(bad_rows == 0 && rerun_same && score_err <= 2e-5, name, std::string(buf) + first_bad);
}

// The persistent wgmma score kernel (the FP8 default, forced here through its launcher) against the
// mma.sync kernel on the same plan: every visible score within 1e-5 of the row's largest (NaN where NaN), nothing
// written past a token's key_len (both buffers start poisoned), reruns bit-identical.
struct ScoreSideCase {
  std::string name;
  int Hi;
  int page_size;
  std::vector<int64_t> ctx;
  std::vector<int> qlen;
  int num_sms = 0;  // > 0: the CTAs the wgmma kernel is given (few: many items a CTA, batch boundaries crossed)
};

void run_scores_side_by_side(const ScoreSideCase& c) {
  using namespace dsacp::cuda;
  const int Hi = c.Hi, Di = 128;
  const std::string name = "indexer scores side by side " + c.name + " (wgmma kernel vs mma.sync kernel)";
  std::vector<int64_t> lens;
  std::vector<int32_t> request, key_len;
  for (size_t b = 0; b < c.ctx.size(); ++b) {
    lens.push_back(c.ctx[b] + c.qlen[b]);
    for (int i = 0; i < c.qlen[b]; ++i) {
      request.push_back(static_cast<int32_t>(b));
      key_len.push_back(static_cast<int32_t>(c.ctx[b] + i + 1));
    }
  }
  const int64_t T = static_cast<int64_t>(request.size());
  const uint64_t seed = 4000 + static_cast<uint64_t>(std::hash<std::string>{}(c.name) % 1000);
  Paging pg = make_paging(lens, c.page_size, 2, seed);
  const int64_t page_bytes = fp8_index_page_bytes(pg.page_size, Di);
  std::vector<uint8_t> pool(static_cast<size_t>(pg.num_pages * page_bytes));
  for (int64_t page = 0; page < pg.num_pages; ++page) {
    for (int32_t i = 0; i < pg.page_size; ++i) {
      for (int d = 0; d < Di; ++d) {
        const uint64_t at = static_cast<uint64_t>((page * pg.page_size + i) * Di + d);
        pool[fp8_index_value_offset(page, i, pg.page_size, Di) + d] =
            (at % 4099 == 17) ? kE4m3NaN : f32_to_e4m3(300.f * uni(seed + 1, at));
      }
      const float sk = std::ldexp(1.f + 0.5f * uni(seed + 2, page * pg.page_size + i), -9);
      std::memcpy(&pool[fp8_index_scale_offset(page, i, pg.page_size, Di)], &sk, 4);
    }
  }
  std::vector<uint8_t> q(static_cast<size_t>(T * Hi * Di));
  for (size_t i = 0; i < q.size(); ++i) q[i] = f32_to_e4m3(6.f * uni(seed + 3, i));
  std::vector<float> qs(static_cast<size_t>(T * Hi)), w(static_cast<size_t>(T * Hi));
  for (size_t i = 0; i < qs.size(); ++i) {
    qs[i] = std::ldexp(1.f + 0.5f * uni(seed + 4, i), static_cast<int>(mix(seed + 5 + i) % 9) - 6);
    w[i] = 0.125f * uni(seed + 6, i);
  }
  auto dput = [](const auto& v) {
    void* d = nullptr;
    const size_t n = std::max<size_t>(16, v.size() * sizeof(v[0]));
    if (cudaMalloc(&d, n) != cudaSuccess) return static_cast<void*>(nullptr);
    if (!v.empty()) cudaMemcpy(d, v.data(), v.size() * sizeof(v[0]), cudaMemcpyHostToDevice);
    return d;
  };
  IndexerTopkParams p;
  p.rows.num_tokens = T;
  p.Hi = Hi;
  p.Di = Di;
  p.K = 2048;
  p.q_dtype = DType::kF8E4M3;
  p.keys = {nullptr, DType::kF8E4M3, pg.num_pages, pg.page_size, Di};
  p.block_table = {nullptr, pg.num_requests, pg.max_pages};
  auto plan = indexer_plan(p, request.data(), key_len.data());
  if (!plan.ok()) {
    report(false, name, plan.status().to_string());
    return;
  }
  const std::vector<ScoreItem> items = indexer_plan_items(*plan);
  std::vector<void*> bufs = {dput(request), dput(key_len), dput(q), dput(qs), dput(w), dput(pool), dput(pg.bt),
                             dput(items), dput(plan->score_offset)};
  const std::vector<float> poison(static_cast<size_t>(std::max<int64_t>(1, plan->max_score_floats)), 12345.f);
  void* d_a = dput(poison);
  void* d_b = dput(poison);
  p.rows.request = static_cast<const int32_t*>(bufs[0]);
  p.rows.key_len = static_cast<const int32_t*>(bufs[1]);
  p.q = bufs[2];
  p.q_scale = static_cast<const float*>(bufs[3]);
  p.w = static_cast<const float*>(bufs[4]);
  p.keys.data = bufs[5];
  p.block_table.data = static_cast<const int32_t*>(bufs[6]);
  const ScoreItem* d_items = static_cast<const ScoreItem*>(bufs[7]);
  const int64_t* d_off = static_cast<const int64_t*>(bufs[8]);
  LaunchContext ctx;  // pass 0: the mma.sync kernel (forced), passes 1 and 2: the wgmma kernel
  ctx.options.indexer_score_kernel = CudaBackendOptions::IndexerScoreKernel::kMmaSync;
  if (c.num_sms > 0) ctx.num_sms = c.num_sms;
  Status st = Status::ok_status();
  std::vector<float> a, b, b2;
  bool applies = true;
  for (int pass = 0; pass < 3 && st.ok(); ++pass) {
    for (const auto& ch : plan->chunks) {
      applies = applies && indexer_scores_wgmma_applies(p, ch.max_group_tokens);
      const ScoreItem* it = d_items + ch.item_begin;
      const int64_t n = ch.item_end - ch.item_begin;
      float* out = static_cast<float*>(pass == 0 ? d_a : d_b);
      if (pass == 0) {
        st = launch_indexer_scores(p, it, n, ch.max_group_tokens, d_off, out, InlinePlan{}, ctx);
      } else {
        st = launch_indexer_scores_wgmma(p, it, n, ch.max_group_tokens, d_off, out, InlinePlan{}, ctx);
      }
      if (!st.ok()) break;
      if (plan->chunks.size() > 1) break;  // (one chunk's rows: later chunks reuse the buffer)
    }
    if (cudaDeviceSynchronize() != cudaSuccess) st = internal_error("side-by-side score launch failed");
    std::vector<float>& dst = pass == 0 ? a : pass == 1 ? b : b2;
    dst.resize(poison.size());
    cudaMemcpy(dst.data(), pass == 0 ? d_a : d_b, dst.size() * 4, cudaMemcpyDeviceToHost);
  }
  for (void* v : bufs) cudaFree(v);
  cudaFree(d_a);
  cudaFree(d_b);
  if (!st.ok() || !applies) {
    report(false, name, st.ok() ? "the wgmma kernel does not apply" : st.to_string());
    return;
  }
  const auto& ch = plan->chunks.front();
  int64_t bad = 0, unwritten = 0, overwritten = 0, nans = 0;
  double max_rel = 0;
  std::vector<uint8_t> visible(a.size(), 0);
  for (int64_t t = ch.t0; t < ch.t1; ++t) {
    const int64_t off = plan->score_offset[t];
    double row_max = 0;
    for (int64_t j = 0; j < key_len[t]; ++j) {
      if (!std::isnan(a[off + j])) row_max = std::max(row_max, std::abs(static_cast<double>(a[off + j])));
    }
    for (int64_t j = 0; j < key_len[t]; ++j) {
      visible[off + j] = 1;
      const float x = a[off + j], y = b[off + j];
      if (y == 12345.f) ++unwritten;
      if (std::isnan(x) || std::isnan(y)) {
        nans += std::isnan(y);
        bad += std::isnan(x) != std::isnan(y);
        continue;
      }
      const double rel = std::abs(static_cast<double>(x) - y) / (row_max + 1e-30);
      max_rel = std::max(max_rel, rel);
      bad += rel > 1e-5;
    }
  }
  for (size_t i = 0; i < b.size(); ++i) overwritten += !visible[i] && b[i] != 12345.f;
  const bool same = std::memcmp(b.data(), b2.data(), b.size() * 4) == 0;
  char buf[256];
  std::snprintf(buf, sizeof buf, "T=%lld, %lld off by > 1e-5 of the row max (max %.1e), %lld NaN, %lld unwritten, "
                "%lld written past key_len, rerun %s", static_cast<long long>(T), static_cast<long long>(bad), max_rel,
                static_cast<long long>(nans), static_cast<long long>(unwritten), static_cast<long long>(overwritten),
                same ? "bit-identical" : "DIFFERS");
  report(bad == 0 && unwritten == 0 && overwritten == 0 && same && nans > 0, name, buf);
}

// Already-quantized rows (e4m3 + row_scales) are stored as they are.
void test_cache_write_fp8_rows(Backend& gpu) {
  const int Di = 128, ps = 61, pages = 3, T = 50;
  std::vector<uint8_t> rows(T * Di);
  std::vector<float> sc(T);
  std::vector<int64_t> slots(T);
  for (int t = 0; t < T; ++t) {
    for (int d = 0; d < Di; ++d) rows[t * Di + d] = static_cast<uint8_t>(mix(31 + t * Di + d));
    sc[t] = std::ldexp(1.f, t - 25);
    slots[t] = t == 7 ? -1 : (t * 3) % (ps * pages);
  }
  std::vector<uint8_t> want(static_cast<size_t>(pages * fp8_index_page_bytes(ps, Di)), 0);
  for (int t = 0; t < T; ++t) {
    if (slots[t] < 0) continue;
    const int64_t page = slots[t] / ps;
    const int32_t off = static_cast<int32_t>(slots[t] % ps);
    std::memcpy(&want[fp8_index_value_offset(page, off, ps, Di)], &rows[t * Di], Di);
    std::memcpy(&want[fp8_index_scale_offset(page, off, ps, Di)], &sc[t], 4);
  }
  Dev d_pool = upload(gpu, std::vector<uint8_t>(want.size(), 0));
  Dev d_rows = upload(gpu, rows), d_sc = upload(gpu, sc), d_slots = upload(gpu, slots);
  CacheWriteParams cw;
  cw.rows = d_rows.buf.get();
  cw.rows_dtype = DType::kF8E4M3;
  cw.row_scales = d_sc.ptr<float>();
  cw.num_rows = T;
  cw.slots = d_slots.ptr<int64_t>();
  cw.pool = {d_pool.buf.get(), DType::kF8E4M3, pages, ps, Di};
  Status s = gpu.cache_write(cw);
  if (s.ok()) s = gpu.synchronize();
  const bool same = download<uint8_t>(gpu, d_pool, want.size()) == want;
  report(s.ok() && same, "cache_write fp8: e4m3 rows + row_scales stored as they are (page61)", s.to_string());
}

void test_cp_kernels(Backend& gpu, Backend& cpu) {
  // gather_rows: bf16 -> f32 and bf16 -> bf16, -1 rows are NaN
  const int dim = 576;
  const int64_t src_rows = 300, n = 257;
  std::vector<uint16_t> src = random_bf16(src_rows * dim, 900);
  std::vector<int64_t> index(n);
  for (int64_t i = 0; i < n; ++i) index[i] = (i % 9 == 4) ? -1 : static_cast<int64_t>(mix(901 + i) % src_rows);
  Dev d_src = upload(gpu, src), d_index = upload(gpu, index);
  for (DType dst_dtype : {DType::kF32, DType::kBF16}) {
    const size_t bytes = n * dim * dtype_size(dst_dtype);
    std::vector<uint8_t> out_c(bytes);
    Dev d_out = upload(gpu, std::vector<uint8_t>(bytes, 0));
    GatherRowsParams p;
    p.src_dtype = DType::kBF16;
    p.src_rows = src_rows;
    p.dim = dim;
    p.num_rows = n;
    p.dst_dtype = dst_dtype;
    GatherRowsParams pc = p, pg = p;
    pc.src = src.data();
    pc.index = index.data();
    pc.dst = out_c.data();
    pg.src = d_src.buf.get();
    pg.index = d_index.ptr<int64_t>();
    pg.dst = d_out.buf.get();
    Status sc = gather_rows_run(cpu, pc), sg = gather_rows_run(gpu, pg);
    std::vector<uint8_t> out_g = download<uint8_t>(gpu, d_out, bytes);
    bool same = sc.ok() && sg.ok();
    for (int64_t i = 0; same && i < n * dim; ++i) {
      const float a = load_as_f32(out_g.data(), dst_dtype, i), b = load_as_f32(out_c.data(), dst_dtype, i);
      same = (std::isnan(a) && std::isnan(b)) || a == b;
    }
    report(same, std::string("gather_rows BF16->") + dtype_name(dst_dtype) + " with -1 rows",
           sg.ok() ? "equal to CPU (NaN rows NaN)" : sg.to_string());
  }
  index[3] = src_rows;
  Dev d_bad = upload(gpu, index);
  GatherRowsParams pb;
  pb.src = d_src.buf.get();
  pb.src_rows = src_rows;
  pb.dim = dim;
  pb.index = d_bad.ptr<int64_t>();
  pb.num_rows = n;
  Dev d_outb = upload(gpu, std::vector<uint16_t>(n * dim, 0));
  pb.dst = d_outb.buf.get();
  Status sb = gather_rows_run(gpu, pb);
  report(sb.code() == StatusCode::kOutOfRange, "gather_rows bad index -> out_of_range", sb.to_string());

  // topk_remap: Pt = 3, I = 5, rank 1, rows with -1 padding
  const int64_t rows = 37;
  const int K = 100;
  std::vector<int32_t> topk(rows * K, -1);
  for (int64_t r = 0; r < rows; ++r) {
    const int m = static_cast<int>(mix(950 + r) % (K + 1));
    for (int i = 0; i < m; ++i) topk[r * K + i] = static_cast<int32_t>(mix(951 + r * K + i) % 5000);
  }
  std::vector<int32_t> local_c(rows * K);
  Dev d_topk = upload(gpu, topk), d_local = upload(gpu, std::vector<int32_t>(rows * K, 7));
  TopkRemapParams rp;
  rp.num_rows = rows;
  rp.K = K;
  rp.Pt = 3;
  rp.I = 5;
  rp.cr = 1;
  TopkRemapParams rc = rp, rg = rp;
  rc.topk = topk.data();
  rc.local = local_c.data();
  rg.topk = d_topk.ptr<int32_t>();
  rg.local = d_local.ptr<int32_t>();
  Status s1 = topk_remap_run(cpu, rc), s2 = topk_remap_run(gpu, rg);
  report(s1.ok() && s2.ok() && download<int32_t>(gpu, d_local, rows * K) == local_c, "topk_remap Pt=3 I=5 cr=1",
         s2.ok() ? "identical to CPU" : s2.to_string());

  // topk_merge (device bitonic merge; host merge past 16384 candidates per row): parts of ascending local rows
  // with scores full of ties, NaN and -inf, garbage after a part's first -1 (ignored, as on the CPU).
  // narrow: distinct scores in [1.499, 1.501) (the candidates share their leading bytes, as a real row's do).
  // equal: every score the same (the order is the positions': the radix select runs through the position bytes).
  // The backend the merge cases run on: this one, or one whose options take the general kernel for every shape.
  Backend* merge_backend = &gpu;
  auto merge_case = [&](int Pt, int Km, int64_t mrows, int I, uint64_t seed, const std::string& name,
                        bool shuffled = false, bool narrow = false, bool equal = false) {
    Backend& on = *merge_backend;
    std::vector<int32_t> part_topk(static_cast<size_t>(Pt) * mrows * Km, -1);
    std::vector<float> part_scores(part_topk.size(), -INFINITY);
    for (int s = 0; s < Pt; ++s) {
      for (int64_t r = 0; r < mrows; ++r) {
        const size_t base = (static_cast<size_t>(s) * mrows + r) * Km;
        const int m = static_cast<int>(mix(seed + s * mrows + r) % (Km + 1));
        for (int i = 0; i < m; ++i) {
          part_topk[base + i] = i * 2 + static_cast<int>(mix(seed + 7 * i) % 2);  // ascending local positions
          const uint64_t h = mix(seed * 3 + base + i);
          part_scores[base + i] = equal         ? 0.75f
                                  : narrow      ? 1.5f + 0.001f * uni(seed, base + i)
                                  : h % 97 == 0 ? NAN
                                  : h % 89 == 0 ? -INFINITY
                                                : std::round(8.f * uni(seed, base + i));
        }
        for (int i = m - 1; shuffled && i > 0; --i) {  // not the canonical ascending order
          const size_t j = base + mix(seed + 31 * i) % (i + 1);
          std::swap(part_topk[base + i], part_topk[j]);
        }
        if (m + 1 < Km) part_topk[base + m + 1] = 12345;  // garbage after the first -1
      }
    }
    std::vector<int32_t> merged_c(mrows * Km);
    Dev d_pt = upload(on, part_topk), d_ps = upload(on, part_scores);
    Dev d_m = upload(on, std::vector<int32_t>(mrows * Km, 7));
    TopkMergeParams mp;
    mp.num_parts = Pt;
    mp.num_rows = mrows;
    mp.K = Km;
    mp.I = I;
    TopkMergeParams mc = mp, mg = mp;
    mc.part_topk = part_topk.data();
    mc.part_scores = part_scores.data();
    mc.topk = merged_c.data();
    mg.part_topk = d_pt.ptr<int32_t>();
    mg.part_scores = d_ps.ptr<float>();
    mg.topk = d_m.ptr<int32_t>();
    Status sc = topk_merge_run(cpu, mc), sg = topk_merge_run(on, mg);
    report(sc.ok() && sg.ok() && download<int32_t>(on, d_m, mrows * Km) == merged_c, name,
           sg.ok() ? "identical to CPU" : sg.to_string() + " / " + sc.to_string());
    // With the fused remap to the last part's local positions (what the DCP local decodes read).
    std::vector<int32_t> local_c(merged_c.size());
    Dev d_local = upload(on, std::vector<int32_t>(merged_c.size(), 0));
    mc.local_topk = local_c.data();
    mg.local_topk = d_local.ptr<int32_t>();
    mc.local_part = mg.local_part = Pt - 1;
    sc = topk_merge_run(cpu, mc);
    sg = topk_merge_run(on, mg);
    report(sc.ok() && sg.ok() && download<int32_t>(on, d_m, mrows * Km) == merged_c &&
               download<int32_t>(on, d_local, mrows * Km) == local_c,
           name + ", with the local remap", sg.ok() ? "identical to CPU" : sg.to_string() + " / " + sc.to_string());
    // The parts given one buffer each (the DCP step's window exchange reads every rank's buffer in place).
    if (Pt <= kMaxPartBuffers) {
      std::vector<Dev> own_t, own_s;
      TopkMergeParams mq = mg;
      mq.part_topk = nullptr;
      mq.part_scores = nullptr;
      const size_t n1 = static_cast<size_t>(mrows) * Km;
      for (int s = 0; s < Pt; ++s) {
        own_t.push_back(upload(on, std::vector<int32_t>(part_topk.begin() + s * n1, part_topk.begin() + (s + 1) * n1)));
        own_s.push_back(upload(on, std::vector<float>(part_scores.begin() + s * n1, part_scores.begin() + (s + 1) * n1)));
        mq.part_topk_of[s] = own_t.back().ptr<int32_t>();
        mq.part_scores_of[s] = own_s.back().ptr<float>();
      }
      Dev d_m2 = upload(on, std::vector<int32_t>(mrows * Km, 7)), d_l2 = upload(on, std::vector<int32_t>(mrows * Km, 7));
      mq.topk = d_m2.ptr<int32_t>();
      mq.local_topk = d_l2.ptr<int32_t>();
      const Status sq = topk_merge_run(on, mq);
      report(sq.ok() && download<int32_t>(on, d_m2, mrows * Km) == merged_c &&
                 download<int32_t>(on, d_l2, mrows * Km) == local_c,
             name + ", parts in separate buffers", sq.ok() ? "identical to CPU" : sq.to_string());
    }
    mg.local_topk = nullptr;
    // An entry below -1 is an error, on the device as on the host.
    part_topk[part_topk.size() / 2] = -5;
    Dev d_bad = upload(on, part_topk);
    mg.part_topk = d_bad.ptr<int32_t>();
    Status sb = topk_merge_run(on, mg);
    report(sb.code() == StatusCode::kOutOfRange, name + ": entry -5 -> out_of_range", sb.to_string());
  };
  merge_case(3, K, rows, 4, 960, "topk_merge 3 parts K=100 with ties");
  merge_case(2, 2048, 64, 64, 970, "topk_merge 2 parts K=2048 (device)");
  merge_case(2, 2048, 64, 64, 975, "topk_merge 2 parts K=2048, distinct scores sharing leading bytes", false, true);
  merge_case(2, 2048, 64, 64, 976, "topk_merge 2 parts K=2048, scores all equal", false, false, true);
  {
    CudaBackendOptions general;
    general.topk_merge_general = true;  // the general kernel on the shapes the small one takes
    auto gb = make_cuda_backend(0, general);
    if (gb.ok()) {
      merge_backend = gb->get();
      merge_case(2, 2048, 64, 64, 971, "topk_merge 2 parts K=2048 (general kernel)");
      merge_case(2, 512, 16, 3, 996, "topk_merge 2 parts K=512, positions not ascending (general kernel)", true);
      merge_backend = &gpu;
    } else {
      report(false, "topk_merge: a backend with the general kernel", gb.status().to_string());
    }
  }
  merge_case(4, 2048, 16, 1, 977, "topk_merge 4 parts K=2048, distinct scores sharing leading bytes", false, true);
  merge_case(8, 2048, 9, 1, 980, "topk_merge 8 parts K=2048 (device, 192 KB shared)");
  merge_case(16, 2048, 5, 3, 990, "topk_merge 16 parts K=2048 (host fallback)");
  merge_case(2, 512, 16, 3, 995, "topk_merge 2 parts K=512, positions not ascending (sort fallback)", true);
}

// Deferred error checks (what the executors use): launches return at once, the first data error comes back
// from synchronize() naming its launch; a scope left early drops its errors; uploads staged in the pinned ring
// are copies of the bytes at call time (the ring wraps past 8 MiB).
void test_deferred_errors(Backend& gpu) {
  const int dim = 8;
  const int64_t src_rows = 10, n = 4;
  std::vector<float> src(src_rows * dim);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<float>(i);
  Dev d_src = upload(gpu, src), d_good = upload(gpu, std::vector<int64_t>{0, 3, -1, 9}),
      d_bad = upload(gpu, std::vector<int64_t>{0, 3, 10, 9}), d_out = upload(gpu, std::vector<float>(n * dim, 0.f));
  GatherRowsParams good;
  good.src = d_src.buf.get();
  good.src_dtype = DType::kF32;
  good.src_rows = src_rows;
  good.dim = dim;
  good.index = d_good.ptr<int64_t>();
  good.num_rows = n;
  good.dst = d_out.buf.get();
  good.dst_dtype = DType::kF32;
  GatherRowsParams bad = good;
  bad.index = d_bad.ptr<int64_t>();
  Status g1, b1, g2, sync1, sync2;
  {
    DeferredErrors defer(gpu);
    g1 = gather_rows_run(gpu, good);
    b1 = gather_rows_run(gpu, bad);
    g2 = gather_rows_run(gpu, good);
    sync1 = gpu.synchronize();
    sync2 = gpu.synchronize();
  }
  report(g1.ok() && b1.ok() && g2.ok() && sync1.code() == StatusCode::kOutOfRange &&
             sync1.message().find("gather_rows: index[2]") != std::string::npos &&
             sync1.message().find("launch 2 of 3") != std::string::npos && sync2.ok(),
         "deferred: a bad index reports at synchronize, naming its launch", sync1.to_string());
  // begin_synchronize enqueues the read-back early; launches after it are still read back.
  Status staged, early_sync, late_sync, clean_sync;
  {
    DeferredErrors defer(gpu);
    (void)gather_rows_run(gpu, bad);
    staged = gpu.begin_synchronize();
    early_sync = gpu.synchronize();
    (void)gather_rows_run(gpu, good);
    (void)gpu.begin_synchronize();
    (void)gather_rows_run(gpu, bad);
    late_sync = gpu.synchronize();
    (void)gather_rows_run(gpu, good);
    (void)gpu.begin_synchronize();
    clean_sync = gpu.synchronize();
  }
  report(staged.ok() && early_sync.code() == StatusCode::kOutOfRange &&
             early_sync.message().find("gather_rows: index[2]") != std::string::npos &&
             late_sync.code() == StatusCode::kOutOfRange && late_sync.message().find("launch 2 of 2") != std::string::npos &&
             clean_sync.ok(),
         "deferred: begin_synchronize reads back early; a launch after it is still checked",
         early_sync.to_string() + " | " + late_sync.to_string() + " | " + clean_sync.to_string());
  {
    DeferredErrors defer(gpu);
    (void)gather_rows_run(gpu, bad);
  }  // left without synchronize: dropped
  Status after = gather_rows_run(gpu, good);
  report(after.ok() && gpu.synchronize().ok(), "deferred: a scope left early drops its errors", after.to_string());

  // 3000 uploads of 4 KiB from one host buffer rewritten between calls: 12 MiB through the 8 MiB ring.
  const size_t chunk = 1024, count = 3000;
  auto big = gpu.allocate(chunk * count * sizeof(int32_t));
  if (!big.ok()) return report(false, "deferred uploads", big.status().to_string());
  std::vector<int32_t> host(chunk);
  Status up, sync;
  {
    DeferredErrors defer(gpu);
    for (size_t k = 0; k < count && up.ok(); ++k) {
      for (size_t i = 0; i < chunk; ++i) host[i] = static_cast<int32_t>(mix(k * chunk + i));
      up = gpu.copy_to_device(big->as<int32_t>() + k * chunk, host.data(), chunk * sizeof(int32_t));
    }
    sync = gpu.synchronize();
  }
  std::vector<int32_t> got(chunk * count);
  Status down = gpu.copy_to_host(got.data(), big->get(), got.size() * sizeof(int32_t));
  size_t wrong = 0;
  for (size_t j = 0; j < got.size(); ++j) wrong += got[j] != static_cast<int32_t>(mix(j));
  report(up.ok() && sync.ok() && down.ok() && wrong == 0, "deferred: 3000 uploads through the pinned ring",
         std::to_string(wrong) + " words wrong " + up.to_string());
}

// The backend's block cache: a freed block comes back for the next allocation of its size class (in stream
// order, so data written through the new buffer is never overwritten by work queued for the old one); an
// allocation the device cannot hold fails with resource_exhausted after the cache is given back.
void test_block_cache(Backend& gpu, bool try_oom) {
  void* first = nullptr;
  {
    auto a = gpu.allocate(3u << 20);
    if (!a.ok()) return report(false, "block cache", a.status().to_string());
    first = a->get();
  }
  auto b = gpu.allocate((3u << 20) - 1000);  // the same size class
  report(b.ok() && b->get() == first, "block cache: a freed block is reused by the next allocation of its class",
         b.ok() ? "" : b.status().to_string());
  // Stream order: fill through buffer x, free it, reuse its block as y in the same deferred scope, fill y;
  // x's fill is queued before y's, so y reads back its own bytes.
  const size_t n = 1 << 18;
  std::vector<int32_t> ones(n, 1), twos(n, 2), got(n, 0);
  Status s1, s2, sync;
  void* reused = nullptr;
  {
    DeferredErrors defer(gpu);
    auto x = gpu.allocate(n * sizeof(int32_t));
    if (!x.ok()) return report(false, "block cache order", x.status().to_string());
    s1 = gpu.copy_to_device(x->get(), ones.data(), n * sizeof(int32_t));
    void* xp = x->get();
    *x = DeviceBuffer{};
    auto y = gpu.allocate(n * sizeof(int32_t));
    if (!y.ok()) return report(false, "block cache order", y.status().to_string());
    reused = y->get() == xp ? y->get() : nullptr;
    s2 = gpu.copy_to_device(y->get(), twos.data(), n * sizeof(int32_t));
    sync = gpu.synchronize();
    if (sync.ok()) sync = gpu.copy_to_host(got.data(), y->get(), n * sizeof(int32_t));
  }
  report(s1.ok() && s2.ok() && sync.ok() && reused != nullptr && got == twos,
         "block cache: reuse within a deferred scope is stream-ordered", sync.to_string());
  // Not under --quick (what compute-sanitizer runs): the failing cudaMallocAsync counts as an API error there.
  if (!try_oom) return;
  auto huge = gpu.allocate(size_t{1} << 42);  // 4 TiB
  report(!huge.ok() && huge.status().code() == StatusCode::kResourceExhausted &&
             huge.status().message().find("allocation of 4398046511104 bytes") != std::string::npos,
         "block cache: an allocation past the device fails with resource_exhausted",
         huge.ok() ? "allocated" : huge.status().to_string());
  auto after = gpu.allocate(1u << 20);
  report(after.ok(), "block cache: allocations work after a failed one", after.ok() ? "" : after.status().to_string());
}

// Lanes: the side lane is its own stream; work on it is ordered after the main lane's work before begin_lanes
// and before the main lane's work after end_lanes; a block freed in a session is not handed out again until the
// session ends; a second session on the same thread is refused.
void test_lanes(Backend& gpu) {
  const size_t n = size_t{1} << 26;  // 256 MiB of int32: a fill long enough for ordering mistakes to show
  auto big = gpu.allocate(n * sizeof(int32_t));
  auto copy = gpu.allocate(n * sizeof(int32_t));
  if (!big.ok() || !copy.ok()) return report(false, "lanes", "allocation failed");
  Status s;
  void* main_stream = gpu.native_stream();
  void* side_stream = nullptr;
  void* held = nullptr;
  bool reused_in_session = true;
  {
    DeferredErrors defer(gpu);
    s = gpu.fill(big->get(), DType::kI32, static_cast<int64_t>(n), 3.f);  // main, before the session
    LaneSession lanes(gpu);
    if (s.ok()) s = lanes.begin();
    Status again = gpu.begin_lanes();
    report(!again.ok() && again.message().find("already open") != std::string::npos,
           "lanes: a second session on one thread is refused", again.to_string());
    lanes.set_lane(1);
    side_stream = gpu.native_stream();
    // Side: reads what main wrote before the session, then overwrites it.
    if (s.ok()) s = gpu.copy_on_device(copy->get(), big->get(), n * sizeof(int32_t));
    if (s.ok()) s = gpu.fill(big->get(), DType::kI32, static_cast<int64_t>(n), 1.f);
    {
      auto x = gpu.allocate(3u << 20);
      if (x.ok()) held = x->get();
    }
    auto y = gpu.allocate(3u << 20);
    reused_in_session = y.ok() && y->get() == held;
    lanes.set_lane(0);
    if (s.ok()) s = lanes.end();
    if (s.ok()) s = gpu.synchronize();
  }
  report(s.ok() && side_stream != nullptr && side_stream != main_stream && gpu.native_stream() == main_stream,
         "lanes: the side lane is a stream of its own, the main lane comes back at the end", s.to_string());
  report(held != nullptr && !reused_in_session, "lanes: a block freed in a session is held until it ends");
  // The free list now holds the held block, then y's (freed after the session, so on top): two allocations of
  // the class take both.
  auto z1 = gpu.allocate(3u << 20);
  auto z2 = gpu.allocate(3u << 20);
  report(z1.ok() && z2.ok() && (z1->get() == held || z2->get() == held), "lanes: held blocks are reused after the session");
  // Main after the session: sees the side lane's fill; the side lane saw main's fill from before the session.
  std::vector<int32_t> a(n), b(n);
  Status d1 = gpu.copy_to_host(a.data(), big->get(), n * sizeof(int32_t));
  Status d2 = gpu.copy_to_host(b.data(), copy->get(), n * sizeof(int32_t));
  const bool a_ok = std::all_of(a.begin(), a.end(), [](int32_t v) { return v == 1; });
  const bool b_ok = std::all_of(b.begin(), b.end(), [](int32_t v) { return v == 3; });
  report(d1.ok() && d2.ok() && a_ok && b_ok, "lanes: side work ordered after main's before begin, before main's after end",
         std::string(a_ok ? "" : "side fill not seen ") + (b_ok ? "" : "main fill not seen by the side lane"));
}

void test_unsupported(Backend& gpu) {
  SparseMlaParams p;
  p.H = 8;  // every H runs; the latent width does not
  p.Dl = 256;
  p.Dr = 64;
  Status s = gpu.sparse_mla(p);
  report(s.code() == StatusCode::kUnsupported && s.message().find("Dl=256") != std::string::npos &&
             s.message().find("Dl = 512") != std::string::npos,
         "sparse_mla Dl=256 -> unsupported naming the supported set", s.to_string());
  IndexerTopkParams q;
  q.Hi = 48;
  q.Di = 128;
  q.q_dtype = DType::kBF16;
  q.keys.dtype = DType::kBF16;
  s = gpu.indexer_topk(q);
  report(s.code() == StatusCode::kUnsupported && s.message().find("Hi = 32 or 64") != std::string::npos,
         "indexer_topk Hi=48 -> unsupported naming the supported set", s.to_string());
  // The fused candidate merge needs the row-synchronized exchange, and its shape must be the top-k's.
  IndexerTopkParams fm;
  fm.Hi = 64;
  fm.Di = 128;
  fm.K = 2048;
  fm.q_dtype = DType::kBF16;
  fm.keys = {nullptr, DType::kBF16, 1, 64, 128};
  fm.rows.num_tokens = 2;
  fm.merge.num_rows = 2;
  fm.merge.num_parts = 2;
  fm.merge.K = 2048;
  s = gpu.indexer_topk(fm);
  report(s.code() == StatusCode::kInvalidArgument && s.message().find("row-synchronized") != std::string::npos,
         "indexer_topk with a fused merge but no row-synchronized exchange -> invalid argument", s.to_string());
  fm.signal.seq = fm.merge.wait.seq = 1;
  fm.signal.size = 2;
  fm.merge.K = 1024;
  s = gpu.indexer_topk(fm);
  report(s.code() == StatusCode::kInvalidArgument && s.message().find("K=1024") != std::string::npos &&
             s.message().find("K=2048") != std::string::npos,
         "indexer_topk with a fused merge of another K -> invalid argument naming both", s.to_string());
  fm.merge.K = 2048;
  fm.merge.num_parts = fm.signal.size = 4;
  s = gpu.indexer_topk(fm);
  report(s.code() == StatusCode::kUnsupported && s.message().find("4 x 2048") != std::string::npos,
         "indexer_topk with a fused merge of 4 x 2048 candidates -> unsupported", s.to_string());
  SparseMlaParams hb;
  hb.H = 128;
  hb.Dl = 512;
  hb.Dr = 64;
  hb.latent = {nullptr, DType::kBF16, 4, 64, 512};
  hb.rope = {nullptr, DType::kBF16, 4, 64, 64};
  // The ranks' partials merged inside attention need 64 heads a rank: 32 heads per block (which attention alone
  // runs, in 32-head groups) is refused with the reason, so that the CP step takes its other path.
  hb.head_blocks = 4;
  hb.peer.sync.seq = 1;
  hb.peer.sync.size = 4;
  hb.peer.sync.num_rows = 1;
  s = gpu.sparse_mla(hb);
  report(s.code() == StatusCode::kUnsupported && s.message().find("64 heads a rank") != std::string::npos &&
             s.message().find("head_blocks=4") != std::string::npos,
         "sparse_mla H=128 head_blocks=4 merged across ranks -> unsupported", s.to_string());
  hb.H = 16;
  hb.head_blocks = 2;
  hb.peer.sync.size = 2;
  s = gpu.sparse_mla(hb);
  report(s.code() == StatusCode::kUnsupported && s.message().find("64 heads a rank") != std::string::npos,
         "sparse_mla H=16 head_blocks=2 merged across ranks -> unsupported", s.to_string());
}

}  // namespace

int main(int argc, char** argv) {
  dsacp::testing::install_crash_trace();
  bool quick = false;
  const char* json = nullptr;
  // --seed N: the top-k tests' seed (default: fresh from the clock; each check names the seed it used)
  uint64_t topk_seed = static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
  std::string only;  // --only TEXT: just the sparse MLA and indexer cases whose name contains TEXT (for a sanitizer
                     // run of one case); the other checks are skipped
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
    if (std::strcmp(argv[i], "--json") == 0 && i + 1 < argc) json = argv[++i];
    if (std::strcmp(argv[i], "--only") == 0 && i + 1 < argc) only = argv[++i];
    if (std::strcmp(argv[i], "--seed") == 0 && i + 1 < argc) topk_seed = std::strtoull(argv[++i], nullptr, 10);
  }
  auto selected = [&](const std::string& name) { return only.empty() || name.find(only) != std::string::npos; };
  auto gr = make_cuda_backend(0);
  if (!gr.ok()) {
    std::printf("SKIP: %s\n", gr.status().to_string().c_str());
    return 77;
  }
  std::unique_ptr<Backend> gpu = std::move(gr).value();
  std::unique_ptr<Backend> cpu = make_cpu_backend(0);

  if (only.empty()) {
    test_unsupported(*gpu);
    test_cache_write(*gpu, *cpu);
    test_cache_write_upload(*gpu, *cpu);
    test_lse_merge(*gpu, *cpu);
    test_cp_kernels(*gpu, *cpu);
    test_deferred_errors(*gpu);
    test_block_cache(*gpu, !quick);
    test_lanes(*gpu);
  }

  std::vector<MlaCase> mla;
  mla.push_back({"decode H=16 page64 K=2048 split-K", 16, 2048, 64, {3000, 2100, 900}, {1, 1, 1}});
  mla.push_back({"decode H=32 page61 K=2048 MTP", 32, 2048, 61, {5000, 2500}, {3, 2}});
  mla.push_back({"decode H=64 page1 K=512", 64, 512, 1, {1500, 700, 40}, {1, 2, 1}});
  mla.push_back({"decode H=128 page64 K=2048 bf16 out", 128, 2048, 64, {4096, 3000}, {2, 1}, DType::kBF16});
  mla.push_back({"prefill H=128 page64 K=2048", 128, 2048, 64, {0}, {quick ? 300 : 700}});
  mla.push_back({"prefill H=16 page61 K=300 chunked", 16, 300, 61, {900, 0}, {200, 150}});
  // Tokens per request >= 8: the warp-specialized kernel by default; an odd tile count (K = 320: 5 tiles, the
  // last pair half empty), hostile rows and the bad-page / bad-request checks (page61).
  mla.push_back({"prefill H=128 page61 K=320 chunked", 128, 320, 61, {700, 0}, {120, 90}});
  {
    // The DCP head-block layout (2 blocks of 64 heads), through the split-K combine and without splits.
    MlaCase hb{"decode H=128 head_blocks=2 split-K", 128, 2048, 64, {3000, 2100}, {2, 1}};
    hb.head_blocks = 2;
    mla.push_back(hb);
    hb.name = "decode H=128 head_blocks=2 no split";
    hb.splits = 1;
    hb.out_dtype = DType::kBF16;
    mla.push_back(hb);
  }
  {
    // Split-K merged by a cluster of the token's splits (2..8: an even, an odd and the largest cluster; forced for
    // the 16 / 32-head kernel, whose default is the merge kernel), and 64-head cases through the workspace and the
    // merge kernel (forced, and past 8 splits); hostile rows leave some splits without keys.
    auto add_split = [&](MlaCase c, int splits, int cluster_merge, int head_blocks = 1) {
      c.splits = splits;
      c.cluster_merge = cluster_merge;
      c.head_blocks = head_blocks;
      mla.push_back(c);
    };
    add_split({"decode H=16 page64 splits=4 cluster merge", 16, 2048, 64, {3000, 2100, 900}, {1, 1, 1}}, 4, 1);
    add_split({"decode H=32 page61 MTP splits=8 cluster merge", 32, 2048, 61, {5000, 2500}, {3, 2}}, 8, 1);
    add_split({"decode H=64 page64 splits=2 cluster merge bf16 out", 64, 2048, 64, {3000, 1500}, {1, 1}, DType::kBF16},
              2, -1);
    add_split({"decode H=128 page64 splits=3 cluster merge head_blocks=2", 128, 2048, 64, {4000, 2000}, {1, 2}}, 3, -1,
              2);
    add_split({"decode H=64 page64 splits=2 merge kernel", 64, 2048, 64, {3000, 1500}, {1, 1}}, 2, 0);
    // more splits than a cluster holds
    add_split({"decode H=128 page64 splits=12 merge kernel bf16 out", 128, 2048, 64, {4000, 2500}, {1, 1},
               DType::kBF16},
              12, -1);
  }
  {
    // The softmax scale's sign and size: a negative and a zero scale (scores scaled before the row max), a large
    // one (logits in the hundreds: the exponent's range).
    auto add_scaled = [&](MlaCase c, float scale) {
      c.scale = scale;
      mla.push_back(c);
    };
    add_scaled({"decode H=64 page64 negative scale", 64, 2048, 64, {2000, 900}, {1, 1}}, -0.0721f);
    add_scaled({"decode H=128 page64 zero scale", 128, 1024, 64, {1500}, {1}}, 0.f);
    add_scaled({"prefill H=128 page64 K=512 scale 1.5", 128, 512, 64, {0}, {160}}, 1.5f);
  }
  {
    // Every head count, in the next head group up with its missing rows masked (sparse_mla_shape): 1..16 in a
    // 16-head group, 17..32 in a 32-head one, 48 and 96 in 64-head groups of the mma.sync kernel (the last one
    // partial); decode, MTP up to 16 tokens and prefill; page sizes 1, 61, 64; hostile rows (short, all-invalid,
    // -1 holes then garbage) in every case.
    struct SmallH {
      int H;
      int page;
    };
    for (const SmallH& h : {SmallH{1, 64}, SmallH{2, 61}, SmallH{3, 1}, SmallH{4, 64}, SmallH{8, 61}, SmallH{12, 64},
                            SmallH{24, 61}, SmallH{48, 64}, SmallH{96, 61}}) {
      const std::string hs = "H=" + std::to_string(h.H) + " page" + std::to_string(h.page);
      mla.push_back({"decode " + hs + " K=2048 split-K", h.H, 2048, h.page, {3000, 2100, 900}, {1, 1, 1}});
      mla.push_back({"MTP " + hs + " K=1024 x16 x5", h.H, 1024, h.page, {1500, 2500}, {16, 5}, DType::kBF16});
      mla.push_back({"prefill " + hs + " K=300 chunked", h.H, 300, h.page, {400, 0}, {quick ? 40 : 130, 70}});
    }
    // Head blocks smaller than a group (the DCP layouts with H / D < 16) and blocks of a partial 64-head group.
    auto add_blocks = [&](MlaCase c, int head_blocks, int splits = 0, int cluster_merge = -1) {
      c.head_blocks = head_blocks;
      c.splits = splits;
      c.cluster_merge = cluster_merge;
      mla.push_back(c);
    };
    add_blocks({"decode H=16 head_blocks=2 split-K", 16, 2048, 64, {3000, 2100}, {2, 1}}, 2);
    add_blocks({"decode H=16 head_blocks=4 page61 no split", 16, 2048, 61, {3000, 2100}, {1, 1}, DType::kBF16}, 4, 1);
    add_blocks({"prefill H=16 head_blocks=8 page1 K=256", 16, 256, 1, {300, 0}, {40, 30}}, 8);
    add_blocks({"MTP H=8 head_blocks=2 K=512", 8, 512, 64, {2000, 700}, {3, 4}}, 2);
    add_blocks({"decode H=128 head_blocks=4 split-K", 128, 2048, 64, {3000, 2100}, {1, 1}}, 4);
    add_blocks({"decode H=128 head_blocks=8 page61", 128, 1024, 61, {3000}, {2}, DType::kBF16}, 8);
    add_blocks({"decode H=96 head_blocks=2 split-K", 96, 2048, 64, {3000, 2100}, {1, 1}}, 2);
    add_blocks({"prefill H=96 head_blocks=2 K=320", 96, 320, 64, {500, 0}, {60, 30}}, 2);
    // Partial groups through either split-K merge: the cluster (forced for 16 / 32-head groups, the default for
    // 64-head ones) and the workspace with the merge kernel.
    add_blocks({"decode H=8 page64 splits=4 cluster merge", 8, 2048, 64, {3000, 2100, 900}, {1, 1, 1}}, 1, 4, 1);
    add_blocks({"decode H=24 page61 MTP splits=3 cluster merge", 24, 2048, 61, {5000, 2500}, {3, 2}}, 1, 3, 1);
    add_blocks({"decode H=48 page64 splits=5 cluster merge", 48, 2048, 64, {3000, 1500}, {1, 1}}, 1, 5, -1);
    add_blocks({"decode H=96 page64 splits=3 merge kernel bf16 out", 96, 2048, 64, {3000, 1500}, {1, 2},
                DType::kBF16},
               1, 3, 0);
    add_blocks({"decode H=12 head_blocks=2 splits=3 merge kernel", 12, 2048, 64, {3000, 1500}, {1, 1}}, 2, 3, 0);
  }
  if (!quick) {
    // element offsets past 2^31: pages from 4.2M rows up (latent row offset * 512 > 2^31)
    MlaCase big{"decode H=64 offsets past 2^31", 64, 2048, 64, {5000, 3000}, {1, 1}};
    big.first_page = (int64_t{1} << 31) / 512 / 64 + 10;
    big.extra_pages = 2;
    mla.push_back(big);
  }
  for (const MlaCase& c : mla) {
    if (!selected(c.name)) continue;
    CudaBackendOptions o;
    o.mla_splits = c.splits;
    if (c.cluster_merge >= 0) {
      o.mla_cluster_merge = c.cluster_merge == 1 ? CudaBackendOptions::Choice::kOn : CudaBackendOptions::Choice::kOff;
    }
    using K = CudaBackendOptions::MlaKernel;
    std::vector<std::pair<K, const char*>> kernels = {{K::kAuto, ""}};  // default kernels (64-head groups: by
                                                                         // tokens per request)
    if (c.H >= 64 && (c.H / c.head_blocks) % 64 == 0) {  // every kernel for 64-head groups
      kernels.insert(kernels.end(), {{K::kWgmmaWs, "ws"}, {K::kWgmmaWs32, "ws32"}, {K::kMmaSync, "mma"}});
    }
    for (const auto& [kernel, tag] : kernels) {
      o.mla_kernel = kernel;
      auto be = make_cuda_backend(0, o);
      MlaCase m = c;
      if (tag[0] != 0) m.name += std::string(" [") + tag + "]";
      if (!be.ok()) {
        report(false, m.name + ": backend", be.status().to_string());
        continue;
      }
      run_mla_case(**be, *cpu, m);
    }
  }

  std::vector<IdxCase> idx;
  idx.push_back({"decode b=4 ctx 5000 page64", 2048, 64, {5000, 4100, 2049, 100}, {1, 1, 1, 1}});
  idx.push_back({"MTP b=2 x3 page61 K=512", 512, 61, {3000, 1200}, {3, 3}});
  idx.push_back({"prefill 600 causal page1 K=256", 256, 1, {0}, {600}});
  idx.push_back({"chunked prefill ctx 1000 + 333 page64 K=2048", 2048, 64, {1000}, {333}});
  if (!quick) {
    idx.push_back({"decode ctx 140000 (128K+) page64", 2048, 64, {140000, 131072}, {1, 1}});
    // Long rows (the top-k's boundary-bin filter) with ties in bulk: 60 distinct keys (each score ~2300 times:
    // the bin fits, ties at the threshold go to the lower positions), and one distinct key (every score equal:
    // the bin is the row, the passes over the row instead).
    IdxCase ties{"decode ctx 140000 + 70000, 60 distinct keys", 2048, 64, {140000, 70000}, {1, 2}};
    ties.distinct_keys = 60;
    idx.push_back(ties);
    ties.name = "decode ctx 100000, every key the same";
    ties.ctx = {100000};
    ties.qlen = {1};
    ties.distinct_keys = 1;
    idx.push_back(ties);
    // element offsets past 2^31 in the indexer pool: pages from 16.8M rows up (row offset * 128 > 2^31)
    idx.push_back({"decode, key offsets past 2^31", 2048, 64, {5000, 3000}, {1, 2}, (int64_t{1} << 31) / 128 / 64 + 10});
  }
  // The plan in the kernels' parameters (one chunk of at most 128 tokens) at its edge: 128 rows inline, 129 from
  // device memory; and a small plan from device memory too (CudaBackendOptions::indexer_inline_plan off).
  for (const int b : {128, 129}) {
    IdxCase edge{b == 128 ? "decode b=128 (plan inline)" : "decode b=129 (plan in device memory)", 512, 64, {}, {}};
    for (int i = 0; i < b; ++i) {
      edge.ctx.push_back(300 + 37 * i);
      edge.qlen.push_back(1);
    }
    idx.push_back(edge);
  }
  {
    // bf16 with 32 indexer heads (GLM-5.x's indexer) against the CPU backend
    IdxCase h32{"Hi=32 decode b=3 page64 K=2048", 2048, 64, {5000, 2100, 300}, {1, 2, 1}};
    h32.Hi = 32;
    idx.push_back(h32);
    h32 = {"Hi=32 prefill 400 causal page61 K=128", 128, 61, {0}, {400}};
    h32.Hi = 32;
    idx.push_back(h32);
  }
  for (const IdxCase& c : idx) {
    if (selected(c.name)) run_indexer_case(*gpu, *cpu, c);
  }
  std::vector<Fp8Case> fp8;
  fp8.push_back({"Hi=64 decode b=3 page64 K=2048 hostile keys", 64, 2048, 64, {5000, 2100, 900}, {1, 1, 1},
                 Fp8ScaleMode::kFp32, DType::kF32, true});
  fp8.push_back({"Hi=32 MTP 16+3 page61 K=512 ue8m0 bf16 rows", 32, 512, 61, {3000, 1200}, {16, 3},
                 Fp8ScaleMode::kUe8m0, DType::kBF16, false});
  fp8.push_back({"Hi=64 prefill 300 causal page1 K=1 hostile keys", 64, 1, 1, {0}, {300}, Fp8ScaleMode::kUe8m0,
                 DType::kF32, true});
  fp8.push_back({"Hi=32 chunked 1000 + 333 page64 K=2048 hostile keys", 32, 2048, 64, {1000}, {333},
                 Fp8ScaleMode::kFp32, DType::kBF16, true});
  fp8.push_back({"Hi=64 MTP 4+2+1 page64 K=1000", 64, 1000, 64, {4000, 2500, 1700}, {4, 2, 1}, Fp8ScaleMode::kFp32,
                 DType::kF32, false});
  // The persistent wgmma kernel (page sizes that are multiples of 4): page 16 (4 pages a 64-key block) next to 64,
  // rows shorter than a block (1..66 keys), next_n 1..16 (groups of up to 4 tokens, the last one partial), prefill
  // past the inline plan (the plan in device memory), and a 300K+ row that wraps each CTA's stage ring many times.
  fp8.push_back({"Hi=64 decode b=3 page16 K=2048 hostile keys", 64, 2048, 16, {5000, 2100, 900}, {1, 1, 1},
                 Fp8ScaleMode::kFp32, DType::kF32, true});
  fp8.push_back({"Hi=32 decode short rows page16 K=64", 32, 64, 16, {0, 5, 30, 62, 63, 64, 65}, {1, 1, 1, 1, 1, 1, 1},
                 Fp8ScaleMode::kFp32, DType::kF32, false});
  fp8.push_back({"Hi=64 decode short rows page64 K=2048", 64, 2048, 64, {0, 1, 63, 64, 200}, {1, 1, 1, 1, 1},
                 Fp8ScaleMode::kUe8m0, DType::kF32, false});
  fp8.push_back({"Hi=64 MTP next_n 1..16 page64 K=2048", 64, 2048, 64, {3000, 2000, 1000, 4100, 2500, 700, 1800},
                 {1, 2, 3, 4, 5, 8, 16}, Fp8ScaleMode::kFp32, DType::kBF16, false});
  fp8.push_back({"Hi=32 MTP next_n 1..16 page16 K=512", 32, 512, 16, {1500, 2000, 900, 3000, 600}, {16, 3, 1, 4, 7},
                 Fp8ScaleMode::kUe8m0, DType::kF32, true});
  fp8.push_back({"Hi=64 prefill 400 causal page64 K=300 (plan in device memory)", 64, 300, 64, {0}, {400},
                 Fp8ScaleMode::kFp32, DType::kF32, false});
  fp8.push_back({"Hi=32 chunked 600 + 200 page16 K=2048 hostile keys", 32, 2048, 16, {600}, {200},
                 Fp8ScaleMode::kFp32, DType::kF32, true});
  if (!quick) {
    fp8.push_back({"Hi=64 decode ctx 320000 + 2 x 40000 page64 K=2048", 64, 2048, 64, {320000, 40000, 40000},
                   {1, 1, 1}, Fp8ScaleMode::kFp32, DType::kBF16, false});
    fp8.push_back({"Hi=32 decode ctx 300000 MTP 2 page16 K=2048 hostile keys", 32, 2048, 16, {300000}, {2},
                   Fp8ScaleMode::kUe8m0, DType::kF32, true});
    fp8.push_back({"Hi=64 decode ctx 140000 page64 K=2048 hostile keys", 64, 2048, 64, {140000}, {1},
                   Fp8ScaleMode::kFp32, DType::kBF16, true});
    fp8.push_back({"Hi=32 decode ctx 70000 x2 page61 K=2048", 32, 2048, 61, {70000}, {2}, Fp8ScaleMode::kUe8m0,
                   DType::kF32, false});
  }
  for (const Fp8Case& c : fp8) {
    if (selected("fp8 " + c.name)) run_fp8_indexer_case(*gpu, c);
  }
  if (only.empty()) test_cache_write_fp8_rows(*gpu);
  // the fp8_ds_mla latent cache: everything, or with --only fp8_ds_mla_small the subset a sanitizer run takes
  {
    const bool fp8_small = only == "fp8_ds_mla_small";
    dsacp::testing::gpu_fp8_mla_checks(*gpu, *cpu, topk_seed, fp8_small, g_log, [&](const std::string& name) {
      return fp8_small ? name.find("fp8_ds_mla") != std::string::npos : selected(name);
    });
  }
  // the streaming 16-head-group kernel: everything, or with --only small_heads_small the sanitizer subset
  {
    const bool sh_small = only == "small_heads_small";
    dsacp::testing::gpu_small_heads_checks(*cpu, topk_seed, sh_small, g_log, [&](const std::string& name) {
      return sh_small ? name.find("small_heads") != std::string::npos : selected(name);
    });
  }
  // the top-k on given scores: everything, or with --only topk_small the subset a sanitizer run takes
  if (only.empty() || only == "topk" || only == "topk_small") test_topk_rows(g_log, topk_seed, only == "topk_small");
  {
    std::vector<ScoreSideCase> side;
    side.push_back({"Hi=64 page64 decode b=4", 64, 64, {5000, 2100, 900, 62}, {1, 1, 1, 1}});
    side.push_back({"Hi=32 page16 MTP 4+3+16", 32, 16, {3000, 1000, 2000}, {4, 3, 16}});
    side.push_back({"Hi=64 page16 MTP 2+2", 64, 16, {4000, 700}, {2, 2}});
    side.push_back({"Hi=64 page128 prefill 300", 64, 128, {0}, {300}});
    side.push_back({"Hi=32 page64 decode ctx 200000", 32, 64, {200000}, {1}});
    // pages of several blocks (a block's first row inside its page), the segment producer at page 4 (16 pages a
    // block), and few CTAs: many items a CTA, so the producers' batches of 32 items and the rings wrap many times
    side.push_back({"Hi=64 page128 decode b=3", 64, 128, {9000, 3001, 500}, {1, 1, 1}});
    side.push_back({"Hi=32 page192 MTP 2+1", 32, 192, {7000, 2500}, {2, 1}});
    side.push_back({"Hi=32 page4 decode b=2", 32, 4, {5000, 1300}, {1, 1}});
    side.push_back({"Hi=64 page64 MTP 4+3 on 3 SMs", 64, 64, {40000, 30001}, {4, 3}, 3});
    side.push_back({"Hi=64 page64 decode b=2 ctx 100000 on 2 SMs", 64, 64, {100000, 77777}, {1, 1}, 2});
    side.push_back({"Hi=32 page16 decode ctx 60000 on 2 SMs", 32, 16, {60000}, {1}, 2});
    for (const ScoreSideCase& c : side) {
      if (selected("scores side by side " + c.name)) run_scores_side_by_side(c);
    }
  }
  // The serving options (slot top-k, base-2 LSE, a precomputed top-k) on one GPU and CP layouts on it.
  if (selected("serving options")) dsacp::testing::gpu_serving_checks(*gpu, *cpu, 271, g_log);
  if (selected("external stream")) dsacp::testing::gpu_external_stream_checks(*gpu, 272, g_log);
  if (selected("combined kv rows")) dsacp::testing::gpu_combined_kv_checks(*gpu, 273, g_log);
  if (selected("decode b=4 ctx 5000 page64 (plan in device memory)")) {
    CudaBackendOptions o;
    o.indexer_inline_plan = false;
    IdxCase device_plan = idx[0];
    device_plan.name = "decode b=4 ctx 5000 page64 (plan in device memory)";
    auto be = make_cuda_backend(0, o);
    if (be.ok()) {
      run_indexer_case(**be, *cpu, device_plan);
    } else {
      report(false, device_plan.name + ": backend", be.status().to_string());
    }
  }

  std::printf("\n%d checks, %d failures\n", g_log.checks(), g_log.failures());
  g_log.write_json(json != nullptr ? json : "");
  if (!only.empty() && g_log.checks() == 0) {
    std::printf("no sparse MLA or indexer case's name contains \"%s\"\n", only.c_str());
    return 2;
  }
  return g_log.failures() == 0 ? 0 : 1;
}
