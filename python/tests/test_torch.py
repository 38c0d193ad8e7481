"""The ops on torch CPU tensors through DLPack (skipped where torch is not installed): bf16 inputs, outputs written
into the caller's torch tensors (same data pointer), non-contiguous tensors refused; the torch custom ops
(torch.ops.dsacp.*) against the plain ops, their fake implementations (torch.library.opcheck), and
torch.compile(fullgraph=True) of a small decode layer that uses all four (no graph break, equal to eager). The same
on CUDA tensors, with graph capture, is in test_cuda.py."""
import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="torch is not installed (CI has no CPU-only torch wheel to install; these run where torch is)")

import dsacp  # noqa: E402  (after torch: registers torch.ops.dsacp)


def case(dtype):
    g = torch.Generator().manual_seed(5)
    T, H, Dl, Dr, ps, K = 3, 4, 32, 8, 4, 5
    latent = torch.randn(6, ps, Dl, generator=g).to(dtype)
    rope = torch.randn(6, ps, Dr, generator=g).to(dtype)
    q_nope = torch.randn(T, H, Dl, generator=g).to(dtype)
    q_rope = torch.randn(T, H, Dr, generator=g).to(dtype)
    block_table = torch.tensor([[3, 1, 5, 0]], dtype=torch.int32)
    key_len = torch.tensor([16, 9, 2], dtype=torch.int32)
    topk = torch.tensor([[0, 4, 7, 12, 15], [1, 2, 8, -1, -1], [0, 1, -1, -1, -1]], dtype=torch.int32)
    return q_nope, q_rope, latent, rope, block_table, torch.zeros(T, dtype=torch.int32), key_len, topk


def test_bf16_inputs_and_torch_outputs_in_place():
    args = case(torch.bfloat16)
    out = torch.empty(3, 4, 32, dtype=torch.bfloat16)
    lse = torch.empty(3, 4, dtype=torch.float32)
    o, l = dsacp.sparse_mla(*args, 0.2, out=out, lse=lse)
    assert o is out and l is lse and o.data_ptr() == out.data_ptr()
    ref, ref_lse = dsacp.sparse_mla(*[a.float() if a.is_floating_point() else a for a in args], 0.2)
    rel = np.linalg.norm(out.float().numpy() - ref) / np.linalg.norm(ref)
    assert rel < 1e-2  # the contract's bf16 bound (inputs are the same bf16 values; out rounded to bf16)
    np.testing.assert_allclose(lse.numpy(), ref_lse, rtol=1e-5, atol=1e-5)


def test_torch_tensors_read_through_the_dlpack_exchange_table_where_torch_has_one():
    # DLPack's C exchange table, where something published one on torch.Tensor (test_dlpack_exchange.py makes one)
    published = hasattr(torch.Tensor, "__dlpack_c_exchange_api__") or hasattr(torch.Tensor, "__c_dlpack_exchange_api__")
    assert dsacp._dsacp._torch_dlpack_exchange() == published
    # a subclass (nn.Parameter) goes the capsule way and gives the same result
    args = case(torch.float32)
    want = dsacp.sparse_mla(*args, 0.2)
    got = dsacp.sparse_mla(torch.nn.Parameter(args[0], requires_grad=False), *args[1:], 0.2)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_non_contiguous_torch_tensor_refused():
    args = list(case(torch.float32))
    args[0] = torch.randn(4, 3, 32).transpose(0, 1)  # [3, 4, 32], not contiguous
    with pytest.raises(ValueError, match=r"'q_nope' is not contiguous \(strides \[32, 96, 1\] elements, expected "
                                         r"\[128, 32, 1\]\)"):
        dsacp.sparse_mla(*args, 0.2)


def layer_inputs(device="cpu", dtype=torch.float32):
    """A decode layer's inputs: 4 requests, one new token each, paged latent / rope / indexer-key pools."""
    g = torch.Generator().manual_seed(11)
    R, ps, num_pages, Dl, Dr, Hi, Di, H, K = 4, 8, 24, 32, 8, 4, 16, 4, 8
    ctx = [20, 31, 9, 16]  # keys before the new token
    perm = torch.randperm(num_pages, generator=g).to(torch.int32)
    bt = torch.full((R, 5), -1, dtype=torch.int32)
    for r in range(R):
        bt[r, :5] = perm[r * 5:(r + 1) * 5] if (r + 1) * 5 <= num_pages else perm[:5]
    lat_pool = torch.randn(num_pages, ps, Dl, generator=g).to(dtype)
    rope_pool = torch.randn(num_pages, ps, Dr, generator=g).to(dtype)
    key_pool = torch.randn(num_pages, ps, Di, generator=g).to(dtype)
    slots = torch.tensor([int(bt[r, ctx[r] // ps]) * ps + ctx[r] % ps for r in range(R)], dtype=torch.int64)
    t = dict(
        lat_rows=torch.randn(R, Dl, generator=g).to(dtype), rope_rows=torch.randn(R, Dr, generator=g).to(dtype),
        key_rows=torch.randn(R, Di, generator=g).to(dtype), slots=slots, lat_pool=lat_pool, rope_pool=rope_pool,
        key_pool=key_pool, q_idx=torch.randn(R, Hi, Di, generator=g).to(dtype), w=torch.rand(R, Hi, generator=g),
        q_nope=torch.randn(R, H, Dl, generator=g).to(dtype), q_rope=torch.randn(R, H, Dr, generator=g).to(dtype),
        bt=bt, req=torch.arange(R, dtype=torch.int32), klen=torch.tensor([c + 1 for c in ctx], dtype=torch.int32))
    t = {k: v.to(device) for k, v in t.items()}
    return t, K


def decode_layer(t, K, scale=0.1):
    """Cache writes of the new token, the indexer's top-k, sparse MLA over its two halves, and their LSE merge."""
    ops = torch.ops.dsacp
    ops.cache_write(t["key_rows"], t["slots"], t["key_pool"])
    ops.cache_write(t["lat_rows"], t["slots"], t["lat_pool"])
    ops.cache_write(t["rope_rows"], t["slots"], t["rope_pool"])
    topk = ops.indexer_topk(t["q_idx"], t["w"], t["key_pool"], t["bt"], t["req"], t["klen"], K)
    half = K // 2
    mla = [ops.sparse_mla(t["q_nope"], t["q_rope"], t["lat_pool"], t["rope_pool"], t["bt"], t["req"], t["klen"],
                          part.contiguous(), scale) for part in (topk[:, :half], topk[:, half:])]
    T, H, Dl = t["q_nope"].shape
    out, lse = ops.lse_merge(torch.stack([o.reshape(T * H, Dl) for o, _ in mla]),
                             torch.stack([l.reshape(T * H) for _, l in mla]))
    whole, whole_lse = ops.sparse_mla(t["q_nope"], t["q_rope"], t["lat_pool"], t["rope_pool"], t["bt"], t["req"],
                                      t["klen"], topk, scale)
    return topk, out.reshape(T, H, Dl) * 1.0, lse.reshape(T, H), whole, whole_lse


def check_layer(res):
    topk, out, lse, whole, whole_lse = res
    assert (topk >= 0).all()  # every row has >= K keys
    torch.testing.assert_close(out.float(), whole.float(), rtol=2e-2 if out.dtype == torch.bfloat16 else 1e-5,
                               atol=2e-2 if out.dtype == torch.bfloat16 else 1e-5)
    torch.testing.assert_close(lse, whole_lse, rtol=1e-4, atol=1e-4)


def test_custom_ops_match_the_plain_ops():
    t, K = layer_inputs()
    res = decode_layer(t, K)
    check_layer(res)
    topk = dsacp.indexer_topk(t["q_idx"], t["w"], t["key_pool"], t["bt"], t["req"], t["klen"], K)
    np.testing.assert_array_equal(res[0].numpy(), topk)
    # the new token's rows are in the pools (cache_write mutated them in place)
    ps = t["lat_pool"].shape[1]
    s = int(t["slots"][2])
    torch.testing.assert_close(t["lat_pool"][s // ps, s % ps], t["lat_rows"][2], rtol=0, atol=0)


def test_fake_implementations_pass_opcheck():
    t, K = layer_inputs()
    ops = torch.ops.dsacp
    topk = ops.indexer_topk(t["q_idx"], t["w"], t["key_pool"], t["bt"], t["req"], t["klen"], K)
    for op, args in [
        (ops.indexer_topk, (t["q_idx"], t["w"], t["key_pool"], t["bt"], t["req"], t["klen"], K)),
        (ops.sparse_mla, (t["q_nope"], t["q_rope"], t["lat_pool"], t["rope_pool"], t["bt"], t["req"], t["klen"], topk,
                          0.1)),
        (ops.lse_merge, (torch.randn(2, 6, 16), torch.randn(2, 6))),
        (ops.cache_write, (t["lat_rows"], t["slots"], t["lat_pool"])),
    ]:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_torch_compile_fullgraph_of_a_decode_layer_equals_eager():
    t, K = layer_inputs()
    eager = decode_layer({k: v.clone() for k, v in t.items()}, K)
    torch._dynamo.reset()
    explain = torch._dynamo.explain(decode_layer)({k: v.clone() for k, v in t.items()}, K)
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    compiled = torch.compile(decode_layer, fullgraph=True, backend="aot_eager")
    got = compiled({k: v.clone() for k, v in t.items()}, K)
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
