"""The driver of test_ray_hosts.py, run on the first simulated host against a two-node Ray
cluster: ``ray_hosts_driver.py ADDRESS MODE [ARGS]``, printing one JSON line.

MODE ``place``: four ranks on the two nodes (``num_hosts=2``), their topology and collectives.
MODE ``lose MARK_DIR``: four ranks allreduce until the test kills the second node; prints the
error the executor raised and how long after the ranks had started it came.
MODE ``elastic MARK_DIR``: an elastic job (``ElasticRayExecutor``, 2 to 4 ranks) trains
until ``MARK_DIR/stop`` exists, while the test kills the second node and starts it again;
prints every rank's result.
"""

import json
import sys
import time

import ray

import func_tasks as T

from ferrovod.ray import ElasticRayExecutor, RayExecutor


def elastic(mark_dir):
    # A node lost is blacklisted for 5 s; by then Ray has marked it dead (the test's fast
    # health checks), and a node started again at its address may join.
    s = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=4, elastic_timeout=120,
                                           timeout_s=60, cooldown_range=(5, 5), verbose=1)
    ex = ElasticRayExecutor(s, cpus_per_slot=1)
    ex.start()
    results = ex.run(T.elastic_count, kwargs={
        "steps": 10 ** 6, "mark_dir": mark_dir, "pause_s": 0.05,
        "until_file": f"{mark_dir}/stop"})
    print(json.dumps({"results": results}), flush=True)


def main() -> None:
    address, mode = sys.argv[1], sys.argv[2]
    ray.init(address=address, log_to_driver=False)
    if mode == "elastic":
        elastic(sys.argv[3])
        return
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=60, placement_group_timeout_s=60),
                     num_hosts=2, num_workers_per_host=2)
    ex.start()
    if mode == "place":
        tops = ex.run(T.topology)
        results = ex.run(T.collectives)
        ok = all(r[1] == 4 for r in results)
        print(json.dumps({"tops": tops, "ok": ok, "sums": [
            out["sum", "float64", (7,)].tolist() for _, _, out in results]}), flush=True)
    else:
        t0 = time.monotonic()
        try:
            ex.run(T.allreduce_until, args=[120, sys.argv[3]])
            print(json.dumps({"error": None}), flush=True)
        except RuntimeError as exc:
            print(json.dumps({"error": str(exc), "after_s": time.monotonic() - t0}), flush=True)
    ex.shutdown()


if __name__ == "__main__":
    main()
