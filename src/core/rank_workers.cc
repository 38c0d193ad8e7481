#include "core/rank_workers.h"

namespace dsacp {

RankWorkers::RankWorkers(int32_t num_ranks) {
  for (int32_t r = 0; r < num_ranks; ++r) threads_.emplace_back([this, r] { loop(r); });
}

RankWorkers::~RankWorkers() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  start_.notify_all();
  for (auto& t : threads_) t.join();
}

void RankWorkers::run(const std::function<void(int32_t)>& job) {
  std::lock_guard<std::mutex> one_run(run_mutex_);
  std::unique_lock<std::mutex> lock(mutex_);
  job_ = &job;
  pending_ = size();
  ++generation_;
  start_.notify_all();
  done_.wait(lock, [this] { return pending_ == 0; });
  job_ = nullptr;
}

void RankWorkers::loop(int32_t r) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int32_t)>* job = nullptr;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      start_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
    }
    (*job)(r);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_ == 0) done_.notify_one();
    }
  }
}

}  // namespace dsacp
