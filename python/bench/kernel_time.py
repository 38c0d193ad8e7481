"""One kernel case timed from Python on torch tensors, as dsacp_bench_gpu times it (issue 28: within 3% of the C++
benchmark): sparse MLA decode, b=64 tokens of 64 requests with 32K keys each, K=2048 distinct sorted positions,
bf16 pools of 64-token shuffled pages, bf16 out; each call timed alone with CUDA events after a 256 MiB L2 flush,
the median of --reps. Compare the rows with `dsacp_bench_gpu --only "sparse_decode b=64 ctx32K" --json F`.

    python python/bench/kernel_time.py --json py.json [--reps 20]
"""
import argparse
import json

import torch

import dsacp


def sparse_decode(H, reps, T=64, R=64, keys=32768, K=2048, page=64, Dl=512, Dr=64):
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(1)
    pages = (keys + page - 1) // page
    n = pages * R
    bt = torch.randperm(n, device=dev, generator=g).to(torch.int32).reshape(R, pages)
    bf = torch.bfloat16
    lat = torch.randn(n, page, Dl, device=dev, generator=g).to(bf)
    rope = torch.randn(n, page, Dr, device=dev, generator=g).to(bf)
    q_nope = torch.randn(T, H, Dl, device=dev, generator=g).to(bf)
    q_rope = torch.randn(T, H, Dr, device=dev, generator=g).to(bf)
    req = (torch.arange(T, device=dev) * R // T).to(torch.int32)
    klen = torch.full((T,), keys, dtype=torch.int32, device=dev)
    topk = torch.rand(T, keys, device=dev, generator=g).argsort(dim=1)[:, :K].sort(dim=1).values.to(torch.int32)
    out = torch.empty(T, H, Dl, dtype=bf, device=dev)
    lse = torch.empty(T, H, dtype=torch.float32, device=dev)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)

    def call():
        dsacp.sparse_mla(q_nope, q_rope, lat, rope, bt, req, klen, topk, 0.0721, out=out, lse=lse)

    for _ in range(3):
        call()
    dsacp.check_errors()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    v = []
    for i in range(reps):
        flush.fill_(i & 0xFF)
        a.record()
        call()
        b.record()
        b.synchronize()
        v.append(a.elapsed_time(b))
    dsacp.check_errors()
    v.sort()
    return v[len(v) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    rows = []
    for H in (128, 64):
        ms = sparse_decode(H, a.reps)
        name = f"sparse_decode b=64 ctx32K h={H}"
        rows.append({"name": name, "ms": ms})
        print(f"{name:44s} {ms:9.4f} ms (from Python, torch tensors)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
