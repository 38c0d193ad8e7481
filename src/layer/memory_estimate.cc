#include "dsacp/memory_estimate.h"

#include <algorithm>
#include <limits>

#include "core/memory.h"
#include "dsacp/backend.h"

namespace dsacp {
namespace {

// Saturating arithmetic: a hostile dim (K = 2^31 - 1) must give "too much", never a wrapped small number.
uint64_t mul(uint64_t a, uint64_t b) {
  if (a != 0 && b > std::numeric_limits<uint64_t>::max() / a) return std::numeric_limits<uint64_t>::max();
  return a * b;
}
uint64_t add(uint64_t a, uint64_t b) { return b > std::numeric_limits<uint64_t>::max() - a ? std::numeric_limits<uint64_t>::max() : a + b; }
uint64_t u(int64_t v) { return v < 0 ? 0 : static_cast<uint64_t>(v); }

}  // namespace

uint64_t MemoryEstimate::total() const { return add(add(caches, inputs), step); }

std::string MemoryEstimate::describe() const {
  return bytes_string(total()) + " (KV caches " + bytes_string(caches) + ", inputs " + bytes_string(inputs) +
         ", step buffers " + bytes_string(step) + (detail.empty() ? "" : ": " + detail) + ")";
}

MemoryEstimate cp_memory_estimate(const StepConfig& c, const CpLayout& layout, const PagedCacheConfig& cc,
                                  int64_t step_tokens, int32_t ranks_here) {
  MemoryEstimate e;
  const uint64_t Pt = u(std::max(layout.num_ranks(), 1));
  const uint64_t ranks = u(std::max(ranks_here, 1));
  const uint64_t elem = dtype_size(cc.dtype);
  const uint64_t index_factor = layout.indexer == IndexerMode::kReplicated ? Pt : 1;
  const uint64_t slots = mul(u(cc.num_pages), u(cc.page_size));
  const uint64_t row = add(mul(u(cc.Dl) + u(cc.Dr), 1), mul(u(cc.Di), index_factor));
  e.caches = mul(mul(mul(slots, row), elem), ranks);

  const uint64_t T = u(step_tokens), K = u(c.K), H = u(c.H), act = dtype_size(c.act_dtype);
  // Inputs: q (nope + rope), the new KV rows, the indexer query, weights and key.
  const uint64_t per_token = add(add(mul(H, u(c.Dl) + u(c.Dr)), u(c.Dl) + u(c.Dr)),
                                 add(mul(u(c.Hi), u(c.Di)), u(c.Di)));
  e.inputs = add(mul(mul(T, per_token), act), mul(mul(T, u(c.Hi)), 4));
  // Per rank (an upper bound: a rank may see every row): top-k indices and scores, its own and gathered from
  // every rank for the sharded merge; attention partials (out f32 + lse) for the merge, and the merged rows.
  const uint64_t topk = mul(mul(mul(T, K), 8), add(Pt, 1));
  const uint64_t attention = mul(mul(T, H), mul(add(u(c.Dl), 1), 4 * 3));
  // The result once: indices, out, lse.
  const uint64_t result = mul(T, add(mul(K, 4), mul(H, mul(add(u(c.Dl), 1), 4))));
  e.step = add(mul(add(topk, attention), ranks), result);
  e.detail = "T=" + std::to_string(T) + ", K=" + std::to_string(K) + ", H=" + std::to_string(H) +
             ", Dl=" + std::to_string(c.Dl) + ", " + std::to_string(ranks) + (ranks == 1 ? " rank" : " ranks") +
             " of " + std::to_string(Pt);
  return e;
}

Status host_memory_check(const MemoryEstimate& estimate, const std::string& what, uint64_t max_bytes) {
  Status s = host_memory_check(estimate.total(), what, max_bytes);
  if (s.ok()) return s;
  // Name the parts: what the memory would be for.
  std::string msg = s.message();
  const std::string needle = "about " + bytes_string(estimate.total());
  const size_t at = msg.find(needle);
  if (at != std::string::npos) msg.replace(at, needle.size(), "about " + estimate.describe());
  return resource_exhausted(msg);
}

Status device_memory_check(const MemoryEstimate& estimate, int32_t ranks_in_estimate,
                           const std::vector<Backend*>& rank_backends, const std::string& what) {
  const uint64_t per_rank = estimate.total() / u(std::max(ranks_in_estimate, 1));
  std::vector<std::pair<Backend*, uint64_t>> devices;  // distinct GPU backends and their ranks
  for (Backend* b : rank_backends) {
    if (b == nullptr || b->cuda_device() < 0) continue;
    auto it = std::find_if(devices.begin(), devices.end(), [&](const auto& d) { return d.first == b; });
    if (it == devices.end()) {
      devices.emplace_back(b, 1);
    } else {
      ++it->second;
    }
  }
  for (const auto& [b, ranks] : devices) {
    const int64_t free_bytes = b->device_memory_free();
    if (free_bytes < 0) continue;
    const uint64_t need = mul(per_rank, ranks);
    if (need > static_cast<uint64_t>(free_bytes)) {
      return resource_exhausted(what + " needs about " + bytes_string(need) + " of GPU memory on " + b->name() + " (" +
                                std::to_string(ranks) + (ranks == 1 ? " rank: " : " ranks: ") + estimate.describe() +
                                "), " + bytes_string(static_cast<uint64_t>(free_bytes)) + " free");
    }
  }
  return Status();
}

}  // namespace dsacp
