// Parameter blocks of the step's kernels, shared by every backend (CPU oracle, CUDA).
// Pointers are in the backend's memory (host memory for the CPU backend, device memory for CUDA).
// Shapes use the project's vocabulary: T, H, Dl, Dr, Hi, Di, K, page_size, num_pages.
#pragma once

#include <cstddef>
#include <cstdint>

#include "dsacp/dtype.h"
#include "dsacp/fp8.h"

namespace dsacp {

// One paged pool of one layer: [num_pages, page_size, dim], row-major. With dtype kF8E4M3 (the FP8 indexer keys)
// each page is two planes: [page_size, dim] e4m3 values, then [page_size] f32 scales (dsacp/fp8.h,
// fp8_index_page_bytes; 132 bytes a token for dim = 128).
// With record_bytes > 0 the pool is one of fp8_ds_mla records (dsacp/fp8.h: latent and rope of a token in one
// record of record_bytes bytes, slot s at byte s * record_bytes): the latent view has dtype kF8E4M3 and dim Dl
// (values at byte 0 of the record, the Dl / 128 f32 scales after them), the rope view of the same records dtype
// kBF16 and dim Dr (at byte record_bytes - 2 * Dr).
struct PagedPoolView {
  void* data = nullptr;  // [num_pages, page_size, dim], f32 or bf16; or FP8 two-plane pages; or records
  DType dtype = DType::kBF16;
  int64_t num_pages = 0;
  int32_t page_size = 0;
  int32_t dim = 0;
  int32_t record_bytes = 0;  // 0: rows (or FP8 two-plane pages); > 0: fp8_ds_mla records
  // Rows only (f32/bf16 pools): elements from one slot's row to the next; 0 = dim (dense rows). A latent and a
  // rope view of one [num_pages, page_size, Dl + Dr] buffer (vLLM's and FlashMLA's bf16 KV layout) both have
  // row_stride Dl + Dr, the rope view starting Dl elements into the buffer.
  int64_t row_stride = 0;
  // Bytes from one page to the next; 0 = dense (a page's rows, records or two planes, the next page right after
  // them). A larger stride, a multiple of 16, leaves the bytes past a page's dense size unused and never read: an
  // engine's pages padded to one size for every layer's caches (vLLM's page_size_padded). Both views of one
  // buffer (the rows' latent and rope, a record pool's parts) have the buffer's page stride.
  int64_t page_stride = 0;
  DSACP_HD bool records() const { return record_bytes > 0; }
};

// Elements from one slot's row of a row pool to the next.
DSACP_HD int64_t pool_row_stride(const PagedPoolView& v) { return v.row_stride > 0 ? v.row_stride : v.dim; }

// Bytes of one element of a row pool's dtype.
DSACP_HD int64_t pool_element_bytes(const PagedPoolView& v) {
  return v.dtype == DType::kBF16 ? 2 : v.dtype == DType::kF8E4M3 ? 1 : 4;
}

// Bytes of one page laid out densely: page_size rows of row_stride elements, records, or the FP8 page's planes.
DSACP_HD int64_t pool_dense_page_bytes(const PagedPoolView& v) {
  if (v.records()) return static_cast<int64_t>(v.page_size) * v.record_bytes;
  if (v.dtype == DType::kF8E4M3) return fp8_index_page_bytes(v.page_size, v.dim);
  return static_cast<int64_t>(v.page_size) * pool_row_stride(v) * pool_element_bytes(v);
}

// Bytes from one page of the pool to the next (page_stride, or the dense size).
DSACP_HD int64_t pool_page_stride(const PagedPoolView& v) {
  return v.page_stride > 0 ? v.page_stride : pool_dense_page_bytes(v);
}

// Bytes past each page's dense size (0 for a dense pool).
DSACP_HD int64_t pool_page_pad_bytes(const PagedPoolView& v) { return pool_page_stride(v) - pool_dense_page_bytes(v); }

// Bytes a pool of num_pages pages spans from its first byte: the last page needs only its dense size.
DSACP_HD int64_t pool_span_bytes(const PagedPoolView& v) {
  return v.num_pages < 1 ? 0 : (v.num_pages - 1) * pool_page_stride(v) + pool_dense_page_bytes(v);
}

// Element offset of slot `slot`'s row (slot = page * page_size + offset) from a row pool's data.
DSACP_HD int64_t pool_row_offset(const PagedPoolView& v, int64_t slot) {
  return (slot / v.page_size) * (pool_page_stride(v) / pool_element_bytes(v)) + (slot % v.page_size) * pool_row_stride(v);
}

// The first byte of slot `slot`'s part in a record pool: the latent values (dtype kF8E4M3) or the rope (kBF16).
DSACP_HD int64_t record_part_offset(const PagedPoolView& v, int64_t slot) {
  return (slot / v.page_size) * pool_page_stride(v) + (slot % v.page_size) * v.record_bytes +
         (v.dtype == DType::kF8E4M3 ? 0 : v.record_bytes - 2 * v.dim);
}

// The most parts a merge takes as one buffer each (LseMergeParams::part_out_of, TopkMergeParams::part_topk_of):
// a window exchange's messages, read in place from every rank's buffer (Communicator::window_next).
inline constexpr int kMaxPartBuffers = 8;

// A window exchange that the kernels synchronize themselves, row by row (Communicator::window_rows): the
// producer kernel raises row t's flag in every peer once its stores of row t (into its own window buffer, or
// into the peers') are done (system-scope release after a system fence); the consumer kernel waits, for each row
// t it reads, until every peer's flag of row t reached `seq` (acquire), bounded by `timeout_ns` and the
// communicator's abort word; a wait that gives up stores its code in the error word (-1 after an abort, else
// 1 + the late rank), which the communicator reports (Communicator::window_rows_done), and a 1 in the device
// word failed_word. Producers check only failed_word (device memory) before they signal: a read of mapped host
// memory per CTA queues on PCIe when every CTA of a kernel makes one at once. seq == 0: no exchange (the kernel
// neither signals nor waits).
struct WindowRowSync {
  uint64_t seq = 0;
  int32_t rank = 0, size = 0;
  int64_t num_rows = 0;                           // rows [0, num_rows) have flags
  uint64_t* signal_to[kMaxPartBuffers] = {};      // rank k's flags of this rank's rows ([num_rows]); null for k == rank
  const uint64_t* wait_on[kMaxPartBuffers] = {};  // this rank's flags of rank k's rows; null for k == rank
  uint64_t timeout_ns = 0;
  const volatile int32_t* abort_word = nullptr;  // the communicator's mapped host words
  int32_t* error_word = nullptr;
  int32_t* failed_word = nullptr;  // device memory of this rank: nonzero once a wait of the communicator failed
  bool active() const { return seq != 0; }
};

// Block table: request b's logical page c lives in physical page data[b * max_pages + c].
struct KernelPlan;  // a backend's schedule of a kernel for a batch (dsacp/backend.h)

struct BlockTableView {
  const int32_t* data = nullptr;  // [num_requests, max_pages]
  int32_t num_requests = 0;
  int32_t max_pages = 0;
};

// Scatter rows into flat slots of a pool: pool[slot / page_size, slot % page_size, :] = rows[t, :].
// A slot of -1 skips the row; any other slot outside [0, num_pages * page_size) is an error.
struct CacheWriteParams {
  const void* rows = nullptr;  // [T, dim], f32 or bf16 (or e4m3, already quantized: row_scales below)
  DType rows_dtype = DType::kBF16;
  // A pool of dtype kF8E4M3 stores quantized rows: f32/bf16 rows are quantized per row (dsacp/fp8.h) with this
  // scale rule; e4m3 rows are stored as they are, with their scales row_scales[T] (positive and finite).
  Fp8ScaleMode fp8_scale_mode = Fp8ScaleMode::kFp32;
  const float* row_scales = nullptr;  // [T], f32, only with rows_dtype kF8E4M3 ([T, dim / 128] into records)
  int64_t num_rows = 0;        // T
  const int64_t* slots = nullptr;  // [T]
  PagedPoolView pool;
  // Optional: more pools written by the same call (one launch on a GPU), each with its own rows ([T, its dim],
  // rows_dtype) and slots; an entry is used when its pool has data (then rows and slots must be set). The steps
  // write a token's indexer key, latent and rope rows together.
  struct MorePool {
    const void* rows = nullptr;
    const int64_t* slots = nullptr;
    PagedPoolView pool;
    // This pool's rows' dtype when it differs from rows_dtype (an FP8 pool written from e4m3 rows beside bf16
    // ones); kI32, not a row type, means rows_dtype. row_scales: as the main row_scales, for e4m3 rows.
    DType rows_dtype = DType::kI32;
    const float* row_scales = nullptr;
  };
  MorePool more[2];
  // Optional: a small upload made by the same call (a CUDA backend carries the bytes in the launch's parameters:
  // no copy call of its own). `bytes` bytes from `host` land at `device` before the write reads its slots (which
  // may lie there) and before any later work in stream order; the host bytes may be reused once the call
  // returns. At most kCacheWriteMaxUploadBytes; `device` 16-byte aligned. Done even when num_rows is 0.
  struct Upload {
    const void* host = nullptr;
    void* device = nullptr;
    size_t bytes = 0;
  };
  Upload upload;
  // A view of fp8_ds_mla latent records (pool.records(), dtype kF8E4M3) quantizes f32/bf16 rows per 128-value
  // tile with this rule; e4m3 rows are stored as they are with their tiles' scales (row_scales [T, dim / 128]).
  // A rope view of records stores bf16 (rounded from f32 rows).
  Fp8ScaleMode record_scale_mode = Fp8ScaleMode::kFp32;
};
inline constexpr size_t kCacheWriteMaxUploadBytes = 3072;

// Pool i of a cache write (0: the main one, 1.. the `more` ones whose pool has data) as a single-pool write; the
// number of pools is cache_write_pools(p).
inline int cache_write_pools(const CacheWriteParams& p) {
  int n = 1;
  for (const CacheWriteParams::MorePool& m : p.more) n += m.pool.data != nullptr;
  return n;
}
inline CacheWriteParams cache_write_pool(const CacheWriteParams& p, int i) {
  CacheWriteParams one;
  one.rows_dtype = p.rows_dtype;
  one.fp8_scale_mode = p.fp8_scale_mode;
  one.record_scale_mode = p.record_scale_mode;
  one.num_rows = p.num_rows;
  if (i == 0) {
    one.rows = p.rows;
    one.row_scales = p.row_scales;
    one.slots = p.slots;
    one.pool = p.pool;
    return one;
  }
  for (const CacheWriteParams::MorePool& m : p.more) {
    if (m.pool.data != nullptr && --i == 0) {
      one.rows = m.rows;
      if (m.rows_dtype != DType::kI32) one.rows_dtype = m.rows_dtype;
      one.row_scales = m.row_scales;
      one.slots = m.slots;
      one.pool = m.pool;
    }
  }
  return one;
}

// Per query token: which request's block table it reads and how many key positions it sees.
// Key positions are request-relative: key j of request b is at block_table[b, j / page_size], j % page_size.
struct QueryRowsView {
  int64_t num_tokens = 0;               // T
  const int32_t* request = nullptr;     // [T] row of the block table
  const int32_t* key_len = nullptr;     // [T] keys [0, key_len) are visible; 0 = none
};

// Exact merge of top-k rows computed by Pt CP ranks over their own keys (the sharded indexer): part s holds
// rank s's local positions and their scores; with KV sharded by interleave I, local position l of rank s is
// global position ((l / I) * Pt + s) * I + l mod I. The result is the canonical global row: the K best
// candidates by score (NaN lowest), ties to the lower global position, ascending, -1 padded. It equals the
// top-k over all keys, because every global winner is among its own rank's local top-k.
struct TopkMergeParams {
  int32_t num_parts = 0;              // Pt
  int64_t num_rows = 0;               // T
  int32_t K = 0;
  int32_t I = 1;                      // interleave of the sharding
  const int32_t* part_topk = nullptr;  // [Pt, T, K] local positions, -1 padded
  const float* part_scores = nullptr;  // [Pt, T, K]
  int32_t* topk = nullptr;             // [T, K] out
  // Optional, in the same pass: the merged rows remapped to part `local_part`'s own local positions (exactly
  // TopkRemapParams with Pt = num_parts, I, cr = local_part): that part's winners in order, then -1.
  int32_t* local_topk = nullptr;       // [T, K] out
  int32_t local_part = 0;
  // Or, with part_topk and part_scores null, one buffer per part (Pt <= kMaxPartBuffers): part s's [T, K] rows
  // at part_topk_of[s] and part_scores_of[s].
  const int32_t* part_topk_of[kMaxPartBuffers] = {};
  const float* part_scores_of[kMaxPartBuffers] = {};
  // Optional (device backends): the parts are a row-synchronized window exchange's messages; row t of the other
  // parts is read once their ranks raised its flag (Communicator::window_rows).
  WindowRowSync wait;
};

// Lightning indexer score and exact top-k in the contract's canonical form:
//   s(t, j) = sum_h w[t, h] * relu(q[t, h, :] . k[j, :]) over visible j;
//   the K largest, ties to the lower position, ascending, front-packed, -1 padded.
// FP8 (q_dtype and keys.dtype kF8E4M3, contract section 6):
//   s(t, j) = sum_h w[t, h] * relu(q_scale[t, h] * sk[j] * (q8[t, h, :] . k8[j, :])), the dot product in f32,
// with sk[j] the key's scale from the pool's scale plane.
struct IndexerTopkParams {
  QueryRowsView rows;
  int32_t Hi = 0, Di = 0, K = 0;
  const void* q = nullptr;  // [T, Hi, Di], f32, bf16 or e4m3
  DType q_dtype = DType::kBF16;
  const float* q_scale = nullptr;  // [T, Hi], f32: with e4m3 q (may be all 1 with the scale folded into w)
  const float* w = nullptr;  // [T, Hi], f32
  PagedPoolView keys;        // [num_pages, page_size, Di]: f32/bf16 rows, or FP8 two-plane pages (with e4m3 q)
  BlockTableView block_table;
  int32_t* topk = nullptr;   // [T, K] out
  // Optional: the score of each chosen entry ([T, K], -inf after the last one), for an exact merge of
  // top-k rows computed over disjoint key sets (sharded indexer).
  float* topk_scores = nullptr;
  // Optional: host copies of rows.request and rows.key_len (the same values). A device backend plans its
  // launch from them instead of reading the rows back, which would wait for the work queued before the call.
  const int32_t* host_request = nullptr;  // [T]
  const int32_t* host_key_len = nullptr;  // [T]
  // Optional (device backends): the launch's schedule made once for these rows (Backend::plan_indexer_topk, the
  // step plan's), so the call plans nothing on the host; with it, workspace (plan->workspace_bytes of device
  // memory) holds the call's score rows instead of the backend's own scratch.
  const KernelPlan* plan = nullptr;
  void* workspace = nullptr;
  // Optional (device backends): topk / topk_scores are this rank's message of a row-synchronized window exchange,
  // and row t's flag is raised in every peer once its row is stored (Communicator::window_rows).
  WindowRowSync signal;
  // Optional (device backends, with signal; merge.num_rows == rows.num_tokens > 0): that exchange's candidate merge
  // done by the top-k itself, row by row: once row t is stored and signalled, the merge of row t waits for the
  // peers' flags of it (merge.wait, the same exchange) and writes merged row t (merge.topk, merge.local_topk).
  // merge's parts are the exchange's messages, this rank's part being topk / topk_scores. Saves the merge kernel's
  // launch and lets each row merge as soon as its candidates are in; the result is topk_merge's.
  TopkMergeParams merge;
};

// Sparse MLA attention over the chosen keys, with natural-log LSE.
//   l(h, j) = scale * (q_nope[t,h,:] . latent[j,:] + q_rope[t,h,:] . rope[j,:]) for j in topk[t, :],
//   an entry e is used iff 0 <= e < key_len[t] (entries are front-packed: the scan stops at the first
//   unused one); out = softmax(l) @ latent; lse = ln sum exp l. No chosen key: out = 0, lse = -inf.
struct SparseMlaParams {
  QueryRowsView rows;
  int32_t H = 0, Dl = 0, Dr = 0, K = 0;
  float scale = 0.f;
  const void* q_nope = nullptr;  // [T, H, Dl]
  const void* q_rope = nullptr;  // [T, H, Dr]
  DType q_dtype = DType::kBF16;
  // [num_pages, page_size, Dl] and [num_pages, page_size, Dr]; or the two views of one pool of fp8_ds_mla
  // records (latent.records(): the latent dequantized as scale * value in f32 is the nope key and the value).
  PagedPoolView latent;
  PagedPoolView rope;
  BlockTableView block_table;
  const int32_t* topk = nullptr; // [T, K]
  void* out = nullptr;           // [T, H, Dl], f32 or bf16
  DType out_dtype = DType::kF32;
  float* lse = nullptr;          // [T, H], f32
  // q_nope, q_rope, out and lse as head_blocks blocks of [T, H / head_blocks, ...] (head slices, block-major:
  // the layout of a gather along heads, and of an all-to-all by head slice) instead of [T, H, ...]. H must be a
  // multiple of head_blocks. 1 = the plain layout.
  int32_t head_blocks = 1;
  // Optional (device backends): Backend::sparse_mla_workspace_bytes(p) bytes of device scratch for the split
  // partials, instead of the backend's own scratch (which may grow, i.e. allocate and wait).
  void* workspace = nullptr;
  // Optional (device backends; the DCP decode over a window, Communicator::window_rows): the partial results of
  // the head_blocks == peer.sync.size ranks merged inside attention. This rank attends over its own keys for every
  // head block; block k != sync.rank's normalized rows ([T, H / head_blocks, Dl] of part_dtype) and their LSE
  // ([T, H / head_blocks]) go to rank k's window (part_out_to[k], part_lse_to[k]: this rank's slot there) and row
  // t's flag is raised in rank k after them. Block sync.rank is not stored as a partial: its rows are merged (as
  // LseMergeParams, parts in rank order) with every peer's rows of that block (part_out_from[s],
  // part_lse_from[s] in this rank's window, row t read once peer s raised its flag) into out / lse, which then
  // hold this rank's head slice only: [T, H / head_blocks, Dl] and [T, H / head_blocks].
  struct PeerMerge {
    WindowRowSync sync;
    DType part_dtype = DType::kF32;  // f32 or bf16
    void* part_out_to[kMaxPartBuffers] = {};
    float* part_lse_to[kMaxPartBuffers] = {};
    const void* part_out_from[kMaxPartBuffers] = {};
    const float* part_lse_from[kMaxPartBuffers] = {};
  } peer;
};

// The row of (token t, head h) in a SparseMlaParams' q / out / lse layout.
inline int64_t mla_head_row(const SparseMlaParams& p, int64_t t, int32_t h) {
  const int32_t per_block = p.H / p.head_blocks;
  return (static_cast<int64_t>(h / per_block) * p.rows.num_tokens + t) * per_block + h % per_block;
}

// Exact merge of S partial attention results over disjoint key sets (reference-design 4.4 step 6):
//   L_s = lse_s if finite else -inf; w_s = exp(L_s - logsumexp L) (0 when every L_s is -inf);
//   out = sum_s w_s out_s; lse = logsumexp_s L_s (-inf when all are -inf, and out = 0).
struct LseMergeParams {
  int32_t num_parts = 0;         // S
  int64_t num_rows = 0;          // T * H
  int32_t Dl = 0;
  const void* part_out = nullptr;   // [S, T*H, Dl] of part_dtype
  const float* part_lse = nullptr;  // [S, T*H]
  void* out = nullptr;              // [T*H, Dl] of out_dtype (may alias part_out when the dtypes match: in place)
  float* lse = nullptr;             // [T*H]
  DType out_dtype = DType::kF32;    // f32 or bf16
  DType part_dtype = DType::kF32;   // f32 or bf16 (bf16 partials: half the bytes to exchange; sums stay f32)
  // Or, with part_out and part_lse null, one buffer per part (S <= kMaxPartBuffers): part s's [T*H, Dl] at
  // part_out_of[s] and its [T*H] LSE at part_lse_of[s].
  const void* part_out_of[kMaxPartBuffers] = {};
  const float* part_lse_of[kMaxPartBuffers] = {};
};

// Row gather with dtype conversion: dst[i, :] = src[index[i], :] for i < num_rows; index -1 fills the row
// with NaN (an unused slot). Packs rows of a pool for a collective and lays gathered rows out as a pool.
struct GatherRowsParams {
  const void* src = nullptr;  // [src_rows, dim], f32 or bf16
  DType src_dtype = DType::kBF16;
  int64_t src_rows = 0;
  int32_t dim = 0;
  int64_t src_stride = 0;  // elements from one source row to the next; 0 = dim
  // Source rows in pages (a padded pool's rows): src_page_pad elements more after every src_page_rows rows.
  int64_t src_page_rows = 0, src_page_pad = 0;
  const int64_t* index = nullptr;  // [num_rows], each in [-1, src_rows)
  int64_t num_rows = 0;
  void* dst = nullptr;  // [num_rows, dim], f32 or bf16
  DType dst_dtype = DType::kBF16;
};

// Element offset of source row r of a gather.
DSACP_HD int64_t gather_src_offset(const GatherRowsParams& p, int64_t r) {
  const int64_t stride = p.src_stride > 0 ? p.src_stride : p.dim;
  return r * stride + (p.src_page_pad > 0 ? (r / p.src_page_rows) * p.src_page_pad : 0);
}

// Global top-k positions to this rank's local positions (reference-design 4.4 step 3), in exact integer
// arithmetic: with KV sharded over Pt ranks by interleave I, entry e is kept iff e >= 0 and
// (e / I) mod Pt == cr, as (e / (Pt*I)) * I + e mod I; kept entries move to the front in their original order,
// then -1. An entry e < -1 is an error.
struct TopkRemapParams {
  int64_t num_rows = 0;
  int32_t K = 0;
  const int32_t* topk = nullptr;  // [num_rows, K] global positions
  int32_t* local = nullptr;       // [num_rows, K] out
  int32_t Pt = 1, I = 1, cr = 0;
};

// A caller's top-k rows (StepInputs::topk: a layer that reuses another layer's top-k) checked and copied into the
// step's top-k buffer. Row t must hold distinct positions in [0, key_len[t]) in ascending order, then -1 to the
// end (a row may hold fewer than min(K, key_len[t]) positions); else the call fails naming the row (device
// backends: at the step's end, naming the row).
struct TopkInputParams {
  int64_t num_rows = 0;
  int32_t K = 0;
  const int32_t* key_len = nullptr;  // [num_rows]
  const int32_t* topk = nullptr;     // [num_rows, K] the caller's rows
  int32_t* out = nullptr;            // [num_rows, K] the copy (not overlapping topk)
};

// The step's outputs in the forms a serving engine asks for (StepConfig::topk_form, lse_base), made from the
// step's canonical top-k and natural-log LSE, in exact arithmetic:
//   slots[t, i] = page * page_size + l % page_size, page = block_table[request[t], l / page_size], for each entry
//     e = topk[t, i] >= 0, with l its local position on the rank that stores it (KV sharded over Pt ranks by
//     interleave I: l = (e / (Pt * I)) * I + e mod I; l = e on one device); -1 stays -1 (FlashMLA's global-slot
//     form). A page outside [0, num_pages) or past max_pages is an error naming the row.
//   lse[i] = lse[i] * kLog2E (one f32 multiply: log2 of the sum of exp2 of the logits in log2 units) for
//     i < lse_count.
// slots may be null (no top-k conversion), lse null (none of the LSE); slots may not alias topk.
inline constexpr float kLog2E = 1.44269504088896340736f;  // 1 / ln 2, rounded to f32
struct OutputFormParams {
  int64_t num_rows = 0;
  int32_t K = 0;
  const int32_t* topk = nullptr;     // [num_rows, K] canonical positions
  const int32_t* request = nullptr;  // [num_rows] block table row of each row
  BlockTableView block_table;
  int32_t page_size = 0;
  int64_t num_pages = 0;             // of the pool the slots address
  int32_t Pt = 1, I = 1;
  int32_t* slots = nullptr;          // [num_rows, K] out
  float* lse = nullptr;              // [lse_count], in place
  int64_t lse_count = 0;
};

// Part s's rows of a merge, whichever way its parts were given (row 0 of the part; rows are contiguous).
inline const void* lse_merge_part_out(const LseMergeParams& p, int32_t s, size_t elem_bytes) {
  return p.part_out != nullptr ? static_cast<const char*>(p.part_out) + static_cast<size_t>(s) * p.num_rows * p.Dl * elem_bytes
                               : p.part_out_of[s];
}
inline const float* lse_merge_part_lse(const LseMergeParams& p, int32_t s) {
  return p.part_lse != nullptr ? p.part_lse + s * p.num_rows : p.part_lse_of[s];
}
inline const int32_t* topk_merge_part_topk(const TopkMergeParams& p, int32_t s) {
  return p.part_topk != nullptr ? p.part_topk + s * p.num_rows * p.K : p.part_topk_of[s];
}
inline const float* topk_merge_part_scores(const TopkMergeParams& p, int32_t s) {
  return p.part_scores != nullptr ? p.part_scores + s * p.num_rows * p.K : p.part_scores_of[s];
}

}  // namespace dsacp
