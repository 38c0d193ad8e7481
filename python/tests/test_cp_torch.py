"""The CP step over torch.distributed: 2 processes (torch.multiprocessing spawn, gloo over TCP; or torchrun:
``torchrun --nproc-per-node 2 python/tests/test_cp_torch.py``), each a CP rank of dsacp.cp_group on the CPU, every
layout of cp_case.py, their rows against the single-device planned step (the top-k bit for bit). Skipped without
torch (CI's environment has none)."""
import os
import pickle
import socket
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (CI has no CPU-only torch wheel to install)")

import dsacp  # noqa: E402
from cp_case import LAYOUTS, check_rank, reference, run_rank  # noqa: E402


def _ranks(outdir):
    """This process's rank of every layout (torch.distributed initialized), pickled to outdir/rank<cr>.pkl."""
    import torch.distributed as dist
    res = {}
    for name in sorted(LAYOUTS):
        g = dsacp.cp_group(**LAYOUTS[name], timeout=120)
        assert g.transport == "python collectives"
        res[name] = run_rank(g, torch_tensors=name.startswith("P2"))
    res["combined"] = run_rank(dsacp.cp_group(P=2, D=1, timeout=120), combined=True)
    with open(os.path.join(outdir, f"rank{dist.get_rank()}.pkl"), "wb") as f:
        pickle.dump(res, f)
    dist.barrier()


def _worker(rank, world, port, outdir):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        _ranks(outdir)
    finally:
        dist.destroy_process_group()


def check(outdir, n=2):
    ref = reference()
    per = [pickle.load(open(os.path.join(outdir, f"rank{r}.pkl"), "rb")) for r in range(n)]
    for name in per[0]:
        seen = set()
        for res in per:
            assert check_rank(res[name], ref) > 0, name
            seen.update((s, t) for s, r in enumerate(res[name]) for t in r[0] if t >= 0)
        assert seen == {(s, t) for s, (o, _, _) in enumerate(ref) for t in range(o.shape[0])}, name


def test_cp_over_torch_distributed_gloo_in_two_processes(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    check(str(tmp_path))


if __name__ == "__main__":  # torchrun --nproc-per-node 2 python/tests/test_cp_torch.py [OUTDIR]
    import torch.distributed as dist
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    dist.init_process_group("gloo")
    _ranks(out)
    if dist.get_rank() == 0:
        check(out, dist.get_world_size())
        print(f"cp over torchrun: {dist.get_world_size()} ranks, every layout's rows equal the single-device step")
    dist.destroy_process_group()
