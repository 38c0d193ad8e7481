"""The planned step on torch CPU tensors (skipped without torch): bf16 caches and inputs used in place (the
outputs' data pointers are the caller's, the caches written where the ops write), the torch operator
dsacp::run_layer against dsacp.run_layer, its fake implementation (torch.library.opcheck), and
torch.compile(fullgraph=True) of two layers under one plan: no graph break, equal to eager, and a new plan (the next
forward pass) runs the compiled code without recompiling. The CUDA side (stream, graphs) is in test_cuda.py."""
import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="torch is not installed (CI has no CPU-only torch wheel to install; these run where torch is)")

import dsacp  # noqa: E402
from dsacp import torch_ops  # noqa: E402

QL, CL = [1, 1, 2, 1], [40, 17, 9, 30]
H, Dl, Dr, Hi, Di, K, PS = 4, 32, 16, 4, 32, 16, 8


def batch(seed=3, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    pages = [(q + c + PS - 1) // PS for q, c in zip(QL, CL)]
    n = sum(pages) + 2
    perm = torch.randperm(n, generator=g).to(torch.int32)
    bt = torch.full((len(QL), max(pages)), -1, dtype=torch.int32)
    at = 0
    for r, m in enumerate(pages):
        bt[r, :m] = perm[at:at + m]
        at += m
    caches = (torch.randn(n, PS, Dl, generator=g).to(dtype), torch.randn(n, PS, Dr, generator=g).to(dtype),
              torch.randn(n, PS, Di, generator=g).to(dtype))
    T = sum(QL)
    x = [torch.randn(s, generator=g).to(dtype) for s in ((T, H, Dl), (T, H, Dr), (T, Dl), (T, Dr), (T, Hi, Di))]
    x += [torch.rand(T, Hi, generator=g), torch.randn(T, Di, generator=g).to(dtype)]
    return bt, n, caches, x


def make_plan(bt, n, **kw):
    return dsacp.plan(QL, CL, bt, num_pages=n, page_size=PS, heads=H, latent_dim=Dl, rope_dim=Dr, index_heads=Hi,
                      index_dim=Di, topk=K, scale=0.1, **kw)


def clone(caches):
    return tuple(c.clone() for c in caches)


def test_bf16_torch_tensors_in_place_equal_the_ops():
    bt, n, caches, x = batch()
    p = make_plan(bt, n, out_dtype=torch.bfloat16)
    ref_caches = clone(caches)
    out = torch.empty(p.num_tokens, H, Dl, dtype=torch.bfloat16)
    o, lse, topk = dsacp.run_layer(p, caches, *x, out=out)
    assert o is out and o.data_ptr() == out.data_ptr() and lse.dtype == torch.float32 and topk.dtype == torch.int32
    slots = torch.tensor(p.slots, dtype=torch.int64)
    for rows, pool in zip((x[2], x[3], x[6]), ref_caches):
        dsacp.cache_write(rows, slots, pool)
    for a, b in zip(caches, ref_caches):
        assert torch.equal(a, b)  # the caller's caches, written in place
    req = torch.tensor(p.token_request, dtype=torch.int32)
    klen = torch.tensor(p.key_len, dtype=torch.int32)
    tk = dsacp.indexer_topk(x[4], x[5], ref_caches[2], bt, req, klen, K)
    ro = torch.empty_like(out)
    _, rl = dsacp.sparse_mla(x[0], x[1], ref_caches[0], ref_caches[1], bt, req, klen, torch.from_numpy(tk), 0.1,
                             out=ro)
    np.testing.assert_array_equal(topk.numpy(), tk)
    assert torch.equal(o, ro)
    np.testing.assert_array_equal(lse.numpy(), rl)


def test_torch_operator_equals_run_layer_and_passes_opcheck():
    bt, n, caches, x = batch()
    p = make_plan(bt, n)
    a = dsacp.run_layer(p, clone(caches), *x)
    b = torch_ops.run_layer(p, clone(caches), *x)
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    args = (p.handle, p.topk, torch.float32, *clone(caches), *x)
    torch.library.opcheck(torch.ops.dsacp.run_layer.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
    del p
    with pytest.raises(ValueError, match="names no live plan"):
        torch.ops.dsacp.run_layer(*args)


def two_layers(plan, caches0, caches1, x):
    """Layer 0 runs the indexer; layer 1 reuses its top-k (a precomputed top-k), on its own caches."""
    o0, l0, k0 = torch_ops.run_layer(plan, caches0, *x)
    o1, l1, k1 = torch_ops.run_layer(plan, caches1, x[0] * 2, *x[1:4], precomputed_topk=k0)
    return o0 + o1, l0, l1, k0, k1


def test_torch_compile_fullgraph_of_two_layers_equals_eager_and_does_not_recompile_per_plan():
    bt, n, caches, x = batch(dtype=torch.float32)
    p = make_plan(bt, n, dtype="f32")
    eager = two_layers(p, clone(caches), clone(caches), x)
    torch._dynamo.reset()
    explain = torch._dynamo.explain(two_layers)(p, clone(caches), clone(caches), x)
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    torch._dynamo.reset()
    compiled = torch.compile(two_layers, fullgraph=True, backend="aot_eager")
    got = compiled(p, clone(caches), clone(caches), x)
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    c0, c1 = clone(caches), clone(caches)
    compiled(p, c0, c1, x)
    e0, e1 = clone(caches), clone(caches)
    two_layers(p, e0, e1, x)
    assert torch.equal(c0[0], e0[0]) and torch.equal(c1[2], e1[2])  # the compiled layers wrote the caches
    # The next forward pass: a new plan of another batch's tables (same shapes), no recompilation.
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(9)).to(torch.int32)
    bt2 = torch.where(bt >= 0, perm[bt.clamp_min(0).long()], bt)
    p2 = make_plan(bt2, n, dtype="f32")
    assert p2.handle.item() != p.handle.item()
    from torch._dynamo.utils import counters
    before = counters["stats"]["unique_graphs"]
    got2 = compiled(p2, clone(caches), clone(caches), x)
    assert counters["stats"]["unique_graphs"] == before
    want2 = two_layers(p2, clone(caches), clone(caches), x)
    for a, b in zip(got2, want2):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
