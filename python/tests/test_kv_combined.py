"""vLLM's combined KV cache from Python: one [num_pages, page_size, kv_row] tensor whose token rows hold the latent,
then the rope (kv_row = Dl + Dr, or more: padded rows), taken by run_layer (rope None), sparse_mla (rope None) and
cache_write (with rope_rows). On the CPU every result equals the separate pools' bit for bit, the padding is left
as it was, and bad shapes / strides are refused naming the tensor and the shape expected."""
import numpy as np
import pytest

import dsacp
from test_plan import caches_with_context, inputs, layout, make_plan, case  # noqa: F401  (the fixture)

DL, DR = 32, 16


def combined(lat, rope, kv_row):
    """The separate pools' rows in one [pages, page_size, kv_row] buffer; the padding columns hold 7.0."""
    kv = np.full(lat.shape[:2] + (kv_row,), 7.0, np.float32)
    kv[..., :DL] = lat
    kv[..., DL:DL + DR] = rope
    return kv


@pytest.mark.parametrize("kv_row", [DL + DR, DL + DR + 4, DL + DR + 16])
def test_run_layer_over_the_combined_kv_equals_separate_pools(case, kv_row):  # noqa: F811
    _, c = case
    bt, n = layout(seed=11)
    lat, rope, keys = caches_with_context(c, bt, n, 8)
    kv = combined(lat, rope, kv_row)
    keys2 = keys.copy()
    p = make_plan(bt, n)
    ref = dsacp.run_layer(p, (lat, rope, keys), *inputs(c))
    got = dsacp.run_layer(p, (kv, None, keys2), *inputs(c))
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(a, b)  # bit for bit
    # The run wrote the new tokens' latent and rope where the separate pools got them; the padding stays.
    np.testing.assert_array_equal(kv[..., :DL], lat)
    np.testing.assert_array_equal(kv[..., DL:DL + DR], rope)
    np.testing.assert_array_equal(kv[..., DL + DR:], 7.0)
    np.testing.assert_array_equal(keys2, keys)
    # A second layer under the same plan over the dict form.
    got2 = dsacp.run_layer(p, {"latent": kv, "rope": None, "index_keys": keys2}, *inputs(c))
    np.testing.assert_array_equal(got2[2], ref[2])


def test_the_ops_over_the_combined_kv(case):  # noqa: F811
    _, c = case
    bt, n = layout(seed=12)
    lat, rope, keys = caches_with_context(c, bt, n, 8)
    kv = combined(lat, rope, DL + DR + 4)
    p = make_plan(bt, n)
    s = np.array(p.slots, np.int64)
    dsacp.cache_write(c["kv_latent"], s, lat)
    dsacp.cache_write(c["k_rope"], s, rope)
    dsacp.cache_write(c["kv_latent"], s, kv, rope_rows=c["k_rope"])
    np.testing.assert_array_equal(kv[..., :DL], lat)
    np.testing.assert_array_equal(kv[..., DL:DL + DR], rope)
    np.testing.assert_array_equal(kv[..., DL + DR:], 7.0)
    req, klen = np.array(p.token_request, np.int32), np.array(p.key_len, np.int32)
    tk = dsacp.indexer_topk(c["idx_q"], c["idx_w"], keys, bt, req, klen, 16)
    o, l = dsacp.sparse_mla(c["q_nope"], c["q_rope"], lat, rope, bt, req, klen, tk, 0.125)
    o2, l2 = dsacp.sparse_mla(c["q_nope"], c["q_rope"], kv, None, bt, req, klen, tk, 0.125)
    np.testing.assert_array_equal(o, o2)
    np.testing.assert_array_equal(l, l2)


def test_combined_kv_refusals(case):  # noqa: F811
    _, c = case
    bt, n = layout(seed=13)
    lat, rope, keys = caches_with_context(c, bt, n, 8)
    p = make_plan(bt, n)
    x = inputs(c)
    short = np.zeros((n, 8, DL + DR - 1), np.float32)
    with pytest.raises(ValueError, match=r"run_layer: tensor 'latent' has shape \[\d+, 8, 47\], expected the combined "
                                         r"KV cache \[num_pages, page_size, kv_row\] with kv_row >= Dl \+ Dr = 32 \+ 16"):
        dsacp.run_layer(p, (short, None, keys), *x)
    odd = np.zeros((n, 8, DL + DR + 2), np.float32)  # 200-byte rows: not a multiple of 16
    with pytest.raises(ValueError, match=r"tensor 'latent' has shape \[\d+, 8, 50\] of float32: the combined KV "
                                         r"cache's rows \(50 values\) .* multiple of 16 bytes"):
        dsacp.run_layer(p, (odd, None, keys), *x)
    strided = np.zeros((n, 8, 2 * (DL + DR)), np.float32)[..., :DL + DR]  # rows 96 apart: not contiguous
    with pytest.raises(ValueError, match=r"tensor 'latent' is not contiguous \(strides \[768, 96, 1\] elements, "
                                         r"expected \[384, 48, 1\], or a wider stride of dim 0 only"):
        dsacp.run_layer(p, (strided, None, keys), *x)
    with pytest.raises(ValueError, match=r"cache 'latent' \(the combined KV, rope=None\) holds float32 in pages of 4"):
        dsacp.run_layer(p, (np.zeros((2 * n, 4, DL + DR), np.float32), None, keys), *x)
    with pytest.raises(ValueError, match=r"cache 'latent' \(the combined KV\) holds 2 pages, the plan's block table "
                                         r"uses page \d+"):
        dsacp.run_layer(p, (np.zeros((2, 8, DL + DR), np.float32), None, keys), *x)
    req, klen = np.array(p.token_request, np.int32), np.array(p.key_len, np.int32)
    tk = np.zeros((p.num_tokens, 16), np.int32)
    with pytest.raises(ValueError, match=r"sparse_mla: tensor 'latent' has shape \[\d+, 8, 40\], expected the combined "
                                         r"KV cache .* since rope is None"):
        dsacp.sparse_mla(c["q_nope"], c["q_rope"], np.zeros((n, 8, 40), np.float32), None, bt, req, klen, tk, 0.1)
    with pytest.raises(ValueError, match=r"cache_write: tensor 'pool' has shape \[\d+, 8, 32\], expected the combined "
                                         r"KV cache .* since rope_rows is given"):
        dsacp.cache_write(c["kv_latent"], np.array(p.slots, np.int64), lat, rope_rows=c["k_rope"])
