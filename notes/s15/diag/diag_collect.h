// DIAGNOSTIC ONLY (session 15, never committed to bench): per-step %globaltimer stamps of the cache write, the
// top-k and the decode MLA kernels, summarized per rank and across ranks.
#pragma once
#include <time.h>
#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <vector>
#include <cuda_runtime.h>
extern "C" int dsacp_diag_dump_topk(unsigned long long*);
extern "C" int dsacp_diag_dump_mla(unsigned long long*);
extern "C" int dsacp_diag_dump_cw(unsigned long long*);
extern "C" int dsacp_diag_dump_scores(unsigned long long*);
extern "C" long long dsacp_diag_offset();
namespace diagc {
constexpr int kR = 256, kS = 16;
struct Acc { double sum = 0, mn = 1e30, mx = -1e30; int n = 0;
  void add(double v) { sum += v; mn = std::min(mn, v); mx = std::max(mx, v); ++n; } };
inline std::mutex mu;
inline std::map<std::string, Acc> acc;
inline std::map<int, std::map<std::string, double>> abs_last;  // per rank: absolute stamps of this step
inline unsigned long long host_ns() { timespec ts; clock_gettime(CLOCK_REALTIME, &ts); return ts.tv_sec * 1000000000ull + ts.tv_nsec; }
inline void add(const std::string& k, double v) { acc[k].add(v); }
// rows: decode rows; device: the rank's GPU (current device set by the caller's thread).
inline void collect(const std::string& label, int rank, int device, int rows, unsigned long long host_t0, bool cp,
                    unsigned long long host_t1 = 0) {
  cudaSetDevice(device);
  const long long offset = dsacp_diag_offset();
  std::vector<unsigned long long> tk(kR * kS), ml(kR * kS), cw(kR * kS), sc(kR * kS);
  dsacp_diag_dump_scores(sc.data());
  dsacp_diag_dump_topk(tk.data()); dsacp_diag_dump_mla(ml.data()); dsacp_diag_dump_cw(cw.data());
  const double base = static_cast<double>(cw[0]);
  auto us = [&](unsigned long long v) { return (static_cast<double>(v) - base) / 1000.0; };
  auto S = [&](std::vector<unsigned long long>& a, int s, int r) { return a[s * kR + r]; };
  double tk0 = 1e30, tk1max = -1e30, tk1sum = 0, w = 0, wmax = 0, mg = 0, mgmax = 0, tkE = -1e30;
  for (int r = 0; r < rows; ++r) {
    tk0 = std::min(tk0, us(S(tk, 0, r)));
    tk1max = std::max(tk1max, us(S(tk, 1, r))); tk1sum += us(S(tk, 1, r));
    tkE = std::max(tkE, us(S(tk, 3, r)));
    if (cp) { const double ww = (double(S(tk, 2, r)) - double(S(tk, 1, r))) / 1000.0; w += ww; wmax = std::max(wmax, ww);
      const double m = (double(S(tk, 3, r)) - double(S(tk, 2, r))) / 1000.0; mg += m; mgmax = std::max(mgmax, m); }
  }
  double m0 = 1e30, m0max = -1e30, mc = -1e30, mE = -1e30, pst = 0, pstmax = 0, ow = 0, owmax = 0, om = 0;
  int np = 0, no = 0;
  for (int r = 0; r < rows * 2; ++r) {
    m0 = std::min(m0, us(S(ml, 0, r))); m0max = std::max(m0max, us(S(ml, 0, r)));
    if (!cp) continue;
    mc = std::max(mc, us(S(ml, 1, r)));
    const int k = r % 2;
    const double d = (double(S(ml, 2, r)) - double(S(ml, 1, r))) / 1000.0;
    if (k != rank) { pst += d; pstmax = std::max(pstmax, d); ++np; }
    else { ow += d; owmax = std::max(owmax, d); ++no; om += (double(S(ml, 3, r)) - double(S(ml, 2, r))) / 1000.0;
      mE = std::max(mE, us(S(ml, 3, r))); }
  }
  std::lock_guard<std::mutex> lock(mu);
  const std::string p = label + " r" + std::to_string(rank) + " ";
  if (cp) {  // merge_small_row's phases (top-k TU, slots 8..): [row * 16 + phase]
    const unsigned long long* ms = tk.data() + 8 * kR;
    double ph[7] = {0}, worst = 0, passes = 0; int worst_r = 0;
    for (int r = 0; r < rows; ++r) {
      const unsigned long long* x = ms + r * 16;
      for (int q = 1; q <= 6; ++q) {
        const int prev = q == 4 ? 3 : q - 1;
        ph[q] += (double(x[q]) - double(x[prev])) / 1000.0 / rows;
      }
      for (int q = 8; q < 16; ++q) passes += (x[q] > x[3] && x[q] <= x[4]) ? 1.0 / rows : 0.0;
      const double tot = (double(x[6]) - double(x[1])) / 1000.0;
      if (tot > worst) worst = tot, worst_r = r;
    }
    add(p + "merge phase: wait", ph[1]); add(p + "merge phase: loads", ph[2]); add(p + "merge phase: keys+minmax", ph[3]);
    add(p + "merge phase: radix select", ph[4]); add(p + "merge phase: compaction", ph[5]); add(p + "merge phase: out", ph[6]);
    add(p + "merge radix passes", passes); add(p + "merge slowest row (after wait)", worst);
    (void)worst_r;
  }
  add(p + "host t0 -> cw start", (base - double(host_t0) - double(offset)) / 1000.0);
  {
    double mend = -1e30;
    for (int r = 0; r < rows * 2; ++r) mend = std::max(mend, us(S(ml, 7, r)));
    add(p + "mla end (kernel's last CTA)", mend);
    if (host_t1) add(p + "mla end -> host step end", (double(host_t1) + double(offset) - base) / 1000.0 - mend);
  }
  add(p + "cw start -> first topk CTA (scores)", tk0);
  add(p + "cw start -> scores CTA 0 start", us(sc[0]));
  add(p + "scores CTA 0 start -> first topk CTA", tk0 - us(sc[0]));
  add(p + "local topk done mean", tk1sum / rows);
  add(p + "local topk done max", tk1max);
  if (cp) {
    add(p + "merge wait mean", w / rows); add(p + "merge wait max", wmax);
    add(p + "merge mean", mg / rows); add(p + "merge max", mgmax);
  }
  add(p + "topk end max", tkE);
  add(p + "mla first start", m0); add(p + "mla last start", m0max);
  if (cp) {
    add(p + "mla compute done max", mc);
    add(p + "mla peer-block store+signal mean", np ? pst / np : 0); add(p + "mla peer-block store max", pstmax);
    add(p + "mla own-block wait mean", no ? ow / no : 0); add(p + "mla own-block wait max", owmax);
    add(p + "mla own-block merge mean", no ? om / no : 0);
    double wts = 0, rws = 0, rw2 = 0, cv = 0, bk = 0; int nn = 0, np2 = 0;
    for (int r = rank; r < rows * 2; r += 2) { wts += (double(S(ml, 4, r)) - double(S(ml, 2, r))) / 1000.0;
      rws += (double(S(ml, 5, r)) - double(S(ml, 4, r))) / 1000.0; rw2 += (double(S(ml, 6, r)) - double(S(ml, 5, r))) / 1000.0; ++nn; }
    for (int r = 1 - rank; r < rows * 2; r += 2) { cv += (double(S(ml, 4, r)) - double(S(ml, 1, r))) / 1000.0;
      bk += (double(S(ml, 5, r)) - double(S(ml, 4, r))) / 1000.0; ++np2; }
    add(p + "mla own-block: weights", wts / nn); add(p + "mla own-block: rows (thread 0)", rws / nn);
    add(p + "mla peer-block: stores (to the signal)", cv / np2);
    add(p + "mla end max", mE);
    auto& a = abs_last[rank];
    a["cw"] = base; a["tk1max"] = base + tk1max * 1000; a["tkE"] = base + tkE * 1000; a["mE"] = base + mE * 1000;
    a["tk0"] = base + tk0 * 1000;
    if (abs_last.size() == 2 && abs_last[0].size() && abs_last[1].size()) {
      for (const char* key : {"cw", "tk0", "tk1max", "tkE", "mE"})
        add(label + " r1-r0 " + key, (abs_last[1][key] - abs_last[0][key]) / 1000.0);
      abs_last.clear();
    }
  }
}
inline void print() {
  std::lock_guard<std::mutex> lock(mu);
  std::printf("diag stamps (us; mean [min, max] over steps):\n");
  for (auto& [k, a] : acc) std::printf("  %-60s %8.1f [%8.1f, %8.1f] n=%d\n", k.c_str(), a.sum / a.n, a.mn, a.mx, a.n);
  acc.clear();
}
}  // namespace diagc
