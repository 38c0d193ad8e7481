"""Python overhead of one op call over the C++ call (CUDA, eager): a tiny lse_merge (2 parts, 1 row, Dl 512)
issued 1000 times from Python against the same 1000 calls made from C++ with the arguments converted once
(_dsacp._bench_lse_merge), host time per call, median of 7 rounds. Rows: the raw module call (stream given), the
package wrapper (torch's current stream looked up), the torch custom op (allocates its outputs), and the C++ loop.
Writes JSON to the path given (default: stdout only)."""
import json
import statistics
import sys
import time

import torch

import dsacp
from dsacp import _dsacp


def per_call(fn, n=1000, rounds=7):
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        times.append((t1 - t0) / n)
    return statistics.median(times) * 1e6


def main():
    dev = "cuda:0"
    po = torch.randn(2, 1, 512, device=dev)
    pl = torch.randn(2, 1, device=dev)
    o = torch.empty(1, 512, device=dev)
    lse = torch.empty(1, device=dev)
    stream = torch.cuda.current_stream().cuda_stream
    dsacp.lse_merge(po, pl, out=o, lse=lse)
    dsacp.check_errors()
    rows = {
        "raw _dsacp.lse_merge (stream given)": per_call(lambda: _dsacp.lse_merge(po, pl, out=o, lse=lse, stream=stream)),
        "dsacp.lse_merge (wrapper, current stream)": per_call(lambda: dsacp.lse_merge(po, pl, out=o, lse=lse)),
        "torch.ops.dsacp.lse_merge (custom op, allocates)": per_call(lambda: torch.ops.dsacp.lse_merge(po, pl)),
        "C++ loop (_bench_lse_merge)": statistics.median(
            _dsacp._bench_lse_merge(po, pl, o, lse, stream, 1000) * 1e6 for _ in range(7)),
    }
    cxx = rows["C++ loop (_bench_lse_merge)"]
    res = {"unit": "us per call (host)", "calls": 1000, "rounds": 7, "rows": rows,
           "python_overhead_us": {k: v - cxx for k, v in rows.items() if not k.startswith("C++")},
           "target_us": 5.0, "torch": torch.__version__, "device": torch.cuda.get_device_name()}
    dsacp.check_errors()
    print(json.dumps(res, indent=1))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(res, f, indent=1)
    print(f"{'call':52s} {'us/call':>8s} {'over C++':>9s}")
    for k, v in rows.items():
        print(f"{k:52s} {v:8.2f} {v - cxx:9.2f}")


if __name__ == "__main__":
    main()
