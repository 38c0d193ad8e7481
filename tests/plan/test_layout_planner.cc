// The planner's cost model and layout search: the light prefill plans equal the executor's plans, the calibration
// file parses (and a bad one is refused naming the field), refused configurations answer in one line.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dsacp/layout_planner.h"

namespace dsacp {
namespace {

PlannerCalibration test_calibration() {
  // The repo's calibration file, so the tests exercise what `dsacp plan` reads.
  auto c = load_planner_calibration(std::string(DSACP_SOURCE_DIR) + "/calibration/h200.json");
  EXPECT_TRUE(c.ok()) << c.status().to_string();
  return c.ok() ? *c : PlannerCalibration{};
}

StepConfig deepseek_config() {
  return step_config_of(kDeepSeekV32Dims, kDeepSeekV32TopK, 0.f, DType::kBF16, DType::kBF16);
}

TEST(LayoutPlanner, LightPrefillPlansEqualTheExecutorsPlans) {
  const int32_t H = 128;
  for (const Request& req : {Request{8192, 0}, Request{8191, 40000}, Request{17, 3}, Request{33000, 1 << 20}}) {
    for (auto [P, D, dsa] : {std::tuple{1, 2, false}, std::tuple{2, 1, false}, std::tuple{4, 2, false},
                             std::tuple{8, 1, false}, std::tuple{1, 4, true}, std::tuple{1, 7, true}}) {
      CpLayout l;
      l.P = P;
      l.D = D;
      l.dsa_cp = dsa;
      const KvSharding s{l.num_ranks(), 64};
      BlockTable t;
      t.num_requests = 1;
      t.max_pages = static_cast<int32_t>(s.pages_needed(req.seq_len(), 64));
      for (int32_t i = 0; i < t.max_pages; ++i) t.data.push_back(i);
      for (int32_t cr = 0; cr < l.num_ranks(); ++cr) {
        SCOPED_TRACE(layout_name(l) + " rank " + std::to_string(cr) + " Q " + std::to_string(req.query_len));
        auto full = cp_rank_plan({req}, l, cr / D, cr % D, t, 64, kMaxDecodeThreshold, H);
        auto light = planner_prefill_rank_plan(req, l, cr / D, cr % D, kMaxDecodeThreshold, H);
        ASSERT_TRUE(full.ok() && light.ok());
        EXPECT_EQ(full->num_rows, light->num_rows);
        EXPECT_EQ(full->num_shared_rows, light->num_shared_rows);
        EXPECT_EQ(full->num_heads, light->num_heads);
        EXPECT_EQ(full->head_begin, light->head_begin);
        EXPECT_EQ(full->output_rows, light->output_rows);
        EXPECT_EQ(full->row_request, light->row_request);
        EXPECT_EQ(full->row_key_len, light->row_key_len);
        if (dsa) {
          EXPECT_EQ(full->gathered_pos, light->gathered_pos);
          EXPECT_EQ(full->gathered_request, light->gathered_request);
        } else {
          EXPECT_EQ(static_cast<int64_t>(full->gathered_pos.size()), int64_t{P} * full->num_rows);
        }
      }
    }
  }
}

TEST(LayoutPlanner, LightPlansGiveTheSameStepCost) {
  const PlannerCalibration cal = test_calibration();
  const StepConfig c = deepseek_config();
  StepCostOptions exact;
  exact.cache = PagedCacheConfig{0, 64, 512, 64, 128, DType::kBF16};
  StepCostOptions light = exact;
  light.light_prefill_plans = true;
  for (const Request& req : {Request{16384, 0}, Request{8192, 100000}, Request{100, 5000}}) {
    for (auto [P, D, dsa, mode] : {std::tuple{2, 1, false, IndexerMode::kSharded},
                                   std::tuple{1, 4, false, IndexerMode::kSharded},
                                   std::tuple{2, 2, false, IndexerMode::kReplicated},
                                   std::tuple{1, 4, true, IndexerMode::kSharded},
                                   std::tuple{1, 3, true, IndexerMode::kReplicated}}) {
      CpLayout l;
      l.P = P;
      l.D = D;
      l.dsa_cp = dsa;
      l.indexer = mode;
      SCOPED_TRACE(layout_name(l) + " Q " + std::to_string(req.query_len));
      auto a = cp_step_cost(cal, c, {req}, l, exact);
      auto b = cp_step_cost(cal, c, {req}, l, light);
      ASSERT_TRUE(a.ok() && b.ok()) << a.status().to_string() << b.status().to_string();
      EXPECT_EQ(a->comm_bytes, b->comm_bytes);
      EXPECT_EQ(a->collectives, b->collectives);
      EXPECT_DOUBLE_EQ(a->step_ms, b->step_ms);
    }
  }
}

TEST(LayoutPlanner, CostGrowsWithContextAndShrinksWithRanks) {
  const PlannerCalibration cal = test_calibration();
  const StepConfig c = deepseek_config();
  StepCostOptions o;
  o.cache = PagedCacheConfig{0, 64, 512, 64, 128, DType::kBF16};
  const std::vector<Request> short_ctx(64, Request{1, 32767}), long_ctx(64, Request{1, 131071});
  CpLayout one, d2;
  d2.D = 2;
  auto a = cp_step_cost(cal, c, short_ctx, one, o);
  auto b = cp_step_cost(cal, c, long_ctx, one, o);
  auto e = cp_step_cost(cal, c, long_ctx, d2, o);
  ASSERT_TRUE(a.ok() && b.ok() && e.ok());
  EXPECT_LT(a->step_ms, b->step_ms);
  EXPECT_LT(e->step_ms, b->step_ms);  // the sharded indexer halves the scores
  EXPECT_GT(e->comm_bytes, 0);
}

TEST(LayoutPlanner, CalibrationErrorsNameTheField) {
  auto bad = parse_planner_calibration("{\"format\": \"dsacp-planner-calibration\", \"version\": 1, \"memory_gib\": 1}");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("kernels"), std::string::npos) << bad.status().message();
  auto wrong = parse_planner_calibration("{\"format\": \"other\"}");
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("format"), std::string::npos);
  EXPECT_FALSE(load_planner_calibration("/nonexistent/h200.json").ok());
}

PlanQuery deepseek_query(int64_t context, int32_t gpus) {
  PlanQuery q;
  q.model = *model_dims("deepseek-v3.2");
  q.context = context;
  q.gpus = gpus;
  return q;
}

void expect_one_line(const Status& s, const std::string& needle) {
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.message().find('\n'), std::string::npos);
  EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
}

TEST(LayoutPlanner, RefusedConfigurationsAnswerInOneLine) {
  const PlannerCalibration cal = test_calibration();
  expect_one_line(plan_layouts(deepseek_query(4, 8), cal).status(), "more ranks than tokens");
  PlanQuery heads = deepseek_query(100000, 8);
  heads.fixed = true;
  heads.fixed_layout.D = 3;  // 128 heads over 3 ranks
  heads.gpus = 3;
  expect_one_line(plan_layouts(heads, cal).status(), "multiple of D");
  PlanQuery mem = deepseek_query(1 << 20, 8);
  mem.batch = 64;
  mem.memory_per_gpu_gib = 1;
  expect_one_line(plan_layouts(mem, cal).status(), "memory too small");
  expect_one_line(model_dims("llama").status(), "unknown model");
}

TEST(LayoutPlanner, RanksEveryLayoutAndSaysWhyTheOthersLose) {
  const PlannerCalibration cal = test_calibration();
  for (const char* model : {"deepseek-v3.2", "glm-5"}) {
    for (int32_t gpus : {8, 64}) {
      PlanQuery q = deepseek_query(1 << 20, gpus);
      q.model = *model_dims(model);
      auto a = plan_layouts(q, cal);
      ASSERT_TRUE(a.ok()) << a.status().to_string();
      ASSERT_EQ(a->chosen, 0);
      const LayoutChoice& best = a->layouts[0];
      EXPECT_TRUE(best.feasible);
      EXPECT_GT(best.ttft_ms, 0);
      EXPECT_GT(best.tpot_ms, 0);
      EXPECT_GT(best.kv_bytes_per_gpu, 0u);
      EXPECT_TRUE(best.loses.empty());
      for (size_t i = 1; i < a->layouts.size(); ++i) EXPECT_FALSE(a->layouts[i].loses.empty()) << a->layouts[i].name;
      EXPECT_EQ(static_cast<int64_t>(a->layouts.size()), a->layouts_considered);
    }
  }
}

}  // namespace
}  // namespace dsacp
