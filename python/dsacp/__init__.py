"""dsacp: DeepSeek Sparse Attention with context parallelism.

The step's kernels over DLPack tensors (numpy, torch, jax, cupy), zero-copy: inputs are read where they are,
outputs go into the caller's tensors when given (``out=``) or into new arrays. Shapes use the library's
vocabulary (T tokens, H heads, Dl latent, Dr rope, Hi / Di indexer heads / dim, K top-k, paged pools
``[num_pages, page_size, dim]``); the math is the contract's (docs/contract.md). Bad arguments raise ValueError
with a one-line message naming the tensor and what was expected; file errors raise OSError; device and
communication failures RuntimeError.

Every tensor of a call is on the CPU (the CPU backend, the oracle) or on one CUDA device (the CUDA backend of a
CUDA build). CUDA calls run on the caller's stream (``stream=``; for torch tensors torch's current stream by default),
never wait for the GPU, and keep the data errors the device finds (a bad page id, slot or index) for the next
``check_errors()``. Without ``out=`` a call on torch CUDA tensors allocates its outputs with torch on the inputs'
device (numpy arrays for CPU inputs). ``dsacp.torch_ops`` (imported when torch is) registers the ops as torch
custom ops (``torch.ops.dsacp.*``) for ``torch.compile`` and CUDA graphs.

The planned step: ``plan = dsacp.plan(...)`` once per forward pass (the batch's host work, uploaded once), then
``dsacp.run_layer(plan, caches, ...)`` for each layer (kernels only, into the caller's caches and outputs).
Context parallelism: ``group = dsacp.cp_group(P, D)`` per process (torch.distributed: gloo on the CPU, dsacp's NCCL
communicators on CUDA), ``dsacp.cp_plan(group, ...)`` per forward pass, ``dsacp.cp_run_layer(plan, ...)`` per layer.
"""
import importlib.util
import sys

_HAVE_TORCH = "torch" in sys.modules or importlib.util.find_spec("torch") is not None
if _HAVE_TORCH:
    # torch before the module: a CUDA build of the module links the system's NCCL, and a libnccl.so.2 loaded first
    # would be the one torch's CUDA library binds to (same soname), which may lack the symbols torch needs.
    import torch  # noqa: F401

from . import _dsacp
from ._dsacp import check_errors, make_case, replay
from .step import StepPlan, plan, run_layer
from .cp import CpStepPlan, TorchCollectives, cp_group, cp_plan, cp_run_layer
from ._dsacp import nccl_available


def _torch_cuda(x):
    """torch when x is a torch CUDA tensor (then outputs are allocated with torch on its device), else None."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor) and x.is_cuda:
        return torch
    return None


def _bytes(x):
    """A float8_e4m3fn torch tensor as its uint8 bytes (the kernels read them as e4m3; no copy): torch versions
    whose DLPack export has no float8 code still pass."""
    dt = getattr(x, "dtype", None)
    if dt is not None and str(dt) == "torch.float8_e4m3fn":
        return x.view(sys.modules["torch"].uint8)
    return x


# The wrappers add to the module's functions only what torch needs: outputs allocated on a torch CUDA input's
# device when not given. The stream (torch's current one for torch tensors) is looked up by the module itself.

def indexer_topk(q, w, keys, block_table, request, key_len, K, *, q_scale=None, out=None, return_scores=False,
                 scores=None, host_request=None, host_key_len=None, stream=None, threads=0, keys_page_size=0):
    q = _bytes(q)
    if out is None or (return_scores and scores is None):
        torch = _torch_cuda(q)
        if torch is not None:
            if out is None:
                out = torch.empty((q.shape[0], K), dtype=torch.int32, device=q.device)
            if return_scores and scores is None:
                scores = torch.empty((q.shape[0], K), dtype=torch.float32, device=q.device)
    return _dsacp.indexer_topk(q, w, keys, block_table, request, key_len, K, q_scale=q_scale, out=out,
                               return_scores=return_scores, scores=scores, host_request=host_request,
                               host_key_len=host_key_len, stream=stream, threads=threads,
                               keys_page_size=keys_page_size)


def sparse_mla(q_nope, q_rope, latent, rope, block_table, request, key_len, topk, scale, *, out=None, lse=None,
               stream=None, threads=0):
    if out is None or lse is None:
        torch = _torch_cuda(q_nope)
        if torch is not None:
            if out is None:
                out = torch.empty(q_nope.shape, dtype=torch.float32, device=q_nope.device)
            if lse is None:
                lse = torch.empty(q_nope.shape[:2], dtype=torch.float32, device=q_nope.device)
    return _dsacp.sparse_mla(q_nope, q_rope, latent, rope, block_table, request, key_len, topk, scale, out=out,
                             lse=lse, stream=stream, threads=threads)


def lse_merge(part_out, part_lse, *, out=None, lse=None, stream=None, threads=0):
    if out is None or lse is None:
        torch = _torch_cuda(part_out)
        if torch is not None:
            if out is None:
                out = torch.empty(part_out.shape[1:], dtype=torch.float32, device=part_out.device)
            if lse is None:
                lse = torch.empty(part_out.shape[1:2], dtype=torch.float32, device=part_out.device)
    return _dsacp.lse_merge(part_out, part_lse, out=out, lse=lse, stream=stream, threads=threads)


def cache_write(rows, slots, pool, *, rope_rows=None, row_scales=None, scale_mode="fp32", stream=None, threads=0):
    _dsacp.cache_write(_bytes(rows), slots, pool, rope_rows=rope_rows, row_scales=row_scales, scale_mode=scale_mode,
                       stream=stream, threads=threads)


for _f in (indexer_topk, sparse_mla, lse_merge, cache_write, plan, run_layer):
    if _f.__doc__ is None:
        _f.__doc__ = getattr(_dsacp, _f.__name__).__doc__

__all__ = ["CpStepPlan", "StepPlan", "TorchCollectives", "cache_write", "check_errors", "cp_group", "cp_plan",
           "cp_run_layer", "indexer_topk", "lse_merge", "make_case", "nccl_available", "plan", "replay", "run_layer",
           "sparse_mla"]
__version__ = "0.1.0"

if _HAVE_TORCH:
    from . import torch_ops  # noqa: E402,F401  (registers torch.ops.dsacp.*)
