#!/usr/bin/env python3
"""Joins bench_gpu's JSON and torch_baseline's JSON into one table (ours vs plain PyTorch, same run)."""
import json
import sys

ours = json.load(open(sys.argv[1]))
torch_ = json.load(open(sys.argv[2]))
out_path = sys.argv[3] if len(sys.argv) > 3 else None
tmap = {c["name"]: c for c in torch_["cases"]}
ceil_copy = next((c["gbs"] for c in torch_["cases"] if c["name"].startswith("ceiling d2d")), None)
ceil_mm = next((c["tflops"] for c in torch_["cases"] if c["name"].startswith("ceiling bf16")), None)
peak_tf = ceil_mm or ours["peak_tflops"]
peak_gbs = ceil_copy or ours["peak_tbs"] * 1000
rows = []
print(f"\nceilings measured this run: copy {peak_gbs:.0f} GB/s, bf16 matmul {peak_tf:.0f} TFLOP/s")
print(f"{'case':44s} {'ours ms':>9s} {'torch ms':>9s} {'speedup':>8s} {'TFLOP/s':>8s} {'GB/s':>8s} "
      f"{'%TF':>5s} {'%BW':>5s} {'floor ms':>9s} {'x floor':>7s}")
for c in ours["cases"]:
    t = tmap.get(c["name"])
    floor = max(c["flops"] / (peak_tf * 1e12), c["bytes"] / (peak_gbs * 1e9)) * 1e3
    r = dict(c)
    r["torch_ms"] = t["ms"] if t else None
    r["speedup_vs_torch"] = t["ms"] / c["ms"] if t else None
    r["floor_ms"] = floor
    r["pct_peak_tflops"] = 100 * c["tflops"] / peak_tf
    r["pct_peak_bw"] = 100 * c["gbs"] / peak_gbs
    rows.append(r)
    print(f"{c['name']:44s} {c['ms']:9.4f} {(t['ms'] if t else float('nan')):9.4f} "
          f"{(r['speedup_vs_torch'] or float('nan')):8.2f} {c['tflops']:8.1f} {c['gbs']:8.1f} "
          f"{r['pct_peak_tflops']:5.1f} {r['pct_peak_bw']:5.1f} {floor:9.4f} {c['ms'] / floor:7.2f}")
if out_path:
    json.dump({"device": ours["device"], "ceilings": {"copy_gbs": peak_gbs, "bf16_tflops": peak_tf},
               "cases": rows}, open(out_path, "w"), indent=1)
