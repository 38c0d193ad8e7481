// dsacp_bench_cp's shared pieces (bench_cp.cc, bench_cp_graph.cc): its options, exits on failure, the rank
// threads, random inputs and the step buffers.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "dsacp/backend.h"
#include "dsacp/fp8.h"
#include "dsacp/cp_step.h"
#include "dsacp/nccl_communicator.h"
#include "dsacp/paged_cache.h"
#include "dsacp/random.h"
#include "dsacp/step.h"
#include "rank_threads.h"
#include "step_shape.h"

namespace dsacp::bench::cp {

inline int g_stagger_us = 0;  // --stagger-us
inline long g_timeout_ms = 300000;  // --timeout-ms: the communicators' bound on every wait
inline size_t g_window_bytes = NcclOptions{}.window_bytes;  // --nccl-window-mb (0: no exchange window)
inline size_t g_peer_exchange_bytes = 0;                    // --nccl-peer-exchange-mb (0: off)
inline bool g_exchange_stamps = false;                      // --exchange-stamps: the peer exchange's phase times

inline void die_if(const Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s failed: %s\n", what, s.to_string().c_str());
    std::exit(2);
  }
}
template <typename T>
T take(Result<T> r, const char* what) {
  die_if(r.status(), what);
  return std::move(r).value();
}

using Clock = std::chrono::steady_clock;
inline double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

inline RankThreads* g_ranks = nullptr;  // made in main, one thread for every GPU, before any rank work

// f(r) for ranks r < n (at most the GPUs' count), each on its rank's thread.
template <typename F>
void on_ranks(int n, F f) {
  g_ranks->run([&](int r) {
    if (r < n) f(r);
  });
}

// 64 MiB of random bf16 in [-1, 1), tiled over a buffer (no two indexer keys of a 128K context repeat).
inline const std::vector<uint16_t>& random_block() {
  static std::vector<uint16_t> block = [] {
    std::vector<uint16_t> b(32u << 20);
    for (size_t i = 0; i < b.size(); ++i) {
      b[i] = f32_to_bf16(static_cast<float>((counter_hash(7, 1, i) >> 40) * (2.0 / 16777216.0) - 1.0)).bits;
    }
    return b;
  }();
  return block;
}

inline void fill_random(Backend& be, void* p, size_t bytes) {
  const auto& b = random_block();
  const size_t chunk = std::min(bytes, b.size() * 2);
  die_if(be.copy_to_device(p, b.data(), chunk), "upload random block");
  for (size_t at = chunk; at < bytes; at += chunk) {
    die_if(be.copy_on_device(static_cast<char*>(p) + at, p, std::min(chunk, bytes - at)), "tile random block");
  }
}

using bench::StepBuffers;
using bench::ordered_table;

inline StepConfig config() { return bench::decode_step_config(); }

// The steps read a block table kept on the device (StepInputs::block_table), as a serving engine keeps it;
// --host-table uploads the host table every step instead.
inline bool g_device_table = true;

// A rank's (or the one GPU's) step buffers, filled: random bf16 rows, head weights in [0, 1).
inline StepBuffers step_buffers(Backend& be, const StepConfig& c, int64_t rows, int64_t heads, int64_t out_rows) {
  StepBuffers b = take(bench::allocate_step_buffers(be, c, rows, heads, out_rows), "allocate");
  const size_t bf = 2;
  fill_random(be, b.q_nope.get(), rows * heads * c.Dl * bf);
  fill_random(be, b.q_rope.get(), rows * heads * c.Dr * bf);
  fill_random(be, b.kv.get(), rows * c.Dl * bf);
  fill_random(be, b.kr.get(), rows * c.Dr * bf);
  fill_random(be, b.iq.get(), rows * c.Hi * c.Di * bf);
  fill_random(be, b.ik.get(), rows * c.Di * bf);
  std::vector<float> w(static_cast<size_t>(std::max<int64_t>(rows * c.Hi, 1)));
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>((counter_hash(9, 2, i) >> 40) / 16777216.0);
  die_if(be.copy_to_device(b.iw.get(), w.data(), w.size() * sizeof(float)), "upload weights");
  return b;
}

// --fp8-kv: the latent cache as fp8_ds_mla records (656 B a key) instead of bf16 rows.
inline bool g_fp8_kv = false;

// A cache of `pages` pages of 64 tokens for the step's dims: bf16 rows, or with --fp8-kv fp8_ds_mla records (the
// indexer keys stay bf16).
inline PagedCacheConfig bench_cache_config(int64_t pages, const StepConfig& c) {
  PagedCacheConfig cc{pages, 64, c.Dl, c.Dr, c.Di, DType::kBF16};
  if (g_fp8_kv) cc.latent_format = LatentFormat::kFp8DsMla;
  return cc;
}

// 4096 valid fp8_ds_mla records (Dl 512, Dr 64) tiled over a record pool: e4m3 values without NaN (exponent at
// most 13), tile scales in [0.005, 0.01), bf16 rope in [-1, 1).
inline void fill_records(Backend& be, void* pool, int64_t records) {
  const int32_t rec = fp8_ds_mla_record_bytes(512, 64);
  static const std::vector<uint8_t> block = [rec] {
    std::vector<uint8_t> b(static_cast<size_t>(4096) * rec);
    for (size_t r = 0; r < 4096; ++r) {
      uint8_t* p = b.data() + r * rec;
      for (int i = 0; i < 512; ++i) {
        const uint64_t h = counter_hash(11, r, static_cast<uint64_t>(i));
        p[i] = static_cast<uint8_t>((h & 0x80) | ((h >> 8) % 0x70));
      }
      for (int k = 0; k < 4; ++k) {
        const float s = 0.005f + 0.005f * static_cast<float>((counter_hash(12, r, k) >> 40) / 16777216.0);
        std::memcpy(p + 512 + 4 * k, &s, 4);
      }
      for (int i = 0; i < 64; ++i) {
        const uint16_t v =
            f32_to_bf16(static_cast<float>((counter_hash(13, r, i) >> 40) * (2.0 / 16777216.0) - 1.0)).bits;
        std::memcpy(p + 528 + 2 * i, &v, 2);
      }
    }
    return b;
  }();
  const size_t bytes = static_cast<size_t>(records) * rec, chunk = std::min(bytes, block.size());
  die_if(be.copy_to_device(pool, block.data(), chunk), "upload records");
  for (size_t at = chunk; at < bytes; at += chunk) {
    die_if(be.copy_on_device(static_cast<char*>(pool) + at, pool, std::min(chunk, bytes - at)), "tile records");
  }
}

inline void fill_cache(Backend& be, const PagedKvCache& cache) {
  if (cache.config().fp8_latent()) {
    const PagedPoolView& v = cache.latent();
    fill_records(be, v.data, v.num_pages * v.page_size);
  } else {
    for (const PagedPoolView& v : {cache.latent(), cache.rope()}) {
      fill_random(be, v.data, static_cast<size_t>(v.num_pages) * v.page_size * v.dim * 2);
    }
  }
  const PagedPoolView& k = cache.index_keys();
  fill_random(be, k.data, static_cast<size_t>(k.num_pages) * k.page_size * k.dim * 2);
}

// A batch on a P x D layout's ranks: the KV sharding (page 64), the block table (request b's pages in order), a
// rank's cache configuration and every rank's plan.
struct CpBatch {
  KvSharding sharding;
  BlockTable table;
  PagedCacheConfig cc;
  std::vector<CpRankPlan> plans;  // rank cr = r * D + d
};
inline CpBatch cp_batch(const StepConfig& c, const std::vector<Request>& requests, const CpLayout& layout) {
  CpBatch b;
  b.sharding = cp_kv_sharding(layout, 64);
  int32_t max_pages = 0;
  for (const Request& r : requests) {
    max_pages = std::max<int32_t>(max_pages, static_cast<int32_t>(b.sharding.pages_needed(r.seq_len(), 64)));
  }
  b.table = ordered_table(static_cast<int32_t>(requests.size()), max_pages);
  b.cc = cp_rank_cache_config(layout, bench_cache_config(static_cast<int64_t>(requests.size()) * max_pages, c));
  for (int cr = 0; cr < layout.num_ranks(); ++cr) {
    b.plans.push_back(take(cp_rank_plan(requests, layout, cr / layout.D, cr % layout.D, b.table, 64,
                                        c.decode_threshold, c.H),
                           "cp_rank_plan"));
  }
  return b;
}

// The ranks' NCCL communicators for a P x D layout (world, PCP group, DCP group), one thread per GPU.
inline std::vector<OwnedCpComms> make_comms(const std::vector<std::unique_ptr<Backend>>& gpus, const CpLayout& layout) {
  const int Pt = layout.num_ranks();
  std::vector<OwnedCpComms> comms(static_cast<size_t>(Pt));
  const NcclId id = take(nccl_make_id(), "nccl id");
  on_ranks(Pt, [&](int cr) {
    NcclOptions o;
    o.device = cr;
    o.producer_stream = gpus[cr]->native_stream();
    o.timeout = std::chrono::milliseconds(g_timeout_ms);
    o.window_bytes = g_window_bytes;
    o.peer_exchange_bytes = g_peer_exchange_bytes;
    o.exchange_stamps = g_exchange_stamps;
    comms[cr] = take(nccl_cp_comms(id, layout, cr, o), "nccl communicators");
  });
  return comms;
}

}  // namespace dsacp::bench::cp
