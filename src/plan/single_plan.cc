// The single-device plan: slots of the new tokens, and each query token's request and visible key count.
#include <string>

#include "dsacp/step.h"

namespace dsacp {

Result<SingleDevicePlan> single_device_plan(const std::vector<Request>& requests, const BlockTable& table,
                                            int32_t page_size, int32_t decode_threshold) {
  SingleDevicePlan plan;
  DSACP_ASSIGN_OR_RETURN(plan.layout, batch_layout(requests, decode_threshold));
  if (table.num_requests != static_cast<int32_t>(requests.size())) {
    return invalid_argument("block table has " + std::to_string(table.num_requests) + " rows, the batch has " +
                            std::to_string(requests.size()) + " requests");
  }
  if (page_size < 1) return invalid_argument("page_size must be >= 1, got " + std::to_string(page_size));
  DSACP_ASSIGN_OR_RETURN(plan.slots, new_token_slots(requests, table, page_size));
  const size_t T = static_cast<size_t>(plan.layout.num_tokens);
  plan.token_request.reserve(T);
  plan.token_key_len.reserve(T);
  for (size_t b = 0; b < requests.size(); ++b) {
    for (int32_t i = 0; i < requests[b].query_len; ++i) {
      plan.token_request.push_back(static_cast<int32_t>(b));
      plan.token_key_len.push_back(requests[b].context_len + i + 1);
    }
  }
  return plan;
}

}  // namespace dsacp
