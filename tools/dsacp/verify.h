// Direct fp64 check of one token of `dsacp run` against the contract's math, from regenerated values.
#pragma once

#include <cstdint>
#include <string>

#include "workload.h"

namespace dsacp::cli {

struct TokenCheck {
  bool topk_exact = false;      // identical to the fp64 canonical row
  int64_t near_tie_swaps = 0;   // entries that differ only between keys whose fp64 scores are within tolerance
  bool ok = false;              // top-k acceptable and out/lse within tolerance
  double out_rel_err = 0;       // ||out - ref|| / ||ref|| over [H, Dl]
  double lse_abs_err = 0;       // max over heads
  std::string problem;          // why not ok
};

struct CheckTolerance {
  double out_rel = 1e-5;        // contract: fp32 storage
  double lse_abs = 1e-4;
  double score_tie_rel = 1e-5;  // near-tie window, relative to max |score| (fp32 accumulation of Hi*Di terms)
};

// topk_row [K], out [H, Dl] f32, lse [H] for the token at `pos` of `request` (it sees keys [0, pos]).
// fp8_latent: the cache holds fp8_ds_mla records, so the keys' latent is the contract's dequantized one (each
// 128-value tile quantized by the fp32 rule, scale * value) and their rope the bf16 it is stored as.
TokenCheck verify_token(const WorkloadValues& values, int32_t request, int64_t pos, float scale,
                        const int32_t* topk_row, const float* out, const float* lse, const CheckTolerance& tol,
                        bool fp8_latent = false);

}  // namespace dsacp::cli
