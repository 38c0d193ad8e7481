// The NCCL communicator's peer exchange and exchange window (kernels/cuda/comm/peer_exchange.h), NcclComm's
// members of nccl_comm.h defined here: the exchange areas registered with every peer at creation and split
// (setup_peer_exchange) and released before NCCL goes (quiesce_peer_exchange, release_peer_exchange); an
// all-gather or all-to-all whose message fits a slot run by dsacp's own kernels instead of NCCL (peer_fits,
// peer_collective); the window (window_next, window_publish, window_rows, window_rows_done, window_rows_check); the diagnostic
// stamps (NcclOptions::exchange_stamps).
#include "comm/nccl/nccl_comm.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>

#include <unistd.h>

namespace dsacp {
namespace nccl_detail {
namespace {

// A random number drawn once per process: ranks with the same one share an address space (pids and host names
// can repeat across containers).
uint64_t process_nonce() {
  static const uint64_t nonce = [] {
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
           static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
           (static_cast<uint64_t>(getpid()) << 16);
  }();
  return nonce;
}

}  // namespace

// A CUDA failure of a peer exchange or window call: it fails the communicator (a rank that skipped an exchange
// its peers ran would pair its next one with their last: the waits accept any newer sequence number).
Status NcclComm::exchange_failed(cudaError_t e, const char* what) {
  const Status st = cuda_error(e, std::string("rank ") + std::to_string(rank_) + ": " + what);
  fail(st.message());
  return st;
}

// What each rank tells the others when a communicator is made.
struct NcclComm::PeerInfo {
  int32_t want = 0;    // this rank has an exchange area and wants to use it
  int32_t device = 0;
  int32_t ipc_ok = 0;  // ipc holds a handle to the area
  int32_t pad = 0;
  uint64_t slot_bytes = 0;    // the area's layout, which every rank must share
  uint64_t window_bytes = 0;
  uint64_t host = 0;   // hash of the host name
  uint64_t process = 0;  // a random number per process: equal means the same address space
  uint64_t area = 0;   // the area's address in its own process
  cudaIpcMemHandle_t ipc{};
};

// Registers an exchange area with every peer: a collective, run by every rank at creation and split. Ranks in
// this process address a peer's area through peer access, ranks in other processes of this host through CUDA
// IPC. Used only when every rank can reach every other (else every collective stays with NCCL); the only
// error is a failed exchange of the areas' details.
Status NcclComm::setup_peer_exchange() {
  if (size_ < 2 || size_ > cuda::peer::kMaxRanks) return Status();
  const bool exchange_wanted = options_.peer_exchange_bytes >= 4096 * static_cast<size_t>(2 * size_);
  const bool window_wanted = options_.window_bytes >= 4096;
  const bool wanted = exchange_wanted || window_wanted;
  slot_bytes_ = exchange_wanted ? options_.peer_exchange_bytes / (2 * static_cast<size_t>(size_)) / 256 * 256 : 0;
  window_bytes_ = window_wanted ? options_.window_bytes / 256 * 256 : 0;
  PeerInfo me;
  me.slot_bytes = slot_bytes_;
  me.window_bytes = window_bytes_;
  me.device = options_.device;
  me.process = process_nonce();
  char host[256] = {};
  (void)gethostname(host, sizeof(host) - 1);
  me.host = std::hash<std::string>{}(host);
  if (wanted) {
    void* words = nullptr;
    const size_t window_at = cuda::peer::area_bytes(size_, slot_bytes_);
    // [exchange flags and slots][window region][this rank's failed word (device memory, peer_sync.cuh)]
    const size_t failed_at = window_at + (window_bytes_ > 0 ? cuda::peer::window_region_bytes(window_bytes_) : 0);
    cudaError_t e = cudaMalloc(&area_, failed_at + 256);
    if (e == cudaSuccess) {
      failed_dev_ = reinterpret_cast<int32_t*>(area_ + failed_at);
      e = cudaMemsetAsync(failed_dev_, 0, sizeof(int32_t), stream_);
    }
    if (e == cudaSuccess) e = cudaMemsetAsync(area_, 0, cuda::peer::kFlagBytes, stream_);
    if (e == cudaSuccess && window_bytes_ > 0) {
      e = cudaMemsetAsync(area_ + window_at, 0, cuda::peer::kWindowHeaderBytes, stream_);
    }
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream_);
    if (e == cudaSuccess) e = cudaHostAlloc(&words, 2 * sizeof(int32_t), cudaHostAllocMapped);
    if (e == cudaSuccess) {
      peer_words_ = static_cast<volatile int32_t*>(words);
      peer_words_[0] = 0;
      peer_words_[1] = 0;
      e = cudaHostGetDevicePointer(reinterpret_cast<void**>(&peer_words_dev_), words, 0);
    }
    if (e == cudaSuccess) {
      me.want = 1;
      me.area = reinterpret_cast<uint64_t>(area_);
      me.ipc_ok = cudaIpcGetMemHandle(&me.ipc, area_) == cudaSuccess;
    }
    (void)cudaGetLastError();
  }
  DSACP_ASSIGN_OR_RETURN(std::vector<PeerInfo> all, exchange_setup_record(me));
  int32_t ok = 1;
  for (const PeerInfo& p : all) ok &= p.want && p.slot_bytes == me.slot_bytes && p.window_bytes == me.window_bytes;
  if (!ok) {  // every rank sees the same records: all of them stop here, no vote needed
    release_peer_exchange(true);
    return Status();
  }
  for (int k = 0; k < size_ && ok; ++k) {
    const PeerInfo& p = all[static_cast<size_t>(k)];
    if (k == rank_) {
      peer_areas_[k] = area_;
    } else if (p.process == me.process) {
      int can = 0;
      if (p.device != me.device) {
        if (cudaDeviceCanAccessPeer(&can, me.device, p.device) != cudaSuccess || !can) ok = 0;
        const cudaError_t e = ok ? cudaDeviceEnablePeerAccess(p.device, 0) : cudaSuccess;
        if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) ok = 0;
      }
      peer_areas_[k] = reinterpret_cast<char*>(p.area);
    } else if (p.host == me.host && p.ipc_ok) {
      void* mapped = nullptr;
      if (cudaIpcOpenMemHandle(&mapped, p.ipc, cudaIpcMemLazyEnablePeerAccess) == cudaSuccess) {
        peer_areas_[k] = static_cast<char*>(mapped);
        ipc_opened_.push_back(mapped);
      } else {
        ok = 0;
      }
    } else {
      ok = 0;
    }
    (void)cudaGetLastError();
  }
  // Every rank must agree, or ranks would pair a peer exchange with NCCL.
  PeerInfo vote;
  vote.want = ok;
  DSACP_ASSIGN_OR_RETURN(std::vector<PeerInfo> votes, exchange_setup_record(vote));
  bool all_ok = true;
  for (const PeerInfo& v : votes) all_ok &= v.want != 0;
  if (!all_ok) {
    release_peer_exchange(true);
    return Status();
  }
  peer_ready_ = true;
  if (options_.exchange_stamps) {
    const size_t bytes = sizeof(unsigned long long) * cuda::peer::kStampRing * cuda::peer::kStamps;
    if (cudaMalloc(&peer_stamps_, bytes) != cudaSuccess) peer_stamps_ = nullptr;
    reset_stamps();
  }
  return Status();
}

// NcclOptions::exchange_stamps: each exchange's phases (put, wait, unpack) from the kernels' global timer.
void NcclComm::reset_stamps() {
  if (peer_stamps_ == nullptr) return;
  std::vector<unsigned long long> init(cuda::peer::kStampRing * cuda::peer::kStamps);
  for (size_t i = 0; i < init.size(); ++i) init[i] = i % 2 == 0 ? ~0ull : 0ull;
  (void)cudaMemcpy(peer_stamps_, init.data(), init.size() * sizeof(init[0]), cudaMemcpyHostToDevice);
}
void NcclComm::print_stamps() {
  if (peer_stamps_ == nullptr) return;
  std::vector<unsigned long long> st(cuda::peer::kStampRing * cuda::peer::kStamps);
  if (cudaMemcpy(st.data(), peer_stamps_, st.size() * sizeof(st[0]), cudaMemcpyDeviceToHost) != cudaSuccess) return;
  std::string out = "peer exchange stamps, rank " + std::to_string(rank_) + " (us from put start: put end, wait start, wait end, unpack start, unpack end):\n";
  const uint64_t last = std::min<uint64_t>(peer_seq_, cuda::peer::kStampRing - 1);
  for (uint64_t q = last > 24 ? last - 23 : 1; q <= last; ++q) {
    const unsigned long long* x = st.data() + q * cuda::peer::kStamps;
    if (x[0] == ~0ull) continue;
    char line[200];
    auto us = [&](unsigned long long t) { return (static_cast<double>(t) - static_cast<double>(x[0])) / 1000.0; };
    std::snprintf(line, sizeof line, "  seq %llu: %.1f %.1f %.1f %.1f %.1f\n", static_cast<unsigned long long>(q), us(x[1]),
                  us(x[2]), us(x[3]), us(x[4]), us(x[5]));
    out += line;
  }
  std::fprintf(stderr, "%s", out.c_str());
}

// All-gathers one PeerInfo per rank through NCCL (creation time only).
Result<std::vector<NcclComm::PeerInfo>> NcclComm::exchange_setup_record(const PeerInfo& mine) {
  std::vector<PeerInfo> all(static_cast<size_t>(size_));
  void* dev = nullptr;
  cudaError_t e = cudaMalloc(&dev, sizeof(PeerInfo) * (size_ + 1));
  if (e == cudaSuccess) e = cudaMemcpy(dev, &mine, sizeof(PeerInfo), cudaMemcpyHostToDevice);
  if (e != cudaSuccess) {
    if (dev != nullptr) (void)cudaFree(dev);
    return cuda_error(e, "peer exchange setup");
  }
  char* recv = static_cast<char*>(dev) + sizeof(PeerInfo);
  Status s;
  {
    auto h = launch("all_gather", 0, [&] { return ncclAllGather(dev, recv, sizeof(PeerInfo), ncclUint8, comm_, stream_); });
    s = h.ok() ? (*h)->wait() : h.status();
  }
  if (s.ok()) {
    e = cudaMemcpy(all.data(), recv, sizeof(PeerInfo) * size_, cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) s = cuda_error(e, "peer exchange setup");
  }
  (void)cudaFree(dev);
  stats_ = CommStats{};  // setup traffic is not the caller's
  if (!s.ok()) return s.with_context("NCCL communicator: peer exchange setup");
  return all;
}

// Before NCCL goes: with the exchange in use and the communicator healthy, this rank closes its mappings of
// the peers' areas and a barrier (bounded by 10 s) makes sure no peer still reads or writes this rank's area
// (and every peer has closed its mapping of it) before it is freed. False: the area must be left allocated.
bool NcclComm::quiesce_peer_exchange() {
  if (!peer_ready_) return true;
  for (void* p : ipc_opened_) (void)cudaIpcCloseMemHandle(p);
  ipc_opened_.clear();
  if (comm_ == nullptr) return false;
  const auto timeout = options_.timeout;
  options_.timeout = std::min(timeout, std::chrono::milliseconds(10000));
  const bool ok = barrier().ok();
  options_.timeout = timeout;
  return ok;
}

// area_safe false (a failed communicator, whose peers may still be in an exchange): the area is left allocated
// (leaked) rather than freed under a peer that may still store into it.
void NcclComm::release_peer_exchange(bool area_safe) {
  peer_ready_ = false;
  for (void* p : ipc_opened_) (void)cudaIpcCloseMemHandle(p);
  ipc_opened_.clear();
  if (area_ != nullptr && area_safe) (void)cudaFree(area_);
  area_ = nullptr;
  failed_dev_ = nullptr;
  if (peer_words_ != nullptr) (void)cudaFreeHost(const_cast<int32_t*>(peer_words_));
  peer_words_ = nullptr;
  (void)cudaGetLastError();
}

// True when these parts go through the peer exchange (set up, at most kMaxParts, the message fits a slot).
bool NcclComm::peer_fits(const std::vector<Part>& parts) const {
  if (!peer_ready_ || slot_bytes_ == 0 || parts.empty() || parts.size() > static_cast<size_t>(cuda::peer::kMaxParts)) {
    return false;
  }
  std::vector<cuda::peer::Part> p;
  for (const Part& x : parts) {
    if (x.bytes > slot_bytes_) return false;  // (and no overflow in the sum below)
    p.push_back({x.send, x.recv, x.bytes});
  }
  return cuda::peer::message_bytes(p.data(), static_cast<int>(p.size())) <= slot_bytes_;
}

Result<std::unique_ptr<CollectiveHandle>> NcclComm::peer_collective(const char* what, bool all_to_all,
                                                                    const std::vector<Part>& parts) {
  cuda::peer::ExchangeArgs a;
  a.kind = all_to_all ? cuda::peer::Kind::kAllToAll : cuda::peer::Kind::kAllGather;
  a.rank = rank_;
  a.size = size_;
  size_t sent = 0;
  for (const Part& p : parts) {
    sent += p.bytes * (size_ - 1);
    if (p.bytes > 0) a.parts[a.num_parts++] = {p.send, p.recv, p.bytes};
  }
  for (int k = 0; k < size_; ++k) a.areas[k] = peer_areas_[k];
  a.slot_bytes = slot_bytes_;
  a.timeout_ns = timeout_ns();
  a.abort_word = peer_words_dev_;
  a.stamps = peer_stamps_;
  a.error_word = peer_words_dev_ + 1;  // [1]: the host reads it after the exchange ([0] is the abort word)
  a.failed_word = failed_dev_;
  // On the producer's stream: in line with the kernels that make the inputs and use the outputs. The
  // exchanges of this communicator must still run one after another (the area's parity argument): an
  // exchange on another stream than the last one waits for the last one's end.
  const cudaStream_t on = exchange_stream();
  // Any failure from here on fails the communicator (exchange_failed).
  if (const cudaError_t e = peer_order_.before(on); e != cudaSuccess) return exchange_failed(e, what);
  auto h = launch(what, sent, [&] {
    a.seq = ++peer_seq_;  // only exchanges that launch count, the same on every rank
    if (cuda::peer::launch_exchange(a, on) == cudaSuccess) return ncclSuccess;
    (void)cudaGetLastError();
    return ncclUnhandledCudaError;
  }, a.num_parts == 0, on);
  if (h.ok() && a.num_parts > 0) {
    if (const cudaError_t e = peer_order_.after(on); e != cudaSuccess) return exchange_failed(e, what);
    ++stats_.peer_collectives;
  }
  return h;
}

// A window call on this communicator: usable, and with a window.
Status NcclComm::window_usable() const {
  DSACP_RETURN_IF_ERROR(usable());
  if (!peer_ready_ || window_bytes_ == 0) return unsupported("NCCL communicator: no exchange window");
  return Status();
}

Result<NcclComm::Window> NcclComm::window_next(size_t bytes) {
  DSACP_RETURN_IF_ERROR(usable());
  if (!peer_ready_ || window_bytes_ == 0) {
    return unsupported("NCCL communicator: no exchange window (NcclOptions::window_bytes 0, or a rank "
                       "that cannot reach the others' memory)");
  }
  if (bytes > window_bytes_) {
    return unsupported("NCCL communicator: a window message of " + std::to_string(bytes) + " bytes, the window holds " +
                       std::to_string(window_bytes_) + " (NcclOptions::window_bytes)");
  }
  // A producer stream other than the last exchange's: this exchange's producers (enqueued after this call) and
  // its publish wait for all the old stream's work so far (the last publish and the reads after it), as the
  // parity argument needs; reads of the last exchange enqueued on the old stream after this call are not
  // covered (communicator.h: enqueue them first).
  if (const cudaError_t e = window_order_.move_to(exchange_stream()); e != cudaSuccess) {
    return exchange_failed(e, "window stream change");
  }
  const int parity = static_cast<int>((window_seq_ + 1) & 1);
  Window w;
  for (int k = 0; k < size_; ++k) w.all.push_back(cuda::peer::window_buffer(window_region(k), window_bytes_, parity));
  w.mine = cuda::peer::window_buffer(window_region(rank_), window_bytes_, parity);
  window_message_bytes_ = bytes;
  return w;
}

Result<std::unique_ptr<CollectiveHandle>> NcclComm::window_publish() {
  DSACP_RETURN_IF_ERROR(window_usable());
  cuda::peer::WindowArgs a;
  a.rank = rank_;
  a.size = size_;
  for (int k = 0; k < size_; ++k) a.windows[k] = window_region(k);
  a.timeout_ns = timeout_ns();
  a.abort_word = peer_words_dev_;
  a.error_word = peer_words_dev_ + 1;
  a.failed_word = failed_dev_;
  const cudaStream_t on = exchange_stream();
  // Window exchanges run one after another (the parity argument): one on another stream than the last waits
  // for the last one's end (window_next has moved the sequence to this stream already, unless it changed since).
  if (const cudaError_t e = window_order_.before(on); e != cudaSuccess) return exchange_failed(e, "window publish");
  auto h = launch("window publish", window_message_bytes_ * (size_ - 1), [&] {
    a.seq = ++window_seq_;  // only publishes that launch count, the same on every rank
    if (cuda::peer::launch_window_publish(a, on) == cudaSuccess) return ncclSuccess;
    (void)cudaGetLastError();
    return ncclUnhandledCudaError;
  }, false, on);
  if (h.ok()) {
    if (const cudaError_t e = window_order_.after(on); e != cudaSuccess) return exchange_failed(e, "window publish");
    ++stats_.window_publishes;
  }
  return h;
}

Result<WindowRowSync> NcclComm::window_rows(int64_t num_rows) {
  DSACP_RETURN_IF_ERROR(window_usable());
  if (num_rows < 0 || num_rows > cuda::peer::kMaxWindowRows) {
    return unsupported("NCCL communicator: a window exchange of " + std::to_string(num_rows) +
                       " rows synchronized by the kernels; the row flags hold " +
                       std::to_string(cuda::peer::kMaxWindowRows));
  }
  WindowRowSync sync;
  sync.seq = ++window_seq_;  // the same on every rank: each calls this once per exchange, in the same order
  sync.rank = rank_;
  sync.size = size_;
  sync.num_rows = num_rows;
  for (int k = 0; k < size_; ++k) {
    if (k == rank_) continue;
    sync.signal_to[k] = cuda::peer::window_row_flags(window_region(k), rank_);
    sync.wait_on[k] = cuda::peer::window_row_flags(window_region(rank_), k);
  }
  sync.timeout_ns = timeout_ns();
  sync.abort_word = peer_words_dev_;
  sync.error_word = peer_words_dev_ + 1;
  sync.failed_word = failed_dev_;
  ++stats_.window_publishes;
  return sync;
}

Result<std::unique_ptr<CollectiveHandle>> NcclComm::window_rows_done() {
  DSACP_RETURN_IF_ERROR(window_usable());
  const cudaStream_t on = exchange_stream();
  window_order_.now_on(on);
  // Nothing to enqueue: the handle's end event marks the point after the consumer, and its wait reads the error
  // word the consumers' waits store into.
  return launch("window rows", window_message_bytes_ * (size_ - 1), [] { return ncclSuccess; }, true, on);
}

// After the caller synchronized the consumers' stream: their waits are over, and a failed one left its error in
// the error word (read as window_rows_done's handle does, without its event).
Status NcclComm::window_rows_check() {
  DSACP_RETURN_IF_ERROR(window_usable());
  const Status s = peer_wait_error("window rows");
  if (!s.ok()) fail(s.message());
  return s;
}

}  // namespace nccl_detail
}  // namespace dsacp
