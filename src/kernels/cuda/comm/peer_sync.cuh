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

// True once the host raised the abort word or an earlier wait of this communicator failed: an exchange must not
// touch the peers' memory any more (a failed rank's later stores could overwrite what a healthy peer still reads).
__device__ __forceinline__ bool words_dead(const volatile int32_t* abort_word, const int32_t* error_word) {
  return *abort_word != 0 || *reinterpret_cast<const volatile int32_t*>(error_word) != 0;
}

// A wait that gives up: the first failure's code goes to the error word (-1 after an abort, else 1 + the peer
// that did not deliver), visible to the host and the later kernels.
__device__ __forceinline__ void record_wait_failure(const volatile int32_t* abort_word, int32_t* error_word, int peer) {
  volatile int32_t* error = reinterpret_cast<volatile int32_t*>(error_word);
  if (*error == 0) *error = *abort_word != 0 ? -1 : 1 + peer;
  __threadfence_system();
}

// words_dead with one read of host memory where the error word follows the abort word (the communicator's
// layout; a read of mapped host memory costs about a microsecond).
__device__ __forceinline__ bool words_dead_one_read(const volatile int32_t* abort_word, const int32_t* error_word) {
  if (error_word == abort_word + 1 && (reinterpret_cast<uintptr_t>(abort_word) & 7) == 0) {
    const unsigned long long both = *reinterpret_cast<const volatile unsigned long long*>(abort_word);
    return both != 0ull;
  }
  return words_dead(abort_word, error_word);
}

// True once a row wait of this rank's communicator failed (WindowRowSync::failed_word: device memory, an L2 read).
// The producers' check before they store into a peer's window or raise its flags. Not the host words: one read
// of mapped host memory per CTA, all CTAs of a kernel at once, queue on PCIe (session 12: +50 us on the top-k,
// +0.3 ms on the merged attention of the DCP 128K step). A host abort reaches the producers through the
// waits: a wait that sees the abort word fails and sets failed_word; a producer that runs after an abort before
// any wait failed stores a correct row of the current exchange (after an abort the host enqueues nothing more).
__device__ __forceinline__ bool row_sync_failed(const WindowRowSync& w) {
  return w.failed_word != nullptr ? *reinterpret_cast<const volatile int32_t*>(w.failed_word) != 0
                                  : words_dead_one_read(w.abort_word, w.error_word);
}

// Producer side of a row-synchronized window exchange: after the CTA's stores of row t (into this rank's window
// buffer or the peers'), the CTA meets at a barrier and thread 0 fences at system scope (cumulative over the
// stores the barrier ordered before it, as the peer exchange's put does) and raises row t's flag in every peer
// (release at system scope), unless a wait of this communicator failed (the peers then time out instead of
// reading a message of a failed rank). One fence a CTA. Every thread of the CTA must call it.
__device__ __forceinline__ void window_row_signal(const WindowRowSync& w, int64_t t) {
  if (w.seq == 0) return;
  __syncthreads();
  if (threadIdx.x == 0 && t >= 0 && t < w.num_rows && !row_sync_failed(w)) {
    __threadfence_system();
    for (int k = 0; k < w.size; ++k) {
      if (w.signal_to[k] != nullptr) st_release_sys(w.signal_to[k] + t, w.seq);
    }
  }
}

// How often a row wait looks at the communicator's host words (the abort and error words), in ns of its own
// spinning: rarely, since every waiting CTA reads them (an abort still ends the wait within ~20 us).
constexpr uint64_t kRowWaitWordsEveryNs = 20000;

// Consumer side: thread k (k < size, k != rank) waits until peer k's flag of row t reached seq (acquire),
// bounded by the timeout and the communicator's words; the CTA then meets at a barrier. Returns false, on every
// thread, when a wait gave up (the failure is in the error word and failed_word; the CTA must not read the
// peers' row). Every thread of the CTA must call it; `ok` is one int of shared memory.
__device__ __forceinline__ bool window_row_wait(const WindowRowSync& w, int64_t t, int* ok) {
  if (w.seq == 0) return true;
  if (threadIdx.x == 0) *ok = 1;
  __syncthreads();
  const int k = static_cast<int>(threadIdx.x);
  if (k < w.size && k != w.rank && t >= 0 && t < w.num_rows) {
    const uint64_t* flag = w.wait_on[k] + t;
    const uint64_t t0 = global_timer_ns();
    uint64_t next_words = t0 + kRowWaitWordsEveryNs;
    for (uint32_t spins = 1; ld_acquire_sys(flag) < w.seq; ++spins) {
      if ((spins & 63) != 0) continue;
      const uint64_t now = global_timer_ns();
      if (now - t0 > w.timeout_ns || (now >= next_words && words_dead(w.abort_word, w.error_word))) {
        record_wait_failure(w.abort_word, w.error_word, k);
        if (w.failed_word != nullptr) *reinterpret_cast<volatile int32_t*>(w.failed_word) = 1;
        *ok = 0;
        break;
      }
      if (now >= next_words) next_words = now + kRowWaitWordsEveryNs;
    }
  }
  __syncthreads();
  return *ok != 0;
}

}  // namespace dsacp::cuda::peer
