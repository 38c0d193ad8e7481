// What dsacp_bench_cp and dsacp_bench_host_step share: the DeepSeek-V3.2 step configuration they time (H=128,
// Dl=512, Dr=64, Hi=64, Di=128, K=2048, bf16), a block table whose requests own consecutive pages, and a step's
// input and output buffers (allocated; filling them is the caller's business).
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "dsacp/backend.h"
#include "dsacp/paged_cache.h"
#include "dsacp/step.h"

namespace dsacp::bench {

inline StepConfig decode_step_config() {
  return step_config_of(kDeepSeekV32Dims, kDeepSeekV32TopK, 0.0723f, DType::kBF16, DType::kBF16);
}

// Request b owns pages [b * pages, (b + 1) * pages).
inline BlockTable ordered_table(int32_t R, int32_t pages) {
  BlockTable t;
  t.num_requests = R;
  t.max_pages = pages;
  t.data.resize(static_cast<size_t>(R) * pages);
  std::iota(t.data.begin(), t.data.end(), 0);
  return t;
}

// A rank's (or the one GPU's) step buffers: `rows` rows of `heads` heads, `out_rows` output rows (bf16 acts).
// `table`, when set, is the block table kept on the device between steps (StepInputs::block_table).
struct StepBuffers {
  DeviceBuffer q_nope, q_rope, kv, kr, iq, iw, ik, topk, out, lse, table;
  StepInputs in() const {
    return {q_nope.get(), q_rope.get(), kv.get(), kr.get(), iq.get(), iw.as<const float>(), ik.get(),
            table.as<const int32_t>()};
  }
  StepOutputs outs() const { return {topk.as<int32_t>(), out.get(), lse.as<float>()}; }
};

inline Result<StepBuffers> allocate_step_buffers(Backend& be, const StepConfig& c, int64_t rows, int64_t heads,
                                                 int64_t out_rows) {
  const size_t bf = 2;
  const int64_t out_n = std::max<int64_t>(out_rows, 1);
  StepBuffers b;
  DSACP_ASSIGN_OR_RETURN(b.q_nope, be.allocate(std::max<size_t>(rows * heads * c.Dl * bf, 2)));
  DSACP_ASSIGN_OR_RETURN(b.q_rope, be.allocate(std::max<size_t>(rows * heads * c.Dr * bf, 2)));
  DSACP_ASSIGN_OR_RETURN(b.kv, be.allocate(std::max<size_t>(rows * c.Dl * bf, 2)));
  DSACP_ASSIGN_OR_RETURN(b.kr, be.allocate(std::max<size_t>(rows * c.Dr * bf, 2)));
  DSACP_ASSIGN_OR_RETURN(b.iq, be.allocate(std::max<size_t>(rows * c.Hi * c.Di * bf, 2)));
  DSACP_ASSIGN_OR_RETURN(b.iw, be.allocate(std::max<int64_t>(rows * c.Hi, 1) * sizeof(float)));
  DSACP_ASSIGN_OR_RETURN(b.ik, be.allocate(std::max<size_t>(rows * c.Di * bf, 2)));
  DSACP_ASSIGN_OR_RETURN(b.topk, be.allocate(out_n * c.K * 4));
  DSACP_ASSIGN_OR_RETURN(b.out, be.allocate(out_n * heads * c.Dl * bf));
  DSACP_ASSIGN_OR_RETURN(b.lse, be.allocate(out_n * heads * 4));
  return b;
}

// Puts `table` on the device as the buffers' device block table.
inline Status keep_table_on_device(Backend& be, const BlockTable& table, StepBuffers& b) {
  DSACP_ASSIGN_OR_RETURN(b.table, be.allocate(std::max<size_t>(table.data.size() * sizeof(int32_t), 4)));
  return be.copy_to_device(b.table.get(), table.data.data(), table.data.size() * sizeof(int32_t));
}

}  // namespace dsacp::bench
