"""
dsacp: DeepSeek Sparse Attention with context parallelism (the C++ library's kernels and replay)
"""

from collections.abc import Sequence


def indexer_topk(q: object, w: object, keys: object, block_table: object, request: object, key_len: object, K: int, *, q_scale: object | None = None, out: object | None = None, return_scores: bool = False, scores: object | None = None, host_request: object | None = None, host_key_len: object | None = None, stream: int | None = None, threads: int = 0, keys_page_size: int = 0) -> object:
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
    calls run on the stream `stream` (a cudaStream_t as an int; None: torch's current stream for torch tensors, else
    the legacy default stream, as 0 is), write into the caller's outputs (out=, lse=, scores=: the package
    wrappers allocate them on the inputs' device when not given) and return without waiting for the GPU: a data error
    the device finds (a bad page id, slot or index) is raised by the next check_errors(). Argument errors (shape,
    dtype, device, contiguity) raise ValueError at the call. Cache pools may have padded pages (a dim-0 stride wider
than a page, a multiple of 16 bytes: an engine's pages padded to one size); every other tensor is contiguous.
    """

def sparse_mla(q_nope: object, q_rope: object, latent: object, rope: object | None, block_table: object, request: object, key_len: object, topk: object, scale: float, *, out: object | None = None, lse: object | None = None, stream: int | None = None, threads: int = 0) -> tuple:
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
    calls run on the stream `stream` (a cudaStream_t as an int; None: torch's current stream for torch tensors, else
    the legacy default stream, as 0 is), write into the caller's outputs (out=, lse=, scores=: the package
    wrappers allocate them on the inputs' device when not given) and return without waiting for the GPU: a data error
    the device finds (a bad page id, slot or index) is raised by the next check_errors(). Argument errors (shape,
    dtype, device, contiguity) raise ValueError at the call. Cache pools may have padded pages (a dim-0 stride wider
than a page, a multiple of 16 bytes: an engine's pages padded to one size); every other tensor is contiguous.
    """

def lse_merge(part_out: object, part_lse: object, *, out: object | None = None, lse: object | None = None, stream: int | None = None, threads: int = 0) -> tuple:
    """
    Exact merge of S partial attention results over disjoint key sets by their LSE.

    part_out [S, rows, Dl] f32/bf16, part_lse [S, rows] f32 -> (out [rows, Dl], lse [rows]); a part whose lse is
    not finite counts as empty; all empty -> out 0, lse -inf.

    Tensors: all on the CPU (numpy, torch, ...) or all on one CUDA device (torch, cupy, jax: used in place). CUDA
    calls run on the stream `stream` (a cudaStream_t as an int; None: torch's current stream for torch tensors, else
    the legacy default stream, as 0 is), write into the caller's outputs (out=, lse=, scores=: the package
    wrappers allocate them on the inputs' device when not given) and return without waiting for the GPU: a data error
    the device finds (a bad page id, slot or index) is raised by the next check_errors(). Argument errors (shape,
    dtype, device, contiguity) raise ValueError at the call. Cache pools may have padded pages (a dim-0 stride wider
than a page, a multiple of 16 bytes: an engine's pages padded to one size); every other tensor is contiguous.
    """

def cache_write(rows: object, slots: object, pool: object, *, rope_rows: object | None = None, row_scales: object | None = None, scale_mode: str = 'fp32', stream: int | None = None, threads: int = 0) -> None:
    """
    Scatters rows into flat slots of a paged pool, in place: pool[slot // page_size, slot % page_size] = rows[t].

    rows [T, dim] f32/bf16 (or float8_e4m3fn with row_scales [T]); slots [T] int64 (-1 skips a row); pool
    [num_pages, page_size, dim] f32/bf16, or uint8 FP8 pages (rows are quantized with scale_mode "fp32" or
    "ue8m0"), or uint8 fp8_ds_mla records [num_pages, page_size, dim + 4 * dim / 128 + 2 * Dr] (the latent rows
    quantized per 128-value tile, or float8_e4m3fn rows with row_scales [T, dim / 128]; rope_rows [T, Dr] f32/bf16
    stored as bf16 in the same records); or, with rope_rows, vLLM's bf16 KV cache [num_pages, page_size, kv_row >= dim +
    Dr] (f32/bf16: each slot's row gets rows[t], then rope_rows[t]; the values past dim + Dr are left as they are).

    Tensors: all on the CPU (numpy, torch, ...) or all on one CUDA device (torch, cupy, jax: used in place). CUDA
    calls run on the stream `stream` (a cudaStream_t as an int; None: torch's current stream for torch tensors, else
    the legacy default stream, as 0 is), write into the caller's outputs (out=, lse=, scores=: the package
    wrappers allocate them on the inputs' device when not given) and return without waiting for the GPU: a data error
    the device finds (a bad page id, slot or index) is raised by the next check_errors(). Argument errors (shape,
    dtype, device, contiguity) raise ValueError at the call. Cache pools may have padded pages (a dim-0 stride wider
than a page, a multiple of 16 bytes: an engine's pages padded to one size); every other tensor is contiguous.
    """

class StepPlan:
    """
    The plan of one batch step (dsacp.plan): build it once per forward pass and
    pass it to run_layer for each layer. It holds the batch's device tables and workspace; keep it alive while runs,
    or CUDA graphs that captured them, use it.
    """

    @property
    def num_tokens(self) -> int:
        """T, the batch's new tokens"""

    @property
    def fingerprint(self) -> int:
        """
        A hash of the config, the requests, the block table and the cache layout (0: not computed)
        """

    @property
    def pages_needed(self) -> int:
        """
        Pages each layer's cache must hold (one past the highest page id the plan checked)
        """

    @property
    def workspace_bytes(self) -> int:
        """
        Device scratch bytes of a run (the plan owns a workspace of this size; workspace= lends another)
        """

    @property
    def device(self) -> str:
        """"cpu" or "cuda:N\""""

    @property
    def stream(self) -> int:
        """The CUDA stream the plan runs on (0 on the CPU)"""

    @property
    def heads(self) -> int: ...

    @property
    def latent_dim(self) -> int: ...

    @property
    def rope_dim(self) -> int: ...

    @property
    def index_heads(self) -> int: ...

    @property
    def index_dim(self) -> int: ...

    @property
    def topk(self) -> int: ...

    @property
    def page_size(self) -> int: ...

    @property
    def out_dtype(self) -> str: ...

    @property
    def dtype(self) -> str:
        """
        The activations' dtype (q_nope, q_rope, kv_latent, k_rope; idx_q, idx_k unless index_dtype is fp8)
        """

    @property
    def cache_dtype(self) -> str:
        """The latent / rope rows' and (unless FP8) the indexer keys' storage"""

    @property
    def latent_cache(self) -> str:
        """
        "rows" (latent and rope pools of cache_dtype) or "fp8_ds_mla" (656-byte records)
        """

    @property
    def index_dtype(self) -> str | None: ...

    @property
    def slots(self) -> list[int]:
        """The new tokens' cache slots"""

    @property
    def key_len(self) -> list[int]:
        """Each new token's key count (context_len + i + 1)"""

    @property
    def token_request(self) -> list[int]: ...

def plan(query_lens: Sequence[int], context_lens: Sequence[int], block_table: object, *, num_pages: int, heads: int, scale: float, topk: int = 2048, page_size: int = 64, latent_dim: int = 512, rope_dim: int = 64, index_heads: int = 64, index_dim: int = 128, dtype: str = 'bf16', out_dtype: str = 'f32', cache_dtype: str | None = None, index_dtype: str | None = None, latent_cache: str = 'rows', index_scale_mode: str = 'fp32', latent_scale_mode: str = 'fp32', topk_form: str = 'canonical', lse_base: str = 'e', decode_threshold: int = 16, device: str = 'cpu', device_block_table: object | None = None, stream: int | None = None, threads: int = 0, fingerprint: bool = True) -> StepPlan:
    """The step's plan for one batch (see dsacp.plan)."""

def run_layer(plan: StepPlan, latent: object, rope: object | None, index_keys: object, q_nope: object, q_rope: object, kv_latent: object, k_rope: object, idx_q: object | None = None, idx_w: object | None = None, idx_k: object | None = None, *, idx_q_scale: object | None = None, idx_k_scale: object | None = None, precomputed_topk: object | None = None, out: object | None = None, lse: object | None = None, topk: object | None = None, workspace: object | None = None, stream: int | None = None, fingerprint: int = 0) -> tuple:
    """One layer's step under a plan (see dsacp.run_layer)."""

class CpGroup:
    """
    A CP rank's group (dsacp.cp_group): its layout, rank and communicators.
    """

    @property
    def rank(self) -> int:
        """cr = r * D + d"""

    @property
    def P(self) -> int: ...

    @property
    def D(self) -> int: ...

    @property
    def r(self) -> int: ...

    @property
    def d(self) -> int: ...

    @property
    def transport(self) -> str:
        """"nccl" or "python collectives\""""

    @property
    def device(self) -> str: ...

    @property
    def stream(self) -> int: ...

    def comm_stats(self) -> tuple:
        """(collectives, bytes sent) of the world communicator"""

def nccl_make_id() -> bytes:
    """A new ncclUniqueId (128 bytes) for the ranks of one NCCL group."""

def nccl_available() -> bool:
    """Whether this build has the NCCL communicator."""

class CpStepPlan:
    """A CP rank's plan of one batch (dsacp.cp_plan)."""

    @property
    def num_rows(self) -> int:
        """The rank's input rows (its tokens and padding rows)"""

    @property
    def output_rows(self) -> int: ...

    @property
    def num_shared_rows(self) -> int: ...

    @property
    def row_token(self) -> list[int]:
        """The batch token of each input row (-1: a padding row)"""

    @property
    def head_begin(self) -> int: ...

    @property
    def num_heads(self) -> int: ...

    @property
    def pages_needed(self) -> int: ...

    @property
    def index_page_factor(self) -> int: ...

    @property
    def topk(self) -> int: ...

    @property
    def heads(self) -> int: ...

    @property
    def latent_dim(self) -> int: ...

    @property
    def rope_dim(self) -> int: ...

    @property
    def out_dtype(self) -> str: ...

    @property
    def run_scratch_bytes(self) -> int: ...

def cp_plan(group: object, query_lens: Sequence[int], context_lens: Sequence[int], block_table: object, *, num_pages: int, heads: int, scale: float, topk: int = 2048, page_size: int = 64, latent_dim: int = 512, rope_dim: int = 64, index_heads: int = 64, index_dim: int = 128, dtype: str = 'bf16', out_dtype: str = 'f32', cache_dtype: str | None = None, index_dtype: str | None = None, latent_cache: str = 'rows', index_scale_mode: str = 'fp32', latent_scale_mode: str = 'fp32', topk_form: str = 'canonical', lse_base: str = 'e', decode_threshold: int = 16, device_block_table: object | None = None) -> CpStepPlan:
    """A CP rank's plan of one batch (see dsacp.cp_plan)."""

def cp_run_layer(plan: CpStepPlan, latent: object, rope: object | None, index_keys: object, q_nope: object, q_rope: object, kv_latent: object, k_rope: object, idx_q: object | None = None, idx_w: object | None = None, idx_k: object | None = None, *, idx_q_scale: object | None = None, idx_k_scale: object | None = None, precomputed_topk: object | None = None, out: object | None = None, lse: object | None = None, topk: object | None = None, stream: int | None = None) -> tuple:
    """One layer's step on a CP rank (see dsacp.cp_run_layer)."""

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
