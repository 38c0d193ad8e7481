// The case file (contract §4): one batch step as safetensors, and the result file.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dsacp/batch.h"
#include "dsacp/fp8.h"
#include "dsacp/safetensors.h"
#include "dsacp/status.h"
#include "dsacp/tensor.h"

namespace dsacp {

struct CaseDims {
  int32_t H = 0, Dl = 0, Dr = 0, Hi = 0, Di = 0;
};

struct CaseFile {
  std::vector<Request> requests;  // from query_lens, context_lens
  int32_t topk = 0;               // __metadata__ "topk" (K >= 1)
  float scale = 0.f;              // __metadata__ "scale" (finite)
  CaseDims dims;
  Tensor q_nope;         // [T, H, Dl], BF16 or F32
  Tensor q_rope;         // [T, H, Dr]
  Tensor kv_latent;      // [T, Dl]
  Tensor k_rope;         // [T, Dr]
  Tensor idx_q;          // [T, Hi, Di]
  Tensor idx_w;          // [T, Hi], F32
  Tensor idx_k;          // [T, Di]
  Tensor ctx_kv_latent;  // [sum C, Dl]
  Tensor ctx_k_rope;     // [sum C, Dr]
  Tensor ctx_idx_k;      // [sum C, Di]
  // The FP8 indexer (contract section 6): idx_q, idx_k and ctx_idx_k are F8_E4M3 together, with these F32
  // scales (each positive and finite; empty tensors otherwise).
  Tensor idx_q_scale;      // [T, Hi]
  Tensor idx_k_scale;      // [T]
  Tensor ctx_idx_k_scale;  // [sum C]
  bool index_fp8() const { return idx_k.dtype() == DType::kF8E4M3 && idx_k.data() != nullptr; }
  // The fp8_ds_mla latent cache: ctx_kv_latent F8_E4M3 with one F32 scale a 128-value tile (positive, finite;
  // empty otherwise). The new tokens' kv_latent stays f32/bf16 (the step quantizes it into the cache).
  Tensor ctx_kv_latent_scale;  // [sum C, Dl / 128]
  bool latent_fp8() const { return ctx_kv_latent.dtype() == DType::kF8E4M3 && ctx_kv_latent.data() != nullptr; }

  int64_t num_tokens() const { return q_nope.numel() == 0 && q_nope.shape().empty() ? 0 : q_nope.dim(0); }
};

// Validates names, dtypes, shapes and lengths; one-line errors such as
// "case: tensor \"q_rope\" has shape [5, 2, 8], expected [T=6, H=2, Dr=8]" or
// "case: __metadata__ has no \"topk\"".
Result<CaseFile> case_from_safetensors(SafetensorsFile file);
Result<CaseFile> case_read(const std::string& path);
Result<SafetensorsFile> case_to_safetensors(const CaseFile& c);
Status case_write(const std::string& path, const CaseFile& c);

// Parameters of a random case (counter-based values, so the same seed gives the same case).
struct CaseGenSpec {
  std::vector<Request> requests;
  CaseDims dims{4, 32, 16, 4, 32};
  int32_t topk = 64;
  float scale = 0.125f;
  DType dtype = DType::kF32;  // of every float tensor except idx_w (always F32)
  uint64_t seed = 1;
};
Result<CaseFile> case_generate(const CaseGenSpec& spec);

// Turns a case's f32/bf16 indexer tensors into the FP8 format in place: idx_k and ctx_idx_k quantized per token,
// idx_q per (token, head), each group with its own scale by `mode` (dsacp/fp8.h); the scale tensors are set.
// A case already in FP8 is left as it is.
Status case_quantize_index(CaseFile& c, Fp8ScaleMode mode = Fp8ScaleMode::kFp32);

// Turns a case's f32/bf16 ctx_kv_latent into the fp8_ds_mla format in place: quantized per 128-value tile by
// `mode`, ctx_kv_latent_scale set (Dl a multiple of 128). A case with an FP8 latent already is left as it is.
Status case_quantize_latent(CaseFile& c, Fp8ScaleMode mode = Fp8ScaleMode::kFp32);
// The forms a step's outputs come in (StepConfig::topk_form, lse_base).
enum class TopkForm {
  kCanonical,  // request-relative key positions (the contract's canonical rows)
  kSlot,       // FlashMLA's global-slot form: page * page_size + offset in the KV cache, -1 padded
};
enum class LseBase {
  kNatural,  // ln sum exp (the default)
  kTwo,      // log2 sum 2^x over logits in log2 units, as FlashInfer returns it: the natural LSE * kLog2E
};
const char* topk_form_name(TopkForm f);  // "canonical", "slot"
const char* lse_base_name(LseBase b);    // "e", "2"

struct StepResult {
  Tensor topk_indices;  // [T, K], I32
  Tensor out;           // [T, H, Dl], F32 or BF16
  Tensor lse;           // [T, H], F32
  // What topk_indices and lse hold. A result file records a form other than the default in its __metadata__
  // ("topk_form": "slot", "lse_base": "2"); a default result has no metadata.
  TopkForm topk_form = TopkForm::kCanonical;
  LseBase lse_base = LseBase::kNatural;
};
Status result_write(const std::string& path, const StepResult& r);
Result<StepResult> result_read(const std::string& path);

}  // namespace dsacp
