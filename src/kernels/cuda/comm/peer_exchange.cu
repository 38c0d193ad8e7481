// The peer exchange kernels (peer_exchange.h): per all-gather / all-to-all, a put (CTA c stores byte range c of
// the message into every peer and raises its flag), a one-CTA wait for every peer's flags, and an unpack.
#include "kernels/cuda/comm/peer_exchange.h"
#include "kernels/cuda/comm/peer_sync.cuh"

#include <cuda_runtime.h>

#include <algorithm>

namespace dsacp::cuda::peer {
namespace {

constexpr int kThreads = 512;
constexpr size_t kChunkTarget = 8 * 1024;  // bytes per CTA before the CTA count reaches kMaxCtas (a CTA moves ~2-4 GB/s to a peer: many CTAs)

// Where each part's block sits in a message, and the split of the message between the CTAs.
struct MessageLayout {
  size_t offset[kMaxParts];
  size_t total;
  size_t chunk;  // a multiple of kAlign
};


// The diagnostic stamps: slot 2j keeps the earliest start (atomicMin), 2j + 1 the latest end (atomicMax).
__device__ __forceinline__ void stamp(const ExchangeArgs& a, int j, bool end) {
  if (a.stamps == nullptr || threadIdx.x != 0 || a.seq >= kStampRing) return;  // the first exchanges only
  unsigned long long* s = a.stamps + a.seq * kStamps + 2 * j;
  const unsigned long long t = global_timer_ns();
  if (end) {
    atomicMax(s + 1, t);
  } else {
    atomicMin(s, t);
  }
}

__device__ __forceinline__ uint64_t* flag_at(char* area, int sender, int cta) {
  return reinterpret_cast<uint64_t*>(area) + sender * kMaxCtas + cta;
}
__device__ __forceinline__ char* slot_at(const ExchangeArgs& a, char* area, int sender) {
  return area + kFlagBytes + (static_cast<size_t>(sender) * 2 + (a.seq & 1)) * a.slot_bytes;
}
// Rank k's block of part i in this rank's send buffer (all-gather: the one block every rank gets).
__device__ __forceinline__ const char* send_block(const ExchangeArgs& a, int i, int k) {
  const char* s = static_cast<const char*>(a.parts[i].send);
  return a.kind == Kind::kAllToAll ? s + static_cast<size_t>(k) * a.parts[i].bytes : s;
}
// Where rank k's block of part i lands in this rank's receive buffer.
__device__ __forceinline__ char* recv_block(const ExchangeArgs& a, int i, int k) {
  return static_cast<char*>(a.parts[i].recv) + static_cast<size_t>(k) * a.parts[i].bytes;
}

// The CTA's threads copy n bytes of an aligned run with V-sized loads and stores (4 in flight per thread).
template <typename V>
__device__ __forceinline__ void copy_run(char* __restrict__ dst, const char* __restrict__ src, size_t n) {
  V* d = reinterpret_cast<V*>(dst);
  const V* s = reinterpret_cast<const V*>(src);
  const size_t m = n / sizeof(V);
  size_t i = threadIdx.x;
  for (; i + 3 * kThreads < m; i += 4 * kThreads) {
    const V v0 = s[i], v1 = s[i + kThreads], v2 = s[i + 2 * kThreads], v3 = s[i + 3 * kThreads];
    d[i] = v0;
    d[i + kThreads] = v1;
    d[i + 2 * kThreads] = v2;
    d[i + 3 * kThreads] = v3;
  }
  for (; i < m; i += kThreads) d[i] = s[i];
}

// The CTA's threads copy n bytes: the widest access (16 or 4 bytes) that dst and src share an alignment for over
// the middle, single bytes over the ends (an all-to-all's blocks k * bytes apart are misaligned when bytes is).
__device__ void copy_bytes(char* __restrict__ dst, const char* __restrict__ src, size_t n) {
  const uintptr_t mis = reinterpret_cast<uintptr_t>(dst) ^ reinterpret_cast<uintptr_t>(src);
  const size_t width = (mis & 15) == 0 ? 16 : (mis & 3) == 0 ? 4 : 1;
  size_t head = (width - (reinterpret_cast<uintptr_t>(dst) & (width - 1))) & (width - 1);
  if (head > n) head = n;
  const size_t body = (n - head) / width * width;
  for (size_t i = threadIdx.x; i < head; i += kThreads) dst[i] = src[i];
  if (width == 16) {
    copy_run<uint4>(dst + head, src + head, body);
  } else if (width == 4) {
    copy_run<uint32_t>(dst + head, src + head, body);
  } else {
    copy_run<unsigned char>(dst + head, src + head, body);
  }
  for (size_t i = head + body + threadIdx.x; i < n; i += kThreads) dst[i] = src[i];
}


// Calls body(i, from, to) for each part i whose block overlaps the message range [lo, hi), with the overlap as
// byte offsets into the part's block.
template <typename Body>
__device__ __forceinline__ void for_pieces(const ExchangeArgs& a, const MessageLayout& m, size_t lo, size_t hi,
                                           Body body) {
  for (int i = 0; i < a.num_parts; ++i) {
    const size_t b0 = m.offset[i], b1 = b0 + a.parts[i].bytes;
    const size_t x0 = lo > b0 ? lo : b0, x1 = hi < b1 ? hi : b1;
    if (x0 < x1) body(i, x0 - b0, x1 - b0, x0);
  }
}

// 1. Put: CTA c stores its range of this rank's blocks into every peer's slot for this rank (and its own block
// into recv), then raises its flag in every peer's area. No waiting: CTAs that run alongside other kernels (a
// gather during the indexer) finish as soon as they are scheduled.
__global__ void __launch_bounds__(kThreads) peer_put_kernel(const ExchangeArgs a, const MessageLayout m) {
  const int c = blockIdx.x;
  const size_t lo = c * m.chunk, hi = min(m.total, lo + m.chunk);
  stamp(a, 0, false);
  __shared__ int dead;
  if (threadIdx.x == 0) dead = rank_failed(words_of(a));
  __syncthreads();
  if (dead) return;  // the whole CTA: no stores, no flags
  for (int k = 0; k < a.size; ++k) {
    char* slot = k == a.rank ? nullptr : slot_at(a, a.areas[k], a.rank);
    for_pieces(a, m, lo, hi, [&](int i, size_t from, size_t to, size_t at) {
      copy_bytes(k == a.rank ? recv_block(a, i, k) + from : slot + at, send_block(a, i, k) + from, to - from);
    });
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    // The CTA's stores above (ordered by the barrier) before the flags.
    __threadfence_system();
    for (int k = 0; k < a.size; ++k) {
      if (k != a.rank) st_release_sys(flag_at(a.areas[k], a.rank, c), a.seq);
    }
  }
  stamp(a, 0, true);
}

// 2. Wait: one CTA, a thread per (peer, CTA) flag, bounded by the timeout and the host's abort word. The only
// kernel of the exchange that waits, so a late peer holds one CTA's slot, not the put's or the unpack's.
__global__ void __launch_bounds__(kThreads) peer_wait_kernel(const ExchangeArgs a, int ctas) {
  char* own = a.areas[a.rank];
  const uint64_t t0 = global_timer_ns();
  stamp(a, 1, false);
  bool failed = false;
  for (int f = threadIdx.x; f < a.size * ctas && !failed; f += kThreads) {
    const int k = f / ctas, c = f % ctas;
    if (k == a.rank) continue;
    failed = !wait_flag(flag_at(own, k, c), a.seq, t0, a.timeout_ns, words_of(a), k);
  }
  __syncthreads();
  stamp(a, 1, true);
}

// 3. Unpack: the peers' blocks from this rank's slots into recv (after the wait, in stream order; after a failed
// wait it copies whatever the slots hold, and the collective reports the error).
__global__ void __launch_bounds__(kThreads) peer_unpack_kernel(const ExchangeArgs a, const MessageLayout m) {
  const int c = blockIdx.x;
  const size_t lo = c * m.chunk, hi = min(m.total, lo + m.chunk);
  stamp(a, 2, false);
  for (int k = 0; k < a.size; ++k) {
    if (k == a.rank) continue;
    const char* slot = slot_at(a, a.areas[a.rank], k);
    for_pieces(a, m, lo, hi, [&](int i, size_t from, size_t to, size_t at) {
      copy_bytes(recv_block(a, i, k) + from, slot + at, to - from);
    });
  }
  __syncthreads();
  stamp(a, 2, true);
}

// A window publish: thread 0 raises this rank's flag in every peer's window (after a system fence: the producer
// kernels' writes of the message came before, in stream order), then thread k waits for peer k's flag here,
// bounded as in peer_wait_kernel. One warp; nothing else waits.
__global__ void __launch_bounds__(32) window_publish_kernel(const WindowArgs a) {
  const PeerWords words = words_of(a);
  if (rank_failed(words)) {
    // A failed rank publishes nothing and waits for nobody; the host must not take this publish for a completed
    // one (the consumers after it would read buffers nobody published), so the error word says so.
    volatile int32_t* error = reinterpret_cast<volatile int32_t*>(a.error_word);
    if (threadIdx.x == 0 && *error == 0) {
      *error = -1;
      __threadfence_system();
    }
    return;
  }
  if (threadIdx.x == 0) {
    __threadfence_system();
    for (int k = 0; k < a.size; ++k) {
      if (k != a.rank) st_release_sys(reinterpret_cast<uint64_t*>(a.windows[k]) + a.rank, a.seq);
    }
  }
  const int k = threadIdx.x;
  if (k >= a.size || k == a.rank) return;
  const uint64_t* flag = reinterpret_cast<const uint64_t*>(a.windows[a.rank]) + k;
  (void)wait_flag(flag, a.seq, global_timer_ns(), a.timeout_ns, words, k);
}

size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

}  // namespace

size_t message_bytes(const Part* parts, int num_parts) {
  size_t total = 0;
  for (int i = 0; i < num_parts; ++i) total += align_up(parts[i].bytes);
  return total;
}

size_t window_region_bytes(size_t window_bytes) { return kWindowHeaderBytes + 2 * window_bytes; }

cudaError_t launch_window_publish(const WindowArgs& args, cudaStream_t stream) {
  if (args.size < 2 || args.size > kMaxRanks || args.rank < 0 || args.rank >= args.size) return cudaErrorInvalidValue;
  window_publish_kernel<<<1, 32, 0, stream>>>(args);
  return cudaGetLastError();
}

size_t area_bytes(int size, size_t slot_bytes) { return kFlagBytes + static_cast<size_t>(size) * 2 * slot_bytes; }

cudaError_t launch_exchange(const ExchangeArgs& args, cudaStream_t stream) {
  if (args.num_parts < 1 || args.num_parts > kMaxParts || args.size < 2 || args.size > kMaxRanks) {
    return cudaErrorInvalidValue;
  }
  MessageLayout m{};
  for (int i = 0; i < args.num_parts; ++i) {
    m.offset[i] = m.total;
    m.total += align_up(args.parts[i].bytes);
  }
  if (m.total == 0 || m.total > args.slot_bytes) return cudaErrorInvalidValue;
  const size_t ctas0 = std::min<size_t>(kMaxCtas, (m.total + kChunkTarget - 1) / kChunkTarget);
  m.chunk = align_up((m.total + ctas0 - 1) / ctas0);
  const unsigned ctas = static_cast<unsigned>((m.total + m.chunk - 1) / m.chunk);
  peer_put_kernel<<<ctas, kThreads, 0, stream>>>(args, m);
  peer_wait_kernel<<<1, kThreads, 0, stream>>>(args, static_cast<int>(ctas));
  peer_unpack_kernel<<<ctas, kThreads, 0, stream>>>(args, m);
  return cudaGetLastError();
}

}  // namespace dsacp::cuda::peer
