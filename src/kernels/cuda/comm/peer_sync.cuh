// Device-side synchronization between the GPUs of one host (peer memory): the flag loads and stores of the peer
// exchange and the window publish (peer_exchange.cu), their failure words, and the row-by-row signal and wait of
// window exchanges that the step's kernels synchronize themselves (WindowRowSync, Communicator::window_rows).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dsacp/kernel_params.h"

namespace dsacp::cuda::peer {

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The communicator's words, three of them:
//   abort word   mapped host memory, raised by the host when the communicator fails (a wait sees it and ends);
//   error word   mapped host memory, the first failed wait's code (-1 after an abort, else 1 + the late peer),
//                read by the host after the exchange;
//   failed word  device memory, 1 once a wait of this rank failed: what the producers read before they store
//                into a peer's memory or raise its flags, and what a later wait reads first.
// Reads of mapped host memory are served one at a time, ~1.1 us each (on an H200: 64 CTAs reading one word once take 76 us, 128 take 143 us); a host-word check in every CTA of a kernel
// made the row-signalling top-k 50 us slower and the merged attention 0.3 ms. So the producers
// check only the failed word, and the waits read the host words rarely (kWaitWordsEveryNs). A host abort
// reaches the producers through the waits (a wait that sees the abort word fails and sets the failed word);
// a producer that runs after an abort before any wait failed stores a correct message of the current exchange,
// and after an abort the host enqueues nothing more.
struct PeerWords {
  const volatile int32_t* abort_word = nullptr;
  int32_t* error_word = nullptr;
  int32_t* failed_word = nullptr;
};

// True when the host words say the communicator failed (two reads of host memory: ~2 us).
__device__ __forceinline__ bool words_dead(const volatile int32_t* abort_word, const int32_t* error_word) {
  return *abort_word != 0 || *reinterpret_cast<const volatile int32_t*>(error_word) != 0;
}

// True once a wait of this rank failed (the failed word; the host words where a caller has none).
__device__ __forceinline__ bool rank_failed(const PeerWords& w) {
  if (w.failed_word != nullptr) return *reinterpret_cast<const volatile int32_t*>(w.failed_word) != 0;
  return words_dead(w.abort_word, w.error_word);
}

// A wait that gives up: the first failure's code goes to the error word (-1 after an abort, else 1 + the peer
// that did not deliver), visible to the host, and the failed word to 1, visible to the later kernels.
__device__ __forceinline__ void record_wait_failure(const PeerWords& w, int peer) {
  volatile int32_t* error = reinterpret_cast<volatile int32_t*>(w.error_word);
  if (*error == 0) *error = *w.abort_word != 0 ? -1 : 1 + peer;
  if (w.failed_word != nullptr) *reinterpret_cast<volatile int32_t*>(w.failed_word) = 1;
  __threadfence_system();
}

// When a wait looks at the host words: not before it has spun for kWaitWordsEveryNs, then every
// kWaitWordsEveryNs. With a read every 20 us, 64 waiting CTAs kept the host-read queue full, and a wait whose flag
// had come sat up to ~0.1 ms behind its own read. An abort ends the waits within ~1 ms.
constexpr uint64_t kWaitWordsEveryNs = 1000000;

// Spins (one thread) until *flag reaches seq, with acquire at system scope, bounded by timeout_ns from t0 and the
// communicator's words; false, with the failure recorded, when it gave up. A rank whose earlier wait failed gives
// up at once.
__device__ __forceinline__ bool wait_flag(const uint64_t* flag, uint64_t seq, uint64_t t0, uint64_t timeout_ns,
                                          const PeerWords& w, int peer) {
  auto seen = [&]() -> uint64_t { return ld_acquire_sys(flag); };
  if (seen() >= seq) return true;
  if (w.failed_word != nullptr && *reinterpret_cast<const volatile int32_t*>(w.failed_word) != 0) {
    record_wait_failure(w, peer);
    return false;
  }
  uint64_t next_words = t0 + kWaitWordsEveryNs;
  for (uint32_t spins = 1; seen() < seq; ++spins) {
    if ((spins & 63) != 0) continue;
    const uint64_t now = global_timer_ns();
    if (now - t0 > timeout_ns || (now >= next_words && words_dead(w.abort_word, w.error_word))) {
      record_wait_failure(w, peer);
      return false;
    }
    if (now >= next_words) next_words = now + kWaitWordsEveryNs;
  }
  return true;
}

// The words of anything that carries them (WindowRowSync, the peer exchange's ExchangeArgs and WindowArgs).
template <typename Args>
__device__ __forceinline__ PeerWords words_of(const Args& a) {
  PeerWords p;
  p.abort_word = a.abort_word;
  p.error_word = a.error_word;
  p.failed_word = a.failed_word;
  return p;
}

// Producer side of a row-synchronized window exchange: after the CTA's stores of row t (into this rank's window
// buffer or the peers'), the CTA meets at a barrier and thread 0 raises row t's flag in every peer with a release
// at system scope, unless a wait of this rank failed (the peers then time out instead of reading a message of a
// failed rank). The barrier orders the CTA's stores before thread 0's release, and a release is cumulative over
// what its thread observed, so the peer's acquire of the flag sees them. (Without the fence.sc.sys it had before
// the release, as the peer exchange's put has, the sparse MLA's 64 KiB of partial rows a CTA went from 13.1 to
// 11.9 us stored and signalled on 2 x H200.) Every thread of the CTA must call it.
__device__ __forceinline__ void window_row_signal(const WindowRowSync& w, int64_t t) {
  if (w.seq == 0) return;
  __syncthreads();
  if (threadIdx.x == 0 && t >= 0 && t < w.num_rows && !rank_failed(words_of(w))) {
    for (int k = 0; k < w.size; ++k) {
      if (w.signal_to[k] != nullptr) st_release_sys(w.signal_to[k] + t, w.seq);
    }
  }
}

// Consumer side: thread k (k < size, k != rank) waits until peer k's flag of row t reached seq (wait_flag); the
// CTA then meets at a barrier. Returns false, on every thread, when a wait gave up (the failure is recorded; the
// CTA must not read the peers' row). Every thread of the CTA must call it; `ok` is one int of shared memory.
__device__ __forceinline__ bool window_row_wait(const WindowRowSync& w, int64_t t, int* ok) {
  if (w.seq == 0) return true;
  if (threadIdx.x == 0) *ok = 1;
  __syncthreads();
  const int k = static_cast<int>(threadIdx.x);
  if (k < w.size && k != w.rank && t >= 0 && t < w.num_rows) {
    if (!wait_flag(w.wait_on[k] + t, w.seq, global_timer_ns(), w.timeout_ns, words_of(w), k)) *ok = 0;
  }
  __syncthreads();
  return *ok != 0;
}

}  // namespace dsacp::cuda::peer
