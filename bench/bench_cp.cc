// Context-parallel scaling on all the GPUs of one machine (NCCL, one thread per GPU), against one GPU in the
// same run: PCP prefill of one long request (32K, 128K tokens), DCP decode at batch 64 (--batch) with 32K and 128K
// contexts (sharded and replicated indexer), and NCCL all-gather / all-to-all bus bandwidth in the style of
// nccl-tests. Whole steps through the executors (step_run on one GPU, cp_step_run per rank) with device-resident
// inputs: host planning, uploads, kernels, collectives. Each rank's communicators' statistics (device time of
// the collectives, time blocked in wait) give compute vs communication and the overlap; phases come from
// separate passes with a StepPhaseRecorder (it synchronizes at phase boundaries). Median of the timed reps
// after one warm-up; the ranks start a step together (a spin barrier) and its time runs from the first rank's
// start to the last rank's end; every step (the one-GPU one too) runs on a long-lived rank thread pinned to a
// core of its own. --only graph: a pass of decode layers captured into one CUDA graph and replayed, one GPU against
// D = n (bench_cp_graph.cc). H=128, Dl=512, Dr=64, Hi=64, Di=128, K=2048, page 64, bf16.
// Usage: dsacp_bench_cp [--json FILE] [--reps N] [--only busbw|pcp|dcp|graph] [--S TOKENS] [--mode sharded|replicated]
//        [--quick] [--host-table] [--one-gpu-only] [--stagger-us N] [--no-pin] [--timeout-ms N] [--batch N]
//        [--nccl-window-mb N (0: none)] [--nccl-peer-exchange-mb N (0: off)] [--exchange-stamps]
//        [--fp8-kv (the latent cache as fp8_ds_mla records: issue 26's DCP row)]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <optional>
#include <string>
#include <thread>

#include <pthread.h>
#include <sched.h>
#include <vector>

#include "dsacp/backend.h"
#include "dsacp/cp_step.h"
#include "dsacp/dtype.h"
#include "dsacp/nccl_communicator.h"
#include "dsacp/random.h"
#include "dsacp/step.h"
#include "dsacp/step_timing.h"
#include "bench_cp_graph.h"
#include "cp_bench_support.h"
#include "rank_threads.h"
#include "step_shape.h"

using namespace dsacp;

namespace {

using namespace bench::cp;
using bench::RankThreads;
using bench::SpinBarrier;
using bench::cpu_relax;
using bench::one_cpu_per_core;
using bench::pin_to;

struct Measure {
  double step_ms = 0;
  StepPhaseTimes phases;  // rank 0, per step (averaged over the timed reps)
  StepLaunchTimes launch;  // the slowest rank's host times per timed step: to its indexer launch, whole step
  double rank_to_indexer_ms[8] = {};  // with --stagger-us: each rank's
  double start_skew_us = 0;  // the latest rank's step start after the earliest's, per timed step (the spin barrier's)
  double comm_busy_ms = 0, comm_enqueue_ms = 0, comm_wait_ms = 0, comm_bytes = 0;  // rank 0, per step
  // Rank 0, per step: all collectives, those by the peer exchange, and window publishes.
  double collectives = 0, peer_collectives = 0, window_publishes = 0;
  size_t kv_bytes_per_gpu = 0;
};

std::string measure_json(const Measure& m) {
  char buf[512];
  const double overlap = m.comm_busy_ms > 0 ? std::max(0.0, 1.0 - m.comm_wait_ms / m.comm_busy_ms) : 0.0;
  std::snprintf(buf, sizeof buf,
                "{\"step_ms\":%.4f,\"kv_ms\":%.4f,\"topk_ms\":%.4f,\"attention_ms\":%.4f,\"comm_busy_ms\":%.4f,"
                "\"comm_enqueue_ms\":%.4f,\"comm_wait_ms\":%.4f,\"comm_bytes\":%.0f,\"overlap\":%.3f,"
                "\"collectives\":%.1f,\"peer_collectives\":%.1f,\"window_publishes\":%.1f,\"host_to_indexer_ms\":%.4f,"
                "\"start_skew_us\":%.2f,\"kv_bytes_per_gpu\":%zu}",
                m.step_ms, m.phases.kv_ms, m.phases.topk_ms, m.phases.attention_ms, m.comm_busy_ms, m.comm_enqueue_ms,
                m.comm_wait_ms, m.comm_bytes, overlap, m.collectives, m.peer_collectives, m.window_publishes, m.launch.to_indexer_ms,
                m.start_skew_us, m.kv_bytes_per_gpu);
  return buf;
}

void scale_phases(StepPhaseTimes& p, int n) {
  if (n <= 0) return;
  p.kv_ms /= n;
  p.topk_ms /= n;
  p.attention_ms /= n;
  p.total_ms /= n;
}

// One GPU: step_run over `requests` (cache filled with random context first when `fill`).
Measure one_gpu(Backend& be, const StepConfig& c, const std::vector<Request>& requests, int reps, bool fill) {
  int64_t T = 0;
  int32_t max_pages = 0;
  for (const Request& r : requests) {
    T += r.query_len;
    max_pages = std::max<int32_t>(max_pages, static_cast<int32_t>((r.seq_len() + 63) / 64));
  }
  const BlockTable table = ordered_table(static_cast<int32_t>(requests.size()), max_pages);
  const PagedCacheConfig cc = bench_cache_config(static_cast<int64_t>(requests.size()) * max_pages, c);
  PagedKvCache cache = take(PagedKvCache::create(be, cc, false), "cache");
  if (fill) fill_cache(be, cache);
  StepBuffers b = step_buffers(be, c, T, c.H, T);
  if (g_device_table) die_if(bench::keep_table_on_device(be, table, b), "device block table");
  Measure m;
  m.kv_bytes_per_gpu = cache.bytes();
  std::vector<double> times;
  // Passes 1..reps record phases (a recorder synchronizes at each phase boundary, which would perturb the step
  // time); passes reps+1..2*reps time whole steps.
  for (int i = 0; i <= 2 * reps; ++i) {
    StepPhaseTimes phases;
    const bool phase_pass = i >= 1 && i <= reps;
    StepLaunchTimes launch;
    double ms = 0;
    on_ranks(1, [&](int) {  // on rank 0's thread, as each CP rank's step runs on its own
      die_if(be.synchronize(), "synchronize");
      const auto t0 = Clock::now();
      {
        std::optional<StepPhaseRecorder> rec;
        if (phase_pass) rec.emplace(&phases);
        StepLaunchRecorder launch_rec(&launch);
        die_if(step_run(be, c, requests, table, cache, b.in(), b.outs()), "step_run");
      }
      ms = ms_since(t0);
    });
    if (i == 0) continue;  // warm-up
    if (!phase_pass) {
      times.push_back(ms);
      m.launch.to_indexer_ms += launch.to_indexer_ms / reps;
      m.launch.total_ms += launch.total_ms / reps;
      continue;
    }
    m.phases.kv_ms += phases.kv_ms;
    m.phases.topk_ms += phases.topk_ms;
    m.phases.attention_ms += phases.attention_ms;
  }
  scale_phases(m.phases, reps);
  m.step_ms = median(times);
  return m;
}

// P x D ranks, rank cr on GPU cr: cp_step_run over `requests`.
Measure cp_gpus(std::vector<std::unique_ptr<Backend>>& gpus, const StepConfig& c, const std::vector<Request>& requests,
                const CpLayout& layout, int reps, bool fill) {
  const int Pt = layout.num_ranks();
  const CpBatch batch = cp_batch(c, requests, layout);
  const KvSharding& sharding = batch.sharding;
  const BlockTable& table = batch.table;
  const PagedCacheConfig& cc = batch.cc;
  const std::vector<CpRankPlan>& plans = batch.plans;
  std::vector<OwnedCpComms> comms = make_comms(gpus, layout);
  std::vector<PagedKvCache> caches;
  std::vector<StepBuffers> bufs(static_cast<size_t>(Pt));
  for (int cr = 0; cr < Pt; ++cr) caches.push_back(take(PagedKvCache::create(*gpus[cr], cc, false), "cache"));
  on_ranks(Pt, [&](int cr) {
    if (fill) fill_cache(*gpus[cr], caches[cr]);
    bufs[cr] = step_buffers(*gpus[cr], c, plans[cr].num_rows, plans[cr].num_heads, plans[cr].output_rows);
    if (g_device_table) die_if(bench::keep_table_on_device(*gpus[cr], table, bufs[cr]), "device block table");
  });
  Measure m;
  m.kv_bytes_per_gpu = caches[0].bytes();
  std::vector<double> times;
  std::vector<StepPhaseTimes> phases(static_cast<size_t>(Pt));
  std::vector<StepLaunchTimes> rank_launch(static_cast<size_t>(Pt));
  std::vector<Clock::time_point> rank_start(static_cast<size_t>(Pt)), rank_end(static_cast<size_t>(Pt));
  SpinBarrier start_together(Pt);
  for (int i = 0; i <= 2 * reps; ++i) {
    const bool phase_pass = i >= 1 && i <= reps;  // as in one_gpu: phase passes, then timed passes
    on_ranks(Pt, [&](int cr) {
      OwnedCpComms& rc = comms[cr];
      die_if(rc.world->barrier(), "barrier");
      for (auto* comm : {rc.world.get(), rc.pcp.get(), rc.dcp.get()}) comm->reset_stats();
      start_together.arrive_and_wait();
      // --stagger-us N (a diagnostic): rank r starts its step r * N us after the barrier, so the ranks' host work
      // before their indexers does not overlap (ranks that are threads share the CUDA driver).
      if (g_stagger_us > 0 && cr > 0) {
        const auto until = Clock::now() + std::chrono::microseconds(g_stagger_us * cr);
        while (Clock::now() < until) cpu_relax();
      }
      StepPhaseTimes p;
      StepLaunchTimes launch;
      const auto t0 = Clock::now();
      {
        std::optional<StepPhaseRecorder> rec;
        if (phase_pass) rec.emplace(&p);
        StepLaunchRecorder launch_rec(&launch);
        const CpComms cp = rc.view();
        die_if(cp_step_run(*gpus[cr], cp, c, requests, plans[cr], layout, sharding, table, caches[cr], bufs[cr].in(),
                           bufs[cr].outs()),
               "cp_step_run");
      }
      rank_end[cr] = Clock::now();
      rank_start[cr] = t0;
      phases[cr] = p;
      rank_launch[cr] = launch;
    });
    if (i == 0) continue;
    if (phase_pass) {
      m.phases.kv_ms += phases[0].kv_ms;
      m.phases.topk_ms += phases[0].topk_ms;
      m.phases.attention_ms += phases[0].attention_ms;
      continue;
    }
    // The step: from the earliest rank's start to the latest rank's end (the ranks start together: SpinBarrier).
    const Clock::time_point first = *std::min_element(rank_start.begin(), rank_start.end());
    const Clock::time_point last_start = *std::max_element(rank_start.begin(), rank_start.end());
    times.push_back(std::chrono::duration<double, std::milli>(*std::max_element(rank_end.begin(), rank_end.end()) - first)
                        .count());
    m.start_skew_us += std::chrono::duration<double, std::micro>(last_start - first).count() / reps;
    double to_indexer = 0;
    for (const StepLaunchTimes& l : rank_launch) to_indexer = std::max(to_indexer, l.to_indexer_ms);
    m.launch.to_indexer_ms += to_indexer / reps;
    if (g_stagger_us > 0) {
      for (size_t r = 0; r < rank_launch.size(); ++r) m.rank_to_indexer_ms[r] += rank_launch[r].to_indexer_ms / reps;
    }
    for (auto* comm : {comms[0].world.get(), comms[0].pcp.get(), comms[0].dcp.get()}) {
      const CommStats s = comm->stats();
      m.comm_busy_ms += s.busy_ms;
      m.comm_enqueue_ms += s.enqueue_ms;
      m.comm_wait_ms += s.wait_ms;
      m.comm_bytes += static_cast<double>(s.bytes);
      m.collectives += static_cast<double>(s.collectives);
      m.peer_collectives += static_cast<double>(s.peer_collectives);
      m.window_publishes += static_cast<double>(s.window_publishes);
    }
  }
  scale_phases(m.phases, reps);
  m.comm_busy_ms /= reps;
  m.comm_enqueue_ms /= reps;
  m.comm_wait_ms /= reps;
  m.comm_bytes /= reps;
  m.collectives /= reps;
  m.peer_collectives /= reps;
  m.window_publishes /= reps;
  m.step_ms = median(times);
  on_ranks(Pt, [&](int cr) { comms[cr] = OwnedCpComms{}; });
  return m;
}

CpLayout layout_of(int P, int D, IndexerMode indexer) {
  CpLayout l;
  l.P = P;
  l.D = D;
  l.indexer = indexer;
  return l;
}

// nccl-tests style: size = the gathered (all-gather) or exchanged (all-to-all) bytes per rank; time = a loop of
// back-to-back collectives over the iterations; algbw = size / time; busbw = algbw * (n - 1) / n. Single
// collectives' latency (launch to completion, waited one by one) shows in the steps' comm_busy.
std::vector<std::string> busbw(std::vector<std::unique_ptr<Backend>>& be, int n, bool quick) {
  std::vector<std::string> rows;
  CpLayout l = layout_of(n, 1, IndexerMode::kSharded);
  std::vector<OwnedCpComms> comms = make_comms(be, l);
  std::printf("\n%-10s %12s %10s %10s %10s %12s  %s\n", "op", "size", "time us", "algbw GB/s", "busbw GB/s",
              "one-by-one us", "via");
  for (const char* op : {"all_gather", "all_to_all"}) {
    for (size_t size = size_t{1} << 20; size <= (size_t{1} << 30); size <<= (quick ? 4 : 1)) {
      const size_t per_rank = size / n;
      std::vector<double> us(static_cast<size_t>(n)), single_us(static_cast<size_t>(n));
      comms[0].world->reset_stats();
      on_ranks(n, [&](int r) {
        DeviceBuffer send = take(be[r]->allocate(size), "allocate"), recv = take(be[r]->allocate(size), "allocate");
        Communicator& c = *comms[r].world;
        const bool ag = std::strcmp(op, "all_gather") == 0;
        const int warm = 5, iters = size >= (size_t{256} << 20) ? 10 : 40;
        for (int i = 0; i < warm; ++i) {
          die_if(ag ? c.all_gather(send.get(), recv.get(), per_rank) : c.all_to_all(send.get(), recv.get(), per_rank),
                 op);
        }
        // Back to back, then one wait for all (nccl-tests: a timed loop, then a stream synchronization).
        die_if(c.barrier(), "barrier");
        std::vector<std::unique_ptr<CollectiveHandle>> handles;
        const auto t0 = Clock::now();
        for (int i = 0; i < iters; ++i) {
          handles.push_back(take(ag ? c.all_gather_async(send.get(), recv.get(), per_rank)
                                    : c.all_to_all_async(send.get(), recv.get(), per_rank),
                                 op));
        }
        for (auto& h : handles) die_if(h->wait(), op);
        us[r] = ms_since(t0) * 1000.0 / iters;
        // One at a time: launch to completion (what a step that waits on each collective pays).
        const auto t1 = Clock::now();
        for (int i = 0; i < iters; ++i) {
          die_if(ag ? c.all_gather(send.get(), recv.get(), per_rank) : c.all_to_all(send.get(), recv.get(), per_rank),
                 op);
        }
        single_us[r] = ms_since(t1) * 1000.0 / iters;
      });
      const double t = *std::max_element(us.begin(), us.end());
      const double algbw = static_cast<double>(size) / (t * 1e-6) / 1e9;
      const double bus = algbw * (n - 1) / n;
      const double single = *std::max_element(single_us.begin(), single_us.end());
      // Which transport moved it: the communicator's peer exchange (sizes that fit its slot) or NCCL.
      const char* via = comms[0].world->stats().peer_collectives > 0 ? "peer" : "nccl";
      std::printf("%-10s %12zu %10.1f %10.1f %10.1f %12.1f  %s\n", op, size, t, algbw, bus, single, via);
      char buf[260];
      std::snprintf(buf, sizeof buf,
                    "{\"op\":\"%s\",\"ranks\":%d,\"bytes\":%zu,\"us\":%.2f,\"algbw\":%.2f,\"busbw\":%.2f,"
                    "\"single_us\":%.2f,\"via\":\"%s\"}",
                    op, n, size, t, algbw, bus, single, via);
      rows.push_back(buf);
    }
  }
  // Window publishes (Communicator::window_next + window_publish of a 4 KiB message): the synchronization a
  // window exchange costs, back to back and one by one.
  {
    std::vector<double> us(static_cast<size_t>(n)), single_us(static_cast<size_t>(n));
    bool have = true;
    on_ranks(n, [&](int r) {
      Communicator& c = *comms[r].world;
      c.set_producer_stream(be[r]->native_stream());
      auto one = [&]() -> Result<std::unique_ptr<CollectiveHandle>> {
        DSACP_ASSIGN_OR_RETURN(auto w, c.window_next(4096));
        (void)w;
        return c.window_publish();
      };
      if (!one().ok()) {
        have = false;
        return;
      }
      for (int i = 0; i < 5; ++i) die_if(take(one(), "window")->wait(), "window");
      die_if(c.barrier(), "barrier");
      const int iters = 40;
      std::vector<std::unique_ptr<CollectiveHandle>> handles;
      const auto t0 = Clock::now();
      for (int i = 0; i < iters; ++i) handles.push_back(take(one(), "window"));
      for (auto& h : handles) die_if(h->wait(), "window");
      us[r] = ms_since(t0) * 1000.0 / iters;
      const auto t1 = Clock::now();
      for (int i = 0; i < iters; ++i) die_if(take(one(), "window")->wait(), "window");
      single_us[r] = ms_since(t1) * 1000.0 / iters;
    });
    if (have) {
      const double t = *std::max_element(us.begin(), us.end());
      const double single = *std::max_element(single_us.begin(), single_us.end());
      std::printf("%-10s %12d %10.1f %10s %10s %12.1f  %s\n", "window", 0, t, "-", "-", single, "window");
      char buf[200];
      std::snprintf(buf, sizeof buf, "{\"op\":\"window_publish\",\"ranks\":%d,\"bytes\":0,\"us\":%.2f,\"single_us\":%.2f}",
                    n, t, single);
      rows.push_back(buf);
    }
  }
  on_ranks(n, [&](int r) { comms[r] = OwnedCpComms{}; });
  return rows;
}

void print_case(const char* name, const Measure& one, const Measure& cp) {
  if (g_stagger_us > 0) {
    std::printf("ranks started %d us apart: host to indexer launch per rank %.3f / %.3f ms\n", g_stagger_us,
                cp.rank_to_indexer_ms[0], cp.rank_to_indexer_ms[1]);
  }
  const double overlap = cp.comm_busy_ms > 0 ? std::max(0.0, 1.0 - cp.comm_wait_ms / cp.comm_busy_ms) : 0.0;
  std::printf("%-34s 1 GPU %9.3f ms | CP %9.3f ms  speedup %5.2fx (ratio %.2f)  kv %.2f/%.2f/%.2f ms"
              "  comm busy %.3f enqueue %.3f wait %.3f ms (overlap %.0f%%)  KV/GPU %.2f -> %.2f GiB"
              "  collectives %.0f (window %.0f)  host to indexer launch %.3f / %.3f ms  start skew %.1f us\n",
              name, one.step_ms, cp.step_ms, one.step_ms / cp.step_ms, cp.step_ms / one.step_ms, cp.phases.kv_ms,
              cp.phases.topk_ms, cp.phases.attention_ms, cp.comm_busy_ms, cp.comm_enqueue_ms, cp.comm_wait_ms,
              100 * overlap,
              one.kv_bytes_per_gpu / 1073741824.0, cp.kv_bytes_per_gpu / 1073741824.0, cp.collectives,
              cp.window_publishes, one.launch.to_indexer_ms, cp.launch.to_indexer_ms, cp.start_skew_us);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  std::string json, only;
  int reps = 3;
  bool quick = false;
  int batch = 64;  // --batch: the DCP decode batch
  int64_t only_S = 0;
  std::string only_mode;
  bool one_gpu_only = false;
  bool pin = true;  // DCP: time the one-GPU step only (its timeline is then the last step's)
  CudaBackendOptions cuda_options;  // --cuda-timeline: each GPU's timeline of the last step
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json" && i + 1 < argc) json = argv[++i];
    else if (a == "--reps" && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
    else if (a == "--only" && i + 1 < argc) only = argv[++i];
    else if (a == "--quick") quick = true;
    else if (a == "--S" && i + 1 < argc) only_S = std::atoll(argv[++i]);
    else if (a == "--mode" && i + 1 < argc) only_mode = argv[++i];
    else if (a == "--host-table") g_device_table = false;
    else if (a == "--one-gpu-only") one_gpu_only = true;
    else if (a == "--stagger-us" && i + 1 < argc) g_stagger_us = std::atoi(argv[++i]);
    else if (a == "--no-pin") pin = false;
    else if (a == "--cuda-timeline") cuda_options.timeline = true;
    else if (a == "--timeout-ms" && i + 1 < argc) g_timeout_ms = std::atol(argv[++i]);
    else if (a == "--batch" && i + 1 < argc) batch = std::max(1, std::atoi(argv[++i]));
    else if (a == "--nccl-window-mb" && i + 1 < argc) g_window_bytes = size_t(std::max(0L, std::atol(argv[++i]))) << 20;
    else if (a == "--nccl-peer-exchange-mb" && i + 1 < argc) {
      g_peer_exchange_bytes = size_t(std::max(0L, std::atol(argv[++i]))) << 20;
    } else if (a == "--exchange-stamps") g_exchange_stamps = true;
    else if (a == "--fp8-kv") g_fp8_kv = true;
  }
  auto count = cuda_device_count();
  if (!count.ok() || *count < 2 || !nccl_available()) {
    std::printf("needs 2 GPUs and NCCL (%s, %s)\n", count.ok() ? std::to_string(*count).c_str() : "no CUDA",
                nccl_version().c_str());
    return 77;
  }
  const int n = *count;  // every GPU of the machine: P = n, D = n, and P x D = 2 x n/2, n/2 x 2 from 4 GPUs
  std::vector<std::unique_ptr<Backend>> gpus;
  for (int g = 0; g < n; ++g) gpus.push_back(take(make_cuda_backend(g, cuda_options), "backend"));
  // The main thread and each rank thread on a core of its own (--no-pin: wherever the OS puts them).
  std::vector<int> cpus = pin ? one_cpu_per_core() : std::vector<int>{};
  if (cpus.size() < static_cast<size_t>(n) + 1) cpus.clear();
  if (!cpus.empty() && !pin_to(cpus[0])) std::fprintf(stderr, "main thread: could not pin to CPU %d\n", cpus[0]);
  std::string pinned = cpus.empty() ? "not pinned" : "main thread and ranks on CPUs";
  for (size_t k = 0; k < cpus.size() && k <= static_cast<size_t>(n); ++k) pinned += " " + std::to_string(cpus[k]);
  RankThreads rank_threads(n, cpus.empty() ? std::vector<int>{} : std::vector<int>(cpus.begin() + 1, cpus.end()));
  g_ranks = &rank_threads;
  const StepConfig c = config();
  std::vector<std::string> cases, bus;
  std::printf("dsacp CP scaling: %d GPUs, %s, H=%d K=%d, %d timed reps, block table %s, %s\n", n,
              nccl_version().c_str(), c.H, c.K, reps, g_device_table ? "kept on the device" : "uploaded every step",
              pinned.c_str());
  auto add = [&](const std::string& name, int64_t S, const char* layout, const Measure& one, const Measure& cp) {
    print_case(name.c_str(), one, cp);
    cases.push_back("{\"case\":\"" + name + "\",\"tokens\":" + std::to_string(S) + ",\"layout\":\"" + layout +
                    "\",\"gpus\":" + std::to_string(n) + ",\"one_gpu\":" + measure_json(one) +
                    ",\"cp\":" + measure_json(cp) + ",\"speedup\":" + std::to_string(one.step_ms / cp.step_ms) + "}");
  };
  if (only.empty() || only == "busbw") bus = busbw(gpus, n, quick);
  if (only.empty() || only == "pcp") {
    for (int64_t S : {int64_t{32768}, int64_t{131072}}) {
      if ((quick && S > 32768) || (only_S != 0 && S != only_S)) continue;
      const std::vector<Request> req{{static_cast<int32_t>(S), 0}};
      const Measure one = one_gpu(*gpus[0], c, req, reps, false);
      const Measure cp = cp_gpus(gpus, c, req, layout_of(n, 1, IndexerMode::kSharded), reps, false);
      add("pcp prefill " + std::to_string(S / 1024) + "K", S, ("P" + std::to_string(n)).c_str(), one, cp);
    }
  }
  if (only.empty() || only == "dcp") {
    for (int64_t S : {int64_t{32768}, int64_t{131072}}) {
      if ((quick && S > 32768) || (only_S != 0 && S != only_S)) continue;
      const std::vector<Request> req(static_cast<size_t>(batch), Request{1, static_cast<int32_t>(S - 1)});
      const std::string b = "b" + std::to_string(batch);
      const Measure one = one_gpu(*gpus[0], c, req, reps, true);
      if (one_gpu_only) {
        std::printf("dcp decode %s %lldK, one GPU only: %.3f ms\n", b.c_str(), static_cast<long long>(S / 1024),
                    one.step_ms);
        continue;
      }
      for (IndexerMode mode : {IndexerMode::kSharded, IndexerMode::kReplicated}) {
        if (!only_mode.empty() && only_mode != (mode == IndexerMode::kSharded ? "sharded" : "replicated")) continue;
        const Measure cp = cp_gpus(gpus, c, req, layout_of(1, n, mode), reps, true);
        const std::string m = mode == IndexerMode::kSharded ? "sharded" : "replicated";
        add("dcp decode " + b + " " + std::to_string(S / 1024) + "K " + m + (g_fp8_kv ? " fp8 kv" : ""), S, ("D" + std::to_string(n) + " " + m).c_str(),
            one, cp);
      }
      // Hybrid layouts from 4 GPUs: 2 x n/2 and n/2 x 2 (sharded indexer).
      std::vector<int> hybrid_P;
      if (n >= 4 && n % 2 == 0) hybrid_P.push_back(2);
      if (n >= 8 && n % 2 == 0) hybrid_P.push_back(n / 2);
      for (int P : hybrid_P) {
        const Measure cp = cp_gpus(gpus, c, req, layout_of(P, n / P, IndexerMode::kSharded), reps, true);
        const std::string name = std::to_string(P) + "x" + std::to_string(n / P);
        add("hybrid decode " + b + " " + std::to_string(S / 1024) + "K " + name, S, name.c_str(), one, cp);
      }
    }
  }
  // A pass of decode layers captured into one CUDA graph and replayed: one GPU against D = n (sharded indexer).
  std::vector<std::string> graph_rows;
  if (only.empty() || only == "graph") {
    constexpr int kLayers = 8;
    for (int64_t S : {int64_t{32768}, int64_t{131072}}) {
      if ((quick && S > 32768) || (only_S != 0 && S != only_S)) continue;
      const std::vector<Request> req(static_cast<size_t>(batch), Request{1, static_cast<int32_t>(S - 1)});
      const double one = one_gpu_graph_layer_ms(*gpus[0], c, req, kLayers, reps);
      const double cp = cp_graph_layer_ms(gpus, c, req, layout_of(1, n, IndexerMode::kSharded), kLayers, reps);
      const std::string name = "graph decode b" + std::to_string(batch) + " " + std::to_string(S / 1024) + "K D" +
                               std::to_string(n) + " sharded";
      std::printf("%s: %d layers a graph, one GPU %.4f ms a layer, D%d %.4f ms a layer (%.3f of one GPU)\n",
                  name.c_str(), kLayers, one, n, cp, cp / one);
      char row[256];
      std::snprintf(row, sizeof row, "{\"case\":\"%s\",\"layers\":%d,\"one_gpu_layer_ms\":%.4f,\"cp_layer_ms\":%.4f,"
                    "\"cp_of_one_gpu\":%.4f}", name.c_str(), kLayers, one, cp, cp / one);
      graph_rows.push_back(row);
    }
  }
  if (!json.empty()) {
    FILE* f = std::fopen(json.c_str(), "w");
    if (f == nullptr) return 2;
    std::fprintf(f, "{\"gpus\":%d,\"nccl\":\"%s\",\"reps\":%d,\"device_block_table\":%s,\"cases\":[", n,
                 nccl_version().c_str(), reps, g_device_table ? "true" : "false");
    for (size_t i = 0; i < cases.size(); ++i) std::fprintf(f, "%s\n%s", i ? "," : "", cases[i].c_str());
    std::fprintf(f, "],\"busbw\":[");
    for (size_t i = 0; i < bus.size(); ++i) std::fprintf(f, "%s\n%s", i ? "," : "", bus[i].c_str());
    std::fprintf(f, "],\"graph_layers\":[");
    for (size_t i = 0; i < graph_rows.size(); ++i) std::fprintf(f, "%s\n%s", i ? "," : "", graph_rows[i].c_str());
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }
  return 0;
}
