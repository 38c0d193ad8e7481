// The serving options' kernels on the host (the CPU backend's, and every backend's default through host
// copies): a caller's precomputed top-k checked and copied, and the step's outputs in the requested forms
// (global-slot top-k, base-2 LSE).
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "dsacp/backend.h"
#include "kernels/cpu/cpu_kernels.h"

namespace dsacp {
namespace cpu {

Status topk_input(const TopkInputParams& p) {
  for (int64_t t = 0; t < p.num_rows; ++t) {
    const int32_t* row = p.topk + t * p.K;
    const int32_t len = p.key_len[t];
    int32_t prev = -1;
    bool ended = false;
    for (int32_t i = 0; i < p.K; ++i) {
      const int32_t e = row[i];
      const std::string at = "precomputed top-k: row " + std::to_string(t) + " entry " + std::to_string(i) + " = " +
                             std::to_string(e);
      if (e == -1) {
        ended = true;
        continue;
      }
      if (ended) return invalid_argument(at + " after a -1 (positions come first, then -1 to the end)");
      if (e < 0 || e >= len) {
        return invalid_argument(at + " is outside the row's visible keys [0, " + std::to_string(len) + ")");
      }
      if (e <= prev) {
        return invalid_argument(at + " does not follow " + std::to_string(prev) +
                                " (positions ascending and distinct)");
      }
      prev = e;
    }
  }
  std::memcpy(p.out, p.topk, static_cast<size_t>(p.num_rows * p.K) * sizeof(int32_t));
  return Status::ok_status();
}

Status output_form(const OutputFormParams& p) {
  if (p.slots != nullptr) {
    const int64_t Pt = p.Pt, I = p.I, B = p.page_size;
    for (int64_t t = 0; t < p.num_rows; ++t) {
      const int32_t b = p.request[t];
      const int32_t* row = p.topk + t * p.K;
      int32_t* dst = p.slots + t * p.K;
      for (int32_t i = 0; i < p.K; ++i) {
        const int64_t e = row[i];
        if (e < 0) {
          dst[i] = -1;
          continue;
        }
        const int64_t l = (e / (Pt * I)) * I + e % I;
        const int64_t column = l / B;
        if (b < 0 || b >= p.block_table.num_requests || column >= p.block_table.max_pages) {
          return out_of_range("top-k slots: row " + std::to_string(t) + " position " + std::to_string(e) +
                              " has no block table entry (request " + std::to_string(b) + ", page column " +
                              std::to_string(column) + " of " + std::to_string(p.block_table.max_pages) + ")");
        }
        const int64_t page = p.block_table.data[static_cast<int64_t>(b) * p.block_table.max_pages + column];
        if (page < 0 || page >= p.num_pages) {
          return out_of_range("top-k slots: row " + std::to_string(t) + " position " + std::to_string(e) +
                              " is on page " + std::to_string(page) + ", outside [0, " + std::to_string(p.num_pages) +
                              ")");
        }
        dst[i] = static_cast<int32_t>(page * B + l % B);
      }
    }
  }
  if (p.lse != nullptr) {
    for (int64_t i = 0; i < p.lse_count; ++i) p.lse[i] *= kLog2E;
  }
  return Status::ok_status();
}

}  // namespace cpu

// The defaults: the host reference on host copies of the inputs.
Status Backend::topk_input(const TopkInputParams& p) {
  const size_t n = static_cast<size_t>(p.num_rows * p.K);
  std::vector<int32_t> key_len(static_cast<size_t>(p.num_rows)), topk(n);
  DSACP_RETURN_IF_ERROR(copy_to_host(key_len.data(), p.key_len, key_len.size() * sizeof(int32_t)));
  DSACP_RETURN_IF_ERROR(copy_to_host(topk.data(), p.topk, n * sizeof(int32_t)));
  std::vector<int32_t> out(n);
  TopkInputParams h = p;
  h.key_len = key_len.data();
  h.topk = topk.data();
  h.out = out.data();
  DSACP_RETURN_IF_ERROR(cpu::topk_input(h));
  return copy_to_device(p.out, out.data(), n * sizeof(int32_t));
}

Status Backend::output_form(const OutputFormParams& p) {
  const size_t n = p.slots != nullptr ? static_cast<size_t>(p.num_rows * p.K) : 0;
  const size_t rows = p.slots != nullptr ? static_cast<size_t>(p.num_rows) : 0;
  const size_t table = p.slots != nullptr ? static_cast<size_t>(p.block_table.num_requests) * p.block_table.max_pages : 0;
  std::vector<int32_t> topk(n), request(rows), table_data(table), slots(n);
  std::vector<float> lse(p.lse != nullptr ? static_cast<size_t>(p.lse_count) : 0);
  OutputFormParams h = p;
  if (p.slots != nullptr) {
    DSACP_RETURN_IF_ERROR(copy_to_host(topk.data(), p.topk, n * sizeof(int32_t)));
    DSACP_RETURN_IF_ERROR(copy_to_host(request.data(), p.request, rows * sizeof(int32_t)));
    DSACP_RETURN_IF_ERROR(copy_to_host(table_data.data(), p.block_table.data, table * sizeof(int32_t)));
    h.topk = topk.data();
    h.request = request.data();
    h.block_table.data = table_data.data();
    h.slots = slots.data();
  }
  if (p.lse != nullptr) {
    DSACP_RETURN_IF_ERROR(copy_to_host(lse.data(), p.lse, lse.size() * sizeof(float)));
    h.lse = lse.data();
  }
  DSACP_RETURN_IF_ERROR(cpu::output_form(h));
  if (p.slots != nullptr) DSACP_RETURN_IF_ERROR(copy_to_device(p.slots, slots.data(), n * sizeof(int32_t)));
  if (p.lse != nullptr) DSACP_RETURN_IF_ERROR(copy_to_device(p.lse, lse.data(), lse.size() * sizeof(float)));
  return Status::ok_status();
}

}  // namespace dsacp
