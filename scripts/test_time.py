"""Where the test suite's time goes, from the log of a run made with
``FERROVOD_TEST_CPU_LOG=<file>`` (tests/python/conftest.py writes a line per test):

    FERROVOD_TEST_CPU_LOG=$PWD/cpu.log make test
    python scripts/test_time.py cpu.log [--top 25]

Prints, per pytest-xdist worker, when it started and ended its last test and how long it ran
tests (the gap at the end is the other worker's tail, when one core has nothing to run); per
test module, the CPU (of pytest and every process it waited for) and the wall time of its
tests; and the tests that took the most CPU. On the suite's 2-core machine its CPU is what
bounds the run: a test that waits costs the other worker nothing, one that computes does.
The CPU of daemons that outlive a test (a Ray or Spark cluster, sshd in the network-namespace
hosts) is counted where they are reaped, or not at all.
"""

import argparse
import collections
import sys
from typing import Callable, Dict, List, NamedTuple


class Test(NamedTuple):
    cpu: float
    wall: float
    start: float
    worker: str
    node: str


def read(path: str) -> List[Test]:
    """The log's tests; lines of the older format (no start or worker) are refused."""
    tests = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            parts = line.rstrip("\n").split(" ", 4)
            if len(parts) < 5:
                sys.exit(f"{path}:{n}: not '<cpu> <wall> <start> <worker> <node id>': {line!r}")
            tests.append(Test(float(parts[0]), float(parts[1]), float(parts[2]), parts[3],
                              parts[4]))
    return tests


def grouped(tests: List[Test], key: Callable[[Test], str]) -> Dict[str, List[Test]]:
    """``tests`` by ``key``, each group in the log's order."""
    groups: Dict[str, List[Test]] = collections.defaultdict(list)
    for t in tests:
        groups[key(t)].append(t)
    return groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("log", help="the file FERROVOD_TEST_CPU_LOG named")
    ap.add_argument("--top", type=int, default=25, help="how many of the costliest tests")
    args = ap.parse_args()
    tests = read(args.log)
    if not tests:
        sys.exit(f"{args.log}: no tests")
    t0 = min(t.start for t in tests)
    end = max(t.start + t.wall for t in tests)

    print(f"{len(tests)} tests, {end - t0:.0f} s from the first test's start to the last's end, "
          f"{sum(t.cpu for t in tests):.0f} CPU s\n")
    print(f"{'worker':<8} {'first start s':>13} {'last end s':>10} {'in tests s':>10} "
          f"{'idle at end s':>13}")
    for w, ts in sorted(grouped(tests, lambda t: t.worker).items()):
        last = max(t.start + t.wall for t in ts)
        print(f"{w:<8} {min(t.start for t in ts) - t0:>13.0f} {last - t0:>10.0f} "
              f"{sum(t.wall for t in ts):>10.0f} {end - last:>13.0f}")

    print(f"\n{'CPU s':>7} {'wall s':>7} {'tests':>5}  module")
    modules = grouped(tests, lambda t: t.node.split("::")[0])
    for m, ts in sorted(modules.items(), key=lambda kv: -sum(t.cpu for t in kv[1])):
        print(f"{sum(t.cpu for t in ts):>7.1f} {sum(t.wall for t in ts):>7.1f} {len(ts):>5}  {m}")

    print(f"\n{'CPU s':>7} {'wall s':>7}  test (the {args.top} that took the most CPU)")
    for t in sorted(tests, key=lambda t: -t.cpu)[:args.top]:
        print(f"{t.cpu:>7.1f} {t.wall:>7.1f}  {t.node}")


if __name__ == "__main__":
    main()
