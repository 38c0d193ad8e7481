#include "core/memory.h"

#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

namespace dsacp {
namespace {

constexpr uint64_t kUnknown = std::numeric_limits<uint64_t>::max();

// The value in kB of `key` ("MemAvailable:", "VmSize:") in a /proc file, in bytes; kUnknown if absent.
uint64_t proc_kb(const char* file, const char* key) {
  std::ifstream in(file);
  std::string line;
  const size_t n = std::strlen(key);
  while (std::getline(in, line)) {
    if (line.compare(0, n, key) != 0) continue;
    std::istringstream fields(line.substr(n));
    uint64_t kb = 0;
    if (fields >> kb) return kb * 1024;
  }
  return kUnknown;
}

// A cgroup v2 file holding one number ("max" = no limit).
uint64_t cgroup_value(const std::string& file) {
  std::ifstream in(file);
  std::string v;
  if (!(in >> v) || v == "max") return kUnknown;
  uint64_t x = 0;
  for (char ch : v) {
    if (ch < '0' || ch > '9') return kUnknown;
    x = x * 10 + static_cast<uint64_t>(ch - '0');
  }
  return x;
}

// The process's cgroup v2 directory ("0::/path" in /proc/self/cgroup).
std::string cgroup_dir() {
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("0::", 0) == 0) return "/sys/fs/cgroup" + line.substr(3);
  }
  return "";
}

}  // namespace

uint64_t host_memory_available(std::string* source) {
  uint64_t best = kUnknown;
  std::string why;
  auto consider = [&](uint64_t v, const char* name) {
    if (v < best) {
      best = v;
      why = name;
    }
  };
  // A MemAvailable of 0 is no reading (a VM whose memory grows on demand reports it so while this process runs):
  // it is ignored rather than refusing every allocation.
  const uint64_t available = proc_kb("/proc/meminfo", "MemAvailable:");
  if (available != 0) consider(available, "MemAvailable");
  const std::string dir = cgroup_dir();
  if (!dir.empty()) {
    const uint64_t max = cgroup_value(dir + "/memory.max");
    const uint64_t cur = cgroup_value(dir + "/memory.current");
    if (max != kUnknown && cur != kUnknown) consider(max > cur ? max - cur : 0, "the cgroup's memory.max");
  }
  struct rlimit as {};
  if (getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY) {
    const uint64_t used = proc_kb("/proc/self/status", "VmSize:");
    const uint64_t lim = static_cast<uint64_t>(as.rlim_cur);
    if (used != kUnknown) consider(lim > used ? lim - used : 0, "the address-space limit (ulimit -v)");
  }
  if (source != nullptr) *source = why;
  return best;
}

std::string bytes_string(uint64_t bytes) {
  char buf[64];
  const double b = static_cast<double>(bytes);
  if (bytes >= (uint64_t{1} << 30)) {
    std::snprintf(buf, sizeof buf, "%.1f GiB", b / double(uint64_t{1} << 30));
  } else if (bytes >= (uint64_t{1} << 20)) {
    std::snprintf(buf, sizeof buf, "%.1f MiB", b / double(uint64_t{1} << 20));
  } else if (bytes >= 1024) {
    std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024.0);
  } else {
    std::snprintf(buf, sizeof buf, "%llu bytes", static_cast<unsigned long long>(bytes));
  }
  return buf;
}

Status host_memory_check(uint64_t bytes, const std::string& what, uint64_t max_bytes) {
  if (max_bytes > 0 && bytes > max_bytes) {
    return resource_exhausted(what + " needs about " + bytes_string(bytes) + " of host memory, more than the " +
                              bytes_string(max_bytes) + " allowed (--max-memory)");
  }
  std::string source;
  const uint64_t available = host_memory_available(&source);
  if (available != kUnknown && bytes > available) {
    return resource_exhausted(what + " needs about " + bytes_string(bytes) + " of host memory, " +
                              bytes_string(available) + " available (" + source + ")");
  }
  return Status();
}

}  // namespace dsacp
