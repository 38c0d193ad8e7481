// A batch step: requests in file order, each with new (query) tokens and tokens already in the cache.
#pragma once

#include <cstdint>
#include <vector>

#include "dsacp/status.h"

namespace dsacp {

struct Request {
  int32_t query_len = 0;    // new tokens this step (>= 1)
  int32_t context_len = 0;  // tokens already in the cache before this step (>= 0)
  int64_t seq_len() const { return int64_t{query_len} + context_len; }
};

// Most query tokens a decode request may have: 1 + MTP draft tokens (reference-design §2, asserted <= 16).
inline constexpr int32_t kMaxDecodeThreshold = 16;

// The batch's classification (reference-design §2): a request is a decode when it has context and at most
// `decode_threshold` new tokens; the first request that is not a decode starts the prefill section, and
// every request after it counts as a prefill (so decodes come first).
struct BatchLayout {
  std::vector<int64_t> query_start;  // [R + 1] exclusive prefix sum of query_len
  int64_t num_tokens = 0;            // T
  int32_t num_decodes = 0;
  int32_t num_prefills = 0;
  int64_t num_decode_tokens = 0;
  int64_t num_prefill_tokens = 0;
  int64_t max_seq_len = 0;
};

// Validates lengths (query_len >= 1, context_len >= 0, seq_len < 2^31, T < 2^31, 1 <= decode_threshold <= 16)
// and classifies. Errors name the request: "request 3: query_len must be >= 1, got 0".
Result<BatchLayout> batch_layout(const std::vector<Request>& requests, int32_t decode_threshold = kMaxDecodeThreshold);

}  // namespace dsacp
