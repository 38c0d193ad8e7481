"""The ops as torch operators: ``torch.ops.dsacp.indexer_topk``, ``sparse_mla``, ``lse_merge``, ``cache_write``
(which mutates its ``pool``) and ``run_layer`` (the planned step of one layer, mutating the layer's caches), each
with a fake (meta) implementation giving the outputs' shapes and dtypes, so that ``torch.compile(fullgraph=True)``
traces a layer that calls them without a graph break and a CUDA graph captures them. They run on torch's current
stream; outputs are new torch tensors on the inputs' device:

- ``indexer_topk(...) -> topk`` int32 [T, K];
- ``sparse_mla(...) -> (out, lse)``: out [T, H, Dl] of q_nope's dtype, lse [T, H] float32;
- ``lse_merge(part_out, part_lse) -> (out, lse)``: out [rows, Dl] of part_out's dtype, lse [rows] float32;
- ``cache_write(rows, slots, pool, ...)``: in place;
- ``run_layer(plan_handle, K, out_dtype, latent, rope, index_keys, q_nope, ...) -> (out, lse, topk)``; call it
  through ``dsacp.torch_ops.run_layer(plan, caches, ...)``, which passes the plan as its handle tensor (a traced
  input: a new plan each forward pass does not recompile a compiled layer).

The operators are defined with ``torch.library.Library`` (schema, one backend-agnostic kernel, a fake kernel) rather
than ``torch.library.custom_op``, whose Python autograd and checking layers cost ~2x the dispatch of an eager call.
The arguments are those of the functions in ``dsacp`` (their docstrings). Imported by ``import dsacp`` when torch
is importable.
"""
from typing import Optional

import torch

from . import _dsacp
from .step import _caches, _plans

Tensor = torch.Tensor
_lib = torch.library.Library("dsacp", "DEF")
_F8 = getattr(torch, "float8_e4m3fn", None)
_OUT_DTYPE = {"bf16": torch.bfloat16, "f32": torch.float32}


def _bytes(t: Optional[Tensor]) -> Optional[Tensor]:
    return t.view(torch.uint8) if t is not None and t.dtype == _F8 else t


def _define(schema, kernel, fake):
    name = schema.split("(", 1)[0]
    _lib.define(schema)
    _lib.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake("dsacp::" + name, fake, lib=_lib)


def _indexer_topk(q, w, keys, block_table, request, key_len, K, q_scale=None, host_request=None, host_key_len=None,
                  keys_page_size=0):
    out = w.new_empty((q.shape[0], K), dtype=torch.int32)
    _dsacp.indexer_topk(_bytes(q), w, keys, block_table, request, key_len, K, q_scale=q_scale, out=out,
                        host_request=host_request, host_key_len=host_key_len, keys_page_size=keys_page_size)
    return out


def _indexer_topk_fake(q, w, keys, block_table, request, key_len, K, q_scale=None, host_request=None,
                       host_key_len=None, keys_page_size=0):
    return q.new_empty((q.shape[0], K), dtype=torch.int32)


_define("indexer_topk(Tensor q, Tensor w, Tensor keys, Tensor block_table, Tensor request, Tensor key_len, int K, "
        "Tensor? q_scale=None, Tensor? host_request=None, Tensor? host_key_len=None, int keys_page_size=0) -> Tensor",
        _indexer_topk, _indexer_topk_fake)


def _sparse_mla(q_nope, q_rope, latent, rope, block_table, request, key_len, topk, scale):
    T, H, Dl = q_nope.shape
    out = q_nope.new_empty((T, H, Dl))
    lse = q_nope.new_empty((T, H), dtype=torch.float32)
    _dsacp.sparse_mla(q_nope, q_rope, latent, rope, block_table, request, key_len, topk, scale, out=out, lse=lse)
    return out, lse


def _sparse_mla_fake(q_nope, q_rope, latent, rope, block_table, request, key_len, topk, scale):
    return torch.empty_like(q_nope), q_nope.new_empty(q_nope.shape[:2], dtype=torch.float32)


_define("sparse_mla(Tensor q_nope, Tensor q_rope, Tensor latent, Tensor? rope, Tensor block_table, Tensor request, "
        "Tensor key_len, Tensor topk, float scale) -> (Tensor, Tensor)", _sparse_mla, _sparse_mla_fake)


def _lse_merge(part_out, part_lse):
    _, rows, Dl = part_out.shape
    out = part_out.new_empty((rows, Dl))  # (new_empty of an int tuple: the cheapest allocation from Python)
    lse = part_lse.new_empty((rows,))
    _dsacp.lse_merge(part_out, part_lse, out=out, lse=lse)
    return out, lse


def _lse_merge_fake(part_out, part_lse):
    return part_out.new_empty(part_out.shape[1:]), part_out.new_empty(part_out.shape[1:2], dtype=torch.float32)


_define("lse_merge(Tensor part_out, Tensor part_lse) -> (Tensor, Tensor)", _lse_merge, _lse_merge_fake)


def _cache_write(rows, slots, pool, rope_rows=None, row_scales=None, scale_mode="fp32"):
    _dsacp.cache_write(_bytes(rows), slots, pool, rope_rows=rope_rows, row_scales=row_scales, scale_mode=scale_mode)


def _cache_write_fake(rows, slots, pool, rope_rows=None, row_scales=None, scale_mode="fp32"):
    return None


_define("cache_write(Tensor rows, Tensor slots, Tensor(a!) pool, Tensor? rope_rows=None, Tensor? row_scales=None, "
        "str scale_mode=\"fp32\") -> ()", _cache_write, _cache_write_fake)


def _plan_of(handle):
    p = _plans.get(int(handle))
    if p is None:
        raise ValueError(f"run_layer: plan handle {int(handle)} names no live plan (the StepPlan was freed: keep it "
                         "alive while its layers run)")
    return p


def _run_layer(plan, K, out_dtype, latent, rope, index_keys, q_nope, q_rope, kv_latent, k_rope, idx_q=None,
               idx_w=None, idx_k=None, idx_q_scale=None, idx_k_scale=None, precomputed_topk=None):
    p = _plan_of(plan)
    T, H = q_nope.shape[0], q_nope.shape[1]
    out = torch.empty((T, H, p.latent_dim), dtype=out_dtype, device=q_nope.device)
    lse = torch.empty((T, H), dtype=torch.float32, device=q_nope.device)
    topk = torch.empty((T, K), dtype=torch.int32, device=q_nope.device)
    _dsacp.run_layer(p._impl, latent, rope, index_keys, q_nope, q_rope, kv_latent, k_rope, _bytes(idx_q), idx_w,
                     _bytes(idx_k), idx_q_scale=idx_q_scale, idx_k_scale=idx_k_scale,
                     precomputed_topk=precomputed_topk, out=out, lse=lse, topk=topk)
    return out, lse, topk


def _run_layer_fake(plan, K, out_dtype, latent, rope, index_keys, q_nope, q_rope, kv_latent, k_rope, idx_q=None,
                    idx_w=None, idx_k=None, idx_q_scale=None, idx_k_scale=None, precomputed_topk=None):
    T, H = q_nope.shape[0], q_nope.shape[1]
    return (q_nope.new_empty((T, H, kv_latent.shape[1]), dtype=out_dtype),
            q_nope.new_empty((T, H), dtype=torch.float32), q_nope.new_empty((T, K), dtype=torch.int32))


_define("run_layer(Tensor plan, int K, ScalarType out_dtype, Tensor(a!) latent, Tensor(b!)? rope, "
        "Tensor(c!) index_keys, Tensor q_nope, Tensor q_rope, Tensor kv_latent, Tensor k_rope, Tensor? idx_q=None, "
        "Tensor? idx_w=None, Tensor? idx_k=None, Tensor? idx_q_scale=None, Tensor? idx_k_scale=None, "
        "Tensor? precomputed_topk=None) -> (Tensor, Tensor, Tensor)", _run_layer, _run_layer_fake)


def run_layer(plan, caches, q_nope, q_rope, kv_latent, k_rope, idx_q=None, idx_w=None, idx_k=None, *,
              idx_q_scale=None, idx_k_scale=None, precomputed_topk=None):
    """``dsacp.run_layer`` as the torch operator ``torch.ops.dsacp.run_layer`` (traceable by torch.compile, captured
    by CUDA graphs): returns new ``(out, lse, topk)``. The plan must have been made with torch imported (its
    ``handle``)."""
    latent, rope, index_keys = _caches(caches)
    return torch.ops.dsacp.run_layer(plan.handle, plan.topk, _OUT_DTYPE[plan.out_dtype], latent, rope, index_keys,
                                     q_nope, q_rope, kv_latent, k_rope, idx_q, idx_w, idx_k, idx_q_scale,
                                     idx_k_scale, precomputed_topk)
