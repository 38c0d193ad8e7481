#!/usr/bin/env python3
"""Writes BENCHMARKS.md, the current table of each benchmark family, from the JSON in bench/results/.

Each results file is one benchmark run wrapped with where it came from (scripts/record_bench.py writes it):
  {"family": "kernels" | "layers" | "cp" | "peers" | "python", "date": "...", "gpu": "...", "commit": "...", "command": "...",
   "data": <the benchmark's own JSON: bench/compare.py's output, dsacp_bench_cp --json, or the peers' table>}
Usage: scripts/benchmarks_md.py [--results DIR] [--out FILE] [--check]
  --check: exit 1 (naming the first differing line) if FILE is not what the results generate.
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fmt(x, digits=4):
    if x is None:
        return "—"
    if isinstance(x, str):
        return x
    if abs(x) >= 100:
        return f"{x:.1f}"
    if abs(x) >= 10:
        return f"{x:.2f}"
    return f"{x:.{digits}f}"


def provenance(r):
    return [f"- date: {r['date']}; GPU: {r['gpu']}; commit: `{r['commit']}`",
            f"- command: `{r['command']}`"] + ([f"- {r['note']}"] if r.get("note") else [])


def kernels_section(r, remeasured=frozenset()):
    """remeasured: names of cases a later kernels run measured again; their older rows stay in the JSON only."""
    d = r["data"]
    c = d.get("ceilings", {})
    title = r.get("title", "Kernels on one GPU")
    torch_ = ", plain PyTorch in the same run" if any(k.get("torch_ms") for k in d["cases"]) else ""
    later = [k for k in d["cases"] if k["name"] in remeasured]
    out = [f"## {title} (`dsacp_bench_gpu`{torch_})", ""] + provenance(r) + ([
        f"- {len(later)} of its cases were measured again by a later run: their rows are in that run's table below "
        "(this run's are in its JSON)"] if later else []) + [
        f"- ceilings {'(nominal, not measured in this run)' if c.get('nominal') else 'measured in the same run'}: device copy {fmt(c.get('copy_gbs'))} GB/s (read + write), "
        f"bf16 matmul {fmt(c.get('bf16_tflops'))} TFLOP/s; floor = max(FLOPs / matmul, bytes / copy)",
        "- method: CUDA events around the kernels, 3 warm-ups, L2 flushed before every timed run, median of 20 "
        "(5 for prefills); b = 64, ctx 32K, top-k 2048, Dl 512, Dr 64, Hi 64, Di 128, page 64 unless the case "
        "says otherwise (docs/benchmarking.md); `extra` is the benchmark's own breakdown; the top-k's forced "
        "cache modes (`uncached`, `cached`) are in the JSON only (the table keeps `cache auto`)", "",
        "| case | ms | TFLOP/s | GB/s | % matmul | % copy | floor ms | × floor | PyTorch ms | speedup | extra |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for k in d["cases"]:
        if k["name"].endswith(" uncached]") or k["name"].endswith(" cached]"):
            continue  # a forced cache mode of the cluster top-k: the JSON keeps it
        if k["name"] in remeasured:
            continue
        xf = k["ms"] / k["floor_ms"] if k.get("floor_ms") else None
        out.append(f"| {k['name']} | {fmt(k['ms'])} | {fmt(k['tflops'], 1)} | {fmt(k['gbs'], 1)} | "
                   f"{fmt(k.get('pct_peak_tflops'), 1)} | {fmt(k.get('pct_peak_bw'), 1)} | {fmt(k.get('floor_ms'))} | "
                   f"{fmt(xf, 2)} | {fmt(k.get('torch_ms'))} | {fmt(k.get('speedup_vs_torch'), 2)} | {k.get('extra', '')} |")
    return out


def cp_section(r):
    d = r["data"]
    out = [f"## Context parallelism on {d.get('gpus', '?')} GPUs (`dsacp_bench_cp`)", ""] + provenance(r) + [
        f"- {d.get('nccl', 'NCCL')}; median of {d.get('reps', '?')} whole steps per layout (host planning, "
        "uploads, kernels and collectives); a CP step's time is its slowest rank's; H 128, Dl 512, Dr 64, Hi 64, "
        "Di 128, K 2048, page 64, bf16", "",
        "| case | layout | one GPU ms | CP ms | CP / one GPU | speedup | top-k phase ms (one / CP) | "
        "KV GiB per GPU (one / CP) | bytes moved a step |",
        "|---|---|---|---|---|---|---|---|---|"]
    gib = float(1 << 30)
    for k in d["cases"]:
        one, cp = k["one_gpu"], k["cp"]
        out.append(f"| {k['case']} | {k['layout']} | {fmt(one['step_ms'])} | {fmt(cp['step_ms'])} | "
                   f"{fmt(cp['step_ms'] / one['step_ms'], 3)} | {fmt(k['speedup'], 2)}× | "
                   f"{fmt(one['topk_ms'])} / {fmt(cp['topk_ms'])} | "
                   f"{one['kv_bytes_per_gpu'] / gib:.2f} / {cp['kv_bytes_per_gpu'] / gib:.2f} | {cp['comm_bytes']} |")
    bus = d.get("busbw", [])
    if bus:
        out += ["", "NCCL collectives through dsacp's communicator (nccl-tests style: size = bytes gathered or "
                "exchanged per rank; back to back, and one by one as a step pays them):", "",
                "| op | ranks | size | µs | algbw GB/s | busbw GB/s | one by one µs |", "|---|---|---|---|---|---|---|"]
        for b in bus:
            if "algbw" not in b:  # a zero-byte operation (a window publish): latency only
                out.append(f"| {b['op']} | {b['ranks']} | 0 | {fmt(b['us'], 1)} | — | — | {fmt(b.get('single_us'), 1)} |")
                continue
            size = b["bytes"]
            label = f"{size >> 30} GiB" if size >= 1 << 30 else f"{size >> 20} MiB"
            out.append(f"| {b['op']} | {b['ranks']} | {label} | {fmt(b['us'], 1)} | {fmt(b['algbw'], 1)} | "
                       f"{fmt(b['busbw'], 1)} | {fmt(b.get('single_us'), 1)} |")
    graphs = d.get("graph_layers", [])
    if graphs:
        out += ["", "Decode layers captured into one CUDA graph and replayed (`--only graph`: device time of a replay "
                "/ its layers; the CP ranks' plans enqueue only, a replay's time is its slowest rank's):", "",
                "| case | layers a graph | one GPU ms a layer | CP ms a layer | CP / one GPU |", "|---|---|---|---|---|"]
        for g in graphs:
            out.append(f"| {g['case']} | {g['layers']} | {fmt(g['one_gpu_layer_ms'])} | {fmt(g['cp_layer_ms'])} | "
                       f"{fmt(g['cp_of_one_gpu'], 3)} |")
    return out


def peers_section(r):
    d = r["data"]
    out = ["## Side by side with the peers (one GPU)", ""] + provenance(r) + [
        "", "| case | dsacp ms | best peer ms | best peer | dsacp / peer |", "|---|---|---|---|---|"]
    for k in d["cases"]:
        out.append(f"| {k['case']} | {k['dsacp_ms']} | {k['peer_ms']} | {k['peer']} | {k['ratio']} |")
    return out


def layers_section(r):
    d = r["data"]
    out = [f"## A forward pass of planned layers on one GPU, eager and as one CUDA graph (`dsacp_bench_gpu --only layers61`)",
           ""] + provenance(r) + [
        "- method: one `step_plan`, then 61 planned `step_run`s (dsacp/step_plan.h) per pass; CUDA events on the "
        "backend's stream around the whole pass, median of the reps; `host us/layer`: the eager pass's host time "
        "divided by 61 (the planned runs' launches); H=128, K=2048, bf16, page 64; the replay's outputs compared with "
        "the eager ones byte for byte; `empty launch us`: one empty kernel launch's host time on the same stream "
        "(the floor a launch)", "",
        "| case | eager ms | graph ms | eager / graph | host us/layer (eager) | empty launch us | step_plan us | outputs |",
        "|---|---|---|---|---|---|---|---|"]
    for k in d["cases"]:
        out.append(f"| {k['name']} | {fmt(k['eager_ms'])} | {fmt(k['graph_ms'])} | {fmt(k['eager_ms'] / k['graph_ms'], 2)} | "
                   f"{fmt(k['host_us_per_layer'], 1)} | {fmt(k.get('empty_launch_us'), 2)} | {fmt(k['plan_us'], 1)} | "
                   f"{'identical' if k['identical'] else 'DIFFER'} |")
    return out


def python_section(r):
    d = r["data"]
    out = ["## The Python module on one H200 (`python/bench/op_overhead.py`, `python/bench/kernel_time.py`)", ""] + \
        provenance(r) + ["", "| call (CUDA, eager) | median us | min us | over C++ us | target |", "|---|---|---|---|---|"]
    for k in d["overhead"]:
        out.append(f"| {k['call']} | {fmt(k['median_us'], 2)} | {fmt(k['min_us'], 2)} | {fmt(k['over_cpp_us'], 2)} | "
                   f"{k['target']} |")
    out += ["", "| kernel case (bf16, K=2048) | from Python ms | dsacp_bench_gpu ms | difference | target |",
            "|---|---|---|---|---|"]
    for k in d["kernels"]:
        diff = 100.0 * (k["python_ms"] / k["cpp_ms"] - 1.0)
        out.append(f"| {k['case']} | {fmt(k['python_ms'])} | {fmt(k['cpp_ms'])} | {diff:+.1f}% | {k['target']} |")
    return out


SECTIONS = {"peers": peers_section, "kernels": kernels_section, "cp": cp_section, "layers": layers_section,
            "python": python_section}
ORDER = ["kernels", "layers", "python", "peers", "cp"]


def generate(results_dir):
    runs = []
    for name in sorted(os.listdir(results_dir)):
        if name.endswith(".json"):
            with open(os.path.join(results_dir, name)) as f:
                r = json.load(f)
            if r.get("family") not in SECTIONS:
                raise SystemExit(f"{name}: family {r.get('family')!r} is not one of {sorted(SECTIONS)}")
            runs.append((ORDER.index(r["family"]), name, r))
    lines = ["# Benchmarks", "",
             "The current numbers, one table per benchmark family, generated by `scripts/benchmarks_md.py` from the "
             "runs recorded in `bench/results/` (each with its date, GPU, commit and command). Do not edit this file "
             "by hand: record a run with `scripts/record_bench.py` and regenerate. Methods and formulas: "
             "[docs/benchmarking.md](docs/benchmarking.md). Earlier measurements: the git history of this file and "
             "[docs/history/](docs/history/README.md).", ""]
    kernel_runs = [r for _, _, r in runs if r["family"] == "kernels"]
    for _, _, r in sorted(runs, key=lambda x: (x[0], x[1])):
        if r["family"] == "kernels":
            later = {k["name"] for o in kernel_runs if o["date"] > r["date"] for k in o["data"]["cases"]}
            lines += kernels_section(r, frozenset(later)) + [""]
        else:
            lines += SECTIONS[r["family"]](r) + [""]
    return "\n".join(lines)


def main(argv):
    results = os.path.join(ROOT, "bench", "results")
    out = os.path.join(ROOT, "BENCHMARKS.md")
    check = False
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--results" and i + 1 < len(argv):
            results = argv[i + 1]
            i += 1
        elif a == "--out" and i + 1 < len(argv):
            out = argv[i + 1]
            i += 1
        elif a == "--check":
            check = True
        else:
            raise SystemExit(f"benchmarks_md.py: unknown argument {a!r} (see the usage at the top of the file)")
        i += 1
    text = generate(results)
    if check:
        have = open(out).read() if os.path.exists(out) else ""
        if have != text:
            a, b = have.splitlines(), text.splitlines()
            n = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
            print(f"{out} is not what bench/results generates (first difference at line {n + 1}); "
                  "run scripts/benchmarks_md.py", file=sys.stderr)
            return 1
        return 0
    with open(out, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
