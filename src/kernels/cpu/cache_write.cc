// cache_write: scatter rows into flat pool slots, converting f32 <-> bf16 (round to nearest even), or quantizing
// into an FP8 pool's two-plane pages (contract section 6).
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "core/parallel.h"
#include "kernels/cpu/cpu_kernels.h"

namespace dsacp::cpu {
namespace {

// Into an FP8 pool (two-plane pages, dsacp/fp8.h): e4m3 rows as they are with their scales, f32/bf16 rows
// quantized with the per-row scale of p.fp8_scale_mode. `row` is scratch of dim floats.
void write_fp8_row(const CacheWriteParams& p, int64_t t, int64_t slot, std::vector<float>& row) {
  const int32_t dim = p.pool.dim, ps = p.pool.page_size;
  uint8_t* base = static_cast<uint8_t*>(p.pool.data);
  const int64_t stride = pool_page_stride(p.pool);
  uint8_t* values = base + fp8_index_value_offset(slot / ps, static_cast<int32_t>(slot % ps), ps, dim, stride);
  float scale;
  if (p.rows_dtype == DType::kF8E4M3) {
    std::memcpy(values, static_cast<const uint8_t*>(p.rows) + t * dim, static_cast<size_t>(dim));
    scale = p.row_scales[t];
  } else {
    row.resize(static_cast<size_t>(dim));
    load_row_f32(p.rows, p.rows_dtype, t * dim, dim, row.data());
    float amax = 0.f;
    for (float x : row) amax = std::max(amax, fp8_amax_term(x));
    scale = fp8_scale_from_amax(amax, p.fp8_scale_mode);
    for (int32_t d = 0; d < dim; ++d) values[d] = fp8_quantize(row[static_cast<size_t>(d)], scale);
  }
  std::memcpy(base + fp8_index_scale_offset(slot / ps, static_cast<int32_t>(slot % ps), ps, dim, stride), &scale,
              sizeof scale);
}

// Into a view of fp8_ds_mla records (dsacp/fp8.h). The latent view: e4m3 rows as they are with their tiles'
// scales (row_scales[t, dim / 128]), f32/bf16 rows quantized per 128-value tile with p.record_scale_mode; the
// rope view: bf16 values (rounded from f32 rows).
void write_record_part(const CacheWriteParams& p, int64_t t, int64_t slot, std::vector<float>& row) {
  const int32_t dim = p.pool.dim;
  uint8_t* dst = static_cast<uint8_t*>(p.pool.data) + record_part_offset(p.pool, slot);
  if (p.pool.dtype == DType::kBF16) {
    if (p.rows_dtype == DType::kBF16) {
      std::memcpy(dst, static_cast<const uint8_t*>(p.rows) + t * dim * 2, static_cast<size_t>(dim) * 2);
      return;
    }
    for (int32_t d = 0; d < dim; ++d) {
      const bf16 v = f32_to_bf16(static_cast<const float*>(p.rows)[t * dim + d]);
      std::memcpy(dst + 2 * d, &v, 2);
    }
    return;
  }
  const int32_t tiles = dim / kFp8DsMlaTile;
  uint8_t* scales = dst + fp8_ds_mla_scale_offset(dim);
  if (p.rows_dtype == DType::kF8E4M3) {
    std::memcpy(dst, static_cast<const uint8_t*>(p.rows) + t * dim, static_cast<size_t>(dim));
    std::memcpy(scales, p.row_scales + t * tiles, static_cast<size_t>(tiles) * 4);
    return;
  }
  row.resize(static_cast<size_t>(dim));
  load_row_f32(p.rows, p.rows_dtype, t * dim, dim, row.data());
  for (int32_t g = 0; g < tiles; ++g) {
    const float* x = row.data() + g * kFp8DsMlaTile;
    float amax = 0.f;
    for (int32_t i = 0; i < kFp8DsMlaTile; ++i) amax = std::max(amax, fp8_amax_term(x[i]));
    const float scale = fp8_scale_from_amax(amax, p.record_scale_mode);
    for (int32_t i = 0; i < kFp8DsMlaTile; ++i) dst[g * kFp8DsMlaTile + i] = fp8_quantize(x[i], scale);
    std::memcpy(scales + 4 * g, &scale, 4);
  }
}

void write_row(const CacheWriteParams& p, int64_t t, std::vector<float>& scratch) {
  const int64_t slot = p.slots[t];
  if (slot < 0) return;  // -1: skipped row (checked before)
  if (p.pool.records()) return write_record_part(p, t, slot, scratch);
  if (p.pool.dtype == DType::kF8E4M3) return write_fp8_row(p, t, slot, scratch);
  const int64_t dim = p.pool.dim;
  const int64_t src = t * dim;
  const int64_t dst = pool_row_offset(p.pool, slot);  // slot = page * page_size + offset
  if (p.rows_dtype == p.pool.dtype) {
    const size_t esz = dtype_size(p.rows_dtype);
    std::memcpy(static_cast<char*>(p.pool.data) + dst * esz, static_cast<const char*>(p.rows) + src * esz,
                static_cast<size_t>(dim) * esz);
    return;
  }
  for (int64_t d = 0; d < dim; ++d) {
    store_from_f32(p.pool.data, p.pool.dtype, dst + d, load_as_f32(p.rows, p.rows_dtype, src + d));
  }
}

}  // namespace

Status cache_write(const CacheWriteParams& p, int num_threads) {
  const int64_t num_slots = p.pool.num_pages * p.pool.page_size;
  std::vector<int64_t> used;
  used.reserve(static_cast<size_t>(p.num_rows));
  for (int64_t t = 0; t < p.num_rows; ++t) {
    const int64_t slot = p.slots[t];
    if (slot == -1) continue;
    if (slot < 0 || slot >= num_slots) {
      return out_of_range("cache_write: row " + std::to_string(t) + ": slot " + std::to_string(slot) +
                          " outside [0, num_pages*page_size=" + std::to_string(num_slots) + ") (and not -1)");
    }
    if (p.rows_dtype == DType::kF8E4M3 && p.pool.records()) {
      const int32_t tiles = p.pool.dim / kFp8DsMlaTile;
      for (int32_t g = 0; g < tiles; ++g) {
        const float sc = p.row_scales[t * tiles + g];
        if (!fp8_scale_ok(sc)) {
          return invalid_argument("cache_write: row_scales[" + std::to_string(t) + ", " + std::to_string(g) +
                                  "] = " + std::to_string(sc) + " must be positive and finite (the scale of tile " +
                                  std::to_string(g) + " of e4m3 latent row " + std::to_string(t) + ")");
        }
      }
    } else if (p.rows_dtype == DType::kF8E4M3 && !fp8_scale_ok(p.row_scales[t])) {
      return invalid_argument("cache_write: row_scales[" + std::to_string(t) + "] = " +
                              std::to_string(p.row_scales[t]) +
                              " must be positive and finite (the scale of e4m3 row " + std::to_string(t) + ")");
    }
    used.push_back(slot);
  }
  // Two rows aimed at one slot would race; then run in row order so the last row wins, deterministically.
  std::sort(used.begin(), used.end());
  const bool has_duplicates = std::adjacent_find(used.begin(), used.end()) != used.end();
  parallel_for(p.num_rows, has_duplicates ? 1 : num_threads, 256, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t t = begin; t < end; ++t) write_row(p, t, scratch);
  });
  return Status::ok_status();
}

}  // namespace dsacp::cpu
