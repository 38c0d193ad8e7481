#include "dsacp/batch.h"

#include <limits>
#include <string>

namespace dsacp {

Result<BatchLayout> batch_layout(const std::vector<Request>& requests, int32_t decode_threshold) {
  if (decode_threshold < 1 || decode_threshold > kMaxDecodeThreshold) {
    return invalid_argument("decode_threshold must be in [1, " + std::to_string(kMaxDecodeThreshold) + "], got " +
                            std::to_string(decode_threshold));
  }
  if (requests.empty()) return invalid_argument("batch has no requests");
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  BatchLayout layout;
  layout.query_start.reserve(requests.size() + 1);
  layout.query_start.push_back(0);
  bool in_prefills = false;
  for (size_t b = 0; b < requests.size(); ++b) {
    const Request& r = requests[b];
    const std::string who = "request " + std::to_string(b);
    if (r.query_len < 1) return invalid_argument(who + ": query_len must be >= 1, got " + std::to_string(r.query_len));
    if (r.context_len < 0) {
      return invalid_argument(who + ": context_len must be >= 0, got " + std::to_string(r.context_len));
    }
    if (r.seq_len() > kMax) {
      return out_of_range(who + ": context_len + query_len = " + std::to_string(r.seq_len()) +
                          " exceeds the largest key position (2^31 - 1)");
    }
    layout.num_tokens += r.query_len;
    if (layout.num_tokens > kMax) {
      return out_of_range("batch has more than 2^31 - 1 query tokens");
    }
    layout.query_start.push_back(layout.num_tokens);
    layout.max_seq_len = std::max(layout.max_seq_len, r.seq_len());
    const bool is_decode = r.context_len > 0 && r.query_len <= decode_threshold;
    in_prefills = in_prefills || !is_decode;
    if (in_prefills) {
      ++layout.num_prefills;
      layout.num_prefill_tokens += r.query_len;
    } else {
      ++layout.num_decodes;
      layout.num_decode_tokens += r.query_len;
    }
  }
  return layout;
}

}  // namespace dsacp
