// Cache write (scatter rows into flat pool slots, f32 <-> bf16 conversion with round-to-nearest-even) and fill.
// Into an FP8 pool (the indexer keys' two-plane pages, dsacp/fp8.h): f32/bf16 rows are quantized per row with the
// header's functions (amax over the row's finite |x|, the scale rule, x / scale -> e4m3), so the bytes equal the
// CPU oracle's; e4m3 rows are stored as they are with their row_scales. One warp per row.
// Into a view of fp8_ds_mla records (PagedPoolView::record_bytes): the latent view quantizes f32/bf16 rows per
// 128-value tile (amax by warp shuffle over each tile's finite |x|, the same fp8.h functions: the bytes are the
// CPU's), e4m3 rows are stored with their tiles' scales; the rope view stores bf16. A slot of -1 skips the row; any other slot outside the pool is reported and skipped.
// Two rows aimed at one slot race here (the CPU oracle lets the last row win); the step never produces them.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstring>

#include "dsacp/fp8.h"
#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/device_error.cuh"
#include "kernels/cuda/cuda_kernels.h"

namespace dsacp::cuda {
namespace {

__device__ __forceinline__ float load_f(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load_f(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void store_f(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store_f(__nv_bfloat16* p, int64_t i, float v) { p[i] = __float2bfloat16_rn(v); }

// Up to three pools of one launch (blockIdx.y picks one): CacheWriteParams' main pool and its `more` pools.
struct WritePools {
  const void* rows[3];
  const int64_t* slots[3];
  void* pool[3];
  int dim[3];
  int64_t stride[3];  // elements from one slot's row to the next
  int64_t page_pad[3];  // elements past each page's rows (a padded pool's page stride)
  int32_t page_size[3];
  int64_t num_slots[3];
};

// CacheWriteParams::upload carried in the launch's parameters: the grid stores the bytes at `device`, and a slot
// that lies there is read from the parameters (the grid's own stores are not ordered before its loads).
// (A launch without an upload passes the 16-byte variant: 3 KB of parameters cost the launch time.)
template <size_t kBytes>
struct UploadArgs {
  char* device;
  uint32_t bytes;
  alignas(16) char data[kBytes];
};
static_assert(sizeof(UploadArgs<kCacheWriteMaxUploadBytes>) + sizeof(WritePools) + 64 <= 4096,
              "cache write parameters past 4 KB");

template <size_t kBytes>
__device__ __forceinline__ int64_t load_slot(const int64_t* slots, int64_t t, const UploadArgs<kBytes>& up) {
  const char* at = reinterpret_cast<const char*>(slots + t);
  if (at >= up.device && at + sizeof(int64_t) <= up.device + up.bytes) {
    return *reinterpret_cast<const int64_t*>(up.data + (at - up.device));  // (8-byte aligned: slots are int64)
  }
  return slots[t];
}

template <size_t kBytes>
__device__ __forceinline__ void store_upload(const UploadArgs<kBytes>& up) {
  const int64_t threads = static_cast<int64_t>(gridDim.x) * gridDim.y * blockDim.x;
  const int64_t me = (static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t vecs = up.bytes / 16;
  for (int64_t i = me; i < vecs; i += threads) {
    reinterpret_cast<uint4*>(up.device)[i] = reinterpret_cast<const uint4*>(up.data)[i];
  }
  for (int64_t i = vecs * 16 + me; i < up.bytes; i += threads) up.device[i] = up.data[i];
}

template <typename SrcT, typename DstT, size_t kUploadBytes>
__global__ void cache_write_kernel(const WritePools w, int64_t n, DeviceErrorWord err,
                                   const __grid_constant__ UploadArgs<kUploadBytes> up) {
  if (up.bytes != 0) store_upload(up);
  const int y = blockIdx.y;
  const SrcT* __restrict__ rows = static_cast<const SrcT*>(w.rows[y]);
  DstT* __restrict__ pool = static_cast<DstT*>(w.pool[y]);
  const int dim = w.dim[y];
  const int64_t num_slots = w.num_slots[y];
  const int64_t t = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (t >= n) return;
  const int64_t slot = load_slot(w.slots[y], t, up);
  if (slot == -1) return;
  if (slot < 0 || slot >= num_slots) {
    if (lane == 0) report_device_error(err, kDevBadSlot, t);
    return;
  }
  const SrcT* src = rows + t * dim;
  DstT* dst = pool + slot * w.stride[y] + (w.page_pad[y] != 0 ? slot / w.page_size[y] * w.page_pad[y] : 0);
  for (int d = lane; d < dim; d += 32) store_f(dst, d, load_f(src, d));
}

// One row into an FP8 pool: warp-wide amax (max is exact in any order), then each value quantized alone.
template <typename SrcT>
__global__ void cache_write_fp8_kernel(const SrcT* __restrict__ rows, const float* __restrict__ row_scales,
                                       const int64_t* __restrict__ slots, unsigned char* __restrict__ pool,
                                       int32_t page_size, int64_t page_stride, int32_t dim, int64_t num_slots,
                                       int64_t n, Fp8ScaleMode mode, DeviceErrorWord err) {
  const int64_t t = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (t >= n) return;
  const int64_t slot = slots[t];
  if (slot == -1) return;
  if (slot < 0 || slot >= num_slots) {
    if (lane == 0) report_device_error(err, kDevBadSlot, t);
    return;
  }
  const int64_t page = slot / page_size;
  const int32_t in_page = static_cast<int32_t>(slot % page_size);
  unsigned char* dst = pool + fp8_index_value_offset(page, in_page, page_size, dim, page_stride);
  float* dst_scale =
      reinterpret_cast<float*>(pool + fp8_index_scale_offset(page, in_page, page_size, dim, page_stride));
  const SrcT* src = rows + t * dim;
  if constexpr (sizeof(SrcT) == 1) {
    for (int d = lane; d < dim; d += 32) dst[d] = src[d];
    if (lane == 0) *dst_scale = row_scales[t];
  } else {
    float amax = 0.f;
    for (int d = lane; d < dim; d += 32) amax = fmaxf(amax, fp8_amax_term(load_f(src, d)));
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    const float scale = fp8_scale_from_amax(amax, mode);
    for (int d = lane; d < dim; d += 32) dst[d] = fp8_quantize(load_f(src, d), scale);
    if (lane == 0) *dst_scale = scale;
  }
}

// One row into a view of fp8_ds_mla records. Latent (kRope false): lane l holds values 4l..4l+3 of each
// 128-value tile (coalesced 4-value loads), the tile's amax is a warp max, then each value quantized alone; the
// tile scales go after the values. Rope: bf16 values at the record's rope bytes.
template <typename SrcT, bool kRope>
__global__ void cache_write_record_kernel(const SrcT* __restrict__ rows, const float* __restrict__ row_scales,
                                          const int64_t* __restrict__ slots, unsigned char* __restrict__ pool,
                                          int32_t record_bytes, int32_t page_size, int64_t page_stride, int32_t dim,
                                          int64_t num_slots, int64_t n, Fp8ScaleMode mode, DeviceErrorWord err) {
  const int64_t t = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (t >= n) return;
  const int64_t slot = slots[t];
  if (slot == -1) return;
  if (slot < 0 || slot >= num_slots) {
    if (lane == 0) report_device_error(err, kDevBadSlot, t);
    return;
  }
  unsigned char* rec = pool + slot / page_size * page_stride + slot % page_size * record_bytes;
  const SrcT* src = rows + t * dim;
  if constexpr (kRope) {
    __nv_bfloat16* dst = reinterpret_cast<__nv_bfloat16*>(rec + record_bytes - 2 * dim);
    for (int d = lane; d < dim; d += 32) store_f(dst, d, load_f(src, d));
  } else {
    const int tiles = dim / kFp8DsMlaTile;
    float* scales = reinterpret_cast<float*>(rec + fp8_ds_mla_scale_offset(dim));
    if constexpr (sizeof(SrcT) == 1) {
      for (int d = lane; d < dim / 4; d += 32) {
        reinterpret_cast<uint32_t*>(rec)[d] = reinterpret_cast<const uint32_t*>(src)[d];
      }
      if (lane < tiles) scales[lane] = row_scales[t * tiles + lane];
    } else {
      for (int g = 0; g < tiles; ++g) {
        float x[4];
        float amax = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          x[i] = load_f(src, g * kFp8DsMlaTile + 4 * lane + i);
          amax = fmaxf(amax, fp8_amax_term(x[i]));
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
        const float scale = fp8_scale_from_amax(amax, mode);
        uint32_t packed = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) packed |= static_cast<uint32_t>(fp8_quantize(x[i], scale)) << (8 * i);
        reinterpret_cast<uint32_t*>(rec + g * kFp8DsMlaTile)[lane] = packed;
        if (lane == 0) scales[g] = scale;
      }
    }
  }
}

template <typename SrcT>
Status launch_cw_record(const CacheWriteParams& p, const LaunchContext& ctx) {
  const int64_t threads = p.num_rows * 32;
  const unsigned blocks = static_cast<unsigned>((threads + 255) / 256);
  const int64_t num_slots = p.pool.num_pages * p.pool.page_size;
  auto* pool = static_cast<unsigned char*>(p.pool.data);
  if constexpr (sizeof(SrcT) == 1) {
    if (p.pool.dtype == DType::kBF16) return internal_error("cache_write: e4m3 rows into a rope view");
  } else if (p.pool.dtype == DType::kBF16) {
    cache_write_record_kernel<SrcT, true><<<blocks, 256, 0, ctx.stream>>>(
        static_cast<const SrcT*>(p.rows), p.row_scales, p.slots, pool, p.pool.record_bytes, p.pool.page_size,
        pool_page_stride(p.pool), p.pool.dim, num_slots, p.num_rows, p.record_scale_mode, ctx.error);
  }
  if (p.pool.dtype != DType::kBF16) {
    cache_write_record_kernel<SrcT, false><<<blocks, 256, 0, ctx.stream>>>(
        static_cast<const SrcT*>(p.rows), p.row_scales, p.slots, pool, p.pool.record_bytes, p.pool.page_size,
        pool_page_stride(p.pool), p.pool.dim, num_slots, p.num_rows, p.record_scale_mode, ctx.error);
  }
  DSACP_CUDA_RETURN_IF_LAUNCH_ERROR("cache_write_record_kernel");
  return Status::ok_status();
}

template <typename SrcT>
Status launch_cw_fp8(const CacheWriteParams& p, const LaunchContext& ctx) {
  const int64_t threads = p.num_rows * 32;
  cache_write_fp8_kernel<SrcT><<<static_cast<unsigned>((threads + 255) / 256), 256, 0, ctx.stream>>>(
      static_cast<const SrcT*>(p.rows), p.row_scales, p.slots, static_cast<unsigned char*>(p.pool.data),
      p.pool.page_size, pool_page_stride(p.pool), p.pool.dim, p.pool.num_pages * p.pool.page_size, p.num_rows,
      p.fp8_scale_mode, ctx.error);
  DSACP_CUDA_RETURN_IF_LAUNCH_ERROR("cache_write_fp8_kernel");
  return Status::ok_status();
}

template <typename T>
__global__ void fill_kernel(T* __restrict__ dst, int64_t count, float value) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    store_f(dst, i, value);
  }
}

// One launch for every pool of p (all of one dtype).
template <typename SrcT, typename DstT>
Status launch_cw_pools(const CacheWriteParams& p, int count, const LaunchContext& ctx) {
  WritePools w{};
  for (int i = 0; i < count; ++i) {
    const CacheWriteParams one = cache_write_pool(p, i);
    w.rows[i] = one.rows;
    w.slots[i] = one.slots;
    w.pool[i] = one.pool.data;
    w.dim[i] = one.pool.dim;
    w.stride[i] = pool_row_stride(one.pool);
    w.page_pad[i] = pool_page_pad_bytes(one.pool) / pool_element_bytes(one.pool);
    w.page_size[i] = one.pool.page_size;
    w.num_slots[i] = one.pool.num_pages * one.pool.page_size;
  }
  const int64_t threads = p.num_rows * 32;
  const dim3 grid(static_cast<unsigned>((threads + 255) / 256), static_cast<unsigned>(count));
  if (p.upload.bytes > 0) {
    UploadArgs<kCacheWriteMaxUploadBytes> up;
    up.device = static_cast<char*>(p.upload.device);
    up.bytes = static_cast<uint32_t>(p.upload.bytes);
    std::memcpy(up.data, p.upload.host, p.upload.bytes);
    cache_write_kernel<SrcT, DstT><<<grid, 256, 0, ctx.stream>>>(w, p.num_rows, ctx.error, up);
  } else {
    const UploadArgs<16> none{};
    cache_write_kernel<SrcT, DstT><<<grid, 256, 0, ctx.stream>>>(w, p.num_rows, ctx.error, none);
  }
  DSACP_CUDA_RETURN_IF_LAUNCH_ERROR("cache_write_kernel");
  return Status::ok_status();
}

// Pool i as a single-pool write (cache_write_pool carries the pool's rows, their dtype and scales, and the FP8
// scale rule).
CacheWriteParams one_pool(const CacheWriteParams& p, int i) { return cache_write_pool(p, i); }

// The pools share a dtype (a step's caches do): one launch for all of them.
bool cache_write_one_launch(const CacheWriteParams& p) {
  const int pools = cache_write_pools(p);
  if (p.pool.dtype == DType::kF8E4M3 || p.pool.records()) return false;  // FP8 pools, records: launches of their own
  for (int i = 1; i < pools; ++i) {
    const CacheWriteParams one = cache_write_pool(p, i);
    if (one.pool.dtype != p.pool.dtype || one.rows_dtype != p.rows_dtype || one.pool.records()) return false;
  }
  return true;
}

template <typename SrcT, typename DstT>
Status launch_cw(const CacheWriteParams& p, const LaunchContext& ctx) {
  if (cache_write_one_launch(p)) return launch_cw_pools<SrcT, DstT>(p, cache_write_pools(p), ctx);
  for (int i = 0; i < cache_write_pools(p); ++i) DSACP_RETURN_IF_ERROR(launch_cache_write(one_pool(p, i), ctx));
  return Status::ok_status();
}

}  // namespace

bool cache_write_carries_upload(const CacheWriteParams& p) {
  return p.upload.bytes <= kCacheWriteMaxUploadBytes && p.num_rows > 0 && cache_write_one_launch(p);
}

Status cache_write_supported(const CacheWriteParams& p) {
  auto ok = [](DType t) { return t == DType::kF32 || t == DType::kBF16; };
  for (int i = 0; i < cache_write_pools(p); ++i) {
    const CacheWriteParams one = cache_write_pool(p, i);
    const DType pool = one.pool.dtype;
    if (one.pool.records()) {
      const bool latent = pool == DType::kF8E4M3;
      const bool rows_ok = latent ? ok(one.rows_dtype) || one.rows_dtype == DType::kF8E4M3 : ok(one.rows_dtype);
      if (!rows_ok || (pool != DType::kF8E4M3 && pool != DType::kBF16) || one.pool.record_bytes % 4 != 0 ||
          (latent && (one.pool.dim % kFp8DsMlaTile != 0 || one.pool.dim / kFp8DsMlaTile > 32))) {
        return unsupported(std::string("cache_write: an fp8_ds_mla ") + (latent ? "latent" : "rope") + " view of " +
                           dtype_name(pool) + " dim " + std::to_string(one.pool.dim) + " from " +
                           dtype_name(one.rows_dtype) + " rows (CUDA writes F32/BF16 rows, or F8_E4M3 latent rows "
                           "with their tile scales, into records of 4-byte multiples, latent dim a multiple of 128)");
      }
      if (one.rows_dtype == DType::kF8E4M3 && one.row_scales == nullptr) {
        return invalid_argument("cache_write: row_scales is null; F8_E4M3 latent rows need their [T, dim / 128] "
                                "f32 scales");
      }
      continue;
    }
    const bool fp8_ok = pool == DType::kF8E4M3 && (ok(one.rows_dtype) || one.rows_dtype == DType::kF8E4M3);
    if (!fp8_ok && (!ok(one.rows_dtype) || !ok(pool))) {
      return unsupported(std::string("cache_write: rows ") + dtype_name(one.rows_dtype) + ", pool " + dtype_name(pool) +
                         " (CUDA cache_write supports F32 and BF16, and F32, BF16 or F8_E4M3 rows into an F8_E4M3 "
                         "pool)");
    }
    if (pool == DType::kF8E4M3 && one.pool.dim % 4 != 0) {
      return unsupported("cache_write: an F8_E4M3 pool of dim " + std::to_string(one.pool.dim) +
                         " (CUDA FP8 pools need dim % 4 == 0: the scale plane is stored as aligned f32)");
    }
    if (one.rows_dtype == DType::kF8E4M3 && one.row_scales == nullptr) {
      return invalid_argument("cache_write: row_scales is null; F8_E4M3 rows need their [T] f32 scales");
    }
  }
  if (p.num_rows >= (int64_t{1} << 26)) return unsupported("cache_write: more than 2^26 rows in one call");
  return Status::ok_status();
}

Status launch_cache_write(const CacheWriteParams& p, const LaunchContext& ctx) {
  DSACP_RETURN_IF_ERROR(cache_write_supported(p));
  if (p.upload.bytes > 0 && !cache_write_carries_upload(p)) {
    return internal_error("cache_write: an upload this launch cannot carry (the caller copies it first)");
  }
  if (p.num_rows == 0) return Status::ok_status();
  if (cache_write_pools(p) > 1 && !cache_write_one_launch(p)) return launch_cw<float, float>(p, ctx);  // per pool
  if (p.pool.records()) {
    if (p.rows_dtype == DType::kF8E4M3) return launch_cw_record<unsigned char>(p, ctx);
    if (p.rows_dtype == DType::kBF16) return launch_cw_record<__nv_bfloat16>(p, ctx);
    return launch_cw_record<float>(p, ctx);
  }
  if (p.pool.dtype == DType::kF8E4M3) {
    if (p.rows_dtype == DType::kF8E4M3) return launch_cw_fp8<unsigned char>(p, ctx);
    if (p.rows_dtype == DType::kBF16) return launch_cw_fp8<__nv_bfloat16>(p, ctx);
    return launch_cw_fp8<float>(p, ctx);
  }
  const bool sb = p.rows_dtype == DType::kBF16, db = p.pool.dtype == DType::kBF16;
  if (sb && db) return launch_cw<__nv_bfloat16, __nv_bfloat16>(p, ctx);
  if (sb) return launch_cw<__nv_bfloat16, float>(p, ctx);
  if (db) return launch_cw<float, __nv_bfloat16>(p, ctx);
  return launch_cw<float, float>(p, ctx);
}

Status launch_fill(void* dst, DType dtype, int64_t count, float value, const LaunchContext& ctx) {
  if (count <= 0) return Status::ok_status();
  const int64_t blocks = std::min<int64_t>((count + 255) / 256, int64_t{ctx.num_sms} * 32);
  if (dtype == DType::kF8E4M3) {  // bytes: every one the e4m3 code of value (the CPU backend's fill)
    DSACP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dst, f32_to_e4m3(value), static_cast<size_t>(count), ctx.stream));
    return Status::ok_status();
  }
  if (dtype == DType::kBF16) {
    fill_kernel<__nv_bfloat16><<<static_cast<unsigned>(blocks), 256, 0, ctx.stream>>>(
        static_cast<__nv_bfloat16*>(dst), count, value);
  } else if (dtype == DType::kF32) {
    fill_kernel<float><<<static_cast<unsigned>(blocks), 256, 0, ctx.stream>>>(static_cast<float*>(dst), count, value);
  } else {
    int32_t v = static_cast<int32_t>(value);
    // i32 fill: reinterpret through a float-typed kernel would change bits; use a memset-like loop instead.
    fill_kernel<float><<<static_cast<unsigned>(blocks), 256, 0, ctx.stream>>>(static_cast<float*>(dst), count,
                                                                              __builtin_bit_cast(float, v));
  }
  DSACP_CUDA_RETURN_IF_LAUNCH_ERROR("fill_kernel");
  return Status::ok_status();
}

}  // namespace dsacp::cuda
