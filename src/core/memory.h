// Host memory: how much a process may still take, and the check made before a large allocation, so that a
// request for too much is refused at once with one line instead of ending in the kernel's out-of-memory killer.
#pragma once

#include <cstdint>
#include <string>

#include "dsacp/status.h"

namespace dsacp {

// The bytes this process can still allocate on the host: the smallest of /proc/meminfo's MemAvailable, the
// cgroup's memory.max - memory.current (cgroup v2) and RLIMIT_AS - the process's current virtual size.
// UINT64_MAX when none of them is known. `source` (optional) names the bound that won.
uint64_t host_memory_available(std::string* source = nullptr);

// "1.5 GiB", "12.0 MiB", "512 bytes".
std::string bytes_string(uint64_t bytes);

// OK when `bytes` fit in what is available and in `max_bytes` (0: no cap of the caller's); else
// resource_exhausted "<what> needs about 23.4 GiB of host memory, 11.2 GiB available (MemAvailable)".
Status host_memory_check(uint64_t bytes, const std::string& what, uint64_t max_bytes = 0);

}  // namespace dsacp
