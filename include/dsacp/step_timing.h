// Phase times of the steps a thread runs (for benchmarks and `dsacp run`): while a StepPhaseRecorder is alive,
// every step_run / cp_step_run on its thread adds the host wall-clock time of its phases, synchronizing the
// backend at each phase boundary so that a phase's time is its device work plus launch gaps (under CP, time
// blocked in collectives is counted in the phase that waits). Those synchronizations cost a few microseconds
// each and stop work of one phase from overlapping the next: time whole steps without a recorder.
#pragma once

namespace dsacp {

struct StepPhaseTimes {
  int steps = 0;
  double kv_ms = 0;         // planning, uploads, KV exchange and cache write
  double topk_ms = 0;       // indexer + exact top-k (with the candidate exchange and merge under CP)
  double attention_ms = 0;  // sparse MLA (with the query gathers, partial all-to-all and LSE merge under CP)
  double total_ms = 0;
};

class StepPhaseRecorder {
 public:
  explicit StepPhaseRecorder(StepPhaseTimes* times);
  ~StepPhaseRecorder();
  StepPhaseRecorder(const StepPhaseRecorder&) = delete;
  StepPhaseRecorder& operator=(const StepPhaseRecorder&) = delete;

 private:
  StepPhaseTimes* previous_;
};

// Host-side launch times of the steps a thread runs, without synchronizing anything (for benchmarks): while a
// StepLaunchRecorder is alive, every step_run / cp_step_run on its thread adds the host time from its start until
// its indexer launch returned (the step's critical path starts on the device there) and its whole host time.
struct StepLaunchTimes {
  int steps = 0;
  double to_indexer_ms = 0;
  double total_ms = 0;
};

class StepLaunchRecorder {
 public:
  explicit StepLaunchRecorder(StepLaunchTimes* times);
  ~StepLaunchRecorder();
  StepLaunchRecorder(const StepLaunchRecorder&) = delete;
  StepLaunchRecorder& operator=(const StepLaunchRecorder&) = delete;

 private:
  StepLaunchTimes* previous_;
};

}  // namespace dsacp
