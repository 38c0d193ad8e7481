"""The Python module's ops against direct numpy math (fp64), the case-file replay against the same math, argument
errors, and zero-copy outputs. CPU backend; run by scripts/test (pytest)."""
import os
import subprocess
import sys

import numpy as np
import pytest

import dsacp

SEED = int(os.environ.get("DSACP_TEST_SEED", "1234")) if os.environ.get("DSACP_TEST_SEED", "") not in ("", "random") \
    else int.from_bytes(os.urandom(4), "little")


@pytest.fixture
def rng():
    print(f"seed {SEED}")
    return np.random.default_rng(SEED)


def paged(rng, rows, page_size, num_pages, extra_pages=2):
    """rows [n, dim] laid into a shuffled paged pool with NaN in every unused slot; returns (pool, block_row)."""
    n, dim = rows.shape
    need = (n + page_size - 1) // page_size
    pages = rng.permutation(num_pages)[:need].astype(np.int32)
    pool = np.full((num_pages, page_size, dim), np.nan, np.float32)
    for j in range(n):
        pool[pages[j // page_size], j % page_size] = rows[j]
    return pool, pages


def topk_reference(scores, K):
    """The canonical row: the K highest (ties to the lower position), ascending, -1 padded."""
    n = len(scores)
    order = sorted(range(n), key=lambda j: (-scores[j], j))[:K]
    row = sorted(order) + [-1] * (K - min(K, n))
    return np.array(row, np.int32)


def test_indexer_topk_matches_fp64(rng):
    T, Hi, Di, ps, K = 5, 3, 16, 7, 9
    n = 40
    keys = rng.standard_normal((n, Di)).astype(np.float32)
    pool, pages = paged(rng, keys, ps, 12)
    block_table = np.full((1, 8), -1, np.int32)
    block_table[0, : len(pages)] = pages
    q = rng.standard_normal((T, Hi, Di)).astype(np.float32)
    w = rng.random((T, Hi)).astype(np.float32)
    key_len = np.array([1, 6, 9, 33, 40], np.int32)
    request = np.zeros(T, np.int32)
    topk, scores = dsacp.indexer_topk(q, w, pool, block_table, request, key_len, K, return_scores=True)
    assert topk.dtype == np.int32 and topk.shape == (T, K)
    for t in range(T):
        s = [float(np.sum(w[t].astype(np.float64) * np.maximum(q[t].astype(np.float64) @ keys[j].astype(np.float64), 0)))
             for j in range(key_len[t])]
        want = topk_reference(s, K)
        np.testing.assert_array_equal(topk[t], want)
        chosen = want[want >= 0]
        np.testing.assert_allclose(scores[t, : len(chosen)], np.array(s)[chosen], rtol=1e-5, atol=1e-5)


def test_sparse_mla_matches_fp64(rng):
    T, H, Dl, Dr, ps, K = 4, 3, 24, 8, 5, 6
    n = 23
    latent = rng.standard_normal((n, Dl)).astype(np.float32)
    rope = rng.standard_normal((n, Dr)).astype(np.float32)
    lat_pool, pages = paged(rng, latent, ps, 9)
    rope_pool = np.full((9, ps, Dr), np.nan, np.float32)
    for j in range(n):
        rope_pool[pages[j // ps], j % ps] = rope[j]
    block_table = np.full((1, 6), -1, np.int32)
    block_table[0, : len(pages)] = pages
    q_nope = rng.standard_normal((T, H, Dl)).astype(np.float32)
    q_rope = rng.standard_normal((T, H, Dr)).astype(np.float32)
    key_len = np.array([23, 23, 4, 0], np.int32)
    topk = np.full((T, K), -1, np.int32)
    topk[0] = [0, 3, 7, 11, 19, 22]
    topk[1, :3] = [2, 5, 20]
    topk[2, :2] = [1, 3]
    scale = 0.3
    out, lse = dsacp.sparse_mla(q_nope, q_rope, lat_pool, rope_pool, block_table, np.zeros(T, np.int32), key_len,
                                topk, scale)
    for t in range(T):
        sel = [j for j in topk[t] if 0 <= j < key_len[t]]
        if not sel:
            assert np.all(out[t] == 0) and np.all(np.isneginf(lse[t]))
            continue
        for h in range(H):
            l = np.array([scale * (q_nope[t, h].astype(np.float64) @ latent[j] + q_rope[t, h].astype(np.float64) @ rope[j])
                          for j in sel])
            m = l.max()
            p = np.exp(l - m)
            want = (p[:, None] * latent[sel].astype(np.float64)).sum(0) / p.sum()
            np.testing.assert_allclose(out[t, h], want, rtol=1e-5, atol=1e-5)
            assert abs(lse[t, h] - (m + np.log(p.sum()))) < 1e-4


def test_lse_merge_matches_fp64(rng):
    S, R, Dl = 3, 7, 10
    part_out = rng.standard_normal((S, R, Dl)).astype(np.float32)
    part_lse = rng.standard_normal((S, R)).astype(np.float32)
    part_lse[1, 2] = -np.inf
    part_lse[:, 4] = -np.inf
    out, lse = dsacp.lse_merge(part_out, part_lse)
    for r in range(R):
        L = part_lse[:, r].astype(np.float64)
        if np.all(np.isneginf(L)):
            assert np.all(out[r] == 0) and np.isneginf(lse[r])
            continue
        m = L.max()
        wts = np.exp(L - m)
        np.testing.assert_allclose(out[r], (wts[:, None] * part_out[:, r]).sum(0) / wts.sum(), rtol=1e-5, atol=1e-6)
        assert abs(lse[r] - (m + np.log(wts.sum()))) < 1e-5


def test_cache_write_in_place(rng):
    pool = np.full((3, 4, 6), np.nan, np.float32)
    rows = rng.standard_normal((3, 6)).astype(np.float32)
    slots = np.array([5, -1, 11], np.int64)
    before = pool.ctypes.data
    dsacp.cache_write(rows, slots, pool)
    assert pool.ctypes.data == before
    np.testing.assert_array_equal(pool[1, 1], rows[0])
    np.testing.assert_array_equal(pool[2, 3], rows[2])
    assert np.isnan(pool[0]).all()
    with pytest.raises(ValueError, match="slot"):
        dsacp.cache_write(rows, np.array([5, 0, 12], np.int64), pool)


def test_outputs_are_the_callers_buffers(rng):
    S, R, Dl = 2, 3, 4
    part_out = rng.standard_normal((S, R, Dl)).astype(np.float32)
    part_lse = rng.standard_normal((S, R)).astype(np.float32)
    out = np.empty((R, Dl), np.float32)
    lse = np.empty((R,), np.float32)
    o, l = dsacp.lse_merge(part_out, part_lse, out=out, lse=lse)
    assert o is out and l is lse
    assert out.ctypes.data == o.ctypes.data
    with pytest.raises(ValueError, match=r"output 'out' has shape \[3, 5\], expected \[3, 4\]"):
        dsacp.lse_merge(part_out, part_lse, out=np.empty((R, 5), np.float32))


def test_argument_errors_name_the_tensor(rng):
    q = np.zeros((2, 2, 8), np.float32)
    w = np.zeros((2, 2), np.float32)
    keys = np.zeros((3, 4, 8), np.float32)
    bt = np.zeros((1, 3), np.int32)
    req = np.zeros(2, np.int32)
    kl = np.array([3, 4], np.int32)
    with pytest.raises(ValueError, match="'w' has shape"):
        dsacp.indexer_topk(q, np.zeros((2, 3), np.float32), keys, bt, req, kl, 2)
    with pytest.raises(ValueError, match="'key_len' has dtype int64, expected int32"):
        dsacp.indexer_topk(q, w, keys, bt, req, kl.astype(np.int64), 2)
    with pytest.raises(ValueError, match="not contiguous"):
        dsacp.indexer_topk(np.zeros((2, 2, 16), np.float32)[:, :, ::2], w, keys, bt, req, kl, 2)
    with pytest.raises(ValueError, match="'keys' has shape"):
        dsacp.indexer_topk(q, w, np.zeros((3, 4, 9), np.float32), bt, req, kl, 2)
    with pytest.raises(ValueError, match="K=0"):
        dsacp.indexer_topk(q, w, keys, bt, req, kl, 0)
    with pytest.raises(ValueError, match="block_table"):
        dsacp.indexer_topk(q, w, keys, np.full((1, 3), 7, np.int32), req, kl, 2)  # page 7 of 3
    with pytest.raises(ValueError, match="key_len"):
        dsacp.indexer_topk(q, w, keys, bt, req, np.array([3, 13], np.int32), 2)  # past max_pages * page_size
    with pytest.raises(TypeError):
        dsacp.indexer_topk("q", w, keys, bt, req, kl, 2)


def test_replay_matches_the_cli_and_every_layout(tmp_path):
    case = str(tmp_path / "c.safetensors")
    dsacp.make_case(case, [1, 3, 9], [40, 17, 0], heads=4, topk=16, seed=7)
    one = dsacp.replay(case, str(tmp_path / "r1.safetensors"))
    assert one["topk_indices"].shape == (13, 16) and one["out"].shape == (13, 4, 32) and one["lse"].shape == (13, 4)
    for layout in (dict(pcp=2), dict(dcp=2), dict(dcp=2, indexer="replicated"), dict(pcp=2, dcp=2)):
        r = dsacp.replay(case, **layout)
        np.testing.assert_array_equal(r["topk_indices"], one["topk_indices"])
        np.testing.assert_allclose(r["out"], one["out"], rtol=1e-5, atol=1e-6)
    cli = subprocess.run([sys.executable, "-m", "dsacp", "replay", case, "--out", str(tmp_path / "r2.safetensors")],
                         capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    assert open(tmp_path / "r1.safetensors", "rb").read() == open(tmp_path / "r2.safetensors", "rb").read()
    with pytest.raises(OSError):
        dsacp.replay(str(tmp_path / "missing.safetensors"))
    with pytest.raises(ValueError, match="indexer"):
        dsacp.replay(case, indexer="sideways")
    (tmp_path / "bad.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(ValueError):
        dsacp.replay(str(tmp_path / "bad.safetensors"))


def test_python_m_dsacp_reports_usage_errors():
    r = subprocess.run([sys.executable, "-m", "dsacp", "run", "--bogus"], capture_output=True, text=True)
    assert r.returncode == 2 and "--bogus" in r.stderr


def test_readme_example_runs():
    import re
    readme = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")
    code = re.search(r"```python\n(.*?)```", open(readme).read(), re.S).group(1)
    env = {}
    exec(code, env)
    assert env["topk"].shape == (2, 8) and env["out"].shape == (2, 4, 64) and np.isfinite(env["lse"]).all()


def test_thread_count_is_checked():
    with pytest.raises(ValueError, match="threads=-1"):
        dsacp.lse_merge(np.zeros((1, 1, 1), np.float32), np.zeros((1, 1), np.float32), threads=-1)
