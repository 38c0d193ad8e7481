// Pages padded past their dense size on the GPU (ExternalPools' page strides: an engine's pages padded to one
// size, vLLM's page_size_padded): a step over padded device pools gives the results of the library's dense pools
// bit for bit, every page holds the dense pool's page and the padding keeps its bytes (0xff: NaN in bf16, e4m3
// and f32, so a kernel that read it would show). Over every kernel family that addresses a page: the cache
// writes (rows, fp8_ds_mla records, FP8 indexer pages), the indexer's score kernels (bf16 mma.sync, FP8 wgmma with
// the tensor-map stage, FP8 mma.sync), and sparse MLA at H = 128 (decode ws32, prefill ws, the paired FP8
// dequantization), 64, 32 and 16 (mma.sync, the streaming small-heads kernel, FP8 via the bf16 prefill scratch),
// bf16 rows in two pools or one combined [pages, 64, 576] buffer, and fp8_ds_mla records, pages padded by whole
// rows and by 16-byte units, page sizes 64 and 48. Separate latent and rope pools padded unlike are refused by sparse
// MLA in one line.
#include <cuda_runtime.h>

#include <cstring>
#include <string>
#include <vector>

#include "dsacp/case_file.h"
#include "dsacp/paged_cache.h"
#include "dsacp/random.h"
#include "dsacp/step.h"
#include "gpu/gpu_test.h"

namespace dsacp::testing {
namespace {

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

enum class Form { kRows, kCombined, kFp8 };
const char* form_name(Form f) { return f == Form::kRows ? "bf16 rows" : f == Form::kCombined ? "combined kv" : "fp8"; }

// One device pool of `pages` pages of `dense` bytes, `stride` apart, filled with 0xff.
struct DevicePool {
  int64_t pages = 0, dense = 0, stride = 0;
  void* data = nullptr;
  Status make(int64_t p, int64_t d, int64_t s) {
    pages = p, dense = d, stride = s;
    if (cudaMalloc(&data, static_cast<size_t>(p * s)) != cudaSuccess ||
        cudaMemset(data, 0xff, static_cast<size_t>(p * s)) != cudaSuccess) {
      return internal_error(std::string("cudaMalloc / cudaMemset: ") + cudaGetErrorString(cudaGetLastError()));
    }
    return Status();
  }
  size_t bytes() const { return static_cast<size_t>((pages - 1) * stride + dense); }
  ~DevicePool() { (void)cudaFree(data); }
  // "" when each page equals the dense device pool's page and the padding is still 0xff.
  std::string compare(Backend& gpu, const void* dense_pool) const {
    std::vector<uint8_t> mine(static_cast<size_t>(pages * stride)), want(static_cast<size_t>(pages * dense));
    Status s = gpu.copy_to_host(mine.data(), data, bytes());
    if (s.ok()) s = gpu.copy_to_host(want.data(), dense_pool, want.size());
    if (!s.ok()) return s.to_string();
    int64_t bad_pages = 0, bad_pad = 0;
    for (int64_t p = 0; p < pages; ++p) {
      bad_pages += std::memcmp(&mine[p * stride], &want[p * dense], dense) != 0;
      for (int64_t b = dense; b < stride && p + 1 < pages; ++b) bad_pad += mine[p * stride + b] != 0xff;
    }
    return bad_pages + bad_pad == 0 ? "" : std::to_string(bad_pages) + " pages differ, " + std::to_string(bad_pad) +
                                               " padding bytes changed";
  }
};

CaseFile padded_case(int32_t H, uint64_t seed, bool fp8) {
  CaseGenSpec spec;
  spec.dims = CaseDims{H, 512, 64, 64, 128};
  spec.topk = 512;
  spec.scale = 0.0723f;
  spec.dtype = DType::kBF16;
  spec.seed = seed;
  // Decodes (two with MTP) and prefill chunks of 40 and 130 tokens (the FP8 prefill's bf16 scratch path).
  spec.requests = {{1, 200 + static_cast<int32_t>(counter_hash(seed, 1, 0) % 3000)},
                   {2, 700 + static_cast<int32_t>(counter_hash(seed, 1, 1) % 2000)},
                   {3, 90},
                   {130, 0},
                   {40, 1100}};
  CaseFile c = std::move(case_generate(spec)).value();
  if (fp8) {
    (void)case_quantize_index(c);
    (void)case_quantize_latent(c);
  }
  return c;
}

// One case over dense library pools and over padded caller pools on `gpu`.
// lat_pad / rope_pad: bytes of padding a page of the latent (records, combined rows) and rope pools. Separate
// latent and rope pools padded by different numbers of rows are refused by sparse MLA (one line) instead.
void padded_checks_on(Backend& gpu, int32_t H, Form form, const std::string& kernel, uint64_t seed, CheckLog& log,
                      int64_t lat_pad, int64_t rope_pad = 0, int32_t page_size = 64) {
  const bool fp8 = form == Form::kFp8;
  const std::string tag = std::string("padded pages, ") + form_name(form) + ", H=" + std::to_string(H) + kernel +
                          ", pads " + std::to_string(lat_pad) + (form == Form::kRows ? "/" + std::to_string(rope_pad) : "") +
                          " B, page_size " + std::to_string(page_size) + ": ";
  const bool unlike = form == Form::kRows && (lat_pad % 1024 != 0 || rope_pad % 128 != 0 || lat_pad / 1024 != rope_pad / 128);
  const CaseFile c = padded_case(H, seed + H, fp8);
  PagedCacheConfig cc;
  cc.page_size = page_size;
  cc.Dl = c.dims.Dl;
  cc.Dr = c.dims.Dr;
  cc.Di = c.dims.Di;
  cc.dtype = DType::kBF16;
  if (fp8) {
    cc.latent_format = LatentFormat::kFp8DsMla;
    cc.index_dtype = DType::kF8E4M3;
  }
  std::vector<SequencePages> seqs(c.requests.size());
  std::vector<const SequencePages*> ptrs;
  int64_t pages = 3;
  for (const Request& r : c.requests) pages += (r.seq_len() + cc.page_size - 1) / cc.page_size;
  cc.num_pages = pages;
  PageAllocator allocator(pages, seed);
  for (size_t b = 0; b < c.requests.size(); ++b) {
    (void)seqs[b].reserve(allocator, c.requests[b].seq_len(), cc.page_size);
    ptrs.push_back(&seqs[b]);
  }
  const BlockTable table = BlockTable::from_sequences(ptrs);
  StepConfig config = step_config_of(c.dims, c.topk, c.scale, DType::kBF16);
  if (fp8) config.index_dtype = DType::kF8E4M3;
  HostStepInputs in{&c.q_nope, &c.q_rope, &c.kv_latent, &c.k_rope, &c.idx_q, &c.idx_w, &c.idx_k};
  if (fp8) {
    in.idx_q_scale = &c.idx_q_scale;
    in.idx_k_scale = &c.idx_k_scale;
  }
  const Tensor* key_scales = fp8 ? &c.ctx_idx_k_scale : nullptr;
  const Tensor* latent_scales = fp8 ? &c.ctx_kv_latent_scale : nullptr;

  // The library's dense pools, 0xff where nothing was written (as the caller's).
  auto created = PagedKvCache::create(gpu, cc);
  Status st = created.status();
  if (st.ok()) {
    for (const PagedPoolView& v : {created->latent(), created->index_keys()}) {
      (void)cudaMemset(v.data, 0xff, static_cast<size_t>(pool_span_bytes(v)));
    }
    if (!fp8) (void)cudaMemset(created->rope().data, 0xff, static_cast<size_t>(pool_span_bytes(created->rope())));
    st = cache_load_context(gpu, *created, c.requests, table, c.ctx_kv_latent, c.ctx_k_rope, c.ctx_idx_k, key_scales,
                            latent_scales);
  }
  Result<StepResult> want = st.ok() ? step_run_host(gpu, config, c.requests, table, *created, in) : Result<StepResult>(st);

  // The caller's padded pools: each pool padded by its own multiple of 16 bytes.
  const int32_t kv_row = cc.Dl + cc.Dr;
  DevicePool lat, rope, idx;  // (freed by their destructors)
  const int64_t lat_dense =
      form == Form::kCombined ? PagedKvCache::kv_page_bytes(cc, kv_row) : PagedKvCache::latent_page_bytes(cc);
  st = lat.make(pages, lat_dense, lat_dense + lat_pad);
  if (st.ok() && form == Form::kRows) {
    st = rope.make(pages, PagedKvCache::rope_page_bytes(cc), PagedKvCache::rope_page_bytes(cc) + rope_pad);
  }
  if (st.ok()) st = idx.make(pages, PagedKvCache::index_keys_page_bytes(cc), PagedKvCache::index_keys_page_bytes(cc) + 80);
  ExternalPools pools;
  if (form == Form::kCombined) {
    pools.kv = lat.data;
    pools.kv_bytes = lat.bytes();
    pools.kv_row = kv_row;
    pools.kv_page_stride = lat.stride;
  } else {
    pools.latent = lat.data;
    pools.latent_bytes = lat.bytes();
    pools.latent_page_stride = lat.stride;
    if (form == Form::kRows) {
      pools.rope = rope.data;
      pools.rope_bytes = rope.bytes();
      pools.rope_page_stride = rope.stride;
    }
  }
  pools.index_keys = idx.data;
  pools.index_keys_bytes = idx.bytes();
  pools.index_keys_page_stride = idx.stride;
  auto wrapped = st.ok() ? PagedKvCache::wrap(cc, pools) : Result<PagedKvCache>(st);
  st = wrapped.status();
  if (st.ok()) {
    st = cache_load_context(gpu, *wrapped, c.requests, table, c.ctx_kv_latent, c.ctx_k_rope, c.ctx_idx_k, key_scales,
                            latent_scales);
  }
  Result<StepResult> got = st.ok() ? step_run_host(gpu, config, c.requests, table, *wrapped, in) : Result<StepResult>(st);
  if (unlike) {
    const std::string m = got.ok() ? "ran" : got.status().message();
    log.report(!got.ok() && m.find("the latent and rope pools' pages are padded unlike") != std::string::npos,
               tag + "refused in one line by sparse MLA", m);
    return;
  }
  log.report(got.ok() && want.ok() && same_bytes(got->topk_indices, want->topk_indices) &&
                 same_bytes(got->out, want->out) && same_bytes(got->lse, want->lse),
             tag + "a step over padded pages = over the library's dense pools, bit for bit",
             !got.ok() ? got.status().to_string() : !want.ok() ? want.status().to_string() : "");
  if (!got.ok() || !want.ok()) return;
  std::string diff;
  if (form == Form::kCombined) {
    // The dense pools' rows side by side: latent then rope in each row of the combined buffer.
    const int64_t slots = pages * cc.page_size;
    std::vector<uint16_t> l(static_cast<size_t>(slots * cc.Dl)), r(static_cast<size_t>(slots * cc.Dr)),
        rows(static_cast<size_t>(slots * kv_row));
    Status cs = gpu.copy_to_host(l.data(), created->latent().data, l.size() * 2);
    if (cs.ok()) cs = gpu.copy_to_host(r.data(), created->rope().data, r.size() * 2);
    for (int64_t t = 0; cs.ok() && t < slots; ++t) {
      std::memcpy(&rows[t * kv_row], &l[t * cc.Dl], cc.Dl * 2);
      std::memcpy(&rows[t * kv_row + cc.Dl], &r[t * cc.Dr], cc.Dr * 2);
    }
    void* dense = nullptr;
    if (cs.ok() && cudaMalloc(&dense, rows.size() * 2) == cudaSuccess) {
      cs = gpu.copy_to_device(dense, rows.data(), rows.size() * 2);
      if (cs.ok()) diff = lat.compare(gpu, dense);
      (void)cudaFree(dense);
    }
    if (!cs.ok()) diff = cs.to_string();
  } else {
    diff = lat.compare(gpu, created->latent().data);
    if (form == Form::kRows) diff += rope.compare(gpu, created->rope().data);
  }
  diff += idx.compare(gpu, created->index_keys().data);
  log.report(diff.empty(), tag + "each page = the dense pool's page, the padding untouched", diff);
}

class PaddedPages : public GpuTest {};

TEST_F(PaddedPages, EveryKernelFamilyReadsAndWritesPaddedPages) {
  const uint64_t seed = 311;
  // Pads of whole rows (the kernels count rows) and of 16-byte units (they count 16-byte units).
  for (const int32_t H : {128, 64, 32, 16}) {
    padded_checks_on(gpu(), H, Form::kRows, "", seed, check_log(), 1024, 128);
    padded_checks_on(gpu(), H, Form::kCombined, "", seed, check_log(), 1152);
    padded_checks_on(gpu(), H, Form::kCombined, "", seed, check_log(), 1040);
    padded_checks_on(gpu(), H, Form::kFp8, "", seed, check_log(), 2 * 656);
    padded_checks_on(gpu(), H, Form::kFp8, "", seed, check_log(), 1040);
  }
  padded_checks_on(gpu(), 64, Form::kCombined, "", seed, check_log(), 1040, 0, 48);
  padded_checks_on(gpu(), 64, Form::kFp8, "", seed, check_log(), 1040, 0, 48);
  padded_checks_on(gpu(), 64, Form::kRows, "", seed, check_log(), 1024, 48);  // refused
  // The streaming 16-head kernel (bulk copies of rows and records) and the FP8 indexer's mma.sync kernel forced.
  CudaBackendOptions small;
  small.mla_kernel = CudaBackendOptions::MlaKernel::kSmallHeads;
  small.indexer_score_kernel = CudaBackendOptions::IndexerScoreKernel::kMmaSync;
  auto b = make_cuda_backend(0, small);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  const std::string k = " (small-heads MLA, mma.sync indexer)";
  padded_checks_on(**b, 16, Form::kRows, k, seed, check_log(), 2048, 256);
  padded_checks_on(**b, 16, Form::kCombined, k, seed, check_log(), 1040);
  padded_checks_on(**b, 16, Form::kFp8, k, seed, check_log(), 1040);
}

}  // namespace
}  // namespace dsacp::testing
