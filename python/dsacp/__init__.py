"""dsacp: DeepSeek Sparse Attention with context parallelism.

The step's kernels over DLPack tensors (numpy, torch, jax, cupy), zero-copy: inputs are read where they are,
outputs go into the caller's tensors when given (``out=``) or into new numpy arrays. Shapes use the library's
vocabulary (T tokens, H heads, Dl latent, Dr rope, Hi / Di indexer heads / dim, K top-k, paged pools
``[num_pages, page_size, dim]``); the math is the contract's (docs/contract.md). Bad arguments raise ValueError
with a one-line message naming the tensor and what was expected; file errors raise OSError; device and
communication failures RuntimeError.

This build's ops run on the CPU backend (the oracle); CUDA tensors and the planned per-layer step come with the
serving API.
"""
from ._dsacp import cache_write, indexer_topk, lse_merge, make_case, replay, sparse_mla

__all__ = ["cache_write", "indexer_topk", "lse_merge", "make_case", "replay", "sparse_mla"]
__version__ = "0.1.0"
