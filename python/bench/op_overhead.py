"""Python overhead of one op call over the C++ call: a tiny lse_merge (2 parts, 1 row, Dl 512) issued 1000 times
from Python against the same 1000 calls made from C++ with the arguments converted once
(_dsacp._bench_lse_merge), host time per call, median (and min) of 9 rounds. Rows: the raw module call (stream
given on CUDA), the package wrapper (stream looked up by the module: torch's current one), the torch operator
(allocates its outputs), the C++ loop; and the planned step's per-layer call (dsacp.run_layer of a small decode
batch, outputs given, and the torch operator) against the same step_run calls made from C++
(_dsacp._bench_run_layer; on CUDA the rows are the host time of the call, its kernel launches included, on the
CPU the kernels themselves run inside: a few ms, so only the CUDA rows show the binding's share).

Usage: python op_overhead.py [--device cuda|cpu] [--json PATH]. Prints the JSON (and a table) to stdout.
On the CPU the kernel itself runs inside every call (a few hundred ns for this size): the C++ row includes it."""
import argparse
import json
import statistics
import time

import numpy as np
import torch

import dsacp
from dsacp import _dsacp, torch_ops  # noqa: F401  (registers torch.ops.dsacp)


def per_call(fn, sync, n=1000, rounds=9):
    times = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        sync()
        times.append((t1 - t0) / n * 1e6)
    return statistics.median(times), min(times)


def decode_plan(dev):
    """A b=8 decode batch (H=16, Dl 512, Dr 64, Hi 64, Di 128, K 64, pages of 64) and one layer's bf16 caches."""
    R, ps, ctx = 8, 64, 200
    pages = (ctx + 1 + ps - 1) // ps
    bt = torch.arange(R * pages, dtype=torch.int32).reshape(R, pages)
    p = dsacp.plan([1] * R, [ctx] * R, bt, num_pages=R * pages, heads=16, scale=0.04, topk=64, device=dev,
                   device_block_table=bt.to(dev) if dev != "cpu" else None)
    g = torch.Generator().manual_seed(1)
    caches = tuple(None if c is None else (torch.randn(c.shape, generator=g) * 0.1).to(c.dtype).to(dev)
                   for c in p.empty_caches(device="cpu"))
    x = [torch.randn(s, generator=g).to(torch.bfloat16).to(dev) for s in
         ((R, 16, 512), (R, 16, 64), (R, 512), (R, 64), (R, 64, 128))]
    w = torch.rand(R, 64, generator=g).to(dev)
    k = torch.randn(R, 128, generator=g).to(torch.bfloat16).to(dev)
    inputs = x + [w, k]
    outs = dict(out=torch.empty(R, 16, 512, device=dev), lse=torch.empty(R, 16, device=dev),
                topk=torch.empty(R, 64, dtype=torch.int32, device=dev))
    return p, caches, inputs, outs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    ap.add_argument("json_path", nargs="?", default=None)  # (the older positional form)
    a = ap.parse_args()
    dev = "cuda:0" if a.device == "cuda" else "cpu"
    cuda = dev != "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    po = torch.randn(2, 1, 512, device=dev)
    pl = torch.randn(2, 1, device=dev)
    o = torch.empty(1, 512, device=dev)
    lse = torch.empty(1, device=dev)
    stream = torch.cuda.current_stream().cuda_stream if cuda else None
    threads = 0 if cuda else 1
    dsacp.lse_merge(po, pl, out=o, lse=lse, threads=threads)
    dsacp.check_errors()
    rows = {
        "raw _dsacp.lse_merge (stream given)": per_call(
            lambda: _dsacp.lse_merge(po, pl, out=o, lse=lse, stream=stream, threads=threads), sync),
        "dsacp.lse_merge (wrapper, current stream)": per_call(
            lambda: dsacp.lse_merge(po, pl, out=o, lse=lse, threads=threads), sync),
        "torch.ops.dsacp.lse_merge (torch operator, allocates)": per_call(lambda: torch.ops.dsacp.lse_merge(po, pl),
                                                                          sync),
    }
    if not cuda:
        pn, pln, on, ln = po.numpy(), pl.numpy(), o.numpy(), lse.numpy()
        rows["raw _dsacp.lse_merge on numpy arrays"] = per_call(
            lambda: _dsacp.lse_merge(pn, pln, out=on, lse=ln, threads=1), sync)
    cxx = [_dsacp._bench_lse_merge(po, pl, o, lse, stream, 1000) * 1e6 for _ in range(9)]
    rows["C++ loop (_bench_lse_merge)"] = (statistics.median(cxx), min(cxx))
    cxx_med, cxx_min = rows["C++ loop (_bench_lse_merge)"]
    layer = {}
    if hasattr(dsacp, "plan"):  # (a module before the planned step: the op rows only)
        p, caches, inputs, outs = decode_plan(dev)
        dsacp.run_layer(p, caches, *inputs, **outs)
        dsacp.check_errors()
        n = 200 if cuda else 20
        layer = {
            "dsacp.run_layer (b=8 decode, outputs given)": per_call(
                lambda: dsacp.run_layer(p, caches, *inputs, **outs), sync, n=n),
            "torch_ops.run_layer (torch operator, allocates)": per_call(
                lambda: torch_ops.run_layer(p, caches, *inputs), sync, n=n),
        }
        cx = [_dsacp._bench_run_layer(p._impl, *caches, *inputs, None, None, None, outs["out"], outs["lse"],
                                      outs["topk"], None, p.stream if cuda else None, 0, n) * 1e6
              for _ in range(9)]
        layer["C++ loop (_bench_run_layer)"] = (statistics.median(cx), min(cx))
        dsacp.check_errors()
    res = {"unit": "us per call (host)", "device_kind": "cuda" if cuda else "cpu", "calls": 1000, "rounds": 9,
           "rows_median": {k: v[0] for k, v in rows.items()}, "rows_min": {k: v[1] for k, v in rows.items()},
           "python_overhead_us": {k: v[0] - cxx_med for k, v in rows.items() if not k.startswith("C++")},
           "python_overhead_us_min": {k: v[1] - cxx_min for k, v in rows.items() if not k.startswith("C++")},
           "run_layer_us_median": {k: v[0] for k, v in layer.items()},
           "run_layer_us_min": {k: v[1] for k, v in layer.items()},
           "run_layer_python_overhead_us": {k: v[0] - layer["C++ loop (_bench_run_layer)"][0]
                                            for k, v in layer.items() if layer and not k.startswith("C++")},
           "run_layer_python_overhead_us_min": {k: v[1] - layer["C++ loop (_bench_run_layer)"][1]
                                                for k, v in layer.items() if layer and not k.startswith("C++")},
           "target_us": 5.0, "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if cuda else "cpu"}
    print(json.dumps(res, indent=1))
    path = a.json or a.json_path
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
    print(f"{'call':56s} {'median':>8s} {'min':>8s} {'over C++':>9s}")
    for k, (med, mn) in rows.items():
        print(f"{k:56s} {med:8.2f} {mn:8.2f} {med - cxx_med:9.2f}")
    for k, (med, mn) in layer.items():
        print(f"{k:56s} {med:8.2f} {mn:8.2f}")


if __name__ == "__main__":
    main()
