#include "verify.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "dsacp/fp8.h"

namespace dsacp::cli {

TokenCheck verify_token(const WorkloadValues& v, int32_t request, int64_t pos, float scale, const int32_t* topk_row,
                        const float* out, const float* lse, const CheckTolerance& tol, bool fp8_latent) {
  using W = WorkloadValues;
  const WorkloadDims& d = v.dims();
  TokenCheck c;
  const int64_t S = pos + 1;

  // Index scores over every visible key, in fp64.
  std::vector<double> q(static_cast<size_t>(d.Hi) * d.Di), w(d.Hi), k(d.Di), score(S);
  for (int64_t i = 0; i < int64_t{d.Hi} * d.Di; ++i) q[i] = v.value(W::kIndexQ, request, pos, i);
  for (int32_t h = 0; h < d.Hi; ++h) w[h] = v.value(W::kIndexW, request, pos, h);
  double max_abs = 0;
  for (int64_t j = 0; j < S; ++j) {
    for (int32_t i = 0; i < d.Di; ++i) k[i] = v.value(W::kIndexKey, request, j, i);
    double s = 0;
    for (int32_t h = 0; h < d.Hi; ++h) {
      double dot = 0;
      for (int32_t i = 0; i < d.Di; ++i) dot += q[static_cast<size_t>(h) * d.Di + i] * k[i];
      s += w[h] * std::max(dot, 0.0);
    }
    score[j] = s;
    max_abs = std::max(max_abs, std::fabs(s));
  }
  // Canonical top-k: largest scores, ties to the lower position, ascending.
  const int64_t n = std::min<int64_t>(d.K, S);
  std::vector<int64_t> order(S);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + n, order.end(), [&](int64_t a, int64_t b) {
    return score[a] != score[b] ? score[a] > score[b] : a < b;
  });
  std::vector<int64_t> ref(order.begin(), order.begin() + n);
  std::sort(ref.begin(), ref.end());

  // The kernel's row: front-packed ascending valid positions, then -1.
  std::vector<int64_t> got;
  for (int32_t i = 0; i < d.K; ++i) {
    const int32_t e = topk_row[i];
    if (e < 0) {
      for (int32_t r = i; r < d.K; ++r) {
        if (topk_row[r] != -1) {
          c.problem = "top-k row is not front-packed (entry " + std::to_string(r) + " = " + std::to_string(topk_row[r]) +
                      " after a -1)";
          return c;
        }
      }
      break;
    }
    if (e >= S || (!got.empty() && e <= got.back())) {
      c.problem = "top-k row entry " + std::to_string(i) + " = " + std::to_string(e) + " is out of range or not ascending";
      return c;
    }
    got.push_back(e);
  }
  if (static_cast<int64_t>(got.size()) != n) {
    c.problem = "top-k row holds " + std::to_string(got.size()) + " keys, expected " + std::to_string(n);
    return c;
  }
  c.topk_exact = got == ref;
  if (!c.topk_exact) {
    // Allowed only where fp32 and fp64 disagree on near-ties at the K-th score.
    const double kth = score[order[n - 1]];
    const double window = tol.score_tie_rel * std::max(1.0, max_abs);
    std::vector<int64_t> diff;
    std::set_symmetric_difference(got.begin(), got.end(), ref.begin(), ref.end(), std::back_inserter(diff));
    for (int64_t j : diff) {
      if (std::fabs(score[j] - kth) > window) {
        c.problem = "top-k differs from fp64 at key " + std::to_string(j) + " (score " + std::to_string(score[j]) +
                    ", K-th score " + std::to_string(kth) + ")";
        return c;
      }
    }
    c.near_tie_swaps = static_cast<int64_t>(diff.size() / 2);
  }

  // Attention over the kernel's chosen keys, in fp64.
  const size_t nk = got.size();
  std::vector<double> lat(nk * d.Dl), rope(nk * d.Dr);
  for (size_t e = 0; e < nk; ++e) {
    for (int32_t i = 0; i < d.Dl; ++i) lat[e * d.Dl + i] = v.value(W::kLatent, request, got[e], i);
    for (int32_t i = 0; i < d.Dr; ++i) rope[e * d.Dr + i] = v.value(W::kRope, request, got[e], i);
    if (!fp8_latent) continue;
    for (int32_t g = 0; g + kFp8DsMlaTile <= d.Dl; g += kFp8DsMlaTile) {
      float amax = 0.f;
      for (int32_t i = g; i < g + kFp8DsMlaTile; ++i) {
        amax = std::max(amax, fp8_amax_term(static_cast<float>(lat[e * d.Dl + i])));
      }
      const float s = fp8_scale_from_amax(amax, Fp8ScaleMode::kFp32);
      for (int32_t i = g; i < g + kFp8DsMlaTile; ++i) {
        lat[e * d.Dl + i] = fp8_dequantize(fp8_quantize(static_cast<float>(lat[e * d.Dl + i]), s), s);
      }
    }
    for (int32_t i = 0; i < d.Dr; ++i) rope[e * d.Dr + i] = round_to_bf16(static_cast<float>(rope[e * d.Dr + i]));
  }
  std::vector<double> qn(static_cast<size_t>(d.H) * d.Dl), qr(static_cast<size_t>(d.H) * d.Dr);
  for (size_t i = 0; i < qn.size(); ++i) qn[i] = v.value(W::kQNope, request, pos, static_cast<int64_t>(i));
  for (size_t i = 0; i < qr.size(); ++i) qr[i] = v.value(W::kQRope, request, pos, static_cast<int64_t>(i));
  double err2 = 0, ref2 = 0;
  std::vector<double> logit(nk), acc(d.Dl);
  for (int32_t h = 0; h < d.H; ++h) {
    const int64_t qbase_n = int64_t{h} * d.Dl, qbase_r = int64_t{h} * d.Dr;
    double m = -std::numeric_limits<double>::infinity();
    for (size_t e = 0; e < nk; ++e) {
      double s = 0;
      for (int32_t i = 0; i < d.Dl; ++i) s += qn[qbase_n + i] * lat[e * d.Dl + i];
      for (int32_t i = 0; i < d.Dr; ++i) s += qr[qbase_r + i] * rope[e * d.Dr + i];
      logit[e] = s * scale;
      m = std::max(m, logit[e]);
    }
    double z = 0;
    std::fill(acc.begin(), acc.end(), 0.0);
    for (size_t e = 0; e < nk; ++e) {
      const double p = std::exp(logit[e] - m);
      z += p;
      for (int32_t i = 0; i < d.Dl; ++i) acc[i] += p * lat[e * d.Dl + i];
    }
    const double ref_lse = nk == 0 ? -std::numeric_limits<double>::infinity() : m + std::log(z);
    for (int32_t i = 0; i < d.Dl; ++i) {
      const double r = nk == 0 ? 0.0 : acc[i] / z;
      const double diff = out[qbase_n + i] - r;
      err2 += diff * diff;
      ref2 += r * r;
    }
    const double lerr = nk == 0 ? (std::isinf(lse[h]) && lse[h] < 0 ? 0.0 : 1.0) : std::fabs(lse[h] - ref_lse);
    c.lse_abs_err = std::max(c.lse_abs_err, std::isnan(lerr) ? 1e30 : lerr);
  }
  c.out_rel_err = ref2 > 0 ? std::sqrt(err2 / ref2) : std::sqrt(err2);
  if (std::isnan(c.out_rel_err)) c.out_rel_err = 1e30;
  if (c.out_rel_err > tol.out_rel) {
    c.problem = "out relative error " + std::to_string(c.out_rel_err) + " above " + std::to_string(tol.out_rel);
  } else if (c.lse_abs_err > tol.lse_abs) {
    c.problem = "lse error " + std::to_string(c.lse_abs_err) + " above " + std::to_string(tol.lse_abs);
  } else {
    c.ok = true;
  }
  return c;
}

}  // namespace dsacp::cli
