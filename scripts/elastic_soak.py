"""Elastic at scale, never a hang: an elastic job on network-namespace hosts (default 4 hosts
of 8 slots, 32 ranks) under a series of random SIGKILLs of workers and removals and additions
of hosts, with ``scripts/elastic_soak_worker.py`` checking at the end that no committed step
was lost or repeated, that every rank holds the same weights and that they equal a
one-process replay.

The launcher runs on a host of its own (h0, the MPIJob shape) and reaches the others over
ssh; the discovery script reads a hosts file this driver edits. Each event waits until the job
has committed a step since the last one (else the job is reported as hung, and the run fails):

* ``kill``: a random worker on a random listed host is SIGKILLed; the launcher blacklists the
  host, which comes back after its cooldown (``--blacklist-cooldown-range``);
* ``add``: a host not listed is added (the job starts with one host unlisted);
* ``remove`` (with ``--removals``): a listed host is taken out of the hosts file (its workers
  leave at a commit), keeping a host of the current membership listed. Removals and kills
  together can leave no worker that holds the committed state to lead the next membership;
  the job then ends saying so (by design: new workers alone would start training over).

At least ``--min-hosts`` hosts stay listed. Prints each event, the time from it to the next
commit, and a summary; the exit status is non-zero on a hang, a failed job or a failed check.
Needs root, iproute2, openssh (``scripts/system_deps.sh``) and this checkout's ``.venv``::

    sudo .venv/bin/python scripts/elastic_soak.py                  # 50 events
    sudo .venv/bin/python scripts/elastic_soak.py --events 10 --hosts 2 --slots 4
"""

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "python"))

from netns import Cluster, missing_tools  # noqa: E402

WORKER = str(ROOT / "scripts" / "elastic_soak_worker.py")


def epochs(log_path: Path) -> int:
    """Memberships the launcher has published so far (its ``elastic: epoch`` lines)."""
    try:
        return log_path.read_text(errors="replace").count("elastic: epoch ")
    except OSError:
        return 0


def current_hosts(log_path: Path) -> list:
    """The hosts of the launcher's latest membership (its last ``elastic: epoch`` line)."""
    try:
        lines = [ln for ln in log_path.read_text(errors="replace").splitlines()
                 if "elastic: epoch " in ln]
    except OSError:
        return []
    if not lines:
        return []
    slots = lines[-1].split("worker(s): ", 1)[-1].split(", ")
    return sorted({slot.split("[", 1)[0] for slot in slots})


def progress(out: Path):
    """(time, steps, size) of the job's last commit, or None before the first."""
    try:
        last = (out / "progress").read_text().splitlines()[-1].split()
    except (OSError, IndexError):
        return None
    return float(last[0]), int(last[1]), int(last[2])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--events", type=int, default=50)
    p.add_argument("--min-hosts", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--hang-after", type=float, default=180.0,
                   help="seconds without a commit after which the job counts as hung")
    p.add_argument("--removals", action="store_true", help="also remove listed hosts")
    p.add_argument("--log", help="also write the job's output to this file")
    args = p.parse_args()
    why = missing_tools()
    if why:
        print(f"elastic_soak: {why}", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    names = [f"h{i}" for i in range(1, args.hosts + 1)]
    np_ = args.hosts * args.slots
    with tempfile.TemporaryDirectory() as tmp, Cluster(["h0"] + names, Path(tmp)) as cluster:
        out = Path(tmp) / "out"
        out.mkdir()
        hosts_file = Path(tmp) / "hosts"
        listed = names[:-1] if len(names) > args.min_hosts else list(names)

        def write_hosts():
            hosts_file.write_text("".join(f"{h}:{args.slots}\n" for h in listed))

        write_hosts()
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("FERROVOD_", "HOROVOD_", "OMPI_", "PMI"))}
        cmd = [sys.executable, "-m", "ferrovod.runner.launch",
               "-np", str(len(listed) * args.slots),
               "--min-np", str(args.min_hosts * args.slots), "--max-np", str(np_),
               "--host-discovery-script", f"cat {hosts_file}",
               "--blacklist-cooldown-range", "5", "20", "--elastic-timeout", "120",
               "-p", "2222", "-i", str(cluster.key),
               sys.executable, WORKER, str(out)]  # fmt: skip
        log = open(Path(tmp) / "job.log", "w")
        choice, t_sent = "", time.time()
        start = time.monotonic()
        job = cluster.popen("h0", cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
        waits, failed = [], None
        last_steps = -1
        log_path = Path(tmp) / "job.log"
        for e in range(args.events + 1):
            t_event = time.time()
            # After a kill, wait for the membership that follows it, then for a commit in it:
            # the time from the kill to training again.
            seen = epochs(log_path)
            need_epoch = e > 0 and choice == "kill"
            while True:
                got = progress(out)
                if need_epoch and epochs(log_path) > seen:
                    need_epoch, t_epoch = False, time.time()
                    t_event = t_epoch
                if got and not need_epoch and got[1] != last_steps and got[0] > t_event - 0.001:
                    break
                if job.poll() is not None:
                    failed = f"the job ended (exit {job.returncode}) before event {e}"
                    break
                if time.time() - t_event > args.hang_after:
                    failed = f"no commit for {args.hang_after:.0f} s after event {e - 1}"
                    break
                time.sleep(0.2)
            if failed:
                break
            if got[1] < last_steps:
                failed = f"committed steps went back from {last_steps} to {got[1]} after event {e}"
                break
            if e > 0:
                waits.append(got[0] - t_sent)
                print(f"  event {e}: next commit after {got[0] - t_sent:.1f} s "
                      f"(step {got[1]}, size {got[2]})", flush=True)
            last_steps = got[1]
            if e == args.events:
                break
            t_sent = time.time()
            unlisted = [h for h in names if h not in listed]
            choice = rng.choice(["kill"] * 4 + ["add"] + (["remove"] if args.removals else []))
            # A removal keeps a host of the current membership listed: removing every host
            # that holds the committed state ends the job (by design), not a soak's question.
            members = current_hosts(log_path)
            removable = [h for h in listed if [m for m in members if m in listed and m != h]]
            if choice == "remove" and (len(listed) <= args.min_hosts or not removable):
                choice = "add" if unlisted else "kill"
            if choice == "add" and not unlisted:
                choice = "kill"
            if choice == "kill":
                victims = [(h, line.split(":", 1)[0]) for h in listed
                           for line in cluster.processes(h, WORKER) if "ferrovod.runner" not in line]
                if not victims:
                    print(f"event {e + 1}: kill, but no worker is running; waiting", flush=True)
                    time.sleep(1)
                    continue
                host, pid = rng.choice(victims)
                print(f"event {e + 1}: SIGKILL worker {pid} on {host}", flush=True)
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            elif choice == "remove":
                host = rng.choice(removable)
                listed.remove(host)
                write_hosts()
                print(f"event {e + 1}: remove {host}", flush=True)
            else:
                host = rng.choice(unlisted)
                listed.append(host)
                write_hosts()
                print(f"event {e + 1}: add {host}", flush=True)
        (out / "stop").touch()
        try:
            job.wait(timeout=args.hang_after)
        except subprocess.TimeoutExpired:
            failed = failed or "the job did not end after the stop was asked"
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        log.close()
        elapsed = time.monotonic() - start
        text = (Path(tmp) / "job.log").read_text()
        if args.log:
            Path(args.log).write_text(text)
        result = None
        if (out / "result.json").exists():
            result = json.loads((out / "result.json").read_text())
        resets = text.count("RESET size")
        print(f"\n{len(waits)} events in {elapsed:.0f} s; job exit {job.returncode}; "
              f"resets seen by ranks: {resets}")
        if waits:
            print(f"time from an event to the next commit: median {statistics.median(waits):.1f} "
                  f"s, max {max(waits):.1f} s")
        print(f"result: {result}")
        if failed or job.returncode != 0 or not result or result["problems"]:
            print(f"FAILED: {failed or 'see the result'}\n--- job log (tail) ---\n{text[-5000:]}")
            return 1
        print("OK")
        return 0


if __name__ == "__main__":
    sys.exit(main())
