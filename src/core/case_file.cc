// The case file (contract §4) and the result file: validation on top of safetensors.
//
// Both loaders accept exactly the tensors the contract lists (a missing one and an extra one are both
// refused: nothing the user hands in is silently ignored) and check every dtype and shape against the dims
// derived from the file, so everything downstream can index without further checks.
#include "dsacp/case_file.h"

#include <array>
#include <charconv>
#include <cmath>
#include <limits>

#include "core/json.h"

namespace dsacp {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

// The case tensors in the contract's order; missing ones are reported in this order.
constexpr std::array<const char*, 12> kCaseTensors = {"query_lens", "context_lens",  "q_nope",     "q_rope",
                                                      "kv_latent",  "k_rope",        "idx_q",      "idx_w",
                                                      "idx_k",      "ctx_kv_latent", "ctx_k_rope", "ctx_idx_k"};
// The FP8 indexer's scale tensors (contract section 6): present exactly when idx_q is F8_E4M3.
constexpr std::array<const char*, 3> kFp8ScaleTensors = {"idx_q_scale", "idx_k_scale", "ctx_idx_k_scale"};
// The fp8_ds_mla context latent's tile scales: present exactly when ctx_kv_latent is F8_E4M3.
constexpr const char* kLatentScaleTensor = "ctx_kv_latent_scale";
constexpr std::array<const char*, 3> kResultTensors = {"topk_indices", "out", "lse"};

template <size_t N>
std::string join(const std::array<const char*, N>& names) {
  std::string s;
  for (const char* n : names) s += (s.empty() ? "" : ", ") + std::string(n);
  return s;
}

template <size_t N>
bool contains(const std::array<const char*, N>& names, const std::string& name) {
  for (const char* n : names) {
    if (name == n) return true;
  }
  return false;
}

// Missing and unexpected tensors, one line each; `what` is "case" or "result".
template <size_t N>
Status check_tensor_names(const char* what, const SafetensorsFile& f, const std::array<const char*, N>& names) {
  for (const char* n : names) {
    if (f.find(n) == nullptr) return invalid_argument(std::string(what) + ": missing tensor \"" + n + "\"");
  }
  for (const auto& [name, t] : f.tensors) {
    if (!contains(names, name)) {
      return invalid_argument(std::string(what) + ": unexpected tensor " + json::quote_name(name) + " (a " + what +
                              " file holds exactly: " + join(names) + ")");
    }
  }
  return Status();
}

// One expected dim: its name and value; value < 0 means "any value >= 1" (a dim still being derived).
struct Dim {
  const char* name;
  int64_t value;
};

std::string dims_string(std::initializer_list<Dim> dims) {
  std::string s = "[";
  for (const Dim& d : dims) {
    if (s.size() > 1) s += ", ";
    s += d.name;
    if (d.value >= 0) s += "=" + std::to_string(d.value);
  }
  return s + "]";
}

// Checks dtype and shape of one tensor. Free dims (value < 0) must be >= 1 and fit int32 (CaseDims).
Status check_case_tensor(const char* what, const char* name, const Tensor& t, std::initializer_list<DType> dtypes,
                         std::initializer_list<Dim> dims) {
  bool dtype_ok = false;
  std::string dtype_list;
  for (DType d : dtypes) {
    dtype_ok = dtype_ok || d == t.dtype();
    dtype_list += (dtype_list.empty() ? "" : " or ") + std::string(dtype_name(d));
  }
  const std::string prefix = std::string(what) + ": tensor \"" + name + "\" ";
  if (!dtype_ok) {
    return invalid_argument(prefix + "has dtype " + dtype_name(t.dtype()) + ", expected " + dtype_list);
  }
  bool shape_ok = t.shape().size() == dims.size();
  size_t i = 0;
  for (const Dim& d : dims) {
    if (!shape_ok) break;
    shape_ok = d.value >= 0 ? t.dim(i) == d.value : true;
    ++i;
  }
  if (!shape_ok) {
    return invalid_argument(prefix + "has shape " + shape_to_string(t.shape()) + ", expected " + dims_string(dims));
  }
  i = 0;
  for (const Dim& d : dims) {
    if (d.value < 0 && (t.dim(i) < 1 || t.dim(i) > kInt32Max)) {
      return invalid_argument(prefix + "has shape " + shape_to_string(t.shape()) + ": " + d.name +
                              " must be in [1, 2^31), got " + std::to_string(t.dim(i)));
    }
    ++i;
  }
  return Status();
}

// "12" -> 12; anything but plain decimal digits (sign, space, fraction, overflow) is refused.
Status parse_topk(const std::map<std::string, std::string>& md, int32_t* out) {
  auto it = md.find("topk");
  if (it == md.end()) return invalid_argument("case: __metadata__ has no \"topk\"");
  const std::string& s = it->second;
  const std::string fail = "case: __metadata__ \"topk\" must be an integer in [1, 2^31), got " + json::quote_name(s);
  if (s.empty() || s[0] < '0' || s[0] > '9') return invalid_argument(fail);
  int64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size() || v < 1 || v > kInt32Max) return invalid_argument(fail);
  *out = static_cast<int32_t>(v);
  return Status();
}

// "0.125", "1e-2", "-3" -> float: read as a double (it must parse completely and be finite), then rounded to
// f32, which must be finite too (3.5e38 is refused). A magnitude below f32's range (1e-50) rounds to 0 or a
// denormal, as any f32 conversion does, and is accepted.
Status parse_scale(const std::map<std::string, std::string>& md, float* out) {
  auto it = md.find("scale");
  if (it == md.end()) return invalid_argument("case: __metadata__ has no \"scale\"");
  const std::string& s = it->second;
  double v = 0.0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  // from_chars leaves v alone on out-of-range: tell a tiny magnitude (accepted as 0) from a huge one.
  bool tiny = false;
  if (ec == std::errc::result_out_of_range && p == s.data() + s.size()) {
    const size_t e = s.find_first_of("eE");
    tiny = e != std::string::npos && e + 1 < s.size() && s[e + 1] == '-';
  }
  if (s.empty() || (ec != std::errc() && !tiny) || p != s.data() + s.size() || !std::isfinite(v)) {
    return invalid_argument("case: __metadata__ \"scale\" must be a finite number, got " + json::quote_name(s));
  }
  const float f = static_cast<float>(v);
  if (!std::isfinite(f)) {
    return invalid_argument("case: __metadata__ \"scale\" " + json::quote_name(s) +
                            " is not finite as an f32 (|scale| must be below 3.4e38)");
  }
  *out = tiny ? (s[0] == '-' ? -0.f : 0.f) : f;
  return Status();
}

// Everything a case file says besides the float tensors' data.
struct CaseHeader {
  std::vector<Request> requests;
  int32_t topk = 0;
  float scale = 0.f;
  CaseDims dims;
};

// Validates a whole case (names, metadata, lengths, dtypes, shapes) without taking anything from it.
// Every value of an FP8 scale tensor positive and finite; the first that is not is named with its row.
Status check_scales(const char* name, const Tensor& t) {
  const float* v = t.data_as<float>();
  const int64_t cols = t.shape().size() == 2 ? t.dim(1) : 1;
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (fp8_scale_ok(v[i])) continue;
    const std::string at = cols > 1 ? std::to_string(i / cols) + ", " + std::to_string(i % cols) : std::to_string(i);
    return invalid_argument(std::string("case: ") + name + "[" + at + "] = " + std::to_string(v[i]) +
                            ", expected a positive finite scale");
  }
  return Status();
}

Status check_case(const SafetensorsFile& f, CaseHeader* h) {
  // The FP8 indexer's scale tensors are part of the case exactly when idx_q is F8_E4M3.
  const Tensor* idx_q_t = f.find("idx_q");
  const bool fp8 = idx_q_t != nullptr && idx_q_t->dtype() == DType::kF8E4M3;
  // The fp8_ds_mla context latent (contract section 6) comes with its tile scales.
  const Tensor* ctx_latent_t = f.find("ctx_kv_latent");
  const bool fp8_latent = ctx_latent_t != nullptr && ctx_latent_t->dtype() == DType::kF8E4M3;
  {
    SafetensorsFile names_only;  // the names alone, without the FP8 scales: the plain check below
    for (const auto& [name, t] : f.tensors) {
      if (name == kLatentScaleTensor) {
        if (!fp8_latent) {
          return invalid_argument("case: unexpected tensor " + json::quote(name) +
                                  " (it comes with an F8_E4M3 ctx_kv_latent only)");
        }
        continue;
      }
      if (fp8 && contains(kFp8ScaleTensors, name)) continue;
      if (!fp8 && contains(kFp8ScaleTensors, name)) {
        return invalid_argument("case: unexpected tensor " + json::quote(name) +
                                " (scale tensors come with an F8_E4M3 idx_q only)");
      }
      names_only.tensors.emplace(name, Tensor());
    }
    DSACP_RETURN_IF_ERROR(check_tensor_names("case", names_only, kCaseTensors));
    for (const char* n : kFp8ScaleTensors) {
      if (fp8 && f.find(n) == nullptr) {
        return invalid_argument(std::string("case: missing tensor \"") + n + "\" (idx_q is F8_E4M3)");
      }
    }
    if (fp8_latent && f.find(kLatentScaleTensor) == nullptr) {
      return invalid_argument(std::string("case: missing tensor \"") + kLatentScaleTensor +
                              "\" (ctx_kv_latent is F8_E4M3)");
    }
  }
  // Other __metadata__ keys (notes such as "format": "pt" that writers add) are allowed and not used.
  DSACP_RETURN_IF_ERROR(parse_topk(f.metadata, &h->topk));
  DSACP_RETURN_IF_ERROR(parse_scale(f.metadata, &h->scale));

  // Lengths: R from query_lens, then the values.
  const Tensor& ql = *f.find("query_lens");
  const Tensor& cl = *f.find("context_lens");
  DSACP_RETURN_IF_ERROR(check_case_tensor("case", "query_lens", ql, {DType::kI32}, {{"R", -1}}));
  const int64_t R = ql.dim(0);
  DSACP_RETURN_IF_ERROR(check_case_tensor("case", "context_lens", cl, {DType::kI32}, {{"R", R}}));
  int64_t T = 0, sum_c = 0;
  h->requests.resize(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {
    const int32_t q = ql.data_as<int32_t>()[r];
    const int32_t c = cl.data_as<int32_t>()[r];
    const std::string at = "[" + std::to_string(r) + "]";
    if (q < 1) return invalid_argument("case: query_lens" + at + " must be >= 1, got " + std::to_string(q));
    if (c < 0) return invalid_argument("case: context_lens" + at + " must be >= 0, got " + std::to_string(c));
    if (int64_t{q} + c > kInt32Max) {
      return invalid_argument("case: request " + std::to_string(r) + " has seq_len " + std::to_string(int64_t{q} + c) +
                              " (query " + std::to_string(q) + " + context " + std::to_string(c) +
                              "), more than 2^31 - 1");
    }
    T += q;  // R <= 2^40 / 4 (tensor size cap), so these int64 sums cannot overflow
    sum_c += c;
    h->requests[static_cast<size_t>(r)] = Request{q, c};
  }
  if (T > kInt32Max)
    return invalid_argument("case: sum of query_lens is " + std::to_string(T) + ", more than 2^31 - 1");

  // Dims from q_nope, q_rope and idx_q; then every tensor against them.
  const Tensor& q_nope = *f.find("q_nope");
  const Tensor& q_rope = *f.find("q_rope");
  const Tensor& idx_q = *f.find("idx_q");
  const auto floats = {DType::kBF16, DType::kF32};
  // Dl, Dr and Di come from the key rows first (two dims, nothing to confuse), so a query whose dims are
  // swapped is reported as itself ("q_nope has shape [T, Dl, H]"), not as the next tensor checked against it.
  // idx_q, idx_k and ctx_idx_k are F8_E4M3 together or not at all (fp8).
  const std::initializer_list<DType> fp8_only = {DType::kF8E4M3};
  const std::initializer_list<DType>& index_types = fp8 ? fp8_only : floats;
  const Tensor& kv_latent = *f.find("kv_latent");
  const Tensor& k_rope = *f.find("k_rope");
  const Tensor& idx_k = *f.find("idx_k");
  DSACP_RETURN_IF_ERROR(check_case_tensor("case", "kv_latent", kv_latent, floats, {{"T", T}, {"Dl", -1}}));
  const int64_t Dl = kv_latent.dim(1);
  DSACP_RETURN_IF_ERROR(check_case_tensor("case", "k_rope", k_rope, floats, {{"T", T}, {"Dr", -1}}));
  const int64_t Dr = k_rope.dim(1);
  DSACP_RETURN_IF_ERROR(check_case_tensor("case", "idx_k", idx_k, index_types, {{"T", T}, {"Di", -1}}));
  const int64_t Di = idx_k.dim(1);
  DSACP_RETURN_IF_ERROR(check_case_tensor("case", "q_nope", q_nope, floats, {{"T", T}, {"H", -1}, {"Dl", Dl}}));
  const int64_t H = q_nope.dim(1);
  DSACP_RETURN_IF_ERROR(check_case_tensor("case", "q_rope", q_rope, floats, {{"T", T}, {"H", H}, {"Dr", Dr}}));
  DSACP_RETURN_IF_ERROR(check_case_tensor("case", "idx_q", idx_q, index_types, {{"T", T}, {"Hi", -1}, {"Di", Di}}));
  const int64_t Hi = idx_q.dim(1);
  DSACP_RETURN_IF_ERROR(check_case_tensor("case", "idx_w", *f.find("idx_w"), {DType::kF32}, {{"T", T}, {"Hi", Hi}}));
  if (fp8_latent) {
    if (Dl % kFp8DsMlaTile != 0) {
      return invalid_argument("case: ctx_kv_latent is F8_E4M3 (fp8_ds_mla) but Dl=" + std::to_string(Dl) +
                              " is not a multiple of 128 (one scale a 128-value tile)");
    }
    DSACP_RETURN_IF_ERROR(check_case_tensor("case", "ctx_kv_latent", *f.find("ctx_kv_latent"), {DType::kF8E4M3},
                                            {{"sumC", sum_c}, {"Dl", Dl}}));
    const Tensor& ls = *f.find(kLatentScaleTensor);
    DSACP_RETURN_IF_ERROR(check_case_tensor("case", kLatentScaleTensor, ls, {DType::kF32},
                                            {{"sumC", sum_c}, {"Dl/128", Dl / kFp8DsMlaTile}}));
    DSACP_RETURN_IF_ERROR(check_scales(kLatentScaleTensor, ls));
  } else {
    DSACP_RETURN_IF_ERROR(
        check_case_tensor("case", "ctx_kv_latent", *f.find("ctx_kv_latent"), floats, {{"sumC", sum_c}, {"Dl", Dl}}));
  }
  DSACP_RETURN_IF_ERROR(
      check_case_tensor("case", "ctx_k_rope", *f.find("ctx_k_rope"), floats, {{"sumC", sum_c}, {"Dr", Dr}}));
  DSACP_RETURN_IF_ERROR(
      check_case_tensor("case", "ctx_idx_k", *f.find("ctx_idx_k"), index_types, {{"sumC", sum_c}, {"Di", Di}}));
  if (fp8) {
    const Tensor &qs = *f.find("idx_q_scale"), &ks = *f.find("idx_k_scale"), &cs = *f.find("ctx_idx_k_scale");
    DSACP_RETURN_IF_ERROR(check_case_tensor("case", "idx_q_scale", qs, {DType::kF32}, {{"T", T}, {"Hi", Hi}}));
    DSACP_RETURN_IF_ERROR(check_case_tensor("case", "idx_k_scale", ks, {DType::kF32}, {{"T", T}}));
    DSACP_RETURN_IF_ERROR(check_case_tensor("case", "ctx_idx_k_scale", cs, {DType::kF32}, {{"sumC", sum_c}}));
    DSACP_RETURN_IF_ERROR(check_scales("idx_q_scale", qs));
    DSACP_RETURN_IF_ERROR(check_scales("idx_k_scale", ks));
    DSACP_RETURN_IF_ERROR(check_scales("ctx_idx_k_scale", cs));
  }
  h->dims = CaseDims{static_cast<int32_t>(H), static_cast<int32_t>(Dl), static_cast<int32_t>(Dr),
                     static_cast<int32_t>(Hi), static_cast<int32_t>(Di)};
  return Status();
}

// Moves a tensor out of the file (check_case has made sure it is there).
Tensor take(SafetensorsFile& f, const char* name) { return std::move(f.tensors.find(name)->second); }

Result<Tensor> lengths_tensor(const std::vector<Request>& requests, bool query) {
  DSACP_ASSIGN_OR_RETURN(Tensor t, Tensor::zeros(DType::kI32, {static_cast<int64_t>(requests.size())}));
  for (size_t r = 0; r < requests.size(); ++r) {
    t.data_as<int32_t>()[r] = query ? requests[r].query_len : requests[r].context_len;
  }
  return t;
}

// Shortest decimal form that reads back to the same float.
std::string float_to_string(float v) {
  char buf[64];
  auto [p, ec] = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, p);
}

// A result, checked: topk_indices I32 [T, K], out F32/BF16 [T, H, Dl], lse F32 [T, H].
Status check_result(const SafetensorsFile& f) {
  DSACP_RETURN_IF_ERROR(check_tensor_names("result", f, kResultTensors));
  // The only metadata a result has: the forms of its top-k and LSE when they are not the default ones.
  for (const auto& [key, value] : f.metadata) {
    if (key == "topk_form") {
      if (value != "slot") {
        return invalid_argument("result: __metadata__ \"topk_form\" must be \"slot\" (canonical rows carry no key), got " +
                                json::quote_name(value));
      }
    } else if (key == "lse_base") {
      if (value != "2") {
        return invalid_argument("result: __metadata__ \"lse_base\" must be \"2\" (a natural-log LSE carries no key), got " +
                                json::quote_name(value));
      }
    } else {
      return invalid_argument("result: unexpected __metadata__ key " + json::quote(key) +
                              " (a result's metadata holds only \"topk_form\" and \"lse_base\")");
    }
  }
  const Tensor& idx = *f.find("topk_indices");
  const Tensor& out = *f.find("out");
  const Tensor& lse = *f.find("lse");
  DSACP_RETURN_IF_ERROR(check_case_tensor("result", "topk_indices", idx, {DType::kI32}, {{"T", -1}, {"K", -1}}));
  const int64_t T = idx.dim(0);
  DSACP_RETURN_IF_ERROR(
      check_case_tensor("result", "out", out, {DType::kF32, DType::kBF16}, {{"T", T}, {"H", -1}, {"Dl", -1}}));
  DSACP_RETURN_IF_ERROR(check_case_tensor("result", "lse", lse, {DType::kF32}, {{"T", T}, {"H", out.dim(1)}}));
  const int32_t* p = idx.data_as<int32_t>();
  for (int64_t i = 0; i < idx.numel(); ++i) {
    if (p[i] < -1) {
      return invalid_argument("result: topk_indices[" + std::to_string(i / idx.dim(1)) + ", " +
                              std::to_string(i % idx.dim(1)) + "] is " + std::to_string(p[i]) +
                              ", expected a position or -1");
    }
  }
  return Status();
}

}  // namespace

Result<CaseFile> case_from_safetensors(SafetensorsFile file) {
  CaseHeader h;
  DSACP_RETURN_IF_ERROR(check_case(file, &h));
  CaseFile c;
  c.requests = std::move(h.requests);
  c.topk = h.topk;
  c.scale = h.scale;
  c.dims = h.dims;
  c.q_nope = take(file, "q_nope");
  c.q_rope = take(file, "q_rope");
  c.kv_latent = take(file, "kv_latent");
  c.k_rope = take(file, "k_rope");
  c.idx_q = take(file, "idx_q");
  c.idx_w = take(file, "idx_w");
  c.idx_k = take(file, "idx_k");
  c.ctx_kv_latent = take(file, "ctx_kv_latent");
  c.ctx_k_rope = take(file, "ctx_k_rope");
  c.ctx_idx_k = take(file, "ctx_idx_k");
  if (c.index_fp8()) {
    c.idx_q_scale = take(file, "idx_q_scale");
    c.idx_k_scale = take(file, "idx_k_scale");
    c.ctx_idx_k_scale = take(file, "ctx_idx_k_scale");
  }
  if (c.latent_fp8()) c.ctx_kv_latent_scale = take(file, kLatentScaleTensor);
  return c;
}

Result<CaseFile> case_read(const std::string& path) {
  DSACP_ASSIGN_OR_RETURN(SafetensorsFile file, safetensors_read(path));  // its errors already name the path
  Result<CaseFile> c = case_from_safetensors(std::move(file));
  if (!c.ok()) return c.status().with_context(path);
  return c;
}

Result<SafetensorsFile> case_to_safetensors(const CaseFile& c) {
  SafetensorsFile f;
  DSACP_ASSIGN_OR_RETURN(f.tensors["query_lens"], lengths_tensor(c.requests, true));
  DSACP_ASSIGN_OR_RETURN(f.tensors["context_lens"], lengths_tensor(c.requests, false));
  const std::pair<const char*, const Tensor*> floats[] = {
      {"q_nope", &c.q_nope},         {"q_rope", &c.q_rope},
      {"kv_latent", &c.kv_latent},   {"k_rope", &c.k_rope},
      {"idx_q", &c.idx_q},           {"idx_w", &c.idx_w},
      {"idx_k", &c.idx_k},           {"ctx_kv_latent", &c.ctx_kv_latent},
      {"ctx_k_rope", &c.ctx_k_rope}, {"ctx_idx_k", &c.ctx_idx_k}};
  for (const auto& [name, t] : floats) {
    if (t->data() == nullptr) return invalid_argument(std::string("case: tensor \"") + name + "\" holds no data");
    DSACP_ASSIGN_OR_RETURN(f.tensors[name], t->clone());
  }
  if (c.index_fp8()) {
    const std::pair<const char*, const Tensor*> scales[] = {
        {"idx_q_scale", &c.idx_q_scale}, {"idx_k_scale", &c.idx_k_scale}, {"ctx_idx_k_scale", &c.ctx_idx_k_scale}};
    for (const auto& [name, t] : scales) {
      if (t->data() == nullptr && t->numel() > 0) {
        return invalid_argument(std::string("case: tensor \"") + name + "\" holds no data");
      }
      DSACP_ASSIGN_OR_RETURN(f.tensors[name], t->clone());
    }
  }
  if (c.latent_fp8()) {
    if (c.ctx_kv_latent_scale.data() == nullptr && c.ctx_kv_latent_scale.numel() > 0) {
      return invalid_argument(std::string("case: tensor \"") + kLatentScaleTensor + "\" holds no data");
    }
    DSACP_ASSIGN_OR_RETURN(f.tensors[kLatentScaleTensor], c.ctx_kv_latent_scale.clone());
  }
  f.metadata["topk"] = std::to_string(c.topk);
  f.metadata["scale"] = float_to_string(c.scale);
  // What we write must read back: the same checks as the loader, plus dims agreeing with the tensors.
  CaseHeader h;
  DSACP_RETURN_IF_ERROR(check_case(f, &h));
  if (h.dims.H != c.dims.H || h.dims.Dl != c.dims.Dl || h.dims.Dr != c.dims.Dr || h.dims.Hi != c.dims.Hi ||
      h.dims.Di != c.dims.Di) {
    return invalid_argument("case: dims say H=" + std::to_string(c.dims.H) + ", Dl=" + std::to_string(c.dims.Dl) +
                            ", Dr=" + std::to_string(c.dims.Dr) + ", Hi=" + std::to_string(c.dims.Hi) + ", Di=" +
                            std::to_string(c.dims.Di) + " but the tensors have H=" + std::to_string(h.dims.H) +
                            ", Dl=" + std::to_string(h.dims.Dl) + ", Dr=" + std::to_string(h.dims.Dr) +
                            ", Hi=" + std::to_string(h.dims.Hi) + ", Di=" + std::to_string(h.dims.Di));
  }
  return f;
}

Status case_write(const std::string& path, const CaseFile& c) {
  DSACP_ASSIGN_OR_RETURN(SafetensorsFile f, case_to_safetensors(c));
  return safetensors_write(path, f);  // its errors name the path
}

Status result_write(const std::string& path, const StepResult& r) {
  SafetensorsFile f;
  const std::pair<const char*, const Tensor*> tensors[] = {
      {"topk_indices", &r.topk_indices}, {"out", &r.out}, {"lse", &r.lse}};
  for (const auto& [name, t] : tensors) {
    if (t->data() == nullptr) return invalid_argument(std::string("result: tensor \"") + name + "\" holds no data");
    DSACP_ASSIGN_OR_RETURN(f.tensors[name], t->clone());
  }
  if (r.topk_form != TopkForm::kCanonical) f.metadata["topk_form"] = topk_form_name(r.topk_form);
  if (r.lse_base != LseBase::kNatural) f.metadata["lse_base"] = lse_base_name(r.lse_base);
  DSACP_RETURN_IF_ERROR(check_result(f));
  return safetensors_write(path, f);
}

Result<StepResult> result_read(const std::string& path) {
  DSACP_ASSIGN_OR_RETURN(SafetensorsFile f, safetensors_read(path));
  Status s = check_result(f);
  if (!s.ok()) return s.with_context(path);
  StepResult r;
  r.topk_indices = take(f, "topk_indices");
  r.out = take(f, "out");
  r.lse = take(f, "lse");
  if (f.metadata.count("topk_form") != 0) r.topk_form = TopkForm::kSlot;
  if (f.metadata.count("lse_base") != 0) r.lse_base = LseBase::kTwo;
  return r;
}

const char* topk_form_name(TopkForm f) { return f == TopkForm::kSlot ? "slot" : "canonical"; }
const char* lse_base_name(LseBase b) { return b == LseBase::kTwo ? "2" : "e"; }

}  // namespace dsacp
