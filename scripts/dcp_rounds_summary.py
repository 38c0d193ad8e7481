#!/usr/bin/env python3
"""Summarizes dsacp_bench_cp --json files of DCP rounds (scripts/gpu-dcp-rounds): per round, the CP step over the
one-GPU step of the same run; then, per case, their mean, min and max, written to OUT_DIR/rounds.json and printed.

Usage: dcp_rounds_summary.py OUT_DIR ROUND.json [ROUND.json ...]
"""
import json
import statistics
import sys


def rounds_of(paths):
    rounds = []
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            print(f"{path}: not read ({e})", file=sys.stderr)
            continue
        for case in data.get("cases", []):
            one, cp = case.get("one_gpu", {}), case.get("cp", {})
            if one.get("step_ms", 0) > 0 and cp.get("step_ms", 0) > 0:
                rounds.append({"file": path, "case": case.get("case", ""), "one_gpu_ms": one["step_ms"],
                               "cp_ms": cp["step_ms"], "ratio": cp["step_ms"] / one["step_ms"]})
    return rounds


def main(argv):
    if len(argv) < 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    out_dir, paths = argv[1], argv[2:]
    rounds = rounds_of(paths)
    if not rounds:
        print("no round with both a one-GPU and a CP step time", file=sys.stderr)
        return 1
    summary = {"rounds": rounds, "cases": {}}
    for r in rounds:
        print(f"{r['case']}: CP {r['cp_ms']:.3f} ms, one GPU {r['one_gpu_ms']:.3f} ms, ratio {r['ratio']:.3f}")
    for case in dict.fromkeys(r["case"] for r in rounds):  # in order of appearance
        of_case = [r for r in rounds if r["case"] == case]
        ratios = [r["ratio"] for r in of_case]
        s = {
            "rounds": len(of_case),
            "ratio_mean": statistics.fmean(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "cp_ms_mean": statistics.fmean(r["cp_ms"] for r in of_case),
            "one_gpu_ms_mean": statistics.fmean(r["one_gpu_ms"] for r in of_case),
        }
        summary["cases"][case] = s
        print(f"{case}, {s['rounds']} rounds: ratio mean {s['ratio_mean']:.3f} (min {s['ratio_min']:.3f}, "
              f"max {s['ratio_max']:.3f}); CP {s['cp_ms_mean']:.3f} ms, one GPU {s['one_gpu_ms_mean']:.3f} ms")
    with open(f"{out_dir}/rounds.json", "w") as f:
        json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
