// Peer exchange: all-gathers and all-to-alls between the GPUs of one machine done by dsacp's own kernels: each
// rank stores its blocks straight into the peers' memory (NVLink), one CTA waits for theirs, and they are
// unpacked into the receive buffer; no NCCL call. Only the wait kernel ever waits, on one CTA, so an exchange
// launched beside a long kernel (the decode queries' gather during the indexer) does not hold SMs from it. The NCCL
// communicator uses it for messages up to its slot size (the decode step's candidates, partial outputs and
// queries: 0.5-8 MiB), where NCCL's per-collective latency (24 us for 1 MiB, 47 for 4 MiB on the H200 pair)
// is most of the time; larger messages keep NCCL.
//
// Each rank owns an exchange area, registered once per communicator (every peer holds a pointer to it: the same
// process through peer access, another process through CUDA IPC):
//   flags [kMaxRanks senders][kMaxCtas] uint64: sender s's CTA c stores the exchange's sequence number there
//         (release, system scope) after its stores into this area;
//   data  [size senders][2 parities][slot_bytes]: sender s's message of exchange `seq` in parity seq & 1.
// The put's CTA c moves byte range c of the message and raises flag c. Two parities make the area safe without
// any reset: a sender writes parity p at exchange seq only after its wait of seq - 1 saw the receiver's flags of
// seq - 1, which the receiver's put of seq - 1 stored after its unpack of seq - 2 (the last reader of parity p)
// had ended. That needs a communicator's exchanges to run one after another: the communicator launches them on
// the producer's stream and makes an exchange on another stream than the last wait for the last one's end.
//
// The wait is bounded: past timeout_ns it stores 1 + the late peer's rank in the error word (host memory), once
// the host raises the abort word -1, and ends; the host turns that into the collective's error. It also sets the
// rank's failed word (device memory); once that is set, later puts store nothing and later waits end at once, so
// a failed rank never writes into a slot a healthy peer may still be reading (peer_sync.cuh, PeerWords).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace dsacp::cuda::peer {

constexpr int kMaxRanks = 8;  // (= kMaxPartBuffers of kernel_params.h: a window's messages are merge parts)
constexpr int kMaxParts = 8;
constexpr int kMaxCtas = 128;
constexpr size_t kFlagBytes = sizeof(uint64_t) * kMaxRanks * kMaxCtas;  // the data starts here (8 KiB)
constexpr size_t kAlign = 16;  // each part's block in a message starts 16-byte aligned

enum class Kind : int32_t { kAllGather = 0, kAllToAll = 1 };

struct Part {
  const void* send;
  void* recv;
  size_t bytes;  // per rank, as in Communicator::all_gather_async / all_to_all_async
};

struct ExchangeArgs {
  Kind kind = Kind::kAllGather;
  int32_t rank = 0, size = 0, num_parts = 0;
  Part parts[kMaxParts] = {};
  char* areas[kMaxRanks] = {};  // every rank's area as this device addresses it (this rank's included)
  size_t slot_bytes = 0;
  uint64_t seq = 0;             // 1, 2, ... per exchange of the communicator, the same on every rank
  uint64_t timeout_ns = 0;
  const volatile int32_t* abort_word = nullptr;  // mapped host memory, raised by the host on failure
  int32_t* error_word = nullptr;                 // mapped host memory: 1 + the rank that did not deliver, or -1
  int32_t* failed_word = nullptr;                // device memory: 1 once a wait of this rank failed
  // Diagnostic (NcclOptions::exchange_stamps): device memory [kStampRing][kStamps] of global-timer ns for
  // exchanges seq < kStampRing: put first start / last end, wait start / end, unpack first start / last end.
  unsigned long long* stamps = nullptr;
};
constexpr int kStampRing = 64, kStamps = 6;

// Windows (Communicator::window_next): zero-copy exchanges. After the slots, a rank's area holds the window
// flags [kMaxRanks senders] uint64 (padded to kWindowFlagBytes) and two window buffers of window_bytes (parity
// seq & 1). Each rank writes its message into its own buffer (its producer kernels), then a publish: one small
// kernel raises this rank's flag (the window exchange's sequence number, release at system scope after a
// system fence) in every peer's area and waits, bounded like the exchange's wait, until every peer's flag in
// its own area reached the sequence number. Consumers then read the peers' buffers in place. The parity
// argument of the slots holds: a rank rewrites parity p at seq + 2 only after its publish of seq + 1 saw the
// peers' flags of seq + 1, which each peer raised after enqueueing its reads of seq.
constexpr size_t kWindowFlagBytes = 4096;
// Then the row flags of window exchanges that the kernels synchronize themselves (Communicator::window_rows,
// WindowRowSync of kernel_params.h): [kMaxRanks senders][kMaxWindowRows] uint64, sender s's producer kernel
// raising row t's flag (the exchange's sequence number, release at system scope after its stores) in every
// peer's region. Sequence numbers only grow, so the flags are never reset; the parity argument above holds with
// "a peer's row flag of seq + 1" in place of "its publish of seq + 1" (every consumer waits for every peer's flag
// of each row it reads, and a producer runs after its rank's consumers of the exchange before).
constexpr int64_t kMaxWindowRows = 4096;
constexpr size_t kWindowRowFlagBytes = sizeof(uint64_t) * kMaxRanks * kMaxWindowRows;  // 256 KiB
constexpr size_t kWindowHeaderBytes = kWindowFlagBytes + kWindowRowFlagBytes;         // zeroed once, at setup
// Sender s's row flags in a window region.
inline uint64_t* window_row_flags(char* region, int sender) {
  return reinterpret_cast<uint64_t*>(region + kWindowFlagBytes) + static_cast<size_t>(sender) * kMaxWindowRows;
}

struct WindowArgs {
  int32_t rank = 0, size = 0;
  char* windows[kMaxRanks] = {};  // every rank's window region (its flags) as this device addresses it
  uint64_t seq = 0;               // 1, 2, ... per window exchange of the communicator, the same on every rank
  uint64_t timeout_ns = 0;
  const volatile int32_t* abort_word = nullptr;  // as in ExchangeArgs
  int32_t* error_word = nullptr;
  int32_t* failed_word = nullptr;
};

// Bytes of the window region: flags, row flags, then two buffers.
size_t window_region_bytes(size_t window_bytes);
// The buffer of parity `parity` in a window region.
inline char* window_buffer(char* region, size_t window_bytes, int parity) {
  return region + kWindowHeaderBytes + static_cast<size_t>(parity) * window_bytes;
}
// Enqueues a window publish (signal every peer, wait for every peer) on `stream`.
cudaError_t launch_window_publish(const WindowArgs& args, cudaStream_t stream);

// Bytes a message of these parts takes in a slot (each part's block rounded up to kAlign).
size_t message_bytes(const Part* parts, int num_parts);
// Bytes of one rank's area for `size` ranks and slots of slot_bytes.
size_t area_bytes(int size, size_t slot_bytes);
// Enqueues the exchange (put, wait, unpack) on `stream`. The message must fit a slot (message_bytes <= slot_bytes).
cudaError_t launch_exchange(const ExchangeArgs& args, cudaStream_t stream);

}  // namespace dsacp::cuda::peer
