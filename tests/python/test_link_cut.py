"""Two hosts as Linux network namespaces joined by a veth link; the link is cut in the middle
of an allreduce loop. Both ranks must get an error within the configured timeout, not hang.
Needs network namespaces (root with CAP_SYS_ADMIN and CAP_NET_ADMIN): tried once
(capabilities.py), skipped with the reason otherwise."""

import os
import subprocess
import sys
import time
import uuid

import pytest

from capabilities import netns_missing
from conftest import WORKERS

pytestmark = pytest.mark.usefixtures("ferrovod_importable")

needs_netns = pytest.mark.skipif(netns_missing() is not None, reason=str(netns_missing()))


def sh(*args):
    subprocess.run(args, check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_hosts():
    """Namespaces A (10.213.7.1) and B (10.213.7.2) on one veth link; yields their names."""
    tag = uuid.uuid4().hex[:6]
    a, b = f"fva{tag}", f"fvb{tag}"
    va, vb = f"va{tag}", f"vb{tag}"
    sh("ip", "netns", "add", a)
    sh("ip", "netns", "add", b)
    try:
        sh("ip", "link", "add", va, "netns", a, "type", "veth", "peer", "name", vb, "netns", b)
        for ns, dev, ip in ((a, va, "10.213.7.1/24"), (b, vb, "10.213.7.2/24")):
            sh("ip", "-n", ns, "addr", "add", ip, "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield a, b, va
    finally:
        for ns in (a, b):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in pids.stdout.split():
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@needs_netns
def test_cut_link_is_an_error_on_both_ranks(two_hosts):
    a, b, dev_a = two_hosts
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FERROVOD_", "HOROVOD_", "RANK", "WORLD_SIZE", "MASTER_"))}
    env.update(WORLD_SIZE="2", MASTER_ADDR="10.213.7.1", MASTER_PORT="29531",
               FERROVOD_TIMEOUT_SECONDS="3", FERROVOD_START_TIMEOUT="30", PYTHONUNBUFFERED="1")
    procs = []
    for rank, ns in enumerate((a, b)):
        e = dict(env, RANK=str(rank), FERROVOD_HOSTNAME=f"host{rank}")
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, str(WORKERS / "foreign_launcher_worker.py"),
             "cut"], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        for p in procs:
            line = p.stdout.readline()
            assert line.startswith("READY"), line + p.stderr.read()
        cut = time.time()
        sh("ip", "-n", a, "link", "set", dev_a, "down")
        for rank, p in enumerate(procs):
            out, err = p.communicate(timeout=30)
            assert p.returncode == 0, out + err
            assert out.startswith("ERR "), out + err
            seconds = float(out.split()[2]) - cut
            # timeout 3 s, plus the wait for the coordinator's verdict
            assert seconds < 8, f"rank {rank} took {seconds:.1f} s: {out}"
            print(f"rank {rank} after {seconds:.1f} s: {out.strip()}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
