"""A two-step CP case for the Python CP tests (threads here, processes in test_cp_torch.py): step 1 prefills every
request's context, step 2 is a mixed batch (MTP decodes, then a prefill with context). Each CP rank runs both steps
over its own caches; every row it computes must equal the single-device planned step's row of that token: the
top-k bit for bit, out and lse to float32 rounding (the merge of partial results reorders sums)."""
import numpy as np

import dsacp

PS = 8
DIMS = dict(heads=4, latent_dim=32, rope_dim=16, index_heads=4, index_dim=32)
K = 16
STEP2 = ([1, 2, 1, 6], [40, 17, 25, 30])  # decodes first (decode_threshold 2), then a prefill with context
STEPS = [(STEP2[1], [0] * 4), STEP2]
LAYOUTS = {  # name -> cp_group keywords
    "P2": dict(P=2, D=1),
    "D2": dict(P=1, D=2),
    "D2-dsa": dict(P=1, D=2, dsa_cp=True),
    "P2-replicated": dict(P=2, D=1, indexer="replicated"),
    "D2-interleave1": dict(P=1, D=2, interleave=1),
}


def block_table():
    """A shuffled table covering every request's whole sequence (more than a CP rank needs)."""
    seq = [q + c for q, c in zip(*STEP2)]
    pages = [(s + PS - 1) // PS for s in seq]
    n = sum(pages) + 2
    perm = np.random.default_rng(5).permutation(n).astype(np.int32)
    bt = np.full((4, max(pages)), -1, np.int32)
    at = 0
    for r, k in enumerate(pages):
        bt[r, :k] = perm[at:at + k]
        at += k
    return bt, n


def step_inputs(step):
    """The step's full-batch inputs (f32), the same on every rank."""
    T = sum(STEPS[step][0])
    g = np.random.default_rng(100 + step)
    H, Dl, Dr, Hi, Di = (DIMS[k] for k in ("heads", "latent_dim", "rope_dim", "index_heads", "index_dim"))
    f = lambda *s: g.standard_normal(s).astype(np.float32)  # noqa: E731
    return [f(T, H, Dl), f(T, H, Dr), f(T, Dl), f(T, Dr), f(T, Hi, Di), np.abs(f(T, Hi)), f(T, Di)]


def new_caches(n, index_factor=1, combined=False):
    lat = np.full((n, PS, 32), np.nan, np.float32)
    keys = np.full((n * index_factor, PS, 32), np.nan, np.float32)
    if combined:
        return (np.full((n, PS, 48), np.nan, np.float32), None, keys)
    return (lat, np.full((n, PS, 16), np.nan, np.float32), keys)


def plan_kwargs(n):
    return dict(num_pages=n, scale=0.125, topk=K, page_size=PS, dtype="f32", decode_threshold=2, **DIMS)


def reference():
    """The single-device planned step's results of both steps: [(out, lse, topk)]."""
    bt, n = block_table()
    caches = new_caches(n)
    res = []
    for step, (ql, cl) in enumerate(STEPS):
        p = dsacp.plan(ql, cl, bt, **plan_kwargs(n))
        res.append(dsacp.run_layer(p, caches, *step_inputs(step)))
    return res


def run_rank(group, combined=False, torch_tensors=False):
    """This rank's rows of both steps: [(row_token, head_begin, num_heads, out, lse, topk)]."""
    bt, n = block_table()
    res = []
    caches = None
    for step, (ql, cl) in enumerate(STEPS):
        p = dsacp.cp_plan(group, ql, cl, bt, **plan_kwargs(n))
        if caches is None:
            caches = new_caches(n, p.index_page_factor, combined)
        x = step_inputs(step)
        if torch_tensors:
            import torch
            x = [torch.from_numpy(a) for a in x]
        rows = [p.rows(a, heads=i < 2) for i, a in enumerate(x)]
        out, lse, topk = dsacp.cp_run_layer(p, caches, *rows)
        res.append((list(p.row_token), p.head_begin, p.num_heads, np.asarray(out), np.asarray(lse),
                    np.asarray(topk)))
    return res


def check_rank(results, ref):
    """A rank's rows against the single-device results; returns how many rows were compared."""
    rows = 0
    for (tok, h0, nh, out, lse, topk), (r_out, r_lse, r_topk) in zip(results, ref):
        for i, t in enumerate(tok):
            if t < 0:
                continue
            np.testing.assert_array_equal(topk[i], r_topk[t], err_msg=f"token {t}")
            np.testing.assert_allclose(out[i], r_out[t, h0:h0 + nh], rtol=2e-5, atol=2e-6)
            np.testing.assert_allclose(lse[i], r_lse[t, h0:h0 + nh], rtol=2e-6, atol=2e-6)
            rows += 1
    return rows
