#!/usr/bin/env python3
"""Issue #30: one MPI rank failing on its input must end the job, never hang it.

`mpirun -np 1 dsacp replay good.st ... : -np 1 dsacp replay bad.st ...` (each rank its own case) used to hang
for as long as one waited (one rank in MPI_Finalize, the other in MPI_Comm_dup). Now every rank agrees on the
load's success (bounded by --comm-timeout) before any communicator exists. Also: a rank that fails before MPI
starts (an unknown option on one rank) ends the job within --comm-timeout.

usage: replay_rank_failure.py --dsacp PATH [--mpirun mpirun] [--work DIR]"""
import argparse
import os
import subprocess
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dsacp", required=True)
    ap.add_argument("--mpirun", default="mpirun")
    ap.add_argument("--work", default="/tmp/dsacp_mpi_rank_failure")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    good = os.path.join(a.work, "good.safetensors")
    bad = os.path.join(a.work, "bad.safetensors")
    subprocess.run([a.dsacp, "make-case", good, "--query-lens", "3,5", "--context-lens", "40,9", "--topk", "8"],
                   check=True, capture_output=True)
    with open(good, "rb") as f:
        data = f.read()
    with open(bad, "wb") as f:
        f.write(data[: len(data) // 2])  # truncated: refused by the loader
    mpirun = [a.mpirun, "--allow-run-as-root", "--oversubscribe"]
    common = ["--launcher", "mpi", "--pcp", "2", "--comm-timeout", "5"]
    failures = []

    def job(name, argv, want_text, bound_s):
        t0 = time.monotonic()
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=bound_s + 30)
        except subprocess.TimeoutExpired:
            failures.append(f"{name}: still running after {bound_s + 30} s (the job hangs)")
            return
        dt = time.monotonic() - t0
        out = r.stdout + r.stderr
        print(f"{name}: exit {r.returncode} after {dt:.1f} s")
        if r.returncode == 0:
            failures.append(f"{name}: exit 0 although a rank failed\n{out}")
        if want_text not in out:
            failures.append(f"{name}: no {want_text!r} in the output\n{out}")
        if dt > bound_s:
            failures.append(f"{name}: took {dt:.1f} s, more than {bound_s} s")

    for order in ("good-bad", "bad-good"):
        first, second = (good, bad) if order == "good-bad" else (bad, good)
        argv = mpirun + ["-np", "1", a.dsacp, "replay", first, "--out", os.path.join(a.work, "r0.st")] + common + \
            [":", "-np", "1", a.dsacp, "replay", second, "--out", os.path.join(a.work, "r1.st")] + common
        job("bad case on one rank (" + order + ")", argv, "could not load its case" if order == "good-bad"
            else "safetensors", 20)
    # A rank that fails before MPI_Init: the other gives up within --comm-timeout and ends the job.
    argv = mpirun + ["-np", "1", a.dsacp, "replay", good, "--out", os.path.join(a.work, "r0.st")] + common + \
        [":", "-np", "1", a.dsacp, "replay", good, "--out", os.path.join(a.work, "r1.st"), "--bogus"] + common
    job("rank failing before MPI starts", argv, "unknown option", 25)
    for f in failures:
        print("FAIL:", f)
    print("ok" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
