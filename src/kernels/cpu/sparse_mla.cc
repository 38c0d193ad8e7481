// Sparse MLA attention on the CPU: each token attends over its chosen key rows with all its heads.
//
// Each token's chosen latent and rope rows are gathered (and converted to f32) once per work item and reused
// by every head of the item. Logit dots use a fixed summation order (kLanes lanes over d mod kLanes, folded in
// halves, then the tail; see dot_block), so a (token, head, key) logit never depends on blocking or threads.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/parallel.h"
#include "kernels/cpu/cpu_kernels.h"

namespace dsacp::cpu {
namespace {

constexpr int kHeadBlock = 4;  // heads sharing each loaded latent row in the weighted sum
// Register blocking of the logit dots (heads x key rows). Measured with GCC 12 -O3 (SSE2 only): 1 x 1 runs
// ~1.8x faster than 4 x 2, 2 x 2 or 1 x 4, whose multi-dimensional lane arrays GCC vectorizes poorly.
constexpr int kLogitHeadBlock = 1;
constexpr int kEntryBlock = 1;
constexpr int kLanes = 16;  // independent partial sums per dot (a power of two)

// dots[m][e] = q[m, :] . x[e, :] for HB query rows (stride qs) and EB key rows (stride xs), fixed order:
// lane i sums d = i, i + kLanes, ... ascending; the lanes are folded in halves (lane i += lane i + w for
// w = kLanes/2, ..., 1); then the tail d >= n rounded down to kLanes is added in order.
template <int HB, int EB>
inline void dot_block(const float* q, int64_t qs, const float* x, int64_t xs, int64_t n, float dots[HB][EB]) {
  float acc[HB][EB][kLanes] = {};
  const int64_t nl = n / kLanes * kLanes;
  for (int64_t d = 0; d < nl; d += kLanes) {
    for (int m = 0; m < HB; ++m) {
      for (int e = 0; e < EB; ++e) {
        for (int i = 0; i < kLanes; ++i) acc[m][e][i] += q[m * qs + d + i] * x[e * xs + d + i];
      }
    }
  }
  for (int m = 0; m < HB; ++m) {
    for (int e = 0; e < EB; ++e) {
      float* a = acc[m][e];
      for (int w = kLanes / 2; w >= 1; w /= 2) {
        for (int i = 0; i < w; ++i) a[i] += a[i + w];
      }
      float s = a[0];
      for (int64_t d = nl; d < n; ++d) s += q[m * qs + d] * x[e * xs + d];
      dots[m][e] = s;
    }
  }
}

// logits[m * n + e] = scale * (qn[m] . lat[e] + qr[m] . rope[e]) for HB heads over all n entries.
template <int HB>
void logits_heads(const float* qn, const float* qr, const float* lat, const float* rope, int64_t n, int64_t dl,
                  int64_t dr, float scale, float* logits) {
  float dn[HB][kEntryBlock], dp[HB][kEntryBlock];
  int64_t e = 0;
  for (; e + kEntryBlock <= n; e += kEntryBlock) {
    dot_block<HB, kEntryBlock>(qn, dl, lat + e * dl, dl, dl, dn);
    dot_block<HB, kEntryBlock>(qr, dr, rope + e * dr, dr, dr, dp);
    for (int m = 0; m < HB; ++m) {
      for (int b = 0; b < kEntryBlock; ++b) logits[m * n + e + b] = scale * (dn[m][b] + dp[m][b]);
    }
  }
  for (; e < n; ++e) {
    float dn1[HB][1], dp1[HB][1];
    dot_block<HB, 1>(qn, dl, lat + e * dl, dl, dl, dn1);
    dot_block<HB, 1>(qr, dr, rope + e * dr, dr, dr, dp1);
    for (int m = 0; m < HB; ++m) logits[m * n + e] = scale * (dn1[m][0] + dp1[m][0]);
  }
}

// Key position j of request b as f32: a row of a plain pool, or the part of an fp8_ds_mla record (the latent
// dequantized as scale * value in f32, each tile of 128 values with its own scale; the rope bf16 as stored).
void load_key(const PagedPoolView& v, const BlockTableView& bt, int32_t b, int64_t j, float* dst) {
  if (!v.records()) {
    load_row_f32(v.data, v.dtype, pool_row_offset(v, key_row_offset(bt, b, j, v.page_size, 1)), v.dim, dst);
    return;
  }
  const int64_t slot = key_row_offset(bt, b, j, v.page_size, 1);
  const uint8_t* src = static_cast<const uint8_t*>(v.data) + record_part_offset(v, slot);
  if (v.dtype == DType::kBF16) {
    for (int32_t d = 0; d < v.dim; ++d) {
      const uint32_t u = static_cast<uint32_t>(src[2 * d] | (src[2 * d + 1] << 8)) << 16;
      std::memcpy(dst + d, &u, 4);
    }
    return;
  }
  for (int32_t g = 0; g < v.dim / kFp8DsMlaTile; ++g) {
    float scale;
    std::memcpy(&scale, src + fp8_ds_mla_scale_offset(v.dim) + 4 * g, 4);
    for (int32_t i = g * kFp8DsMlaTile; i < (g + 1) * kFp8DsMlaTile; ++i) dst[i] = fp8_dequantize(src[i], scale);
  }
}

struct Scratch {
  std::vector<float> lat, rope, qn, qr, logits, acc;
};

// One token t, heads [h0, h1), over its first n chosen entries (already checked).
void attend(const SparseMlaParams& p, int64_t t, int32_t h0, int32_t h1, int32_t n, Scratch& s) {
  const int64_t dl = p.Dl, dr = p.Dr;
  const int32_t nh = h1 - h0;
  const int32_t b = p.rows.request[t];
  if (n == 0) {
    for (int32_t h = h0; h < h1; ++h) {
      const int64_t r = mla_head_row(p, t, h);
      for (int64_t d = 0; d < dl; ++d) store_from_f32(p.out, p.out_dtype, r * dl + d, 0.f);
      p.lse[r] = -std::numeric_limits<float>::infinity();
    }
    return;
  }
  s.lat.resize(static_cast<size_t>(n * dl));
  s.rope.resize(static_cast<size_t>(n * dr));
  const int32_t* row = p.topk + t * p.K;
  for (int32_t e = 0; e < n; ++e) {
    load_key(p.latent, p.block_table, b, row[e], s.lat.data() + e * dl);
    load_key(p.rope, p.block_table, b, row[e], s.rope.data() + e * dr);
  }
  s.qn.resize(static_cast<size_t>(nh * dl));
  s.qr.resize(static_cast<size_t>(nh * dr));
  for (int32_t m = 0; m < nh; ++m) {
    const int64_t r = mla_head_row(p, t, h0 + m);
    load_row_f32(p.q_nope, p.q_dtype, r * dl, dl, s.qn.data() + m * dl);
    load_row_f32(p.q_rope, p.q_dtype, r * dr, dr, s.qr.data() + m * dr);
  }
  s.logits.resize(static_cast<size_t>(nh) * n);
  s.acc.resize(static_cast<size_t>(kHeadBlock * dl));

  int32_t m0 = 0;
  for (; m0 + kLogitHeadBlock <= nh; m0 += kLogitHeadBlock) {
    logits_heads<kLogitHeadBlock>(s.qn.data() + m0 * dl, s.qr.data() + m0 * dr, s.lat.data(), s.rope.data(), n, dl, dr,
                                  p.scale, s.logits.data() + static_cast<int64_t>(m0) * n);
  }
  for (; m0 < nh; ++m0) {
    logits_heads<1>(s.qn.data() + m0 * dl, s.qr.data() + m0 * dr, s.lat.data(), s.rope.data(), n, dl, dr, p.scale,
                    s.logits.data() + static_cast<int64_t>(m0) * n);
  }

  // Softmax and weighted sum, kHeadBlock heads at a time so each latent row is read once per block.
  for (int32_t mb = 0; mb < nh; mb += kHeadBlock) {
    const int32_t hb = std::min(kHeadBlock, nh - mb);
    double sum[kHeadBlock];
    float maxl[kHeadBlock];
    for (int32_t m = 0; m < hb; ++m) {
      float* l = s.logits.data() + static_cast<int64_t>(mb + m) * n;
      float mx = -std::numeric_limits<float>::infinity();
      for (int32_t e = 0; e < n; ++e) mx = std::max(mx, l[e]);
      double sm = 0.0;
      for (int32_t e = 0; e < n; ++e) {
        l[e] = std::exp(l[e] - mx);  // logits become unnormalized probabilities
        sm += l[e];
      }
      sum[m] = sm;
      maxl[m] = mx;
      std::fill_n(s.acc.data() + m * dl, dl, 0.f);
    }
    for (int32_t e = 0; e < n; ++e) {
      const float* x = s.lat.data() + e * dl;
      for (int32_t m = 0; m < hb; ++m) {
        const float pe = s.logits[static_cast<int64_t>(mb + m) * n + e];
        float* a = s.acc.data() + m * dl;
        for (int64_t d = 0; d < dl; ++d) a[d] += pe * x[d];
      }
    }
    for (int32_t m = 0; m < hb; ++m) {
      const int32_t h = h0 + mb + m;
      const float inv = static_cast<float>(1.0 / sum[m]);
      const float* a = s.acc.data() + m * dl;
      const int64_t r = mla_head_row(p, t, h);
      for (int64_t d = 0; d < dl; ++d) store_from_f32(p.out, p.out_dtype, r * dl + d, a[d] * inv);
      p.lse[r] = static_cast<float>(static_cast<double>(maxl[m]) + std::log(sum[m]));
    }
  }
}

}  // namespace

Status sparse_mla(const SparseMlaParams& p, int num_threads) {
  const QueryRowsView& rows = p.rows;
  const BlockTableView& bt = p.block_table;
  const int32_t ps = p.latent.page_size;
  // Count each token's used entries (front-packed: stop at the first e outside [0, key_len)) and check that
  // every used entry's page is addressable. Pages no entry uses are never read, so they are not checked.
  std::vector<int32_t> used(static_cast<size_t>(rows.num_tokens));
  for (int64_t t = 0; t < rows.num_tokens; ++t) {
    const int32_t b = rows.request[t];
    const int32_t len = rows.key_len[t];
    const std::string where = "sparse_mla: token " + std::to_string(t) + ": ";
    if (b < 0 || b >= bt.num_requests) {
      return out_of_range(where + "rows.request=" + std::to_string(b) + " outside the block table's [0, " +
                          std::to_string(bt.num_requests) + ")");
    }
    if (len < 0) return out_of_range(where + "rows.key_len must be >= 0, got " + std::to_string(len));
    const int32_t* row = p.topk + t * p.K;
    int32_t n = 0;
    for (; n < p.K && row[n] >= 0 && row[n] < len; ++n) {
      const int32_t c = row[n] / ps;
      const int32_t page = c < bt.max_pages ? bt.data[static_cast<int64_t>(b) * bt.max_pages + c] : -1;
      if (c >= bt.max_pages || page < 0 || page >= p.latent.num_pages) {
        std::string msg = where + "topk entry " + std::to_string(row[n]) + " needs block_table[";
        msg += std::to_string(b) + ", " + std::to_string(c) + "]";
        if (c >= bt.max_pages) {
          msg += " past max_pages=";
          msg += std::to_string(bt.max_pages);
        } else {
          msg += "=";  // appended piecewise: GCC 12 warns (-Wrestrict, PR105329) on "lit" + string&&
          msg += std::to_string(page);
          msg += " outside [0, num_pages=";
          msg += std::to_string(p.latent.num_pages);
          msg += ")";
        }
        return out_of_range(msg);
      }
    }
    used[t] = n;
  }

  // Work items: (token, head group). Few tokens (decode) are split over head groups so threads stay busy;
  // many tokens keep all heads together so each token's rows are gathered once.
  const int threads = num_threads > 0 ? num_threads : default_num_threads();
  int32_t head_groups = 1;
  if (rows.num_tokens < 4 * threads) {
    const int64_t want = (4 * threads + rows.num_tokens - 1) / rows.num_tokens;
    head_groups = static_cast<int32_t>(std::min<int64_t>(want, (p.H + kHeadBlock - 1) / kHeadBlock));
  }
  int32_t per_group = (p.H + head_groups - 1) / head_groups;
  per_group = std::min(p.H, (per_group + kHeadBlock - 1) / kHeadBlock * kHeadBlock);
  head_groups = (p.H + per_group - 1) / per_group;

  parallel_for(rows.num_tokens * head_groups, threads, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t it = begin; it < end; ++it) {
      const int64_t t = it / head_groups;
      const int32_t h0 = static_cast<int32_t>(it % head_groups) * per_group;
      attend(p, t, h0, std::min(p.H, h0 + per_group), used[t], scratch);
    }
  });
  return Status::ok_status();
}

}  // namespace dsacp::cpu
