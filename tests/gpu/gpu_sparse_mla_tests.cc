// GPU sparse MLA over bf16 pools against the CPU oracle: decode, MTP and prefill; every head count 1..128 (in the
// next head group up, its missing rows masked) and the DCP head-block layouts; page sizes 1 / 61 / 64 over shuffled
// pages with NaN in every unused slot; hostile rows (-1 holes then garbage, all-invalid rows); split-K through the
// cluster merge and the merge kernel; the softmax scale's sign and size; element offsets past 2^31; every kernel
// for 64-head groups; reruns bit-identical; bad page ids and request rows reported. One test per case
// (SparseMla.Case/<case name>); --quick shortens the prefill cases and drops the 2^31 one.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <ostream>
#include <string>
#include <vector>

#include "dsacp/backend.h"
#include "dsacp/dtype.h"
#include "dsacp/fp8.h"
#include "gpu/gpu_kernel_data.h"
#include "gpu/gpu_test.h"

namespace dsacp::testing {
namespace {

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
  auto [lens, request, key_len] = query_rows(c.ctx, c.qlen);
  const int64_t T = static_cast<int64_t>(request.size());
  Paging pg = make_paging(lens, c.page_size, c.extra_pages, 31 + c.H, c.first_page);
  std::vector<uint16_t> latent = make_pool(pg, lens, Dl, 100);
  std::vector<uint16_t> rope = make_pool(pg, lens, Dr, 200);
  std::vector<uint16_t> qn = random_bf16(T * c.H * Dl, 300), qr = random_bf16(T * c.H * Dr, 301);
  // hostile rows: short (-1, then garbage), all-invalid
  std::vector<int32_t> topk = stride_walk_topk(key_len, c.K, 0, c.hostile_rows);
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

std::vector<MlaCase> sparse_mla_cases() {
  std::vector<MlaCase> mla;
  mla.push_back({"decode H=16 page64 K=2048 split-K", 16, 2048, 64, {3000, 2100, 900}, {1, 1, 1}});
  mla.push_back({"decode H=32 page61 K=2048 MTP", 32, 2048, 61, {5000, 2500}, {3, 2}});
  mla.push_back({"decode H=64 page1 K=512", 64, 512, 1, {1500, 700, 40}, {1, 2, 1}});
  mla.push_back({"decode H=128 page64 K=2048 bf16 out", 128, 2048, 64, {4096, 3000}, {2, 1}, DType::kBF16});
  mla.push_back({"prefill H=128 page64 K=2048", 128, 2048, 64, {0}, {gpu_test_options().quick ? 300 : 700}});
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
      mla.push_back({"prefill " + hs + " K=300 chunked", h.H, 300, h.page, {400, 0}, {gpu_test_options().quick ? 40 : 130, 70}});
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
  if (!gpu_test_options().quick) {
    // element offsets past 2^31: pages from 4.2M rows up (latent row offset * 512 > 2^31)
    MlaCase big{"decode H=64 offsets past 2^31", 64, 2048, 64, {5000, 3000}, {1, 1}};
    big.first_page = (int64_t{1} << 31) / 512 / 64 + 10;
    big.extra_pages = 2;
    mla.push_back(big);
  }
  return mla;
}

void PrintTo(const MlaCase& c, std::ostream* os) { *os << c.name; }

// The case on the default kernel and, for 64-head groups, on every kernel forced.
void run_mla_case_on_kernels(Backend& cpu, const MlaCase& c) {
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
    run_mla_case(**be, cpu, m);
  }
}

class SparseMla : public GpuTest, public ::testing::WithParamInterface<MlaCase> {};

TEST_P(SparseMla, Case) { run_mla_case_on_kernels(cpu(), GetParam()); }

INSTANTIATE_TEST_SUITE_P(, SparseMla, ::testing::ValuesIn(sparse_mla_cases()),
                         [](const ::testing::TestParamInfo<MlaCase>& i) { return param_name(i.param.name); });

}  // namespace
}  // namespace dsacp::testing
