// The serving options on a GPU (StepConfig::topk_form, lse_base; StepInputs::topk): the CPU tests' checks
// (tests/layer/test_serving_options.cc) on one GPU and on CP layouts with every rank on that GPU.
#pragma once

#include <cstdint>

#include "dsacp/backend.h"
#include "gpu/check_log.h"

namespace dsacp::testing {

void gpu_serving_checks(Backend& gpu, Backend& cpu, uint64_t seed, CheckLog& log);
// CudaBackendOptions::stream: a backend on the caller's stream against `gpu` (a default backend).
void gpu_external_stream_checks(Backend& gpu, uint64_t seed, CheckLog& log);
// PagedKvCache::wrap of one [num_pages, page_size, kv_row] bf16 buffer (latent then rope, with and without
// padding), H = 64 and 16: the step's results equal the library pools' bit for bit.
void gpu_combined_kv_checks(Backend& gpu, uint64_t seed, CheckLog& log);

}  // namespace dsacp::testing
