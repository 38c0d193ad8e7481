"""The planned step: ``plan = dsacp.plan(...)`` once per forward pass, ``dsacp.run_layer(plan, caches, ...)`` per
layer (the C++ API's step_plan / step_run over a plan, dsacp/step_plan.h).

The plan does the batch's host work once: the checks of the block table against the requests, the new tokens'
slots and key lengths, the backend's kernel schedules and the workspace, uploaded once (a CUDA plan: in its
stream's order). A run only enqueues the layer's kernels (cache write, indexer + exact top-k or the caller's
precomputed top-k, sparse MLA, the outputs' serving forms) on the plan's stream: no host planning, no allocation,
no host synchronization; data errors the device finds come back from ``dsacp.check_errors()``. The layer's caches
are the caller's tensors, used in place: latent and rope pools ``[num_pages, page_size, Dl | Dr]`` of the plan's
cache dtype, or ``fp8_ds_mla`` records uint8 ``[num_pages, page_size, 656]`` (rope None); the indexer keys
``[num_pages, page_size, Di]``, or FP8 pages uint8 ``[num_pages, page_size * (Di + 4)]`` (``index_dtype="fp8"``).
"""
import itertools
import sys
import weakref

from . import _dsacp

_ids = itertools.count(1)
_plans = weakref.WeakValueDictionary()  # handle value -> StepPlan (torch_ops.run_layer finds its plan by it)

_TORCH_DTYPES = {"bf16": "bfloat16", "f32": "float32"}


class StepPlan:
    """The plan of one batch step (from ``dsacp.plan``). Attributes: ``topk`` (K), ``heads``, ``latent_dim``,
    ``rope_dim``, ``index_heads``, ``index_dim``, ``page_size``, ``dtype``, ``out_dtype``, ``cache_dtype``,
    ``latent_cache``, ``index_dtype``, ``num_tokens`` (T), ``device``, ``stream``, ``fingerprint``,
    ``pages_needed``, ``workspace_bytes``, and the host tables ``slots``, ``key_len``, ``token_request``. With torch,
    ``handle`` is a CPU int64 tensor naming the plan for ``torch.ops.dsacp.run_layer`` (torch.compile traces it as
    an input, so a new plan each forward pass does not recompile). Keep the plan alive while its runs (or CUDA
    graphs that captured them) may run."""

    def __init__(self, impl):
        self._impl = impl
        for k in ("topk", "heads", "latent_dim", "rope_dim", "index_heads", "index_dim", "page_size", "dtype",
                  "out_dtype", "cache_dtype", "latent_cache", "index_dtype", "num_tokens", "device", "stream"):
            setattr(self, k, getattr(impl, k))
        self.id = next(_ids)
        _plans[self.id] = self
        torch = sys.modules.get("torch")
        self.handle = torch.tensor([self.id], dtype=torch.int64) if torch is not None else None

    fingerprint = property(lambda self: self._impl.fingerprint)
    pages_needed = property(lambda self: self._impl.pages_needed)
    workspace_bytes = property(lambda self: self._impl.workspace_bytes)
    slots = property(lambda self: self._impl.slots)
    key_len = property(lambda self: self._impl.key_len)
    token_request = property(lambda self: self._impl.token_request)

    def cache_shapes(self, num_pages):
        """{"latent", "rope", "index_keys"} -> (shape, dtype name) of one layer's caches of num_pages pages in this
        plan's layout (rope None for fp8_ds_mla records)."""
        ps = self.page_size
        if self.latent_cache == "fp8_ds_mla":
            lat = ((num_pages, ps, self.latent_dim + self.latent_dim // 32 + 2 * self.rope_dim), "uint8")
            rope = None
        else:
            lat = ((num_pages, ps, self.latent_dim), self.cache_dtype)
            rope = ((num_pages, ps, self.rope_dim), self.cache_dtype)
        if self.index_dtype == "fp8":
            keys = ((num_pages, ps * (self.index_dim + 4)), "uint8")
        else:
            keys = ((num_pages, ps, self.index_dim), self.cache_dtype)
        return {"latent": lat, "rope": rope, "index_keys": keys}

    def empty_caches(self, num_pages=None, device=None):
        """One layer's caches as new zeroed torch tensors (latent, rope, index_keys) of num_pages pages (default
        pages_needed) on the plan's device (or `device`)."""
        import torch
        dev = self.device if device is None else device
        out = []
        for v in self.cache_shapes(self.pages_needed if num_pages is None else num_pages).values():
            out.append(None if v is None else torch.zeros(v[0], dtype=getattr(torch, _TORCH_DTYPES.get(v[1], v[1])),
                                                          device=dev))
        return tuple(out)

    def __repr__(self):
        return (f"dsacp.StepPlan(T={self.num_tokens}, H={self.heads}, K={self.topk}, page_size={self.page_size}, "
                f"device={self.device!r}, pages_needed={self.pages_needed})")


def _name(x):
    """A dtype or device given as torch's object, as the module's string."""
    if x is None or isinstance(x, str):
        return x
    s = str(x)
    return {"torch.bfloat16": "bf16", "torch.float32": "f32"}.get(s, s)


def plan(query_lens, context_lens, block_table, *, num_pages, heads, scale, topk=2048, page_size=64, latent_dim=512,
         rope_dim=64, index_heads=64, index_dim=128, dtype="bf16", out_dtype="f32", cache_dtype=None,
         index_dtype=None, latent_cache="rows", index_scale_mode="fp32", latent_scale_mode="fp32",
         topk_form="canonical", lse_base="e", decode_threshold=16, device=None, device_block_table=None,
         stream=None, threads=0, fingerprint=True):
    """The plan of one batch step, made once per forward pass and used by every layer's ``run_layer``.

    The batch: request i has ``query_lens[i]`` new tokens after ``context_lens[i]`` cached ones (decodes first: a
    request with context and at most decode_threshold new tokens), its pages in ``block_table[i]`` (a host int32
    ``[num_requests, max_pages]`` tensor; every position of every request must have a page < num_pages). The
    layer: ``heads`` query heads, ``latent_dim`` / ``rope_dim`` (Dl / Dr), ``index_heads`` / ``index_dim`` (Hi /
    Di), ``topk`` (K), softmax ``scale``; ``dtype`` of the activations ("bf16" / "f32" or torch dtypes),
    ``out_dtype``. The caches' layout: ``page_size``, ``cache_dtype`` (default dtype), ``latent_cache`` ("rows" or
    "fp8_ds_mla" records, whose latent is quantized per 128-value tile by ``latent_scale_mode``),
    ``index_dtype="fp8"`` for e4m3 indexer inputs and the FP8 132-byte key pages. Outputs: ``topk_form``
    "canonical" (request-relative positions) or "slots" (FlashMLA's ``page * page_size + offset``, -1 padded);
    ``lse_base`` "e" or "2".

    ``device``: "cpu" (default; ``threads`` of the CPU backend) or "cuda:N" (torch.device accepted); a CUDA plan
    runs on ``stream`` (default: torch's current stream), and every run_layer of it must run on that stream.
    ``device_block_table``: the same table already on the device (the engine's), read in place instead of an
    uploaded copy; the plan keeps a reference. Refused with ValueError naming the field (bad lengths, a block table
    that misses or exceeds the pages, dims that do not fit)."""
    if device is None:
        dbt = device_block_table
        device = str(dbt.device) if dbt is not None and hasattr(dbt, "device") and "cuda" in str(dbt.device) else "cpu"
    device = _name(device)
    if device.startswith("cuda") and stream is None:
        torch = sys.modules.get("torch")
        if torch is not None:
            stream = torch.cuda.current_stream(torch.device(device)).cuda_stream
    ql = [int(x) for x in query_lens]
    cl = [int(x) for x in context_lens]
    impl = _dsacp.plan(ql, cl, block_table, num_pages=num_pages, heads=heads, scale=scale, topk=topk,
                       page_size=page_size, latent_dim=latent_dim, rope_dim=rope_dim, index_heads=index_heads,
                       index_dim=index_dim, dtype=_name(dtype), out_dtype=_name(out_dtype),
                       cache_dtype=_name(cache_dtype), index_dtype=index_dtype, latent_cache=latent_cache,
                       index_scale_mode=index_scale_mode, latent_scale_mode=latent_scale_mode, topk_form=topk_form,
                       lse_base=lse_base, decode_threshold=decode_threshold, device=device,
                       device_block_table=device_block_table, stream=stream, threads=threads,
                       fingerprint=fingerprint)
    return StepPlan(impl)


def _caches(caches):
    if isinstance(caches, dict):
        return caches["latent"], caches.get("rope"), caches["index_keys"]
    if isinstance(caches, (tuple, list)):
        if len(caches) != 3:
            raise ValueError(f"run_layer: caches has {len(caches)} entries, expected (latent, rope, index_keys) "
                             "(rope None for fp8_ds_mla records)")
        return caches
    return caches.latent, caches.rope, caches.index_keys


def _plan_impl(plan):
    if isinstance(plan, StepPlan):
        return plan._impl
    if isinstance(plan, _dsacp.StepPlan):
        return plan
    raise TypeError(f"run_layer: plan is a {type(plan).__name__}, expected a dsacp.StepPlan (from dsacp.plan)")


def run_layer(plan, caches, q_nope, q_rope, kv_latent, k_rope, idx_q=None, idx_w=None, idx_k=None, *,
              idx_q_scale=None, idx_k_scale=None, precomputed_topk=None, out=None, lse=None, topk=None,
              workspace=None, stream=None, fingerprint=0):
    """One layer's step under ``plan``: the new tokens' latent, rope and indexer keys written into the caches at
    the plan's slots, the indexer scores and exact top-k (or ``precomputed_topk``, canonical positions, which
    skips the indexer: idx_q / idx_w / idx_k may then be None), sparse MLA over the chosen keys. Returns
    ``(out [T, H, Dl] of the plan's out_dtype, lse [T, H] float32, topk [T, K] int32)`` in the plan's serving forms,
    into ``out=`` / ``lse=`` / ``topk=`` when given (else new tensors: torch on the inputs' device for torch inputs,
    numpy for other CPU inputs).

    ``caches``: ``(latent, rope, index_keys)`` (or a dict / an object with those names) of the caller's tensors in
    the plan's layout, written in place (rope None with fp8_ds_mla records). Inputs: q_nope [T, H, Dl], q_rope
    [T, H, Dr], kv_latent [T, Dl], k_rope [T, Dr], idx_q [T, Hi, Di], idx_k [T, Di] of the plan's dtype (e4m3 with
    idx_q_scale [T, Hi] and idx_k_scale [T] for an FP8 indexer), idx_w [T, Hi] float32. ``workspace``: a uint8
    device tensor of at least plan.workspace_bytes lent for the run's scratch (default: the plan's own).
    ``fingerprint``: the batch's (plan.fingerprint of the plan the caller meant): refused when it is not this
    plan's. CUDA: runs on the plan's stream (the call's ``stream`` or torch's current stream must be it), returns
    without waiting. Argument errors (another device or batch size, a cache of another layout or too few pages,
    a wrong dtype or shape) raise ValueError naming the tensor."""
    impl = _plan_impl(plan)
    latent, rope, index_keys = _caches(caches)
    torch = sys.modules.get("torch")
    if torch is not None and idx_q is not None and idx_q.dtype == torch.float8_e4m3fn:
        # e4m3 as its bytes (torch versions whose DLPack export has no float8 code still pass; no copy)
        idx_q, idx_k = idx_q.view(torch.uint8), (idx_k.view(torch.uint8) if idx_k is not None else None)
    if out is None or lse is None or topk is None:
        if torch is not None and isinstance(q_nope, torch.Tensor):
            T, H = q_nope.shape[0], q_nope.shape[1]
            dev = q_nope.device
            if out is None:
                out = torch.empty((T, H, impl.latent_dim), dtype=getattr(torch, _TORCH_DTYPES[impl.out_dtype]),
                                  device=dev)
            if lse is None:
                lse = torch.empty((T, H), dtype=torch.float32, device=dev)
            if topk is None:
                topk = torch.empty((T, impl.topk), dtype=torch.int32, device=dev)
    return _dsacp.run_layer(impl, latent, rope, index_keys, q_nope, q_rope, kv_latent, k_rope, idx_q, idx_w, idx_k,
                            idx_q_scale=idx_q_scale, idx_k_scale=idx_k_scale, precomputed_topk=precomputed_topk,
                            out=out, lse=lse, topk=topk, workspace=workspace, stream=stream,
                            fingerprint=fingerprint)
