// The serving options on a GPU against the default path worked by hand: slot rows = the block table lookup of the
// canonical rows (and the CPU oracle's slots), base-2 LSE = the natural LSE * kLog2E bit for bit, a precomputed
// top-k equal to the indexer's gives its outputs bit for bit (with and without the indexer's inputs), a malformed
// precomputed row refused at the step's end naming the row; a backend on the caller's stream gives the default
// backend's results bit for bit and leaves the stream alive.
#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "dsacp/case_file.h"
#include "dsacp/cp_step.h"
#include "dsacp/paged_cache.h"
#include "dsacp/random.h"
#include "dsacp/replay.h"
#include "gpu/gpu_test.h"

namespace dsacp::testing {
namespace {

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

// The replay's shared block table (replay.cc's replay_setup: a seeded allocator, the largest share's pages).
BlockTable replay_table(const CaseFile& c, const ReplayOptions& o, KvSharding* sharding) {
  *sharding = cp_kv_sharding(o.layout, o.page_size);
  int64_t pages = o.spare_pages;
  for (const Request& r : c.requests) pages += sharding->pages_needed(r.seq_len(), o.page_size);
  PageAllocator allocator(pages, o.page_shuffle_seed);
  std::vector<SequencePages> seqs(c.requests.size());
  std::vector<const SequencePages*> ptrs;
  for (size_t b = 0; b < c.requests.size(); ++b) {
    (void)seqs[b].reserve(allocator, sharding->local_len(c.requests[b].seq_len(), 0), o.page_size);
    ptrs.push_back(&seqs[b]);
  }
  return BlockTable::from_sequences(ptrs);
}

// The bf16 cache of one device that holds the replay's table (its pages and spares).
PagedCacheConfig replay_cache_config(const CaseFile& c, const ReplayOptions& o, const KvSharding& sharding) {
  PagedCacheConfig cc;
  cc.page_size = o.page_size;
  cc.Dl = c.dims.Dl;
  cc.Dr = c.dims.Dr;
  cc.Di = c.dims.Di;
  cc.dtype = DType::kBF16;
  cc.num_pages = o.spare_pages;
  for (const Request& r : c.requests) cc.num_pages += sharding.pages_needed(r.seq_len(), o.page_size);
  return cc;
}

// How many slot entries differ from the lookup of the canonical rows (-1 for a row shape mismatch).
int64_t slot_mismatches(const CaseFile& c, const ReplayOptions& o, const StepResult& canonical, const StepResult& slots) {
  if (canonical.topk_indices.numel() != slots.topk_indices.numel()) return -1;
  KvSharding sharding;
  const BlockTable table = replay_table(c, o, &sharding);
  const int32_t K = c.topk, B = o.page_size;
  int64_t bad = 0, t = 0;
  for (size_t b = 0; b < c.requests.size(); ++b) {
    for (int32_t i = 0; i < c.requests[b].query_len; ++i, ++t) {
      for (int32_t k = 0; k < K; ++k) {
        const int32_t e = canonical.topk_indices.data_as<int32_t>()[t * K + k];
        int64_t want = -1;
        if (e >= 0) {
          const int64_t l = sharding.local_pos(e);
          want = int64_t{table.page(static_cast<int32_t>(b), l / B)} * B + l % B;
        }
        bad += slots.topk_indices.data_as<int32_t>()[t * K + k] != want;
      }
    }
  }
  return bad;
}

CaseFile make_serving_case(uint64_t seed) {
  CaseGenSpec spec;
  spec.dims = CaseDims{64, 512, 64, 64, 128};
  spec.topk = 512;
  spec.scale = 0.0723f;
  spec.dtype = DType::kBF16;
  spec.seed = seed;
  spec.requests = {{1, 200 + static_cast<int32_t>(counter_hash(seed, 1, 0) % 3000)},
                   {2, 700 + static_cast<int32_t>(counter_hash(seed, 1, 1) % 2000)},
                   {3, 90},
                   {130, 0},
                   {40, 1100}};
  return std::move(case_generate(spec)).value();
}

CpLayout layout_of(int32_t P, int32_t D, IndexerMode mode, bool dsa_cp, int32_t interleave) {
  CpLayout l;
  l.P = P;
  l.D = D;
  l.indexer = mode;
  l.dsa_cp = dsa_cp;
  l.interleave = interleave;
  return l;
}


// The serving options (slot top-k, base-2 LSE, a precomputed top-k) on one GPU and on CP layouts on it.
void gpu_serving_checks(Backend& gpu, Backend& cpu, uint64_t seed, CheckLog& log) {
  struct Named {
    const char* name;
    CpLayout layout;
  } layouts[] = {
      {"one GPU", CpLayout{}},
      {"D2 sharded on one GPU", layout_of(1, 2, IndexerMode::kSharded, false, 0)},
      {"D2 replicated interleave 5 on one GPU", layout_of(1, 2, IndexerMode::kReplicated, false, 5)},
      {"P2xD2 sharded on one GPU", layout_of(2, 2, IndexerMode::kSharded, false, 0)},
      {"D2 DSA-CP on one GPU", layout_of(1, 2, IndexerMode::kSharded, true, 0)},
  };
  const CaseFile mixed = make_serving_case(seed);
  // DSA-CP's decode path (every token's attention over own keys) wants a decode-only batch.
  CaseFile decodes = make_serving_case(seed);
  {
    CaseGenSpec spec;
    spec.dims = mixed.dims;
    spec.topk = mixed.topk;
    spec.scale = mixed.scale;
    spec.dtype = DType::kBF16;
    spec.seed = seed + 1;
    spec.requests = {{1, 3000}, {2, 700}, {4, 1500}, {1, 60}};
    decodes = std::move(case_generate(spec)).value();
  }
  for (const Named& n : layouts) {
    const CaseFile& c = n.layout.dsa_cp ? decodes : mixed;
    const std::string tag = std::string("serving options, ") + n.name + ": ";
    ReplayOptions o;
    o.page_size = 64;
    o.layout = n.layout;
    auto canonical = replay_case(gpu, c, o);
    if (!canonical.ok()) {
      log.report(false, tag + "canonical step", canonical.status().to_string());
      continue;
    }
    ReplayOptions forms = o;
    forms.topk_form = TopkForm::kSlot;
    forms.lse_base = LseBase::kTwo;
    auto converted = replay_case(gpu, c, forms);
    if (!converted.ok()) {
      log.report(false, tag + "slot + base-2 step", converted.status().to_string());
      continue;
    }
    const int64_t bad_slots = slot_mismatches(c, o, *canonical, *converted);
    log.report(bad_slots == 0 && converted->topk_form == TopkForm::kSlot, tag + "slot rows = block table lookup",
               std::to_string(bad_slots) + " entries differ");
    int64_t bad_lse = 0;
    for (int64_t i = 0; i < canonical->lse.numel(); ++i) {
      const float want = canonical->lse.data_as<float>()[i] * kLog2E;
      bad_lse += std::memcmp(&want, converted->lse.data_as<float>() + i, sizeof want) != 0;
    }
    log.report(bad_lse == 0 && same_bytes(converted->out, canonical->out), tag + "base-2 LSE = ln LSE * kLog2E, out unchanged",
               std::to_string(bad_lse) + " LSE values differ");
    if (n.layout.num_ranks() == 1) {
      // The CPU oracle's slots: the same rows on the same table.
      auto oracle = replay_case(cpu, c, forms);
      log.report(oracle.ok() && same_bytes(oracle->topk_indices, converted->topk_indices),
                 tag + "slot rows = the CPU oracle's", oracle.ok() ? "" : oracle.status().to_string());
    }
    // A precomputed top-k equal to the indexer's: the same outputs, with and without the indexer's inputs.
    ReplayOptions pre = o;
    pre.topk = &canonical->topk_indices;
    auto reused = replay_case(gpu, c, pre);
    log.report(reused.ok() && same_bytes(reused->topk_indices, canonical->topk_indices) &&
                   same_bytes(reused->out, canonical->out) && same_bytes(reused->lse, canonical->lse),
               tag + "precomputed top-k = the indexer's outputs bit for bit",
               reused.ok() ? "" : reused.status().to_string());
    // A malformed row (token 0's first two positions swapped) fails the step naming the row.
    auto spoiled = canonical->topk_indices.clone();
    if (spoiled.ok()) {
      int32_t* row = spoiled->data_as<int32_t>();
      std::swap(row[0], row[1]);
      pre.topk = &*spoiled;
      auto refused = replay_case(gpu, c, pre);
      const std::string m = refused.ok() ? "" : refused.status().to_string();
      log.report(!refused.ok() && m.find("not a top-k row of canonical form") != std::string::npos &&
                     m.find('\n') == std::string::npos,
                 tag + "malformed precomputed row refused naming the row", refused.ok() ? "ran" : m);
    }
    // The backend still runs a good step after the refusal.
    auto again = replay_case(gpu, c, o);
    log.report(again.ok() && same_bytes(again->topk_indices, canonical->topk_indices),
               tag + "a good step after the refusal", again.ok() ? "" : again.status().to_string());
  }
  // Without the indexer's inputs (a layer that reuses another's top-k): one GPU through step_run_host.
  {
    const CaseFile& c = mixed;
    ReplayOptions o;
    o.page_size = 64;
    auto canonical = replay_case(gpu, c, o);
    KvSharding sharding;
    const BlockTable table = replay_table(c, o, &sharding);
    const PagedCacheConfig cc = replay_cache_config(c, o, sharding);
    auto cache = PagedKvCache::create(gpu, cc);
    Status st = cache.ok() ? cache_load_context(gpu, *cache, c.requests, table, c.ctx_kv_latent, c.ctx_k_rope, c.ctx_idx_k)
                           : cache.status();
    const StepConfig config = step_config_of(c.dims, c.topk, c.scale, DType::kBF16);
    HostStepInputs in{&c.q_nope, &c.q_rope, &c.kv_latent, &c.k_rope, nullptr, nullptr, nullptr};
    if (canonical.ok()) in.topk = &canonical->topk_indices;
    Result<StepResult> r = st.ok() && canonical.ok() ? step_run_host(gpu, config, c.requests, table, *cache, in)
                                                    : Result<StepResult>(st.ok() ? canonical.status() : st);
    log.report(r.ok() && same_bytes(r->out, canonical->out) && same_bytes(r->lse, canonical->lse),
               "serving options, one GPU: precomputed top-k without indexer inputs = the indexer's outputs",
               r.ok() ? "" : r.status().to_string());
  }
}

// CudaBackendOptions::stream: a backend on the caller's stream against `gpu` (a default backend).
void gpu_external_stream_checks(Backend& gpu, uint64_t seed, CheckLog& log) {
  const std::string tag = "external stream: ";
  cudaStream_t mine = nullptr;
  if (cudaStreamCreateWithFlags(&mine, cudaStreamNonBlocking) != cudaSuccess) {
    log.report(false, tag + "cudaStreamCreate", cudaGetErrorString(cudaGetLastError()));
    return;
  }
  const CaseFile c = make_serving_case(seed);
  ReplayOptions o;
  o.page_size = 64;
  auto want = replay_case(gpu, c, o);
  {
    CudaBackendOptions options;
    options.stream = mine;
    auto backend = make_cuda_backend(gpu.cuda_device(), options);
    log.report(backend.ok() && (*backend)->native_stream() == static_cast<void*>(mine),
               tag + "the backend issues its work on the caller's stream",
               backend.ok() ? "" : backend.status().to_string());
    if (backend.ok() && want.ok()) {
      auto got = replay_case(**backend, c, o);
      log.report(got.ok() && same_bytes(got->topk_indices, want->topk_indices) && same_bytes(got->out, want->out) &&
                     same_bytes(got->lse, want->lse),
                 tag + "a step on the caller's stream = the default backend's, bit for bit",
                 got.ok() ? "" : got.status().to_string());
      ReplayOptions p2 = o;
      p2.layout = layout_of(2, 1, IndexerMode::kSharded, false, 0);
      auto cp = replay_case(**backend, c, p2);
      log.report(cp.ok() && same_bytes(cp->topk_indices, want->topk_indices),
                 tag + "a P2 step (both ranks on the caller's stream's backend) = one device's top-k",
                 cp.ok() ? "" : cp.status().to_string());
    }
  }
  const cudaError_t alive = cudaStreamQuery(mine);
  log.report(alive == cudaSuccess, tag + "the caller's stream outlives the backend, idle", cudaGetErrorName(alive));
  (void)cudaStreamDestroy(mine);
}

// One backend's checks of the combined buffer (combined_kv_checks_on); for H = 16 again with the streaming
// 16-head kernel forced (its bulk copies read the row stride too).
void combined_kv_checks_on(Backend& gpu, int32_t H, const std::string& kernel, uint64_t seed, CheckLog& log);

// PagedKvCache::wrap of one [num_pages, page_size, kv_row] bf16 buffer (latent then rope, with and without
// padding), H = 64 and 16: the step's results equal the library pools' bit for bit.
void gpu_combined_kv_checks(Backend& gpu, uint64_t seed, CheckLog& log) {
  combined_kv_checks_on(gpu, 64, "", seed, log);
  combined_kv_checks_on(gpu, 16, "", seed, log);
  CudaBackendOptions o;
  o.mla_kernel = CudaBackendOptions::MlaKernel::kSmallHeads;
  auto small = make_cuda_backend(0, o);
  if (!small.ok()) {
    log.report(false, "combined kv rows, small-heads kernel: backend", small.status().to_string());
    return;
  }
  combined_kv_checks_on(**small, 16, " small-heads kernel", seed, log);
}

void combined_kv_checks_on(Backend& gpu, int32_t H, const std::string& kernel, uint64_t seed, CheckLog& log) {
  {
    CaseFile c = make_serving_case(seed + H);
    if (H != 64) {
      CaseGenSpec spec;
      spec.dims = c.dims;
      spec.dims.H = H;
      spec.topk = c.topk;
      spec.scale = c.scale;
      spec.dtype = DType::kBF16;
      spec.seed = seed + H;
      spec.requests = c.requests;
      c = std::move(case_generate(spec)).value();
    }
    ReplayOptions o;
    o.page_size = 64;
    KvSharding sharding;
    const BlockTable table = replay_table(c, o, &sharding);
    const PagedCacheConfig cc = replay_cache_config(c, o, sharding);
    const StepConfig config = step_config_of(c.dims, c.topk, c.scale, DType::kBF16);
    const HostStepInputs in{&c.q_nope, &c.q_rope, &c.kv_latent, &c.k_rope, &c.idx_q, &c.idx_w, &c.idx_k};
    auto created = PagedKvCache::create(gpu, cc, /*poison_unused=*/false);
    Status st = created.ok() ? cache_load_context(gpu, *created, c.requests, table, c.ctx_kv_latent, c.ctx_k_rope,
                                                  c.ctx_idx_k)
                             : created.status();
    Result<StepResult> want = st.ok() ? step_run_host(gpu, config, c.requests, table, *created, in)
                                      : Result<StepResult>(st);
    for (const int32_t kv_row : {cc.Dl + cc.Dr, cc.Dl + cc.Dr + 8}) {
      const std::string tag =
          "combined kv rows, H=" + std::to_string(H) + kernel + " kv_row " + std::to_string(kv_row) + ": ";
      const size_t kv_bytes = PagedKvCache::kv_bytes(cc, kv_row), key_bytes = PagedKvCache::index_keys_bytes(cc);
      void* kv = nullptr;
      void* keys = nullptr;
      if (cudaMalloc(&kv, kv_bytes) != cudaSuccess || cudaMalloc(&keys, key_bytes) != cudaSuccess ||
          cudaMemset(kv, 0, kv_bytes) != cudaSuccess || cudaMemset(keys, 0, key_bytes) != cudaSuccess) {
        log.report(false, tag + "cudaMalloc", cudaGetErrorString(cudaGetLastError()));
        (void)cudaFree(kv);
        (void)cudaFree(keys);
        continue;
      }
      ExternalPools pools;
      pools.kv = kv;
      pools.kv_bytes = kv_bytes;
      pools.kv_row = kv_row;
      pools.index_keys = keys;
      pools.index_keys_bytes = key_bytes;
      auto wrapped = PagedKvCache::wrap(cc, pools);
      Status ws = wrapped.ok() ? cache_load_context(gpu, *wrapped, c.requests, table, c.ctx_kv_latent, c.ctx_k_rope,
                                                    c.ctx_idx_k)
                               : wrapped.status();
      Result<StepResult> got = ws.ok() ? step_run_host(gpu, config, c.requests, table, *wrapped, in)
                                       : Result<StepResult>(ws);
      log.report(got.ok() && want.ok() && same_bytes(got->topk_indices, want->topk_indices) &&
                     same_bytes(got->out, want->out) && same_bytes(got->lse, want->lse),
                 tag + "a step over one [pages, 64, kv_row] buffer = over the library's two pools, bit for bit",
                 !got.ok() ? got.status().to_string() : !want.ok() ? want.status().to_string() : "");
      // Row by row: the latent, then the rope, then zeros (the padding untouched).
      if (got.ok() && want.ok()) {
        const int64_t slots = cc.num_pages * cc.page_size;
        std::vector<uint16_t> rows(static_cast<size_t>(slots * kv_row)), lat(static_cast<size_t>(slots * cc.Dl)),
            rope(static_cast<size_t>(slots * cc.Dr));
        Status cs = gpu.copy_to_host(rows.data(), kv, kv_bytes);
        if (cs.ok()) cs = gpu.copy_to_host(lat.data(), created->latent().data, lat.size() * 2);
        if (cs.ok()) cs = gpu.copy_to_host(rope.data(), created->rope().data, rope.size() * 2);
        int64_t bad = 0;
        for (int64_t t = 0; cs.ok() && t < slots; ++t) {
          const uint16_t* r = rows.data() + t * kv_row;
          bad += std::memcmp(r, lat.data() + t * cc.Dl, cc.Dl * 2) != 0;
          bad += std::memcmp(r + cc.Dl, rope.data() + t * cc.Dr, cc.Dr * 2) != 0;
          for (int32_t d = cc.Dl + cc.Dr; d < kv_row; ++d) bad += r[d] != 0;
        }
        log.report(cs.ok() && bad == 0, tag + "each slot's row = the library pools' latent and rope rows, padding untouched",
                   cs.ok() ? std::to_string(bad) + " rows differ" : cs.to_string());
      }
      (void)cudaFree(kv);
      (void)cudaFree(keys);
    }
  }
}

}  // namespace

class Serving : public GpuTest {};

TEST_F(Serving, Options) { gpu_serving_checks(gpu(), cpu(), 271, check_log()); }
TEST_F(Serving, ExternalStream) { gpu_external_stream_checks(gpu(), 272, check_log()); }
TEST_F(Serving, CombinedKvRows) { gpu_combined_kv_checks(gpu(), 273, check_log()); }

}  // namespace dsacp::testing
