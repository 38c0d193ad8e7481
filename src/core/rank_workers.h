// One long-lived thread per rank of a local CP cluster: every rank's work (communicator creation, context loads,
// steps, release) runs on its own thread, the same one every time, and a step does not pay for starting threads
// (a fresh thread's first CUDA calls set up its per-thread state: tens of microseconds). Idle threads sleep on a
// condition variable (a library must not spin the host's cores between steps).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace dsacp {

class RankWorkers {
 public:
  explicit RankWorkers(int32_t num_ranks);
  ~RankWorkers();
  RankWorkers(const RankWorkers&) = delete;
  RankWorkers& operator=(const RankWorkers&) = delete;

  int32_t size() const { return static_cast<int32_t>(threads_.size()); }
  // Runs job(r) on rank r's thread for every rank and returns once all of them have returned. One run at a
  // time (calls from several threads are serialized).
  void run(const std::function<void(int32_t)>& job);

 private:
  void loop(int32_t r);
  std::vector<std::thread> threads_;
  std::mutex run_mutex_;  // one run at a time
  std::mutex mutex_;
  std::condition_variable start_, done_;
  const std::function<void(int32_t)>* job_ = nullptr;
  uint64_t generation_ = 0;
  int32_t pending_ = 0;
  bool stop_ = false;
};

}  // namespace dsacp
