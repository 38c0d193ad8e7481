#!/usr/bin/env python3
"""Plain-PyTorch baseline of the NCCL bus bandwidth (torch.distributed, one process per GPU), measured the way
dsacp_bench_cp measures its own communicator: all_gather_into_tensor and all_to_all_single, size = bytes
gathered / exchanged per rank, algbw = size / time, busbw = algbw * (n - 1) / n (nccl-tests).
Usage: torch_busbw.py [--json FILE] [--gpus N]"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, n, port, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=n, device_id=torch.device("cuda", rank))
    rows = []
    for op in ("all_gather", "all_to_all"):
        size = 1 << 20
        while size <= 1 << 30:
            send = torch.empty(size // n if op == "all_gather" else size, dtype=torch.uint8, device="cuda")
            recv = torch.empty(size, dtype=torch.uint8, device="cuda")
            iters = 10 if size >= 256 << 20 else 40

            def run():
                if op == "all_gather":
                    dist.all_gather_into_tensor(recv, send)
                else:
                    dist.all_to_all_single(recv, send)

            for _ in range(5):
                run()
            torch.cuda.synchronize()
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                run()
            end.record()
            torch.cuda.synchronize()
            us = start.elapsed_time(end) * 1000 / iters
            t = torch.tensor([us], device="cuda")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            us = t.item()
            algbw = size / (us * 1e-6) / 1e9
            rows.append({"op": op, "ranks": n, "bytes": size, "us": us, "algbw": algbw, "busbw": algbw * (n - 1) / n})
            if rank == 0:
                print(f"torch {op:10s} {size:12d} {us:10.1f} us  busbw {algbw * (n - 1) / n:7.1f} GB/s", flush=True)
            size <<= 1
    if rank == 0 and out_path:
        with open(out_path, "w") as f:
            json.dump({"torch": torch.__version__, "busbw": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    out = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
    n = int(sys.argv[sys.argv.index("--gpus") + 1]) if "--gpus" in sys.argv else torch.cuda.device_count()
    mp.spawn(worker, args=(n, 29500 + os.getpid() % 1000, out), nprocs=n, join=True)
