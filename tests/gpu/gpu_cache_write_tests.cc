// GPU cache write against the CPU oracle: bf16 / f32 rows into bf16 pools (page 61, -1 slots, three pools in one
// launch, a bad slot), the write's upload of the step's small vectors, and already-quantized fp8 indexer rows.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "dsacp/backend.h"
#include "dsacp/dtype.h"
#include "dsacp/fp8.h"
#include "gpu/gpu_kernel_data.h"
#include "gpu/gpu_test.h"

namespace dsacp::testing {
namespace {

void test_cache_write(Backend& gpu, Backend& cpu) {
  for (DType src : {DType::kBF16, DType::kF32}) {
    const int dim = 576 - 64;  // latent
    const int64_t T = 37;
    Paging pg = make_paging({200}, 61, 3, 11);
    std::vector<int64_t> slots(T);
    for (int64_t t = 0; t < T; ++t) slots[t] = (t % 7 == 3) ? -1 : pg.row_of(0, 150 - 4 * t > 0 ? 150 - 4 * t : t);
    std::vector<uint16_t> rows_b = random_bf16(T * dim, 5);
    std::vector<float> rows_f(T * dim);
    for (size_t i = 0; i < rows_f.size(); ++i) rows_f[i] = uniform_at(6, i) * 3.f;
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
        for (size_t j = 0; j < r3[i].size(); ++j) r3[i][j] = uniform_at(40 + i, j) * 2.f;
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
  for (size_t i = 0; i < extra.size(); ++i) extra[i] = static_cast<int32_t>(splitmix64(70 + i));
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
      for (size_t j = 0; j < rows[i].size(); ++j) rows[i][j] = uniform_at(80 + i, j) * 4.f;
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

// Already-quantized rows (e4m3 + row_scales) are stored as they are.
void test_cache_write_fp8_rows(Backend& gpu) {
  const int Di = 128, ps = 61, pages = 3, T = 50;
  std::vector<uint8_t> rows(T * Di);
  std::vector<float> sc(T);
  std::vector<int64_t> slots(T);
  for (int t = 0; t < T; ++t) {
    for (int d = 0; d < Di; ++d) rows[t * Di + d] = static_cast<uint8_t>(splitmix64(31 + t * Di + d));
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

}  // namespace

class CacheWrite : public GpuTest {};

TEST_F(CacheWrite, Bf16Pools) { test_cache_write(gpu(), cpu()); }
TEST_F(CacheWrite, Upload) { test_cache_write_upload(gpu(), cpu()); }
TEST_F(CacheWrite, Fp8Rows) { test_cache_write_fp8_rows(gpu()); }

}  // namespace dsacp::testing
