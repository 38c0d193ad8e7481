// The PCP planner (reference-design §3), a pure function of (batch, options, rank).
#include <algorithm>
#include <numeric>
#include <string>

#include "dsacp/cp_plan.h"

namespace dsacp {

std::vector<int64_t> pcp_prefill_offsets(int64_t Q, int32_t P, int32_t r) {
  const int64_t two_p = 2 * int64_t{P};
  const int64_t q_pad = (Q + two_p - 1) / two_p * two_p;
  const int64_t c = q_pad / two_p;
  std::vector<int64_t> offsets;
  offsets.reserve(static_cast<size_t>(2 * c));
  for (int64_t i = 0; i < c; ++i) offsets.push_back(int64_t{r} * c + i);                 // head: chunk r
  for (int64_t i = 0; i < c; ++i) offsets.push_back((two_p - 1 - r) * c + i);           // tail: chunk 2P-1-r
  return offsets;
}

void pcp_compact_decode_slots(std::vector<int64_t>& slots, const std::vector<int32_t>& decode_query_lens, int32_t P) {
  int64_t total = 0;
  for (int32_t q : decode_query_lens) total += q;
  if (total == 0) return;
  std::vector<int64_t> out(static_cast<size_t>(total * P), -1);
  int64_t start = 0;
  for (int32_t q : decode_query_lens) {
    for (int64_t j = 0; j < q; ++j) out[start + j] = slots[start + j * P];
    start += int64_t{q} * P;
  }
  std::copy(out.begin(), out.end(), slots.begin());
}

std::vector<int64_t> PcpRankPlan::gathered_row_slots() const {
  std::vector<int64_t> s(all_positions.size());
  for (size_t j = 0; j < s.size(); ++j) s[j] = padded_slots[all_positions[j]];
  return s;
}

Result<PcpRankPlan> pcp_plan(const std::vector<Request>& requests, const PcpOptions& options, int32_t rank,
                             const KvSharding& sharding, int32_t cr, const BlockTable& table, int32_t page_size) {
  const int32_t P = options.P;
  if (P < 1) return invalid_argument("PCP size must be >= 1, got " + std::to_string(P));
  if (rank < 0 || rank >= P) {
    return invalid_argument("PCP rank " + std::to_string(rank) + " outside [0, " + std::to_string(P) + ")");
  }
  DSACP_RETURN_IF_ERROR(validate_sharding(sharding));
  if (cr < 0 || cr >= sharding.Pt) {
    return invalid_argument("CP rank " + std::to_string(cr) + " outside [0, " + std::to_string(sharding.Pt) + ")");
  }
  if (options.graph_bucket_tokens < 0) return invalid_argument("graph bucket must be >= 0");
  PcpRankPlan plan;
  plan.P = P;
  plan.rank = rank;
  DSACP_ASSIGN_OR_RETURN(plan.layout, batch_layout(requests, options.decode_threshold));
  const int32_t R = static_cast<int32_t>(requests.size());
  const int32_t num_decodes = plan.layout.num_decodes;

  // 3.3: padded lengths and each rank's rows; all_positions for every rank (the gathered order).
  plan.padded_query_lens.resize(R);
  plan.chunk_size.assign(R, 0);
  std::vector<int64_t> padded_start(R + 1, 0);
  for (int32_t b = 0; b < R; ++b) {
    const int64_t Q = requests[b].query_len;
    if (b < num_decodes) {
      plan.padded_query_lens[b] = Q * P;
    } else {
      const int64_t two_p = 2 * int64_t{P};
      plan.padded_query_lens[b] = (Q + two_p - 1) / two_p * two_p;
      plan.chunk_size[b] = plan.padded_query_lens[b] / two_p;
    }
    padded_start[b + 1] = padded_start[b] + plan.padded_query_lens[b];
  }
  const int64_t num_padded = padded_start[R];
  if (num_padded % P != 0) return internal_error("PCP padded token count is not a multiple of P");
  const int64_t T_loc = num_padded / P;
  if (T_loc > INT32_MAX) return out_of_range("PCP local token count exceeds 2^31 - 1");
  plan.num_local_tokens = T_loc;
  plan.all_positions.reserve(static_cast<size_t>(num_padded));
  for (int32_t k = 0; k < P; ++k) {
    for (int32_t b = 0; b < R; ++b) {
      const int64_t Q = requests[b].query_len;
      if (b < num_decodes) {
        for (int64_t j = 0; j < Q; ++j) {
          plan.all_positions.push_back(padded_start[b] + int64_t{k} * Q + j);
          if (k == rank) {
            plan.row_request.push_back(b);
            plan.row_offset.push_back(static_cast<int32_t>(j));
          }
        }
      } else {
        for (int64_t off : pcp_prefill_offsets(Q, P, k)) {
          plan.all_positions.push_back(padded_start[b] + off);
          if (k == rank) {
            plan.row_request.push_back(b);
            plan.row_offset.push_back(static_cast<int32_t>(off));
          }
        }
      }
    }
  }
  plan.num_local_decode_tokens = plan.layout.num_decode_tokens;
  for (int64_t i = 0; i < T_loc; ++i) {
    const Request& r = requests[plan.row_request[i]];
    const bool pad = plan.row_offset[i] >= r.query_len;
    plan.row_is_pad.push_back(pad ? 1 : 0);
    plan.row_key_len.push_back(pad ? 0 : r.context_len + plan.row_offset[i] + 1);
  }
  plan.restore_index.assign(static_cast<size_t>(num_padded), -1);
  for (int64_t j = 0; j < num_padded; ++j) plan.restore_index[plan.all_positions[j]] = j;

  // 3.4: unpad mask and the padded slot mapping (the ordinary slots scattered into the mask's true positions).
  const int64_t decode_region = plan.layout.num_decode_tokens * P;
  plan.unpad_mask.assign(static_cast<size_t>(num_padded), 0);
  for (int64_t p = 0; p < decode_region; ++p) plan.unpad_mask[p] = p % P == 0;
  for (int32_t b = num_decodes; b < R; ++b) {
    for (int64_t i = 0; i < requests[b].query_len; ++i) plan.unpad_mask[padded_start[b] + i] = 1;
  }
  plan.padded_slots.assign(static_cast<size_t>(num_padded), -1);
  int64_t next_true = 0;
  for (int32_t b = 0; b < R; ++b) {
    for (int64_t i = 0; i < requests[b].query_len; ++i) {
      while (next_true < num_padded && !plan.unpad_mask[next_true]) ++next_true;
      if (next_true >= num_padded) return internal_error("PCP unpad mask has fewer true positions than tokens");
      DSACP_ASSIGN_OR_RETURN(plan.padded_slots[next_true],
                             sharded_slot(sharding, cr, table, b, requests[b].context_len + i, page_size));
      ++next_true;
    }
  }
  // 3.10: the decode region keeps one copy (rank 0's) of every decode token.
  std::vector<int32_t> decode_lens;
  for (int32_t b = 0; b < num_decodes; ++b) decode_lens.push_back(requests[b].query_len);
  pcp_compact_decode_slots(plan.padded_slots, decode_lens, P);

  // 3.5 and 3.7: head/tail indices over the prefill rows, and the key counts of the two calls.
  int64_t offset = 0;
  for (int32_t b = num_decodes; b < R; ++b) {
    const int64_t c = plan.chunk_size[b];
    for (int64_t i = 0; i < c; ++i) plan.q_head_idx.push_back(offset + i);
    for (int64_t i = 0; i < c; ++i) plan.q_tail_idx.push_back(offset + c + i);
    offset += 2 * c;
    plan.head_key_lens.push_back(requests[b].context_len + c * (rank + 1));
    plan.tail_key_lens.push_back(requests[b].context_len + c * (2 * int64_t{P} - rank));
  }
  std::vector<int64_t> cat = plan.q_head_idx;
  cat.insert(cat.end(), plan.q_tail_idx.begin(), plan.q_tail_idx.end());
  plan.q_full_idx.assign(cat.size(), 0);
  std::iota(plan.q_full_idx.begin(), plan.q_full_idx.end(), 0);
  std::sort(plan.q_full_idx.begin(), plan.q_full_idx.end(), [&](int64_t a, int64_t b) { return cat[a] < cat[b]; });

  // The token behind every gathered row (the same for every rank).
  plan.gathered_request.assign(static_cast<size_t>(num_padded), -1);
  plan.gathered_pos.assign(static_cast<size_t>(num_padded), -1);
  for (int64_t j = 0; j < num_padded; ++j) {
    const int64_t q = plan.all_positions[j];
    const int32_t b = static_cast<int32_t>(std::upper_bound(padded_start.begin(), padded_start.end(), q) -
                                           padded_start.begin() - 1);
    const int64_t off = q - padded_start[b];
    const int64_t Q = requests[b].query_len;
    int64_t i = -1;
    if (b < num_decodes) {
      if (off / Q == 0) i = off % Q;  // rank 0's copy
    } else if (off < Q) {
      i = off;
    }
    if (i >= 0) {
      plan.gathered_request[j] = b;
      plan.gathered_pos[j] = requests[b].context_len + i;
    }
  }

  plan.output_rows = std::max(T_loc, options.graph_bucket_tokens);
  return plan;
}

}  // namespace dsacp
