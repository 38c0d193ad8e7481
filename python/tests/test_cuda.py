"""The ops on torch CUDA tensors (skipped without torch, a CUDA device or a CUDA build of the module): against the
same ops on CPU copies (bf16 pools; bf16 and FP8 indexer keys), zero-copy outputs on the caller's stream, argument
errors at the call (mixed devices, non-contiguous), device-found data errors kept for check_errors(), the
fp8_ds_mla record cache (the CUDA cache write's bytes equal the CPU's, its sparse MLA within bf16 of the CPU's), CUDA-graph capture and replay of a
decode layer, and torch.compile(fullgraph=True) of it."""
import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="torch is not installed (CI has no CPU-only torch wheel to install; these run where torch is)")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import dsacp  # noqa: E402

DEV = "cuda:0"


def cuda_build():
    try:
        dsacp.lse_merge(torch.zeros(1, 1, 512, device=DEV), torch.zeros(1, 1, device=DEV))
        return True
    except RuntimeError as e:
        return "unsupported" not in str(e)


if not cuda_build():
    pytest.skip("the module was built without CUDA", allow_module_level=True)


def decode_case(fp8_keys=False, R=6, H=16, K=64, seed=3):
    """A bf16 decode batch over shuffled pages of 64: CPU tensors (the caller moves them)."""
    g = torch.Generator().manual_seed(seed)
    ps, Dl, Dr, Hi, Di = 64, 512, 64, 64, 128
    ctx = [300, 1000, 77, 513, 64, 900][:R]
    max_pages = max((c + 1 + ps - 1) // ps for c in ctx)
    num_pages = R * max_pages + 3
    perm = torch.randperm(num_pages, generator=g).to(torch.int32)
    bt = perm[: R * max_pages].reshape(R, max_pages).contiguous()
    slots = torch.tensor([int(bt[r, ctx[r] // ps]) * ps + ctx[r] % ps for r in range(R)], dtype=torch.int64)
    t = dict(
        lat_pool=torch.randn(num_pages, ps, Dl, generator=g).to(torch.bfloat16),
        rope_pool=torch.randn(num_pages, ps, Dr, generator=g).to(torch.bfloat16),
        key_pool=(torch.zeros(num_pages, ps * (Di + 4), dtype=torch.uint8) if fp8_keys
                  else torch.randn(num_pages, ps, Di, generator=g).to(torch.bfloat16)),
        lat_rows=torch.randn(R, Dl, generator=g).to(torch.bfloat16),
        rope_rows=torch.randn(R, Dr, generator=g).to(torch.bfloat16),
        key_rows=torch.randn(R, Di, generator=g).to(torch.bfloat16),
        all_keys=torch.randn(num_pages * ps, Di, generator=g).to(torch.bfloat16),
        slots=slots, q_idx=torch.randn(R, Hi, Di, generator=g).to(torch.bfloat16),
        w=torch.rand(R, Hi, generator=g), q_nope=torch.randn(R, H, Dl, generator=g).to(torch.bfloat16),
        q_rope=torch.randn(R, H, Dr, generator=g).to(torch.bfloat16), bt=bt, req=torch.arange(R, dtype=torch.int32),
        klen=torch.tensor([c + 1 for c in ctx], dtype=torch.int32))
    return t, K


def to(t, device):
    return {k: v.to(device) for k, v in t.items()}


def fill_keys(t, fp8):
    """Every slot of the indexer pool written (FP8: quantized by cache_write) on t's device."""
    n = t["all_keys"].shape[0]
    dsacp.cache_write(t["all_keys"], torch.arange(n, dtype=torch.int64, device=t["all_keys"].device), t["key_pool"])


def topk_close(gpu, cpu_topk, cpu_scores_of, K):
    """The GPU's rows equal the CPU's, or differ only among keys whose CPU scores tie the K-th within 1e-3."""
    gpu, cpu_topk = gpu.cpu().numpy(), cpu_topk
    for r in range(gpu.shape[0]):
        if np.array_equal(gpu[r], cpu_topk[r]):
            continue
        s = cpu_scores_of(r)
        kth = np.sort(s[cpu_topk[r][cpu_topk[r] >= 0]])[0]
        extra = np.setdiff1d(gpu[r], cpu_topk[r])
        assert np.all(np.abs(s[extra] - kth) <= 1e-3 * max(1.0, abs(kth))), f"row {r}"


@pytest.mark.parametrize("fp8_keys", [False, True])
def test_ops_on_cuda_tensors_match_the_cpu_ops(fp8_keys):
    c, K = decode_case(fp8_keys)
    g = to(c, DEV)
    for t in (c, g):
        fill_keys(t, fp8_keys)
        for rows, pool in (("key_rows", "key_pool"), ("lat_rows", "lat_pool"), ("rope_rows", "rope_pool")):
            dsacp.cache_write(t[rows], t["slots"], t[pool])
    for pool in ("key_pool", "lat_pool", "rope_pool"):
        torch.testing.assert_close(g[pool].cpu(), c[pool], rtol=0, atol=0)  # the same bytes (FP8: same quantization)
    q, q_scale = c["q_idx"], None
    if fp8_keys:  # e4m3 q with a scale per (token, head), as FP8 keys need
        q_scale = (q.float().abs().amax(-1) / 448).clamp_min(1e-8)
        q = (q.float() / q_scale[..., None]).to(torch.float8_e4m3fn)
    host = dict(host_request=c["req"], host_key_len=c["klen"])
    topk_g = dsacp.indexer_topk(q.to(DEV), g["w"], g["key_pool"], g["bt"], g["req"], g["klen"], K,
                                q_scale=None if q_scale is None else q_scale.to(DEV), **host)
    assert topk_g.is_cuda and topk_g.dtype == torch.int32
    qc = q.view(torch.uint8) if fp8_keys else q  # (CPU: e4m3 as its bytes)
    topk_c = dsacp.indexer_topk(qc, c["w"], c["key_pool"], c["bt"], c["req"], c["klen"], K, q_scale=q_scale)
    all_scores = {}

    def scores_of(r):  # every key's CPU score of row r (K = key_len: the whole row)
        if r not in all_scores:
            n = int(c["klen"][r])
            tk, s = dsacp.indexer_topk(qc[r:r + 1].contiguous(), c["w"][r:r + 1].contiguous(), c["key_pool"],
                                       c["bt"], c["req"][r:r + 1].contiguous(), c["klen"][r:r + 1].contiguous(), n,
                                       q_scale=None if q_scale is None else q_scale[r:r + 1].contiguous(),
                                       return_scores=True)
            full = np.full(n, -np.inf, np.float32)
            full[tk[0]] = s[0]
            all_scores[r] = full
        return all_scores[r]

    topk_close(topk_g, topk_c, scores_of, K)
    topk = torch.from_numpy(topk_c)
    out = torch.empty(g["q_nope"].shape, dtype=torch.bfloat16, device=DEV)
    o, lse = dsacp.sparse_mla(g["q_nope"], g["q_rope"], g["lat_pool"], g["rope_pool"], g["bt"], g["req"], g["klen"],
                              topk.to(DEV), 0.04, out=out)
    assert o is out
    ref, ref_lse = dsacp.sparse_mla(c["q_nope"], c["q_rope"], c["lat_pool"], c["rope_pool"], c["bt"], c["req"],
                                    c["klen"], topk, 0.04)
    rel = np.linalg.norm(o.float().cpu().numpy() - ref) / np.linalg.norm(ref)
    assert rel < 1e-2
    np.testing.assert_allclose(lse.cpu().numpy(), ref_lse, rtol=1e-3, atol=1e-3)
    parts = torch.randn(3, 40, 512, device=DEV)
    plse = torch.randn(3, 40, device=DEV)
    mo, ml = dsacp.lse_merge(parts, plse)
    ro, rl = dsacp.lse_merge(parts.cpu(), plse.cpu())
    np.testing.assert_allclose(mo.cpu().numpy(), ro, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ml.cpu().numpy(), rl, rtol=1e-5, atol=1e-5)
    dsacp.check_errors()


def test_caller_stream_and_argument_errors():
    c, K = decode_case()
    g = to(c, DEV)
    topk = torch.arange(K, dtype=torch.int32).repeat(6, 1).to(DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        o, l = dsacp.sparse_mla(g["q_nope"], g["q_rope"], g["lat_pool"], g["rope_pool"], g["bt"], g["req"], g["klen"],
                                topk, 0.04)
    s.synchronize()
    ref, _ = dsacp.sparse_mla(g["q_nope"], g["q_rope"], g["lat_pool"], g["rope_pool"], g["bt"], g["req"], g["klen"],
                              topk, 0.04, stream=torch.cuda.current_stream().cuda_stream)
    torch.testing.assert_close(o, ref, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"tensor 'block_table' is on cpu but 'q_nope' is on cuda:0"):
        dsacp.sparse_mla(g["q_nope"], g["q_rope"], g["lat_pool"], g["rope_pool"], c["bt"], g["req"], g["klen"], topk,
                         0.04)
    with pytest.raises(ValueError, match=r"'q_rope' is not contiguous"):
        dsacp.sparse_mla(g["q_nope"], g["q_rope"].transpose(0, 1).contiguous().transpose(0, 1), g["lat_pool"],
                         g["rope_pool"], g["bt"], g["req"], g["klen"], topk, 0.04)
    with pytest.raises(ValueError, match=r"output 'out' not given"):
        dsacp._dsacp.lse_merge(torch.zeros(2, 3, 512, device=DEV), torch.zeros(2, 3, device=DEV))
    with pytest.raises(ValueError, match=r"'host_key_len' is on cuda:0, expected a CPU tensor"):
        dsacp.indexer_topk(g["q_idx"], g["w"], g["key_pool"], g["bt"], g["req"], g["klen"], K, host_request=c["req"],
                           host_key_len=g["klen"])


def test_device_found_errors_wait_for_check_errors():
    c, K = decode_case()
    g = to(c, DEV)
    bad = g["bt"].clone()
    bad[1, 0] = 10 ** 6  # a page id past the pool
    topk = torch.arange(K, dtype=torch.int32).repeat(6, 1).to(DEV)
    dsacp.check_errors()
    dsacp.sparse_mla(g["q_nope"], g["q_rope"], g["lat_pool"], g["rope_pool"], bad, g["req"], g["klen"], topk, 0.04)
    with pytest.raises((ValueError, RuntimeError), match="sparse_mla"):
        dsacp.check_errors()
    dsacp.check_errors()  # reported once


def test_fp8_ds_mla_records_on_cuda():
    R, Dl, Dr, ps = 4, 512, 64, 64
    pool_c = torch.zeros(3, ps, 656, dtype=torch.uint8)
    rows = torch.randn(R, Dl).to(torch.bfloat16)
    rope = torch.randn(R, Dr).to(torch.bfloat16)
    slots = torch.tensor([0, 5, 70, 130], dtype=torch.int64)
    dsacp.cache_write(rows, slots, pool_c, rope_rows=rope)
    pool_g = torch.zeros(3, ps, 656, dtype=torch.uint8, device=DEV)
    dsacp.cache_write(rows.to(DEV), slots.to(DEV), pool_g, rope_rows=rope.to(DEV))
    dsacp.check_errors()
    torch.testing.assert_close(pool_g.cpu(), pool_c, rtol=0, atol=0)
    q_nope = torch.randn(R, 16, Dl).to(torch.bfloat16)
    q_rope = torch.randn(R, 16, Dr).to(torch.bfloat16)
    bt = torch.tensor([[0, 1, 2]] * R, dtype=torch.int32)
    req = torch.arange(R, dtype=torch.int32)
    klen = torch.full((R,), 131, dtype=torch.int32)
    topk = torch.tensor([[0, 5, 70, 130]] * R, dtype=torch.int32)
    ref, ref_lse = dsacp.sparse_mla(q_nope, q_rope, pool_c, None, bt, req, klen, topk, 0.04)
    o, l = dsacp.sparse_mla(*[x.to(DEV) for x in (q_nope, q_rope, pool_c)], None,
                            *[x.to(DEV) for x in (bt, req, klen, topk)], 0.04)
    dsacp.check_errors()
    torch.testing.assert_close(o.float().cpu(), torch.as_tensor(ref).float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(l.float().cpu(), torch.as_tensor(ref_lse).float(), rtol=1e-3, atol=1e-3)


def gpu_layer_inputs():
    c, K = decode_case(R=6, H=64)
    return to(c, DEV), c, K


def layer(t, host_req, host_klen, K, scale=0.04):
    ops = torch.ops.dsacp
    ops.cache_write(t["key_rows"], t["slots"], t["key_pool"])
    ops.cache_write(t["lat_rows"], t["slots"], t["lat_pool"])
    ops.cache_write(t["rope_rows"], t["slots"], t["rope_pool"])
    topk = ops.indexer_topk(t["q_idx"], t["w"], t["key_pool"], t["bt"], t["req"], t["klen"], K, None, host_req,
                            host_klen)
    half = K // 2
    mla = [ops.sparse_mla(t["q_nope"], t["q_rope"], t["lat_pool"], t["rope_pool"], t["bt"], t["req"], t["klen"],
                          part.contiguous(), scale) for part in (topk[:, :half], topk[:, half:])]
    T, H, Dl = t["q_nope"].shape
    out, lse = ops.lse_merge(torch.stack([o.reshape(T * H, Dl) for o, _ in mla]),
                             torch.stack([x.reshape(T * H) for _, x in mla]))
    return topk, out.reshape(T, H, Dl), lse.reshape(T, H)


def test_cuda_graph_capture_and_replay_of_a_decode_layer():
    g, c, K = gpu_layer_inputs()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on the capture stream: its backend and scratch exist before capture
        for _ in range(2):
            layer(g, c["req"], c["klen"], K)
    s.synchronize()
    dsacp.check_errors()  # (no error slots pending while capturing)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        static = layer(g, c["req"], c["klen"], K)
    for i in range(3):
        g["q_nope"].copy_(torch.randn_like(g["q_nope"].float()).to(torch.bfloat16))
        g["q_idx"].copy_(torch.randn_like(g["q_idx"].float()).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        eager = layer(g, c["req"], c["klen"], K)
        torch.cuda.synchronize()
        torch.testing.assert_close(static[0], eager[0], rtol=0, atol=0)
        torch.testing.assert_close(static[1], eager[1], rtol=0, atol=0)
        torch.testing.assert_close(static[2], eager[2], rtol=0, atol=0)
    dsacp.check_errors()


def test_torch_compile_fullgraph_on_cuda_equals_eager():
    g, c, K = gpu_layer_inputs()
    eager = layer({k: v.clone() for k, v in g.items()}, c["req"], c["klen"], K)
    torch._dynamo.reset()
    explain = torch._dynamo.explain(layer)({k: v.clone() for k, v in g.items()}, c["req"], c["klen"], K)
    assert explain.graph_break_count == 0
    compiled = torch.compile(layer, fullgraph=True)
    got = compiled({k: v.clone() for k, v in g.items()}, c["req"], c["klen"], K)
    torch.cuda.synchronize()
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    dsacp.check_errors()


def test_readme_cuda_example_runs():
    import os
    import re
    readme = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")
    blocks = re.findall(r"```python\n(.*?)```", open(readme).read(), re.S)
    code = next(b for b in blocks if "cuda" in b)
    env = {}
    exec(code, env)
    assert env["topk"].shape == (2, 64) and env["out"].shape == (2, 16, 512) and torch.isfinite(env["lse"]).all()


# The planned step on CUDA tensors: dsacp.plan once, dsacp.run_layer per layer, on the plan's stream.

def plan_case(fp8=False, seed=4):
    """A decode batch (6 requests, one with 2 MTP tokens) and one layer's inputs and caches, on the CPU.
    fp8: fp8_ds_mla latent records and the FP8 indexer (e4m3 idx_q / idx_k with their scales, 132-byte pages)."""
    g = torch.Generator().manual_seed(seed)
    ps, Dl, Dr, Hi, Di, K = 64, 512, 64, 64, 128, 128
    H = 16 if fp8 else 64
    ql, cl = [1, 1, 2, 1, 1, 1], [300, 1000, 77, 513, 64, 900]
    pages = [(q + c + ps - 1) // ps for q, c in zip(ql, cl)]
    n = sum(pages) + 3
    perm = torch.randperm(n, generator=g).to(torch.int32)
    bt = torch.full((len(ql), max(pages)), -1, dtype=torch.int32)
    at = 0
    for r, m in enumerate(pages):
        bt[r, :m] = perm[at:at + m]
        at += m
    kw = dict(num_pages=n, page_size=ps, heads=H, latent_dim=Dl, rope_dim=Dr, index_heads=Hi, index_dim=Di, topk=K,
              scale=0.04, dtype="bf16", out_dtype="f32")
    if fp8:
        kw.update(latent_cache="fp8_ds_mla", index_dtype="fp8")
    T = sum(ql)
    bf = torch.bfloat16
    x = [torch.randn(s, generator=g).to(bf) for s in ((T, H, Dl), (T, H, Dr), (T, Dl), (T, Dr))]
    q = torch.randn(T, Hi, Di, generator=g)
    k = torch.randn(T, Di, generator=g)
    w = torch.rand(T, Hi, generator=g)
    ctx_slots = torch.tensor([int(bt[r, p // ps]) * ps + p % ps for r in range(len(ql)) for p in range(cl[r])],
                             dtype=torch.int64)
    C = len(ctx_slots)
    if fp8:
        caches = [torch.zeros(n, ps, 656, dtype=torch.uint8), None, torch.zeros(n, ps * (Di + 4), dtype=torch.uint8)]
        dsacp.cache_write(torch.randn(C, Dl, generator=g), ctx_slots, caches[0],
                          rope_rows=torch.randn(C, Dr, generator=g))
        dsacp.cache_write(torch.randn(C, Di, generator=g), ctx_slots, caches[2])
        qs = (q.abs().amax(-1) / 448).clamp_min(1e-8)
        ks = (k.abs().amax(-1) / 448).clamp_min(1e-8)
        idx = dict(idx_q=(q / qs[..., None]).to(torch.float8_e4m3fn), idx_w=w,
                   idx_k=(k / ks[:, None]).to(torch.float8_e4m3fn), idx_q_scale=qs, idx_k_scale=ks)
    else:
        caches = [torch.randn(n, ps, Dl, generator=g).to(bf), torch.randn(n, ps, Dr, generator=g).to(bf),
                  torch.randn(n, ps, Di, generator=g).to(bf)]
        idx = dict(idx_q=q.to(bf), idx_w=w, idx_k=k.to(bf))
    return (ql, cl, bt), kw, caches, x, idx


def on(dev, caches, x, idx):
    return ([None if c is None else c.to(dev) for c in caches], [a.to(dev) for a in x],
            {k: v.to(dev) for k, v in idx.items()})


@pytest.mark.parametrize("fp8", [False, True])
def test_run_layer_on_cuda_tensors_matches_the_cpu(fp8):
    (ql, cl, bt), kw, caches, x, idx = plan_case(fp8)
    gc, gx, gi = on(DEV, caches, x, idx)
    cpu = dsacp.plan(ql, cl, bt, **kw)
    p = dsacp.plan(ql, cl, bt, device=DEV, device_block_table=bt.to(DEV), **kw)
    assert p.device == DEV and p.stream == torch.cuda.current_stream().cuda_stream
    T, H = p.num_tokens, p.heads
    out = torch.empty(T, H, 512, device=DEV)
    o, lse, topk = dsacp.run_layer(p, gc, *gx, **gi, out=out)
    assert o is out and o.data_ptr() == out.data_ptr() and topk.is_cuda
    ro, rl, rk = dsacp.run_layer(cpu, caches, *x, **{k: (v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn
                                                         else v) for k, v in idx.items()})
    dsacp.check_errors()
    for a, b in zip(gc, caches):  # the cache writes: the same bytes
        if a is not None:
            torch.testing.assert_close(a.cpu(), b, rtol=0, atol=0)
    # The top-k may differ only among keys whose scores tie the K-th (the GPU's and CPU's sums round apart);
    # attention over the CPU's top-k then gives the CPU's out within bf16.
    same = (topk.cpu() == torch.from_numpy(np.asarray(rk))).float().mean()
    assert same > 0.98
    o2, l2, _ = dsacp.run_layer(p, gc, *gx, precomputed_topk=torch.as_tensor(np.asarray(rk)).to(DEV))
    ref = torch.as_tensor(np.asarray(ro))
    rel = (o2.cpu() - ref).norm() / ref.norm()
    assert rel < (3e-2 if fp8 else 1e-2)
    torch.testing.assert_close(l2.cpu(), torch.as_tensor(np.asarray(rl)), rtol=2e-3, atol=2e-3)
    dsacp.check_errors()


def test_run_layer_stream_and_errors_on_cuda():
    (ql, cl, bt), kw, caches, x, idx = plan_case()
    gc, gx, gi = on(DEV, caches, x, idx)
    p = dsacp.plan(ql, cl, bt, device=DEV, **kw)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with pytest.raises(ValueError, match=r"the plan was made on stream"):
            dsacp.run_layer(p, gc, *gx, **gi)
        ps = dsacp.plan(ql, cl, bt, device=DEV, **kw)  # made on s: runs on s
        a = dsacp.run_layer(ps, [c.clone() for c in gc], *gx, **gi)
    s.synchronize()
    b = dsacp.run_layer(p, [c.clone() for c in gc], *gx, **gi)
    torch.cuda.synchronize()
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, rtol=0, atol=0)
    if p.workspace_bytes > 0:  # a lent workspace: too small refused, large enough the same results
        with pytest.raises(ValueError, match=r"workspace has 16 bytes, the plan needs"):
            dsacp.run_layer(p, [c.clone() for c in gc], *gx, **gi,
                            workspace=torch.empty(16, dtype=torch.uint8, device=DEV))
        lent = dsacp.run_layer(p, [c.clone() for c in gc], *gx, **gi,
                               workspace=torch.empty(p.workspace_bytes, dtype=torch.uint8, device=DEV))
        torch.cuda.synchronize()
        for u, v in zip(lent, b):
            torch.testing.assert_close(u, v, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"'q_nope' is on cpu, the plan was made for cuda:0"):
        dsacp.run_layer(p, caches, *x, **idx)
    with pytest.raises(ValueError, match=r"tensor 'block_table' is on cuda:0, expected a CPU tensor"):
        dsacp.plan(ql, cl, bt.to(DEV), device=DEV, **kw)
    dsacp.check_errors()


def test_cuda_graph_capture_and_replay_of_planned_layers():
    (ql, cl, bt), kw, caches, x, idx = plan_case()
    gc, gx, gi = on(DEV, caches, x, idx)
    layers = [[c.clone() for c in gc] for _ in range(2)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # the plan on the capture stream; a warm-up run makes the stream's backend
        p = dsacp.plan(ql, cl, bt, device=DEV, device_block_table=bt.to(DEV), **kw)
        for layer in layers:
            dsacp.run_layer(p, layer, *gx, **gi)
    s.synchronize()
    dsacp.check_errors()
    T, H = p.num_tokens, p.heads
    static = [(torch.empty(T, H, 512, device=DEV), torch.empty(T, H, device=DEV),
               torch.empty(T, p.topk, dtype=torch.int32, device=DEV)) for _ in layers]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        for layer, (o, l, k) in zip(layers, static):
            dsacp.run_layer(p, layer, *gx, **gi, out=o, lse=l, topk=k)
    for i in range(3):
        gx[0].copy_(torch.randn_like(gx[0].float()).to(torch.bfloat16))
        gi["idx_q"].copy_(torch.randn_like(gi["idx_q"].float()).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        with torch.cuda.stream(s):
            eager = [dsacp.run_layer(p, layer, *gx, **gi) for layer in layers]
        s.synchronize()
        for got, want in zip(static, eager):
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
    dsacp.check_errors()


def test_torch_compile_fullgraph_of_planned_layers_on_cuda():
    from dsacp import torch_ops
    (ql, cl, bt), kw, caches, x, idx = plan_case()
    gc, gx, gi = on(DEV, caches, x, idx)
    p = dsacp.plan(ql, cl, bt, device=DEV, **kw)

    def two(plan, c0, c1, x, idx):
        o0, l0, k0 = torch_ops.run_layer(plan, c0, *x, **idx)
        o1, l1, k1 = torch_ops.run_layer(plan, c1, x[0] * 2, *x[1:], precomputed_topk=k0)
        return o0 + o1, l0, l1, k0, k1

    eager = two(p, [c.clone() for c in gc], [c.clone() for c in gc], gx, gi)
    torch._dynamo.reset()
    compiled = torch.compile(two, fullgraph=True)
    got = compiled(p, [c.clone() for c in gc], [c.clone() for c in gc], gx, gi)
    torch.cuda.synchronize()
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    dsacp.check_errors()


@pytest.mark.parametrize("kv_row", [576, 640])
def test_combined_kv_on_cuda_equals_separate_pools(kv_row):
    """vLLM's bf16 KV [num_pages, 64, 576] (and padded rows) on the GPU: the same bytes written and the same results
    as the separate pools, bit for bit; the padding stays."""
    (ql, cl, bt), kw, caches, x, idx = plan_case(False)
    gc, gx, gi = on(DEV, caches, x, idx)
    lat, rope, keys = gc
    kv = torch.full(lat.shape[:2] + (kv_row,), 3.0, dtype=torch.bfloat16, device=DEV)
    kv[..., :512] = lat
    kv[..., 512:576] = rope
    keys2 = keys.clone()
    p = dsacp.plan(ql, cl, bt, device=DEV, device_block_table=bt.to(DEV), **kw)
    ref = dsacp.run_layer(p, (lat, rope, keys), *gx, **gi)
    got = dsacp.run_layer(p, (kv, None, keys2), *gx, **gi)
    dsacp.check_errors()
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    assert torch.equal(kv[..., :512], lat) and torch.equal(kv[..., 512:576], rope) and torch.equal(keys2, keys)
    assert bool((kv[..., 576:] == 3.0).all())
    # The ops: cache_write with rope_rows and sparse_mla with rope None, against the separate pools.
    s = torch.tensor(p.slots, dtype=torch.int64, device=DEV)
    dsacp.cache_write(gx[2], s, kv, rope_rows=gx[3])
    req = torch.tensor(p.token_request, dtype=torch.int32, device=DEV)
    klen = torch.tensor(p.key_len, dtype=torch.int32, device=DEV)
    o1, l1 = dsacp.sparse_mla(gx[0], gx[1], lat, rope, bt.to(DEV), req, klen, ref[2], kw["scale"])
    o2, l2 = dsacp.sparse_mla(gx[0], gx[1], kv, None, bt.to(DEV), req, klen, ref[2], kw["scale"])
    dsacp.check_errors()
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    with pytest.raises(ValueError, match=r"tensor 'latent' is not contiguous"):
        dsacp.run_layer(p, (kv[:, :, :576] if kv_row > 576 else kv[:, ::2], None, keys2), *gx, **gi)


def test_cp_group_of_one_nccl_rank_runs_the_cp_step():
    """dsacp.cp_group on CUDA: the NCCL id broadcast through a torch.distributed group (one process here: one GPU is
    lent, and NCCL refuses two ranks on one GPU), dsacp's NCCL communicators, the planned CP step of a 1 x 1
    layout against the single-device planned step."""
    import socket
    import torch.distributed as dist
    if not dsacp.nccl_available():
        pytest.skip("built without NCCL")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        g = dsacp.cp_group(1, 1, device=DEV)
        assert g.transport == "nccl" and g.device == DEV and g.rank == 0
        (ql, cl, bt), kw, caches, x, idx = plan_case(False)
        gc, gx, gi = on(DEV, caches, x, idx)
        gc2 = [c.clone() for c in gc]
        single = dsacp.plan(ql, cl, bt, device=DEV, **kw)
        ro, rl, rk = dsacp.run_layer(single, gc, *gx, **gi)
        p = dsacp.cp_plan(g, ql, cl, bt, **kw)
        assert p.num_rows == sum(ql) and p.num_heads == kw["heads"]
        rows = [p.rows(a, heads=i < 2) for i, a in enumerate(gx)]
        o, l, k = dsacp.cp_run_layer(p, gc2, *rows, **{n: p.rows(v) for n, v in gi.items()})
        dsacp.check_errors()
        torch.cuda.synchronize()
        tok = torch.tensor(p.row_token, device=DEV)
        assert (k[:len(tok)] == rk[tok]).float().mean() > 0.98
        rel = (o[:len(tok)] - ro[tok]).norm() / ro.norm()
        assert rel < 1e-2
    finally:
        dist.destroy_process_group()


def padded_pages(pool, pad_bytes, fill):
    """pool's pages in a CUDA buffer with pad_bytes more a page (`fill` there): a view whose dim 0 is strided."""
    n, page = pool.shape[0], pool[0].numel()
    extra = pad_bytes // pool.element_size()
    buf = torch.full((n, page + extra), fill, dtype=pool.dtype, device=pool.device)
    buf[:, :page] = pool.reshape(n, page)
    strides = (page + extra,) + tuple(pool.stride()[1:])
    return buf, buf.as_strided(pool.shape, strides)


@pytest.mark.parametrize("fp8", [False, True])
def test_padded_pages_on_cuda_equal_dense_pools(fp8):
    """Pages padded to a larger size (vLLM's page_size_padded: a dim-0 stride wider than a page) on the GPU:
    run_layer's results and the pages it writes equal the dense pools' bit for bit; the padding stays. The records
    padded by 1040 bytes (not a whole record), separate bf16 latent and rope pools by one row each; pools padded
    unlike are refused."""
    (ql, cl, bt), kw, caches, x, idx = plan_case(fp8)
    gc, gx, gi = on(DEV, caches, x, idx)
    dense = [None if c is None else c.clone() for c in gc]
    pads = [1040, None, 80] if fp8 else [1024, 128, 80]
    padded = [None if c is None else padded_pages(c, pad, 7 if fp8 else 3.0) for c, pad in zip(gc, pads)]
    p = dsacp.plan(ql, cl, bt, device=DEV, device_block_table=bt.to(DEV), **kw)
    ref = dsacp.run_layer(p, dense, *gx, **gi)
    got = dsacp.run_layer(p, [None if v is None else v[1] for v in padded], *gx, **gi)
    dsacp.check_errors()
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    for d, v in zip(dense, padded):
        if d is None:
            continue
        buf, view = v
        assert torch.equal(view, d)
        assert bool((buf[:, d[0].numel():] == (7 if fp8 else 3.0)).all())
    if not fp8:
        _, unlike = padded_pages(dense[1], 48, 3.0)  # the rope padded by 48 bytes, the latent by a row
        with pytest.raises(ValueError, match=r"the latent and rope pools' pages are padded unlike"):
            dsacp.run_layer(p, [padded[0][1], unlike, padded[2][1]], *gx, **gi)
