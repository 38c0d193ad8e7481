"""The ops as torch custom ops: ``torch.ops.dsacp.indexer_topk``, ``sparse_mla``, ``lse_merge`` and
``cache_write`` (which mutates its ``pool``), each with a fake (meta) implementation giving the outputs' shapes and
dtypes, so that ``torch.compile(fullgraph=True)`` traces a layer that calls them without a graph break and a CUDA
graph captures them. They run on torch's current stream; outputs are new torch tensors on the inputs' device:

- ``indexer_topk(...) -> topk`` int32 [T, K];
- ``sparse_mla(...) -> (out, lse)``: out [T, H, Dl] of q_nope's dtype, lse [T, H] float32;
- ``lse_merge(part_out, part_lse) -> (out, lse)``: out [rows, Dl] of part_out's dtype, lse [rows] float32;
- ``cache_write(rows, slots, pool, ...)``: in place.

The arguments are those of the functions in ``dsacp`` (their docstrings). Imported by ``import dsacp`` when torch
is importable.
"""
from typing import Optional, Tuple

import torch

from . import _dsacp

Tensor = torch.Tensor


def _stream(t: Tensor) -> Optional[int]:
    return torch._C._cuda_getCurrentRawStream(t.get_device()) if t.is_cuda else None


def _bytes(t: Optional[Tensor]) -> Optional[Tensor]:
    return t.view(torch.uint8) if t is not None and t.dtype == torch.float8_e4m3fn else t


@torch.library.custom_op("dsacp::indexer_topk", mutates_args=())
def indexer_topk(q: Tensor, w: Tensor, keys: Tensor, block_table: Tensor, request: Tensor, key_len: Tensor, K: int,
                 q_scale: Optional[Tensor] = None, host_request: Optional[Tensor] = None,
                 host_key_len: Optional[Tensor] = None, keys_page_size: int = 0) -> Tensor:
    out = torch.empty((q.shape[0], K), dtype=torch.int32, device=q.device)
    _dsacp.indexer_topk(_bytes(q), w, keys, block_table, request, key_len, K, q_scale=q_scale, out=out,
                        host_request=host_request, host_key_len=host_key_len, stream=_stream(q),
                        keys_page_size=keys_page_size)
    return out


@indexer_topk.register_fake
def _(q, w, keys, block_table, request, key_len, K, q_scale=None, host_request=None, host_key_len=None,
      keys_page_size=0):
    return q.new_empty((q.shape[0], K), dtype=torch.int32)


@torch.library.custom_op("dsacp::sparse_mla", mutates_args=())
def sparse_mla(q_nope: Tensor, q_rope: Tensor, latent: Tensor, rope: Optional[Tensor], block_table: Tensor,
               request: Tensor, key_len: Tensor, topk: Tensor, scale: float) -> Tuple[Tensor, Tensor]:
    out = torch.empty(q_nope.shape, dtype=q_nope.dtype, device=q_nope.device)
    lse = torch.empty(q_nope.shape[:2], dtype=torch.float32, device=q_nope.device)
    _dsacp.sparse_mla(q_nope, q_rope, latent, rope, block_table, request, key_len, topk, scale, out=out, lse=lse,
                      stream=_stream(q_nope))
    return out, lse


@sparse_mla.register_fake
def _(q_nope, q_rope, latent, rope, block_table, request, key_len, topk, scale):
    return torch.empty_like(q_nope), q_nope.new_empty(q_nope.shape[:2], dtype=torch.float32)


@torch.library.custom_op("dsacp::lse_merge", mutates_args=())
def lse_merge(part_out: Tensor, part_lse: Tensor) -> Tuple[Tensor, Tensor]:
    out = torch.empty(part_out.shape[1:], dtype=part_out.dtype, device=part_out.device)
    lse = torch.empty(part_out.shape[1:2], dtype=torch.float32, device=part_out.device)
    _dsacp.lse_merge(part_out, part_lse, out=out, lse=lse, stream=_stream(part_out))
    return out, lse


@lse_merge.register_fake
def _(part_out, part_lse):
    return part_out.new_empty(part_out.shape[1:]), part_out.new_empty(part_out.shape[1:2], dtype=torch.float32)


@torch.library.custom_op("dsacp::cache_write", mutates_args=("pool",))
def cache_write(rows: Tensor, slots: Tensor, pool: Tensor, rope_rows: Optional[Tensor] = None,
                row_scales: Optional[Tensor] = None, scale_mode: str = "fp32") -> None:
    _dsacp.cache_write(_bytes(rows), slots, pool, rope_rows=rope_rows, row_scales=row_scales, scale_mode=scale_mode,
                       stream=_stream(rows))


@cache_write.register_fake
def _(rows, slots, pool, rope_rows=None, row_scales=None, scale_mode="fp32"):
    return None
