"""The planned step on the CPU: dsacp.plan once, dsacp.run_layer per layer, over the caller's caches. Against the
C++ step (dsacp.replay of the same case file: top-k, out and lse bit for bit) and against the ops it is made of
(cache_write, indexer_topk, sparse_mla), two layers under one plan, a precomputed top-k, the serving forms, the
fp8_ds_mla record cache and the FP8 indexer pages, zero-copy outputs and caches, and the argument errors."""
import json
import struct

import numpy as np
import pytest

import dsacp

_DT = {"F32": np.float32, "I32": np.int32, "I64": np.int64, "U8": np.uint8}


def read_safetensors(path):
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    head = json.loads(b[8:8 + n])
    out = {}
    for k, v in head.items():
        if k == "__metadata__":
            out[k] = v
            continue
        lo, hi = v["data_offsets"]
        out[k] = np.frombuffer(b[8 + n + lo:8 + n + hi], dtype=_DT[v["dtype"]]).reshape(v["shape"]).copy()
    return out


QL, CL = [1, 1, 2, 1, 5], [40, 17, 9, 0, 30]
DIMS = dict(heads=4, latent_dim=32, rope_dim=16, index_heads=4, index_dim=32)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("plan") / "c.safetensors")
    dsacp.make_case(path, QL, CL, topk=16, seed=7, **DIMS)
    return path, read_safetensors(path)


def layout(ps=8, seed=3, spare=3):
    """A shuffled block table for the batch and the pool's page count."""
    pages = [(q + c + ps - 1) // ps for q, c in zip(QL, CL)]
    num_pages = sum(pages) + spare
    perm = np.random.default_rng(seed).permutation(num_pages).astype(np.int32)
    bt = np.full((len(QL), max(pages) + 1), -1, np.int32)
    at = 0
    for r, n in enumerate(pages):
        bt[r, :n] = perm[at:at + n]
        at += n
    return bt, num_pages


def slots_of(bt, ps, reqs, positions):
    return np.array([bt[r, p // ps] * ps + p % ps for r, p in zip(reqs, positions)], np.int64)


def caches_with_context(c, bt, num_pages, ps):
    """The context rows of case c written into new f32 pools (latent, rope, index_keys) at their slots."""
    lat = np.full((num_pages, ps, 32), np.nan, np.float32)
    rope = np.full((num_pages, ps, 16), np.nan, np.float32)
    keys = np.full((num_pages, ps, 32), np.nan, np.float32)
    reqs = [r for r, n in enumerate(CL) for _ in range(n)]
    pos = [p for n in CL for p in range(n)]
    s = slots_of(bt, ps, reqs, pos)
    dsacp.cache_write(c["ctx_kv_latent"], s, lat)
    dsacp.cache_write(c["ctx_k_rope"], s, rope)
    dsacp.cache_write(c["ctx_idx_k"], s, keys)
    return lat, rope, keys


def inputs(c):
    return [c[k] for k in ("q_nope", "q_rope", "kv_latent", "k_rope", "idx_q", "idx_w", "idx_k")]


def make_plan(bt, num_pages, ps=8, **kw):
    return dsacp.plan(QL, CL, bt, num_pages=num_pages, page_size=ps, scale=0.125, topk=16, dtype="f32", **DIMS, **kw)


def test_run_layer_equals_the_cpp_step(case):
    path, c = case
    ref = dsacp.replay(path, page_size=8)
    bt, n = layout()
    caches = caches_with_context(c, bt, n, 8)
    p = make_plan(bt, n)
    assert p.num_tokens == sum(QL) and p.pages_needed <= n and p.device == "cpu"
    out, lse, topk = dsacp.run_layer(p, caches, *inputs(c))
    np.testing.assert_array_equal(topk, ref["topk_indices"])
    np.testing.assert_array_equal(out, ref["out"])  # bit for bit: the same kernels in the same order
    np.testing.assert_array_equal(lse, ref["lse"])


def test_run_layer_equals_the_ops_it_is_made_of(case):
    _, c = case
    bt, n = layout(seed=5)
    lat, rope, keys = caches_with_context(c, bt, n, 8)
    p = make_plan(bt, n)
    out, lse, topk = dsacp.run_layer(p, (lat, rope, keys), *inputs(c))
    lat2, rope2, keys2 = caches_with_context(c, bt, n, 8)
    s = np.array(p.slots, np.int64)
    assert np.array_equal(s, slots_of(bt, 8, p.token_request, np.array(p.key_len) - 1))
    for rows, pool in ((c["kv_latent"], lat2), (c["k_rope"], rope2), (c["idx_k"], keys2)):
        dsacp.cache_write(rows, s, pool)
    for a, b in ((lat, lat2), (rope, rope2), (keys, keys2)):
        np.testing.assert_array_equal(a, b)  # the run wrote the new tokens where the ops do
    req, klen = np.array(p.token_request, np.int32), np.array(p.key_len, np.int32)
    tk = dsacp.indexer_topk(c["idx_q"], c["idx_w"], keys2, bt, req, klen, 16)
    o, l = dsacp.sparse_mla(c["q_nope"], c["q_rope"], lat2, rope2, bt, req, klen, tk, 0.125)
    np.testing.assert_array_equal(topk, tk)
    np.testing.assert_array_equal(out, o)
    np.testing.assert_array_equal(lse, l)


def test_two_layers_under_one_plan_and_outputs_in_place(case):
    _, c = case
    bt, n = layout()
    p = make_plan(bt, n)
    layers = []
    for seed in (1, 2):
        x = inputs(c)
        x = [a * (1 + 0.25 * seed) if a.dtype == np.float32 else a for a in x]  # another layer's activations
        layers.append((caches_with_context(c, bt, n, 8), x))
    T = p.num_tokens
    outs = [(np.empty((T, 4, 32), np.float32), np.empty((T, 4), np.float32), np.empty((T, 16), np.int32))
            for _ in layers]
    for (caches, x), (o, l, k) in zip(layers, outs):
        r = dsacp.run_layer(p, caches, *x, out=o, lse=l, topk=k)
        assert r[0] is o and r[1] is l and r[2] is k  # zero-copy: the caller's buffers
    for (caches, x), (o, l, k) in zip(layers, outs):  # each layer alone, with a plan of its own, on fresh caches
        alone = dsacp.run_layer(make_plan(bt, n), caches_with_context(c, bt, n, 8), *x)
        np.testing.assert_array_equal(o, alone[0])
        np.testing.assert_array_equal(l, alone[1])
        np.testing.assert_array_equal(k, alone[2])
    assert not np.array_equal(outs[0][0], outs[1][0])


def test_precomputed_topk_skips_the_indexer(case):
    _, c = case
    bt, n = layout()
    p = make_plan(bt, n)
    x = inputs(c)
    out, lse, topk = dsacp.run_layer(p, caches_with_context(c, bt, n, 8), *x)
    o2, l2, k2 = dsacp.run_layer(p, caches_with_context(c, bt, n, 8), *x[:4], precomputed_topk=topk)
    np.testing.assert_array_equal(k2, topk)
    np.testing.assert_array_equal(o2, out)
    np.testing.assert_array_equal(l2, lse)


def test_serving_forms_slots_and_base_2(case):
    _, c = case
    bt, n = layout()
    out, lse, topk = dsacp.run_layer(make_plan(bt, n), caches_with_context(c, bt, n, 8), *inputs(c))
    p = make_plan(bt, n, topk_form="slots", lse_base="2")
    o2, l2, s2 = dsacp.run_layer(p, caches_with_context(c, bt, n, 8), *inputs(c))
    req = np.array(p.token_request)
    want = np.where(topk >= 0, bt[req[:, None], np.maximum(topk, 0) // 8] * 8 + topk % 8, -1)
    np.testing.assert_array_equal(s2, want)
    np.testing.assert_array_equal(o2, out)
    np.testing.assert_allclose(l2, lse / np.log(2), rtol=1e-6)


def test_fp8_caches_equal_the_ops(case):
    """fp8_ds_mla latent records (uint8 [pages, page_size, 656]) and FP8 indexer pages (uint8 [pages,
    page_size * 132]) as the caller's tensors: the run writes and reads them as cache_write / sparse_mla do."""
    rng = np.random.default_rng(2)
    ps, R = 16, 3
    ql, cl = [1, 2, 1], [20, 40, 0]
    T, H, Dl, Dr, Hi, Di, K = sum(ql), 16, 512, 64, 4, 128, 32
    bt = np.array([[4, 1, 6], [0, 2, 5], [3, -1, -1]], np.int32)
    n = 8
    rec = np.zeros((n, ps, 656), np.uint8)
    keys = np.zeros((n, ps * (Di + 4)), np.uint8)
    ctx_slots = np.array([bt[r, p // ps] * ps + p % ps for r in range(R) for p in range(cl[r])], np.int64)
    dsacp.cache_write(rng.standard_normal((len(ctx_slots), Dl), np.float32), ctx_slots, rec,
                      rope_rows=rng.standard_normal((len(ctx_slots), Dr), np.float32))
    p = dsacp.plan(ql, cl, bt, num_pages=n, page_size=ps, heads=H, latent_dim=Dl, rope_dim=Dr, index_heads=Hi,
                   index_dim=Di, topk=K, scale=0.05, dtype="f32", latent_cache="fp8_ds_mla", index_dtype="fp8")
    assert p.cache_shapes(n)["latent"][0] == rec.shape and p.cache_shapes(n)["index_keys"][0] == keys.shape
    # FP8 indexer inputs: e4m3 bytes with their scales (q per (token, head), keys per token): quantized by the
    # cache write of a helper pool, then read back.
    q = rng.standard_normal((T, Hi, Di), np.float32)
    q_scale = (np.abs(q).max(-1) / 448).astype(np.float32)
    q8 = np.zeros((T * Hi, 1, Di + 4), np.uint8)
    dsacp.cache_write((q / q_scale[..., None]).reshape(T * Hi, Di), np.arange(T * Hi, dtype=np.int64), q8,
                      row_scales=np.ones(T * Hi, np.float32))
    q_e4m3 = q8[:, 0, :Di].reshape(T, Hi, Di).copy()
    k = rng.standard_normal((T, Di), np.float32)
    k_scale = (np.abs(k).max(-1) / 448).astype(np.float32)
    k8 = np.zeros((T, 1, Di + 4), np.uint8)
    dsacp.cache_write(k / k_scale[:, None], np.arange(T, dtype=np.int64), k8, row_scales=np.ones(T, np.float32))
    k_e4m3 = k8[:, 0, :Di].copy()
    w = rng.random((T, Hi), np.float32)
    x = [rng.standard_normal(s, np.float32) for s in ((T, H, Dl), (T, H, Dr), (T, Dl), (T, Dr))]
    rec2, keys2 = rec.copy(), keys.copy()
    out, lse, topk = dsacp.run_layer(p, (rec, None, keys), *x, q_e4m3, w, k_e4m3, idx_q_scale=q_scale,
                                     idx_k_scale=k_scale)
    s = np.array(p.slots, np.int64)
    dsacp.cache_write(x[2], s, rec2, rope_rows=x[3])
    dsacp.cache_write(k_e4m3, s, keys2, row_scales=k_scale)
    np.testing.assert_array_equal(rec, rec2)
    np.testing.assert_array_equal(keys, keys2)
    req, klen = np.array(p.token_request, np.int32), np.array(p.key_len, np.int32)
    tk = dsacp.indexer_topk(q_e4m3, w, keys2, bt, req, klen, K, q_scale=q_scale)
    o, l = dsacp.sparse_mla(x[0], x[1], rec2, None, bt, req, klen, tk, 0.05)
    np.testing.assert_array_equal(topk, tk)
    np.testing.assert_array_equal(out, o)
    np.testing.assert_array_equal(lse, l)


def test_argument_errors_name_what_does_not_match(case):
    _, c = case
    bt, n = layout()
    p = make_plan(bt, n)
    caches = caches_with_context(c, bt, n, 8)
    x = inputs(c)
    with pytest.raises(ValueError, match=r"'q_nope' has 5 tokens, the plan's batch 10 \(a plan of another batch\?\)"):
        dsacp.run_layer(p, caches, x[0][:5].copy(), *x[1:])
    small = tuple(a[:p.pages_needed - 1].copy() for a in caches)
    with pytest.raises(ValueError, match=r"cache 'latent' holds \d+ pages, the plan's block table uses page \d+"):
        dsacp.run_layer(p, small, *x)
    with pytest.raises(ValueError, match=r"tensor 'kv_latent' has dtype int32, expected float32"):
        dsacp.run_layer(p, caches, *x[:2], x[2].astype(np.int32), *x[3:])
    with pytest.raises(ValueError, match=r"'q_rope' has shape \[10, 4, 8\], expected \[T=10, H=4, Dr=16\]"):
        dsacp.run_layer(p, caches, x[0], x[1][..., :8].copy(), *x[2:])
    with pytest.raises(ValueError, match=r"cache 'rope' holds float32 in pages of 4, the plan's layout wants float32 "
                                         r"in pages of 8"):
        dsacp.run_layer(p, (caches[0], caches[1].reshape(-1, 4, 16), caches[2]), *x)
    with pytest.raises(ValueError, match=r"the plan is of another batch"):
        dsacp.run_layer(p, caches, *x, fingerprint=p.fingerprint ^ 1)
    dsacp.run_layer(p, caches, *x, fingerprint=p.fingerprint)  # the right one passes
    with pytest.raises(ValueError, match=r"'latent' has shape \[\d+, 8, 32\], expected the combined KV cache .* since "
                                         r"cache 'rope' is None"):
        dsacp.run_layer(p, (caches[0], None, caches[2]), *x)
    with pytest.raises(ValueError, match=r"'idx_q' is None"):
        dsacp.run_layer(p, caches, *x[:4])
    with pytest.raises(ValueError, match=r"caches has 2 entries"):
        dsacp.run_layer(p, caches[:2], *x)
    with pytest.raises(TypeError, match=r"expected a dsacp.StepPlan"):
        dsacp.run_layer("plan", caches, *x)
    with pytest.raises(ValueError, match=r"output 'out' has shape \[10, 4, 16\], expected \[10, 4, 32\]"):
        dsacp.run_layer(p, caches, *x, out=np.empty((10, 4, 16), np.float32))
    bad_topk = np.full((10, 16), -1, np.int32)
    bad_topk[3, 0] = 500  # past the token's keys
    with pytest.raises(ValueError, match=r"row 3"):
        dsacp.run_layer(p, caches, *x[:4], precomputed_topk=bad_topk)
    # The plan's own refusals.
    with pytest.raises(ValueError, match=r"topk_form=\"slot\", expected \"canonical\" or \"slots\""):
        make_plan(bt, n, topk_form="slot")
    with pytest.raises(ValueError, match=r"request 0: key position 40 has no page"):
        make_plan(bt[:, :2].copy(), n)
    with pytest.raises(ValueError, match=r"block_table has 4 rows, the batch 5 requests"):
        make_plan(bt[:4].copy(), n)
    with pytest.raises(ValueError, match=r"5 query_lens but 4 context_lens"):
        dsacp.plan(QL, CL[:4], bt, num_pages=n, heads=4, scale=0.1)
    with pytest.raises(ValueError, match=r"device_block_table is for a plan on a CUDA device"):
        make_plan(bt, n, device_block_table=bt)
    with pytest.raises(ValueError, match=r"device=\"gpu\""):
        make_plan(bt, n, device="gpu")
    bad = bt.copy()
    bad[1, 0] = n + 5
    with pytest.raises(ValueError, match=r"block table"):
        make_plan(bad, n)


def test_readme_planned_step_example_runs():
    import os
    import re
    readme = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")
    code = next(b for b in re.findall(r"```python\n(.*?)```", open(readme).read(), re.S) if "dsacp.plan(" in b)
    env = {}
    exec(code, env)
    assert env["out"].shape == (2, 4, 64) and env["topk"].shape == (2, 8) and np.isfinite(env["lse"]).all()
    assert (env["topk"][0] >= 0).all()
