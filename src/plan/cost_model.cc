// The planner's calibration file and one step's cost on its slowest rank (the critical path of cp_step_run:
// which exchanges overlap which kernels is read off src/layer/cp_step.cc, and noted where each term is formed).
#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <string>

#include "core/json.h"
#include "dsacp/dtype.h"
#include "dsacp/fp8.h"
#include "dsacp/layout_planner.h"

namespace dsacp {

double KernelFit::ms(double bytes, double flops) const {
  double t = 0;
  if (gbs > 0) t = std::max(t, bytes / (gbs * 1e6));
  if (tflops > 0) t = std::max(t, flops / (tflops * 1e9));
  return launch_us * 1e-3 + t;
}

double TopkFit::ms(double total_elems, double longest_row) const {
  if (total_elems <= 0) return 0;
  double t = 0;
  if (total_gelem_s > 0) t = std::max(t, total_elems / (total_gelem_s * 1e6));
  if (row_gelem_s > 0) t = std::max(t, longest_row / (row_gelem_s * 1e6));
  return launch_us * 1e-3 + t;
}

double LinkFit::ms(double sent_bytes) const { return latency_us * 1e-3 + (gbs > 0 ? sent_bytes / (gbs * 1e6) : 0); }

namespace {

Result<double> number_at(const json::Value& obj, const char* key, const std::string& where) {
  const json::Value* v = obj.find(key);
  if (v == nullptr || v->kind != json::Kind::kNumber || !std::isfinite(v->number) || v->number < 0) {
    return invalid_argument("planner calibration: " + where + "." + key + " must be a number >= 0");
  }
  return v->number;
}

Result<const json::Value*> object_at(const json::Value& obj, const char* key, const std::string& where) {
  const json::Value* v = obj.find(key);
  if (v == nullptr || v->kind != json::Kind::kObject) {
    return invalid_argument("planner calibration: " + where + "." + key + " must be an object");
  }
  return v;
}

std::string string_at(const json::Value& obj, const char* key) {
  const json::Value* v = obj.find(key);
  return v != nullptr && v->kind == json::Kind::kString ? v->string : std::string();
}

Result<KernelFit> kernel_fit(const json::Value& kernels, const char* name) {
  DSACP_ASSIGN_OR_RETURN(const json::Value* k, object_at(kernels, name, "kernels"));
  const std::string where = std::string("kernels.") + name;
  KernelFit f;
  DSACP_ASSIGN_OR_RETURN(f.launch_us, number_at(*k, "launch_us", where));
  DSACP_ASSIGN_OR_RETURN(f.gbs, number_at(*k, "gbs", where));
  DSACP_ASSIGN_OR_RETURN(f.tflops, number_at(*k, "tflops", where));
  return f;
}

Result<TopkFit> topk_fit(const json::Value& kernels, const char* name) {
  DSACP_ASSIGN_OR_RETURN(const json::Value* k, object_at(kernels, name, "kernels"));
  const std::string where = std::string("kernels.") + name;
  TopkFit f;
  DSACP_ASSIGN_OR_RETURN(f.launch_us, number_at(*k, "launch_us", where));
  DSACP_ASSIGN_OR_RETURN(f.total_gelem_s, number_at(*k, "total_gelem_s", where));
  DSACP_ASSIGN_OR_RETURN(f.row_gelem_s, number_at(*k, "row_gelem_s", where));
  return f;
}

Result<LinkFit> link_fit(const json::Value& links, const char* name) {
  DSACP_ASSIGN_OR_RETURN(const json::Value* k, object_at(links, name, "links"));
  const std::string where = std::string("links.") + name;
  LinkFit f;
  DSACP_ASSIGN_OR_RETURN(f.latency_us, number_at(*k, "latency_us", where));
  DSACP_ASSIGN_OR_RETURN(f.gbs, number_at(*k, "gbs", where));
  return f;
}

}  // namespace

Result<PlannerCalibration> parse_planner_calibration(std::string_view text) {
  DSACP_ASSIGN_OR_RETURN(json::Value doc, json::parse(text));
  if (doc.kind != json::Kind::kObject) return invalid_argument("planner calibration: expected a JSON object");
  if (string_at(doc, "format") != "dsacp-planner-calibration") {
    return invalid_argument("planner calibration: format must be \"dsacp-planner-calibration\"");
  }
  PlannerCalibration c;
  c.gpu = string_at(doc, "gpu");
  if (const json::Value* v = doc.find("version"); v != nullptr && v->kind == json::Kind::kNumber) {
    c.version = std::to_string(static_cast<int64_t>(v->number));
  }
  if (c.version != "1") return invalid_argument("planner calibration: version must be 1, got \"" + c.version + "\"");
  if (const json::Value* src = doc.find("source"); src != nullptr && src->kind == json::Kind::kObject) {
    if (const json::Value* k = src->find("kernels"); k != nullptr && k->kind == json::Kind::kObject) {
      c.source_commit = string_at(*k, "commit");
      c.source_date = string_at(*k, "date");
    }
  }
  DSACP_ASSIGN_OR_RETURN(c.memory_gib, number_at(doc, "memory_gib", "calibration"));
  DSACP_ASSIGN_OR_RETURN(const json::Value* kernels, object_at(doc, "kernels", "calibration"));
  DSACP_ASSIGN_OR_RETURN(c.indexer_bf16, kernel_fit(*kernels, "indexer_bf16"));
  DSACP_ASSIGN_OR_RETURN(c.indexer_fp8, kernel_fit(*kernels, "indexer_fp8"));
  DSACP_ASSIGN_OR_RETURN(c.indexer_bf16_hi32, kernel_fit(*kernels, "indexer_bf16_hi32"));
  DSACP_ASSIGN_OR_RETURN(c.indexer_fp8_hi32, kernel_fit(*kernels, "indexer_fp8_hi32"));
  DSACP_ASSIGN_OR_RETURN(c.topk_decode, topk_fit(*kernels, "topk_decode"));
  DSACP_ASSIGN_OR_RETURN(c.topk_prefill, topk_fit(*kernels, "topk_prefill"));
  DSACP_ASSIGN_OR_RETURN(c.mla_decode, kernel_fit(*kernels, "mla_decode"));
  DSACP_ASSIGN_OR_RETURN(c.mla_prefill, kernel_fit(*kernels, "mla_prefill"));
  DSACP_ASSIGN_OR_RETURN(c.topk_merge, kernel_fit(*kernels, "topk_merge"));
  DSACP_ASSIGN_OR_RETURN(c.lse_merge, kernel_fit(*kernels, "lse_merge"));
  DSACP_ASSIGN_OR_RETURN(const json::Value* host, object_at(doc, "host", "calibration"));
  DSACP_ASSIGN_OR_RETURN(c.kv_phase_us, number_at(*host, "kv_phase_us", "host"));
  DSACP_ASSIGN_OR_RETURN(c.kv_phase_ns_per_row, number_at(*host, "kv_phase_ns_per_row", "host"));
  DSACP_ASSIGN_OR_RETURN(c.replicated_table_ns_per_page, number_at(*host, "replicated_table_ns_per_page", "host"));
  DSACP_ASSIGN_OR_RETURN(c.host_step_us, number_at(*host, "host_step_us", "host"));
  DSACP_ASSIGN_OR_RETURN(const json::Value* links, object_at(doc, "links", "calibration"));
  DSACP_ASSIGN_OR_RETURN(c.nvlink, link_fit(*links, "nvlink"));
  DSACP_ASSIGN_OR_RETURN(c.window, link_fit(*links, "window"));
  return c;
}

Result<PlannerCalibration> load_planner_calibration(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return io_error("planner calibration " + json::quote_name(path) + ": cannot open the file");
  std::ostringstream ss;
  ss << in.rdbuf();
  Result<PlannerCalibration> c = parse_planner_calibration(ss.str());
  if (!c.ok()) return c.status().with_context(json::quote_name(path));
  c->path = path;
  return c;
}

namespace {

// Rows of one kernel call: each row's request and key count (the keys it scores or attends over).
struct RowSet {
  int64_t rows = 0;
  double keys = 0;          // sum of key counts
  double longest = 0;       // the longest row
  double request_keys = 0;  // sum over requests of their longest row (the keys a decode reads once)
  double entries = 0;       // sum of min(K, key count): the top-k entries attended
};

struct StepModel {
  const PlannerCalibration& cal;
  const StepConfig& c;
  const PagedCacheConfig& cc;
  bool fp8_index() const { return c.index_input_dtype() == DType::kF8E4M3; }

  double indexer_ms(const RowSet& s, bool prefill) const {
    if (s.rows == 0) return 0;
    const bool hi32 = c.Hi <= 32;
    const KernelFit& f = fp8_index() ? (hi32 ? cal.indexer_fp8_hi32 : cal.indexer_fp8)
                                     : (hi32 ? cal.indexer_bf16_hi32 : cal.indexer_bf16);
    const double key_bytes = c.Di * static_cast<double>(dtype_size(c.index_input_dtype())) + (fp8_index() ? 4 : 0);
    const double flops = 2.0 * c.Hi * c.Di * s.keys;
    const double scores = f.ms(s.request_keys * key_bytes, flops);
    const TopkFit& t = prefill ? cal.topk_prefill : cal.topk_decode;
    return scores + t.ms(s.keys, s.longest);
  }
  // Sparse MLA of `s` rows with `heads` heads over `entries_scale` of each row's top-k entries (a rank's own
  // share of them for attention over its own keys).
  double mla_ms(const RowSet& s, int64_t heads, double entries_scale, bool prefill) const {
    if (s.rows == 0) return 0;
    const double entries = s.entries * entries_scale;
    const double kv_row = cc.fp8_latent() ? fp8_ds_mla_record_bytes(cc.Dl, cc.Dr)
                                          : (cc.Dl + cc.Dr) * static_cast<double>(dtype_size(cc.dtype));
    const double act = static_cast<double>(dtype_size(c.act_dtype)), out = static_cast<double>(dtype_size(c.out_dtype));
    const double bytes = entries * kv_row + s.rows * heads * ((c.Dl + c.Dr) * act + c.Dl * out);
    const double flops = 2.0 * heads * entries * (c.Dl + c.Dr + c.Dl);
    return (prefill ? cal.mla_prefill : cal.mla_decode).ms(bytes, flops);
  }
  double topk_merge_ms(int64_t parts, int64_t rows) const {
    if (rows == 0) return 0;
    return cal.topk_merge.ms(static_cast<double>(parts) * rows * c.K * 8.0, 0);
  }
  double lse_merge_ms(int64_t parts, int64_t rows_heads, double part_bytes) const {
    if (rows_heads == 0) return 0;
    return cal.lse_merge.ms(static_cast<double>(parts) * rows_heads * (c.Dl * part_bytes + 4), 0);
  }
};

RowSet row_set(const std::vector<int32_t>& row_request, const std::vector<int32_t>& key_len, int64_t first,
               int64_t last, int32_t K, const KvSharding* local, int32_t cr) {
  RowSet s;
  std::vector<std::pair<int32_t, double>> per_request;  // (request, longest)
  for (int64_t i = first; i < last; ++i) {
    double k = key_len[i];
    if (k <= 0) continue;  // padding rows
    if (local != nullptr) k = static_cast<double>(local->local_len(key_len[i], cr));
    ++s.rows;
    s.keys += k;
    s.longest = std::max(s.longest, k);
    s.entries += std::min<double>(K, key_len[i]);
    if (per_request.empty() || per_request.back().first != row_request[i]) {
      per_request.emplace_back(row_request[i], k);
    } else {
      per_request.back().second = std::max(per_request.back().second, k);
    }
  }
  for (const auto& pr : per_request) s.request_keys += pr.second;
  return s;
}

bool group_on_one_node(CommGroup g, const CpLayout& l, int32_t cr, int32_t gpn) {
  const int32_t D = l.D, P = l.P, r = cr / D, d = cr % D;
  int32_t lo = cr, hi = cr;
  switch (g) {
    case CommGroup::kWorld: lo = 0; hi = P * D - 1; break;
    case CommGroup::kPcp: lo = d; hi = (P - 1) * D + d; break;
    case CommGroup::kDcp: lo = r * D; hi = r * D + D - 1; break;
  }
  return lo / gpn == hi / gpn;
}

}  // namespace

Result<CpRankPlan> planner_prefill_rank_plan(const Request& req, const CpLayout& layout, int32_t r, int32_t d,
                                             int32_t decode_threshold, int32_t H) {
  DSACP_RETURN_IF_ERROR(validate_layout(layout, H));
  if (r < 0 || r >= layout.P || d < 0 || d >= layout.D) {
    return invalid_argument("CP rank (" + std::to_string(r) + ", " + std::to_string(d) + ") outside the layout");
  }
  CpRankPlan plan;
  plan.P = layout.P;
  plan.D = layout.D;
  plan.r = r;
  plan.d = d;
  plan.cr = r * layout.D + d;
  DSACP_ASSIGN_OR_RETURN(plan.layout, batch_layout({req}, decode_threshold));
  if (plan.layout.num_prefills != 1) return invalid_argument("planner_prefill_rank_plan: the request is a decode");
  const int64_t Q = req.query_len, C = req.context_len;
  if (!layout.dsa_cp) {
    for (int64_t off : pcp_prefill_offsets(Q, layout.P, r)) {
      plan.row_request.push_back(0);
      plan.row_key_len.push_back(off < Q ? static_cast<int32_t>(C + off + 1) : 0);
    }
    plan.num_rows = static_cast<int64_t>(plan.row_key_len.size());
    plan.num_shared_rows = layout.P == 1 ? plan.num_rows : 0;
    plan.num_heads = H / layout.D;
    plan.head_begin = d * plan.num_heads;
    plan.output_rows = std::max(plan.num_rows, layout.graph_bucket_tokens);
    return plan;
  }
  DSACP_ASSIGN_OR_RETURN(DsaCpSlice slice, dsa_cp_slice({req}, layout.D, d));
  for (int64_t t = slice.local_start; t < slice.local_end_with_pad; ++t) {
    plan.row_request.push_back(0);
    plan.row_key_len.push_back(t < Q ? static_cast<int32_t>(C + t + 1) : 0);
  }
  plan.num_rows = slice.local_end_with_pad - slice.local_start;
  plan.num_heads = H;
  for (int64_t t = 0; t < slice.num_tokens_pad; ++t) {
    plan.gathered_request.push_back(t < Q ? 0 : -1);
    plan.gathered_pos.push_back(t < Q ? C + t : -1);
  }
  plan.output_rows = plan.num_rows;
  return plan;
}

Result<StepCost> cp_step_cost(const PlannerCalibration& cal, const StepConfig& c, const std::vector<Request>& requests,
                              const CpLayout& layout, const StepCostOptions& o) {
  DSACP_RETURN_IF_ERROR(validate_layout(layout, c.H));
  const int32_t Pt = layout.num_ranks(), B = o.cache.page_size;
  if (B < 1) return invalid_argument("page size must be >= 1, got " + std::to_string(B));
  const KvSharding sharding{Pt, layout.interleave == 0 ? B : layout.interleave};
  DSACP_ASSIGN_OR_RETURN(BatchLayout bl, batch_layout(requests, c.decode_threshold));
  if (bl.num_tokens < Pt && bl.num_prefills > 0 && bl.num_decodes == 0 && layout.dsa_cp) {
    return invalid_argument("DSA-CP over " + std::to_string(Pt) + " ranks needs at least as many tokens, got " +
                            std::to_string(bl.num_tokens));
  }
  // The shared block table: request b owns consecutive pages.
  BlockTable table;
  table.num_requests = static_cast<int32_t>(requests.size());
  int64_t cols = 1;
  for (const Request& r : requests) cols = std::max(cols, sharding.pages_needed(r.seq_len(), B));
  if (cols * table.num_requests > (int64_t{1} << 31)) return out_of_range("planner: block table past 2^31 entries");
  table.max_pages = static_cast<int32_t>(cols);
  table.data.resize(static_cast<size_t>(cols) * table.num_requests);
  for (size_t i = 0; i < table.data.size(); ++i) table.data[i] = static_cast<int32_t>(i);

  const StepModel m{cal, c, o.cache};
  const bool windows = o.windows && Pt <= o.links.gpus_per_node;
  // Ranks evaluated: every one for small layouts, else the edges of the PCP and DCP groups.
  std::vector<int32_t> ranks;
  if (Pt <= o.all_ranks_up_to) {
    for (int32_t cr = 0; cr < Pt; ++cr) ranks.push_back(cr);
  } else {
    // PCP ranks differ by their head and tail chunks, DSA-CP ranks by the last one's padding, DCP ranks of one PCP
    // rank not at all (heads split evenly): the first and the last rank cover them.
    ranks = {0, Pt - 1};
  }

  StepCost worst;
  worst.step_ms = -1;
  for (int32_t cr : ranks) {
    StepCost sc;
    sc.rank = cr;
    const double host = cal.host_step_us * 1e-3;
    if (Pt == 1) {
      DSACP_ASSIGN_OR_RETURN(SingleDevicePlan p, single_device_plan(requests, table, B, c.decode_threshold));
      const int64_t T = bl.num_tokens, Td = bl.num_decode_tokens;
      sc.kv_ms = cal.kv_phase_us * 1e-3 + cal.kv_phase_ns_per_row * 1e-6 * T;
      const RowSet dec = row_set(p.token_request, p.token_key_len, 0, Td, c.K, nullptr, 0);
      const RowSet pre = row_set(p.token_request, p.token_key_len, Td, T, c.K, nullptr, 0);
      sc.indexer_ms = m.indexer_ms(dec, false) + m.indexer_ms(pre, true);
      sc.attention_ms = m.mla_ms(dec, c.H, 1.0, false) + m.mla_ms(pre, c.H, 1.0, true);
      sc.step_ms = host + sc.kv_ms + sc.indexer_ms + sc.attention_ms;
      if (sc.step_ms > worst.step_ms) worst = sc;
      continue;
    }
    const bool light = o.light_prefill_plans && requests.size() == 1 && bl.num_prefills == 1;
    DSACP_ASSIGN_OR_RETURN(CpRankPlan plan,
                           light ? planner_prefill_rank_plan(requests[0], layout, cr / layout.D, cr % layout.D,
                                                             c.decode_threshold, c.H)
                                 : cp_rank_plan(requests, layout, cr / layout.D, cr % layout.D, table, B,
                                                c.decode_threshold, c.H));
    CommContext ctx;
    ctx.cache = o.cache;
    ctx.windows = windows;
    ctx.light_views = o.light_prefill_plans;
    DSACP_ASSIGN_OR_RETURN(std::vector<PlannedCollective> list,
                           cp_step_collectives(c, requests, layout, plan, table, ctx));
    // Link time of each collective, by what it is.
    auto link_ms = [&](const PlannedCollective& pc) {
      const LinkFit& l = pc.kind == CommKind::kWindow ? cal.window : cal.nvlink;
      if (group_on_one_node(pc.group, layout, cr, o.links.gpus_per_node)) return l.ms(static_cast<double>(pc.bytes));
      return (l.latency_us + o.links.inter_node_latency_us) * 1e-3 +
             static_cast<double>(pc.bytes) / (std::min(l.gbs, o.links.inter_node_gbs) * 1e6);
    };
    auto time_of = [&](const char* what) {
      double t = 0;
      for (const PlannedCollective& pc : list) {
        if (pc.what.rfind(what, 0) == 0) t += link_ms(pc);
      }
      return t;
    };
    for (const PlannedCollective& pc : list) {
      sc.comm_ms += link_ms(pc);
      sc.comm_bytes += pc.bytes;
      sc.collectives += pc.kind == CommKind::kWindow ? 0 : 1;
    }
    const bool replicated = layout.indexer == IndexerMode::kReplicated;
    const int64_t rows = plan.num_rows, Hr = plan.num_heads;
    const int64_t T_dec = layout.dsa_cp ? 0 : plan.pcp.num_local_decode_tokens;
    const bool decode_only = plan.layout.num_prefills == 0;
    const bool local_decodes = layout.decode_mode == DecodeMode::kLocalMerge;
    // The KV exchange gathers its group's rows (cp_step_run checks gathered_pos has as many).
    const int64_t gathered_rows = layout.dsa_cp ? static_cast<int64_t>(plan.gathered_pos.size())
                                                : int64_t{layout.P} * plan.num_rows;

    // DSA-CP: every token of the padded batch (the gathered rows), over own keys (`local`) or all.
    auto gathered_set = [&](const KvSharding* local) {
      std::vector<int32_t> all_req, all_len;
      all_req.reserve(static_cast<size_t>(gathered_rows));
      all_len.reserve(static_cast<size_t>(gathered_rows));
      for (int64_t j = 0; j < gathered_rows; ++j) {
        all_req.push_back(std::max(0, plan.gathered_request[j]));
        all_len.push_back(plan.gathered_pos[j] < 0 ? 0 : static_cast<int32_t>(plan.gathered_pos[j] + 1));
      }
      return row_set(all_req, all_len, 0, gathered_rows, c.K, local, cr);
    };
    // 1. KV exchange (waited), then the cache write of the gathered rows (and the replicated indexer's table).
    double rep_pages = 0;
    if (replicated) {
      for (const Request& r : requests) rep_pages += std::ceil(static_cast<double>(r.seq_len()) / B);
    }
    const double kv_comm = time_of("KV exchange");
    sc.kv_ms = kv_comm + cal.kv_phase_us * 1e-3 + cal.kv_phase_ns_per_row * 1e-6 * gathered_rows +
               cal.replicated_table_ns_per_page * 1e-6 * rep_pages;
    const double t_kv = host + sc.kv_ms;

    // 2-3. Views start after the cache write and overlap the indexer; the top-k.
    double t = t_kv;
    const double kv_view_ready = t_kv + time_of("gathered KV view");
    double q_ready = t_kv + time_of("decode queries along heads") + time_of("queries along tokens");
    if (replicated) {
      const RowSet dec = row_set(plan.row_request, plan.row_key_len, 0, T_dec, c.K, nullptr, 0);
      const RowSet rest = row_set(plan.row_request, plan.row_key_len, T_dec, rows, c.K, nullptr, 0);
      t += m.indexer_ms(dec, false) + m.indexer_ms(rest, !decode_only);
      t += time_of("top-k along tokens");
    } else if (layout.dsa_cp) {
      // The queries along tokens (waited), the local top-k of every token over own keys, candidates, merge.
      t += time_of("indexer queries along tokens");
      const RowSet all = gathered_set(&sharding);
      t += m.indexer_ms(all, !decode_only);
      t += time_of("top-k candidates") + m.topk_merge_ms(Pt, all.rows);
    } else {
      const int64_t shared = plan.num_shared_rows;
      const RowSet own = row_set(plan.row_request, plan.row_key_len, 0, shared, c.K, &sharding, cr);
      const double shared_end = t + m.indexer_ms(own, shared > T_dec);
      double end = shared_end;
      if (shared < rows) {
        // The prefill rows wait for the indexer-key view, gathered since the cache write.
        const RowSet pre = row_set(plan.row_request, plan.row_key_len, shared, rows, c.K, nullptr, 0);
        end = std::max(shared_end, t_kv + time_of("gathered indexer-key view")) + m.indexer_ms(pre, true);
      }
      if (shared > 0) end = std::max(end, shared_end + time_of("top-k candidates")) + m.topk_merge_ms(Pt, own.rows);
      t = end;
    }
    sc.indexer_ms = t - t_kv;

    // 4. Attention: rows over the gathered KV (after its view), then local decodes (own keys, exchange, merge).
    const double t_topk = t;
    const int64_t first_gathered = layout.dsa_cp ? (decode_only ? rows : 0) : (local_decodes ? T_dec : 0);
    if (first_gathered < rows) {
      const RowSet g = row_set(plan.row_request, plan.row_key_len, first_gathered, rows, c.K, nullptr, 0);
      t = std::max(t, kv_view_ready) + m.mla_ms(g, Hr, 1.0, !decode_only);
    }
    const double part_bytes = c.out_dtype == DType::kBF16 ? 2 : 4;
    if (layout.dsa_cp && decode_only) {
      const RowSet all = gathered_set(nullptr);
      t = std::max(t, q_ready) + m.mla_ms(all, c.H, 1.0 / Pt, false);
      t += time_of("partials along tokens") + m.lse_merge_ms(Pt, rows * c.H, 4);
    } else if (!layout.dsa_cp && local_decodes && T_dec > 0) {
      const RowSet dec = row_set(plan.row_request, plan.row_key_len, 0, T_dec, c.K, nullptr, 0);
      t = std::max(t, q_ready) + m.mla_ms(dec, c.H, 1.0 / Pt, false);
      const double window = time_of("decode partials (window)");
      if (window > 0) {
        t += window;  // merged inside attention: no merge kernel
      } else {
        t += time_of("decode partials") + m.lse_merge_ms(Pt, T_dec * Hr, part_bytes);
      }
    }
    sc.attention_ms = t - t_topk;
    sc.step_ms = t;
    if (sc.step_ms > worst.step_ms) worst = sc;
  }
  return worst;
}

}  // namespace dsacp
