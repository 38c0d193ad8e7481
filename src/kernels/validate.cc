// Parameter validation shared by every backend, and the validated entry points (*_run).
// validate() only looks at scalars and pointer nullness: the pointers may be device memory, so anything
// that depends on tensor contents (request ids, key lengths, page ids, slots) is checked by the backend.
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "dsacp/backend.h"

namespace dsacp {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

// "<kernel>: <field> must be >= 1, got 0"
Status check_positive(const char* kernel, const char* field, int64_t value) {
  if (value >= 1) return Status::ok_status();
  return invalid_argument(std::string(kernel) + ": " + field + " must be >= 1, got " + str(value));
}

Status check_non_negative(const char* kernel, const char* field, int64_t value) {
  if (value >= 0) return Status::ok_status();
  return invalid_argument(std::string(kernel) + ": " + field + " must be >= 0, got " + str(value));
}

Status check_pointer(const char* kernel, const char* field, const void* ptr) {
  if (ptr != nullptr) return Status::ok_status();
  return invalid_argument(std::string(kernel) + ": " + field + " must not be null");
}

Status check_float_dtype(const char* kernel, const char* field, DType dtype) {
  if (dtype == DType::kF32 || dtype == DType::kBF16) return Status::ok_status();
  return invalid_argument(std::string(kernel) + ": " + field + " must be F32 or BF16, got " + dtype_name(dtype));
}

Status check_equal(const char* kernel, const char* field, const char* what, int64_t expected, int64_t given) {
  if (expected == given) return Status::ok_status();
  return invalid_argument(std::string(kernel) + ": " + field + " must equal " + what + "=" + str(expected) + ", got " +
                          str(given));
}

// F32 or BF16, or (where FP8 is taken) F8_E4M3.
Status check_value_dtype(const char* kernel, const char* field, DType dtype, bool fp8_ok) {
  if (!fp8_ok || dtype != DType::kF8E4M3) return check_float_dtype(kernel, field, dtype);
  return Status::ok_status();
}

// A view of fp8_ds_mla records: the latent part (F8_E4M3, dim a multiple of 128, values and scales) or the rope
// part (BF16) inside records of record_bytes, and the pool's bytes fit int64.
Status check_record_pool(const char* kernel, const std::string& n, const PagedPoolView& pool) {
  const int64_t part = pool.dtype == DType::kF8E4M3 ? int64_t{pool.dim} + 4 * (pool.dim / kFp8DsMlaTile)
                                                    : 2 * int64_t{pool.dim};
  if (pool.dtype != DType::kF8E4M3 && pool.dtype != DType::kBF16) {
    return invalid_argument(std::string(kernel) + ": " + n + ".dtype must be F8_E4M3 (latent) or BF16 (rope) in " +
                            "fp8_ds_mla records, got " + dtype_name(pool.dtype));
  }
  if (pool.dtype == DType::kF8E4M3 && pool.dim % kFp8DsMlaTile != 0) {
    return invalid_argument(std::string(kernel) + ": " + n +
                            ".dim must be a multiple of 128 in fp8_ds_mla records, got " + str(pool.dim));
  }
  if (part > pool.record_bytes) {
    return invalid_argument(std::string(kernel) + ": " + n + ".record_bytes=" + str(pool.record_bytes) +
                            " cannot hold its " + str(part) + "-byte part (dim " + str(pool.dim) + ")");
  }
  if (pool.num_pages > std::numeric_limits<int64_t>::max() / pool.page_size / pool.record_bytes) {
    return invalid_argument(std::string(kernel) + ": " + n + " has too many bytes: num_pages=" + str(pool.num_pages) +
                            " x page_size=" + str(pool.page_size) + " x record_bytes=" + str(pool.record_bytes) +
                            " overflows int64");
  }
  return Status::ok_status();
}

// A page stride of 0 (dense) or a multiple of 16 bytes of at least a page's dense bytes, the pool's span fitting
// int64 (after the pool's own checks: its dense page size is known to fit).
Status check_page_stride(const char* kernel, const std::string& n, const PagedPoolView& pool) {
  if (pool.page_stride == 0) return Status::ok_status();
  const int64_t dense = pool_dense_page_bytes(pool);
  if (pool.page_stride < dense || pool.page_stride % 16 != 0) {
    return invalid_argument(std::string(kernel) + ": " + n + ".page_stride " + str(pool.page_stride) +
                            " must be 0 (dense) or a multiple of 16 bytes of at least a page's " + str(dense) +
                            " bytes");
  }
  if (pool.num_pages > std::numeric_limits<int64_t>::max() / pool.page_stride) {
    return invalid_argument(std::string(kernel) + ": " + n + " spans too many bytes: num_pages=" + str(pool.num_pages) +
                            " x page_stride=" + str(pool.page_stride) + " overflows int64");
  }
  return Status::ok_status();
}

// A pool must be non-empty and its element count must fit int64 (slots and offsets are int64). fp8_ok: the pool
// may hold FP8 two-plane pages (the indexer keys); records_ok: it may be a view of fp8_ds_mla records.
Status check_pool(const char* kernel, const char* name, const PagedPoolView& pool, bool fp8_ok = false,
                  bool records_ok = false, bool strided_ok = false) {
  const std::string n(name);
  if (pool.row_stride != 0) {
    if (!strided_ok || pool.records() || pool.dtype == DType::kF8E4M3) {
      return invalid_argument(std::string(kernel) + ": " + n + ".row_stride must be 0 here (" +
                              (strided_ok ? "records and FP8 pages have their own layout" : "this pool is dense") +
                              "), got " + str(pool.row_stride));
    }
    if (pool.row_stride < pool.dim) {
      return invalid_argument(std::string(kernel) + ": " + n + ".row_stride " + str(pool.row_stride) +
                              " is less than its dim " + str(pool.dim) + " (rows would overlap)");
    }
  }
  DSACP_RETURN_IF_ERROR(check_positive(kernel, (n + ".num_pages").c_str(), pool.num_pages));
  DSACP_RETURN_IF_ERROR(check_positive(kernel, (n + ".page_size").c_str(), pool.page_size));
  DSACP_RETURN_IF_ERROR(check_positive(kernel, (n + ".dim").c_str(), pool.dim));
  DSACP_RETURN_IF_ERROR(check_pointer(kernel, (n + ".data").c_str(), pool.data));
  if (pool.record_bytes < 0 || (pool.records() && !records_ok)) {
    return invalid_argument(std::string(kernel) + ": " + n + ".record_bytes must be 0 here (fp8_ds_mla records are " +
                            "the latent cache's format only), got " + str(pool.record_bytes));
  }
  if (pool.records()) {
    DSACP_RETURN_IF_ERROR(check_record_pool(kernel, n, pool));
    return check_page_stride(kernel, n, pool);
  }
  if (!fp8_ok && pool.dtype == DType::kF8E4M3) {
    return invalid_argument(std::string(kernel) + ": " + n + ".dtype must be F32 or BF16, got F8_E4M3 (FP8 pages " +
                            "are the indexer keys' format only)");
  }
  DSACP_RETURN_IF_ERROR(check_value_dtype(kernel, (n + ".dtype").c_str(), pool.dtype, fp8_ok));
  const int64_t max = std::numeric_limits<int64_t>::max();
  const int64_t row = pool.dtype == DType::kF8E4M3 ? int64_t{pool.dim} + 4 : pool_row_stride(pool);  // + the f32 scale
  if (pool.dim > max - 4 || pool.num_pages > max / pool.page_size / row) {
    return invalid_argument(std::string(kernel) + ": " + n +
                            " has too many elements: num_pages=" + str(pool.num_pages) +
                            " x page_size=" + str(pool.page_size) + " x dim=" + str(pool.dim) + " overflows int64");
  }
  return check_page_stride(kernel, n, pool);
}

Status check_block_table(const char* kernel, const BlockTableView& bt) {
  DSACP_RETURN_IF_ERROR(check_positive(kernel, "block_table.num_requests", bt.num_requests));
  DSACP_RETURN_IF_ERROR(check_positive(kernel, "block_table.max_pages", bt.max_pages));
  return check_pointer(kernel, "block_table.data", bt.data);
}

Status check_rows(const char* kernel, const QueryRowsView& rows) {
  DSACP_RETURN_IF_ERROR(check_non_negative(kernel, "rows.num_tokens", rows.num_tokens));
  if (rows.num_tokens == 0) return Status::ok_status();
  DSACP_RETURN_IF_ERROR(check_pointer(kernel, "rows.request", rows.request));
  return check_pointer(kernel, "rows.key_len", rows.key_len);
}

}  // namespace

Status validate(const CacheWriteParams& p) {
  const char* k = "cache_write";
  DSACP_RETURN_IF_ERROR(check_non_negative(k, "num_rows", p.num_rows));
  DSACP_RETURN_IF_ERROR(check_value_dtype(k, "rows_dtype", p.rows_dtype, true));
  DSACP_RETURN_IF_ERROR(check_pool(k, "pool", p.pool, true, true, true));
  for (const CacheWriteParams::MorePool& m : p.more) {
    if (m.pool.data == nullptr) continue;
    DSACP_RETURN_IF_ERROR(check_pool(k, "more[].pool", m.pool, true, true, true));
    if (m.rows_dtype != DType::kI32) {
      DSACP_RETURN_IF_ERROR(check_value_dtype(k, "more[].rows_dtype", m.rows_dtype, true));
    }
  }
  for (const Fp8ScaleMode m : {p.fp8_scale_mode, p.record_scale_mode}) {
    if (m != Fp8ScaleMode::kFp32 && m != Fp8ScaleMode::kUe8m0) {
      return invalid_argument(std::string(k) + ": " +
                              (m == p.fp8_scale_mode ? "fp8_scale_mode" : "record_scale_mode") +
                              " must be kFp32 or kUe8m0, got " + str(static_cast<int>(m)));
    }
  }
  // e4m3 rows are stored as they are: only into an FP8 pool, and with their scales.
  for (int i = 0; i < cache_write_pools(p); ++i) {
    const CacheWriteParams one = cache_write_pool(p, i);
    const char* name = i == 0 ? "pool" : "more[].pool";
    if (one.rows_dtype == DType::kF8E4M3 && one.pool.dtype != DType::kF8E4M3) {
      return invalid_argument(std::string(k) + ": e4m3 rows (F8_E4M3) go only into an F8_E4M3 pool; " + name +
                              ".dtype is " + dtype_name(one.pool.dtype));
    }
    if (one.rows_dtype == DType::kF8E4M3 && p.num_rows > 0) {
      DSACP_RETURN_IF_ERROR(check_pointer(
          k, i == 0 ? "row_scales (with F8_E4M3 rows)" : "more[].row_scales (with F8_E4M3 rows)", one.row_scales));
    }
  }
  if (p.upload.bytes > 0) {
    if (p.upload.bytes > kCacheWriteMaxUploadBytes) {
      return invalid_argument(std::string(k) + ": upload of " + std::to_string(p.upload.bytes) + " bytes, at most " +
                              std::to_string(kCacheWriteMaxUploadBytes) + " (larger uploads: Backend::copy_to_device)");
    }
    DSACP_RETURN_IF_ERROR(check_pointer(k, "upload.host", p.upload.host));
    DSACP_RETURN_IF_ERROR(check_pointer(k, "upload.device", p.upload.device));
    if (reinterpret_cast<uintptr_t>(p.upload.device) % 16 != 0) {
      return invalid_argument(std::string(k) + ": upload.device must be 16-byte aligned");
    }
  }
  if (p.num_rows == 0) return Status::ok_status();
  DSACP_RETURN_IF_ERROR(check_pointer(k, "rows", p.rows));
  for (const CacheWriteParams::MorePool& m : p.more) {
    if (m.pool.data == nullptr) continue;
    DSACP_RETURN_IF_ERROR(check_pointer(k, "more[].rows", m.rows));
    DSACP_RETURN_IF_ERROR(check_pointer(k, "more[].slots", m.slots));
  }
  return check_pointer(k, "slots", p.slots);
}

Status validate(const IndexerTopkParams& p) {
  const char* k = "indexer_topk";
  DSACP_RETURN_IF_ERROR(check_rows(k, p.rows));
  DSACP_RETURN_IF_ERROR(check_positive(k, "Hi", p.Hi));
  DSACP_RETURN_IF_ERROR(check_positive(k, "Di", p.Di));
  DSACP_RETURN_IF_ERROR(check_positive(k, "K", p.K));
  DSACP_RETURN_IF_ERROR(check_value_dtype(k, "q_dtype", p.q_dtype, true));
  DSACP_RETURN_IF_ERROR(check_pool(k, "keys", p.keys, true));
  DSACP_RETURN_IF_ERROR(check_equal(k, "keys.dim", "Di", p.Di, p.keys.dim));
  // The FP8 score (contract section 6) takes e4m3 queries and FP8 keys together; neither mixes with f32/bf16.
  if ((p.q_dtype == DType::kF8E4M3) != (p.keys.dtype == DType::kF8E4M3)) {
    return invalid_argument(std::string(k) + ": q_dtype " + dtype_name(p.q_dtype) + " with keys.dtype " +
                            dtype_name(p.keys.dtype) + ": F8_E4M3 queries need F8_E4M3 keys and the reverse");
  }
  DSACP_RETURN_IF_ERROR(check_block_table(k, p.block_table));
  if (p.rows.num_tokens == 0) return Status::ok_status();
  if (p.q_dtype == DType::kF8E4M3) DSACP_RETURN_IF_ERROR(check_pointer(k, "q_scale (with F8_E4M3 q)", p.q_scale));
  DSACP_RETURN_IF_ERROR(check_pointer(k, "q", p.q));
  DSACP_RETURN_IF_ERROR(check_pointer(k, "w", p.w));
  return check_pointer(k, "topk", p.topk);
}

Status validate(const SparseMlaParams& p) {
  const char* k = "sparse_mla";
  DSACP_RETURN_IF_ERROR(check_rows(k, p.rows));
  DSACP_RETURN_IF_ERROR(check_positive(k, "H", p.H));
  DSACP_RETURN_IF_ERROR(check_positive(k, "Dl", p.Dl));
  DSACP_RETURN_IF_ERROR(check_positive(k, "Dr", p.Dr));
  DSACP_RETURN_IF_ERROR(check_positive(k, "K", p.K));
  DSACP_RETURN_IF_ERROR(check_positive(k, "head_blocks", p.head_blocks));
  if (p.H % p.head_blocks != 0) {
    return invalid_argument(std::string(k) + ": H=" + str(p.H) + " must be a multiple of head_blocks=" +
                            str(p.head_blocks));
  }
  if (!std::isfinite(p.scale)) {
    return invalid_argument(std::string(k) + ": scale must be finite, got " + std::to_string(p.scale));
  }
  DSACP_RETURN_IF_ERROR(check_float_dtype(k, "q_dtype", p.q_dtype));
  DSACP_RETURN_IF_ERROR(check_float_dtype(k, "out_dtype", p.out_dtype));
  DSACP_RETURN_IF_ERROR(check_pool(k, "latent", p.latent, false, true, true));
  DSACP_RETURN_IF_ERROR(check_pool(k, "rope", p.rope, false, true, true));
  // fp8_ds_mla: the latent view (F8_E4M3) and the rope view (BF16) of one pool of records of exactly
  // fp8_ds_mla_record_bytes(Dl, Dr) bytes; rows: neither is a record view.
  if (p.latent.records() || p.rope.records()) {
    const int32_t want = fp8_ds_mla_record_bytes(p.Dl, p.Dr);
    if (!p.latent.records() || !p.rope.records() || p.latent.dtype != DType::kF8E4M3 ||
        p.rope.dtype != DType::kBF16 || p.latent.data != p.rope.data || p.latent.record_bytes != want ||
        p.rope.record_bytes != want) {
      return invalid_argument(std::string(k) + ": an fp8_ds_mla cache needs latent (F8_E4M3) and rope (BF16) views " +
                              "of one pool of " + str(want) + "-byte records (Dl=" + str(p.Dl) + ", Dr=" + str(p.Dr) +
                              "); got latent " + dtype_name(p.latent.dtype) + " record_bytes=" +
                              str(p.latent.record_bytes) + ", rope " + dtype_name(p.rope.dtype) +
                              " record_bytes=" + str(p.rope.record_bytes) +
                              (p.latent.data != p.rope.data ? " over different pools" : ""));
    }
  }
  DSACP_RETURN_IF_ERROR(check_equal(k, "latent.dim", "Dl", p.Dl, p.latent.dim));
  DSACP_RETURN_IF_ERROR(check_equal(k, "rope.dim", "Dr", p.Dr, p.rope.dim));
  // Both pools are addressed through one block table, so their paging must agree.
  DSACP_RETURN_IF_ERROR(check_equal(k, "rope.page_size", "latent.page_size", p.latent.page_size, p.rope.page_size));
  DSACP_RETURN_IF_ERROR(check_equal(k, "rope.num_pages", "latent.num_pages", p.latent.num_pages, p.rope.num_pages));
  DSACP_RETURN_IF_ERROR(check_block_table(k, p.block_table));
  if (p.rows.num_tokens == 0) return Status::ok_status();
  DSACP_RETURN_IF_ERROR(check_pointer(k, "q_nope", p.q_nope));
  DSACP_RETURN_IF_ERROR(check_pointer(k, "q_rope", p.q_rope));
  DSACP_RETURN_IF_ERROR(check_pointer(k, "topk", p.topk));
  DSACP_RETURN_IF_ERROR(check_pointer(k, "out", p.out));
  return check_pointer(k, "lse", p.lse);
}

namespace {

// A merge's parts: two arrays of every part (names[0], names[1]; `whole`), or, with both null, one pair of buffers
// per part (a_of, b_of: the "<name>_of" fields), at most kMaxPartBuffers parts, every one set.
template <typename A, typename B>
Status check_merge_parts(const char* k, int32_t num_parts, std::array<const char*, 2> names,
                         std::array<const void*, 2> whole, const A* const (&a_of)[kMaxPartBuffers],
                         const B* const (&b_of)[kMaxPartBuffers]) {
  if (whole[0] != nullptr || whole[1] != nullptr) {
    DSACP_RETURN_IF_ERROR(check_pointer(k, names[0], whole[0]));
    return check_pointer(k, names[1], whole[1]);
  }
  if (num_parts > kMaxPartBuffers) {
    return invalid_argument(std::string(k) + ": parts given one buffer each (" + names[0] + "_of) take at most " +
                            str(kMaxPartBuffers) + " parts, got num_parts=" + str(num_parts));
  }
  for (int32_t s = 0; s < num_parts; ++s) {
    if (a_of[s] == nullptr || b_of[s] == nullptr) {
      return invalid_argument(std::string(k) + ": part " + str(s) + " has no buffer (" + names[0] + " and " + names[1] +
                              " are null, so " + names[0] + "_of[s] and " + names[1] +
                              "_of[s] must be set for every part)");
    }
  }
  return Status::ok_status();
}

}  // namespace

Status validate(const LseMergeParams& p) {
  const char* k = "lse_merge";
  DSACP_RETURN_IF_ERROR(check_positive(k, "num_parts", p.num_parts));
  DSACP_RETURN_IF_ERROR(check_non_negative(k, "num_rows", p.num_rows));
  DSACP_RETURN_IF_ERROR(check_positive(k, "Dl", p.Dl));
  DSACP_RETURN_IF_ERROR(check_float_dtype(k, "out_dtype", p.out_dtype));
  DSACP_RETURN_IF_ERROR(check_float_dtype(k, "part_dtype", p.part_dtype));
  if (p.num_rows == 0) return Status::ok_status();
  DSACP_RETURN_IF_ERROR(check_merge_parts(k, p.num_parts, {"part_out", "part_lse"}, {p.part_out, p.part_lse},
                                          p.part_out_of, p.part_lse_of));
  for (int32_t s = 0; s < p.num_parts; ++s) {
    if (p.out == lse_merge_part_out(p, s, dtype_size(p.part_dtype)) && p.out_dtype != p.part_dtype) {
      return invalid_argument(std::string(k) + ": out aliases part " + str(s) + " with a different dtype (out " +
                              dtype_name(p.out_dtype) + ", parts " + dtype_name(p.part_dtype) +
                              "); an in-place merge needs the same dtype");
    }
  }
  DSACP_RETURN_IF_ERROR(check_pointer(k, "out", p.out));
  return check_pointer(k, "lse", p.lse);
}

Status validate(const GatherRowsParams& p) {
  const char* k = "gather_rows";
  DSACP_RETURN_IF_ERROR(check_non_negative(k, "src_rows", p.src_rows));
  DSACP_RETURN_IF_ERROR(check_positive(k, "dim", p.dim));
  if (p.src_stride != 0 && p.src_stride < p.dim) {
    return invalid_argument(std::string(k) + ": src_stride " + str(p.src_stride) + " is less than dim " + str(p.dim));
  }
  if (p.src_page_pad < 0 || (p.src_page_pad > 0 && p.src_page_rows < 1)) {
    return invalid_argument(std::string(k) + ": src_page_pad " + str(p.src_page_pad) + " needs src_page_pad >= 0 and " +
                            "src_page_rows >= 1 (got " + str(p.src_page_rows) + ")");
  }
  DSACP_RETURN_IF_ERROR(check_non_negative(k, "num_rows", p.num_rows));
  DSACP_RETURN_IF_ERROR(check_float_dtype(k, "src_dtype", p.src_dtype));
  DSACP_RETURN_IF_ERROR(check_float_dtype(k, "dst_dtype", p.dst_dtype));
  if (p.num_rows == 0) return Status::ok_status();
  DSACP_RETURN_IF_ERROR(check_pointer(k, "index", p.index));
  DSACP_RETURN_IF_ERROR(check_pointer(k, "dst", p.dst));
  if (p.src_rows > 0) DSACP_RETURN_IF_ERROR(check_pointer(k, "src", p.src));
  return Status::ok_status();
}

Status validate(const TopkRemapParams& p) {
  const char* k = "topk_remap";
  DSACP_RETURN_IF_ERROR(check_non_negative(k, "num_rows", p.num_rows));
  DSACP_RETURN_IF_ERROR(check_positive(k, "K", p.K));
  DSACP_RETURN_IF_ERROR(check_positive(k, "Pt", p.Pt));
  DSACP_RETURN_IF_ERROR(check_positive(k, "I", p.I));
  if (p.cr < 0 || p.cr >= p.Pt) {
    return invalid_argument(std::string(k) + ": cr must be in [0, Pt=" + str(p.Pt) + "), got " + str(p.cr));
  }
  if (p.num_rows == 0) return Status::ok_status();
  DSACP_RETURN_IF_ERROR(check_pointer(k, "topk", p.topk));
  DSACP_RETURN_IF_ERROR(check_pointer(k, "local", p.local));
  const int64_t n = p.num_rows * p.K;
  if (p.topk < p.local + n && p.local < p.topk + n) {
    return invalid_argument(std::string(k) + ": topk and local overlap (the remap is not in place)");
  }
  return Status::ok_status();
}

Status validate(const TopkMergeParams& p) {
  const char* k = "topk_merge";
  DSACP_RETURN_IF_ERROR(check_positive(k, "num_parts", p.num_parts));
  DSACP_RETURN_IF_ERROR(check_non_negative(k, "num_rows", p.num_rows));
  DSACP_RETURN_IF_ERROR(check_positive(k, "K", p.K));
  DSACP_RETURN_IF_ERROR(check_positive(k, "I", p.I));
  if (p.num_rows == 0) return Status::ok_status();
  DSACP_RETURN_IF_ERROR(check_merge_parts(k, p.num_parts, {"part_topk", "part_scores"},
                                          {p.part_topk, p.part_scores}, p.part_topk_of, p.part_scores_of));
  if (p.local_topk != nullptr && (p.local_part < 0 || p.local_part >= p.num_parts)) {
    return invalid_argument(std::string(k) + ": local_part=" + str(p.local_part) + " outside [0, num_parts=" +
                            str(p.num_parts) + ")");
  }
  return check_pointer(k, "topk", p.topk);
}

Status topk_merge_run(Backend& backend, const TopkMergeParams& p) {
  DSACP_RETURN_IF_ERROR(validate(p));
  if (p.num_rows == 0) return Status::ok_status();
  return backend.topk_merge(p);
}

Status gather_rows_run(Backend& backend, const GatherRowsParams& p) {
  DSACP_RETURN_IF_ERROR(validate(p));
  if (p.num_rows == 0) return Status::ok_status();
  return backend.gather_rows(p);
}

Status validate(const TopkInputParams& p) {
  const char* k = "precomputed top-k";
  DSACP_RETURN_IF_ERROR(check_non_negative(k, "num_rows", p.num_rows));
  DSACP_RETURN_IF_ERROR(check_positive(k, "K", p.K));
  if (p.num_rows == 0) return Status::ok_status();
  DSACP_RETURN_IF_ERROR(check_pointer(k, "key_len", p.key_len));
  DSACP_RETURN_IF_ERROR(check_pointer(k, "topk", p.topk));
  DSACP_RETURN_IF_ERROR(check_pointer(k, "out", p.out));
  const int64_t n = p.num_rows * p.K;
  if (p.topk < p.out + n && p.out < p.topk + n) {
    return invalid_argument(std::string(k) + ": the caller's rows and the step's top-k buffer overlap");
  }
  return Status::ok_status();
}

Status validate(const OutputFormParams& p) {
  const char* k = "output form";
  DSACP_RETURN_IF_ERROR(check_non_negative(k, "num_rows", p.num_rows));
  DSACP_RETURN_IF_ERROR(check_non_negative(k, "lse_count", p.lse_count));
  if (p.lse_count > 0) DSACP_RETURN_IF_ERROR(check_pointer(k, "lse", p.lse));
  if (p.slots == nullptr || p.num_rows == 0) return Status::ok_status();
  DSACP_RETURN_IF_ERROR(check_positive(k, "K", p.K));
  DSACP_RETURN_IF_ERROR(check_positive(k, "page_size", p.page_size));
  DSACP_RETURN_IF_ERROR(check_positive(k, "Pt", p.Pt));
  DSACP_RETURN_IF_ERROR(check_positive(k, "I", p.I));
  DSACP_RETURN_IF_ERROR(check_pointer(k, "topk", p.topk));
  DSACP_RETURN_IF_ERROR(check_pointer(k, "request", p.request));
  DSACP_RETURN_IF_ERROR(check_pointer(k, "block_table", p.block_table.data));
  const int64_t n = p.num_rows * p.K;
  if (p.topk < p.slots + n && p.slots < p.topk + n) {
    return invalid_argument(std::string(k) + ": topk and slots overlap (the conversion is not in place)");
  }
  return Status::ok_status();
}

Status topk_input_run(Backend& backend, const TopkInputParams& p) {
  DSACP_RETURN_IF_ERROR(validate(p));
  if (p.num_rows == 0) return Status::ok_status();
  return backend.topk_input(p);
}

Status output_form_run(Backend& backend, const OutputFormParams& p) {
  DSACP_RETURN_IF_ERROR(validate(p));
  if ((p.slots == nullptr || p.num_rows == 0) && (p.lse == nullptr || p.lse_count == 0)) return Status::ok_status();
  return backend.output_form(p);
}

Status topk_remap_run(Backend& backend, const TopkRemapParams& p) {
  DSACP_RETURN_IF_ERROR(validate(p));
  if (p.num_rows == 0) return Status::ok_status();
  return backend.topk_remap(p);
}

Status cache_write_run(Backend& backend, const CacheWriteParams& p) {
  DSACP_RETURN_IF_ERROR(validate(p));
  if (p.num_rows == 0) {
    // Nothing to write; the upload is still made.
    return p.upload.bytes == 0 ? Status::ok_status() : backend.copy_to_device(p.upload.device, p.upload.host, p.upload.bytes);
  }
  return backend.cache_write(p);
}

Status indexer_topk_run(Backend& backend, const IndexerTopkParams& p) {
  DSACP_RETURN_IF_ERROR(validate(p));
  if (p.rows.num_tokens == 0) return Status::ok_status();
  return backend.indexer_topk(p);
}

Status sparse_mla_run(Backend& backend, const SparseMlaParams& p) {
  DSACP_RETURN_IF_ERROR(validate(p));
  if (p.rows.num_tokens == 0) return Status::ok_status();
  return backend.sparse_mla(p);
}

Status Backend::check_sparse_mla(const SparseMlaParams& p) const {
  DSACP_RETURN_IF_ERROR(validate(p));
  if (p.peer.sync.active()) {
    return unsupported(name() + ": sparse_mla: partials merged across ranks inside attention (SparseMlaParams::peer) "
                                "need a device backend with peer memory");
  }
  return Status::ok_status();
}

Result<std::shared_ptr<const KernelPlan>> Backend::plan_indexer_topk(const IndexerTopkParams& p) {
  (void)p;
  return std::shared_ptr<const KernelPlan>();
}

Status Backend::begin_capture() {
  return unsupported(name() + ": begin_capture: this backend records no work (CUDA graphs need the CUDA backend)");
}

Result<CapturedWork> Backend::end_capture() {
  return unsupported(name() + ": end_capture: this backend records no work (CUDA graphs need the CUDA backend)");
}

Status Backend::replay(const CapturedWork& work) {
  (void)work;
  return unsupported(name() + ": replay: this backend records no work (CUDA graphs need the CUDA backend)");
}

Status lse_merge_run(Backend& backend, const LseMergeParams& p) {
  DSACP_RETURN_IF_ERROR(validate(p));
  if (p.num_rows == 0) return Status::ok_status();
  return backend.lse_merge(p);
}

}  // namespace dsacp
