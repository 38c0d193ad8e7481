// Replay of one case (contract §4): load the context into paged caches whose pages are placed in a
// shuffled order with NaN in every unused slot, run the step in the given layout, return the result in the
// case's token order (the same whatever the layout).
#pragma once

#include <cstdint>
#include <vector>

#include "dsacp/backend.h"
#include "dsacp/case_file.h"
#include "dsacp/cp_step.h"
#include "dsacp/memory_estimate.h"
#include "dsacp/status.h"

namespace dsacp {

struct ReplayOptions {
  int32_t page_size = 64;
  DType out_dtype = DType::kF32;
  uint64_t page_shuffle_seed = 0x5eed;  // 0 = pages in order
  int32_t spare_pages = 3;              // unused (NaN) pages in the pool besides the ones the batch needs
  CpLayout layout;                      // P = 1: single device
  bool device_block_table = false;      // the step reads the block table from backend memory (StepInputs)
  // Host bytes the replay may plan to take (replay_memory_estimate); 0 = only what the host has available.
  // A case needing more is refused (resource exhausted) before anything is allocated.
  uint64_t max_memory_bytes = 0;
  // The FP8 indexer for a case whose indexer tensors are f32/bf16: they are quantized on load (idx_k, ctx_idx_k
  // per token, idx_q per (token, head), by index_scale_mode; case_quantize_index), so the replay equals the
  // replay of the quantized case. A case in FP8 already replays in FP8 whatever this says.
  bool index_fp8 = false;
  Fp8ScaleMode index_scale_mode = Fp8ScaleMode::kFp32;
  // The fp8_ds_mla latent cache for a case whose ctx_kv_latent is f32/bf16: it is quantized on load per 128-value
  // tile by latent_scale_mode (case_quantize_latent), so the replay equals the replay of the quantized case. A case
  // with an F8_E4M3 ctx_kv_latent replays over fp8_ds_mla whatever this says. The new tokens' latent is quantized
  // by the step's cache write with the same rule.
  bool latent_fp8 = false;
  Fp8ScaleMode latent_scale_mode = Fp8ScaleMode::kFp32;
  // Serving options (StepConfig): the result's top-k form and LSE base; a precomputed top-k (I32 [T, K],
  // canonical rows in the case's token order, e.g. a canonical result's topk_indices) that replaces the indexer.
  TopkForm topk_form = TopkForm::kCanonical;
  LseBase lse_base = LseBase::kNatural;
  const Tensor* topk = nullptr;
};

// The memory a replay of `c` plans to take on `ranks_here` ranks (every rank: replay_case; 1: replay_case_rank),
// from the case's dims alone: the caches, the inputs in the compute dtype, the step's buffers and the result.
MemoryEstimate replay_memory_estimate(const CaseFile& c, const ReplayOptions& options, int32_t ranks_here);

// The dtype the step computes in: BF16 when every float input of the case is BF16, else F32
// (so no value the user handed in is rounded).
DType case_compute_dtype(const CaseFile& c);

Result<StepResult> replay_case(Backend& backend, const CaseFile& c, const ReplayOptions& options);
// The same with CP rank cr on rank_backends[cr] (P * D backends; GPUs on different devices talk through NCCL).
Result<StepResult> replay_case(const std::vector<Backend*>& rank_backends, const CaseFile& c,
                               const ReplayOptions& options);

// One CP rank of the replay in a process of its own (`dsacp replay --launcher mpi`). Every process of the
// layout calls it with the same case and options: comms.world has P*D ranks (world rank cr = r*D + d),
// comms.pcp is its PCP group (rank r), comms.dcp its DCP group (rank d). Each process builds the same block
// table (seeded allocator) and loads only its own rank's share of the context; the ranks' results are
// all-gathered as raw bytes over comms.world (through the backend's memory: host or, under NCCL, device). World rank 0 returns the full result (the same as
// replay_case's), every other rank an empty StepResult.
Result<StepResult> replay_case_rank(Backend& backend, const CaseFile& c, const ReplayOptions& options,
                                    const CpComms& comms);

}  // namespace dsacp
