"""Caches whose pages are padded to a larger size (a dim-0 stride wider than a page: vLLM's page_size_padded, an
engine's pages padded to one size for every layer's caches). On the CPU, run_layer and the ops over padded pools
equal the dense pools' results bit for bit, write the same pages and leave the padding as it was; a stride that is
not a multiple of 16 bytes, or a stride anywhere but dim 0, is refused naming the tensor."""
import numpy as np
import pytest

import dsacp
from test_plan import caches_with_context, inputs, layout, make_plan, case  # noqa: F401  (the fixture)

PAD = 7.0


def padded(pool, extra):
    """pool's pages in a buffer with `extra` more elements a page (PAD there): a view whose dim 0 is strided."""
    n = pool.shape[0]
    page = pool[0].size
    buf = np.full((n, page + extra), PAD, pool.dtype)
    buf[:, :page] = pool.reshape(n, page)
    view = buf[:, :page].reshape(pool.shape) if pool.ndim == 2 else np.lib.stride_tricks.as_strided(
        buf, shape=pool.shape, strides=(buf.strides[0],) + pool.strides[1:])
    assert view.strides[0] == (page + extra) * pool.itemsize and not view.flags["C_CONTIGUOUS"]
    return buf, view


@pytest.mark.parametrize("extra", [4, 12])  # 16 and 48 bytes a page (f32)
def test_run_layer_over_padded_pages_equals_dense_pools(case, extra):  # noqa: F811
    _, c = case
    bt, n = layout(seed=21)
    lat, rope, keys = caches_with_context(c, bt, n, 8)
    (lat_buf, lat_p), (rope_buf, rope_p), (keys_buf, keys_p) = (padded(x, extra) for x in (lat, rope, keys))
    p = make_plan(bt, n)
    ref = dsacp.run_layer(p, (lat, rope, keys), *inputs(c))
    got = dsacp.run_layer(p, (lat_p, rope_p, keys_p), *inputs(c))
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(a, b)  # bit for bit
    for dense, buf, view in ((lat, lat_buf, lat_p), (rope, rope_buf, rope_p), (keys, keys_buf, keys_p)):
        np.testing.assert_array_equal(view, dense)  # the step's new tokens went where the dense pool got them
        np.testing.assert_array_equal(buf[:, dense[0].size:], PAD)  # the padding as it was


def test_the_ops_over_padded_pages(case):  # noqa: F811
    _, c = case
    bt, n = layout(seed=22)
    lat, rope, keys = caches_with_context(c, bt, n, 8)
    p = make_plan(bt, n)
    s = np.array(p.slots, np.int64)
    lat_buf, lat_p = padded(lat, 8)
    keys_buf, keys_p = padded(keys, 4)
    dsacp.cache_write(c["kv_latent"], s, lat)
    dsacp.cache_write(c["kv_latent"], s, lat_p)
    dsacp.cache_write(c["idx_k"], s, keys)
    dsacp.cache_write(c["idx_k"], s, keys_p)
    np.testing.assert_array_equal(lat_p, lat)
    np.testing.assert_array_equal(keys_p, keys)
    np.testing.assert_array_equal(lat_buf[:, lat[0].size:], PAD)
    req, klen = np.array(p.token_request, np.int32), np.array(p.key_len, np.int32)
    tk = dsacp.indexer_topk(c["idx_q"], c["idx_w"], keys, bt, req, klen, 16)
    np.testing.assert_array_equal(dsacp.indexer_topk(c["idx_q"], c["idx_w"], keys_p, bt, req, klen, 16), tk)
    o, l = dsacp.sparse_mla(c["q_nope"], c["q_rope"], lat, rope, bt, req, klen, tk, 0.125)
    o2, l2 = dsacp.sparse_mla(c["q_nope"], c["q_rope"], lat_p, rope, bt, req, klen, tk, 0.125)
    np.testing.assert_array_equal(o, o2)
    np.testing.assert_array_equal(l, l2)


def test_padded_fp8_index_pages_and_records():
    """uint8 pools: FP8 indexer pages [num_pages, page_size * 132] and fp8_ds_mla records, pages padded by 16 and
    32 bytes: the cache writes store the dense pools' bytes page by page and leave the padding."""
    rng = np.random.default_rng(5)
    ps, Di, Dl, Dr, T = 8, 128, 128, 64, 6
    slots = np.array([0, 5, 9, 17, 23, 30], np.int64)
    keys = rng.standard_normal((T, Di)).astype(np.float32)
    dense = np.zeros((4, ps * (Di + 4)), np.uint8)
    buf = np.full((4, ps * (Di + 4) + 16), 0xEE, np.uint8)
    view = buf[:, :ps * (Di + 4)]
    view[:] = 0  # the pages as the dense pool's, 0xEE past them
    dsacp.cache_write(keys, slots, dense)
    dsacp.cache_write(keys, slots, view)
    np.testing.assert_array_equal(view, dense)
    np.testing.assert_array_equal(buf[:, ps * (Di + 4):], 0xEE)
    rec = Dl + 4 * (Dl // 128) + 2 * Dr
    lat = rng.standard_normal((T, Dl)).astype(np.float32)
    rope = rng.standard_normal((T, Dr)).astype(np.float32)
    dense_r = np.zeros((4, ps, rec), np.uint8)
    buf_r = np.full((4, ps * rec + 32), 0xEE, np.uint8)
    view_r = np.lib.stride_tricks.as_strided(buf_r, shape=(4, ps, rec), strides=(ps * rec + 32, rec, 1))
    view_r[:] = 0
    dsacp.cache_write(lat, slots, dense_r, rope_rows=rope)
    dsacp.cache_write(lat, slots, view_r, rope_rows=rope)
    np.testing.assert_array_equal(view_r, dense_r)
    np.testing.assert_array_equal(buf_r[:, ps * rec:], 0xEE)


def test_padded_page_refusals(case):  # noqa: F811
    _, c = case
    bt, n = layout(seed=23)
    lat, rope, keys = caches_with_context(c, bt, n, 8)
    p = make_plan(bt, n)
    x = inputs(c)
    _, odd = padded(lat, 2)  # 8 bytes of padding a page: not a multiple of 16
    with pytest.raises(ValueError, match=r"the latent pool's page stride 1032 must be 0 \(dense\) or a multiple of 16 "
                                         r"bytes of at least a page's 1024 bytes"):
        dsacp.run_layer(p, (odd, rope, keys), *x)
    req, klen = np.array(p.token_request, np.int32), np.array(p.key_len, np.int32)
    tk = np.zeros((p.num_tokens, 16), np.int32)
    with pytest.raises(ValueError, match=r"sparse_mla: latent.page_stride 1032 must be 0 \(dense\) or a multiple of 16"):
        dsacp.sparse_mla(c["q_nope"], c["q_rope"], odd, rope, bt, req, klen, tk, 0.125)
    rows = np.zeros((n, 16, 32), np.float32)[:, ::2]  # dim 1 strided: refused
    with pytest.raises(ValueError, match=r"tensor 'latent' is not contiguous \(strides \[512, 64, 1\] elements, "
                                         r"expected \[256, 32, 1\], or a wider stride of dim 0 only: padded pages\)"):
        dsacp.run_layer(p, (rows, rope, keys), *x)
