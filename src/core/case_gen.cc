// Random cases from counter-based values: element i of tensor `id` is counter_uniform(seed, id, i), so a
// rank (or a verifier) can regenerate any element of any tensor without the rest.
//
// Every input is uniform in [-1, 1) (rounded to bf16 for bf16 cases, so the stored value is the value):
// dot products over D terms then spread with standard deviation ~ sqrt(D)/3, which keeps index scores
// well apart (ties are rare) and attention logits in a range where the softmax is neither flat nor one-hot
// for the usual scale ~ D^-0.5.
#include <algorithm>
#include <cmath>
#include <limits>

#include "core/parallel.h"
#include "dsacp/case_file.h"
#include "dsacp/random.h"

namespace dsacp {
namespace {

// Stream ids: the tensor's position in the contract's table (query_lens = 0, context_lens = 1, ...).
enum TensorId : uint64_t {
  kQNope = 2,
  kQRope,
  kKvLatent,
  kKRope,
  kIdxQ,
  kIdxW,
  kIdxK,
  kCtxKvLatent,
  kCtxKRope,
  kCtxIdxK,
};

Result<Tensor> random_tensor(DType dtype, Shape shape, uint64_t seed, uint64_t stream) {
  DSACP_ASSIGN_OR_RETURN(Tensor t, Tensor::zeros(dtype, std::move(shape)));
  void* data = t.data();
  parallel_for(t.numel(), 0, int64_t{1} << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) store_from_f32(data, dtype, i, counter_uniform(seed, stream, i));
  });
  return t;
}

}  // namespace

Result<CaseFile> case_generate(const CaseGenSpec& spec) {
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  if (spec.requests.empty()) return invalid_argument("case_generate: no requests");
  int64_t T = 0, sum_c = 0;
  for (size_t r = 0; r < spec.requests.size(); ++r) {
    const Request& q = spec.requests[r];
    if (q.query_len < 1 || q.context_len < 0 || q.seq_len() > kInt32Max) {
      return invalid_argument("case_generate: request " + std::to_string(r) + " has query_len " +
                              std::to_string(q.query_len) + ", context_len " + std::to_string(q.context_len) +
                              " (need query_len >= 1, context_len >= 0, seq_len < 2^31)");
    }
    T += q.query_len;
    sum_c += q.context_len;
  }
  if (T > kInt32Max)
    return invalid_argument("case_generate: " + std::to_string(T) + " query tokens, more than 2^31 - 1");
  const CaseDims& d = spec.dims;
  if (d.H < 1 || d.Dl < 1 || d.Dr < 1 || d.Hi < 1 || d.Di < 1) {
    return invalid_argument("case_generate: dims must be >= 1, got " +
                            dims_to_string({{"H", d.H}, {"Dl", d.Dl}, {"Dr", d.Dr}, {"Hi", d.Hi}, {"Di", d.Di}}));
  }
  if (spec.topk < 1) return invalid_argument("case_generate: topk must be >= 1, got " + std::to_string(spec.topk));
  if (!std::isfinite(spec.scale)) return invalid_argument("case_generate: scale must be finite");
  if (spec.dtype != DType::kF32 && spec.dtype != DType::kBF16) {
    return invalid_argument(std::string("case_generate: dtype must be F32 or BF16, got ") + dtype_name(spec.dtype));
  }

  CaseFile c;
  c.requests = spec.requests;
  c.topk = spec.topk;
  c.scale = spec.scale;
  c.dims = d;
  const DType f = spec.dtype;
  const uint64_t s = spec.seed;
  DSACP_ASSIGN_OR_RETURN(c.q_nope, random_tensor(f, {T, d.H, d.Dl}, s, kQNope));
  DSACP_ASSIGN_OR_RETURN(c.q_rope, random_tensor(f, {T, d.H, d.Dr}, s, kQRope));
  DSACP_ASSIGN_OR_RETURN(c.kv_latent, random_tensor(f, {T, d.Dl}, s, kKvLatent));
  DSACP_ASSIGN_OR_RETURN(c.k_rope, random_tensor(f, {T, d.Dr}, s, kKRope));
  DSACP_ASSIGN_OR_RETURN(c.idx_q, random_tensor(f, {T, d.Hi, d.Di}, s, kIdxQ));
  DSACP_ASSIGN_OR_RETURN(c.idx_w, random_tensor(DType::kF32, {T, d.Hi}, s, kIdxW));
  DSACP_ASSIGN_OR_RETURN(c.idx_k, random_tensor(f, {T, d.Di}, s, kIdxK));
  DSACP_ASSIGN_OR_RETURN(c.ctx_kv_latent, random_tensor(f, {sum_c, d.Dl}, s, kCtxKvLatent));
  DSACP_ASSIGN_OR_RETURN(c.ctx_k_rope, random_tensor(f, {sum_c, d.Dr}, s, kCtxKRope));
  DSACP_ASSIGN_OR_RETURN(c.ctx_idx_k, random_tensor(f, {sum_c, d.Di}, s, kCtxIdxK));
  return c;
}

namespace {

// rows [n, group] of t (f32 or bf16) -> e4m3 codes and one scale per row (with `tiles`, groups of a row's last
// dim: the scales [..., last / group]).
Status quantize_rows(const Tensor& t, int64_t group, Fp8ScaleMode mode, Tensor* codes, Tensor* scales,
                     bool tiles = false) {
  const int64_t n = group > 0 ? t.numel() / group : 0;
  DSACP_ASSIGN_OR_RETURN(*codes, Tensor::zeros(DType::kF8E4M3, t.shape()));
  Shape sshape(t.shape().begin(), t.shape().end() - 1);
  if (tiles && !t.shape().empty()) sshape.push_back(t.shape().back() / group);
  DSACP_ASSIGN_OR_RETURN(*scales, Tensor::zeros(DType::kF32, sshape));
  uint8_t* q = static_cast<uint8_t*>(codes->data());
  float* sc = scales->data_as<float>();
  parallel_for(n, 0, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float amax = 0.f;
      for (int64_t i = 0; i < group; ++i) {
        amax = std::max(amax, fp8_amax_term(load_as_f32(t.data(), t.dtype(), r * group + i)));
      }
      const float s = fp8_scale_from_amax(amax, mode);
      sc[r] = s;
      for (int64_t i = 0; i < group; ++i) {
        q[r * group + i] = fp8_quantize(load_as_f32(t.data(), t.dtype(), r * group + i), s);
      }
    }
  });
  return Status();
}

}  // namespace

Status case_quantize_index(CaseFile& c, Fp8ScaleMode mode) {
  if (c.index_fp8()) return Status();
  const int64_t di = c.dims.Di;
  Tensor q, k, ck;
  DSACP_RETURN_IF_ERROR(quantize_rows(c.idx_q, di, mode, &q, &c.idx_q_scale));
  DSACP_RETURN_IF_ERROR(quantize_rows(c.idx_k, di, mode, &k, &c.idx_k_scale));
  DSACP_RETURN_IF_ERROR(quantize_rows(c.ctx_idx_k, di, mode, &ck, &c.ctx_idx_k_scale));
  c.idx_q = std::move(q);
  c.idx_k = std::move(k);
  c.ctx_idx_k = std::move(ck);
  return Status();
}

Status case_quantize_latent(CaseFile& c, Fp8ScaleMode mode) {
  if (c.latent_fp8()) return Status();
  if (c.dims.Dl % kFp8DsMlaTile != 0) {
    return invalid_argument("fp8_ds_mla needs Dl a multiple of 128 (one scale a 128-value tile), the case has Dl=" +
                            std::to_string(c.dims.Dl));
  }
  Tensor q;
  DSACP_RETURN_IF_ERROR(quantize_rows(c.ctx_kv_latent, kFp8DsMlaTile, mode, &q, &c.ctx_kv_latent_scale, true));
  c.ctx_kv_latent = std::move(q);
  return Status();
}

}  // namespace dsacp
