"""FP8 latent caches as vLLM holds them: fp8_ds_mla records, uint8 [num_blocks, page_size, Dl + 4 * Dl / 128 +
2 * Dr] (656 bytes for Dl 512, Dr 64). cache_write quantizes latent rows per 128-value tile and stores the rope as
bf16 in the same record; sparse_mla attends over the records. Checked against direct numpy decoding of the bytes
(e4m3 values times their tile's f32 scale; bf16 rope) and the same attention over f32 pools of the decoded values.
CPU backend (the CUDA backend's record kernels answer "unsupported" until they land: tests/test_cuda.py)."""
import numpy as np
import pytest

import dsacp


def e4m3_decode(b):
    """float8_e4m3fn bytes -> float32 (bias 7, no infinities, 0x7f / 0xff NaN)."""
    b = b.astype(np.int32)
    s = np.where(b & 0x80, -1.0, 1.0)
    e = (b >> 3) & 0xF
    m = b & 0x7
    v = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7))
    v = np.where((e == 15) & (m == 7), np.nan, v)
    return (s * v).astype(np.float32)


def bf16_round(x):
    """f32 -> the nearest bf16 (ties to even), as f32."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def decode_records(pool, Dl, Dr):
    """(latent [.., Dl], rope [.., Dr]) of every record, as f32."""
    tiles = Dl // 128
    vals = e4m3_decode(pool[..., :Dl])
    scales = np.ascontiguousarray(pool[..., Dl:Dl + 4 * tiles]).view(np.float32)
    latent = vals * np.repeat(scales, 128, axis=-1)
    rope = (np.ascontiguousarray(pool[..., Dl + 4 * tiles:]).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return latent, rope


def test_cache_write_and_sparse_mla_over_fp8_ds_mla_records():
    rng = np.random.default_rng(7)
    T, H, Dl, Dr, ps, num_pages, K = 5, 4, 256, 16, 8, 6, 12
    record = Dl + 4 * (Dl // 128) + 2 * Dr
    n = 30
    pool = np.zeros((num_pages, ps, record), np.uint8)
    pages = rng.permutation(num_pages)[:4].astype(np.int32)
    block_table = np.full((1, 5), -1, np.int32)
    block_table[0, :4] = pages
    latent = (rng.standard_normal((n, Dl)) * rng.uniform(0.1, 10, (n, 1))).astype(np.float32)
    rope = rng.standard_normal((n, Dr)).astype(np.float32)
    slots = np.array([pages[j // ps] * ps + j % ps for j in range(n)], np.int64)
    dsacp.cache_write(latent, slots, pool, rope_rows=rope)

    lat_dec, rope_dec = decode_records(pool, Dl, Dr)
    for j in range(n):
        got = lat_dec[pages[j // ps], j % ps]
        for tile in range(Dl // 128):
            x = latent[j, tile * 128:(tile + 1) * 128]
            # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of the value; the tile's max maps to 448.
            assert np.all(np.abs(got[tile * 128:(tile + 1) * 128] - x) <= np.abs(x) / 16 + np.abs(x).max() / 448 * 2 ** -6)
        np.testing.assert_array_equal(rope_dec[pages[j // ps], j % ps], bf16_round(rope[j]))

    q_nope = rng.standard_normal((T, H, Dl)).astype(np.float32)
    q_rope = rng.standard_normal((T, H, Dr)).astype(np.float32)
    key_len = np.array([30, 30, 17, 5, 0], np.int32)
    topk = np.full((T, K), -1, np.int32)
    for t in range(T):
        sel = np.sort(rng.permutation(key_len[t])[:K]) if key_len[t] else []
        topk[t, :len(sel)] = sel
    request = np.zeros(T, np.int32)
    out, lse = dsacp.sparse_mla(q_nope, q_rope, pool, None, block_table, request, key_len, topk, 0.05)
    ref, ref_lse = dsacp.sparse_mla(q_nope, q_rope, np.ascontiguousarray(lat_dec), np.ascontiguousarray(rope_dec),
                                    block_table, request, key_len, topk, 0.05)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
    assert np.all(out[4] == 0) and np.all(np.isneginf(lse[4]))


def test_record_argument_errors():
    T, H, Dl, Dr, ps = 2, 2, 128, 16, 4
    pool = np.zeros((3, ps, Dl + 4 + 2 * Dr), np.uint8)
    f32_pool = np.zeros((3, ps, Dl), np.float32)
    q_nope = np.zeros((T, H, Dl), np.float32)
    bt = np.zeros((1, 3), np.int32)
    req = np.zeros(T, np.int32)
    klen = np.ones(T, np.int32)
    topk = np.zeros((T, 1), np.int32)
    with pytest.raises(ValueError, match=r"rope of 16 values, but q_rope has Dr=8; expected records of 148 bytes"):
        dsacp.sparse_mla(q_nope, np.zeros((T, H, 8), np.float32), pool, None, bt, req, klen, topk, 1.0)
    with pytest.raises(ValueError, match=r"expected the combined KV cache .* since rope is None \(or fp8_ds_mla"):
        dsacp.sparse_mla(q_nope, np.zeros((T, H, Dr), np.float32), f32_pool, None, bt, req, klen, topk, 1.0)
    with pytest.raises(ValueError, match=r"expected the combined KV cache .* since rope_rows is given \(or fp8_ds_mla"):
        dsacp.cache_write(np.zeros((T, Dl), np.float32), np.zeros(T, np.int64), f32_pool,
                          rope_rows=np.zeros((T, Dr), np.float32))
    with pytest.raises(ValueError, match=r"'rope_rows' has shape \[2, 8\], expected \[T=2, Dr=16\]"):
        dsacp.cache_write(np.zeros((T, Dl), np.float32), np.zeros(T, np.int64), pool,
                          rope_rows=np.zeros((T, 8), np.float32))


def test_cpu_calls_ignore_stream_and_check_errors_is_a_no_op():
    out, lse = dsacp.lse_merge(np.zeros((2, 3, 4), np.float32), np.zeros((2, 3), np.float32), stream=12345)
    assert out.shape == (3, 4) and lse.shape == (3,)
    dsacp.check_errors()
