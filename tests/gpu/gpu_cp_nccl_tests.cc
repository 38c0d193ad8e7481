// The NCCL communicator on two GPUs (ranks as threads): every collective against host math, split, grouped
// exchanges back to back, the exchange window, a peer that never arrives -> kTimeout, a peer that aborts -> an
// error naming it, both bounded. Skipped without two GPUs and NCCL.
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
#include "gpu/gpu_cp_support.h"
#include "gpu/gpu_test.h"

namespace dsacp::testing {
namespace {

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

// Two GPUs and NCCL, or the test is skipped.
class CpNccl : public GpuTest {
 protected:
  void SetUp() override {
    GpuTest::SetUp();
    if (IsSkipped()) return;
    auto count = cuda_device_count();
    if (!count.ok() || *count < 2 || !nccl_available()) GTEST_SKIP() << "the NCCL tests need 2 GPUs and NCCL";
  }
  uint64_t seed() const { return gpu_test_options().seed; }
};

TEST_F(CpNccl, Collectives) {
  for (bool peer : {true, false}) test_nccl_collectives(seed(), peer);
}

TEST_F(CpNccl, BackToBack) {
  for (bool peer : {true, false}) test_back_to_back(seed(), peer);
  test_back_to_back(seed() + 1, true, true);
}

TEST_F(CpNccl, Timeout) {
  for (bool peer : {true, false}) test_nccl_timeout(peer);
  test_nccl_timeout(false, true);
}

TEST_F(CpNccl, Abort) {
  for (bool peer : {true, false}) test_nccl_abort(peer);
  test_nccl_abort(false, true);
}

// --window N: N rounds (fresh seeds) instead of one.
TEST_F(CpNccl, Window) {
  const int rounds = std::max(1, gpu_test_options().window);
  for (int i = 0; i < rounds; ++i) test_window(seed() + static_cast<uint64_t>(i));
}

TEST_F(CpNccl, WindowRowsTimeout) {
  test_window_rows_timeout(false);
  test_window_rows_timeout(true);
}

}  // namespace
}  // namespace dsacp::testing
