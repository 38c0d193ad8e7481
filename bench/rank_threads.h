// The CP benchmark's host threads: one long-lived, spinning thread per rank pinned to a core of its own, and a
// spinning barrier that starts the ranks' timed steps together.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <pthread.h>
#include <sched.h>

namespace dsacp::bench {

// A spin-wait's pause: on x86 it leaves the core's other hardware thread the issue slots a tight loop would take.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// CPUs this process may run on, one per physical core (the first hardware thread of each, from sysfs), so that
// the spinning rank threads never share a core: a busy sibling slowed a rank's host work by up to 2x.
inline std::vector<int> one_cpu_per_core() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return cpus;
  std::vector<std::pair<int, int>> seen;  // (package, core)
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &set)) continue;
    auto read_id = [cpu](const char* what) {
      const std::string path = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/" + what;
      FILE* f = std::fopen(path.c_str(), "r");
      int v = -1;
      if (f != nullptr) {
        if (std::fscanf(f, "%d", &v) != 1) v = -1;
        std::fclose(f);
      }
      return v;
    };
    const std::pair<int, int> id{read_id("physical_package_id"), read_id("core_id")};
    if (id.second >= 0 && std::find(seen.begin(), seen.end(), id) != seen.end()) continue;
    seen.push_back(id);
    cpus.push_back(cpu);
  }
  return cpus;
}

inline bool pin_to(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0;
}

// One long-lived thread per rank, as a serving engine keeps them: every rank's work (communicator creation,
// steps, release) runs on its own thread, and a step's time does not include starting a thread (a fresh thread's
// first CUDA calls, which set up its per-thread state, cost tens of microseconds). The threads spin between jobs
// (a serving engine's rank workers are busy stepping): a thread woken from a sleep runs its first tens of
// microseconds of host work slower. The one-GPU step runs on rank 0's thread the same way, so both sides of a
// comparison pay the same dispatch.
class RankThreads {
 public:
  // cpus: where to pin rank r's thread (cpus[r], when there is one); empty: not pinned.
  RankThreads(int n, const std::vector<int>& cpus) {
    for (int r = 0; r < n; ++r) {
      const int cpu = r < static_cast<int>(cpus.size()) ? cpus[r] : -1;
      threads_.emplace_back([this, r, cpu] {
        if (cpu >= 0 && !pin_to(cpu)) std::fprintf(stderr, "rank thread %d: could not pin to CPU %d\n", r, cpu);
        loop(r);
      });
    }
  }
  ~RankThreads() {
    stop_.store(true, std::memory_order_release);
    for (auto& t : threads_) t.join();
  }
  int size() const { return static_cast<int>(threads_.size()); }
  // Runs f(r) on rank r's thread for every rank, and waits for all of them.
  void run(const std::function<void(int)>& f) {
    job_ = &f;
    pending_.store(size(), std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_acq_rel);
    while (pending_.load(std::memory_order_acquire) != 0) cpu_relax();
    job_ = nullptr;
  }

 private:
  void loop(int r) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t g;
      while ((g = generation_.load(std::memory_order_acquire)) == seen) {
        if (stop_.load(std::memory_order_acquire)) return;
        cpu_relax();
      }
      seen = g;
      (*job_)(r);
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }
  std::vector<std::thread> threads_;
  const std::function<void(int)>* job_ = nullptr;  // published by generation_'s release
  std::atomic<int> pending_{0};
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stop_{false};
};

// A spinning barrier for the rank threads: after the communicators' barrier (an NCCL all-reduce, whose waits
// return on each thread at its own time, and a condition variable's wake-ups before it), every rank leaves this
// within a microsecond or so, so that the ranks start a timed step together. Without it one rank started its step
// up to tens of microseconds after the other, and the earlier rank's time included waiting for it.
class SpinBarrier {
 public:
  explicit SpinBarrier(int n) : n_(n) {}
  void arrive_and_wait() {
    const uint64_t gen = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(gen + 1, std::memory_order_release);
      return;
    }
    while (generation_.load(std::memory_order_acquire) == gen) cpu_relax();
  }

 private:
  const int n_;
  std::atomic<int> arrived_{0};
  std::atomic<uint64_t> generation_{0};
};

}  // namespace dsacp::bench
