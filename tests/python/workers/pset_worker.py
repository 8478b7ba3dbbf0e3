"""Process sets: results per set, independence of disjoint sets, registration rules.

usage: pset_worker.py MODE
  static        init(process_sets=[ProcessSet([0, 2]), ProcessSet([1, 3])]) on 4 ranks
  dynamic       init(process_sets="dynamic"), add/remove sets at run time
  dynamic_env   init() with FERROVOD_DYNAMIC_PROCESS_SETS=1 set by the test
"""

import sys
import time

import numpy as np

import fvtest as T
from fvtest import AVERAGE, SUM

import ferrovod as fv


class Case:
    """Case keys counted per set: members of several sets see different sequences overall."""

    def __init__(self):
        self.i = {}

    def key(self, ps):
        i = self.i[ps.process_set_id] = self.i.get(ps.process_set_id, 0) + 1
        return (77, i, ps.process_set_id)


def check_ops_on(ck, ps, cases, tag):
    """Every op kind on ``ps`` (this rank is a member) against the members-only reference.

    Ops are named: members of several sets issue different numbers of ops, so automatic
    (call-order) names would not line up across a set's members. barrier() takes no name.
    """
    r = fv.rank()
    members = list(ps.ranks)
    m = len(members)
    me = members.index(r)
    ck.equal(ps.rank(), me, f"{tag} ps.rank()")
    ck.equal(ps.size(), m, f"{tag} ps.size()")
    ck.equal(ps.included(), True, f"{tag} ps.included()")
    for dt in (np.float32, np.int32, np.float64):
        for opn, op in ((SUM, fv.Sum), (AVERAGE, fv.Average), (T.MAX, fv.Max)):
            k = cases.key(ps)
            xs = [T.gen(k, j, dt, (9,), T.input_mode(opn, dt), m) for j in members]
            ck.array(fv.allreduce(xs[me], op=op, process_set=ps, name=f"{tag}.ar.{k[1]}"), T.ref_reduce(xs, opn, dt, m),
                     f"{tag} allreduce {opn} {np.dtype(dt)}")
    k = cases.key(ps)
    xs = [T.gen(k, j, np.int16, (j % 3 + 1, 2)) for j in members]
    ck.array(fv.allgather(xs[me], process_set=ps, name=f"{tag}.ag"), np.concatenate(xs),
             f"{tag} allgather (set-rank order)")
    for root in members:  # the root is a global rank
        k = cases.key(ps)
        xs = [T.gen(k, j, np.float64, (4,)) for j in members]
        ck.array(fv.broadcast(xs[me], root, process_set=ps, name=f"{tag}.bc.{root}"), xs[members.index(root)],
                 f"{tag} broadcast root={root}")
        x = xs[me].copy()
        fv.broadcast_(x, root_rank=root, process_set=ps, name=f"{tag}.bc_.{root}")
        ck.array(x, xs[members.index(root)], f"{tag} broadcast_ root={root}")
    k = cases.key(ps)
    xs = [T.gen(k, j, np.float32, (2 * m, 3)) for j in members]
    ck.array(fv.alltoall(xs[me], process_set=ps, name=f"{tag}.a2a"), np.concatenate([x[2 * me:2 * me + 2] for x in xs]),
             f"{tag} alltoall")
    k = cases.key(ps)
    xs = [T.gen(k, j, np.float32, (2 * m + 1, 2)) for j in members]
    start, cnt = T.split_rows(2 * m + 1, m)[me]
    ck.array(fv.reducescatter(xs[me], op=fv.Sum, process_set=ps, name=f"{tag}.rs"),
             T.ref_reduce(xs, SUM, np.float32, m)[start:start + cnt], f"{tag} reducescatter")
    k = cases.key(ps)
    xs = [[T.gen(k, j, np.float32, (3,)) for j in members], [T.gen(k + (1,), j, np.float64, (2, 2)) for j in members]]
    res = fv.grouped_allreduce([xs[0][me], xs[1][me]], op=fv.Sum, process_set=ps, name=f"{tag}.gar")
    ck.array(res[0], T.ref_reduce(xs[0], SUM, np.float32, m), f"{tag} grouped_allreduce[0]")
    ck.array(res[1], T.ref_reduce(xs[1], SUM, np.float64, m), f"{tag} grouped_allreduce[1]")
    fv.barrier(process_set=ps)
    ck.equal(fv.allgather_object(("obj", r), process_set=ps, name=f"{tag}.ago"), [("obj", j) for j in members],
             f"{tag} allgather_object")
    ck.equal(fv.broadcast_object({"from": members[-1]} if r == members[-1] else None, root_rank=members[-1],
                                 process_set=ps, name=f"{tag}.bco"), {"from": members[-1]}, f"{tag} broadcast_object")


def check_foreign(ck, ps, tag):
    """Every op on a set this rank is not in is a ValueError raised at once."""
    x = np.ones(4, np.float32)
    ck.equal(ps.included(), False, f"{tag} included()")
    for what, fn in {
        "allreduce": lambda: fv.allreduce(x, process_set=ps),
        "allreduce_async": lambda: fv.allreduce_async(x, process_set=ps),  # at submission, as Horovod
        "allgather": lambda: fv.allgather(x, process_set=ps),
        "broadcast": lambda: fv.broadcast(x, ps.ranks[0], process_set=ps),
        "alltoall": lambda: fv.alltoall(x, process_set=ps),
        "reducescatter": lambda: fv.reducescatter(x, process_set=ps),
        "barrier": lambda: fv.barrier(process_set=ps),
    }.items():
        ck.raises(ValueError, fn, f"{tag} {what} on a set this rank is not in")


def global_sync(ck, tag):
    n = fv.size()
    ck.array(fv.allreduce(np.ones(3, np.float64) * (fv.rank() + 1), op=fv.Sum, name=f"global.{tag}"),
             np.full(3, n * (n + 1) / 2), f"global allreduce {tag}")


def case_static():
    a, b = fv.ProcessSet([2, 0]), fv.ProcessSet([1, 3])  # ranks are sorted
    fv.init(process_sets=[a, b])
    r, n = fv.rank(), fv.size()
    assert n == 4, "run with 4 ranks"
    ck = T.Checker(r)
    cases = Case()
    ck.equal(list(a.ranks), [0, 2], "ProcessSet sorts its ranks")
    ids = {fv.global_process_set.process_set_id, a.process_set_id, b.process_set_id}
    ck.true(None not in ids and len(ids) == 3, "process_set_id", f"ids {ids}")
    ck.equal(fv.global_process_set.process_set_id, 0, "global set id")
    ck.equal(fv.global_process_set.size(), 4, "global set size")
    ck.equal(fv.global_process_set.rank(), r, "global set rank")
    mine, other = (a, b) if r in (0, 2) else (b, a)
    check_ops_on(ck, mine, cases, "own set")
    check_foreign(ck, other, "foreign set")
    ck.raises(ValueError, lambda: fv.broadcast(np.ones(2), other.ranks[0], process_set=mine),
              "broadcast root outside the set")
    ck.raises((ValueError, fv.FerrovodError), lambda: fv.add_process_set([0, 1]), "add_process_set when not dynamic")
    global_sync(ck, "after static checks")

    # disjoint sets run independently: B finishes 100 ops while A's ranks have not submitted
    # theirs. A's ranks wait in a global broadcast that B's ranks join only after their 100 ops,
    # so a set B that waited for set A would never finish (the job fails at its deadline).
    x = np.full(16, r + 1, np.float32)
    b_done = np.zeros(1, np.int32)
    if mine is a:
        fv.broadcast(b_done, 1, name="indep.b_done")
        t_start = time.time()
        res = fv.allreduce(x, op=fv.Sum, process_set=a, name="indep")
        ck.array(res, np.full(16, 1 + 3, np.float32), "set A op after set B's")
        t_end = time.time()
    else:
        t_start = time.time()
        for i in range(100):
            res = fv.allreduce(x, op=fv.Sum, process_set=b, name="indep" if i == 0 else f"indep.{i % 5}")
            ck.array(res, np.full(16, 2 + 4, np.float32), f"set B op {i}")
        t_end = time.time()
        print(f"set B: 100 allreduces in {t_end - t_start:.3f} s", flush=True)
        fv.broadcast(b_done, 1, name="indep.b_done")
    spans = fv.allgather_object((r, t_start, t_end), name="spans")
    b_end = max(e for rr, _, e in spans if rr in (1, 3))
    a_start = min(s for rr, s, _ in spans if rr in (0, 2))
    ck.true(b_end < a_start, "independent sets", f"set B ended at {b_end:.3f}, after set A started at {a_start:.3f}: "
            f"B waited for A ({spans})")

    # both sets busy at once, same op names in both
    for i in range(20):
        k = (91, i)
        xs = [T.gen(k, j, np.float64, (33,)) for j in mine.ranks]
        ck.array(fv.allreduce(xs[mine.ranks.index(r)], op=fv.Sum, process_set=mine, name=f"both.{i}"),
                 T.ref_reduce(xs, SUM, np.float64, 2), f"concurrent set op {i}")
    global_sync(ck, "end")
    return ck.count


def case_dynamic(via_env):
    if via_env:
        fv.init()
    else:
        fv.init(process_sets="dynamic")
    r, n = fv.rank(), fv.size()
    assert n == 4, "run with 4 ranks"
    ck = T.Checker(r)
    cases = Case()
    p = fv.add_process_set([0, 1, 2])
    ck.true(p.process_set_id not in (None, 0), "add_process_set id", f"id {p.process_set_id}")
    q = fv.add_process_set(fv.ProcessSet([3, 1]))
    ck.equal(list(q.ranks), [1, 3], "added set ranks")
    ck.raises(ValueError, lambda: fv.add_process_set([0, 1, 2]), "adding a duplicate set")
    # Horovod's internal view of the registry (hvd.mpi_ops._basics), which its tests read,
    # and its str() of a set
    from ferrovod.common.basics import HorovodBasics

    ck.equal(HorovodBasics()._get_process_set_ids_and_ranks(),
             {0: [0, 1, 2, 3], p.process_set_id: [0, 1, 2], q.process_set_id: [1, 3]},
             "process set ids and ranks")
    ck.equal(str(q), f"ProcessSet(process_set_id={q.process_set_id}, ranks=[1, 3], mpi_comm=None)",
             "str() of a set")
    for ps, tag in ((p, "dyn p"), (q, "dyn q")):
        if r in ps.ranks:
            check_ops_on(ck, ps, cases, tag)
        else:
            check_foreign(ck, ps, tag)
    global_sync(ck, "after dynamic checks")
    ck.equal(fv.remove_process_set(p), True, "remove_process_set")
    ck.raises(ValueError, lambda: fv.allreduce(np.ones(2), process_set=p), "op on a removed set")
    ck.equal(HorovodBasics()._get_process_set_ids_and_ranks(),
             {0: [0, 1, 2, 3], q.process_set_id: [1, 3]}, "ids and ranks after a removal")
    ck.equal(fv.remove_process_set(p), False, "removing twice")
    ck.equal(fv.remove_process_set(fv.global_process_set), False, "removing the global set")
    s = fv.add_process_set([0, 3])
    if r in (0, 3):
        check_ops_on(ck, s, cases, "dyn s")
    else:
        check_foreign(ck, s, "dyn s")
    if r in q.ranks:
        check_ops_on(ck, q, cases, "dyn q again")
    global_sync(ck, "end")
    return ck.count


def main():
    mode = sys.argv[1]
    if mode == "static":
        return case_static()
    return case_dynamic(via_env=(mode == "dynamic_env"))


if __name__ == "__main__":
    T.run_main(main)
