#!/usr/bin/env python3
"""Fits the planner's kernel and link coefficients (dsacp plan, docs/planner.md) from the project's benchmark JSON.

    python3 scripts/plan_calibrate.py [--kernels bench/results/kernels_h200.json]
        [--cp bench/results/cp_2xh200.json] [--out calibration/h200.json]

Each kernel is t = launch + max(bytes / bandwidth, flops / throughput): the bandwidth from the rows a kernel reads
its bytes in (decode), the throughput from the rows it computes in (prefill, many heads); the top-k by elements a
second over all rows and within one row; the links t = latency + sent / bandwidth over the NCCL all-gather rows;
the step's host work (uploads, cache write) from the one-GPU step rows' kv phase. Only numpy-free arithmetic: the
fits are medians and two-point or weighted least-squares lines, so a reader can redo them by hand.
"""
import argparse
import json
import re
import statistics
import sys

LAUNCH_US = 3.0  # a kernel launch on the GPU's stream, back to back (the top-k's ctx0 row is 4 us with its work)


def case_map(doc):
    return {c["name"]: c for c in doc["data"]["cases"]}


def scores_ms(case):
    m = re.search(r"scores only ([0-9.]+) ms", case.get("extra") or "")
    if not m:
        raise SystemExit(f"plan_calibrate: {case['name']}: no 'scores only' time in extra")
    return float(m.group(1))


def weighted_line(xs, ys):
    """a, b minimizing sum(((a + b x) - y) / y)^2: the relative error of a line through the points."""
    w = [1.0 / (y * y) for y in ys]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, xs))
    sy = sum(wi * y for wi, y in zip(w, ys))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    b = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    a = (sy - b * sx) / sw
    return a, b


def balanced(rates):
    """The rate whose predicted times are off by the same fraction, high and low, over the rows (minimax)."""
    lo, hi = min(rates), max(rates)
    return 2 * lo * hi / (lo + hi)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", default="bench/results/kernels_h200.json")
    ap.add_argument("--cp", default="bench/results/cp_2xh200.json")
    ap.add_argument("--out", default="calibration/h200.json")
    ap.add_argument("--memory-gib", type=float, default=139.0, help="usable memory a GPU (an H200 shows about 139 GiB)")
    a = ap.parse_args()
    kdoc = json.load(open(a.kernels))
    cdoc = json.load(open(a.cp))
    k = case_map(kdoc)
    Hi, Di, K = 64, 128, 2048
    launch_ms = LAUNCH_US * 1e-3

    # Indexer scores, bf16: decode rows read 64 requests' keys (bandwidth); the causal prefill is flops.
    bw = []
    for ctx in (32, 64, 128):
        name = f"indexer_decode b=64 ctx{ctx}K" + (" (a DCP rank's half of 128K)" if ctx == 64 else "")
        keys = 64 * ctx * 1024
        bw.append(keys * Di * 2 / ((scores_ms(k[name]) - launch_ms) * 1e6))
    T = 8192
    causal = T * (T + 1) / 2
    idx_tf = 2 * Hi * Di * causal / ((scores_ms(k["indexer_prefill T=8192 causal"]) - launch_ms) * 1e9)
    indexer_bf16 = {"launch_us": LAUNCH_US, "gbs": round(statistics.median(bw), 1), "tflops": round(idx_tf, 1)}
    # Hi = 32 (GLM-5's indexer) runs its own rows: the same reads in less time.
    bw32 = [64 * c * 1024 * Di * 2 / ((scores_ms(k[f"indexer_bf16_hi32 decode b=64 ctx{c}K Hi=32"]) - launch_ms) * 1e6)
            for c in (32, 128)]
    tf32 = 2 * 32 * Di * causal / ((scores_ms(k["indexer_bf16_hi32 prefill T=8192 causal Hi=32"]) - launch_ms) * 1e9)
    indexer_bf16_hi32 = {"launch_us": LAUNCH_US, "gbs": round(balanced(bw32), 1), "tflops": round(tf32, 1)}

    # FP8 indexer (Hi = 64): next_n = 1 decodes for the bandwidth; next_n = 4 and the prefill for the throughput.
    bw8, tf8 = [], []
    for ctx in (32, 64, 128):
        keys = 64 * ctx * 1024
        bw8.append(keys * (Di + 4) / ((scores_ms(k[f"indexer_fp8 decode b=64 ctx{ctx}K next_n=1 Hi=64"]) - launch_ms) * 1e6))
        tf8.append(2 * Hi * Di * 4 * keys / ((scores_ms(k[f"indexer_fp8 decode b=64 ctx{ctx}K next_n=4 Hi=64"]) - launch_ms) * 1e9))
    tf8.append(2 * Hi * Di * causal / ((scores_ms(k["indexer_fp8 prefill T=8192 causal Hi=64"]) - launch_ms) * 1e9))
    indexer_fp8 = {"launch_us": LAUNCH_US, "gbs": round(statistics.median(bw8), 1), "tflops": round(statistics.median(tf8), 1)}
    bw8_32, tf8_32 = [], []
    for ctx in (32, 64, 128):
        keys = 64 * ctx * 1024
        bw8_32.append(keys * (Di + 4) / ((scores_ms(k[f"indexer_fp8 decode b=64 ctx{ctx}K next_n=1 Hi=32"]) - launch_ms) * 1e6))
        tf8_32.append(2 * 32 * Di * 4 * keys / ((scores_ms(k[f"indexer_fp8 decode b=64 ctx{ctx}K next_n=4 Hi=32"]) - launch_ms) * 1e9))
    tf8_32.append(2 * 32 * Di * causal / ((scores_ms(k["indexer_fp8 prefill T=8192 causal Hi=32"]) - launch_ms) * 1e9))
    indexer_fp8_hi32 = {"launch_us": LAUNCH_US, "gbs": round(balanced(bw8_32), 1), "tflops": round(balanced(tf8_32), 1)}

    # Top-k: elements a second over many rows (decode: 64 rows; prefill: 8192 causal rows), and within one row.
    tk_launch = k["topk b=64 ctx0 K=2048 (launch floor) [default]"]["ms"]
    dec = [64 * c * 1024 / ((k[f"topk b=64 ctx{c}K K=2048 [default]"]["ms"] - tk_launch) * 1e6) for c in (32, 64, 128)]
    row = 1 << 20
    row_rate = row / ((k["topk b=1 ctx1M K=2048 [default]"]["ms"] - tk_launch) * 1e6)
    pre_rate = causal / ((k["topk prefill T=8192 causal K=2048 [default]"]["ms"] - tk_launch) * 1e6)
    topk_decode = {"launch_us": round(tk_launch * 1e3, 2), "total_gelem_s": round(balanced(dec), 2),
                   "row_gelem_s": round(row_rate, 3)}
    topk_prefill = {"launch_us": round(tk_launch * 1e3, 2), "total_gelem_s": round(pre_rate, 2),
                    "row_gelem_s": round(row_rate, 3)}

    # Sparse MLA decode: few heads read their K entries (bandwidth); 128 heads compute.
    bw_mla = [k[f"sparse_decode b=64 ctx32K h={h}"]["bytes"] / ((k[f"sparse_decode b=64 ctx32K h={h}"]["ms"] - launch_ms) * 1e6)
              for h in (1, 2, 4, 8, 16)]
    h128 = k["sparse_decode b=64 ctx32K h=128"]
    mla_decode = {"launch_us": LAUNCH_US, "gbs": round(statistics.median(bw_mla), 1),
                  "tflops": round(h128["flops"] / ((h128["ms"] - launch_ms) * 1e9), 1)}
    pre = [k[f"sparse_prefill T=8192 keys8192 h={h}"] for h in (128, 64)]
    mla_prefill = {"launch_us": LAUNCH_US, "gbs": 0,
                   "tflops": round(statistics.median(c["flops"] / ((c["ms"] - launch_ms) * 1e9) for c in pre), 1)}

    # Candidate merge: parts x rows x K x 8 bytes read (positions and scores), 2 and 4 parts of 64 rows; the line
    # through them has no launch term left (it would be negative), so a bandwidth alone.
    rates = [p * 64 * K * 8 / (k[f"topk_merge {p} parts b=64 K=2048"]["ms"] * 1e6) for p in (2, 4)]
    topk_merge = {"launch_us": 0, "gbs": round(balanced(rates), 1), "tflops": 0}
    # The LSE merge has no benchmark row: half the copy ceiling (it reads every part once, writes one).
    copy_gbs = kdoc["data"]["ceilings"]["copy_gbs"]
    lse_merge = {"launch_us": LAUNCH_US, "gbs": round(copy_gbs / 2, 1), "tflops": 0, "measured": False}

    # Host work of a step's kv phase (uploads, slot lists, the cache write): a line in the rows written, over the
    # one-GPU step rows; the replicated indexer's block table from its D2 rows against the sharded ones.
    cases = cdoc["data"]["cases"]
    xs, ys, seen = [], [], set()
    for c in cases:
        rows = c["tokens"] if c["case"].startswith("pcp prefill") else 64
        key = (c["case"].split(" sharded")[0].split(" replicated")[0], rows)
        if key in seen:
            continue
        seen.add(key)
        xs.append(rows)
        ys.append(c["one_gpu"]["kv_ms"])
    kv_a, kv_b = weighted_line(xs, ys)
    per_page = []
    by = {c["case"]: c for c in cases}
    for ctx in (32, 128):
        rep, sh = by.get(f"dcp decode b64 {ctx}K replicated"), by.get(f"dcp decode b64 {ctx}K sharded")
        if rep and sh:
            pages = 64 * (ctx * 1024 // 64)
            per_page.append((rep["cp"]["kv_ms"] - sh["cp"]["kv_ms"]) / pages * 1e6)
    host = {"kv_phase_us": round(max(kv_a, 0) * 1e3, 2), "kv_phase_ns_per_row": round(kv_b * 1e6, 3),
            "replicated_table_ns_per_page": round(statistics.median(per_page), 3) if per_page else 0,
            "host_step_us": 0}

    # Links: NCCL all-gather over NVLink (2 ranks): rank sends bytes / 2 of the gathered bytes.
    ag = [r for r in cdoc["data"]["busbw"] if r["op"] == "all_gather"]
    lat, inv = weighted_line([r["bytes"] / 2 for r in ag], [r["us"] for r in ag])
    nvlink = {"latency_us": round(lat, 2), "gbs": round(1.0 / (inv * 1e3), 1)}
    pub = [r for r in cdoc["data"]["busbw"] if r["op"] == "window_publish"]
    window = {"latency_us": pub[0]["us"] if pub else 13.0, "gbs": nvlink["gbs"]}

    out = {
        "format": "dsacp-planner-calibration",
        "version": 1,
        "gpu": kdoc.get("gpu", ""),
        "memory_gib": a.memory_gib,
        "fitted_by": "scripts/plan_calibrate.py",
        "source": {
            "kernels": {"file": a.kernels, "commit": kdoc.get("commit", ""), "date": kdoc.get("date", "")},
            "cp": {"file": a.cp, "commit": cdoc.get("commit", ""), "date": cdoc.get("date", ""), "gpu": cdoc.get("gpu", "")},
        },
        "kernels": {"indexer_bf16": indexer_bf16, "indexer_bf16_hi32": indexer_bf16_hi32, "indexer_fp8": indexer_fp8,
                    "indexer_fp8_hi32": indexer_fp8_hi32, "topk_decode": topk_decode,
                    "topk_prefill": topk_prefill, "mla_decode": mla_decode, "mla_prefill": mla_prefill,
                    "topk_merge": topk_merge, "lse_merge": lse_merge},
        "host": host,
        "links": {"nvlink": nvlink, "window": window},
    }
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(json.dumps(out["kernels"], indent=None))
    print(json.dumps(out["host"]), json.dumps(out["links"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
