"""Authentication of every connection, tested from outside while a real 3-rank job runs.

Raw clients connect to the rendezvous store, to ranks' data listeners (while the mesh is
being built: after that the listeners are closed) and to the coordinator's control listener,
and try: garbage, a protocol message with no handshake, silence, the handshake with a wrong
secret, and a replay of a handshake recorded from a legitimate connection. Every one must be
dropped before the server reveals anything (at most its 36-byte greeting, then the rejection
byte 0x00), while the job keeps running and every rank's results stay correct.

The handshake (src/bootstrap/auth.rs) is re-implemented here in a few lines of Python; the
legitimate connections the replays are recorded from use the job's real secret, which the
worker hands to the test through a private file.
"""

import hashlib
import hmac
import json
import os
import signal
import socket
import struct
import subprocess
import threading
import time

from conftest import _env, _kill_marked, assert_ok, launcher_cmd, parse_rank_lines

MAGIC = b"FVA1"
LABEL = b"ferrovod-auth-v1"
GREETING = 36  # MAGIC + 32-byte nonce
ACCEPTED, REJECTED = 1, 0
# The coordinator drops a silent client after FERROVOD_TIMEOUT_SECONDS; the store after 10 s.
TIMEOUT_S = 6
STORE_AUTH_TIMEOUT_S = 10


# --------------------------------------------------------------------------- protocol helpers

def recv_exact(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def proof(secret, role, own, peer):
    return hmac.new(secret, LABEL + role + own + peer, hashlib.sha256).digest()


class Rejected(Exception):
    pass


def handshake(sock, secret):
    """Runs the initiator's side; returns every byte we sent. Raises Rejected on 0x00."""
    nonce = os.urandom(32)
    hello = MAGIC + nonce
    sock.sendall(hello)
    peer = recv_exact(sock, GREETING)
    assert peer[:4] == MAGIC, peer
    mine = proof(secret, b"I", nonce, peer[4:])
    sock.sendall(mine)
    status = recv_exact(sock, 1)[0]
    if status == REJECTED:
        raise Rejected()
    assert status == ACCEPTED, status
    theirs = recv_exact(sock, 32)
    assert hmac.compare_digest(theirs, proof(secret, b"R", peer[4:], nonce)), \
        "the server does not know the secret"
    return hello + mine


def frame(body):
    return struct.pack("<I", len(body)) + body


def wire_str(s):
    b = s.encode()
    return struct.pack("<I", len(b)) + b


def store_get_request(key, timeout_ms):
    return frame(b"\x02" + wire_str(key) + struct.pack("<Q", timeout_ms))


def read_frame(sock):
    (n,) = struct.unpack("<I", recv_exact(sock, 4))
    return recv_exact(sock, n)


def store_get(sock, key, timeout_ms=30000):
    sock.sendall(store_get_request(key, timeout_ms))
    reply = read_frame(sock)
    assert reply[0] == 0, f"store GET {key!r}: status {reply[0]}"
    (n,) = struct.unpack("<I", reply[1:5])
    return reply[5:5 + n]


def connect(addr, timeout=30.0):
    if addr.startswith("@"):  # the coordinator's abstract Unix socket, for ranks on its host
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        s.connect("\0" + addr[1:])
        return s
    host, port = addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def drain(sock, timeout):
    """Everything the server sends until it closes: (bytes, closed within timeout)."""
    sock.settimeout(timeout)
    got = b""
    try:
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                return got, True
            got += chunk
    except ConnectionResetError:
        return got, True
    except socket.timeout:
        return got, False


# A protocol message a client would send after the handshake, per target.
def unauthenticated_message(target):
    if target == "store":
        return store_get_request("g0/coordinator", 0)
    if target in ("coordinator", "local"):
        return frame(b"\x00" + struct.pack("<Q", 1))  # ToCoordinator::Hello { rank: 1 }
    return struct.pack("<4I", int.from_bytes(b"FVM1", "little"), 2, 0, 3)  # mesh hello 2 -> 0


def legit_session(addr, secret, target):
    """A legitimate connection: the handshake, then (for the store) a real request. Returns
    every byte the client sent, for replaying."""
    with connect(addr) as s:
        sent = handshake(s, secret)
        if target == "store":
            req = store_get_request("g0/coordinator", 0)
            s.sendall(req)
            assert read_frame(s)[0] == 0
            sent += req
    return sent


def attack(addr, kind, target, secret, recorded, wait_close, connected=None):
    """Runs one attack; returns (what the server sent, whether it closed, note). Sets the
    event ``connected`` once its connection is made (or refused)."""
    try:
        s = connect(addr)
    except ConnectionRefusedError:
        return b"", True, "refused"
    finally:
        if connected is not None:
            connected.set()
    try:
        if kind == "garbage":
            junk = os.urandom(200)
            if junk[:4] == MAGIC:
                junk = b"X" + junk
            s.sendall(junk)
        elif kind == "request":
            s.sendall(unauthenticated_message(target))
            s.shutdown(socket.SHUT_WR)
        elif kind == "silence":
            pass
        elif kind == "wrong-secret":
            try:
                handshake(s, b"not-the-job-secret")
            except Rejected:
                got, closed = drain(s, wait_close)
                return b"(greeting)" + bytes([REJECTED]) + got, closed, "rejected"
            except (ConnectionError, OSError) as e:
                return b"", True, f"dropped: {e}"
            return b"ACCEPTED", False, "accepted with a wrong secret"
        elif kind == "replay":
            s.sendall(recorded)
        else:
            raise ValueError(kind)
        got, closed = drain(s, wait_close)
        return got, closed, ""
    except (ConnectionError, OSError) as e:
        return b"", True, f"dropped: {e}"
    finally:
        s.close()


def check_dropped(result, what, kind=None, must_close=True):
    """The server said nothing but its greeting (and for a proof it checked, 0x00), and hung
    up. With ``kind`` set, it must also have been reached: it greeted us, and it rejected a
    wrong or replayed proof with 0x00 rather than, say, timing out."""
    got, closed, note = result
    assert note != "accepted with a wrong secret", what
    if got.startswith(b"(greeting)"):
        got = got[len(b"(greeting)"):]
        assert got == bytes([REJECTED]), f"{what}: {got!r}"
        got = MAGIC + bytes(32) + got  # stands for the greeting handshake() consumed
    # At most the server's greeting and the rejection byte: never its proof, never data.
    assert len(got) <= GREETING + 1, f"{what}: server sent {len(got)} bytes: {got[:80]!r}"
    if got:
        assert got[:4] == MAGIC, f"{what}: {got[:40]!r}"
    if len(got) == GREETING + 1:
        assert got[-1] == REJECTED, f"{what}: status byte {got[-1]}"
    if kind is not None:
        assert len(got) >= GREETING, f"{what}: never reached the handshake ({note or got!r})"
        if kind in ("wrong-secret", "replay"):
            assert len(got) == GREETING + 1, f"{what}: the proof was not rejected ({got!r})"
    if must_close:
        assert closed, f"{what}: connection still open"


KINDS = ("garbage", "request", "wrong-secret", "replay")


# --------------------------------------------------------------------------- the test

def wait_for(pred, timeout, what, proc=None):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        v = pred()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the job ended (exit {proc.returncode}) while waiting for {what}")
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def progress(d):
    try:
        return int((d / "progress").read_text())
    except (OSError, ValueError):
        return 0


def run_attacks(jobs):
    """Runs (name, fn) pairs concurrently; returns {name: result}."""
    results = {}

    def one(name, fn):
        try:
            results[name] = fn()
        except BaseException as e:  # reported by the caller
            results[name] = e

    threads = [threading.Thread(target=one, args=job, daemon=True) for job in jobs]
    for t in threads:
        t.start()
    return threads, results


def test_strangers_are_dropped_and_the_job_goes_on(ferrovod_importable, tmp_path):
    out_path = tmp_path / "job.out"
    env = _env({"FERROVOD_TIMEOUT_SECONDS": TIMEOUT_S})
    marker = "auth-" + os.urandom(6).hex()
    env["FERROVOD_TEST_JOB"] = marker
    with open(out_path, "w") as out:
        proc = subprocess.Popen(launcher_cmd(3, "auth_worker.py", tmp_path), stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _attack_the_job(proc, tmp_path)
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            _kill_marked(marker)
            proc.wait()
    res = subprocess.CompletedProcess(proc.args, proc.returncode, out_path.read_text(), "")
    res.elapsed = 0.0
    res.ranks = parse_rank_lines(res.stdout)
    counts = assert_ok(res, 3, min_checks=30)
    assert counts[0] >= 30


def _attack_the_job(proc, d):
    info = json.loads(wait_for(lambda: (d / "info.json").exists() and (d / "info.json").read_text(),
                               60, "the rendezvous address", proc))
    secret = bytes.fromhex(info["secret"])
    store = info["rendezvous"]

    # A legitimate client of the store: learns the listeners, and its handshake is recorded.
    with connect(store) as s:
        handshake(s, secret)
        data = [store_get(s, f"g0/peer/{r}").decode().split("\n")[0] for r in (0, 1)]
        published = store_get(s, "g0/coordinator").decode()
    # "host:port", then the name of the coordinator's abstract socket for ranks on its host.
    coordinator, local = published.split("\n", 1)
    assert local.startswith("ferrovod-control-"), published
    targets = {"store": store, "coordinator": coordinator, "local": "@" + local,
               "data0": data[0], "data1": data[1]}
    recorded = {name: legit_session(addr, secret, name.rstrip("01"))
                for name, addr in targets.items() if not name.startswith("data")}
    # Ranks 0 and 1 wait for the last rank, listeners open: recording a data-listener handshake
    # would wait too, so the replays there use the store's recording (the same protocol).
    recorded["data0"] = recorded["data1"] = recorded["store"]

    # Phase 1: rank 2 has not started; ranks 0 and 1 are in init(). Connections to the data
    # listeners wait in their backlog until the mesh is built, then get the handshake.
    jobs = []
    connected = []
    for name, addr in targets.items():
        for kind in KINDS:
            connected.append(threading.Event())
            jobs.append((f"{name}/{kind}/init", lambda a=addr, k=kind, n=name, c=connected[-1]:
                         attack(a, k, n.rstrip("01"), secret, recorded[n], wait_close=60,
                                connected=c)))
    silent = {name: connect(addr) for name, addr in targets.items()}
    threads, results = run_attacks(jobs)
    # Every attack is connected (a data listener's waits in its backlog) before the mesh forms.
    wait_for(lambda: all(c.is_set() for c in connected), 60, "the attacks to connect", proc)
    (d / "go").write_text("")
    wait_for(lambda: progress(d) >= 5, 60, "the job to start stepping", proc)

    # Phase 2: the job is running. Attack the store and the coordinator again; the data
    # listeners are closed now (refused) or drop us.
    p0 = progress(d)
    jobs2 = [(f"{name}/{kind}/running", lambda a=addr, k=kind, n=name: attack(
        a, k, n.rstrip("01"), secret, recorded[n], wait_close=30))
        for name, addr in targets.items() for kind in KINDS]
    threads2, results2 = run_attacks(jobs2)
    for t in threads + threads2:
        t.join(90)
    results.update(results2)
    failures = []
    for name, r in sorted(results.items()):
        try:
            if isinstance(r, BaseException):
                raise r
            target, kind, phase = name.split("/")
            # Every attack must have been served, except on data listeners once the mesh is
            # built (closed by then: refused, or whatever the kernel says).
            served = phase == "init" or not target.startswith("data")
            check_dropped(r, name, kind if served else None)
        except (AssertionError, OSError) as e:
            failures.append(f"{name}: {e!r}")
    assert not failures, "\n".join(failures)

    # Silent clients: the job runs regardless; the store and the coordinator time them out.
    p1 = wait_for(lambda: progress(d) >= p0 + 10 and progress(d), 60,
                  "the job to keep stepping during the attacks", proc)
    for name in ("store", "coordinator", "local"):
        limit = STORE_AUTH_TIMEOUT_S if name == "store" else TIMEOUT_S
        check_dropped(drain(silent[name], limit + 10) + ("",), f"{name}/silence", "silence")
    for name in ("data0", "data1"):
        # Accepted while the mesh was built, held by the handshake's deadline (the start
        # timeout), and never answered beyond the greeting.
        got, _ = drain(silent[name], 0.5)
        check_dropped((got, True, ""), f"{name}/silence", "silence")
        silent[name].close()

    # Still serving its legitimate clients after all that.
    with connect(store) as s:
        handshake(s, secret)
        assert store_get(s, "g0/coordinator").decode() == published
    assert progress(d) >= p1
    (d / "stop").write_text("")
