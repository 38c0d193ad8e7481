// The planner's collectives of a step (cp_step_collectives) against what the executor counts: every layout up
// to 8 ranks, decode, MTP, chunked-prefill and mixed batches, run on the thread transport; collectives and bytes
// of each rank's world, PCP and DCP communicators equal exactly.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dsacp/case_file.h"
#include "dsacp/cp_step.h"
#include "dsacp/layout_planner.h"
#include "dsacp/paged_cache.h"
#include "support/layout_check.h"

namespace dsacp {
namespace {

struct Batch {
  const char* name;
  std::vector<Request> requests;
};

std::vector<Batch> batches() {
  return {
      {"decode", {{1, 40}, {1, 7}, {1, 100}}},
      {"mtp", {{2, 33}, {3, 90}, {1, 12}}},
      {"chunked_prefill", {{24, 50}, {9, 0}}},
      {"mixed", {{1, 60}, {2, 21}, {17, 30}, {5, 0}}},
  };
}

std::vector<CpLayout> layouts_up_to_8(int32_t H) {
  std::vector<CpLayout> out;
  for (int32_t Pt = 2; Pt <= 8; ++Pt) {
    for (int32_t P = 1; P <= Pt; ++P) {
      if (Pt % P != 0) continue;
      const int32_t D = Pt / P;
      for (IndexerMode mode : {IndexerMode::kSharded, IndexerMode::kReplicated}) {
        CpLayout l;
        l.P = P;
        l.D = D;
        l.indexer = mode;
        if (H % D == 0) out.push_back(l);
        if (P == 1) {
          CpLayout dsa = l;
          dsa.dsa_cp = true;
          out.push_back(dsa);
        }
        if (D == 1 && mode == IndexerMode::kSharded) {
          CpLayout gathered = l;
          gathered.decode_mode = DecodeMode::kGathered;
          out.push_back(gathered);
          CpLayout rows = l;
          rows.interleave = 3;  // row-granular gathered views
          out.push_back(rows);
        }
      }
    }
  }
  return out;
}

std::string describe(const CpLayout& l, const char* batch) {
  return layout_name(l) + (l.decode_mode == DecodeMode::kGathered ? " gathered-decodes" : "") + " I" +
         std::to_string(l.interleave) + " / " + batch;
}

TEST(StepCollectives, EqualTheExecutorsCountsForEveryLayoutUpTo8Ranks) {
  constexpr int32_t H = 8, B = 4;
  auto backend = make_cpu_backend(1);
  int checked = 0;
  for (const Batch& batch : batches()) {
    CaseGenSpec spec;
    spec.requests = batch.requests;
    spec.dims = CaseDims{H, 16, 8, 2, 8};
    spec.topk = 8;
    auto c = case_generate(spec);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    const StepConfig sc = testing::f32_step_config(*c);
    const HostStepInputs in = testing::case_inputs(*c);
    for (const CpLayout& layout : layouts_up_to_8(H)) {
      SCOPED_TRACE(describe(layout, batch.name));
      const KvSharding s{layout.num_ranks(), layout.interleave == 0 ? B : layout.interleave};
      PagedCacheConfig cc{0, B, 16, 8, 8, DType::kF32};
      std::vector<int32_t> pages;
      for (const Request& r : batch.requests) {
        pages.push_back(static_cast<int32_t>(s.pages_needed(r.seq_len(), B)));
        cc.num_pages += pages.back();
      }
      // Request b owns consecutive pages.
      BlockTable table;
      table.num_requests = static_cast<int32_t>(batch.requests.size());
      table.max_pages = *std::max_element(pages.begin(), pages.end());
      table.data.assign(static_cast<size_t>(table.num_requests) * table.max_pages, -1);
      int32_t next = 0;
      for (int32_t b = 0; b < table.num_requests; ++b) {
        for (int32_t p = 0; p < pages[b]; ++p) table.data[static_cast<size_t>(b) * table.max_pages + p] = next++;
      }
      auto cluster = LocalCpCluster::create(*backend, layout, cc);
      ASSERT_TRUE(cluster.ok()) << cluster.status().to_string();
      ASSERT_TRUE((*cluster)->load_context(batch.requests, table, c->ctx_kv_latent, c->ctx_k_rope, c->ctx_idx_k).ok());
      auto r = (*cluster)->step(sc, batch.requests, table, in);
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      const auto& stats = (*cluster)->last_step_group_comm_stats();
      ASSERT_EQ(static_cast<int32_t>(stats.size()), layout.num_ranks());
      CommContext ctx;
      ctx.cache = cc;
      for (int32_t cr = 0; cr < layout.num_ranks(); ++cr) {
        auto plan = cp_rank_plan(batch.requests, layout, cr / layout.D, cr % layout.D, table, B, sc.decode_threshold, H);
        ASSERT_TRUE(plan.ok()) << plan.status().to_string();
        auto list = cp_step_collectives(sc, batch.requests, layout, *plan, table, ctx);
        ASSERT_TRUE(list.ok()) << list.status().to_string();
        const CommStats* got[3] = {&stats[cr].world, &stats[cr].pcp, &stats[cr].dcp};
        for (CommGroup g : {CommGroup::kWorld, CommGroup::kPcp, CommGroup::kDcp}) {
          const CollectiveTotals want = collective_totals(*list, g);
          const CommStats& have = *got[static_cast<int>(g)];
          EXPECT_EQ(want.windows, 0);
          EXPECT_EQ(want.collectives, have.collectives) << "rank " << cr << " " << comm_group_name(g) << " collectives";
          EXPECT_EQ(want.bytes, have.bytes) << "rank " << cr << " " << comm_group_name(g) << " bytes";
        }
        EXPECT_EQ(collective_totals(*list, CommGroup::kWorld).bytes, (*cluster)->last_step_comm_stats()[cr].bytes);
      }
      ++checked;
    }
  }
  EXPECT_GT(checked, 150);
}

// With exchange windows (NCCL ranks on one host) the DCP decode's candidates and partials go through windows,
// which count apart; the PCP layouts keep their collectives.
TEST(StepCollectives, WindowsReplaceTheDcpDecodeExchanges) {
  const std::vector<Request> reqs(4, Request{1, 200});
  const StepConfig c = step_config_of(kDeepSeekV32Dims, kDeepSeekV32TopK, 1.f, DType::kBF16, DType::kBF16);
  CpLayout l;
  l.D = 2;
  BlockTable t;
  t.num_requests = 4;
  t.max_pages = 2;
  t.data = {0, 1, 2, 3, 4, 5, 6, 7};
  auto plan = cp_rank_plan(reqs, l, 0, 0, t, 64, c.decode_threshold, c.H);
  ASSERT_TRUE(plan.ok());
  CommContext ctx;
  ctx.cache = PagedCacheConfig{8, 64, 512, 64, 128, DType::kBF16};
  ctx.windows = true;
  auto list = cp_step_collectives(c, reqs, l, *plan, t, ctx);
  ASSERT_TRUE(list.ok());
  const CollectiveTotals w = collective_totals(*list, CommGroup::kWorld);
  EXPECT_EQ(w.windows, 2);
  EXPECT_EQ(w.collectives, 0);
  EXPECT_EQ(collective_totals(*list, CommGroup::kDcp).collectives, 1);  // the queries along heads
}

}  // namespace
}  // namespace dsacp
