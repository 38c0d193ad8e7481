// Host-includable. Data-dependent errors found inside kernels (a page id out of range, a bad request row, a bad slot).
// Kernels record the first one in a small device word pair; the backend reads it after the launch and turns it
// into a Status. Kernels never trap: a bad entry is treated as absent (zero row / skipped) and reported.
#pragma once

#include <cstdint>

namespace dsacp::cuda {

enum DeviceErrorCode : int32_t {
  kDevOk = 0,
  kDevBadRequest = 1,   // rows.request[t] outside [0, num_requests)
  kDevBadKeyLen = 2,    // rows.key_len[t] < 0 or > max_pages * page_size
  kDevBadPage = 3,      // a page id the kernel needs is outside [0, num_pages) (or past max_pages)
  kDevBadSlot = 4,      // cache_write slot outside [0, num_pages * page_size) and not -1
  kDevBadIndex = 5,     // gather_rows index outside [-1, src_rows)
  kDevBadEntry = 6,     // topk_remap entry < -1
  kDevSmemAlign = 7,    // a kernel's dynamic shared memory did not start 1024-byte aligned (nothing computed)
  kDevBadTopkRow = 8,   // a precomputed top-k row not in canonical form (TopkInputParams)
};

// word[0] = first error code, word[1] = the row (token or cache row) it was found at.
struct DeviceErrorWord {
  int32_t* word = nullptr;  // [2] device memory, zero = no error
};

}  // namespace dsacp::cuda
