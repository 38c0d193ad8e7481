// The executor's side of dsacp/step_timing.h: a clock that adds phase times to the thread's recorder, if any.
#pragma once

#include <chrono>

#include "dsacp/backend.h"
#include "dsacp/step_timing.h"

namespace dsacp {

StepPhaseTimes* current_step_phase_times();
StepLaunchTimes* current_step_launch_times();

// The executor's side of StepLaunchRecorder: start at construction, indexer_launched() after the (first) indexer
// launch, finish() at the end of a successful step.
class LaunchClock {
 public:
  LaunchClock() : times_(current_step_launch_times()), start_(Clock::now()) {}
  void indexer_launched() {
    if (times_ == nullptr || indexer_) return;
    indexer_ = true;
    times_->to_indexer_ms += std::chrono::duration<double, std::milli>(Clock::now() - start_).count();
  }
  void finish() {
    if (times_ == nullptr) return;
    times_->total_ms += std::chrono::duration<double, std::milli>(Clock::now() - start_).count();
    ++times_->steps;
  }

 private:
  using Clock = std::chrono::steady_clock;
  StepLaunchTimes* times_;
  Clock::time_point start_;
  bool indexer_ = false;
};

class PhaseClock {
 public:
  explicit PhaseClock(Backend& backend)
      : backend_(backend), times_(current_step_phase_times()), start_(Clock::now()), last_(start_) {}
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
  // Call once, at the end of a successful step.
  void finish() {
    if (times_ == nullptr) return;
    times_->total_ms += std::chrono::duration<double, std::milli>(Clock::now() - start_).count();
    ++times_->steps;
  }

 private:
  using Clock = std::chrono::steady_clock;
  Backend& backend_;
  StepPhaseTimes* times_;
  Clock::time_point start_, last_;
};

}  // namespace dsacp
