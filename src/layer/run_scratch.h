// The device buffers of a planned run, kept by its plan across runs (the CP step's; CpStepPlan holds one). A
// run takes its buffers in the same order every time; the n-th buffer it takes is the n-th one the plan kept
// from earlier runs, replaced by a larger one only where this run needs more. So a plan's runs after the first
// allocate nothing (what capturing a run into a CUDA graph needs: capture after one eager run), and a buffer a
// collective may still be writing into when a run gives up early stays alive with the plan instead of being
// freed under it.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "dsacp/backend.h"
#include "dsacp/status.h"

namespace dsacp {

class RunScratch {
 public:
  // Claims the scratch for one run (refused while another run holds it: a plan's runs go one after the other)
  // and starts its sequence of takes at the first buffer.
  Status begin_run(const char* who);
  void end_run() { busy_.store(false); }

  // The next buffer of this run: at least `bytes` (at least 1) bytes of `backend` memory, not owned by the result
  // (the scratch keeps it). Contents are whatever the previous run left.
  Result<DeviceBuffer> take(Backend& backend, size_t bytes);

  size_t bytes() const { return bytes_; }                // device bytes held now
  int64_t allocations() const { return allocations_; }  // backend allocations made so far, all runs

 private:
  std::vector<DeviceBuffer> blocks_;
  size_t next_ = 0;
  size_t bytes_ = 0;
  int64_t allocations_ = 0;
  std::atomic<bool> busy_{false};
};

// Holds a RunScratch for the lifetime of one run.
class RunScratchClaim {
 public:
  explicit RunScratchClaim(RunScratch& s) : s_(s) {}
  Status claim(const char* who) {
    DSACP_RETURN_IF_ERROR(s_.begin_run(who));
    held_ = true;
    return Status();
  }
  ~RunScratchClaim() {
    if (held_) s_.end_run();
  }
  RunScratchClaim(const RunScratchClaim&) = delete;
  RunScratchClaim& operator=(const RunScratchClaim&) = delete;

 private:
  RunScratch& s_;
  bool held_ = false;
};

}  // namespace dsacp
