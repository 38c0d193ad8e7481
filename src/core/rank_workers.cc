#include "core/rank_workers.h"

#include <algorithm>
#include <exception>
#include <string>
#include <utility>
#include <system_error>

namespace dsacp {

RankWorkers::RankWorkers(int32_t num_ranks, int32_t fail_start_at) {
  try {
    threads_.reserve(static_cast<size_t>(std::max(num_ranks, 0)));
    for (int32_t r = 0; r < num_ranks; ++r) {
      if (r == fail_start_at) throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again));
      threads_.emplace_back([this, r] { loop(r); });
    }
  } catch (const std::system_error& e) {
    start_status_ = resource_exhausted("cannot start the thread of CP rank " + std::to_string(threads_.size()) +
                                       " of " + std::to_string(num_ranks) + ": " + e.code().message() +
                                       " (too many threads for the address space or the thread limit?)");
    // The threads already started wait on the condition variables: stop and join them before anything is
    // destroyed (a destroyed condition variable with waiters hangs; a joinable std::thread terminates).
    stop_and_join();
  } catch (const std::bad_alloc&) {
    start_status_ = resource_exhausted("out of memory starting " + std::to_string(num_ranks) + " CP rank threads");
    stop_and_join();
  }
}

Result<std::unique_ptr<RankWorkers>> RankWorkers::create(int32_t num_ranks, int32_t fail_start_at) {
  auto w = std::make_unique<RankWorkers>(num_ranks, fail_start_at);
  if (!w->start_status_.ok()) return w->start_status_;
  return w;
}

void RankWorkers::stop_and_join() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  start_.notify_all();
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
  threads_.clear();
}

RankWorkers::~RankWorkers() { stop_and_join(); }

void RankWorkers::run(const std::function<void(int32_t)>& job) {
  std::lock_guard<std::mutex> one_run(run_mutex_);
  std::unique_lock<std::mutex> lock(mutex_);
  job_ = &job;
  pending_ = size();
  ++generation_;
  start_.notify_all();
  done_.wait(lock, [this] { return pending_ == 0; });
  job_ = nullptr;
  // An exception of a job (std::bad_alloc) would end the process on its rank's thread: it is carried to the
  // caller's thread instead.
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
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
    std::exception_ptr error;
    try {
      (*job)(r);
    } catch (...) {
      error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (error && !error_) error_ = error;
      if (--pending_ == 0) done_.notify_one();
    }
  }
}

}  // namespace dsacp
