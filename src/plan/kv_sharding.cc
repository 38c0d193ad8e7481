#include <algorithm>
#include <string>

#include "dsacp/cp_plan.h"

namespace dsacp {

int64_t KvSharding::local_len(int64_t S, int32_t cr) const {
  const int64_t base = (S / I / Pt) * I;
  const int64_t rem = S - base * Pt;
  return base + std::clamp<int64_t>(rem - int64_t{cr} * I, 0, I);
}

int64_t KvSharding::pages_needed(int64_t S, int32_t page_size) const {
  return (local_len(S, 0) + page_size - 1) / page_size;
}

Status validate_sharding(const KvSharding& s) {
  if (s.Pt < 1) return invalid_argument("CP size must be >= 1, got " + std::to_string(s.Pt));
  if (s.I < 1) return invalid_argument("interleave size must be >= 1, got " + std::to_string(s.I));
  return Status();
}

Result<int64_t> sharded_slot(const KvSharding& s, int32_t cr, const BlockTable& table, int32_t request, int64_t p,
                             int32_t page_size) {
  if (s.owner(p) != cr) return int64_t{-1};
  return slot_of(table, request, s.local_pos(p), page_size);
}

}  // namespace dsacp
