// GPU merges against the CPU oracle: the LSE merge of attention partials (f32 and bf16 parts, -inf / NaN parts,
// an empty row, parts in separate buffers), and the CP step's kernels: gather_rows, topk_remap and topk_merge.
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

void test_lse_merge(Backend& gpu, Backend& cpu) {
  const int S = 3, Dl = 512;
  const int64_t rows = 77;
  std::vector<float> part_out(S * rows * Dl), part_lse(S * rows);
  for (size_t i = 0; i < part_out.size(); ++i) part_out[i] = uniform_at(21, i);
  for (int64_t i = 0; i < S * rows; ++i) {
    const int k = static_cast<int>(splitmix64(22 + i) % 8);
    part_lse[i] = k == 0 ? -std::numeric_limits<float>::infinity() : k == 1 ? NAN : 5.f * uniform_at(23, i);
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

void test_cp_kernels(Backend& gpu, Backend& cpu) {
  // gather_rows: bf16 -> f32 and bf16 -> bf16, -1 rows are NaN
  const int dim = 576;
  const int64_t src_rows = 300, n = 257;
  std::vector<uint16_t> src = random_bf16(src_rows * dim, 900);
  std::vector<int64_t> index(n);
  for (int64_t i = 0; i < n; ++i) index[i] = (i % 9 == 4) ? -1 : static_cast<int64_t>(splitmix64(901 + i) % src_rows);
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
    const int m = static_cast<int>(splitmix64(950 + r) % (K + 1));
    for (int i = 0; i < m; ++i) topk[r * K + i] = static_cast<int32_t>(splitmix64(951 + r * K + i) % 5000);
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
        const int m = static_cast<int>(splitmix64(seed + s * mrows + r) % (Km + 1));
        for (int i = 0; i < m; ++i) {
          part_topk[base + i] = i * 2 + static_cast<int>(splitmix64(seed + 7 * i) % 2);  // ascending local positions
          const uint64_t h = splitmix64(seed * 3 + base + i);
          part_scores[base + i] = equal         ? 0.75f
                                  : narrow      ? 1.5f + 0.001f * uniform_at(seed, base + i)
                                  : h % 97 == 0 ? NAN
                                  : h % 89 == 0 ? -INFINITY
                                                : std::round(8.f * uniform_at(seed, base + i));
        }
        for (int i = m - 1; shuffled && i > 0; --i) {  // not the canonical ascending order
          const size_t j = base + splitmix64(seed + 31 * i) % (i + 1);
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

}  // namespace

class Merge : public GpuTest {};

TEST_F(Merge, LseMerge) { test_lse_merge(gpu(), cpu()); }
TEST_F(Merge, CpKernels) { test_cp_kernels(gpu(), cpu()); }

}  // namespace dsacp::testing
