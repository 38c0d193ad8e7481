// One long-lived thread per rank of a local CP cluster: every rank's work (communicator creation, context loads,
// steps, release) runs on its own thread, the same one every time, and a step does not pay for starting threads
// (a fresh thread's first CUDA calls set up its per-thread state: tens of microseconds). Idle threads sleep on a
// condition variable (a library must not spin the host's cores between steps).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <memory>
#include <vector>

#include "dsacp/status.h"

namespace dsacp {

class RankWorkers {
 public:
  // Starts the threads; a thread that cannot be started (std::system_error: no address space, thread limit)
  // fails the creation with resource_exhausted after the threads already started are stopped and joined.
  // `fail_start_at` >= 0 makes that thread's start fail as if the system had refused it (tests).
  static Result<std::unique_ptr<RankWorkers>> create(int32_t num_ranks, int32_t fail_start_at = -1);
  // The same without the Status: a failed start leaves fewer threads (size() < num_ranks) and start_status()
  // says why; run() must not be called then.
  explicit RankWorkers(int32_t num_ranks, int32_t fail_start_at = -1);
  ~RankWorkers();
  const Status& start_status() const { return start_status_; }
  RankWorkers(const RankWorkers&) = delete;
  RankWorkers& operator=(const RankWorkers&) = delete;

  int32_t size() const { return static_cast<int32_t>(threads_.size()); }
  // Runs job(r) on rank r's thread for every rank and returns once all of them have returned. One run at a
  // time (calls from several threads are serialized). An exception a job throws is rethrown here.
  void run(const std::function<void(int32_t)>& job);

 private:
  void loop(int32_t r);
  void stop_and_join();
  std::vector<std::thread> threads_;
  Status start_status_;
  std::mutex run_mutex_;  // one run at a time
  std::mutex mutex_;
  std::condition_variable start_, done_;
  const std::function<void(int32_t)>* job_ = nullptr;
  uint64_t generation_ = 0;
  int32_t pending_ = 0;
  std::exception_ptr error_;  // the first exception a job threw in the current run
  bool stop_ = false;
};

}  // namespace dsacp
