// One CP rank's step split in two, as the single-device step is (dsacp/step_plan.h): a plan built once per
// forward pass from the batch and the rank's part of the layout (the checks, every host table — slots of the
// exchanged rows, local key lengths, the replicated indexer's table, the gathered views' pack and unpack
// orders and view tables, the DSA-CP rows, the local decodes' head orders — uploaded once, and the backend's
// indexer schedules), and a per-layer run that reads it: collectives, kernels and their device buffers only.
//
//   CpStepPlan plan = cp_step_plan(backend, config, requests, rank_plan, layout, sharding, table, cache_config).value();
//   for (layer : layers) cp_step_run(backend, comms, plan, layer.cache, layer.inputs, layer.outputs);
//
// Every rank of the layout plans with the same batch and its own CpRankPlan; every rank runs each layer.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "dsacp/backend.h"
#include "dsacp/batch.h"
#include "dsacp/communicator.h"
#include "dsacp/cp_plan.h"
#include "dsacp/paged_cache.h"
#include "dsacp/status.h"
#include "dsacp/step.h"

namespace dsacp {

struct CpComms;  // dsacp/cp_step.h

struct CpStepPlanOptions {
  // The block table already in the backend's memory (the host table's entries), as a serving engine keeps it:
  // the plan reads it instead of uploading its own, and checks on the host only the pages this rank writes (its
  // new tokens'); the kernels check every page they read.
  const int32_t* device_block_table = nullptr;
  // Runs that only enqueue, as a CUDA graph capture of a run needs (Backend::begin_capture around cp_step_run,
  // on every rank): no host wait for a collective, no synchronize at the step's end; the kernels' errors come
  // back from the backend's next synchronize(). The run then needs a device backend and communicators that order
  // their collectives on the device (Communicator::orders_on_device: NCCL), and exchanges its rows by the
  // collectives only (the exchange windows keep their sequence on the host). A collective's failure is not
  // reported by the run (NCCL's own error handling and the caller's synchronize see it).
  bool enqueue_only = false;
};

// The plan of one batch on one CP rank. Movable; it must outlive the runs that use it.
class CpStepPlan {
 public:
  CpStepPlan();
  ~CpStepPlan();
  CpStepPlan(CpStepPlan&&) noexcept;
  CpStepPlan& operator=(CpStepPlan&&) noexcept;

  const StepConfig& config() const;
  const CpRankPlan& rank_plan() const;
  const CpLayout& layout() const;
  // Pages a layer's cache must hold (one past the highest page id of the rank's pools the plan addresses).
  int64_t pages_needed() const;
  // The device buffers the plan keeps for its runs (the gathered rows, the exchanged candidates and partials):
  // taken in the same order by every run, grown only where a run needs more, so the runs of a plan after its
  // first allocate nothing (capture a run into a CUDA graph after one eager run). Bytes held now, and the
  // backend allocations that took, all runs together.
  size_t run_scratch_bytes() const;
  int64_t run_scratch_allocations() const;

  struct Impl;
  const Impl& impl() const { return *impl_; }

 private:
  friend Result<CpStepPlan> cp_step_plan(Backend&, const StepConfig&, const std::vector<Request>&, const CpRankPlan&,
                                         const CpLayout&, const KvSharding&, const BlockTable&,
                                         const PagedCacheConfig&, const CpStepPlanOptions&);
  std::unique_ptr<Impl> impl_;
};

// Checks the config, the layout, the sharding and the block table against the batch and the rank's cache
// configuration (cp_rank_cache_config: index_page_factor = Pt under the replicated indexer), builds the rank's
// host tables and uploads them (in stream order before any run). Refusals are one line naming what is wrong.
Result<CpStepPlan> cp_step_plan(Backend& backend, const StepConfig& config, const std::vector<Request>& requests,
                                const CpRankPlan& plan, const CpLayout& layout, const KvSharding& sharding,
                                const BlockTable& table, const PagedCacheConfig& cache,
                                const CpStepPlanOptions& options = {});

// One layer's step on this rank under `plan` (see cp_step_run in dsacp/cp_step.h for the inputs' and outputs'
// shapes). Refused at once: a plan of another backend, a cache of another configuration or with fewer pages than
// the plan addresses, communicators that are not the plan's ranks. StepInputs::block_table is ignored (the plan
// holds the table).
Status cp_step_run(Backend& backend, const CpComms& comms, const CpStepPlan& plan, PagedKvCache& cache,
                   const StepInputs& inputs, const StepOutputs& outputs);

}  // namespace dsacp
