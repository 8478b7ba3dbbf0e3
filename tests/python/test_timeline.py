"""Timeline: rank 0 writes a Chrome-trace JSON file with, per tensor, negotiation, the op, the
transfer and the fusion copies; it parses and holds the events of a known run."""

import json
from collections import defaultdict

import pytest

from conftest import describe, run_job

pytestmark = pytest.mark.usefixtures("ferrovod_importable")


def _load(path):
    events = json.loads(path.read_text())
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e["name"] == "process_name"}
    per_tensor = defaultdict(list)
    for e in events:
        if e.get("ph") in ("B", "E"):
            per_tensor[names[e["pid"]]].append(e)
    return events, per_tensor


def _activities(evs):
    """Begin names in order, checking every B has its E and timestamps never go back."""
    stack, seen, last = [], [], 0
    for e in evs:
        assert e["ts"] >= last, evs
        last = e["ts"]
        if e["ph"] == "B":
            stack.append(e["name"])
            seen.append(e["name"])
        else:
            assert stack, f"E without B in {evs}"
            stack.pop()
    assert not stack, f"unclosed {stack}"
    return seen


def test_env_timeline_holds_every_tensor_and_phase(tmp_path):
    path = tmp_path / "timeline.json"
    res = run_job(2, "timeline_worker.py", "env", path, env={"FERROVOD_TIMELINE": str(path)},
                  timeout=60)
    assert res.returncode == 0, describe(res)
    _, per = _load(path)
    assert {"tl.a", "tl.group", "tl.gather", "tl.bcast"} <= set(per), sorted(per)
    acts = _activities(per["tl.a"])
    assert acts.count("NEGOTIATE_ALLREDUCE") == 3 and acts.count("ALLREDUCE") == 3, acts
    assert acts.count("TCP_ALLREDUCE") == 3, acts
    group = _activities(per["tl.group"])
    assert "MEMCPY_IN_FUSION_BUFFER" in group and "MEMCPY_OUT_FUSION_BUFFER" in group, group
    assert _activities(per["tl.gather"]) == ["NEGOTIATE_ALLGATHER", "ALLGATHER", "TCP_ALLGATHER"]
    assert _activities(per["tl.bcast"]) == ["NEGOTIATE_BROADCAST", "BROADCAST", "TCP_BCAST"]
    ends = [e for e in per["tl.gather"] if e["ph"] == "E" and "args" in e]
    assert ends and "int32" in ends[-1]["args"]["tensors"], ends


def test_timeline_is_written_while_the_job_runs(tmp_path):
    path = tmp_path / "live.json"
    res = run_job(2, "timeline_worker.py", "live", path, env={"FERROVOD_TIMELINE": str(path)},
                  timeout=60)
    assert res.returncode == 0, describe(res)
    _, per = _load(path)
    assert "tl.bcast" in per, sorted(per)


def test_runtime_start_and_stop_with_cycle_marks(tmp_path):
    path = tmp_path / "runtime.json"
    res = run_job(2, "timeline_worker.py", "runtime", path, timeout=60)
    assert res.returncode == 0, describe(res)
    events, per = _load(path)
    assert "before.start" not in per and "after.stop" not in per, sorted(per)
    assert "tl.a" in per
    assert any(e.get("name") == "CYCLE_START" and e.get("ph") == "i" for e in events)


def test_launcher_flag_sets_the_timeline(tmp_path):
    path = tmp_path / "flag.json"
    res = run_job(2, "timeline_worker.py", "env", path, timeout=60,
                  launcher_args=("--timeline-filename", str(path)))
    assert res.returncode == 0, describe(res)
    _, per = _load(path)
    assert "tl.a" in per


def test_torch_ops_carry_horovods_names(tmp_path):
    """ferrovod.torch names a named op ``<op>.<name>``, as Horovod's torch does (and its
    test_timeline.py looks for): an allreduce, a broadcast and an allgather given one name are
    three ops, in flight together, each under its own name; called in different orders on
    different ranks, they fail on every rank and the job goes on."""
    path = tmp_path / "torch.json"
    res = run_job(3, "timeline_worker.py", "torch", path, env={"FERROVOD_TIMELINE": str(path)},
                  timeout=90)
    assert res.returncode == 0, describe(res)
    assert res.stdout.count("OK") == 3, describe(res)
    _, per = _load(path)
    assert {"allreduce.tl.twin", "broadcast.tl.twin"} <= set(per), sorted(per)
    assert "NEGOTIATE_ALLREDUCE" in _activities(per["allreduce.tl.twin"])
    assert "NEGOTIATE_BROADCAST" in _activities(per["broadcast.tl.twin"])
