// GPU context-parallel tests: the NCCL communicator (every collective against host math, split, a peer that
// never arrives -> kTimeout, a peer that aborts -> an error naming it, both bounded), and every CP layout on
// GPUs against one GPU on random batches (fresh seeds): ranks on 2 GPUs through NCCL, and wider layouts with
// every rank on GPU 0 (device copies between threads). Top-k rows must be identical to one GPU's, out and lse
// within tolerance; the single GPU is also compared with the CPU oracle.
// Self-contained (no GoogleTest). Exit 0 = all passed, 1 = a failure, 77 = no usable GPU.
// Usage: dsacp_gpu_cp_tests [--seed N] [--json FILE] [--small-heads] [--fp8-kv]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "dsacp/backend.h"
#include "dsacp/case_file.h"
#include "dsacp/nccl_communicator.h"
#include "dsacp/random.h"
#include "dsacp/replay.h"
#include "gpu/check_log.h"
#include "gpu/crash_trace.h"

using namespace dsacp;

namespace {

testing::CheckLog g_log;

void report(bool ok, const std::string& name, const std::string& detail = "") { g_log.report(ok, name, detail); }

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Runs f(rank) on `n` threads and joins them.
template <typename F>
void on_ranks(int n, F f) {
  std::vector<std::thread> t;
  for (int r = 0; r < n; ++r) t.emplace_back([&f, r] { f(r); });
  for (auto& x : t) x.join();
}

std::vector<uint8_t> random_bytes(uint64_t seed, size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(counter_hash(seed, 0xb17e, i));
  return v;
}

// ---- NCCL communicator ------------------------------------------------------------------------------------------

struct RankSetup {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<NcclCommunicator> comm;
  Status status;
};

// Two ranks (GPU 0 and 1) as threads, one NCCL communicator each.
// peer: the communicators' peer exchange on (32 MiB: 8 MiB slots) or off (every collective through NCCL).
std::vector<RankSetup> make_rank_pair(std::chrono::milliseconds timeout, std::shared_ptr<AbortSignal> signal,
                                      bool peer = true, size_t window_bytes = NcclOptions{}.window_bytes) {
  std::vector<RankSetup> ranks(2);
  auto id = nccl_make_id();
  if (!id.ok()) {
    ranks[0].status = ranks[1].status = id.status();
    return ranks;
  }
  on_ranks(2, [&](int r) {
    auto b = make_cuda_backend(r);
    if (!b.ok()) {
      ranks[r].status = b.status();
      return;
    }
    ranks[r].backend = std::move(b).value();
    NcclOptions o;
    o.device = r;
    o.timeout = timeout;
    o.abort_signal = signal;
    o.peer_exchange_bytes = peer ? size_t{32} << 20 : 0;
    o.window_bytes = window_bytes;
    auto c = NcclCommunicator::create(*id, 2, r, o);
    if (!c.ok()) {
      ranks[r].status = c.status();
      return;
    }
    ranks[r].comm = std::move(c).value();
  });
  return ranks;
}

// True when both ranks of a pair were made; else reports `what` as failed, with both ranks' statuses.
bool pair_made(const std::vector<RankSetup>& ranks, const std::string& what) {
  if (ranks[0].status.ok() && ranks[1].status.ok()) return true;
  report(false, what, ranks[0].status.to_string() + " / " + ranks[1].status.to_string());
  return false;
}

void test_nccl_collectives(uint64_t seed, bool peer) {
  auto ranks = make_rank_pair(std::chrono::seconds(60), nullptr, peer);
  const std::string via = peer ? " (peer exchange)" : " (NCCL only)";
  if (!pair_made(ranks, "nccl: create 2 ranks")) return;
  const int n = 2;
  const size_t bytes = 3 * 1000 * 1000 + 17;  // not a multiple of anything
  std::vector<std::string> errors(n);
  std::vector<std::vector<uint8_t>> sent(n), got_ag(n), got_a2a(n), got_bc(n), got_dim(n);
  for (int r = 0; r < n; ++r) sent[r] = random_bytes(seed + r, n * bytes);
  const int64_t outer = 3, local = 2, inner = 5;  // all_gather_dim of int32 [3, 2, 5] blocks
  on_ranks(n, [&](int r) {
    Backend& be = *ranks[r].backend;
    Communicator& c = *ranks[r].comm;
    auto check = [&](const Status& s, const char* what) {
      if (!s.ok() && errors[r].empty()) errors[r] = std::string(what) + ": " + s.to_string();
      return s.ok();
    };
    auto send = be.allocate(n * bytes);
    auto recv = be.allocate(n * bytes);
    if (!send.ok() || !recv.ok()) return (void)check(Status(StatusCode::kBackendError, "alloc"), "allocate");
    if (!check(be.copy_to_device(send->get(), sent[r].data(), n * bytes), "upload")) return;
    got_ag[r].resize(n * bytes);
    if (!check(c.all_gather(send->get(), recv->get(), bytes), "all_gather")) return;
    if (!check(be.copy_to_host(got_ag[r].data(), recv->get(), n * bytes), "download")) return;
    got_a2a[r].resize(n * bytes);
    if (!check(c.all_to_all(send->get(), recv->get(), bytes), "all_to_all")) return;
    if (!check(be.copy_to_host(got_a2a[r].data(), recv->get(), n * bytes), "download")) return;
    got_bc[r].resize(bytes);
    if (!check(c.broadcast(send->get(), bytes, 1), "broadcast")) return;
    if (!check(be.copy_to_host(got_bc[r].data(), send->get(), bytes), "download")) return;
    if (!check(c.barrier(), "barrier")) return;
    const size_t dim_bytes = outer * local * inner * 4;
    auto scratch = be.allocate(n * dim_bytes);
    if (!scratch.ok()) return;
    if (!check(be.copy_to_device(send->get(), sent[r].data(), dim_bytes), "upload")) return;
    if (!check(c.all_gather_dim(send->get(), recv->get(), scratch->get(), outer, local, inner, 4), "all_gather_dim")) {
      return;
    }
    got_dim[r].resize(n * dim_bytes);
    check(be.copy_to_host(got_dim[r].data(), recv->get(), n * dim_bytes), "download");
  });
  for (int r = 0; r < n; ++r) {
    if (!errors[r].empty()) {
      report(false, "nccl: collectives rank " + std::to_string(r), errors[r]);
      return;
    }
  }
  bool ag = true, a2a = true, bc = true, dim = true;
  for (int r = 0; r < n; ++r) {
    for (int k = 0; k < n; ++k) {
      ag &= std::memcmp(got_ag[r].data() + k * bytes, sent[k].data(), bytes) == 0;
      a2a &= std::memcmp(got_a2a[r].data() + k * bytes, sent[k].data() + r * bytes, bytes) == 0;
    }
    bc &= std::memcmp(got_bc[r].data(), sent[1].data(), bytes) == 0;
    const size_t row = local * inner * 4;
    for (int64_t o = 0; o < outer; ++o) {
      for (int k = 0; k < n; ++k) {
        dim &= std::memcmp(got_dim[r].data() + (o * n + k) * row, sent[k].data() + o * row, row) == 0;
      }
    }
  }
  report(ag, "nccl: all_gather 2 x 3 MB matches host" + via);
  report(a2a, "nccl: all_to_all matches host" + via);
  report(bc, "nccl: broadcast from rank 1" + via);
  report(dim, "nccl: all_gather_dim [3, 2x2, 5] int32" + via);
  const CommStats st = ranks[0].comm->stats();
  // all_gather, all_to_all and all_gather_dim's all_gather move 3 MB or less: the peer exchange when it is on.
  report(st.collectives >= 5 && st.busy_ms > 0 && st.peer_collectives == (peer ? 3 : 0),
         "nccl: stats count collectives, device time and peer exchanges" + via,
         std::to_string(st.collectives) + " collectives (" + std::to_string(st.peer_collectives) +
             " peer exchanges), busy " + std::to_string(st.busy_ms) + " ms, wait " + std::to_string(st.wait_ms) + " ms");

  // split into singletons: a collective on a 1-rank communicator is a copy.
  std::vector<std::string> split_err(n);
  on_ranks(n, [&](int r) {
    auto child = ranks[r].comm->split(r, 0);
    if (!child.ok()) {
      split_err[r] = child.status().to_string();
      return;
    }
    if ((*child)->size() != 1 || (*child)->rank() != 0) split_err[r] = "wrong size/rank";
    Backend& be = *ranks[r].backend;
    auto a = be.allocate(64), b = be.allocate(64);
    std::vector<uint8_t> x = random_bytes(seed * 7 + r, 64), y(64);
    if (!be.copy_to_device(a->get(), x.data(), 64).ok()) split_err[r] = "upload";
    Status s = (*child)->all_gather(a->get(), b->get(), 64);
    if (!s.ok()) split_err[r] = s.to_string();
    if (!be.copy_to_host(y.data(), b->get(), 64).ok() || x != y) split_err[r] = "data";
  });
  report(split_err[0].empty() && split_err[1].empty(), "nccl: split into 1-rank communicators" + via,
         split_err[0] + split_err[1]);
  on_ranks(2, [&](int r) { ranks[r].comm.reset(); });  // released by each rank's own thread
}

// A window exchange on rank r's communicator: window_next(bytes), publish, wait (the message is not written:
// the timeout and abort tests only need the exchange's synchronization).
Status window_round(RankSetup& rank, size_t bytes) {
  rank.comm->set_producer_stream(rank.backend->native_stream());
  auto w = rank.comm->window_next(bytes);
  if (!w.ok()) return w.status();
  auto h = rank.comm->window_publish();
  if (!h.ok()) return h.status();
  return (*h)->wait();
}

// window: the exchange that waits is a window publish instead of an all-gather.
void test_nccl_timeout(bool peer, bool window = false) {
  auto ranks = make_rank_pair(std::chrono::milliseconds(2000), nullptr, peer);
  const std::string via = window ? " (window publish)" : peer ? " (peer exchange)" : " (NCCL only)";
  if (!pair_made(ranks, "nccl timeout: create")) return;
  Status got;
  double waited = 0;
  on_ranks(2, [&](int r) {
    if (r == 1) return;  // never posts the collective
    Backend& be = *ranks[0].backend;
    auto a = be.allocate(1 << 20), b = be.allocate(2 << 20);
    const auto t0 = Clock::now();
    got = window ? window_round(ranks[0], 1 << 20) : ranks[0].comm->all_gather(a->get(), b->get(), 1 << 20);
    waited = seconds_since(t0);
  });
  report(got.code() == StatusCode::kTimeout && waited >= 1.9 && waited < 15,
         "nccl: a peer that never arrives -> kTimeout, bounded" + via,
         got.to_string() + ", after " + std::to_string(waited) + " s");
  Status later = ranks[0].comm->barrier();
  report(!later.ok(), "nccl: the timed-out communicator fails later calls at once" + via, later.to_string());
  ranks[1].comm->abort("test: the peer is gone");  // as its process's exit would: both sides aborted
  const auto t0 = Clock::now();
  on_ranks(2, [&](int r) { ranks[r].comm.reset(); });
  report(seconds_since(t0) < 20, "nccl: communicators of a failed group are released, bounded" + via,
         std::to_string(seconds_since(t0)) + " s");
}

void test_nccl_abort(bool peer, bool window = false) {
  auto signal = std::make_shared<AbortSignal>();
  auto ranks = make_rank_pair(std::chrono::seconds(120), signal, peer);
  const std::string via = window ? " (window publish)" : peer ? " (peer exchange)" : " (NCCL only)";
  if (!pair_made(ranks, "nccl abort: create")) return;
  Status got;
  double waited = 0;
  on_ranks(2, [&](int r) {
    if (r == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      ranks[1].comm->abort("injected failure");
      return;
    }
    Backend& be = *ranks[0].backend;
    auto a = be.allocate(1 << 20), b = be.allocate(2 << 20);
    const auto t0 = Clock::now();
    got = window ? window_round(ranks[0], 1 << 20) : ranks[0].comm->all_gather(a->get(), b->get(), 1 << 20);
    waited = seconds_since(t0);
  });
  report(!got.ok() && got.message().find("rank 1 failed: injected failure") != std::string::npos && waited < 10,
         "nccl: a peer's abort fails the waiting rank at once, naming it" + via,
         got.to_string() + ", after " + std::to_string(waited) + " s");
  on_ranks(2, [&](int r) { ranks[r].comm.reset(); });
}

// A row-synchronized window exchange (Communicator::window_rows) whose peer never raises its rows: rank 0's
// consumer (a candidate merge waiting on the rows' flags) gives up after the 2 s timeout, the exchange's handle
// (or, via_check, window_rows_check after the consumer finished: the CP step's end) reports it naming the late
// rank, and the communicator fails later calls at once.
void test_window_rows_timeout(bool via_check) {
  auto ranks = make_rank_pair(std::chrono::milliseconds(2000), nullptr, false);
  if (!pair_made(ranks, "window rows timeout: create")) return;
  Status got;
  double waited = 0;
  on_ranks(2, [&](int r) {
    if (r == 1) return;  // never takes part
    Backend& be = *ranks[0].backend;
    Communicator& c = *ranks[0].comm;
    c.set_producer_stream(be.native_stream());
    const int32_t K = 4;
    auto out = be.allocate(K * sizeof(int32_t));
    auto w = c.window_next(2 * K * sizeof(int32_t));
    if (!out.ok() || !w.ok()) {
      got = !w.ok() ? w.status() : out.status();
      return;
    }
    auto sync = c.window_rows(1);
    if (!sync.ok()) {
      got = sync.status();
      return;
    }
    TopkMergeParams mp;
    mp.num_parts = 2;
    mp.num_rows = 1;
    mp.K = K;
    for (int k = 0; k < 2; ++k) {
      mp.part_topk_of[k] = static_cast<const int32_t*>(w->all[k]);
      mp.part_scores_of[k] = reinterpret_cast<const float*>(static_cast<const char*>(w->all[k]) + K * sizeof(int32_t));
    }
    mp.topk = out->as<int32_t>();
    mp.wait = *sync;
    const auto t0 = Clock::now();
    got = be.topk_merge(mp);  // (checked: returns once the merge kernel ended)
    if (got.ok() && via_check) {
      got = c.window_rows_check();
    } else if (got.ok()) {
      auto h = c.window_rows_done();
      got = h.ok() ? (*h)->wait() : h.status();
    }
    waited = seconds_since(t0);
  });
  const std::string via = via_check ? " (window_rows_check)" : " (window_rows_done)";
  report(got.code() == StatusCode::kTimeout && got.message().find("rank 1 did not deliver") != std::string::npos &&
             waited >= 1.9 && waited < 15,
         "window rows: a peer that never raises its rows -> kTimeout naming it, bounded" + via,
         got.to_string() + ", after " + std::to_string(waited) + " s");
  Status later = ranks[0].comm->barrier();
  report(!later.ok(), "window rows: the timed-out communicator fails later calls at once" + via, later.to_string());
  ranks[1].comm->abort("test: the peer is gone");
  on_ranks(2, [&](int r) { ranks[r].comm.reset(); });
}

// Window exchanges (Communicator::window_next / window_publish): 2 ranks, 6 exchanges of different sizes back to
// back (both buffers, each reused), each rank writing its message into its own buffer on its backend stream and,
// after the publish, reading every rank's message in place with a kernel (gather_rows, as the step's merges read
// them; a cudaMemcpy from a peer's memory is a peer copy with its own ordering rules, which the window does not
// promise), then checking the copies on the host; a message past the window -> kUnsupported, and
// NcclOptions::window_bytes 0 -> no window (kUnsupported).
void test_window(uint64_t seed) {
  auto ranks = make_rank_pair(std::chrono::seconds(20), nullptr, false);
  if (!pair_made(ranks, "window: create 2 ranks")) return;
  const int n = 2, rounds = 6, dim = 1024;  // a message: rows of 1024 floats (finite: copied bit for bit)
  auto round_rows = [](int i) -> int64_t { return 200 + 37 * i + (i % 2) * 300; };
  std::vector<std::string> errors(n);
  std::vector<std::vector<std::vector<float>>> sent(n), got(n);  // got[r][i]: rank 0's then rank 1's message
  for (int r = 0; r < n; ++r) {
    for (int i = 0; i < rounds; ++i) {
      std::vector<float> m(static_cast<size_t>(round_rows(i) * dim));
      for (size_t e = 0; e < m.size(); ++e) m[e] = static_cast<float>(counter_hash(seed * 7 + r, i, e) % 100003) - 5e4f;
      sent[r].push_back(std::move(m));
    }
    got[r].resize(rounds);
  }
  std::vector<int64_t> publishes(n);
  on_ranks(n, [&](int r) {
    Backend& be = *ranks[r].backend;
    Communicator& c = *ranks[r].comm;
    c.set_producer_stream(be.native_stream());
    std::vector<int64_t> index(static_cast<size_t>(round_rows(rounds - 1) + 300));
    for (size_t e = 0; e < index.size(); ++e) index[e] = static_cast<int64_t>(e);
    auto d_index = be.allocate(index.size() * sizeof(int64_t));
    auto local = be.allocate(index.size() * dim * sizeof(float) * n);
    if (!d_index.ok() || !local.ok() || !be.copy_to_device(d_index->get(), index.data(), index.size() * 8).ok()) {
      errors[r] = "allocate";
      return;
    }
    for (int i = 0; i < rounds && errors[r].empty(); ++i) {
      const int64_t rows = round_rows(i);
      const size_t b = static_cast<size_t>(rows * dim) * sizeof(float);
      auto w = c.window_next(b);
      if (!w.ok() || w->all.size() != 2 || w->all[r] != w->mine) {
        errors[r] = "window_next " + std::to_string(i) + ": " + (w.ok() ? "bad buffers" : w.status().to_string());
        break;
      }
      Status st = be.copy_to_device(w->mine, sent[r][i].data(), b);
      auto h = c.window_publish();
      if (!st.ok() || !h.ok()) {
        errors[r] = "round " + std::to_string(i) + ": " + (st.ok() ? h.status().to_string() : st.to_string());
        break;
      }
      (*h)->order_before(be.native_stream());
      for (int k = 0; k < n && st.ok(); ++k) {
        GatherRowsParams g;
        g.src = w->all[k];
        g.src_dtype = g.dst_dtype = DType::kF32;
        g.src_rows = rows;
        g.dim = dim;
        g.index = d_index->as<const int64_t>();
        g.num_rows = rows;
        g.dst = local->as<float>() + k * rows * dim;
        st = gather_rows_run(be, g);
      }
      got[r][i].resize(static_cast<size_t>(n * rows * dim));
      if (st.ok()) st = be.copy_to_host(got[r][i].data(), local->get(), n * b);
      if (!st.ok()) errors[r] = "read round " + std::to_string(i) + ": " + st.to_string();
      st = (*h)->wait();
      if (!st.ok() && errors[r].empty()) errors[r] = "wait " + std::to_string(i) + ": " + st.to_string();
    }
    publishes[r] = c.stats().window_publishes;
  });
  int bad = 0;
  std::string where;
  for (int r = 0; r < n; ++r) {
    for (int i = 0; i < rounds && errors[0].empty() && errors[1].empty(); ++i) {
      const size_t m = sent[0][i].size();
      for (int k = 0; k < n; ++k) {
        const float* g = got[r][i].data() + k * m;
        if (std::memcmp(g, sent[k][i].data(), m * sizeof(float)) == 0) continue;
        if (++bad > 3) continue;
        size_t at = 0;
        while (g[at] == sent[k][i][at]) ++at;
        where += " [rank " + std::to_string(r) + " round " + std::to_string(i) + " reading rank " + std::to_string(k) +
                 ": first difference at float " + std::to_string(at) + " of " + std::to_string(m) + "]";
      }
    }
  }
  report(errors[0].empty() && errors[1].empty() && bad == 0 && publishes[0] == rounds && publishes[1] == rounds,
         "window: 6 exchanges, every rank's message read in place by a kernel",
         errors[0] + errors[1] + std::to_string(bad) + " messages differ" + where + ", " + std::to_string(publishes[0]) +
             " publishes");
  auto too_big = ranks[0].comm->window_next(size_t{1} << 40);
  report(!too_big.ok() && too_big.status().code() == StatusCode::kUnsupported &&
             too_big.status().message().find("the window holds") != std::string::npos,
         "window: a message past the window -> kUnsupported", too_big.ok() ? "accepted" : too_big.status().to_string());
  on_ranks(2, [&](int r) { ranks[r].comm.reset(); });
  auto off = make_rank_pair(std::chrono::seconds(60), nullptr, false, 0);
  if (!pair_made(off, "window off: create 2 ranks")) return;
  auto none = off[0].comm->window_next(1024);
  report(!none.ok() && none.status().code() == StatusCode::kUnsupported, "window: window_bytes 0 -> no window",
         none.ok() ? "a window" : none.status().to_string());
  on_ranks(2, [&](int r) { off[r].comm.reset(); });
}

// Grouped all-gathers and all-to-alls of odd sizes (0.3 to 12 MB) launched back to back without waiting, then
// every result against the host, and the stats counting each op once.
// lanes: each op's producer stream alternates between the backend's main and side lane (the peer exchange runs
// on the producer's stream, so consecutive exchanges run on different streams and must still follow each other).
void test_back_to_back(uint64_t seed, bool peer, bool lanes = false) {
  auto ranks = make_rank_pair(std::chrono::seconds(60), nullptr, peer);
  const std::string via = std::string(peer ? " (peer exchange and NCCL mixed)" : " (NCCL only)") +
                          (lanes ? ", producer stream alternating between two lanes" : "");
  if (!pair_made(ranks, "nccl back to back: create 2 ranks")) return;
  const int n = 2, ops = 9;
  auto op_bytes = [](int i) -> size_t { return i == 4 ? (size_t{12} << 20) + 5 : 300 * 1000 * (i + 1) + 7 * i; };
  std::vector<std::string> errors(n);
  // sent[r][i]: rank r's two parts of op i, each n * bytes; got[r][i]: its two receive buffers.
  std::vector<std::vector<std::vector<uint8_t>>> sent(n), got(n);
  for (int r = 0; r < n; ++r) {
    for (int i = 0; i < ops; ++i) sent[r].push_back(random_bytes(seed * 131 + r * 17 + i, 2 * n * op_bytes(i)));
    got[r].resize(ops);
  }
  on_ranks(n, [&](int r) {
    Backend& be = *ranks[r].backend;
    Communicator& c = *ranks[r].comm;
    std::vector<DeviceBuffer> bufs;
    std::vector<std::unique_ptr<CollectiveHandle>> handles;
    LaneSession lane_session(be);
    if (lanes) {
      const Status s = lane_session.begin();
      if (!s.ok()) errors[r] = "begin_lanes: " + s.to_string();
    }
    for (int i = 0; i < ops && errors[r].empty(); ++i) {
      const size_t b = op_bytes(i);
      if (lanes) {
        lane_session.set_lane(i % 2);
        c.set_producer_stream(be.native_stream());
      }
      auto send = be.allocate(2 * n * b), recv = be.allocate(2 * n * b);
      if (!send.ok() || !recv.ok()) {
        errors[r] = "allocate";
        break;
      }
      Status s = be.copy_to_device(send->get(), sent[r][i].data(), 2 * n * b);
      char* sp = static_cast<char*>(send->get());
      char* rp = static_cast<char*>(recv->get());
      const std::vector<Communicator::Part> parts = {{sp, rp, b}, {sp + n * b, rp + n * b, b}};
      auto h = i % 2 == 0 ? c.all_gather_group_async(parts) : c.all_to_all_group_async(parts);
      if (!s.ok() || !h.ok()) {
        errors[r] = "op " + std::to_string(i) + ": " + (s.ok() ? h.status().to_string() : s.to_string());
        break;
      }
      handles.push_back(std::move(h).value());
      bufs.push_back(std::move(send).value());
      bufs.push_back(std::move(recv).value());
    }
    if (lanes) {
      lane_session.set_lane(0);
      c.set_producer_stream(be.native_stream());
    }
    for (size_t i = 0; i < handles.size(); ++i) {
      Status s = handles[i]->wait();
      if (!s.ok() && errors[r].empty()) errors[r] = "wait " + std::to_string(i) + ": " + s.to_string();
      got[r][i].resize(2 * n * op_bytes(static_cast<int>(i)));
      if (s.ok()) s = be.copy_to_host(got[r][i].data(), bufs[2 * i + 1].get(), got[r][i].size());
      if (!s.ok() && errors[r].empty()) errors[r] = "download " + std::to_string(i) + ": " + s.to_string();
    }
    const Status s = lane_session.end();
    if (!s.ok() && errors[r].empty()) errors[r] = "end_lanes: " + s.to_string();
  });
  for (int r = 0; r < n; ++r) {
    if (!errors[r].empty()) return report(false, "nccl back to back: rank " + std::to_string(r), errors[r]);
  }
  int wrong = 0;
  for (int r = 0; r < n; ++r) {
    for (int i = 0; i < ops; ++i) {
      const size_t b = op_bytes(i);
      for (int part = 0; part < 2; ++part) {
        for (int k = 0; k < n; ++k) {
          // all-gather: block k is rank k's part; all-to-all: block k is rank k's block r of the part.
          const uint8_t* want = sent[k][i].data() + part * n * b + (i % 2 == 0 ? 0 : r * b);
          wrong += std::memcmp(got[r][i].data() + part * n * b + k * b, want, b) != 0;
        }
      }
    }
  }
  report(wrong == 0, "nccl: 9 grouped ops back to back match host" + via, std::to_string(wrong) + " blocks wrong");
  const CommStats st = ranks[0].comm->stats();
  // Op 4 (2 x 12 MB) is past the peer exchange's 8 MiB slot: NCCL; the other eight fit.
  report(st.collectives == ops && st.busy_ms > 0 && st.peer_collectives == (peer ? ops - 1 : 0),
         "nccl: stats count every op once" + via,
         std::to_string(st.collectives) + " collectives, " + std::to_string(st.peer_collectives) + " peer exchanges");
  on_ranks(2, [&](int r) { ranks[r].comm.reset(); });
}

// ---- CP layouts on GPUs -------------------------------------------------------------------------------------------

struct Compare {
  bool topk_same = false;
  double out_rel = 0, lse_abs = 0;
  int64_t rows_differ = 0;
};

Compare compare(const StepResult& got, const StepResult& want) {
  Compare c;
  const int64_t T = want.topk_indices.dim(0), K = want.topk_indices.dim(1);
  c.topk_same = got.topk_indices.nbytes() == want.topk_indices.nbytes();
  if (c.topk_same) {
    for (int64_t t = 0; t < T; ++t) {
      if (std::memcmp(got.topk_indices.data_as<int32_t>() + t * K, want.topk_indices.data_as<int32_t>() + t * K,
                      K * sizeof(int32_t)) != 0) {
        ++c.rows_differ;
      }
    }
    c.topk_same = c.rows_differ == 0;
  }
  double e2 = 0, r2 = 0;
  for (int64_t i = 0; i < want.out.numel(); ++i) {
    const double a = got.out.get_f32(i), b = want.out.get_f32(i);
    e2 += (a - b) * (a - b);
    r2 += b * b;
  }
  c.out_rel = r2 > 0 ? std::sqrt(e2 / r2) : std::sqrt(e2);
  for (int64_t i = 0; i < want.lse.numel(); ++i) {
    const double a = got.lse.get_f32(i), b = want.lse.get_f32(i);
    if (std::isinf(a) && std::isinf(b) && (a > 0) == (b > 0)) continue;
    c.lse_abs = std::max(c.lse_abs, std::fabs(a - b));
  }
  return c;
}

std::string describe(const Compare& c) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "top-k %s (%lld rows differ), out rel err %.2e, lse max err %.2e",
                c.topk_same ? "identical" : "DIFFER", static_cast<long long>(c.rows_differ), c.out_rel, c.lse_abs);
  return buf;
}

struct Layout {
  const char* name;
  CpLayout layout;
  bool one_gpu;  // every rank on GPU 0
};

// NCCL without its exchange window: every exchange through the collectives.
CpLayout without_window(CpLayout l) {
  l.nccl_window_bytes = 0;
  return l;
}

CpLayout with_choices(CpLayout l, CpLayout::WindowRows rows, bool fused_topk_merge) {
  l.window_rows = rows;
  l.fused_topk_merge = fused_topk_merge;
  return l;
}

CpLayout make_layout(int P, int D, IndexerMode indexer = IndexerMode::kSharded, int interleave = 0,
                     bool dsa_cp = false, DecodeMode decode = DecodeMode::kLocalMerge) {
  CpLayout l;
  l.P = P;
  l.D = D;
  l.indexer = indexer;
  l.interleave = interleave;
  l.dsa_cp = dsa_cp;
  l.decode_mode = decode;
  l.comm_timeout_ms = 15000;  // a deadlock becomes an error naming the stuck collective, within the run
  return l;
}

CaseFile make_case(uint64_t seed, int32_t H, bool decode_only) {
  CaseGenSpec spec;
  spec.dims = CaseDims{H, 512, 64, 64, 128};
  spec.topk = 512;
  spec.scale = 0.0723f;
  spec.dtype = DType::kBF16;
  spec.seed = seed;
  const int nd = 3 + static_cast<int>(counter_hash(seed, 1, 0) % 3);
  for (int i = 0; i < nd; ++i) {
    spec.requests.push_back({1 + static_cast<int32_t>(counter_hash(seed, 2, i) % 3),
                             200 + static_cast<int32_t>(counter_hash(seed, 3, i) % 6000)});
  }
  if (!decode_only) {
    spec.requests.push_back({257, 0});
    spec.requests.push_back({61, 1500 + static_cast<int32_t>(counter_hash(seed, 4, 0) % 1000)});
    spec.requests.push_back({7, 0});
  }
  auto c = case_generate(spec);
  if (!c.ok()) {
    std::printf("case_generate: %s\n", c.status().to_string().c_str());
    std::exit(1);
  }
  return std::move(c).value();
}

void test_layouts(uint64_t seed, int num_gpus) {
  auto cpu = make_cpu_backend(0);
  std::vector<std::unique_ptr<Backend>> gpus;
  for (int g = 0; g < std::min(num_gpus, 8); ++g) gpus.push_back(std::move(make_cuda_backend(g)).value());

  const Layout wide[] = {
      {"P2 (NCCL)", make_layout(2, 1), false},
      {"D2 sharded (NCCL)", make_layout(2 / 2, 2), false},
      {"D2 replicated (NCCL)", make_layout(1, 2, IndexerMode::kReplicated), false},
      {"P2 interleave 1 (NCCL)", make_layout(2, 1, IndexerMode::kSharded, 1), false},
      {"P2 gathered decodes (NCCL)", make_layout(2, 1, IndexerMode::kSharded, 0, false, DecodeMode::kGathered), false},
      {"D2 DSA-CP (NCCL)", make_layout(1, 2, IndexerMode::kSharded, 0, true), false},
      {"D2 sharded (NCCL, no window)", without_window(make_layout(1, 2)), false},
      {"D2 sharded (NCCL, window publishes)", with_choices(make_layout(1, 2), CpLayout::WindowRows::kNone, true), false},
      {"D2 sharded (NCCL, window rows: candidates only)",
       with_choices(make_layout(1, 2), CpLayout::WindowRows::kTopkOnly, true), false},
      {"D2 sharded (NCCL, window rows, merge kernel)", with_choices(make_layout(1, 2), CpLayout::WindowRows::kBoth, false),
       false},
      {"D2 replicated (NCCL, no window)", without_window(make_layout(1, 2, IndexerMode::kReplicated)), false},
      {"D2 DSA-CP (NCCL, no window)", without_window(make_layout(1, 2, IndexerMode::kSharded, 0, true)), false},
      {"P2xD2 on one GPU", make_layout(2, 2), true},
      {"P4 on one GPU", make_layout(4, 1), true},
      {"D4 replicated on one GPU", make_layout(1, 4, IndexerMode::kReplicated), true},
      {"D4 DSA-CP on one GPU", make_layout(1, 4, IndexerMode::kSharded, 3, true), true},
      {"P2xD4 on one GPU", make_layout(2, 4), true},
  };
  for (int variant = 0; variant < 2; ++variant) {
    const bool decode_only = variant == 1;
    const int32_t H = decode_only ? 128 : 64;
    const uint64_t s = seed * 31 + variant;
    const CaseFile c = make_case(s, H, decode_only);
    const std::string tag = std::string(decode_only ? "decode-only" : "mixed") + " H=" + std::to_string(H) +
                            " seed " + std::to_string(s) + ": ";
    ReplayOptions one;
    one.page_size = 64;
    one.out_dtype = DType::kF32;
    auto want = replay_case(*gpus[0], c, one);
    if (!want.ok()) {
      report(false, tag + "one GPU", want.status().to_string());
      continue;
    }
    auto oracle = replay_case(*cpu, c, one);
    if (oracle.ok()) {
      const Compare cc = compare(*want, *oracle);
      report(cc.topk_same && cc.out_rel < 1e-2, tag + "one GPU vs CPU oracle", describe(cc));
    } else {
      report(false, tag + "CPU oracle", oracle.status().to_string());
    }
    for (const Layout& l : wide) {
      if (decode_only != l.layout.dsa_cp && l.layout.dsa_cp) continue;  // DSA-CP: the decode-only batch
      if (l.layout.dsa_cp && !decode_only) continue;
      if (!l.one_gpu && num_gpus < l.layout.num_ranks()) continue;
      ReplayOptions o = one;
      o.layout = l.layout;
      std::vector<Backend*> ranks;
      for (int32_t cr = 0; cr < l.layout.num_ranks(); ++cr) ranks.push_back(gpus[l.one_gpu ? 0 : cr].get());
      const auto t0 = Clock::now();
      auto got = replay_case(ranks, c, o);
      if (!got.ok()) {
        report(false, tag + l.name, got.status().to_string());
        continue;
      }
      const Compare cc = compare(*got, *want);
      report(cc.topk_same && cc.out_rel < 5e-3 && cc.lse_abs < 2e-2, tag + l.name + " vs one GPU",
             describe(cc) + " (" + std::to_string(seconds_since(t0)) + " s)");
    }
  }
  // A bf16 output: the local decodes' partials travel in bf16 (the direct head-block path at H=128 over D=2), with
  // the default decode kernel (ws32) and with the prefill kernel (ws) forced, whose merge has its own staging rule.
  using MlaKernel = CudaBackendOptions::MlaKernel;
  for (const auto& [kernel, tag] : {std::pair<MlaKernel, const char*>{MlaKernel::kAuto, ""}, {MlaKernel::kWgmmaWs, "ws"}}) {
    const CaseFile c = make_case(seed * 31 + 2, 128, true);
    ReplayOptions one;
    one.page_size = 64;
    one.out_dtype = DType::kBF16;
    auto want = replay_case(*gpus[0], c, one);
    ReplayOptions o = one;
    o.layout = make_layout(1, 2);
    const bool two = num_gpus >= 2;
    CudaBackendOptions bo;
    bo.mla_kernel = kernel;
    std::vector<std::unique_ptr<Backend>> forced;
    for (int g = 0; g < (two ? 2 : 1); ++g) {
      auto b = make_cuda_backend(g, bo);
      if (b.ok()) forced.push_back(std::move(b).value());
    }
    if (forced.size() != (two ? 2u : 1u)) {
      report(false, std::string("decode-only H=128 bf16 out: backends with MLA kernel ") + tag, "make_cuda_backend failed");
      continue;
    }
    auto got = replay_case(std::vector<Backend*>{forced[0].get(), forced[two ? 1 : 0].get()}, c, o);
    const std::string name = std::string("decode-only H=128 bf16 out (bf16 partials") +
                             (tag[0] != 0 ? ", MLA kernel " + std::string(tag) : std::string()) + "): D2 sharded" +
                             (two ? " (NCCL)" : " on one GPU");
    if (!want.ok() || !got.ok()) {
      report(false, name, (want.ok() ? got : want).status().to_string());
    } else {
      const Compare cc = compare(*got, *want);
      report(cc.topk_same && cc.out_rel < 1e-2 && cc.lse_abs < 2e-2, name + " vs one GPU", describe(cc));
    }
  }
  // Decode batches past one wave of the GPU, at H=128 with bf16 out (bf16 partials):
  //   100 rows: the merged attention's grid (200 CTAs of one an SM) cannot all be resident at once; its partials
  //     fit the 16 MiB window, so both exchanges are row-synced;
  //   160 rows: the top-k's grid (one CTA of a row an SM, merging its row once the peer's came) cannot all be
  //     resident; the partials leave the window (the candidates alone go row by row). Every third row's indexer
  //     weights are 0, so all its scores tie at 0 on both GPUs and the merge must keep the lowest global positions.
  // The kernels that wait for the peer's rows then run beside CTAs not yet started on either GPU: the rows must
  // still arrive (token-major grids: a CTA signals its row before it waits, and never waits for a row whose
  // producer comes after it in its own grid).
  for (const int rows : {100, 160}) {
    if (num_gpus < 2) break;
    CaseGenSpec spec;
    spec.dims = CaseDims{128, 512, 64, 64, 128};
    spec.topk = 512;
    spec.scale = 0.0723f;
    spec.dtype = DType::kBF16;
    spec.seed = seed * 31 + 3 + static_cast<uint64_t>(rows);
    for (int i = 0; i < rows; ++i) {
      spec.requests.push_back({1, 600 + static_cast<int32_t>(counter_hash(spec.seed, 5, i) % 5000)});
    }
    auto c = case_generate(spec);
    if (c.ok() && rows == 160) {
      const int64_t Hi = c->idx_w.shape()[1];
      for (int64_t t = 0; t < rows; t += 3) {
        for (int64_t h = 0; h < Hi; ++h) c->idx_w.set_f32(t * Hi + h, 0.f);
      }
    }
    ReplayOptions one;
    one.page_size = 64;
    one.out_dtype = DType::kBF16;
    auto want = c.ok() ? replay_case(*gpus[0], *c, one) : Result<StepResult>(c.status());
    ReplayOptions o = one;
    o.layout = make_layout(1, 2);
    const auto t0 = Clock::now();
    const std::string name = "decode-only H=128, " + std::to_string(rows) + " rows (grids past one wave" +
                             (rows == 160 ? ", every third row's scores all tied" : "") +
                             "): D2 sharded (NCCL, window rows)";
    if (!want.ok()) {
      report(false, name, want.status().to_string());
    } else if (auto got = replay_case(std::vector<Backend*>{gpus[0].get(), gpus[1].get()}, *c, o); !got.ok()) {
      report(false, name, got.status().to_string());
    } else {
      const Compare cc = compare(*got, *want);
      report(cc.topk_same && cc.out_rel < 1e-2 && cc.lse_abs < 2e-2, name + " vs one GPU",
             describe(cc) + " (" + std::to_string(seconds_since(t0)) + " s)");
    }
  }
  // Two different backends on one GPU cannot be NCCL ranks: refused with the reason, not hung.
  {
    CaseFile c = make_case(seed + 5, 64, false);
    ReplayOptions o;
    o.layout = make_layout(2, 1);
    auto second = make_cuda_backend(0);
    auto got = replay_case(std::vector<Backend*>{gpus[0].get(), second->get()}, c, o);
    report(!got.ok() && got.status().message().find("both on CUDA device 0") != std::string::npos,
           "two backends on one GPU are refused", got.ok() ? "ran" : got.status().to_string());
  }
}

// Layouts whose ranks hold fewer than 16 heads (H / D < 16: what tensor parallelism leaves a GPU, split again by
// DCP): attention runs them in a 16-head group with the missing rows masked, and the DCP step's partials merged
// inside attention (64 heads a rank only) fall back to the step's other path. Each layout is checked against one
// GPU, and one GPU against the CPU oracle; ranks share GPU 0 unless there are GPUs enough for NCCL.
void test_small_head_layouts(uint64_t seed, int num_gpus) {
  auto cpu = make_cpu_backend(0);
  std::vector<std::unique_ptr<Backend>> gpus;
  for (int g = 0; g < std::min(num_gpus, 8); ++g) gpus.push_back(std::move(make_cuda_backend(g)).value());
  struct Variant {
    int32_t H;
    bool decode_only;
  };
  const Layout layouts[] = {
      {"D2 sharded", make_layout(1, 2), true},
      {"D2 replicated", make_layout(1, 2, IndexerMode::kReplicated), true},
      {"D4 sharded", make_layout(1, 4), true},
      {"D8 sharded", make_layout(1, 8), true},
      {"D2 DSA-CP", make_layout(1, 2, IndexerMode::kSharded, 0, true), true},
      {"D4 DSA-CP", make_layout(1, 4, IndexerMode::kSharded, 3, true), true},
      {"P2xD2", make_layout(2, 2), true},
      {"P2xD4", make_layout(2, 4), true},
      {"D2 sharded (NCCL)", make_layout(1, 2), false},
  };
  for (const Variant v : {Variant{16, false}, Variant{16, true}, Variant{8, false}}) {
    const uint64_t s = seed * 37 + static_cast<uint64_t>(v.H) + (v.decode_only ? 1 : 0);
    const CaseFile c = make_case(s, v.H, v.decode_only);
    const std::string tag = std::string(v.decode_only ? "decode-only" : "mixed") + " H=" + std::to_string(v.H) +
                            " seed " + std::to_string(s) + ": ";
    ReplayOptions one;
    one.page_size = 64;
    one.out_dtype = DType::kF32;
    auto want = replay_case(*gpus[0], c, one);
    if (!want.ok()) {
      report(false, tag + "one GPU", want.status().to_string());
      continue;
    }
    auto oracle = replay_case(*cpu, c, one);
    if (oracle.ok()) {
      const Compare cc = compare(*want, *oracle);
      report(cc.topk_same && cc.out_rel < 1e-2, tag + "one GPU vs CPU oracle", describe(cc));
    } else {
      report(false, tag + "CPU oracle", oracle.status().to_string());
    }
    for (const Layout& l : layouts) {
      if (l.layout.dsa_cp && !v.decode_only) continue;  // DSA-CP: the decode-only batch
      if (v.H / l.layout.D < 1) continue;
      if (!l.one_gpu && (num_gpus < l.layout.num_ranks() || !nccl_available())) continue;
      ReplayOptions o = one;
      o.layout = l.layout;
      std::vector<Backend*> ranks;
      for (int32_t cr = 0; cr < l.layout.num_ranks(); ++cr) ranks.push_back(gpus[l.one_gpu ? 0 : cr].get());
      const std::string name = tag + l.name + " (" + std::to_string(v.H / l.layout.D) + " heads a DCP rank" +
                               (l.one_gpu ? ", on one GPU)" : ")");
      auto got = replay_case(ranks, c, o);
      if (!got.ok()) {
        report(false, name, got.status().to_string());
        continue;
      }
      const Compare cc = compare(*got, *want);
      report(cc.topk_same && cc.out_rel < 5e-3 && cc.lse_abs < 2e-2, name + " vs one GPU", describe(cc));
      if (l.layout.D == 2 && !l.layout.dsa_cp && oracle.ok()) {
        const Compare co = compare(*got, *oracle);
        report(co.topk_same && co.out_rel < 1e-2, name + " vs CPU oracle", describe(co));
      }
    }
  }
}

// Communicator churn: `cycles` NCCL clusters made, used for one step and released, one after the other (what
// the layout tests do between layouts, where a heap corruption inside ncclCommDestroy showed about one run in
// five). Alternates D2 and P2 layouts on a small decode batch; every step is checked against one GPU.
void test_churn(uint64_t seed, int cycles) {
  std::vector<std::unique_ptr<Backend>> gpus;
  for (int g = 0; g < 2; ++g) gpus.push_back(std::move(make_cuda_backend(g)).value());
  const CaseFile c = make_case(seed, 64, true);
  ReplayOptions one;
  one.page_size = 64;
  auto want = replay_case(*gpus[0], c, one);
  if (!want.ok()) return report(false, "churn: one GPU", want.status().to_string());
  int good = 0;
  const auto t0 = Clock::now();
  for (int i = 0; i < cycles; ++i) {
    ReplayOptions o = one;
    o.layout = i % 2 == 0 ? make_layout(1, 2) : make_layout(2, 1);
    auto got = replay_case(std::vector<Backend*>{gpus[0].get(), gpus[1].get()}, c, o);
    if (got.ok() && compare(*got, *want).topk_same) ++good;
  }
  report(good == cycles, "churn: " + std::to_string(cycles) + " NCCL clusters made, used and released",
         std::to_string(good) + " matched one GPU, " + std::to_string(seconds_since(t0) / std::max(cycles, 1)) +
             " s per cycle");
}

}  // namespace

// Every CP layout with FP8 KV (the fp8_ds_mla latent cache: the case's context latent quantized on load, the new
// tokens' by the step's cache write; the gathered views and the KV exchanges move the 656-byte records), every
// rank on GPU 0, against one GPU over the same records: top-k identical, out within the bf16 bound. One GPU is
// also compared with the CPU oracle over the same records.
void test_fp8_kv_layouts(uint64_t seed) {
  auto cpu = make_cpu_backend(0);
  auto gpu = make_cuda_backend(0);
  if (!gpu.ok()) {
    report(false, "FP8 KV layouts: backend", gpu.status().to_string());
    return;
  }
  const Layout layouts[] = {
      {"P2 on one GPU", make_layout(2, 1), true},
      {"D2 sharded on one GPU", make_layout(1, 2), true},
      {"D2 replicated on one GPU", make_layout(1, 2, IndexerMode::kReplicated), true},
      {"P2 gathered decodes on one GPU", make_layout(2, 1, IndexerMode::kSharded, 0, false, DecodeMode::kGathered),
       true},
      {"P2xD2 on one GPU", make_layout(2, 2), true},
      {"P4 on one GPU", make_layout(4, 1), true},
      {"D4 DSA-CP on one GPU", make_layout(1, 4, IndexerMode::kSharded, 3, true), true},
  };
  for (int variant = 0; variant < 2; ++variant) {
    const bool decode_only = variant == 1;
    const int32_t H = decode_only ? 128 : 64;
    const uint64_t s = seed * 37 + 11 + variant;
    const CaseFile c = make_case(s, H, decode_only);
    const std::string tag = std::string("FP8 KV ") + (decode_only ? "decode-only" : "mixed") + " H=" +
                            std::to_string(H) + " seed " + std::to_string(s) + ": ";
    ReplayOptions one;
    one.page_size = 64;
    one.out_dtype = DType::kF32;
    one.latent_fp8 = true;
    auto want = replay_case(**gpu, c, one);
    if (!want.ok()) {
      report(false, tag + "one GPU", want.status().to_string());
      continue;
    }
    auto oracle = replay_case(*cpu, c, one);
    if (oracle.ok()) {
      const Compare cc = compare(*want, *oracle);
      report(cc.topk_same && cc.out_rel < 1.5e-2, tag + "one GPU vs CPU oracle", describe(cc));
    } else {
      report(false, tag + "CPU oracle", oracle.status().to_string());
    }
    for (const Layout& l : layouts) {
      if (l.layout.dsa_cp != decode_only && l.layout.dsa_cp) continue;
      ReplayOptions o = one;
      o.layout = l.layout;
      std::vector<Backend*> ranks(static_cast<size_t>(l.layout.num_ranks()), gpu->get());
      const auto t0 = Clock::now();
      auto got = replay_case(ranks, c, o);
      if (!got.ok()) {
        report(false, tag + l.name, got.status().to_string());
        continue;
      }
      const Compare cc = compare(*got, *want);
      report(cc.topk_same && cc.out_rel < 5e-3 && cc.lse_abs < 2e-2, tag + l.name + " vs one GPU",
             describe(cc) + " (" + std::to_string(seconds_since(t0)) + " s)");
    }
  }
}

int main(int argc, char** argv) {
  dsacp::testing::install_crash_trace();
  uint64_t seed = static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count()) % 1000003;
  std::string json;
  int churn = 0;  // --churn N: only the communicator churn test, N cycles
  int window_rounds = 0;  // --window N: only the window exchange test, N times (fresh seeds)
  bool small_heads = false;  // --small-heads: only the layouts with fewer than 16 heads a rank
  bool fp8_kv = false;  // --fp8-kv: only the layouts with the fp8_ds_mla latent cache
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--seed" && i + 1 < argc) seed = std::strtoull(argv[++i], nullptr, 10);
    if (a == "--json" && i + 1 < argc) json = argv[++i];
    if (a == "--churn" && i + 1 < argc) churn = std::atoi(argv[++i]);
    if (a == "--window" && i + 1 < argc) window_rounds = std::atoi(argv[++i]);
    if (a == "--small-heads") small_heads = true;
    if (a == "--fp8-kv") fp8_kv = true;
  }
  auto count = cuda_device_count();
  if (!count.ok() || *count < 1) {
    std::printf("no usable GPU: %s\n", count.ok() ? "0 devices" : count.status().to_string().c_str());
    return 77;
  }
  std::printf("dsacp GPU CP tests: %d GPU(s), %s, seed %llu\n", *count, nccl_version().c_str(),
              static_cast<unsigned long long>(seed));
  if (window_rounds > 0) {
    if (*count >= 2 && nccl_available()) {
      for (int i = 0; i < window_rounds; ++i) test_window(seed + static_cast<uint64_t>(i));
    }
    std::printf("%d checks, %d failed\n", g_log.checks(), g_log.failures());
    std::fflush(stdout);
    std::_Exit(g_log.failures() == 0 ? 0 : 1);
  }
  if (small_heads || fp8_kv) {
    if (small_heads) test_small_head_layouts(seed, *count);
    if (fp8_kv) test_fp8_kv_layouts(seed);
    std::printf("%d checks, %d failed\n", g_log.checks(), g_log.failures());
    g_log.write_json(json, "\"gpus\":" + std::to_string(*count) + ",\"seed\":" + std::to_string(seed) + ",");
    std::fflush(stdout);
    std::_Exit(g_log.failures() == 0 ? 0 : 1);
  }
  if (churn > 0) {
    if (*count >= 2 && nccl_available()) test_churn(seed, churn);
    std::printf("%d checks, %d failed\n", g_log.checks(), g_log.failures());
    std::fflush(stdout);
    std::_Exit(g_log.failures() == 0 ? 0 : 1);
  }
  if (*count >= 2 && nccl_available()) {
    for (bool peer : {true, false}) {
      test_nccl_collectives(seed, peer);
      test_back_to_back(seed, peer);
      test_nccl_timeout(peer);
      test_nccl_abort(peer);
    }
    test_back_to_back(seed + 1, true, true);
    test_window(seed);
    test_nccl_timeout(false, true);
    test_nccl_abort(false, true);
    test_window_rows_timeout(false);
    test_window_rows_timeout(true);
  } else {
    std::printf("(NCCL tests need 2 GPUs and NCCL: skipped)\n");
  }
  test_layouts(seed, *count);
  test_small_head_layouts(seed, *count);
  test_fp8_kv_layouts(seed);
  std::printf("%d checks, %d failed\n", g_log.checks(), g_log.failures());
  g_log.write_json(json, "\"gpus\":" + std::to_string(*count) + ",\"seed\":" + std::to_string(seed) + ",");
  // Aborted NCCL communicators are released by detached threads; end without waiting for them in teardown.
  std::fflush(stdout);
  std::_Exit(g_log.failures() == 0 ? 0 : 1);
}
