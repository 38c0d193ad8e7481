// Context-parallel planning: pure host functions of (batch, layout, rank). No kernels, no communication.
//
// KV sharding (reference-design 3.2): with Pt CP ranks and interleave I, key position p of a request lives
// on rank owner(p) = (p / I) mod Pt at local position lp(p) = (p / I / Pt) * I + p mod I. Every rank shares
// one block table per request; rank cr stores its local position lp in page block_table[b, lp / page_size].
#pragma once

#include <cstdint>
#include <vector>

#include "dsacp/batch.h"
#include "dsacp/paged_cache.h"
#include "dsacp/status.h"

namespace dsacp {

struct KvSharding {
  int32_t Pt = 1;  // CP ranks that share the KV
  int32_t I = 1;   // interleave: consecutive positions per shard unit

  int32_t owner(int64_t p) const { return static_cast<int32_t>((p / I) % Pt); }
  int64_t local_pos(int64_t p) const { return (p / I / Pt) * I + p % I; }
  // The global position of local position lp on rank cr (inverse of owner/local_pos).
  int64_t global_pos(int64_t lp, int32_t cr) const { return ((lp / I) * Pt + cr) * I + lp % I; }
  // How many of a request's S positions rank cr stores.
  int64_t local_len(int64_t S, int32_t cr) const;
  // Pages a request of S positions needs in the shared block table (rank 0 stores the most).
  int64_t pages_needed(int64_t S, int32_t page_size) const;
};

Status validate_sharding(const KvSharding& s);

// Slot on rank cr of key position p of `request`, or -1 when another rank owns it.
Result<int64_t> sharded_slot(const KvSharding& s, int32_t cr, const BlockTable& table, int32_t request, int64_t p,
                             int32_t page_size);

// ---------------------------------------------------------------------------------------------------
// PCP (reference-design §3): every prefill is padded to a multiple of 2P and cut into 2P chunks; rank r
// takes chunk r (head) and chunk 2P-1-r (tail). Decodes are not split: every rank holds all their tokens.

struct PcpRankPlan {
  BatchLayout layout;  // classification of the whole batch (decodes first)
  int32_t P = 1, rank = 0;

  // Local rows, in order: every decode token, then per prefill its head chunk, then its tail chunk.
  std::vector<int32_t> row_request;  // [T_loc] request of the row
  std::vector<int32_t> row_offset;   // [T_loc] padded offset among the request's new tokens
  std::vector<uint8_t> row_is_pad;   // [T_loc] 1 for padding rows (offset >= query_len)
  std::vector<int32_t> row_key_len;  // [T_loc] keys the row sees: context_len + offset + 1; 0 for pads
  int64_t num_local_tokens = 0;         // T_loc (equal on every rank)
  int64_t num_local_decode_tokens = 0;  // the first rows

  // 3.3 / 3.4: the global padded layout (decodes span Q*P, prefills Qpad), P * T_loc rows.
  std::vector<int64_t> padded_query_lens;  // [R]
  std::vector<int64_t> chunk_size;         // [R] c = Qpad / 2P for prefills, 0 for decodes
  std::vector<int64_t> all_positions;      // [P*T_loc] padded position of gathered row k*T_loc + i
  std::vector<int64_t> restore_index;      // [P*T_loc] argsort(all_positions): restored = gathered[restore]
  std::vector<uint8_t> unpad_mask;         // [P*T_loc] per padded position
  // Per padded position: this rank's cache slot (3.4, with the decode fix-up of 3.10), -1 = skip.
  std::vector<int64_t> padded_slots;       // [P*T_loc]

  // 3.5: relative to the prefill rows (local rows after the decode rows).
  std::vector<int64_t> q_head_idx, q_tail_idx, q_full_idx;
  // 3.7: per prefill request (in batch order): keys seen by the head call and by the tail call.
  std::vector<int64_t> head_key_lens, tail_key_lens;

  // 3.12: rows of this rank's output buffer (T_loc, or the graph bucket when larger).
  int64_t output_rows = 0;

  // The slot for gathered row j (rank k's local row i at j = k*T_loc + i): padded_slots[all_positions[j]].
  std::vector<int64_t> gathered_row_slots() const;
  // The token behind gathered row j: its request and key position, or -1 for padding rows and for the
  // duplicate copies of decode tokens (only rank 0's copy is stored).
  std::vector<int32_t> gathered_request;  // [P*T_loc]
  std::vector<int64_t> gathered_pos;      // [P*T_loc]
};

struct PcpOptions {
  int32_t P = 1;
  int32_t decode_threshold = kMaxDecodeThreshold;
  int64_t graph_bucket_tokens = 0;  // 0 = none
};

// The plan of PCP rank `rank`. `sharding` says where each key lives (Pt = P for pure PCP), `table` is the
// shared block table, `cr` the rank's index in the sharding group.
Result<PcpRankPlan> pcp_plan(const std::vector<Request>& requests, const PcpOptions& options, int32_t rank,
                             const KvSharding& sharding, int32_t cr, const BlockTable& table, int32_t page_size);

// The token split alone (3.3): padded offsets of rank r's rows of one prefill of Q tokens.
std::vector<int64_t> pcp_prefill_offsets(int64_t Q, int32_t P, int32_t r);

// The decode slot fix-up of 3.10 (MTP varlen compaction), in place on the decode region of padded slots:
// out[st_b + j] = in[st_b + j*P] for j < Q_b, every other decode entry -1.
void pcp_compact_decode_slots(std::vector<int64_t>& padded_slots, const std::vector<int32_t>& decode_query_lens,
                              int32_t P);

// ---------------------------------------------------------------------------------------------------
// Gathered views (3.9): each rank packs rows of its sharded pools, the packs are all-gathered, and the
// gathered rows form one paged view of the requests' whole KV, addressed by view_table.
struct GatheredViewPlan {
  int64_t rows_per_rank = 0;        // rows every rank contributes (-1 slots are padding)
  std::vector<int64_t> pack_slots;  // [rows_per_rank] this rank's local slots to pack, -1 = padding row
  // direct: the gathered buffer [Pt * rows_per_rank] is itself the view's pool (page granular: whole pages
  // were packed, which needs I to be a multiple of page_size). Otherwise the view's pool is built as
  // view_row[i] = gathered[unpack_rows[i]] (-1 = unused slot).
  bool direct = false;
  std::vector<int64_t> unpack_rows;  // [view_num_pages * page_size] when !direct
  int64_t view_num_pages = 0;
  BlockTable view_table;  // one row per request of `requests`, global logical pages
  // Page granular only: the compact list of physical pages packed (3.9 valid_block_ids).
  std::vector<int32_t> valid_block_ids;
};

// The compact gathered view of the given requests (rows of `table` selected by `request_ids`) for rank cr.
// `seq_lens[i]` is the number of positions of request_ids[i] to cover.
Result<GatheredViewPlan> gathered_view_plan(const std::vector<int32_t>& request_ids,
                                            const std::vector<int64_t>& seq_lens, const BlockTable& table,
                                            const KvSharding& sharding, int32_t cr, int32_t page_size);

// ---------------------------------------------------------------------------------------------------
// DCP (reference-design §4).

// The replicated indexer cache (4.1): every rank stores every token's indexer key in a pool with Pt times
// the pages, addressed by global position through this derived table: global page G of request b is
// replicated page table[b, G / Pt] * Pt + G mod Pt (valid for any interleave: rank 0's share of a request
// always covers ceil(S / (page_size * Pt)) pages). Columns past a request's global pages are -1.
Result<BlockTable> replicated_index_table(const BlockTable& table, const std::vector<int64_t>& seq_lens, int32_t Pt,
                                          int32_t page_size);

// DSA-CP token slicing (§5): the batch's T tokens padded to a multiple of `group`, rank g takes
// [g * T_loc, (g + 1) * T_loc).
struct DsaCpSlice {
  int64_t num_tokens_pad = 0;      // Tpad
  int64_t local_start = 0;         // ls
  int64_t local_end = 0;           // min(le, T): real tokens end here
  int64_t local_end_with_pad = 0;  // le
  std::vector<int64_t> cu_q_local;  // [R] cumulative local query counts
  std::vector<int64_t> len_k_local; // [R] keys of the last local query of each request (0 when none)
};
Result<DsaCpSlice> dsa_cp_slice(const std::vector<Request>& requests, int32_t group, int32_t g);

// ---------------------------------------------------------------------------------------------------
// The whole CP layout: P x D ranks, CP rank cr = r * D + d, KV sharded over Pt = P * D.

enum class IndexerMode {
  kSharded,     // indexer keys sharded like the KV; exact merge of per-rank top-k candidates
  kReplicated,  // every rank stores every indexer key (Pt x the indexer pages); top-k computed locally
};

// How decode tokens are attended.
enum class DecodeMode {
  kLocalMerge,  // over each rank's own keys, exact LSE merge across ranks (never re-gathers the KV)
  kGathered,    // over the gathered KV (the reference design's PCP decode; only with D = 1)
};

struct CpLayout {
  int32_t P = 1;           // PCP ranks: prefill tokens split head/tail
  int32_t D = 1;           // DCP ranks: heads (or, with dsa_cp, tokens) split inside each PCP rank
  int32_t interleave = 0;  // KV interleave I; 0 = the page size
  IndexerMode indexer = IndexerMode::kSharded;
  bool dsa_cp = false;     // DCP ranks split tokens (all heads each) instead of heads; needs P = 1
  DecodeMode decode_mode = DecodeMode::kLocalMerge;
  int64_t graph_bucket_tokens = 0;  // PCP output rows padded to this many (0 = none)
  // Longest wait in any collective before it fails with a timeout (a peer that died or hung).
  int64_t comm_timeout_ms = 600000;
  // The NCCL communicators the CP cluster and the CLI make for the ranks: the exchange window's bytes
  // (NcclOptions::window_bytes; 0 = none: every exchange through NCCL collectives) and the peer exchange's
  // (NcclOptions::peer_exchange_bytes; 0 = off, the default).
  size_t nccl_window_bytes = size_t{32} << 20;
  size_t nccl_peer_exchange_bytes = 0;
  // How the DCP decode exchanges its candidates and partials where the communicator has an exchange window: the
  // kernels synchronize it row by row (kBoth, the default), for one exchange only, or never (kNone: a publish
  // kernel per exchange and the LSE merge kernel).
  enum class WindowRows : uint8_t { kBoth, kTopkOnly, kMlaOnly, kNone };
  WindowRows window_rows = WindowRows::kBoth;
  bool fused_topk_merge = true;  // the top-k merges the window's rows itself (else a merge kernel after it)
  bool decode_head_blocks = true;  // local decodes read the head-gathered queries in place where they can
  int32_t num_ranks() const { return P * D; }
};

// Checks a layout against the model's head count: P, D >= 1, H divisible by D (native DCP), DSA-CP only
// without PCP, gathered decodes only without DCP, interleave >= 0.
Status validate_layout(const CpLayout& layout, int32_t H);

// What CP rank (r, d) computes in one step.
struct CpRankPlan {
  int32_t P = 1, D = 1, r = 0, d = 0, cr = 0;
  BatchLayout layout;
  // This rank's rows: tokens of the batch (-1 = padding), their request and visible key count.
  std::vector<int64_t> row_token;    // [rows]
  std::vector<int32_t> row_request;  // [rows]
  std::vector<int32_t> row_key_len;  // [rows] 0 for padding
  int64_t num_rows = 0;
  // Rows [0, num_shared_rows) are the same tokens, in the same order, on every rank of the layout (the
  // decode tokens; under DCP alone every row): their top-k can be merged and their attention split by keys.
  int64_t num_shared_rows = 0;
  int32_t head_begin = 0, num_heads = 0;  // this rank's query heads
  // The KV exchange: rows all-gathered over the exchange group (the PCP group, or the DCP group under DSA-CP)
  // and the token each one stores (-1 = none).
  std::vector<int32_t> gathered_request;
  std::vector<int64_t> gathered_pos;
  int64_t output_rows = 0;  // num_rows, or the PCP graph bucket when larger
  PcpRankPlan pcp;          // the PCP plan (P >= 1) this rank's rows come from (not under DSA-CP)
};

Result<CpRankPlan> cp_rank_plan(const std::vector<Request>& requests, const CpLayout& layout, int32_t r, int32_t d,
                                const BlockTable& table, int32_t page_size, int32_t decode_threshold, int32_t H);

// Which of a rank's rows attend over the gathered KV view, and whose keys the view holds: rows
// [first_gathered, num_rows) over the view of requests `view_ids` (ascending), the rows before them (the
// local decodes, local_decode_rows of them) over the rank's own keys. DSA-CP: every row over the view of every
// request when the batch has prefills, none in a decode-only batch; otherwise the decodes stay local under
// DecodeMode::kLocalMerge. The executor and the planner's collective count both read it.
struct CpGatheredRows {
  int64_t first_gathered = 0;
  int64_t local_decode_rows = 0;
  std::vector<int32_t> view_ids;
};
CpGatheredRows cp_gathered_rows(const CpRankPlan& plan, const CpLayout& layout, int32_t num_requests);

}  // namespace dsacp
