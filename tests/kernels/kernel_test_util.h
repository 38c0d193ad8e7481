// Shared builders for the CPU kernel tests: a batch of requests with causal query tokens over paged keys.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "dsacp/backend.h"
#include "support/paged_fixture.h"

namespace dsacp::testing {

// One request: num_keys keys of context (its own new keys included) and num_queries query tokens, the last
// query seeing all keys and each earlier one one key fewer (causal).
struct RequestShape {
  int64_t num_keys;
  int32_t num_queries;
};

inline std::string requests_name(const std::vector<RequestShape>& rs) {
  std::string s = "req";
  for (const auto& r : rs) {  // appended piecewise: GCC 12 -Wrestrict false positive on "lit" + string&&
    s += '_';
    s += std::to_string(r.num_keys);
    s += 'x';
    s += std::to_string(r.num_queries);
  }
  return s;
}

// The token rows of a batch: request id and key_len per token; with `empty_row`, one more token of request 0
// with key_len 0 (a padding row) is appended.
struct TokenRows {
  std::vector<int32_t> request, key_len;
  int64_t size() const { return static_cast<int64_t>(request.size()); }
  QueryRowsView view() const { return {size(), request.data(), key_len.data()}; }
};

inline TokenRows make_token_rows(const std::vector<RequestShape>& rs, bool empty_row) {
  TokenRows rows;
  for (int32_t b = 0; b < static_cast<int32_t>(rs.size()); ++b) {
    for (int32_t i = 0; i < rs[b].num_queries; ++i) {
      rows.request.push_back(b);
      rows.key_len.push_back(static_cast<int32_t>(rs[b].num_keys - rs[b].num_queries + 1 + i));
    }
  }
  if (empty_row) {
    rows.request.push_back(0);
    rows.key_len.push_back(0);
  }
  return rows;
}

inline std::vector<int64_t> key_counts(const std::vector<RequestShape>& rs) {
  std::vector<int64_t> v;
  for (const auto& r : rs) v.push_back(r.num_keys);
  return v;
}

inline const char* dtype_label(DType t) { return t == DType::kBF16 ? "BF16" : "F32"; }

// Bitwise equality of float arrays (NaN patterns included).
inline bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// Parts [parts, per_part] of one array as one vector each (a window exchange's messages, each in its own buffer:
// the merges' part_*_of inputs).
template <typename T>
std::vector<std::vector<T>> split_parts(const std::vector<T>& flat, int64_t parts, int64_t per_part) {
  std::vector<std::vector<T>> out(static_cast<size_t>(parts));
  for (int64_t k = 0; k < parts; ++k) out[k].assign(flat.begin() + k * per_part, flat.begin() + (k + 1) * per_part);
  return out;
}

}  // namespace dsacp::testing
