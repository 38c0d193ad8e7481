#!/usr/bin/env python3
"""The planner's predictions against every measured GPU case in bench/results (docs/planner.md).

    python3 scripts/plan_validate.py --dsacp build/rel/dsacp [--calibration calibration/h200.json]
        [--kernels bench/results/kernels_h200.json] [--cp bench/results/cp_2xh200.json] [--plot FILE.png]

Kernel rows (one H200) are predicted from the calibration's fitted terms with the cost model's formulas
(t = launch + max(bytes / bandwidth, flops / throughput); the top-k by elements); step rows (one GPU and the
2-GPU context-parallel rows) by the C++ model itself: `dsacp plan --step Q:CxN --pcp P --dcp D ... --json`.
Prints a markdown table: case, measured, predicted, error, and what bounds the prediction. --plot draws
`dsacp plan --json` time and memory against G (needs matplotlib).
"""
import argparse
import json
import re
import subprocess
import sys

HI, DI, K = 64, 128, 2048


def kernel_ms(fit, bytes_, flops):
    t = 0.0
    if fit["gbs"] > 0:
        t = max(t, bytes_ / (fit["gbs"] * 1e6))
    if fit["tflops"] > 0:
        t = max(t, flops / (fit["tflops"] * 1e9))
    return fit["launch_us"] * 1e-3 + t


def topk_ms(fit, total, longest):
    if total <= 0:
        return fit["launch_us"] * 1e-3
    t = max(total / (fit["total_gelem_s"] * 1e6), longest / (fit["row_gelem_s"] * 1e6))
    return fit["launch_us"] * 1e-3 + t


def bound(fit, bytes_, flops):
    b = bytes_ / (fit["gbs"] * 1e6) if fit["gbs"] > 0 else 0
    f = flops / (fit["tflops"] * 1e9) if fit["tflops"] > 0 else 0
    return "bandwidth" if b >= f else "compute"


def kernel_rows(kdoc, cal):
    kf = cal["kernels"]
    rows = []
    for c in kdoc["data"]["cases"]:
        name, ms = c["name"], c["ms"]
        m = re.fullmatch(r"sparse_decode b=64 ctx32K h=(\d+)( MTP2)?", name) or \
            re.fullmatch(r"splits sparse_decode h=128 used=1024 splits=1", name)
        if m:
            fit = kf["mla_decode"]
            rows.append((name, ms, kernel_ms(fit, c["bytes"], c["flops"]), "MLA decode, " + bound(fit, c["bytes"], c["flops"])))
            continue
        if re.fullmatch(r"sparse_prefill T=8192 keys8192 h=\d+", name):
            fit = kf["mla_prefill"]
            rows.append((name, ms, kernel_ms(fit, c["bytes"], c["flops"]), "MLA prefill, compute"))
            continue
        m = re.fullmatch(r"indexer_decode b=64 ctx(\d+)K.*", name)
        m8 = re.fullmatch(r"indexer_fp8 decode b=64 ctx(\d+)K next_n=(\d) Hi=(\d+)", name)
        mh = re.fullmatch(r"indexer_bf16_hi32 decode b=64 ctx(\d+)K Hi=32", name)
        if m or m8 or mh:
            ctx = int((m or m8 or mh).group(1)) * 1024
            nn = int(m8.group(2)) if m8 else 1
            hi = int(m8.group(3)) if m8 else (32 if mh else HI)
            fit = kf[("indexer_fp8" if m8 else "indexer_bf16") + ("_hi32" if hi <= 32 else "")]
            key_bytes = DI + 4 if m8 else DI * 2
            b, f = 64 * ctx * key_bytes, 2 * hi * DI * 64 * nn * ctx
            p = kernel_ms(fit, b, f) + topk_ms(kf["topk_decode"], 64 * nn * ctx, ctx)
            rows.append((name, ms, p, "indexer scores " + bound(fit, b, f) + " + top-k"))
            continue
        mp = re.fullmatch(r"indexer(_fp8|_bf16_hi32)? prefill T=8192 causal( Hi=(\d+))?", name) or \
            (name == "indexer_prefill T=8192 causal" and re.match(r"(.*)", name))
        if mp:
            fp8 = "fp8" in name
            hi = 32 if "Hi=32" in name else HI
            fit = kf[("indexer_fp8" if fp8 else "indexer_bf16") + ("_hi32" if hi <= 32 else "")]
            causal = 8192 * 8193 / 2
            b, f = 8192 * (DI + 4 if fp8 else DI * 2), 2 * hi * DI * causal
            p = kernel_ms(fit, b, f) + topk_ms(kf["topk_prefill"], causal, 8192)
            rows.append((name, ms, p, "indexer scores compute + top-k"))
            continue
        mt = re.fullmatch(r"topk (b=(\d+) ctx(\d+)([KM])|prefill T=8192 causal) K=2048( \(launch floor\))? \[default\]", name)
        if mt:
            if mt.group(2):
                b = int(mt.group(2))
                ctx = int(mt.group(3)) * (1024 if mt.group(4) == "K" else 1 << 20)
                p = topk_ms(kf["topk_decode"], b * ctx, ctx)
            else:
                p = topk_ms(kf["topk_prefill"], 8192 * 8193 / 2, 8192)
            rows.append((name, ms, p, "top-k"))
            continue
        mm = re.fullmatch(r"topk_merge (\d) parts b=64 K=2048", name)
        if mm:
            parts = int(mm.group(1))
            rows.append((name, ms, kernel_ms(kf["topk_merge"], parts * 64 * K * 8, 0), "candidate merge"))
    return rows


def step_rows(cdoc, dsacp, calibration):
    rows = []
    seen = set()
    for c in cdoc["data"]["cases"]:
        tokens, name = c["tokens"], c["case"]
        if name.startswith("pcp prefill"):
            step = f"{tokens}:0"
        else:
            step = f"1:{tokens - 1}x64"
        layout = c["layout"]
        args = []
        m = re.match(r"P(\d+)", layout)
        if m:
            args += ["--pcp", m.group(1)]
        m = re.match(r"D(\d+)", layout)
        if m:
            args += ["--dcp", m.group(1)]
        if "replicated" in layout:
            args += ["--indexer", "replicated"]
        one_key = step
        todo = []
        if one_key not in seen:
            seen.add(one_key)
            todo.append((f"1 GPU step: {name.split(' sharded')[0].split(' replicated')[0].replace('pcp ', '').replace('dcp ', '')}",
                         c["one_gpu"]["step_ms"], []))
        todo.append((f"2 GPU step: {name} ({layout})", c["cp"]["step_ms"], args))
        for label, measured, a in todo:
            cmd = [dsacp, "plan", "--model", "deepseek-v3.2", "--step", step, "--json", "--calibration", calibration] + a
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"plan_validate: {' '.join(cmd)}: {out.stderr.strip()}")
            p = json.loads(out.stdout)
            what = f"kv {p['kv_ms']:.3g} + indexer {p['indexer_ms']:.3g} + attention {p['attention_ms']:.3g} ms"
            rows.append((label, measured, p["step_ms"], what))
    return rows


def plot(dsacp, calibration, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
    for model in ("deepseek-v3.2", "glm-5"):
        gs, ttft, tpot, kv = [], [], [], []
        for g in (8, 16, 32, 64, 128, 256, 512):
            out = subprocess.run([dsacp, "plan", "--model", model, "--context", str(1 << 20), "--gpus", str(g),
                                  "--json", "--calibration", calibration], capture_output=True, text=True, check=True)
            best = [l for l in json.loads(out.stdout)["layouts"] if l.get("chosen")][0]
            gs.append(g)
            ttft.append(best["ttft_ms"] / 1e3)
            tpot.append(best["tpot_ms"])
            kv.append(best["kv_bytes_per_gpu"] / 2**30)
        for a, y in zip(ax, (ttft, tpot, kv)):
            a.plot(gs, y, marker="o", label=model)
    for a, t in zip(ax, ("TTFT (s), 1M-token prompt", "TPOT (ms), batch 1", "KV a GPU (GiB)")):
        a.set_xscale("log", base=2)
        a.set_xlabel("GPUs")
        a.set_title(t)
        a.grid(True, alpha=0.3)
    ax[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dsacp", default="build/rel/dsacp")
    ap.add_argument("--calibration", default="calibration/h200.json")
    ap.add_argument("--kernels", default="bench/results/kernels_h200.json")
    ap.add_argument("--cp", default="bench/results/cp_2xh200.json")
    ap.add_argument("--plot", help="write a PNG of the chosen layout's TTFT, TPOT and KV against G")
    a = ap.parse_args()
    cal = json.load(open(a.calibration))
    kdoc, cdoc = json.load(open(a.kernels)), json.load(open(a.cp))
    rows = kernel_rows(kdoc, cal) + step_rows(cdoc, a.dsacp, a.calibration)
    print(f"Calibration {a.calibration} (kernels {cal['source']['kernels']['commit']}, "
          f"CP rows {cal['source']['cp']['commit']}).\n")
    print("| case | measured ms | predicted ms | error | model term |")
    print("|---|---:|---:|---:|---|")
    within, worst = 0, []
    for name, meas, pred, what in rows:
        err = (pred - meas) / meas
        within += abs(err) <= 0.15
        worst.append((abs(err), name))
        print(f"| {name} | {meas:.4g} | {pred:.4g} | {err * 100:+.1f}% | {what} |")
    steps = [r for r in rows if "GPU step" in r[0]]
    steps_within = sum(abs((p - m) / m) <= 0.15 for _, m, p, _ in steps)
    print(f"\n{within} of {len(rows)} rows within 15% ({steps_within} of {len(steps)} step rows); worst: "
          + ", ".join(f"{n} {e * 100:.0f}%" for e, n in sorted(worst, reverse=True)[:3]))
    if a.plot:
        plot(a.dsacp, a.calibration, a.plot)
        print(f"plot: {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
