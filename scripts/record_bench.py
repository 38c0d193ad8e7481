#!/usr/bin/env python3
"""Records one benchmark run for BENCHMARKS.md: wraps the benchmark's JSON with its date, GPU, commit and command
into bench/results/<name>.json (see scripts/benchmarks_md.py), replacing that family's earlier run.
Usage: scripts/record_bench.py --family kernels|layers|cp|peers|python --in RUN.json --name NAME --command "..."
                               [--commit HASH] [--date "YYYY-MM-DD HH:MM UTC"] [--gpu "..."] [--note "..."] [--title "..."]
The commit defaults to `git rev-parse --short HEAD`, the date to now, the GPU to the JSON's "device"."""
import datetime
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv):
    opts = {}
    i = 0
    while i < len(argv):
        if not argv[i].startswith("--") or i + 1 >= len(argv):
            raise SystemExit(f"record_bench.py: bad argument {argv[i]!r} (see the usage at the top of the file)")
        opts[argv[i][2:]] = argv[i + 1]
        i += 2
    for need in ("family", "in", "name", "command"):
        if need not in opts:
            raise SystemExit(f"record_bench.py: --{need} is required")
    with open(opts["in"]) as f:
        data = json.load(f)
    commit = opts.get("commit") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                                  capture_output=True, text=True).stdout.strip()
    date = opts.get("date") or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rec = {"family": opts["family"], "date": date, "gpu": opts.get("gpu") or data.get("device", "?"),
           "commit": commit, "command": opts["command"], "data": data}
    for extra in ("note", "title"):
        if extra in opts:
            rec[extra] = opts[extra]
    path = os.path.join(ROOT, "bench", "results", opts["name"] + ".json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(rec, f, indent=1)
        f.write("\n")
    print(path)


if __name__ == "__main__":
    main(sys.argv[1:])
