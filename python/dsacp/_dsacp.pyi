"""
dsacp: DeepSeek Sparse Attention with context parallelism (the C++ library's kernels and replay)
"""

from collections.abc import Sequence
from typing import Annotated

from numpy.typing import NDArray


def indexer_topk(q: Annotated[NDArray, dict(writable=False)], w: Annotated[NDArray, dict(writable=False)], keys: object, block_table: Annotated[NDArray, dict(writable=False)], request: Annotated[NDArray, dict(writable=False)], key_len: Annotated[NDArray, dict(writable=False)], K: int, *, q_scale: Annotated[NDArray, dict(writable=False)] | None = None, out: object | None = None, return_scores: bool = False, scores: object | None = None, host_request: Annotated[NDArray, dict(writable=False)] | None = None, host_key_len: Annotated[NDArray, dict(writable=False)] | None = None, stream: int | None = None, threads: int = 0, keys_page_size: int = 0) -> object:
    """
    Lightning indexer scores and the exact canonical top-k.

    s(t, j) = sum_h w[t, h] * relu(q[t, h, :] . k[j, :]) over the keys j < key_len[t] of request request[t]; the K
    highest, ties to the lower position, ascending, -1 padded (NaN lowest). FP8: q float8_e4m3fn with q_scale [T, Hi],
    keys as uint8 two-plane pages.

    q [T, Hi, Di] f32/bf16/float8_e4m3fn; w [T, Hi] f32; keys [num_pages, page_size, Di] f32/bf16, or uint8
    [num_pages, page_size, Di + 4] / [num_pages, page_size * (Di + 4)] (FP8 pages; keys_page_size names the page size
    of the 2-D form when it is ambiguous); block_table [R, max_pages] int32; request, key_len [T] int32.
    Returns topk [T, K] int32 (into out= when given), and the chosen scores [T, K] f32 with return_scores=True (or
    into scores=). host_request / host_key_len: CPU int32 [T] copies of request / key_len, from which a CUDA call plans
    its launch; without them it reads the two rows back (a host wait behind the stream's work, not allowed inside a
    CUDA graph capture; a captured call replays the plan of the lengths it was captured with).

    Tensors: all on the CPU (numpy, torch, ...) or all on one CUDA device (torch, cupy, jax: used in place). CUDA
    calls run on the stream `stream` (a cudaStream_t as an int; None or 0: the legacy default stream; the dsacp
    package's wrappers pass torch's current stream), write into the caller's outputs (out=, lse=, scores=: the package
    wrappers allocate them on the inputs' device when not given) and return without waiting for the GPU: a data error
    the device finds (a bad page id, slot or index) is raised by the next check_errors(). Argument errors (shape,
    dtype, device, contiguity) raise ValueError at the call.
    """

def sparse_mla(q_nope: Annotated[NDArray, dict(writable=False)], q_rope: Annotated[NDArray, dict(writable=False)], latent: object, rope: object | None, block_table: Annotated[NDArray, dict(writable=False)], request: Annotated[NDArray, dict(writable=False)], key_len: Annotated[NDArray, dict(writable=False)], topk: Annotated[NDArray, dict(writable=False)], scale: float, *, out: object | None = None, lse: object | None = None, stream: int | None = None, threads: int = 0) -> tuple:
    """
    Sparse MLA attention over the chosen keys, with natural-log LSE.

    l(h, j) = scale * (q_nope[t, h] . latent[j] + q_rope[t, h] . rope[j]) for the entries j of topk[t] that are in
    [0, key_len[t]) (front-packed, -1 padded); out = softmax(l) @ latent, lse = ln sum exp l; a row with no key
    gives out = 0, lse = -inf. q_nope [T, H, Dl], q_rope [T, H, Dr] (f32 or bf16, one dtype); latent [num_pages,
    page_size, Dl], rope [num_pages, page_size, Dr]; or latent the fp8_ds_mla record cache as vLLM holds it (uint8
    [num_pages, page_size, Dl + 4 * Dl / 128 + 2 * Dr]: 656 bytes a token for Dl 512, Dr 64) and rope None;
    block_table, request, key_len as indexer_topk; topk [T, K] int32. Returns (out [T, H, Dl], lse [T, H]); out= may
    be f32 or bf16.

    Tensors: all on the CPU (numpy, torch, ...) or all on one CUDA device (torch, cupy, jax: used in place). CUDA
    calls run on the stream `stream` (a cudaStream_t as an int; None or 0: the legacy default stream; the dsacp
    package's wrappers pass torch's current stream), write into the caller's outputs (out=, lse=, scores=: the package
    wrappers allocate them on the inputs' device when not given) and return without waiting for the GPU: a data error
    the device finds (a bad page id, slot or index) is raised by the next check_errors(). Argument errors (shape,
    dtype, device, contiguity) raise ValueError at the call.
    """

def lse_merge(part_out: Annotated[NDArray, dict(writable=False)], part_lse: Annotated[NDArray, dict(writable=False)], *, out: object | None = None, lse: object | None = None, stream: int | None = None, threads: int = 0) -> tuple:
    """
    Exact merge of S partial attention results over disjoint key sets by their LSE.

    part_out [S, rows, Dl] f32/bf16, part_lse [S, rows] f32 -> (out [rows, Dl], lse [rows]); a part whose lse is
    not finite counts as empty; all empty -> out 0, lse -inf.

    Tensors: all on the CPU (numpy, torch, ...) or all on one CUDA device (torch, cupy, jax: used in place). CUDA
    calls run on the stream `stream` (a cudaStream_t as an int; None or 0: the legacy default stream; the dsacp
    package's wrappers pass torch's current stream), write into the caller's outputs (out=, lse=, scores=: the package
    wrappers allocate them on the inputs' device when not given) and return without waiting for the GPU: a data error
    the device finds (a bad page id, slot or index) is raised by the next check_errors(). Argument errors (shape,
    dtype, device, contiguity) raise ValueError at the call.
    """

def cache_write(rows: Annotated[NDArray, dict(writable=False)], slots: Annotated[NDArray, dict(writable=False)], pool: object, *, rope_rows: Annotated[NDArray, dict(writable=False)] | None = None, row_scales: Annotated[NDArray, dict(writable=False)] | None = None, scale_mode: str = 'fp32', stream: int | None = None, threads: int = 0) -> None:
    """
    Scatters rows into flat slots of a paged pool, in place: pool[slot // page_size, slot % page_size] = rows[t].

    rows [T, dim] f32/bf16 (or float8_e4m3fn with row_scales [T]); slots [T] int64 (-1 skips a row); pool
    [num_pages, page_size, dim] f32/bf16, or uint8 FP8 pages (rows are quantized with scale_mode "fp32" or
    "ue8m0"), or uint8 fp8_ds_mla records [num_pages, page_size, dim + 4 * dim / 128 + 2 * Dr] (the latent rows
    quantized per 128-value tile, or float8_e4m3fn rows with row_scales [T, dim / 128]; rope_rows [T, Dr] f32/bf16
    stored as bf16 in the same records).

    Tensors: all on the CPU (numpy, torch, ...) or all on one CUDA device (torch, cupy, jax: used in place). CUDA
    calls run on the stream `stream` (a cudaStream_t as an int; None or 0: the legacy default stream; the dsacp
    package's wrappers pass torch's current stream), write into the caller's outputs (out=, lse=, scores=: the package
    wrappers allocate them on the inputs' device when not given) and return without waiting for the GPU: a data error
    the device finds (a bad page id, slot or index) is raised by the next check_errors(). Argument errors (shape,
    dtype, device, contiguity) raise ValueError at the call.
    """

def check_errors() -> None:
    """
    Waits for the CUDA work of every op so far and raises the first data error a kernel found since the last
    check (ValueError naming the kernel and the row). Does nothing when no op ran on CUDA tensors.
    """

def replay(case_path: str, out_path: str | None = None, *, page_size: int = 64, out_dtype: str = 'f32', pcp: int = 1, dcp: int = 1, interleave: int = 0, indexer: str = 'sharded', dsa_cp: bool = False, threads: int = 0) -> dict:
    """
    Runs the batch step stored in a case file (the contract's section 4) in a context-parallel layout on the CPU
    backend; writes the result file when out_path is given. Returns {"topk_indices", "out" (f32), "lse"} as numpy
    arrays, the same whatever the layout.
    """

def make_case(path: str, query_lens: Sequence[int], context_lens: Sequence[int], *, heads: int = 4, latent_dim: int = 32, rope_dim: int = 16, index_heads: int = 4, index_dim: int = 32, topk: int = 64, scale: float = 0.125, dtype: str = 'f32', seed: int = 1) -> None:
    """
    Writes a random case file (counter-based values: the same seed gives the same file).
    """
