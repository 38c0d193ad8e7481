#include "support/reference_math.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace dsacp::ref {

std::vector<double> index_scores(std::span<const float> q, std::span<const float> w, std::span<const float> keys,
                                 int32_t hi, int32_t di, int64_t num_keys) {
  std::vector<double> s(static_cast<size_t>(num_keys), 0.0);
  for (int64_t j = 0; j < num_keys; ++j) {
    double total = 0.0;
    for (int32_t h = 0; h < hi; ++h) {
      double dot = 0.0;
      for (int32_t d = 0; d < di; ++d) dot += double(q[h * di + d]) * double(keys[j * di + d]);
      total += double(w[h]) * std::max(dot, 0.0);
    }
    s[j] = total;
  }
  return s;
}

namespace {
// Strict "a ranks above b": larger score, NaN below everything, then the lower position.
bool ranks_above(std::span<const double> s, int32_t a, int32_t b) {
  const bool na = std::isnan(s[a]), nb = std::isnan(s[b]);
  if (na != nb) return nb;
  if (!na && s[a] != s[b]) return s[a] > s[b];
  return a < b;
}
}  // namespace

std::vector<int32_t> canonical_topk(std::span<const double> scores, int32_t k) {
  const int32_t n = static_cast<int32_t>(scores.size());
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return ranks_above(scores, a, b); });
  const int32_t m = std::min(n, k);
  std::vector<int32_t> row(order.begin(), order.begin() + m);
  std::sort(row.begin(), row.end());
  row.resize(static_cast<size_t>(k), -1);
  return row;
}

std::string check_topk_row(std::span<const int32_t> row, std::span<const double> scores, int32_t k, double tol) {
  const int32_t n = static_cast<int32_t>(scores.size());
  const int32_t m = std::min(n, k);
  if (static_cast<int32_t>(row.size()) != k) return "row has " + std::to_string(row.size()) + " entries, want K";
  std::vector<char> chosen(static_cast<size_t>(n), 0);
  for (int32_t i = 0; i < k; ++i) {
    if (i < m) {
      if (row[i] < 0 || row[i] >= n) return "entry " + std::to_string(i) + " = " + std::to_string(row[i]) + " invalid";
      if (i > 0 && row[i] <= row[i - 1]) return "entries not strictly ascending at " + std::to_string(i);
      chosen[row[i]] = 1;
    } else if (row[i] != -1) {
      return "entry " + std::to_string(i) + " should be -1 padding, got " + std::to_string(row[i]);
    }
  }
  double scale = 0.0, min_chosen = std::numeric_limits<double>::infinity(),
         max_unchosen = -std::numeric_limits<double>::infinity();
  for (int32_t j = 0; j < n; ++j) {
    if (std::isnan(scores[j])) continue;
    scale = std::max(scale, std::abs(scores[j]));
    if (chosen[j])
      min_chosen = std::min(min_chosen, scores[j]);
    else
      max_unchosen = std::max(max_unchosen, scores[j]);
  }
  if (max_unchosen > min_chosen + tol * std::max(scale, 1e-30)) {
    return "an unchosen score " + std::to_string(max_unchosen) + " beats a chosen one " + std::to_string(min_chosen);
  }
  return "";
}

AttentionResult attention(std::span<const float> q_nope, std::span<const float> q_rope, std::span<const float> latent,
                          std::span<const float> rope, std::span<const int32_t> chosen, double scale, int32_t dl,
                          int32_t dr) {
  AttentionResult r;
  r.out.assign(static_cast<size_t>(dl), 0.0);
  std::vector<double> logits;
  std::vector<int32_t> keys;
  for (int32_t j : chosen) {
    if (j < 0) break;
    double dot = 0.0;
    for (int32_t d = 0; d < dl; ++d) dot += double(q_nope[d]) * double(latent[int64_t(j) * dl + d]);
    for (int32_t d = 0; d < dr; ++d) dot += double(q_rope[d]) * double(rope[int64_t(j) * dr + d]);
    logits.push_back(scale * dot);
    keys.push_back(j);
  }
  if (keys.empty()) {
    r.lse = -std::numeric_limits<double>::infinity();
    return r;
  }
  const double mx = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (double l : logits) sum += std::exp(l - mx);
  for (size_t e = 0; e < keys.size(); ++e) {
    const double pe = std::exp(logits[e] - mx) / sum;
    for (int32_t d = 0; d < dl; ++d) r.out[d] += pe * double(latent[int64_t(keys[e]) * dl + d]);
  }
  r.lse = mx + std::log(sum);
  return r;
}

double rel_norm_error(std::span<const float> got, std::span<const double> want) {
  if (got.size() != want.size()) return std::numeric_limits<double>::infinity();
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i]) || std::isnan(want[i])) return std::numeric_limits<double>::infinity();
    num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    den += want[i] * want[i];
  }
  if (den == 0.0) return num == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(num / den);
}

double e4m3_value(int code) {
  const int s = (code >> 7) & 1, e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return s ? -mag : mag;
}

uint8_t brute_e4m3(float x) {
  const bool neg = std::signbit(x);
  if (std::isnan(x)) return static_cast<uint8_t>((neg ? 0x80 : 0) | 0x7f);
  const double a = std::fabs(static_cast<double>(x));
  if (a >= 448.0) return static_cast<uint8_t>((neg ? 0x80 : 0) | 0x7e);
  int best = 0;
  double best_d = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= 0x7e; ++c) {
    const double d = std::fabs(e4m3_value(c) - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return static_cast<uint8_t>((neg ? 0x80 : 0) | best);
}

}  // namespace dsacp::ref
