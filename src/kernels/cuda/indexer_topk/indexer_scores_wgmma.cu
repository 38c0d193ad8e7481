// FP8 lightning indexer scores on wgmma, persistent and warp-specialized (the fast path of launch_indexer_scores):
//   s(t, j) = sk[j] * sum_h (w[t,h] * q_scale[t,h]) * relu(q8[t,h,:] . k8[j,:])
// which is the contract's sum_h w * relu((q_scale * sk) * dot) for positive scales (a positive factor commutes
// with the ReLU; the contract's scales are positive and finite, and the cache write's are >= 2^-126).
//
// Work: the chunk's score items (a token group of <= 4 tokens of one request x 256 keys) cut into blocks of 64 keys;
// each CTA (one an SM) takes a contiguous run of whole items, and inside it math warpgroup c takes items c, c + kMW,
// ... (a static split: no atomics, bit-identical reruns). A CTA = 1 + kMW warpgroups (kMW = 3 or 2); math warpgroup
// c (warpgroup 1 + c) has its own producer warp (warp c of warpgroup 0) and ring of stages
// (indexer_scores_wgmma.cuh: the producers resolve their items a batch of 32 ahead and fill a stage by bulk
// copies of a block's rows and scales; a stage's full barrier completes when its record and bytes are in).
// The math warpgroup: each thread loads its two key rows' 32-byte slices from the stage and converts them to f16
// (exact) in registers: the wgmma's A operand (64 keys x 128). D[64 keys, N] = K x Q^T, N = Hi x the group's tokens
// (wgmma m64nNk16 f16 with A from registers, f32 accumulate, in passes of <= 128 columns: the e4m3 wgmma keeps too
// few bits in its sums, wgmma_f16_sm90.cuh): each key is read once for every token of its group. The columns of a
// k-step are a fixed permutation of the row's bytes; Q in shared memory is stored permuted the same way, so the
// dot products are unchanged. The sum over heads is within the thread then over its quad in a fixed fp32 order
// (v5: the columns ascending, then xor 1, 2; v6: 4-deep partial sums and a reduce-scatter), so reruns are
// bit-identical; v5 and v6 differ in rounding only (both within the contract's tolerance of the CPU oracle).
// Two math loops: v5 (one accumulator set: wgmma, wait, epilogue, a serial chain a block;
// docs/design/2026-12-02-persistent-score-kernel.md) and v6 (two sets: a unit's wgmma runs while the previous
// unit's epilogue and the next stage's loads run; docs/design/2026-12-03-score-kernel-v6.md). v7, the default, is
// v6's loop with the stage 128B-swizzled by tensor copies (page sizes % 64 == 0), the e4m3 halves converted without
// shifts and v5's epilogue order at one token a pass (docs/design/2026-12-03-score-kernel-v7.md).
// Only visible keys (j < key_len[t]) are written, into token t's row at score_offset[t]: the same output as the
// mma.sync kernel (indexer_scores_mma.cu), which serves the layouts this one does not (bf16, page sizes that are
// not multiples of 4: key rows then are not 16-byte aligned).
#include <cuda_runtime.h>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/smem_attribute.h"
#include "kernels/cuda/indexer_topk/indexer_kernels.h"
#include "kernels/cuda/indexer_topk/indexer_scores_wgmma.cuh"

namespace dsacp::cuda {
namespace {
using namespace score_wg;

// ReLU as max.NaN(x, 0): one instruction; NaN stays NaN (contract section 7). It gives +0 where relu() gives -0
// for x = -0, which no score can see: every sum starts at +0, and +0 + (-0) = +0.
__device__ __forceinline__ float relu_nan(float x) {
  float y;
  asm("max.NaN.f32 %0, %1, 0f00000000;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---- v6's math loop: two accumulator sets, a unit's wgmma in flight during the previous unit's epilogue ----
// A unit = (block, pass of <= 128 columns). A step issues the next unit into one set and then finishes the
// pending unit from the other set (wait until one group is left, epilogue), so the tensor pipe works on unit u + 1
// while the warpgroup reduces unit u, loads block u + 2's stage and converts it. The A fragments are one set: a new
// block's stage is loaded first (raw e4m3 words), converted once the pending unit's wgmma (the last reader of the
// fragments) is done.
struct Unit {
  int32_t kb = 0;
  float sk0 = 0.f, sk1 = 0.f;
  int pass = 0;
};
template <int kPN, bool kHoist, int kNP>
struct V6State {
  RingPos pos;
  GroupView gv;
  int np = 1;          // the group's passes with tokens
  Unit cur, pend;      // the block whose fragments are live (its last issued pass), the unit in flight
  bool has_pend = false, more = false;  // more: cur has a pass still to issue
  uint32_t af[8][4];
  float wr[kHoist ? kPN / 4 : 1];  // w * q_scale of the thread's columns (kHoist: kept in registers)
  int32_t my_len[kNP];             // per pass: key_len of the lane's token (lane_token; 0 if absent)
  float* my_row[kNP];              // and its score row
};

// The quad's sums of a unit are reduced and split at once (a reduce-scatter over lanes tq = 0..3, two xor
// rounds): each round sends the half of the values the partner keeps. Lane tq ends with: one token and both rows
// (4 tokens a pass: token tq), one token and one row (2 tokens: token tq / 2, row tq % 2), or one row of the
// pass's token (1 token: row tq / 2, lanes with even tq store it).
template <int kPT>
__device__ __forceinline__ int lane_token(int tq) {
  return kPT == 1 ? 0 : kPT == 2 ? tq >> 1 : tq;
}
template <int kN>
__device__ __forceinline__ void quad_split(float (&v)[kN], float (&out)[kN / 2], int mask, bool high) {
#pragma unroll
  for (int j = 0; j < kN / 2; ++j) {
    const float keep = high ? v[kN / 2 + j] : v[j], send = high ? v[j] : v[kN / 2 + j];
    out[j] = keep + __shfl_xor_sync(0xffffffffu, send, mask);
  }
}

// Unit u's epilogue: for each token of its pass and each of the thread's two rows, s = sk * sum_h (w * q_scale) *
// relu(dot): the thread's columns in ascending order dealt round-robin to kP partial sums (chains of 4), added as a
// tree, then the quad's reduce-scatter; a fixed fp32 order, so reruns are bit-identical. Tokens the group lacks are
// computed and not stored (their key_len is 0).
template <int kHi, int kPN, bool kHoist, int kNP>
__device__ __forceinline__ void epilogue_v6(float (&acc)[kPN / 2], const Unit& u, const V6State<kPN, kHoist, kNP>& s,
                                            const float* sWq, int tq, int row0) {
  constexpr int kPT = kPN / kHi, kT = kHi / 4, kP = kT / 4;  // kT terms a (token, row), kP partial sums
#pragma unroll
  for (int i = 0; i < kPN / 2; ++i) reg_fence(acc[i]);
  float v[2 * kPT];  // [token][row]
#pragma unroll
  for (int pt = 0; pt < kPT; ++pt) {
    float part[2][kP];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int j = 0; j < kP; ++j) part[r][j] = 0.f;
    }
#pragma unroll
    for (int ii = 0; ii < kHi / 8; ++ii) {
      const int i = pt * (kHi / 8) + ii;  // the pass's column group
      float2 wv;
      if constexpr (kHoist) {
        wv = make_float2(s.wr[2 * i], s.wr[2 * i + 1]);
      } else {
        wv = *reinterpret_cast<const float2*>(sWq + u.pass * kPN + 8 * i + 2 * tq);
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float& p0 = part[r][(2 * ii) % kP];
        p0 = fmaf(wv.x, relu_nan(acc[4 * i + 2 * r]), p0);
        float& p1 = part[r][(2 * ii + 1) % kP];
        p1 = fmaf(wv.y, relu_nan(acc[4 * i + 2 * r + 1]), p1);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      v[2 * pt + r] = kP == 4 ? (part[r][0] + part[r][1]) + (part[r][2] + part[r][3]) : part[r][0] + part[r][1];
    }
  }
  const int32_t len = kNP > 1 && u.pass ? s.my_len[kNP - 1] : s.my_len[0];
  float* row = kNP > 1 && u.pass ? s.my_row[kNP - 1] : s.my_row[0];
  const int32_t k0 = u.kb + row0, k1 = k0 + 8;
  if constexpr (kPT == 1) {
    float h[1];
    quad_split<2>(v, h, 2, tq & 2);
    const float t = h[0] + __shfl_xor_sync(0xffffffffu, h[0], 1);
    const int32_t k = tq & 2 ? k1 : k0;
    if ((tq & 1) == 0 && k < len) row[k] = (tq & 2 ? u.sk1 : u.sk0) * t;
  } else if constexpr (kPT == 2) {
    float h[2], q[1];
    quad_split<4>(v, h, 2, tq & 2);
    quad_split<2>(h, q, 1, tq & 1);
    const int32_t k = tq & 1 ? k1 : k0;
    if (k < len) row[k] = (tq & 1 ? u.sk1 : u.sk0) * q[0];
  } else {
    static_assert(kPT == 4, "1, 2 or 4 tokens a pass");
    float h[4], q[2];
    quad_split<8>(v, h, 2, tq & 2);
    quad_split<4>(h, q, 1, tq & 1);
    if (k0 < len) row[k0] = u.sk0 * q[0];
    if (k1 < len) row[k1] = u.sk1 * q[1];
  }
}

// v7 at one token a pass, v5's order: per row one chain over the thread's columns ascending, then xor 1, 2 over
// the quad (4 shuffles against the reduce-scatter's 2, but no tree adds and no selects: 2.5% faster at one token a
// pass in the first v6 build, docs/design/2026-12-03-score-kernel-v6.md). Lane tq = 0 stores both rows.
template <int kHi, int kPN, bool kHoist, int kNP>
__device__ __forceinline__ void epilogue_chain(float (&acc)[kPN / 2], const Unit& u,
                                               const V6State<kPN, kHoist, kNP>& s, const float* sWq, int tq,
                                               int row0) {
  static_assert(kPN == kHi && kNP == 1, "one token a pass");
#pragma unroll
  for (int i = 0; i < kPN / 2; ++i) reg_fence(acc[i]);
  float s0 = 0.f, s1 = 0.f;
#pragma unroll
  for (int i = 0; i < kHi / 8; ++i) {
    float2 wv;
    if constexpr (kHoist) {
      wv = make_float2(s.wr[2 * i], s.wr[2 * i + 1]);
    } else {
      wv = *reinterpret_cast<const float2*>(sWq + 8 * i + 2 * tq);
    }
    s0 = fmaf(wv.x, relu_nan(acc[4 * i]), s0);
    s0 = fmaf(wv.y, relu_nan(acc[4 * i + 1]), s0);
    s1 = fmaf(wv.x, relu_nan(acc[4 * i + 2]), s1);
    s1 = fmaf(wv.y, relu_nan(acc[4 * i + 3]), s1);
  }
  s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
  s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
  s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
  s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
  if (tq == 0) {
    const int32_t len = s.my_len[0], k0 = u.kb + row0, k1 = k0 + 8;
    float* row = s.my_row[0];
    if (k0 < len) row[k0] = u.sk0 * s0;
    if (k1 < len) row[k1] = u.sk1 * s1;
  }
}

// v6 / v7 flags: kFlTma = the stage 128B-swizzled by a tensor copy (v7, page sizes that are multiples of 64; else
// bulk copies, unswizzled); kFlChain = the chain epilogue at one token a pass (v7).
constexpr int kFlTma = 1, kFlChain = 2;

template <int kHi, int kPN, bool kHoist, int kNP, int kVer, int kFl>
__device__ __forceinline__ void epilogue_any(float (&acc)[kPN / 2], const Unit& u,
                                             const V6State<kPN, kHoist, kNP>& s, const float* sWq, int tq, int row0) {
  if constexpr (kVer == 7 && (kFl & kFlChain) && kPN == kHi) {
    epilogue_chain<kHi, kPN, kHoist, kNP>(acc, u, s, sWq, tq, row0);
  } else {
    epilogue_v6<kHi, kPN, kHoist, kNP>(acc, u, s, sWq, tq, row0);
  }
}

// A math warpgroup starts group (t0, nt): its tokens' key lengths and score rows (per pass: the lane's token),
// loaded before load_group_q's first barrier so that all of the group's loads share one round trip; then Q and
// w * q_scale (hoisted into registers where they fit).
template <int kHi, int kNT, int kPN, bool kHoist>
__device__ __forceinline__ void enter_group(V6State<kPN, kHoist, kHi * kNT / kPN>& s, const WgArgs& a, int32_t t0,
                                            int32_t nt, uint32_t sQ, float* sWq, int bar, int wt) {
  constexpr int kN = kHi * kNT, kPT = kPN / kHi, kNP = kN / kPN;
  const int tq = wt & 3;
  s.np = min(kNP, (nt + kPT - 1) / kPT);
#pragma unroll
  for (int p = 0; p < kNP; ++p) {
    const int tok = p * kPT + lane_token<kPT>(tq);
    s.my_len[p] = tok < nt ? __ldg(a.key_len + t0 + tok) : 0;
    s.my_row[p] = a.scores + (tok < nt ? plan_score_offset(a.inl, a.score_offset, t0 + tok) : 0);
  }
  load_group_q<kHi, kN>(a, t0, nt, sQ, sWq, bar, wt, s.gv);
  if constexpr (kHoist) {
#pragma unroll
    for (int i = 0; i < kPN / 8; ++i) {
      s.wr[2 * i] = sWq[8 * i + 2 * tq];
      s.wr[2 * i + 1] = sWq[8 * i + 2 * tq + 1];
    }
  }
}

// One step: issue the next unit into `an`, finish the pending one (in `ao`). False at the ring's end marker (the
// pending unit finished).
template <int kHi, int kNT, int kPN, bool kHoist, int kVer, int kFl>
__device__ __forceinline__ bool step_v6(float (&an)[kPN / 2], float (&ao)[kPN / 2],
                                        V6State<kPN, kHoist, kHi * kNT / kPN>& s, const WgArgs& a, const Ring& ring,
                                        uint32_t sQ, float* sWq, int bar, int wt) {
  constexpr int kN = kHi * kNT, kPT = kPN / kHi, kNP = kN / kPN;
  const int lane = wt & 31, g = lane >> 2, tq = lane & 3, row0 = (wt >> 5) * 16 + g;
  int pass = 0;
  if (kNP > 1 && s.more) {
    pass = s.cur.pass + 1;  // the live block's next pass (same fragments)
  } else {
    const int slot = s.pos.slot;
    mbar_wait(ring.full + 8 * slot, s.pos.phase);
    const int4 info = ring.info[slot];
    if (info.z < 0 || info.x != s.gv.t0) {
      // the end, or another group: finish the pending unit (it reads the old Q, w and rows)
      wgmma_wait<0>();
      if (s.has_pend) epilogue_any<kHi, kPN, kHoist, kNP, kVer, kFl>(ao, s.pend, s, sWq, tq, row0);
      s.has_pend = false;
      if (info.z < 0) return false;
      enter_group<kHi, kNT, kPN, kHoist>(s, a, info.x, info.y, sQ, sWq, bar, wt);
    }
    constexpr bool kSw = kVer == 7 && (kFl & kFlTma);
    const RawRows rr = kSw ? load_rows_sw(ring.stage + slot * kStageBytes, row0, g, tq)
                           : load_rows(ring.stage + slot * kStageBytes, row0, g, tq);
    s.cur.sk0 = ring.scale[slot * kBK + row0];
    s.cur.sk1 = ring.scale[slot * kBK + row0 + 8];
    s.cur.kb = info.z;
    wgmma_wait<0>();  // the pending unit's wgmma, the fragments' last reader, is done
    if constexpr (kSw) {
      rows_to_f16_sw(rr, s.af);
    } else if constexpr (kVer == 7) {
      rows_to_f16_fast(rr, g, s.af);
    } else {
      rows_to_f16(rr, g, s.af);
    }
    // the stage is read (its words in af, its scales in cur): release it to the producer
    mbar_arrive(ring.empty + 8 * slot);
    s.pos.next(ring.S);
  }
  s.cur.pass = pass;
  s.more = pass + 1 < s.np;
  // D = K [64 keys, 128] x Q^T [128, kPN] of this pass: 8 k-steps of 16 columns (slab ks / 4, 32 bytes each within it)
  wgmma_fence();
  const uint64_t db = wgmma_desc_sw128(sQ + pass * kPN * 128, 16, 1024);
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
    const uint32_t kq = (ks >> 2) * kN * 128 + (ks & 3) * 32;
    wgmma_m64k16_f16_rs<kPN>(an, s.af[ks], db + (kq >> 4), ks > 0 ? 1 : 0);
  }
  wgmma_commit();
  wgmma_wait<1>();  // the pending unit (the group before this one) is done
  if (s.has_pend) epilogue_any<kHi, kPN, kHoist, kNP, kVer, kFl>(ao, s.pend, s, sWq, tq, row0);
  s.pend = s.cur;
  s.has_pend = true;
  return true;
}

template <int kHi, int kNT, int kMW, int kVer, int kFl>
__device__ __forceinline__ void math_v6(const WgArgs& a, const Ring& ring, uint32_t sQ, float* sWq, int bar,
                                        int wt, int64_t first_item) {
  constexpr int kN = kHi * kNT, kPN = kN < kPassN ? kN : kPassN;
  // w * q_scale in registers where they fit: N <= 32, or N = 64 with 2 math warpgroups (3 x 144 registers do not
  // hold them next to two accumulator sets and the fragments)
  constexpr bool kHoist = kPN <= 32 || (kPN <= 64 && kMW == 2);
  V6State<kPN, kHoist, kN / kPN> s;
  // the first group's Q straight from the plan, while the producer brings the first stages
  if (first_item >= 0) {
    const ScoreItem x = plan_item(a.inl, a.items, first_item);
    enter_group<kHi, kNT, kPN, kHoist>(s, a, x.t0, x.nt, sQ, sWq, bar, wt);
  }
  float acc0[kPN / 2], acc1[kPN / 2];
  for (;;) {
    if (!step_v6<kHi, kNT, kPN, kHoist, kVer, kFl>(acc0, acc1, s, a, ring, sQ, sWq, bar, wt)) break;
    if (!step_v6<kHi, kNT, kPN, kHoist, kVer, kFl>(acc1, acc0, s, a, ring, sQ, sWq, bar, wt)) break;
  }
}

// Registers a thread after setmaxnreg (v6): the producer warpgroup gives registers to the math warpgroups (two
// accumulator sets: N = 128 takes ~200). 512 threads: 80 + 3 x 144 <= 4 x 128; 384: 72 + 2 x 216 = 3 x 168. The
// producer spilled at 56 / 40 (ptxas -v); at 3 x 144 the math spills one 8-byte value (a store a block, no wait).
template <int kMW>
constexpr int kProducerRegs = kMW == 3 ? 80 : 72;
template <int kMW>
constexpr int kMathRegs = kMW == 3 ? 144 : 216;

// The kernel body: kVer 5 (math_v5), 6 or 7 (math_v6; kFl: v7's flags); the producers and the layout are the
// same. A kernel name each version, so a profiler can pick either.
template <int kHi, int kNT, int kMW, int kVer, int kFl>
__device__ __forceinline__ void wgmma_scores_body(const WgArgs& a) {
  static_assert(kMW == 2 || kMW == 3, "2 or 3 math warpgroups");
  constexpr int kN = kHi * kNT;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  const int S = a.stages, ST = kMW * S;  // a ring's stages, all stages
  const Layout<kN, kMW> L{ST};
  const uint32_t bars = base + L.bar_off();

  const int tid = threadIdx.x, wg = tid >> 7;
  if (tid < 2 * ST) mbar_init(bars + 8 * tid, tid < ST ? 1 : 128);
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  __syncthreads();

  // this CTA's items [i0, i1): whole items, split evenly; warpgroup c's: i0 + c + kMW n, n < nc
  const int64_t i0 = a.num_items * blockIdx.x / gridDim.x, i1 = a.num_items * (blockIdx.x + 1) / gridDim.x;
  const int c = wg == 0 ? tid >> 5 : wg - 1;
  const int64_t nc = i1 - i0 > c ? (i1 - i0 - c + kMW - 1) / kMW : 0;
  const Ring ring{base + c * S * kStageBytes, reinterpret_cast<float*>(smem + L.scale_off()) + c * S * kBK,
                  reinterpret_cast<int4*>(smem + L.info_off()) + c * S, bars + 8 * c * S, bars + 8 * (ST + c * S), S};

  if (wg == 0) {
    // ==== producers: warp c feeds math warpgroup c (the other warps of the warpgroup have nothing to do) ====
    if constexpr (kVer >= 6) setmaxnreg_dec<kProducerRegs<kMW>>();
    if (c >= kMW) return;
    const int lane = tid & 31;
    RingPos pos;
    if constexpr ((kFl & kFlTma) != 0) {
      produce_paged64<kHi, true>(a, ring, pos, lane, i0 + c, kMW, nc);  // (launched only at page sizes % 64 == 0)
    } else if (a.page_size % kBK == 0) {
      produce_paged64<kHi, false>(a, ring, pos, lane, i0 + c, kMW, nc);
    } else {
      produce_segments<kHi>(a, ring, pos, lane, i0 + c, kMW, nc);
    }
    // the end marker
    begin_stage(ring, pos, lane, make_int4(-1, 0, -1, 0), 0);
    return;
  }

  // ==== math warpgroups ====
  const uint32_t sQ = base + L.q_off() + c * 2 * kN * 128;  // f16 Q, permuted [2 slabs][N x 128 B]
  float* sWq = reinterpret_cast<float*>(smem + L.wq_off()) + c * kN;
  if constexpr (kVer >= 6) {
    setmaxnreg_inc<kMathRegs<kMW>>();
    math_v6<kHi, kNT, kMW, kVer, kFl>(a, ring, sQ, sWq, 1 + c, tid & 127, nc > 0 ? i0 + c : -1);
  } else {
    math_v5<kHi, kNT>(a, ring, sQ, sWq, 1 + c, tid & 127);
  }
}

template <int kHi, int kNT, int kMW>
__global__ void __launch_bounds__(128 * (1 + kMW), 1) indexer_scores_wgmma_kernel(const __grid_constant__ WgArgs a) {
  wgmma_scores_body<kHi, kNT, kMW, 5, 0>(a);
}
template <int kHi, int kNT, int kMW>
__global__ void __launch_bounds__(128 * (1 + kMW), 1) indexer_scores_wgmma6_kernel(const __grid_constant__ WgArgs a) {
  wgmma_scores_body<kHi, kNT, kMW, 6, 0>(a);
}
template <int kHi, int kNT, int kMW, int kFl>
__global__ void __launch_bounds__(128 * (1 + kMW), 1) indexer_scores_wgmma7_kernel(const __grid_constant__ WgArgs a) {
  wgmma_scores_body<kHi, kNT, kMW, 7, kFl>(a);
}

// v7's key tensor map: the pool's row planes as [num_pages][page_size rows][128 B] (page stride page_size x 132 B:
// the two-plane page), boxes of 64 rows of one page, 128B swizzle. cuTensorMapEncodeTiled through the runtime's
// driver entry point (no link to libcuda). False where it is unavailable or refuses the shape.
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
EncodeTiledFn encode_tiled_fn() {
  static const EncodeTiledFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      return static_cast<EncodeTiledFn>(nullptr);
    }
    return reinterpret_cast<EncodeTiledFn>(f);
  }();
  return fn;
}
bool make_key_tensor_map(CUtensorMap* map, void* keys, int64_t num_pages, int32_t page_size, int64_t page_stride) {
  const EncodeTiledFn fn = encode_tiled_fn();
  if (fn == nullptr || num_pages < 1 || num_pages > (int64_t{1} << 31) || page_size % kBK != 0) return false;
  const cuuint64_t dims[3] = {kDi, static_cast<cuuint64_t>(page_size), static_cast<cuuint64_t>(num_pages)};
  const cuuint64_t strides[2] = {kDi, static_cast<cuuint64_t>(page_stride)};
  const cuuint32_t box[3] = {kDi, kBK, 1}, estr[3] = {1, 1, 1};
  return fn(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, keys, dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Math warpgroups a CTA for N = kN columns (heads x group tokens), by version.
// v5 (docs/design/2026-12-02-persistent-score-kernel.md): 3 where N <= 64 (12-18% faster than 2 at next_n 1; a 4th
// changed nothing), else 2 (N = 128 / 256 take 144-160 registers a thread: 512 threads allow 128).
// v6 (docs/design/2026-12-03-score-kernel-v6.md): the same split (N <= 64: 3 x 144 registers; else 2 x 216); 2 at
// N <= 64 (the variant the bench times) was 1-3% slower at 32K..128K, Hi 64 and 32.
template <int kN>
constexpr int kMathWarpgroups = kN <= 64 ? 3 : 2;

template <int kHi, int kNT, int kMW, int kVer, int kFl = 0>
Status launch_wg(WgArgs& a, const LaunchContext& ctx) {
  constexpr int kN = kHi * kNT;
  static_assert(kMaxStages % kMW == 0, "whole rings");
  int device = 0, optin = 0;
  DSACP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  DSACP_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  Layout<kN, kMW> L{kMaxStages};
  while (L.stages > 2 * kMW && L.bytes() > optin) L.stages -= kMW;
  a.stages = L.stages / kMW;
  const int bytes = L.bytes();
  auto* kernel = kVer == 7   ? indexer_scores_wgmma7_kernel<kHi, kNT, kMW, kFl>
                 : kVer == 6 ? indexer_scores_wgmma6_kernel<kHi, kNT, kMW>
                             : indexer_scores_wgmma_kernel<kHi, kNT, kMW>;
  DSACP_CUDA_RETURN_IF_ERROR(ensure_dynamic_smem_limit(reinterpret_cast<const void*>(kernel), bytes));
  const int grid = static_cast<int>(std::min<int64_t>(std::max(ctx.num_sms, 1), a.num_items));
  kernel<<<grid, 128 * (1 + kMW), bytes, ctx.stream>>>(a);
  DSACP_CUDA_RETURN_IF_LAUNCH_ERROR("indexer_scores_wgmma_kernel");
  return Status::ok_status();
}

// The (Hi, group tokens) instance of a version and math-warpgroup count (0: the rule).
template <int kHi, int kNT>
Status launch_wg_variant(WgArgs& a, const LaunchContext& ctx, const ScoreWgmmaVariant& v, bool tma) {
  constexpr int kN = kHi * kNT, kMW = kMathWarpgroups<kN>;
  if (v.version == 5) return launch_wg<kHi, kNT, kMW, 5>(a, ctx);
  if (v.version == 7) {
    // the chain epilogue at one token a pass unless told otherwise (epilogue 1: the reduce-scatter)
    const bool chain = v.epilogue != 1;
    if (tma) {
      return chain ? launch_wg<kHi, kNT, kMW, 7, kFlTma | kFlChain>(a, ctx)
                   : launch_wg<kHi, kNT, kMW, 7, kFlTma>(a, ctx);
    }
    return chain ? launch_wg<kHi, kNT, kMW, 7, kFlChain>(a, ctx) : launch_wg<kHi, kNT, kMW, 7, 0>(a, ctx);
  }
  if constexpr (kN <= 64) {
    if (v.math_warpgroups == 2) return launch_wg<kHi, kNT, 2, 6>(a, ctx);
  }
  return launch_wg<kHi, kNT, kMathWarpgroups<kN>, 6>(a, ctx);
}

}  // namespace

bool indexer_scores_wgmma_applies(const IndexerTopkParams& p, int max_group_tokens) {
  return p.keys.dtype == DType::kF8E4M3 && p.q_dtype == DType::kF8E4M3 && (p.Hi == 32 || p.Hi == 64) &&
         p.Di == kDi && p.keys.page_size % 4 == 0 && reinterpret_cast<uintptr_t>(p.keys.data) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(p.q) % 16 == 0 && max_group_tokens >= 1 && max_group_tokens <= kMaxGroupTokens;
}

// The measured rule (dsacp_bench_gpu, one H200, b = 64, 32K..128K; docs/design/2026-12-02-persistent-score-kernel.md,
// 2026-12-03-score-kernel-v6.md, -v7.md): this kernel wherever it applies (v6: 1.9-2.3x faster than the mma.sync
// kernel at next_n 1, 2.2-2.9x at next_n 2..4, 1.7x at prefill; v7 2.0-2.8x).
bool indexer_scores_wgmma_preferred(const IndexerTopkParams& p, int max_group_tokens) {
  (void)p;
  return max_group_tokens >= 1;
}

Status launch_indexer_scores_wgmma(const IndexerTopkParams& p, const ScoreItem* items, int64_t num_items,
                                   int max_group_tokens, const int64_t* score_offset, float* scores,
                                   const InlinePlan& inl, const LaunchContext& ctx, const ScoreWgmmaVariant& v) {
  if (num_items == 0) return Status::ok_status();
  WgArgs a{};
  fill_score_kernel_args(a, p, items, num_items, score_offset, scores, inl, ctx);
  // v7's swizzled stage: page sizes that are multiples of 64 and a tensor map (else v7 with bulk copies)
  const bool tma = v.version == 7 && v.tma_stage && p.keys.page_size % kBK == 0 &&
                   make_key_tensor_map(&a.kmap, p.keys.data, p.keys.num_pages, p.keys.page_size, a.page_stride);
  const int nt = max_group_tokens <= 1 ? 1 : max_group_tokens <= 2 ? 2 : 4;
  if (p.Hi == 32) {
    return nt == 1   ? launch_wg_variant<32, 1>(a, ctx, v, tma)
           : nt == 2 ? launch_wg_variant<32, 2>(a, ctx, v, tma)
                     : launch_wg_variant<32, 4>(a, ctx, v, tma);
  }
  return nt == 1 ? launch_wg_variant<64, 1>(a, ctx, v, tma)
         : nt == 2 ? launch_wg_variant<64, 2>(a, ctx, v, tma)
                   : launch_wg_variant<64, 4>(a, ctx, v, tma);
}

Status launch_indexer_scores_wgmma(const IndexerTopkParams& p, const ScoreItem* items, int64_t num_items,
                                   int max_group_tokens, const int64_t* score_offset, float* scores,
                                   const InlinePlan& inl, const LaunchContext& ctx) {
  ScoreWgmmaVariant v;  // v7, the default
  if (ctx.options.indexer_score_kernel == CudaBackendOptions::IndexerScoreKernel::kWgmmaV5) v.version = 5;
  if (ctx.options.indexer_score_kernel == CudaBackendOptions::IndexerScoreKernel::kWgmmaV6) v.version = 6;
  return launch_indexer_scores_wgmma(p, items, num_items, max_group_tokens, score_offset, scores, inl, ctx, v);
}

}  // namespace dsacp::cuda
