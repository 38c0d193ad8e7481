// Memory a CP step needs, estimated from the dims and the layout before anything is allocated, and the check
// against what the host has (and an optional cap, `--max-memory`): a job that cannot fit is refused at once
// with one line saying how much it needs and for what, instead of being killed by the kernel's out-of-memory
// killer after minutes. The estimate is an upper bound of the large buffers (caches, inputs, the step's
// top-k and attention partials, the result); small bookkeeping and thread stacks are not counted.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dsacp/cp_plan.h"
#include "dsacp/paged_cache.h"
#include "dsacp/status.h"
#include "dsacp/step.h"

namespace dsacp {

struct MemoryEstimate {
  uint64_t caches = 0;  // the paged KV pools of every rank this process runs
  uint64_t inputs = 0;  // the step's inputs (and, for a replay, their converted copies and the context)
  uint64_t step = 0;    // the step's own buffers on every rank: top-k candidates, attention partials, the result
  uint64_t total() const;
  // "23.4 GiB (KV caches 1.2 GiB, inputs 3.0 MiB, step buffers 22.2 GiB: T=6, K=100000000, 1 rank)"
  std::string describe() const;
  std::string detail;  // the dims the step part came from (for describe)
};

// A step of `step_tokens` tokens with `config` on `ranks_here` ranks of `layout` (every rank for ranks that are
// threads, 1 for a process per rank), each holding a cache of `per_rank_cache` (num_pages, page size, dims).
MemoryEstimate cp_memory_estimate(const StepConfig& config, const CpLayout& layout,
                                  const PagedCacheConfig& per_rank_cache, int64_t step_tokens, int32_t ranks_here);

// OK when the estimate fits in the host's available memory and in `max_bytes` (0: no cap); else
// resource_exhausted "<what> needs about <describe()> of host memory, 11.2 GiB available (MemAvailable)".
Status host_memory_check(const MemoryEstimate& estimate, const std::string& what, uint64_t max_bytes);

// OK when, for every device among `rank_backends` (rank cr runs on rank_backends[cr]), the estimate's share of
// the ranks on that device fits in its free memory (Backend::device_memory_free; host backends are skipped);
// else resource_exhausted "<what> needs about 9.3 GiB of GPU memory on cuda:0 (4 ranks), 1.2 GiB free".
Status device_memory_check(const MemoryEstimate& estimate, int32_t ranks_in_estimate,
                           const std::vector<class Backend*>& rank_backends, const std::string& what);

}  // namespace dsacp
