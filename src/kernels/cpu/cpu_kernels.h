// The CPU backend's kernels (the oracle). Each takes already-validated parameters (see validate.cc) and
// checks what depends on tensor contents (request ids, key lengths, page ids, slots) before computing, so a
// bad index comes back as a Status and the threaded part can never fail or read out of bounds.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "dsacp/kernel_params.h"
#include "dsacp/status.h"

namespace dsacp::cpu {

Status cache_write(const CacheWriteParams& p, int num_threads);
Status indexer_topk(const IndexerTopkParams& p, int num_threads);
Status sparse_mla(const SparseMlaParams& p, int num_threads);
Status lse_merge(const LseMergeParams& p, int num_threads);
Status gather_rows(const GatherRowsParams& p, int num_threads);
Status topk_remap(const TopkRemapParams& p, int num_threads);
Status topk_merge(const TopkMergeParams& p, int num_threads);
Status topk_input(const TopkInputParams& p);
Status output_form(const OutputFormParams& p);

// Order key of a top-k candidate: larger = better. Score first (NaN below every number, -0 == +0), then the
// lower position wins a tie. Distinct positions give distinct keys, so the order is strict and total.
inline uint64_t topk_rank_key(float score, int32_t position) {
  uint32_t u;
  if (score != score) {
    u = 0;  // NaN ranks below everything, -inf included
  } else {
    if (score == 0.f) score = 0.f;
    std::memcpy(&u, &score, sizeof u);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    if (u == 0) u = 1;
  }
  return (static_cast<uint64_t>(u) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(position));
}
inline int32_t topk_rank_key_position(uint64_t key) {
  return static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(key));
}

// Checks that token t's request row and its first key_len keys are addressable through the block table:
// request in [0, num_requests), key_len in [0, max_pages * page_size], and every page id the keys use in
// [0, num_pages). `checked_pages[b]` remembers how many leading pages of request b are already known good,
// so a batch of tokens of one request costs one pass over its pages.
Status check_token_keys(const char* kernel, const QueryRowsView& rows, int64_t t, const BlockTableView& bt,
                        int32_t page_size, int64_t num_pages, int32_t* checked_pages);

// Element offset of key position j of request b's row in a pool of row width dim (after check_token_keys).
inline int64_t key_row_offset(const BlockTableView& bt, int32_t b, int64_t j, int32_t page_size, int32_t dim) {
  const int64_t page = bt.data[static_cast<int64_t>(b) * bt.max_pages + j / page_size];
  return (page * page_size + j % page_size) * dim;
}

// Converts n elements of a f32 or bf16 buffer, starting at element offset, to f32.
void load_row_f32(const void* data, DType dtype, int64_t offset, int64_t n, float* dst);

}  // namespace dsacp::cpu
