"""Allreduce bus bandwidth across two simulated hosts joined by a link shaped to a given rate.

Run as root from the repository root (it builds network namespaces)::

    .venv/bin/python benchmarks/multihost_link.py --rate 1gbit --ranks-per-host 1,2 --compare torch
    .venv/bin/python benchmarks/multihost_link.py --rate 10gbit --compare mpi4py --sizes 1M,64M

What it does:

1. Builds two hosts, ``h1`` and ``h2``, with ``tests/python/netns.py`` (network namespaces with
   sshd, joined by veth links into a bridge) and limits what each host sends on ``eth0`` with
   ``tc ... tbf`` (see :func:`tbf_params`), so every direction between them runs at ``--rate``.
2. Checks that the limit took effect: a bulk TCP transfer with plain Python sockets, each
   direction alone and then both at once (as allreduce uses the link; the better of two tries),
   printed as the measured raw link rate beside TCP's ceiling at the link's MTU.
3. For each ranks-per-host ``k`` starts ``benchmarks/collectives.py --ops allreduce`` with
   ``ferrovodrun -H h1:k,h2:k`` from ``h1`` (optionally ``--compare torch``: gloo in the same
   job) and prints one table: size, ranks, ferrovod's bus bandwidth, the peer's, and each one's
   as a percentage of the configured rate (ferrovod's of the measured raw TCP rate too). With
   ``--compare mpi4py`` the job is Open MPI's instead: ``mpirun -H h1:k,h2:k`` with the flags
   its users give it on such hosts (``Cluster.mpirun_args()``: its TCP on ``eth0``, ranks that
   yield when idle), and collectives.py times mpi4py's in-place ``Allreduce`` beside ferrovod's
   in the same job, which finds its peers over MPI. ``--env K=V``
   (repeatable) reaches every worker, e.g. to compare ``FERROVOD_HIERARCHICAL_ALLREDUCE=0``/``1``.

Bus bandwidth follows nccl-tests (see ``benchmarks/collectives.py``): for a ring allreduce each
rank sends 2(n-1)/n of the buffer over its outgoing link, so a busbw equal to the link's rate
means the link was kept full. It is recomputed here from the per-call time that collectives.py
prints (more digits than its GB/s column). The link rate counts whole Ethernet frames (tbf
charges ``skb->len``); TCP payload is at most 1448 of each 1514-byte frame, so ~95.6 % of the
configured rate is the ceiling for anything over TCP at MTU 1500 (printed as "TCP's ceiling").

The namespaces and everything running in them are removed at the end, also on error or Ctrl-C.
Exit status: 0 done, 1 a job failed, 2 cannot run here (not root, a tool missing), 130 Ctrl-C.
This is a benchmark, not a test: it prints numbers.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "python"))

from netns import Cluster, missing_tools  # noqa: E402

PY = sys.executable
COLLECTIVES = str(REPO / "benchmarks" / "collectives.py")
HOSTS = ("h1", "h2")
PROBE_PORT = 5201
DEFAULT_PROBE_SECONDS = 3.0
# The first part of a bulk transfer runs on the token bucket's burst and TCP's ramp-up; the
# rate is measured after it.
PROBE_SKIP_SECONDS = 0.5


# -- rates and sizes -------------------------------------------------------------------------


_RATE_UNITS = {
    "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
    "kibit": 1 << 10, "mibit": 1 << 20, "gibit": 1 << 30,
    # tc's "bps" means bytes per second.
    "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9,
}  # fmt: skip


def parse_rate(text: str) -> int:
    """A rate in tc's syntax ('1gbit', '500mbit', '100mbps' = bytes/s) → bits per second."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match:
        raise ValueError(f"rate {text!r}: expected a number and a unit such as 1gbit")
    unit = match.group(2).lower() or "bit"
    if unit not in _RATE_UNITS:
        raise ValueError(f"rate {text!r}: unknown unit {unit!r} (use bit, kbit, mbit, gbit)")
    bits = int(float(match.group(1)) * _RATE_UNITS[unit])
    if bits < 1000:
        raise ValueError(f"rate {text!r} is below 1 kbit/s")
    return bits


def parse_size(text: str) -> int:
    """'4', '64K', '16M', '1G' (powers of 1024) → bytes (as collectives.py reads them)."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def size_bytes(number: str, unit: str) -> int:
    """A size as collectives.py prints it ('64', 'MiB') → bytes."""
    return int(number) << {"B": 0, "KiB": 10, "MiB": 20, "GiB": 30}[unit]


def mbit(bits_per_second: float) -> str:
    """Bits per second as Mbit/s text."""
    return f"{bits_per_second / 1e6:.1f} Mbit/s"


def tbf_params(rate_bits: int) -> Tuple[str, str]:
    """tbf's burst (bytes) and latency for a link of ``rate_bits``, in tc's syntax.

    burst — 2 ms worth of the rate (250 kB at 1 Gbit/s), at least 64 KiB + headers:
      * tbf releases packets from an hrtimer; when the timer fires late (a busy 2-core VM can
        delay it by up to ~1 ms) the tokens of the missed time must still fit in the bucket,
        or that time's share of the rate is lost for good. 2 ms covers such delays.
      * veth passes GSO packets of up to 64 KiB; a bucket smaller than one such packet makes
        tbf cut every packet into segments in software (more CPU, in the shaper).
      * it stays small beside the transfers this benchmark is about: a 64 MiB allreduce moves
        ~67 MB each way (~0.54 s at 1 Gbit/s), of which one 250 kB burst is 0.4 %. Messages
        below ~256 KiB do go out at veth speed on a full bucket, so their rows can exceed the
        rate: read them as latency figures, not as link figures.
    latency — 10 ms of queue (1.25 MB at 1 Gbit/s, plus the burst): a switch-like buffer. A TCP
      flow at this rate queues at most about one pacing interval per socket (TCP small queues,
      ~1 ms), so nothing is dropped in normal operation, while a flow that overruns it still
      meets loss as on a real link rather than an unbounded queue.
    """
    burst = max(rate_bits // 8 * 2 // 1000, 64 * 1024 + 2048)
    return f"{burst}b", "10ms"


def tcp_ceiling(mtu: int) -> float:
    """Fraction of a tbf rate that TCP payload can use: tbf charges each frame with its
    14-byte Ethernet header; IPv4 (20), TCP (20) and the timestamp option (12) ride inside."""
    return (mtu - 52) / (mtu + 14)


# -- raw TCP rate ----------------------------------------------------------------------------


# Runs in a host's namespace: "recv PORT SKIP" prints the receive rate after the first SKIP
# seconds; "send HOST PORT SECONDS" sends for that long. Plain sockets, kernel-tuned buffers,
# as ferrovod's TCP transport uses them.
PROBE = r"""
import socket, sys, time
if sys.argv[1] == "recv":
    port, skip = int(sys.argv[2]), float(sys.argv[3])
    srv = socket.create_server(("0.0.0.0", port))
    print("READY", flush=True)
    conn, _ = srv.accept()
    view = memoryview(bytearray(1 << 20))
    total, t0, mark = 0, None, None
    while True:
        n = conn.recv_into(view)
        now = time.perf_counter()
        if not n:
            break
        if t0 is None:
            t0 = now
        total += n
        if mark is None and now - t0 >= skip:
            mark = (now, total)
        last = (now, total)
    if mark is None or last[0] <= mark[0]:
        sys.exit("transfer too short to measure")
    print("RATE", (last[1] - mark[1]) * 8 / (last[0] - mark[0]), total, flush=True)
else:
    host, port, seconds = sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    deadline = time.monotonic() + 10
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=2)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    block = bytes(1 << 20)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sock.sendall(block)
    sock.close()
"""


def measure_tcp(cluster: Cluster, pairs: Sequence[Tuple[str, str]], seconds: float,
                port: int = PROBE_PORT) -> Dict[Tuple[str, str], float]:
    """Bulk TCP transfers for each (sender, receiver) of ``pairs``, all at the same time;
    returns each pair's receive rate in bits per second."""
    receivers: Dict[Tuple[str, str], subprocess.Popen] = {}
    senders: List[subprocess.Popen] = []
    try:
        for i, (src, dst) in enumerate(pairs):
            proc = cluster.popen(dst, [PY, "-c", PROBE, "recv", str(port + i),
                                       str(PROBE_SKIP_SECONDS)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            receivers[(src, dst)] = proc
            ready = proc.stdout.readline() if proc.stdout else ""
            if not ready.startswith("READY"):
                raise RuntimeError(f"TCP probe receiver on {dst} did not start: "
                                   f"{proc.stderr.read() if proc.stderr else ''}")
        for i, (src, dst) in enumerate(pairs):
            senders.append(cluster.popen(src, [PY, "-c", PROBE, "send", dst, str(port + i),
                                               str(seconds)],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                         text=True))
        rates = {}
        for (src, dst), proc in receivers.items():
            out, err = proc.communicate(timeout=seconds + 30)
            words = out.split()
            if proc.returncode != 0 or "RATE" not in words:
                raise RuntimeError(f"TCP probe {src}->{dst} failed: {err.strip()}")
            rates[(src, dst)] = float(words[words.index("RATE") + 1])
        for proc in senders:
            proc.wait(timeout=30)
        return rates
    finally:
        for proc in [*receivers.values(), *senders]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# -- the benchmark jobs ----------------------------------------------------------------------


@dataclass
class Row:
    """One size of one job: per-call seconds of each stack (None: wrong result)."""

    nbytes: int
    ranks: int
    per_host: int
    fv_seconds: Optional[float]
    # The peer's (--compare): gloo's or mpi4py's.
    peer_seconds: Optional[float] = None

    def busbw(self, seconds: Optional[float]) -> Optional[float]:
        """Bus bandwidth in bytes per second of a ring allreduce taking ``seconds``."""
        if seconds is None:
            return None
        return self.nbytes / seconds * 2 * (self.ranks - 1) / self.ranks


@dataclass
class JobResult:
    """What one ferrovodrun job printed and how it ended."""

    per_host: int
    returncode: int
    rows: List[Row] = field(default_factory=list)
    output: List[str] = field(default_factory=list)
    seconds: float = 0.0


# collectives.py's table row from rank 0 (ferrovodrun tags it "[0]<stdout>:", Open MPI's
# --tag-output "[1,0]<stdout>:"): op, size (number and unit), iters, fv µs, fv busbw, then per
# peer µs and busbw, then the ratios. "WRONG" replaces the µs of a wrong result.
RANK0 = re.compile(r"^\[(?:\d+,)?0\]<stdout>:")
ROW = re.compile(RANK0.pattern + r"\s*allreduce\s+(\d+) (B|KiB|MiB|GiB)\s+\d+\s+(.*)$")


def parse_row(line: str, ranks: int, per_host: int, compare: bool) -> Optional[Row]:
    """A Row from one line of the job's output, or None when it is not a table row."""
    match = ROW.match(line.strip())
    if not match:
        return None
    cells = match.group(3).split()

    def seconds(cell: str) -> Optional[float]:
        return None if cell == "WRONG" else float(cell) * 1e-6

    row = Row(size_bytes(match.group(1), match.group(2)), ranks, per_host, seconds(cells[0]))
    if compare and len(cells) >= 3:
        row.peer_seconds = seconds(cells[2])
    return row


def clean_env() -> Dict[str, str]:
    """This process's environment without any launch variables (as the multi-host tests do):
    a FERROVOD_* or MPI variable set in the caller's shell must not confuse the launch."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("FERROVOD_", "HOROVOD_", "OMPI_", "PMI", "SLURM_"))
            and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}


def run_job(cluster: Cluster, per_host: int, args: argparse.Namespace) -> JobResult:
    """One job of collectives.py across both hosts, started on h1: by ferrovodrun, or by
    Open MPI's mpirun for ``--compare mpi4py``."""
    ranks = per_host * len(HOSTS)
    xflags: List[str] = []
    # gloo takes its address from this interface on every host, as ferrovod does from
    # --network-interfaces; ranks of one host still reach each other over loopback.
    for kv in ["GLOO_SOCKET_IFNAME=eth0", *args.env]:
        xflags += ["-x", kv]
    bench = [PY, COLLECTIVES, "--ops", "allreduce", "--master-addr", HOSTS[0]]
    bench += ["--sizes", args.sizes] if args.sizes else ["--max-size", args.max_size]
    if args.iters:
        bench += ["--iters", str(args.iters)]
    if args.compare:
        bench += ["--compare", args.compare]
    hosts = ",".join(f"{h}:{per_host}" for h in HOSTS)
    if args.compare == "mpi4py":
        # ferrovod's address on every host from the interface Open MPI is told to use, as
        # ferrovodrun's --network-interfaces gives it.
        xflags += ["-x", "FERROVOD_IFACE=eth0", "-x", "PATH"]
        root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        argv = ["mpirun", "-np", str(ranks), "-H", hosts, *root, "--bind-to", "none",
                "--tag-output", *cluster.mpirun_args(), *xflags, *bench]  # fmt: skip
    else:
        argv = [PY, "-m", "ferrovod.runner.launch", "-np", str(ranks), "-H", hosts,
                "-p", "2222", "-i", str(cluster.key), "--network-interfaces", "eth0",
                *xflags, *bench]  # fmt: skip
    result = JobResult(per_host, -1)
    start = time.monotonic()
    proc = cluster.popen(HOSTS[0], argv, env=clean_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, cwd=str(REPO))
    # The job's wall-clock limit, enforced from a timer so that a hung job cannot hold the
    # benchmark (and the namespaces) forever.
    timer = threading.Timer(args.job_timeout, proc.kill)
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            result.output.append(line)
            row = parse_row(line, ranks, per_host, bool(args.compare))
            if row is not None:
                result.rows.append(row)
            if RANK0.match(line) and (row is not None or "#" in line or "---" in line
                                      or " op " in line):
                print(f"  [{per_host}/host] {line.split(':', 1)[1]}", flush=True)
        result.returncode = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    result.seconds = time.monotonic() - start
    return result


def qdisc_counters(cluster: Cluster) -> Dict[str, str]:
    """Each host's tbf counters (sent, dropped, overlimits) as tc prints them."""
    counters = {}
    for name, host in cluster.hosts.items():
        res = subprocess.run(["ip", "netns", "exec", host.ns, "tc", "-s", "qdisc", "show",
                              "dev", "eth0"], capture_output=True, text=True, timeout=10)
        match = re.search(r"Sent .*?\)", res.stdout)
        counters[name] = match.group(0) if match else res.stdout.strip()
    return counters


# -- report ----------------------------------------------------------------------------------


def fmt_size(nbytes: int) -> str:
    """Bytes as 4 B, 64 KiB, 16 MiB."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def print_table(rows: Sequence[Row], rate_bits: float, tcp_bits: float, peer: str) -> None:
    """The combined table: busbw in MB/s (10^6 bytes) and ferrovod's as % of both rates, with
    the peer's (``peer``: its name, or empty for none) and its ratio to ferrovod's."""
    headers = ["size", "ranks", "fv busbw MB/s"]
    if peer:
        headers += [f"{peer} busbw MB/s"]
    headers += ["fv % of rate", "fv % of TCP"]
    if peer:
        headers += [f"{peer} % of rate", f"fv / {peer}"]
    body = []
    for row in rows:
        fv, other = row.busbw(row.fv_seconds), row.busbw(row.peer_seconds)
        cells = [fmt_size(row.nbytes), f"{row.ranks} ({row.per_host}/host)",
                 "WRONG" if fv is None else f"{fv / 1e6:.1f}"]
        if peer:
            cells.append("WRONG" if other is None else f"{other / 1e6:.1f}")
        cells += ["-" if fv is None else f"{fv * 8 / rate_bits * 100:.1f}",
                  "-" if fv is None else f"{fv * 8 / tcp_bits * 100:.1f}"]
        if peer:
            cells.append("-" if other is None else f"{other * 8 / rate_bits * 100:.1f}")
            cells.append("-" if fv is None or not other else f"{fv / other:.2f}")
        body.append(cells)
    widths = [max(len(c) for c in column) for column in zip(headers, *body)]

    def line(cells: List[str]) -> str:
        return "  ".join(c.rjust(w) for c, w in zip(cells, widths))

    print(line(headers))
    print(line(["-" * w for w in widths]))
    for cells in body:
        print(line(cells))


# -- main ------------------------------------------------------------------------------------


def start_hosts(workdir: Path, who: str) -> Optional[Cluster]:
    """``HOSTS`` built in ``workdir``, or None when they cannot be (why printed, as ``who``;
    what was made of them removed)."""
    cluster = Cluster(list(HOSTS), workdir)
    try:
        cluster.__enter__()
    except (RuntimeError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        print(f"{who}: cannot build the hosts: {detail}", file=sys.stderr)
        cluster.close()
        return None
    return cluster


def _terminate(signum: int, frame: Optional[FrameType]) -> None:
    # SIGTERM (e.g. from a CI timeout) takes the same clean-up path as Ctrl-C.
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="1gbit", help="link rate in tc's syntax (1gbit)")
    parser.add_argument("--ranks-per-host", default="1,2",
                        help="comma-separated ranks per host, one job each (default: 1,2)")
    parser.add_argument("--max-size", default="64M", help="largest message (default: 64M)")
    parser.add_argument("--sizes", default=None,
                        help="comma-separated sizes instead of powers of 4 up to --max-size")
    parser.add_argument("--iters", type=int, default=0,
                        help="timed calls for small sizes (collectives.py's default if unset)")
    parser.add_argument("--compare", default="",
                        help="'torch': time gloo in the same ferrovodrun jobs; 'mpi4py': run "
                             "the jobs with Open MPI's mpirun and time its Allreduce beside")
    parser.add_argument("--env", action="append", default=[], metavar="K=V",
                        help="variable for every worker (repeatable), e.g. "
                             "FERROVOD_HIERARCHICAL_ALLREDUCE=1")
    parser.add_argument("--burst", default=None, help="tbf burst (default: see tbf_params)")
    parser.add_argument("--latency", default=None, help="tbf latency (default: 10ms)")
    parser.add_argument("--probe-seconds", type=float, default=DEFAULT_PROBE_SECONDS,
                        help="length of each raw TCP transfer (default: 3)")
    parser.add_argument("--job-timeout", type=float, default=1800,
                        help="seconds one ferrovodrun job may take (default: 1800)")
    args = parser.parse_args()

    try:
        rate_bits = parse_rate(args.rate)
        per_host_list = [int(k) for k in args.ranks_per_host.split(",") if k.strip()]
        parse_size(args.max_size)
    except ValueError as exc:
        parser.error(str(exc))
    if not per_host_list or min(per_host_list) < 1:
        parser.error("--ranks-per-host: positive integers, e.g. 1,2")
    for kv in args.env:
        if "=" not in kv or not kv.split("=", 1)[0]:
            parser.error(f"--env {kv!r}: expected NAME=VALUE")
    if args.compare not in ("", "torch", "mpi4py"):
        parser.error("--compare: 'torch' or 'mpi4py' across hosts")
    if args.compare == "mpi4py" and shutil.which("mpirun") is None:
        print("multihost_link: --compare mpi4py needs Open MPI's mpirun", file=sys.stderr)
        return 2
    if args.probe_seconds <= PROBE_SKIP_SECONDS:
        parser.error(f"--probe-seconds must exceed {PROBE_SKIP_SECONDS}")

    why = missing_tools() or (None if shutil.which("tc") else "needs tc (iproute2)")
    if why:
        print(f"multihost_link: cannot run here: {why}", file=sys.stderr)
        return 2

    burst, latency = tbf_params(rate_bits)
    burst, latency = args.burst or burst, args.latency or latency
    # A shell that starts this in the background ignores SIGINT for it; Ctrl-C (or kill -INT)
    # must still reach the clean-up below.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _terminate)
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="fv-link-"))
    cluster: Optional[Cluster] = None
    try:
        cluster = start_hosts(workdir, "multihost_link")
        if cluster is None:
            return 1
        print(f"# hosts {', '.join(f'{h.name} {h.ip}' for h in cluster.hosts.values())}; "
              f"tbf rate {rate_bits}bit burst {burst} latency {latency} on each host's eth0")
        try:
            shown = cluster.shape(f"{rate_bits}bit", burst, latency)
        except RuntimeError as exc:
            print(f"multihost_link: cannot shape the link: {exc}", file=sys.stderr)
            return 2
        for name, text in shown.items():
            print(f"#   {name}: {text}")
        cc = cluster.run(HOSTS[0], ["cat", "/proc/sys/net/ipv4/tcp_congestion_control"],
                         timeout=10).stdout.strip()
        print(f"# TCP congestion control in the hosts: {cc}")

        h1, h2 = HOSTS
        one = measure_tcp(cluster, [(h1, h2)], args.probe_seconds)
        other = measure_tcp(cluster, [(h2, h1)], args.probe_seconds)
        # Allreduce keeps both directions busy at once, so that is the rate it can hope for.
        # Other work on the machine can only slow a probe down: the better of two is the
        # link's rate.
        both = max((measure_tcp(cluster, [(h1, h2), (h2, h1)], args.probe_seconds)
                    for _ in range(2)), key=lambda rates: min(rates.values()))
        tcp_bits = min(both.values())
        mtu = int(cluster.run(h1, ["cat", "/sys/class/net/eth0/mtu"], timeout=10).stdout)
        print(f"# raw TCP (Python sockets, {args.probe_seconds:g} s each, after "
              f"{PROBE_SKIP_SECONDS:g} s): {h1}->{h2} {mbit(one[(h1, h2)])}, "
              f"{h2}->{h1} {mbit(other[(h2, h1)])}; both at once "
              f"{mbit(both[(h1, h2)])} / {mbit(both[(h2, h1)])}")
        print(f"# measured raw link rate (both directions busy, slower one): {mbit(tcp_bits)}"
              f" = {tcp_bits / rate_bits * 100:.1f} % of the configured {mbit(rate_bits)}; "
              f"TCP's ceiling at MTU {mtu}: {tcp_ceiling(mtu) * 100:.1f} %")
        if tcp_bits < 0.5 * rate_bits or tcp_bits > 1.05 * rate_bits:
            print("# WARNING: the raw TCP rate is far from the configured rate: the shaping "
                  "did not take effect as intended (or the machine is too busy)")
        print(f"# setup and TCP probes took {time.monotonic() - started:.1f} s", flush=True)

        rows: List[Row] = []
        failed = 0
        for per_host in per_host_list:
            launcher = "mpirun" if args.compare == "mpi4py" else "ferrovodrun"
            print(f"# job: {launcher} -H {h1}:{per_host},{h2}:{per_host} collectives.py "
                  f"--ops allreduce{' --compare ' + args.compare if args.compare else ''}"
                  + "".join(f" [env {kv}]" for kv in args.env), flush=True)
            before = qdisc_counters(cluster)
            job = run_job(cluster, per_host, args)
            after = qdisc_counters(cluster)
            rows += job.rows
            if job.returncode in (130, -signal.SIGINT):
                # The launcher saw the Ctrl-C first (same process group): stop here too.
                raise KeyboardInterrupt
            print(f"# job with {per_host}/host took {job.seconds:.1f} s, exit {job.returncode}")
            for name in HOSTS:
                print(f"#   tbf {name}: before {before[name]}; after {after[name]}")
            if job.returncode != 0:
                failed += 1
                print(f"multihost_link: the job with {per_host} rank(s) per host failed "
                      f"(exit {job.returncode}); its last output:", file=sys.stderr)
                for line in job.output[-40:]:
                    print(f"  {line}", file=sys.stderr)

        print()
        print(f"# allreduce float32 across 2 hosts, link {mbit(rate_bits)} "
              f"({rate_bits / 8e6:.1f} MB/s) per direction, measured raw TCP {mbit(tcp_bits)}"
              + "".join(f", {kv}" for kv in args.env))
        print_table(rows, rate_bits, tcp_bits, {"torch": "gloo"}.get(args.compare, args.compare))
        largest = max((r.nbytes for r in rows), default=0)
        for row in rows:
            bw = row.busbw(row.fv_seconds)
            if row.nbytes == largest and bw is not None:
                pct = bw * 8 / rate_bits * 100
                print(f"# {fmt_size(row.nbytes)}, {row.per_host}/host: ferrovod at {pct:.1f} % "
                      f"of the configured rate ({'meets' if pct >= 90 else 'misses'} 90 %), "
                      f"{bw * 8 / tcp_bits * 100:.1f} % of raw TCP")
        print(f"# total time {time.monotonic() - started:.1f} s")
        return 1 if failed else 0
    except KeyboardInterrupt:
        print("\nmultihost_link: interrupted; removing the hosts", file=sys.stderr)
        return 130
    finally:
        # Ctrl-C during clean-up must not leave namespaces behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if cluster is not None:
            cluster.close()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
