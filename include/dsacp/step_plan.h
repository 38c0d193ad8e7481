// The single-device step split in two: a plan built once per forward pass from the batch (everything that
// depends only on the requests, the block table and the config: slots, key lengths, the backend's kernel
// schedules, the workspace size), uploaded once; and a per-layer run that only enqueues kernels (no host
// planning, no allocation, no host<->device copy, no synchronization), so a serving engine calls it once per
// layer and can capture it into a CUDA graph (Backend::begin_capture).
//
//   StepPlan plan = step_plan(backend, config, requests, table, cache_config).value();   // once per forward
//   for (layer : layers) step_run(backend, plan, layer.cache, layer.inputs, layer.outputs);   // per layer
//   backend.synchronize();   // errors found on the device by any layer's kernels come back here
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "dsacp/backend.h"
#include "dsacp/batch.h"
#include "dsacp/paged_cache.h"
#include "dsacp/status.h"
#include "dsacp/step.h"

namespace dsacp {

struct StepPlanOptions {
  // The step's block table already in the backend's memory ([num_requests, max_pages] int32, the host table's
  // entries), as a serving engine keeps it: the plan reads it instead of uploading its own copy, and checks on
  // the host only the pages of the new tokens (the pages the run writes); every other page is checked by the
  // kernels that read it (found at the next synchronize(), naming the kernel and the token).
  const int32_t* device_block_table = nullptr;
  // The plan allocates its own workspace (workspace_bytes()); off: every run must be given one.
  bool own_workspace = true;
  // The plan's fingerprint (StepPlan::fingerprint, a hash of the whole block table among others); off: 0, and runs
  // check none (a one-shot plan, as step_run over the batch makes).
  bool fingerprint = true;
};

// A device buffer the caller lends a planned run for its scratch (at least StepPlan::workspace_bytes() bytes,
// 256-byte aligned); null: the plan's own.
struct StepWorkspace {
  void* data = nullptr;
  size_t bytes = 0;
};

// The plan of one batch on one backend. Movable; it must outlive the runs (and graphs) that use it.
class StepPlan {
 public:
  StepPlan();
  ~StepPlan();
  StepPlan(StepPlan&&) noexcept;
  StepPlan& operator=(StepPlan&&) noexcept;

  const StepConfig& config() const;
  const SingleDevicePlan& host() const;  // slots, token requests, key lengths (host copies)
  int64_t num_tokens() const;
  // A hash of the config, the requests, the block table's entries and the cache config (0 with
  // StepPlanOptions::fingerprint off): a run given inputs with another StepInputs::plan_fingerprint is refused.
  uint64_t fingerprint() const;
  // Pages a layer's cache must hold: one past the highest page id the plan checked.
  int64_t pages_needed() const;
  // Device scratch bytes a run needs (0 for backends that use none).
  size_t workspace_bytes() const;

  struct Impl;
  const Impl& impl() const { return *impl_; }

 private:
  friend Result<StepPlan> step_plan(Backend&, const StepConfig&, const std::vector<Request>&, const BlockTable&,
                                    const PagedCacheConfig&, const StepPlanOptions&);
  std::unique_ptr<Impl> impl_;
};

// The fingerprint a plan of this batch has (StepInputs::plan_fingerprint).
uint64_t step_fingerprint(const StepConfig& config, const std::vector<Request>& requests, const BlockTable& table,
                          const PagedCacheConfig& cache);

// Checks the config against the cache config and the block table against the batch (every position of every
// request has a page in range; with options.device_block_table, the new tokens' positions), plans, uploads the
// plan's device tables and (options.own_workspace) allocates its workspace. The uploads are in stream order before
// any run (the host vectors are free when it returns).
Result<StepPlan> step_plan(Backend& backend, const StepConfig& config, const std::vector<Request>& requests,
                           const BlockTable& table, const PagedCacheConfig& cache, const StepPlanOptions& options = {});

// One layer's step under `plan`: cache write -> indexer + top-k (or the caller's precomputed top-k) -> sparse MLA
// -> the outputs' serving forms, enqueued on the backend's stream with deferred error checks. It does not wait:
// data errors found on the device come back from the next Backend::synchronize(), naming the kernel and the
// token. Refused at once (one line naming the mismatch): a plan of another backend, inputs of another batch
// (StepInputs::plan_fingerprint set and different), a cache of another config or with fewer pages than
// plan.pages_needed(), a workspace smaller than plan.workspace_bytes(), missing indexer inputs.
// StepInputs::block_table is ignored (the plan holds the table).
Status step_run(Backend& backend, const StepPlan& plan, PagedKvCache& cache, const StepInputs& inputs,
                const StepOutputs& outputs, const StepWorkspace& workspace = {});

}  // namespace dsacp
