"""The CP step from Python with the ranks as threads of this process: dsacp.cp_group over Python collectives
objects (here a threading.Barrier exchange; test_cp_torch.py runs the same case as processes over
torch.distributed), dsacp.cp_plan and dsacp.cp_run_layer of each rank, against the single-device planned step
(cp_case.py). Runs without torch (CI)."""
import threading

import numpy as np
import pytest

import dsacp
from cp_case import LAYOUTS, check_rank, reference, run_rank


class _Shared:
    def __init__(self, n):
        self.n, self.slots = n, [None] * n
        self.bar = threading.Barrier(n, timeout=60)


class ThreadCollectives:
    """A CP communicator's collectives between threads: each rank posts its buffer, all copy, all leave."""

    def __init__(self, shared, rank):
        self.sh, self.rank = shared, rank

    def all_gather(self, send, recv):
        sh = self.sh
        sh.slots[self.rank] = send
        sh.bar.wait()
        n = send.size
        for k in range(sh.n):
            recv[k * n:(k + 1) * n] = sh.slots[k]
        sh.bar.wait()

    def all_to_all(self, send, recv):
        sh = self.sh
        sh.slots[self.rank] = send
        sh.bar.wait()
        n = send.size // sh.n
        for k in range(sh.n):
            recv[k * n:(k + 1) * n] = sh.slots[k][self.rank * n:(self.rank + 1) * n]
        sh.bar.wait()

    def broadcast(self, buf, root):
        sh = self.sh
        if self.rank == root:
            sh.slots[root] = buf
        sh.bar.wait()
        if self.rank != root:
            buf[:] = sh.slots[root]
        sh.bar.wait()

    def barrier(self):
        self.sh.bar.wait()

    def abort(self, reason):
        self.sh.bar.abort()


def thread_groups(P, D, **layout):
    """The P * D ranks' groups of one layout (world, PCP and DCP collectives between threads)."""
    world = _Shared(P * D)
    pcp = [_Shared(P) for _ in range(D)]
    dcp = [_Shared(D) for _ in range(P)]
    return [dsacp.cp_group(P, D, rank=cr, collectives=(ThreadCollectives(world, cr),
                                                       ThreadCollectives(pcp[cr % D], cr // D),
                                                       ThreadCollectives(dcp[cr // D], cr % D)), **layout)
            for cr in range(P * D)]


def run_threads(groups, fn):
    results, errors = [None] * len(groups), []

    def body(i):
        try:
            results[i] = fn(groups[i])
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_cp_ranks_as_threads_equal_the_single_device_step(ref, name):
    groups = thread_groups(**LAYOUTS[name])
    assert [g.rank for g in groups] == [0, 1] and groups[0].transport == "python collectives"
    results = run_threads(groups, run_rank)
    seen = set()
    for res in results:
        assert check_rank(res, ref) > 0
        for step, r in enumerate(res):
            seen.update((step, t) for t in r[0] if t >= 0)
    assert seen == {(s, t) for s, (o, _, _) in enumerate(ref) for t in range(o.shape[0])}  # every token computed
    assert groups[0].comm_stats()[0] > 0  # the ranks did exchange


def test_cp_over_the_combined_kv(ref):
    results = run_threads(thread_groups(P=2, D=1), lambda g: run_rank(g, combined=True))
    for res in results:
        assert check_rank(res, ref) > 0


def test_cp_argument_errors():
    g = thread_groups(P=1, D=2)[0]
    from cp_case import block_table, plan_kwargs
    bt, n = block_table()
    kw = plan_kwargs(n)
    with pytest.raises(ValueError, match=r"H=3 .*divisible|divisible.*D=2|heads"):
        dsacp.cp_plan(g, [1], [5], bt[:1], **{**kw, "heads": 3})
    p = dsacp.cp_plan(g, [1, 2, 1, 6], [40, 17, 25, 30], bt, **kw)
    assert p.num_heads == 2 and p.head_begin == 0 and p.num_rows >= 1
    x = [np.zeros((p.num_rows + 1, 4, 32), np.float32)]
    caches = (np.zeros((n, 8, 32), np.float32), np.zeros((n, 8, 16), np.float32), np.zeros((n, 8, 32), np.float32))
    with pytest.raises(ValueError, match=r"cp_run_layer: tensor 'q_nope' has \d+ tokens, the rank's rows \d+"):
        dsacp.cp_run_layer(p, caches, *x, x[0], x[0], x[0])
    with pytest.raises(ValueError, match=r"collectives=\(world, pcp, dcp\) goes with rank="):
        dsacp.cp_group(2, 1, collectives=(None, None, None))
    with pytest.raises(ValueError, match=r"indexer=\"both\""):
        dsacp.cp_group(2, 1, rank=0, collectives=(1, 2, 3), indexer="both")


def test_a_failing_collective_is_a_runtime_error_and_aborts_the_group(ref):
    class Broken(ThreadCollectives):
        def all_gather(self, send, recv):
            raise OSError("link down")

    world = _Shared(2)
    groups = [dsacp.cp_group(2, 1, rank=cr, collectives=(Broken(world, cr), Broken(_Shared(2), cr),
                                                         ThreadCollectives(_Shared(1), 0)))
              for cr in range(2)]
    with pytest.raises(RuntimeError, match=r"CP rank \d: .*link down"):
        run_threads(groups, run_rank)
