// Lightning indexer scores and exact canonical top-k on the CPU.
//
// Determinism: the score of (token t, key j) is computed by one fixed sequence of fp32 operations that depends
// only on q[t], w[t] and k[j]: each dot q[t,h,:].k[j,:] sums d = 0..Di-1 in order, then the heads are added in
// order h = 0..Hi-1 as s += w[t,h] * relu(dot). Tiling (which keys share a tile, which tokens share a group,
// how the work is split over threads) never changes that sequence, so the scores, and hence the top-k rows,
// are bit-identical across thread counts and across CP layouts that split tokens or keys differently.
// FP8 (e4m3 q and keys): the same order, with the contract's s += w[t,h] * relu((q_scale[t,h] * sk[j]) * dot).
//
// Layout of the work: tokens are processed in chunks (bounded score buffer); inside a chunk, consecutive
// tokens of one request form groups that share transposed key tiles, and each group's key range is cut into
// blocks, so a single decode token with a long context is still split over threads. Top-k then runs per token.
#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/parallel.h"
#include "kernels/cpu/cpu_kernels.h"

namespace dsacp::cpu {
namespace {

constexpr int kTileKeys = 32;  // keys per transposed tile: the vectorized inner dimension (8 SSE accumulators)
// Heads computed together against one tile. Measured with GCC 12 -O3 (SSE2 only): 1 head x 32 keys runs ~2.5x
// faster than 2 x 16 or 4 x 8, which GCC vectorizes poorly.
constexpr int kHeadBlock = 1;
constexpr int kGroupTokens = 8;                     // tokens of one request sharing each key tile
constexpr int64_t kKeyBlock = 1024;                 // keys per work item
constexpr int64_t kScoreBudget = int64_t{1} << 24;  // floats of scores held per chunk (64 MiB)
constexpr int64_t kQueryBudget = int64_t{1} << 23;  // floats of converted bf16 queries per chunk (32 MiB)

// out[m][j] = sum_d q[m, d] * kt[d, j] for MR heads and one tile, d ascending (the fixed order). The sums
// live in a local array (not behind the out pointer, which could alias q or kt) so they stay in registers.
template <int MR>
inline void dot_tile(const float* __restrict q, int64_t di, const float* __restrict kt, float out[][kTileKeys]) {
  float acc[MR][kTileKeys] = {};
  for (int64_t d = 0; d < di; ++d) {
    const float* kd = kt + d * kTileKeys;
    for (int m = 0; m < MR; ++m) {
      const float qv = q[m * di + d];
      for (int j = 0; j < kTileKeys; ++j) acc[m][j] += qv * kd[j];
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < kTileKeys; ++j) out[m][j] = acc[m][j];
  }
}

// s[j] = sum_h w[h] * relu(q[h, :] . kt[:, j]) for the kTileKeys keys of one tile.
void score_tile(const float* q, const float* w, int32_t hi, int64_t di, const float* kt, float* s) {
  float acc[kHeadBlock][kTileKeys];
  for (int j = 0; j < kTileKeys; ++j) s[j] = 0.f;
  int32_t h = 0;
  for (; h + kHeadBlock <= hi; h += kHeadBlock) {
    dot_tile<kHeadBlock>(q + h * di, di, kt, acc);
    for (int m = 0; m < kHeadBlock; ++m) {
      const float wh = w[h + m];
      for (int j = 0; j < kTileKeys; ++j) s[j] += wh * std::max(acc[m][j], 0.f);
    }
  }
  for (; h < hi; ++h) {
    dot_tile<1>(q + h * di, di, kt, acc);
    const float wh = w[h];
    for (int j = 0; j < kTileKeys; ++j) s[j] += wh * std::max(acc[0][j], 0.f);
  }
}

// The FP8 score (contract section 6) of the kTileKeys keys of one tile: q and kt hold the exact e4m3 values, so
// each product is exact in f32 and the d-ordered sum is the f32 dot of the contract; then
// s[j] += w[h] * relu((q_scale[h] * sk[j]) * dot), heads in order.
void score_tile_fp8(const float* q, const float* w, const float* q_scale, int32_t hi, int64_t di, const float* kt,
                    const float* sk, float* s) {
  float acc[1][kTileKeys];
  for (int j = 0; j < kTileKeys; ++j) s[j] = 0.f;
  for (int32_t h = 0; h < hi; ++h) {
    dot_tile<1>(q + h * di, di, kt, acc);
    const float wh = w[h], qs = q_scale[h];
    for (int j = 0; j < kTileKeys; ++j) s[j] += wh * std::max((qs * sk[j]) * acc[0][j], 0.f);
  }
}

// Key position j of request b from an FP8 pool: its exact e4m3 values (as f32) and its scale.
void load_fp8_key(const PagedPoolView& keys, const BlockTableView& bt, int32_t b, int64_t j, float* values,
                  float* scale) {
  const int64_t page = bt.data[static_cast<int64_t>(b) * bt.max_pages + j / keys.page_size];
  const int32_t off = static_cast<int32_t>(j % keys.page_size);
  const uint8_t* base = static_cast<const uint8_t*>(keys.data);
  const int64_t stride = pool_page_stride(keys);
  const uint8_t* v = base + fp8_index_value_offset(page, off, keys.page_size, keys.dim, stride);
  for (int32_t d = 0; d < keys.dim; ++d) values[d] = e4m3_to_f32(v[d]);
  std::memcpy(scale, base + fp8_index_scale_offset(page, off, keys.page_size, keys.dim, stride), sizeof(float));
}

// Canonical top-k row from n scores: K best by rank_key, ascending positions, -1 padded. With row_scores,
// also the chosen entries' scores (-inf after the last one).
void select_topk(const float* scores, int32_t n, int32_t k, int32_t* row, float* row_scores,
                 std::vector<uint64_t>& keys) {
  int32_t chosen = n;
  if (n <= k) {
    for (int32_t j = 0; j < n; ++j) row[j] = j;
    for (int32_t j = n; j < k; ++j) row[j] = -1;
  } else {
    keys.resize(static_cast<size_t>(n));
    for (int32_t j = 0; j < n; ++j) keys[j] = topk_rank_key(scores[j], j);
    std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(), std::greater<uint64_t>());
    for (int32_t i = 0; i < k; ++i) row[i] = topk_rank_key_position(keys[i]);
    std::sort(row, row + k);
    chosen = k;
  }
  if (row_scores != nullptr) {
    for (int32_t i = 0; i < chosen; ++i) row_scores[i] = scores[row[i]];
    for (int32_t i = chosen; i < k; ++i) row_scores[i] = -std::numeric_limits<float>::infinity();
  }
}

struct Group {
  int64_t t0, t1;   // tokens [t0, t1) of the chunk, one request
  int32_t max_len;  // longest key_len in the group
};

struct WorkItem {
  int32_t group;
  int32_t k0, k1;  // key positions [k0, k1)
};

}  // namespace

Status indexer_topk(const IndexerTopkParams& p, int num_threads) {
  const QueryRowsView& rows = p.rows;
  const int32_t hi = p.Hi;
  const int64_t di = p.Di;
  const int64_t q_row = hi * di;
  const bool fp8 = p.keys.dtype == DType::kF8E4M3;  // with e4m3 q (validated)
  {
    std::vector<int32_t> checked(static_cast<size_t>(p.block_table.num_requests), 0);
    for (int64_t t = 0; t < rows.num_tokens; ++t) {
      DSACP_RETURN_IF_ERROR(
          check_token_keys("indexer_topk", rows, t, p.block_table, p.keys.page_size, p.keys.num_pages, checked.data()));
    }
  }

  std::vector<float> scores;
  std::vector<int64_t> score_offset;
  std::vector<float> q_f32;
  std::vector<Group> groups;
  std::vector<WorkItem> items;
  const int64_t max_chunk_tokens = std::max<int64_t>(1, kQueryBudget / q_row);

  for (int64_t c0 = 0; c0 < rows.num_tokens;) {
    // Chunk [c0, c1): bounded scores and converted queries, at least one token.
    int64_t c1 = c0, total = 0;
    score_offset.clear();
    while (c1 < rows.num_tokens && c1 - c0 < max_chunk_tokens) {
      const int64_t len = rows.key_len[c1];
      if (c1 > c0 && total + len > kScoreBudget) break;
      score_offset.push_back(total);
      total += len;
      ++c1;
    }
    scores.resize(static_cast<size_t>(total));
    const float* q_chunk = p.q_dtype == DType::kF32 ? static_cast<const float*>(p.q) + c0 * q_row : nullptr;
    if (p.q_dtype == DType::kBF16) {
      q_f32.resize(static_cast<size_t>((c1 - c0) * q_row));
      parallel_for(c1 - c0, num_threads, 16, [&](int64_t b, int64_t e) {
        load_row_f32(p.q, DType::kBF16, (c0 + b) * q_row, (e - b) * q_row, q_f32.data() + b * q_row);
      });
      q_chunk = q_f32.data();
    } else if (fp8) {  // the exact e4m3 values
      q_f32.resize(static_cast<size_t>((c1 - c0) * q_row));
      const uint8_t* q8 = static_cast<const uint8_t*>(p.q) + c0 * q_row;
      for (int64_t i = 0; i < (c1 - c0) * q_row; ++i) q_f32[static_cast<size_t>(i)] = e4m3_to_f32(q8[i]);
      q_chunk = q_f32.data();
    }

    groups.clear();
    items.clear();
    for (int64_t t = c0; t < c1;) {
      Group g{t - c0, t - c0, 0};
      const int32_t b = rows.request[t];
      while (t < c1 && rows.request[t] == b && g.t1 - g.t0 < kGroupTokens) {
        g.max_len = std::max(g.max_len, rows.key_len[t]);
        ++g.t1;
        ++t;
      }
      for (int64_t k0 = 0; k0 < g.max_len; k0 += kKeyBlock) {
        items.push_back({static_cast<int32_t>(groups.size()), static_cast<int32_t>(k0),
                         static_cast<int32_t>(std::min<int64_t>(g.max_len, k0 + kKeyBlock))});
      }
      groups.push_back(g);
    }

    parallel_for(static_cast<int64_t>(items.size()), num_threads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> kt(static_cast<size_t>(di * kTileKeys));
      std::vector<float> key_row(static_cast<size_t>(di));
      float s[kTileKeys];
      float sk[kTileKeys];
      for (int64_t it = begin; it < end; ++it) {
        const WorkItem& item = items[it];
        const Group& g = groups[item.group];
        const int32_t b = rows.request[c0 + g.t0];
        for (int32_t j0 = item.k0; j0 < item.k1; j0 += kTileKeys) {
          const int32_t nvalid = std::min(kTileKeys, item.k1 - j0);
          // Transposed tile kt[d, jj]; keys past the group's range are zeros (never read from the pool).
          for (int32_t jj = 0; jj < kTileKeys; ++jj) {
            if (jj < nvalid) {
              if (fp8) {
                load_fp8_key(p.keys, p.block_table, b, j0 + jj, key_row.data(), &sk[jj]);
              } else {
                load_row_f32(p.keys.data, p.keys.dtype,
                             pool_row_offset(p.keys, key_row_offset(p.block_table, b, j0 + jj, p.keys.page_size, 1)),
                             di, key_row.data());
              }
              for (int64_t d = 0; d < di; ++d) kt[d * kTileKeys + jj] = key_row[d];
            } else {
              for (int64_t d = 0; d < di; ++d) kt[d * kTileKeys + jj] = 0.f;
              sk[jj] = 0.f;
            }
          }
          for (int64_t lt = g.t0; lt < g.t1; ++lt) {
            const int32_t len = rows.key_len[c0 + lt];
            if (len <= j0) continue;
            if (fp8) {
              score_tile_fp8(q_chunk + lt * q_row, p.w + (c0 + lt) * hi, p.q_scale + (c0 + lt) * hi, hi, di, kt.data(),
                             sk, s);
            } else {
              score_tile(q_chunk + lt * q_row, p.w + (c0 + lt) * hi, hi, di, kt.data(), s);
            }
            const int32_t n = std::min(kTileKeys, len - j0);
            std::memcpy(scores.data() + score_offset[lt] + j0, s, static_cast<size_t>(n) * sizeof(float));
          }
        }
      }
    });

    parallel_for(c1 - c0, num_threads, 1, [&](int64_t begin, int64_t end) {
      std::vector<uint64_t> keys;
      for (int64_t lt = begin; lt < end; ++lt) {
        float* row_scores = p.topk_scores == nullptr ? nullptr : p.topk_scores + (c0 + lt) * p.K;
        select_topk(scores.data() + score_offset[lt], rows.key_len[c0 + lt], p.K, p.topk + (c0 + lt) * p.K, row_scores,
                    keys);
      }
    });
    c0 = c1;
  }
  return Status::ok_status();
}

}  // namespace dsacp::cpu
