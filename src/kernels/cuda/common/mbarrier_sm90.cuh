// Shared-memory mbarriers (sm_90): init, arrive (release), cp.async-tracked arrive, and phase waits. A barrier
// completes a phase when its expected count of arrivals is reached; waiters name the phase by its parity
// (phase k of a barrier used once per loop iteration k: parity k & 1).
#pragma once

#include <cstdint>

namespace dsacp::cuda {

// One thread initializes; the block synchronizes (__syncthreads) before any other thread uses the barrier.
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Arrive with release semantics: this thread's earlier memory accesses happen before the phase completes.
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
// Arrive once every cp.async this thread issued so far has landed (counts as one of the expected arrivals:
// .noinc). The copies are generic-proxy writes: a reader through the async proxy (wgmma) fences after its wait.
__device__ __forceinline__ void cp_async_mbar_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Wait (acquire) until the phase of the given parity has completed; kCluster: with cluster scope, for a phase that
// threads of other CTAs arrive on too. The loop is warp-uniform (vote), so a wgmma issued after it does not see a
// divergent path.
template <bool kCluster = false>
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  if constexpr (kCluster) {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, "
        "0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } else {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
  return done != 0;
}
template <bool kCluster = false>
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!__all_sync(0xffffffffu, mbar_try_wait<kCluster>(bar, parity))) {
  }
}
__device__ __forceinline__ void mbar_wait_cluster(uint32_t bar, uint32_t parity) { mbar_wait<true>(bar, parity); }

// Arrive and add `bytes` to the transaction bytes this phase waits for (bulk copies complete them, in any order
// with this arrive: the count may go below zero meanwhile).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Cluster forms (a barrier that a peer CTA's threads arrive on through distributed shared memory). The init is
// made visible to the cluster by fence_mbarrier_init_cluster and a cluster barrier before any peer arrives.
__device__ __forceinline__ void fence_mbarrier_init_cluster() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Arrive on the barrier at `remote_bar`, a shared::cluster address (cluster_map), with the default semantics
// (release at CTA scope, as CUTLASS's ClusterBarrier::arrive): for a consumer that signals it is done reading its
// own slot (its reads complete, nothing it wrote for the peer to see); a cluster-scope release costs a
// MEMBAR.ALL.GPU + ERRBAR a thread (measured: 14% of a paired decode CTA's consumer stall samples at 256 a pair).
__device__ __forceinline__ void mbar_arrive_remote(uint32_t remote_bar) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote_bar) : "memory");
}
}  // namespace dsacp::cuda
