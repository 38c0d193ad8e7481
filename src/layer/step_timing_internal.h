// The executor's side of dsacp/step_timing.h: a clock that adds phase times to the thread's recorder, if any.
#pragma once

#include <chrono>

#include "dsacp/backend.h"
#include "dsacp/step_timing.h"

namespace dsacp {

StepPhaseTimes* current_step_phase_times();
StepLaunchTimes* current_step_launch_times();

// Also the executor's side of StepLaunchRecorder: indexer_launched() after the (first) indexer launch.
class PhaseClock {
 public:
  explicit PhaseClock(Backend& backend)
      : backend_(backend), times_(current_step_phase_times()), launch_(current_step_launch_times()),
        start_(Clock::now()), last_(start_) {}
  // Adds the time since the previous mark to `phase` (a member of StepPhaseTimes). While a recorder is alive it
  // first waits for the backend, so the phase holds its device work (and returns the errors found so far).
  Status mark(double StepPhaseTimes::*phase) {
    if (times_ == nullptr) return Status();
    DSACP_RETURN_IF_ERROR(backend_.synchronize());
    const auto now = Clock::now();
    times_->*phase += std::chrono::duration<double, std::milli>(now - last_).count();
    last_ = now;
    return Status();
  }
  // The step's host time to its indexer launch (only the first call counts), for a StepLaunchRecorder.
  void indexer_launched() {
    if (launch_ == nullptr || indexer_launched_) return;
    indexer_launched_ = true;
    launch_->to_indexer_ms += since_start_ms();
  }
  // Call once, at the end of a successful step.
  void finish() {
    const double total = since_start_ms();
    if (times_ != nullptr) {
      times_->total_ms += total;
      ++times_->steps;
    }
    if (launch_ != nullptr) {
      launch_->total_ms += total;
      ++launch_->steps;
    }
  }

 private:
  using Clock = std::chrono::steady_clock;
  double since_start_ms() const { return std::chrono::duration<double, std::milli>(Clock::now() - start_).count(); }
  Backend& backend_;
  StepPhaseTimes* times_;
  StepLaunchTimes* launch_;
  Clock::time_point start_, last_;
  bool indexer_launched_ = false;
};

}  // namespace dsacp
