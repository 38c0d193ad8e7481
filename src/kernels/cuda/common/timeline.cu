// The CUDA backend's timeline diagnostic (CudaBackendOptions::timeline, timeline.h). Host code only.
#include "kernels/cuda/common/timeline.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace dsacp::cuda::timeline {
namespace {

using Clock = std::chrono::steady_clock;

struct Entry {
  const char* name;
  const char* lane;
  double host_us;
  double host_end_us;
  cudaEvent_t start, end;  // null for host-only spans
};

struct Device {
  bool in_step = false;
  cudaEvent_t ref = nullptr;
  Clock::time_point host_ref;
  std::vector<Entry> entries;
  std::vector<cudaEvent_t> free_events;
  std::string last;
};

std::mutex g_mu;
std::map<int, Device> g_devices;

cudaEvent_t take_event(Device& d) {
  if (!d.free_events.empty()) {
    cudaEvent_t e = d.free_events.back();
    d.free_events.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  if (cudaEventCreate(&e) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return e;
}

double since(const Device& d) { return std::chrono::duration<double, std::micro>(Clock::now() - d.host_ref).count(); }

void recycle(Device& d) {
  for (const Entry& e : d.entries) {
    if (e.start != nullptr) d.free_events.push_back(e.start);
    if (e.end != nullptr) d.free_events.push_back(e.end);
  }
  d.entries.clear();
}

std::atomic<bool> g_enabled{false};

}  // namespace

bool enabled() { return g_enabled.load(std::memory_order_relaxed); }

void enable() { g_enabled.store(true, std::memory_order_relaxed); }

void begin_step(int device, cudaStream_t stream) {
  if (!enabled()) return;
  std::lock_guard<std::mutex> lock(g_mu);
  Device& d = g_devices[device];
  recycle(d);
  if (d.ref == nullptr && cudaEventCreate(&d.ref) != cudaSuccess) {
    (void)cudaGetLastError();
    d.ref = nullptr;
    return;
  }
  d.host_ref = Clock::now();
  (void)cudaEventRecord(d.ref, stream);
  d.in_step = true;
}

Span open(int device, cudaStream_t stream) {
  Span s;
  if (!enabled()) return s;
  std::lock_guard<std::mutex> lock(g_mu);
  Device& d = g_devices[device];
  if (!d.in_step) return s;
  s.start = take_event(d);
  if (s.start != nullptr) (void)cudaEventRecord(s.start, stream);
  s.host_us = since(d);
  return s;
}

void close(int device, const Span& span, cudaStream_t stream, const char* name, const char* lane) {
  if (!span.active()) return;
  std::lock_guard<std::mutex> lock(g_mu);
  Device& d = g_devices[device];
  if (!d.in_step) {
    d.free_events.push_back(span.start);
    return;
  }
  cudaEvent_t end = take_event(d);
  if (end != nullptr) (void)cudaEventRecord(end, stream);
  d.entries.push_back({name, lane, span.host_us, since(d), span.start, end});
}

double host_now_us(int device) {
  if (!enabled()) return 0;
  std::lock_guard<std::mutex> lock(g_mu);
  return since(g_devices[device]);
}

void host_span(int device, double begin_us, const char* name, const char* lane) {
  if (!enabled()) return;
  std::lock_guard<std::mutex> lock(g_mu);
  Device& d = g_devices[device];
  if (!d.in_step) return;
  d.entries.push_back({name, lane, begin_us, since(d), nullptr, nullptr});
}

void end_step(int device) {
  if (!enabled()) return;
  std::lock_guard<std::mutex> lock(g_mu);
  Device& d = g_devices[device];
  if (!d.in_step) return;
  d.in_step = false;
  std::string text;
  char line[256];
  std::snprintf(line, sizeof line, "  %-34s %-6s %9s %8s %9s %9s %8s\n", "call", "lane", "host us", "+us", "gpu from",
                "gpu to", "gpu us");
  text += line;
  for (const Entry& e : d.entries) {
    float a = -1, b = -1;
    if (e.start != nullptr && e.end != nullptr) {
      if (cudaEventElapsedTime(&a, d.ref, e.start) != cudaSuccess) a = -1;
      if (cudaEventElapsedTime(&b, d.ref, e.end) != cudaSuccess) b = -1;
      (void)cudaGetLastError();
    }
    if (a >= 0 && b >= 0) {
      std::snprintf(line, sizeof line, "  %-34s %-6s %9.1f %8.1f %9.1f %9.1f %8.1f\n", e.name, e.lane, e.host_us,
                    e.host_end_us - e.host_us, 1000.0 * a, 1000.0 * b, 1000.0 * (b - a));
    } else {
      std::snprintf(line, sizeof line, "  %-34s %-6s %9.1f %8.1f\n", e.name, e.lane, e.host_us,
                    e.host_end_us - e.host_us);
    }
    text += line;
  }
  std::snprintf(line, sizeof line, "  (step ended on the host at %.1f us)\n", since(d));
  text += line;
  d.last = text;
  recycle(d);
}

void print_last(int device) {
  if (!enabled()) return;
  std::lock_guard<std::mutex> lock(g_mu);
  Device& d = g_devices[device];
  if (d.last.empty()) return;
  std::fprintf(stderr, "dsacp timeline of the last step on GPU %d:\n%s", device, d.last.c_str());
}

}  // namespace dsacp::cuda::timeline
