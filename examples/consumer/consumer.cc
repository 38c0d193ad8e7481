// One DSA step through the installed package: a decode request and a short prefill over a paged cache on the CPU
// backend; every query row's top-k and attention output are then checked against a direct computation.
#include <dsacp/backend.h>
#include <dsacp/paged_cache.h>
#include <dsacp/random.h>
#include <dsacp/step.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

namespace {

dsacp::Tensor filled(dsacp::Shape shape, uint64_t seed) {
  dsacp::Tensor t = dsacp::Tensor::zeros(dsacp::DType::kF32, std::move(shape)).value();
  for (int64_t i = 0; i < t.numel(); ++i) t.set_f32(i, dsacp::counter_uniform(seed, 0, static_cast<uint64_t>(i)));
  return t;
}

int fail(const char* what, const dsacp::Status& s) {
  std::fprintf(stderr, "dsacp_consumer: %s: %s\n", what, s.to_string().c_str());
  return 1;
}

}  // namespace

int main() {
  using namespace dsacp;
  const int32_t H = 2, Dl = 16, Dr = 8, Hi = 2, Di = 16, K = 8, page_size = 8;
  const std::vector<Request> requests = {{1, 20}, {3, 0}};  // a decode over 20 cached tokens; a 3-token prefill

  std::unique_ptr<Backend> backend = make_cpu_backend(1);
  PagedCacheConfig cc;
  cc.num_pages = 8;
  cc.page_size = page_size;
  cc.Dl = Dl;
  cc.Dr = Dr;
  cc.Di = Di;
  cc.dtype = DType::kF32;
  Result<PagedKvCache> cache = PagedKvCache::create(*backend, cc);
  if (!cache.ok()) return fail("cache", cache.status());

  // Pages from a shuffled allocator: one block table row per request.
  PageAllocator allocator(cc.num_pages, /*shuffle_seed=*/7);
  std::vector<SequencePages> seqs(requests.size());
  std::vector<const SequencePages*> seq_ptrs;
  for (size_t b = 0; b < requests.size(); ++b) {
    if (Status s = seqs[b].reserve(allocator, requests[b].seq_len(), page_size); !s.ok()) return fail("pages", s);
    seq_ptrs.push_back(&seqs[b]);
  }
  const BlockTable table = BlockTable::from_sequences(seq_ptrs);

  const int64_t C = 20, T = 4;  // context rows (request 0's), new tokens
  Tensor ctx_latent = filled({C, Dl}, 1), ctx_rope = filled({C, Dr}, 2), ctx_keys = filled({C, Di}, 3);
  if (Status s = cache_load_context(*backend, *cache, requests, table, ctx_latent, ctx_rope, ctx_keys); !s.ok()) {
    return fail("context", s);
  }
  Tensor q_nope = filled({T, H, Dl}, 4), q_rope = filled({T, H, Dr}, 5), kv_latent = filled({T, Dl}, 6),
         k_rope = filled({T, Dr}, 7), idx_q = filled({T, Hi, Di}, 8), idx_w = filled({T, Hi}, 9),
         idx_k = filled({T, Di}, 10);
  StepConfig config;
  config.H = H;
  config.Dl = Dl;
  config.Dr = Dr;
  config.Hi = Hi;
  config.Di = Di;
  config.K = K;
  config.scale = 0.25f;
  config.act_dtype = DType::kF32;
  HostStepInputs in{&q_nope, &q_rope, &kv_latent, &k_rope, &idx_q, &idx_w, &idx_k};
  Result<StepResult> result = step_run_host(*backend, config, requests, table, *cache, in);
  if (!result.ok()) return fail("step", result.status());

  // The keys each token sees (request-relative positions): request 0's context then its new token; request 1's
  // new tokens, causally.
  struct Row {
    int64_t first_key_row;  // where the request's keys start in the concatenation below
    int64_t key_len;
  };
  const Row rows[T] = {{0, 21}, {21, 1}, {21, 2}, {21, 3}};
  auto key_value = [&](const Tensor& ctx, const Tensor& fresh, int64_t dim, int64_t key_row, int64_t d) {
    // key rows: ctx rows 0..19, request 0's new token (fresh row 0), request 1's new tokens (fresh rows 1..3)
    return key_row < C ? ctx.get_f32(key_row * dim + d) : fresh.get_f32((key_row - C) * dim + d);
  };
  double worst = 0;
  for (int64_t t = 0; t < T; ++t) {
    // Indexer scores and the canonical top-k: highest first, ties to the lower position, then ascending.
    std::vector<std::pair<double, int64_t>> scored;
    for (int64_t j = 0; j < rows[t].key_len; ++j) {
      double score = 0;
      for (int32_t h = 0; h < Hi; ++h) {
        double dot = 0;
        for (int32_t d = 0; d < Di; ++d) {
          dot += double{idx_q.get_f32((t * Hi + h) * Di + d)} * key_value(ctx_keys, idx_k, Di, rows[t].first_key_row + j, d);
        }
        score += idx_w.get_f32(t * Hi + h) * std::max(0.0, dot);
      }
      scored.push_back({-score, j});
    }
    std::sort(scored.begin(), scored.end());
    std::vector<int64_t> chosen;
    for (size_t i = 0; i < std::min<size_t>(K, scored.size()); ++i) chosen.push_back(scored[i].second);
    std::sort(chosen.begin(), chosen.end());
    for (int32_t i = 0; i < K; ++i) {
      const int64_t want = i < static_cast<int32_t>(chosen.size()) ? chosen[static_cast<size_t>(i)] : -1;
      if (result->topk_indices.data_as<int32_t>()[t * K + i] != want) {
        std::fprintf(stderr, "dsacp_consumer: token %lld: top-k entry %d is %d, expected %lld\n",
                     static_cast<long long>(t), i, result->topk_indices.data_as<int32_t>()[t * K + i],
                     static_cast<long long>(want));
        return 1;
      }
    }
    // Attention over the chosen keys: out = softmax(scale * (q_nope . latent + q_rope . rope)) @ latent.
    for (int32_t h = 0; h < H; ++h) {
      std::vector<double> logit;
      for (int64_t j : chosen) {
        const int64_t kr = rows[t].first_key_row + j;
        double l = 0;
        for (int32_t d = 0; d < Dl; ++d) l += double{q_nope.get_f32((t * H + h) * Dl + d)} * key_value(ctx_latent, kv_latent, Dl, kr, d);
        for (int32_t d = 0; d < Dr; ++d) l += double{q_rope.get_f32((t * H + h) * Dr + d)} * key_value(ctx_rope, k_rope, Dr, kr, d);
        logit.push_back(config.scale * l);
      }
      const double m = *std::max_element(logit.begin(), logit.end());
      double sum = 0;
      for (double l : logit) sum += std::exp(l - m);
      for (int32_t d = 0; d < Dl; ++d) {
        double o = 0;
        for (size_t i = 0; i < chosen.size(); ++i) {
          o += std::exp(logit[i] - m) / sum * key_value(ctx_latent, kv_latent, Dl, rows[t].first_key_row + chosen[i], d);
        }
        worst = std::max(worst, std::abs(o - result->out.get_f32((t * H + h) * Dl + d)));
      }
      worst = std::max(worst, std::abs(m + std::log(sum) - result->lse.get_f32(t * H + h)));
    }
  }
  if (!(worst < 1e-4)) {
    std::fprintf(stderr, "dsacp_consumer: out / lse differ from the direct computation by %g\n", worst);
    return 1;
  }
  std::printf("dsacp_consumer: %lld tokens on %s: top-k exact, out and lse within %.1e of fp64 -> PASS\n",
              static_cast<long long>(T), backend->name().c_str(), worst);
  return 0;
}
