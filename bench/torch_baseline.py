#!/usr/bin/env python3
"""Plain-PyTorch versions of the benchmarked computations, timed the same way as bench_gpu (CUDA events, L2
flushed with a 256 MiB memset before each run, median), plus the two measured ceilings (device copy, bf16 matmul).
Shapes match bench/bench_gpu.cc. Usage: torch_baseline.py [--json FILE] [--reps N] [--only NAME]"""
import argparse
import json
import math
import statistics

import torch

p = argparse.ArgumentParser()
p.add_argument("--json")
p.add_argument("--reps", type=int, default=10)
p.add_argument("--only", default="")
args = p.parse_args()
dev = "cuda"
flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
rows = []


def timed(fn, reps):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ts = []
    for i in range(reps):
        flush.fill_(i & 0xFF)
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def record(name, ms, flops, nbytes):
    rows.append({"name": name, "ms": ms, "tflops": flops / ms / 1e9, "gbs": nbytes / ms / 1e6})
    print(f"torch {name:44s} {ms:9.4f} ms {flops / ms / 1e9:8.1f} TFLOP/s {nbytes / ms / 1e6:8.1f} GB/s", flush=True)


def want(n):
    return not args.only or args.only in n


g = torch.Generator(device=dev)
g.manual_seed(1)


def rnd(*shape, scale=1.0):
    return ((torch.rand(*shape, device=dev, generator=g) * 2 - 1) * scale).to(torch.bfloat16)


# ---- ceilings ----
if want("ceiling"):
    x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    ms = timed(lambda: y.copy_(x), 10)
    record("ceiling d2d copy 1 GiB (read+write)", ms, 0, 2 * x.numel())
    del x, y
    a = rnd(8192, 8192)
    b = rnd(8192, 8192)
    ms = timed(lambda: a @ b, 10)
    record("ceiling bf16 matmul 8192^3", ms, 2 * 8192**3, 3 * 8192 * 8192 * 2)
    del a, b


# ---- sparse MLA: gather the chosen rows, two matmuls, fp32 softmax ----
def sparse_mla(name, T, H, keys_per_req, R, reps, chunk=None):
    K, page = 2048, 64
    kv = rnd(R * keys_per_req, 576)  # flat (page order irrelevant for the torch version)
    q = rnd(T, H, 576)
    req = torch.arange(T, device=dev) * R // T
    idx = torch.stack([torch.randperm(keys_per_req, device=dev)[:K].sort().values for _ in range(min(T, 256))])
    idx = idx.repeat((T + idx.shape[0] - 1) // idx.shape[0], 1)[:T]
    rows_ = req[:, None] * keys_per_req + idx  # [T, K]
    scale = 0.0721
    chunk = chunk or T

    def run():
        outs = []
        for t0 in range(0, T, chunk):
            r = rows_[t0:t0 + chunk]
            k = kv[r]  # [c, K, 576]
            s = torch.matmul(q[t0:t0 + chunk], k.transpose(1, 2)).float() * scale  # [c, H, K]
            lse = torch.logsumexp(s, -1)
            pr = torch.softmax(s, -1).to(torch.bfloat16)
            o = torch.matmul(pr, k[..., :512])
            outs.append((o, lse))
        return outs

    ms = timed(run, reps)
    flops = 2 * T * H * K * (576 + 512)
    kv_rows = min(T * K, R * keys_per_req)
    nbytes = kv_rows * 576 * 2 + T * H * 576 * 2 + T * H * 512 * 2 + T * H * 4 + T * K * 4
    record(name, ms, flops, nbytes)


if want("sparse_decode"):
    sparse_mla("sparse_decode b=64 ctx32K h=128", 64, 128, 32768, 64, args.reps)
    sparse_mla("sparse_decode b=64 ctx32K h=64", 64, 64, 32768, 64, args.reps)
    sparse_mla("sparse_decode b=64 ctx32K h=16", 64, 16, 32768, 64, args.reps)
    sparse_mla("sparse_decode b=64 ctx32K h=128 MTP2", 128, 128, 32768, 64, args.reps)
if want("sparse_prefill"):
    sparse_mla("sparse_prefill T=8192 keys8192 h=128", 8192, 128, 8192, 1, max(3, args.reps // 3), chunk=512)


# ---- indexer + top-k: logits, relu, weighted head sum, causal mask, torch.topk ----
# fp8: e4m3 keys with a f32 scale a key and e4m3 queries with a f32 scale a (token, head), as the FP8 indexer takes
# them; plain PyTorch upcasts them to bf16 for the matmul and applies both scales to the logits.
def indexer(name, R, ctx, qlen, reps, chunk=None, Hi=64, fp8=False):
    K, Di = 2048, 128
    total = ctx + qlen
    keys = rnd(R, total, Di)
    T = R * qlen
    q = rnd(T, Hi, Di)
    w = ((torch.rand(T, Hi, device=dev, generator=g) * 2 - 1) * 0.125)
    chunk = chunk or qlen
    if fp8:
        keys8 = (keys.float() * 400).to(torch.float8_e4m3fn)
        sk = torch.rand(R, total, device=dev, generator=g) * 0.01 + 0.01
        q8 = (q.float() * 400).to(torch.float8_e4m3fn)
        sq = torch.rand(T, Hi, device=dev, generator=g) + 0.5
        del keys, q

        def run_batched():
            logits = torch.einsum("bhd,bsd->bhs", q8.view(R, qlen * Hi, Di).to(torch.bfloat16),
                                  keys8.to(torch.bfloat16)).float().view(R, qlen, Hi, total)
            logits = logits * sq.view(R, qlen, Hi, 1) * sk.view(R, 1, 1, total)
            s = (logits.relu() * w.view(R, qlen, Hi, 1)).sum(2)  # [R, qlen, total]
            pos = torch.arange(total, device=dev)
            vis = ctx + torch.arange(qlen, device=dev)[:, None]
            s = s.masked_fill(pos[None, None, :] > vis[None], float("-inf"))
            return torch.topk(s, min(K, total), dim=-1).indices.sort(-1).values

        def run_prefill():
            res = []
            for t0 in range(0, qlen, chunk):
                c = min(qlen, t0 + chunk) - t0
                logits = torch.matmul(q8[t0:t0 + c].to(torch.bfloat16), keys8[0].to(torch.bfloat16).T).float()
                s = ((logits * sq[t0:t0 + c, :, None] * sk[0][None, None, :]).relu() * w[t0:t0 + c, :, None]).sum(1)
                pos = torch.arange(total, device=dev)
                vis = ctx + t0 + torch.arange(c, device=dev)[:, None]
                s = s.masked_fill(pos[None, :] > vis, float("-inf"))
                res.append(torch.topk(s, min(K, total), dim=-1).indices.sort(-1).values)
            return res

        ms = timed(run_prefill if R == 1 else run_batched, reps)
        visible = sum(ctx + i + 1 for i in range(qlen)) * R
        record(name, ms, 2 * Hi * Di * visible, R * total * (Di + 4) + T * Hi * (Di + 8) + T * K * 4)
        return

    def run():
        res = []
        for b in range(R):
            for t0 in range(0, qlen, chunk):
                qs = q[b * qlen + t0: b * qlen + min(qlen, t0 + chunk)]  # [c, Hi, Di]
                c = qs.shape[0]
                logits = torch.matmul(qs, keys[b].T)  # [c, Hi, total] bf16
                s = (logits.float().relu() * w[b * qlen + t0: b * qlen + t0 + c, :, None]).sum(1)  # [c, total]
                pos = torch.arange(total, device=dev)
                vis = ctx + t0 + torch.arange(c, device=dev)[:, None]
                s = s.masked_fill(pos[None, :] > vis, float("-inf"))
                res.append(torch.topk(s, min(K, total), dim=-1).indices.sort(-1).values)
        return res

    def run_batched():  # decode: all requests at once
        logits = torch.einsum("bhd,bsd->bhs", q.view(R, Hi, Di), keys)  # [R, Hi, total]
        s = (logits.float().relu() * w[:, :, None]).sum(1)
        return torch.topk(s, K, dim=-1).indices.sort(-1).values

    fn = run_batched if qlen == 1 else run
    ms = timed(fn, reps)
    visible = sum(ctx + i + 1 for i in range(qlen)) * R
    flops = 2 * Hi * Di * visible
    nbytes = R * total * Di * 2 + T * Hi * Di * 2 + T * Hi * 4 + T * K * 4
    record(name, ms, flops, nbytes)


if want("indexer_prefill"):
    indexer("indexer_prefill T=8192 causal", 1, 0, 8192, max(3, args.reps // 3), chunk=512)
if want("indexer_decode"):
    indexer("indexer_decode b=64 ctx32K", 64, 32768 - 1, 1, args.reps)
    indexer("indexer_decode b=64 ctx128K", 64, 131072 - 1, 1, args.reps)

if want("indexer_fp8"):
    for hi in (64, 32):
        for ctx in (32768, 131072):
            for nn in ((1, 2, 4) if hi == 64 else (1,)):
                indexer(f"indexer_fp8 decode b=64 ctx{ctx // 1024}K next_n={nn} Hi={hi}", 64, ctx - nn, nn, args.reps,
                        Hi=hi, fp8=True)
        indexer(f"indexer_fp8 prefill T=8192 causal Hi={hi}", 1, 0, 8192, max(3, args.reps // 3), chunk=512, Hi=hi,
                fp8=True)

# ---- the top-k alone on given scores (bench_gpu's topk_* rows: normal scores, sigma 1.5, f32): torch.topk, then
# the positions sorted; not canonical (ties are not broken by position, short rows not -1 padded) ----
def topk_alone(name, R, ctx, reps, causal=False):
    K = 2048
    s = torch.randn(R, ctx, device=dev, generator=g) * 1.5
    if causal:  # row i sees keys [0, i]
        s = s.masked_fill(torch.ones(R, ctx, device=dev, dtype=torch.bool).triu(1), float("-inf"))
    ms = timed(lambda: torch.topk(s, K, dim=-1).indices.sort(-1).values, reps)
    record(name, ms, 0, s.numel() * 4 + R * K * 4)


for ctx in (32768, 65536, 131072):
    if want(f"topk_decode{ctx // 1024}K"):
        topk_alone(f"topk b=64 ctx{ctx // 1024}K K=2048", 64, ctx, args.reps)
if want("topk_prefill"):
    topk_alone("topk prefill T=8192 causal K=2048", 8192, 8192, max(3, args.reps // 3), causal=True)

if args.json:
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": rows}, f, indent=1)
