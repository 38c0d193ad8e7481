"""Context parallelism from Python: ``group = dsacp.cp_group(P, D)`` once per process (one CP rank a process, as
``torchrun`` or ``torch.multiprocessing`` start them), ``plan = dsacp.cp_plan(group, ...)`` once per forward pass,
``dsacp.cp_run_layer(plan, caches, ...)`` per layer (the C++ API's cp_step_plan / cp_step_run, dsacp/cp_step_plan.h).

Rank ``cr = r * D + d`` of a ``P x D`` layout (PCP: prefill tokens split head / tail over the P ranks; DCP: heads,
or with ``dsa_cp`` tokens, split over the D ranks; the KV sharded over all P * D). Its communicators:

- CPU ranks (``device="cpu"``): torch.distributed over gloo (``TorchCollectives``): the world of the process group
  and its PCP / DCP subgroups (made here with ``dist.new_group``; every rank must call cp_group together). Host
  buffers go through torch.distributed as uint8 tensors over the same memory (no copy).
- CUDA ranks (``device="cuda:N"``): dsacp's NCCL communicators (the ones the C++ cluster and CLI use: its own
  stream, the exchange window, bounded waits), the ncclUniqueId made by rank 0 and broadcast through the process
  group. One GPU per rank: NCCL refuses two ranks on one GPU.
- ``collectives=(world, pcp, dcp)`` with ``rank=``: any objects with ``all_gather(send, recv)``,
  ``all_to_all(send, recv)``, ``broadcast(buf, root)``, ``barrier()`` (and optionally ``abort(reason)``) over
  1-D uint8 numpy arrays: another transport, or ranks as threads of one process (the tests).

A rank's inputs are its rows (``plan.num_rows``: ``plan.rows(x)`` selects them from full-batch tensors, padding
rows zero) with its heads (``plan.rows(q, heads=True)``); its outputs ``plan.output_rows`` rows of its heads, row
i holding token ``plan.row_token[i]`` (-1: padding). Its caches hold the KV it owns: pools of ``num_pages`` pages
addressed by the shared block table (the indexer keys ``plan.index_page_factor`` times that under the replicated
indexer), in the layouts run_layer takes (separate pools, vLLM's combined ``[pages, page_size, 576]`` KV with rope
None, fp8_ds_mla records).

A failure past the argument checks aborts the group (its later collectives fail at once); peers already waiting
in a gloo collective fail when its timeout (``timeout`` seconds) runs out. Make a new group after a failure.
"""
import datetime
import sys

from . import _dsacp
from .step import _TORCH_DTYPES, _caches, _name


class TorchCollectives:
    """A CP communicator's collectives over a torch.distributed process group (gloo for CPU tensors); each call
    blocks until done. The buffers are 1-D uint8 numpy arrays that the library owns for the call."""

    def __init__(self, group):
        import torch
        import torch.distributed as dist
        self._torch, self._dist, self.group = torch, dist, group
        self.size = dist.get_world_size(group)
        self._global = [dist.get_global_rank(group, i) for i in range(self.size)]
        self._a2a = True  # all_to_all_single until the backend refuses it

    def all_gather(self, send, recv):
        t = self._torch
        self._dist.all_gather(list(t.from_numpy(recv).chunk(self.size)), t.from_numpy(send), group=self.group)

    def all_to_all(self, send, recv):
        t = self._torch
        s, r = t.from_numpy(send), t.from_numpy(recv)
        if self._a2a:
            try:
                self._dist.all_to_all_single(r, s, group=self.group)
                return
            except RuntimeError:
                self._a2a = False  # (a backend without all_to_all: every rank meets the same refusal)
        n = s.numel() // self.size
        parts = [t.empty_like(s) for _ in range(self.size)]
        self._dist.all_gather(parts, s, group=self.group)
        me = self._dist.get_rank(self.group)
        for k in range(self.size):
            r[k * n:(k + 1) * n] = parts[k][me * n:(me + 1) * n]

    def broadcast(self, buf, root):
        self._dist.broadcast(self._torch.from_numpy(buf), src=self._global[root], group=self.group)

    def barrier(self):
        self._dist.barrier(group=self.group)

    def abort(self, reason):
        self.aborted = reason


def _subgroups(dist, pg, P, D, cr, backend, timeout):
    """(world, pcp, dcp) process groups of rank cr: every rank makes every group (new_group is collective)."""
    ranks = [dist.get_global_rank(pg, i) for i in range(P * D)] if pg is not None else list(range(P * D))
    kw = dict(backend=backend, timeout=datetime.timedelta(seconds=timeout))
    world = dist.new_group(ranks, **kw)
    pcp = dcp = None
    for d in range(D):  # PCP groups: the ranks with the same d, ranked by r
        g = dist.new_group([ranks[r * D + d] for r in range(P)], **kw)
        if cr % D == d:
            pcp = g
    for r in range(P):  # DCP groups: the ranks with the same r, ranked by d
        g = dist.new_group([ranks[r * D + d] for d in range(D)], **kw)
        if cr // D == r:
            dcp = g
    return world, pcp, dcp


def cp_group(P, D=1, *, process_group=None, device="cpu", collectives=None, rank=None, interleave=0,
             indexer="sharded", dsa_cp=False, decode_mode="local_merge", graph_bucket_tokens=0, timeout=600.0,
             threads=0, stream=None, window_bytes=None):
    """This process's CP rank of a ``P x D`` layout. With torch.distributed initialized, the rank is the process
    group's (``process_group``, default the world), which must have P * D ranks. ``device``: "cpu" (gloo
    collectives; ``threads`` of the CPU backend) or "cuda:N" (NCCL on GPU N, on ``stream``, default torch's
    current one: every cp_run_layer of the group runs there). The layout: ``interleave`` of the KV sharding (0: the
    page size), ``indexer`` "sharded" or "replicated", ``dsa_cp`` (D ranks split tokens), ``decode_mode``
    "local_merge" or "gathered", ``graph_bucket_tokens``; ``timeout`` (seconds) bounds every wait;
    ``window_bytes``: the NCCL exchange window (None: the library's default). Collective over the group's ranks."""
    device = _name(device)
    layout = dict(P=P, D=D, interleave=interleave, indexer=indexer, dsa_cp=dsa_cp, decode_mode=decode_mode,
                  graph_bucket_tokens=graph_bucket_tokens, timeout_ms=int(timeout * 1000))
    if collectives is not None:
        if rank is None or len(collectives) != 3:
            raise ValueError("cp_group: collectives=(world, pcp, dcp) goes with rank= (this rank's cr = r * D + d)")
        world, pcp, dcp = collectives
        return _dsacp._cp_group_collectives(world, pcp, dcp, rank, threads=threads, **layout)
    import torch.distributed as dist
    if not dist.is_initialized():
        raise ValueError("cp_group: torch.distributed is not initialized (dist.init_process_group first), and no "
                         "collectives= given")
    cr = dist.get_rank(process_group)
    n = dist.get_world_size(process_group)
    if n != P * D:
        raise ValueError(f"cp_group: the process group has {n} ranks, the layout P={P} x D={D} needs {P * D}")
    if rank is not None and rank != cr:
        raise ValueError(f"cp_group: rank={rank}, but this process is rank {cr} of the process group")
    if device == "cpu":
        groups = _subgroups(dist, process_group, P, D, cr, "gloo", timeout)
        world, pcp, dcp = (TorchCollectives(g) for g in groups)
        return _dsacp._cp_group_collectives(world, pcp, dcp, cr, threads=threads, **layout)
    if not device.startswith("cuda"):
        raise ValueError(f"cp_group: device={device!r}, expected \"cpu\" or \"cuda:N\"")
    import torch
    index = int(device[5:]) if len(device) > 5 else torch.cuda.current_device()
    if stream is None:
        stream = torch.cuda.current_stream(torch.device("cuda", index)).cuda_stream
    # Rank 0 makes the NCCL id; the process group carries it to the others.
    box = [_dsacp.nccl_make_id() if cr == 0 else None]
    src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    with torch.cuda.device(index):
        dist.broadcast_object_list(box, src=src, group=process_group)
    return _dsacp._cp_group_nccl(box[0], cr, device=index, stream=stream,
                                 window_bytes=-1 if window_bytes is None else int(window_bytes), **layout)


class CpStepPlan:
    """A CP rank's plan of one batch (from ``cp_plan``): ``num_rows``, ``output_rows``, ``row_token``,
    ``num_shared_rows``, ``head_begin``, ``num_heads``, ``pages_needed``, ``index_page_factor``, ``topk``,
    ``heads``, ``latent_dim``, ``rope_dim``, ``out_dtype``; ``rows(x)`` selects the rank's rows of a full-batch
    tensor. Keep it (and its group) alive while its runs may run."""

    def __init__(self, impl, group):
        self._impl, self.group = impl, group
        for k in ("num_rows", "output_rows", "num_shared_rows", "row_token", "head_begin", "num_heads",
                  "pages_needed", "index_page_factor", "topk", "heads", "latent_dim", "rope_dim", "out_dtype"):
            setattr(self, k, getattr(impl, k))

    def rows(self, x, heads=False):
        """This rank's rows of x ([T, ...]: numpy or torch), padding rows zero; with heads, also its heads (dim 1)."""
        tok = self.row_token
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(x, torch.Tensor):
            idx = torch.tensor([max(t, 0) for t in tok], dtype=torch.long, device=x.device)
            y = x.index_select(0, idx)
            pad = torch.tensor([t < 0 for t in tok], dtype=torch.bool, device=x.device)
            y[pad] = 0
        else:
            import numpy as np
            y = np.asarray(x)[np.maximum(np.asarray(tok, np.int64), 0)]
            y[np.asarray(tok) < 0] = 0
        if heads:
            y = y[:, self.head_begin:self.head_begin + self.num_heads]
            y = y.contiguous() if hasattr(y, "contiguous") else y.copy()
        return y

    run_scratch_bytes = property(lambda self: self._impl.run_scratch_bytes)

    def __repr__(self):
        return (f"dsacp.CpStepPlan(rank={self.group.rank}, rows={self.num_rows}, heads={self.head_begin}.."
                f"{self.head_begin + self.num_heads}, pages_needed={self.pages_needed})")


def cp_plan(group, query_lens, context_lens, block_table, *, num_pages, heads, scale, topk=2048, page_size=64,
            latent_dim=512, rope_dim=64, index_heads=64, index_dim=128, dtype="bf16", out_dtype="f32",
            cache_dtype=None, index_dtype=None, latent_cache="rows", index_scale_mode="fp32",
            latent_scale_mode="fp32", topk_form="canonical", lse_base="e", decode_threshold=16,
            device_block_table=None):
    """This rank's plan of one batch step: the arguments of ``dsacp.plan`` (the same batch and block table on every
    rank: the table addresses each rank's own pools of ``num_pages`` pages), on the group's device and stream.
    Every rank plans; none waits for another here."""
    impl = _dsacp.cp_plan(group, [int(x) for x in query_lens], [int(x) for x in context_lens], block_table,
                          num_pages=num_pages, heads=heads, scale=scale, topk=topk, page_size=page_size,
                          latent_dim=latent_dim, rope_dim=rope_dim, index_heads=index_heads, index_dim=index_dim,
                          dtype=_name(dtype), out_dtype=_name(out_dtype), cache_dtype=_name(cache_dtype),
                          index_dtype=index_dtype, latent_cache=latent_cache, index_scale_mode=index_scale_mode,
                          latent_scale_mode=latent_scale_mode, topk_form=topk_form, lse_base=lse_base,
                          decode_threshold=decode_threshold, device_block_table=device_block_table)
    return CpStepPlan(impl, group)


def cp_run_layer(plan, caches, q_nope, q_rope, kv_latent, k_rope, idx_q=None, idx_w=None, idx_k=None, *,
                 idx_q_scale=None, idx_k_scale=None, precomputed_topk=None, out=None, lse=None, topk=None,
                 stream=None):
    """One layer's step on this CP rank under ``plan``: the inputs are the rank's rows (``plan.rows``; q_nope /
    q_rope with its heads only), ``caches`` its pools as for ``run_layer``. Returns ``(out [output_rows,
    num_heads, Dl], lse [output_rows, num_heads], topk [output_rows, K])`` (into out= / lse= / topk= when given).
    Collective: every rank of the group runs each layer, in the same order."""
    latent, rope, index_keys = _caches(caches)
    torch = sys.modules.get("torch")
    impl = plan._impl if isinstance(plan, CpStepPlan) else plan
    if torch is not None and idx_q is not None and idx_q.dtype == torch.float8_e4m3fn:
        idx_q, idx_k = idx_q.view(torch.uint8), (idx_k.view(torch.uint8) if idx_k is not None else None)
    if (out is None or lse is None or topk is None) and torch is not None and isinstance(q_nope, torch.Tensor):
        R, H, dev = impl.output_rows, impl.num_heads, q_nope.device
        if out is None:
            out = torch.empty((R, H, impl.latent_dim), dtype=getattr(torch, _TORCH_DTYPES[impl.out_dtype]), device=dev)
        if lse is None:
            lse = torch.empty((R, H), dtype=torch.float32, device=dev)
        if topk is None:
            topk = torch.empty((R, impl.topk), dtype=torch.int32, device=dev)
    return _dsacp.cp_run_layer(impl, latent, rope, index_keys, q_nope, q_rope, kv_latent, k_rope, idx_q, idx_w,
                               idx_k, idx_q_scale=idx_q_scale, idx_k_scale=idx_k_scale,
                               precomputed_topk=precomputed_topk, out=out, lse=lse, topk=topk, stream=stream)
