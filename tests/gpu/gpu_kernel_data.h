// The GPU kernel tests' shared data: device copies of host vectors, paged layouts over shuffled pages, bf16 pools
// with NaN in every unused row, random bf16 values (tests/support/random_values.h) and the comparator.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <vector>

#include "dsacp/backend.h"
#include "dsacp/dtype.h"
#include "support/compare.h"
#include "support/random_values.h"

namespace dsacp::testing {

inline constexpr uint16_t kBf16NaN = 0x7fc0;

struct Dev {  // device copy of a host vector
  DeviceBuffer buf;
  template <typename T>
  T* ptr() const { return buf.as<T>(); }
};

template <typename T>
inline Dev upload(Backend& be, const std::vector<T>& v) {
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
inline std::vector<T> download(Backend& be, const Dev& d, size_t n) {
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

inline Paging make_paging(const std::vector<int64_t>& lens, int32_t page_size, int64_t extra_pages, uint64_t seed,
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
  for (size_t i = ids.size(); i > 1; --i) std::swap(ids[i - 1], ids[splitmix64(seed + i) % i]);
  p.bt.assign(static_cast<size_t>(p.num_requests) * p.max_pages, -1);
  size_t next = 0;
  for (int32_t b = 0; b < p.num_requests; ++b) {
    for (int64_t c = 0; c < (lens[b] + page_size - 1) / page_size; ++c) p.bt[b * p.max_pages + c] = ids[next++];
  }
  return p;
}

// A bf16 pool [num_pages * page_size, dim]: NaN everywhere, random values in the requests' rows.
inline std::vector<uint16_t> make_pool(const Paging& pg, const std::vector<int64_t>& lens, int dim, uint64_t seed) {
  std::vector<uint16_t> pool(static_cast<size_t>(pg.num_pages * pg.page_size * dim), kBf16NaN);
  for (int32_t b = 0; b < pg.num_requests; ++b) {
    for (int64_t j = 0; j < lens[b]; ++j) {
      const int64_t r = pg.row_of(b, j);
      for (int d = 0; d < dim; ++d) {
        pool[r * dim + d] = f32_to_bf16(uniform_at(seed + b, static_cast<uint64_t>(j) * dim + d)).bits;
      }
    }
  }
  return pool;
}

inline std::vector<uint16_t> random_bf16(size_t n, uint64_t seed, float amp = 1.f) {
  std::vector<uint16_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = f32_to_bf16(amp * uniform_at(seed, i)).bits;
  return v;
}

// A batch's query rows: request b has qlen[b] new tokens after ctx[b] earlier keys, its token i seeing
// ctx[b] + i + 1 keys; lens[b] = ctx[b] + qlen[b] (the request's keys).
struct QueryRows {
  std::vector<int64_t> lens;
  std::vector<int32_t> request, key_len;  // a row each
};
inline QueryRows query_rows(const std::vector<int64_t>& ctx, const std::vector<int>& qlen) {
  QueryRows q;
  for (size_t b = 0; b < ctx.size(); ++b) {
    q.lens.push_back(ctx[b] + qlen[b]);
    for (int i = 0; i < qlen[b]; ++i) {
      q.request.push_back(static_cast<int32_t>(b));
      q.key_len.push_back(static_cast<int32_t>(ctx[b] + i + 1));
    }
  }
  return q;
}

// Sparse MLA top-k rows [T, K] over each row's key_len keys: distinct positions by a stride walk from a random
// start (a gcd-free stride); with `hostile`, every fifth row (t % 5 == 2) short (a third of its keys), the last row
// of several empty, and garbage every third entry after a row's first -1.
inline std::vector<int32_t> stride_walk_topk(const std::vector<int32_t>& key_len, int K, uint64_t seed, bool hostile) {
  const int64_t T = static_cast<int64_t>(key_len.size());
  std::vector<int32_t> topk(T * K, -1);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t len = key_len[t];
    int64_t n = std::min<int64_t>(K, len);
    if (hostile && t % 5 == 2) n = n / 3;
    if (hostile && t == T - 1 && T > 1) n = 0;
    int64_t stride = 1 + static_cast<int64_t>(splitmix64(seed + 400 + t) % 97);
    while (std::gcd(stride, len) != 1) ++stride;
    int64_t pos = static_cast<int64_t>(splitmix64(seed + 500 + t) % len);
    for (int64_t i = 0; i < n; ++i) {
      topk[t * K + i] = static_cast<int32_t>(pos);
      pos = (pos + stride) % len;
    }
    if (hostile) {
      for (int64_t i = n + 1; i < K; i += 3) topk[t * K + i] = static_cast<int32_t>(i % len);
    }
  }
  return topk;
}

// rel_error_finite with *nan_mismatch cleared first.
inline double rel_norm(const std::vector<float>& a, const std::vector<float>& ref, bool* nan_mismatch) {
  *nan_mismatch = false;
  return rel_error_finite(a, ref, nan_mismatch);
}

inline std::vector<float> to_f32(const std::vector<uint16_t>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = bf16_to_f32(bf16{v[i]});
  return f;
}

}  // namespace dsacp::testing
