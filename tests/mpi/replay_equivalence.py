#!/usr/bin/env python3
"""Multi-process CP replay against threads: `dsacp make-case`, then `dsacp replay --launcher threads` and
`mpirun -np 4 dsacp replay --launcher mpi` for several layouts; the result files must hold the same top-k bytes
and out / lse within 1e-5. Pure Python (no numpy): CI needs only python3.

usage: replay_equivalence.py --dsacp PATH [--mpirun mpirun] [--work DIR]"""
import argparse
import json
import math
import os
import struct
import subprocess
import sys
import time

LAYOUTS = [
    ["--pcp", "2", "--dcp", "2"],  # hybrid, sharded indexer (the default)
    ["--pcp", "4"],
    ["--dcp", "4", "--dsa-cp"],
    ["--dcp", "4", "--indexer", "replicated"],
]
FORMATS = {"F32": ("f", 4), "I32": ("i", 4)}


def read_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack_from("<Q", blob, 0)
    header = json.loads(blob[8 : 8 + n])
    data = blob[8 + n :]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        tensors[name] = (info["dtype"], info["shape"], data[begin:end])
    return tensors


def values(tensor):
    dtype, _, raw = tensor
    code, size = FORMATS[dtype]
    return struct.unpack("<%d%s" % (len(raw) // size, code), raw)


def close(a, b, tol):
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= tol * max(1.0, abs(a))


def compare(ref_path, got_path):
    ref, got = read_safetensors(ref_path), read_safetensors(got_path)
    problems = []
    for name in ("topk_indices", "out", "lse"):
        if name not in got:
            problems.append(f"{name} missing")
            continue
        if ref[name][:2] != got[name][:2]:
            problems.append(f"{name}: {got[name][:2]} instead of {ref[name][:2]}")
            continue
        if name == "topk_indices":
            if ref[name][2] != got[name][2]:
                problems.append("topk_indices differ")
            continue
        bad = sum(1 for a, b in zip(values(ref[name]), values(got[name])) if not close(a, b, 1e-5))
        if bad:
            problems.append(f"{name}: {bad} values differ by more than 1e-5")
    return problems


def run(cmd, env):
    start = time.time()
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=100)
    if p.returncode != 0:
        sys.exit(f"FAILED (exit {p.returncode}): {' '.join(cmd)}\n{p.stdout}")
    return time.time() - start


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dsacp", required=True)
    ap.add_argument("--mpirun", default="mpirun")
    ap.add_argument("--work", default="mpi_replay")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
    case = os.path.join(args.work, "case.safetensors")
    # Decodes, MTP rows, a prefill with context, a fresh prefill shorter than 2P, a long context.
    run([args.dsacp, "make-case", case, "--query-lens", "1,2,1,37,3,1", "--context-lens", "300,90,700,120,0,1013",
         "--heads", "8", "--topk", "64", "--seed", "7"], env)
    mpirun = [args.mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "4"]
    failures = 0
    for layout in LAYOUTS:
        name = " ".join(layout)
        threads_out = os.path.join(args.work, "threads.safetensors")
        mpi_out = os.path.join(args.work, "mpi.safetensors")
        for path in (threads_out, mpi_out):
            if os.path.exists(path):
                os.remove(path)
        t_threads = run([args.dsacp, "replay", case, "--out", threads_out, "--threads", "1"] + layout, env)
        t_mpi = run(mpirun + [args.dsacp, "replay", case, "--out", mpi_out, "--threads", "1", "--launcher", "mpi"]
                    + layout, env)
        problems = compare(threads_out, mpi_out)
        status = "ok" if not problems else "MISMATCH: " + "; ".join(problems)
        print(f"{name:36s} threads {t_threads:5.2f} s  mpirun -np 4 {t_mpi:5.2f} s  {status}")
        failures += bool(problems)
    # A world that does not match the layout is refused with one line.
    p = subprocess.run(mpirun[:-1] + ["2", args.dsacp, "replay", case, "--out", mpi_out, "--pcp", "4",
                                      "--launcher", "mpi"], env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=100)
    if p.returncode == 0 or "the MPI world has 2 processes" not in p.stdout:
        print("world-size mismatch was not refused:\n" + p.stdout)
        failures += 1
    else:
        print("mpirun -np 2 with --pcp 4: refused")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
