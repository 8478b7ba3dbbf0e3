"""Horovod's launcher surface beyond the command line: ``--config-file`` (Horovod's YAML), and
the Python names scripts and Horovod's own tests reach (``ferrovod.runner.launch.parse_args``,
``_run_elastic``/``_run_static``, ``runner.common.util.config_parser``,
``runner.elastic.driver``'s settings, ``runner.gloo_run._get_min_start_hosts``).

Every job here is real: ``ferrovodrun`` started as a process, or the launcher run inside this
test process through its Python API, with real workers.
"""

from __future__ import annotations

import io
import json
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from unittest import mock

import cloudpickle
import pytest

from conftest import describe, lines_matching, run_job

pytestmark = pytest.mark.usefixtures("ferrovod_importable")

SCRIPTS = Path(__file__).resolve().parent / "launcher_scripts"

# Shaped like the files Horovod's documentation shows, every section given.
HOROVOD_CONFIG = """\
params:
  fusion_threshold_mb: 32
  cycle_time_ms: 2.5
  cache_capacity: 512
  hierarchical_allreduce: false
autotune:
  enabled: false
timeline:
  filename: {timeline}
  mark_cycles: true
stall_check:
  enabled: true
  warning_time_seconds: 30
  shutdown_time_seconds: 90
library_options:
  gloo_timeout_seconds: 45
logging:
  level: warning
  with_timestamp: false
"""


def _reports(res):
    """``{rank: report}`` from report_env.py's REPORT lines."""
    found = {}
    for rank in res.ranks:
        for m in lines_matching(res, rank, r"^REPORT (.*)$"):
            found[rank] = json.loads(m.group(1))
    return found


def _report_env_job(tmp_path, config, *flags):
    path = tmp_path / "horovod.yaml"
    path.write_text(config)
    cmd_flags = ("--config-file", str(path), *flags)
    return run_job(2, str(SCRIPTS / "report_env.py"), launcher_args=cmd_flags, timeout=60)


def test_config_file_settings_reach_every_worker_and_flags_win(tmp_path):
    timeline = tmp_path / "tl.json"
    res = _report_env_job(tmp_path, HOROVOD_CONFIG.format(timeline=timeline),
                          "--cycle-time-ms", "3")
    assert res.returncode == 0, describe(res)
    got = _reports(res)
    assert sorted(got) == [0, 1], describe(res)
    for rank, report in got.items():
        env = report["env"]
        expected = {
            "FERROVOD_FUSION_THRESHOLD": str(32 * 1024 * 1024),
            "FERROVOD_CYCLE_TIME": "3.0",  # the flag, not the file's 2.5
            "FERROVOD_CACHE_CAPACITY": "512",
            "FERROVOD_HIERARCHICAL_ALLREDUCE": "0",
            "FERROVOD_AUTOTUNE": "0",
            "FERROVOD_TIMELINE": str(timeline),
            "FERROVOD_TIMELINE_MARK_CYCLES": "1",
            "FERROVOD_STALL_CHECK_DISABLE": "0",
            "FERROVOD_STALL_CHECK_TIME_SECONDS": "30",
            "FERROVOD_STALL_SHUTDOWN_TIME_SECONDS": "90",
            "FERROVOD_TIMEOUT_SECONDS": "45",
            "FERROVOD_LOG_LEVEL": "WARNING",
            "FERROVOD_LOG_HIDE_TIME": "1",
        }
        wrong = {k: (env.get(k), v) for k, v in expected.items() if env.get(k) != v}
        assert not wrong, f"rank {rank}: (got, expected) {wrong}\n{describe(res)}"


def test_the_config_files_timeline_is_written_by_the_engine(tmp_path):
    """Applied, not only exported: the engine writes the timeline the file names."""
    timeline = tmp_path / "tl.json"
    config = tmp_path / "horovod.yaml"
    config.write_text(f"timeline:\n  filename: {timeline}\n")
    res = run_job(2, "timeline_worker.py", "env", timeline, timeout=90,
                  launcher_args=("--config-file", str(config)))
    assert res.returncode == 0, describe(res)
    events = json.loads(timeline.read_text())
    names = {e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    assert {"tl.a", "tl.group", "tl.gather", "tl.bcast"} <= names, sorted(names)


@pytest.mark.parametrize("config,message", [
    ("params:\n  fusion_threshold: 32\n", "unknown key params.fusion_threshold"),
    ("parameters:\n  fusion_threshold_mb: 32\n", "unknown section 'parameters'"),
    ("params:\n  fusion_threshold_mb: -1\n", "params.fusion_threshold_mb"),
    ("params:\n  cycle_time_ms: fast\n", "params.cycle_time_ms"),
    ("stall_check:\n  enabled: maybe\n", "stall_check.enabled must be true or false"),
    ("logging:\n  level: chatty\n", "logging.level"),
    ("params: 32\n", "section 'params' must be a mapping"),
    ("- params\n", "must hold a mapping of sections"),
    ("params: [unclosed\n", "is not valid YAML"),
    ("controller: nccl\n", "controller must be gloo or mpi"),
    ("elastic:\n  blacklist_cooldown_range: 5\n", "elastic.blacklist_cooldown_range takes 2 values"),
])
def test_a_bad_config_file_is_a_usage_error_naming_the_key(tmp_path, config, message):
    res = _report_env_job(tmp_path, config)
    assert res.returncode == 2, describe(res)
    assert message in res.stderr and "horovod.yaml" in res.stderr, describe(res)
    assert not _reports(res), "no worker may start"


def test_a_missing_config_file_is_a_usage_error(tmp_path):
    res = run_job(2, str(SCRIPTS / "report_env.py"), timeout=30,
                  launcher_args=("--config-file", str(tmp_path / "absent.yaml")))
    assert res.returncode == 2 and "absent.yaml" in res.stderr, describe(res)


def test_the_elastic_section_makes_an_elastic_job(tmp_path):
    from ferrovod.runner import launch

    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:3\n")
    script.chmod(0o755)
    config = tmp_path / "horovod.yaml"
    config.write_text(f"elastic:\n  min_np: 2\n  max_np: 3\n  reset_limit: 4\n"
                      f"  blacklist_cooldown_range: [10, 100]\n  elastic_timeout: 7\n"
                      f"  host_discovery_script: {script}\n")
    args = launch.parse_args(["-np", "2", "--config-file", str(config), "--reset-limit", "1",
                              "true"])
    plan = launch.plan_job(args, {})
    s = plan.elastic
    assert s is not None
    assert (s.num_proc, s.min_np, s.max_np, s.reset_limit, s.cooldown, s.timeout_s,
            s.script) == (2, 2, 3, 1, (10, 100), 7.0, str(script))


def test_set_env_from_args_gives_the_workers_variables():
    from ferrovod.runner import launch
    from ferrovod.runner.common.util import config_parser

    args = launch.parse_args(["-np", "2", "--fusion-threshold-mb", "8", "--no-stall-check",
                              "--log-level", "debug", "true"])
    env = config_parser.set_env_from_args({"KEEP": "1"}, args)
    assert env["KEEP"] == "1"
    assert env["FERROVOD_FUSION_THRESHOLD"] == str(8 << 20)
    assert env["FERROVOD_STALL_CHECK_DISABLE"] == "1"
    assert env["FERROVOD_LOG_LEVEL"] == "DEBUG"
    assert "FERROVOD_CYCLE_TIME" not in env  # not given: the workers' environment decides


# -- the launcher run in this process ---------------------------------------------------------


def _in_process(argv, fn_name):
    """Runs ``ferrovod.runner.launch.<fn_name>(parse_args(argv))`` here; returns (exception or
    None, seconds, captured output)."""
    from ferrovod.runner import launch

    out, err = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    try:
        with redirect_stdout(out), redirect_stderr(err):
            getattr(launch, fn_name)(launch.parse_args(argv))
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        return exc, time.monotonic() - t0, out.getvalue() + err.getvalue()
    return None, time.monotonic() - t0, out.getvalue() + err.getvalue()


def _worker(code):
    return [sys.executable, "-c", f"import ferrovod as fv; fv.init(); print('size', fv.size()); {code}"]


def test_run_elastic_returns_when_the_job_succeeds(tmp_path):
    exc, _, output = _in_process(["-np", "2", "--min-np", "2", "-H", "localhost:2",
                                  *_worker("fv.shutdown()")], "_run_elastic")
    assert exc is None, f"{exc!r}\n{output}"
    assert output.count("size 2") == 2, output


def test_run_elastic_raises_horovods_message_when_every_worker_fails(tmp_path):
    from ferrovod.runner.elastic.constants import WORKER_FAILURE_MESSAGE

    exc, took, output = _in_process(["-np", "2", "--min-np", "2", "-H", "localhost:2",
                                     *_worker("raise SystemExit(3)")], "_run_elastic")
    assert isinstance(exc, RuntimeError), f"{exc!r}\n{output}"
    # Horovod's own words, which scripts match on, then which worker and how.
    assert str(exc).startswith(WORKER_FAILURE_MESSAGE.split("{", 1)[0]), exc
    assert "Horovod detected that one or more processes exited with non-zero status" in str(exc)
    assert "exit code 3" in str(exc), exc
    assert took < 60, took


def test_run_static_raises_naming_the_failed_rank():
    exc, _, output = _in_process(["-np", "2", sys.executable, "-c",
                                  "import os, sys; sys.exit(int(os.environ['FERROVOD_RANK']) * 5)"],
                                 "_run_static")
    assert isinstance(exc, RuntimeError), f"{exc!r}\n{output}"
    assert "rank 1" in str(exc) and "exit code 5" in str(exc), exc


def test_run_elastic_refuses_a_job_that_is_not_elastic():
    exc, _, _ = _in_process(["-np", "2", "true"], "_run_elastic")
    assert isinstance(exc, ValueError) and "not an elastic job" in str(exc), exc


def test_the_reset_limit_error_is_horovods_message(tmp_path):
    """A host added while the limit is 0: the job stops with Horovod's reset-limit message."""
    from ferrovod.runner.elastic.constants import RESET_LIMIT_EXCEEDED_MESSAGE

    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    grow = (f"import time; open({str(hosts)!r}, 'a').write('127.0.0.1:1\\n') "
            "if fv.rank() == 0 else None; time.sleep(600)")
    # The workers sleep outside any collective, so they never read the abort: the driver's
    # grace for them to raise it would only be waited out before they are stopped.
    with mock.patch("ferrovod.runner.elastic.driver.DISCOVER_HOSTS_FREQUENCY_SECS", 0.05), \
            mock.patch("ferrovod.runner.elastic.driver.ABORT_GRACE_S", 0.5):
        exc, took, output = _in_process(["-np", "2", "--min-np", "2", "--reset-limit", "0",
                                         "--host-discovery-script", str(script),
                                         *_worker(grow)], "_run_elastic")
    assert isinstance(exc, RuntimeError), f"{exc!r}\n{output}"
    assert RESET_LIMIT_EXCEEDED_MESSAGE.format(0) in str(exc), exc
    # The workers would sleep 10 minutes: the job ended because of the limit, not with them.
    assert took < 300, f"took {took:.1f} s\n{output}"


def test_min_start_hosts_and_the_elastic_timeout_are_the_drivers_settings():
    """Horovod's tests patch these two names; both are what the driver reads. Two hosts asked
    for and one given: the job does not start, and gives up after the patched timeout."""
    with mock.patch("ferrovod.runner.gloo_run._get_min_start_hosts", return_value=2), \
            mock.patch("ferrovod.runner.elastic.driver.ELASTIC_TIMEOUT_SECS", 1.5):
        exc, took, output = _in_process(["-np", "2", "--min-np", "2", "-H", "localhost:2",
                                         *_worker("")], "_run_elastic")
    assert isinstance(exc, RuntimeError), f"{exc!r}\n{output}"
    assert "on at least 2 host(s)" in str(exc) and "1.5 s" in str(exc), exc
    assert "size" not in output, "no worker may start"
    assert took < 15, took


# -- ferrovod.run: a Python function on every process ---------------------------------------

# The workers cannot import this test module (it is not on their path): its functions travel
# by value, as a script's own (__main__) functions do.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _sum_of_ranks(offset, scale=1.0):
    import numpy as np

    import ferrovod as fv

    fv.init()
    mine = np.arange(5, dtype=np.float64) * (fv.rank() + offset)
    total = fv.allreduce(mine, op=fv.Sum, name="run.sum") * scale
    return fv.rank(), fv.size(), mine, total


def test_run_returns_every_ranks_result_in_rank_order():
    import numpy as np

    import ferrovod

    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(out):
        results = ferrovod.run(_sum_of_ranks, args=(1,), kwargs={"scale": 0.5}, np=3)
    assert [r[:2] for r in results] == [(0, 3), (1, 3), (2, 3)], out.getvalue()
    reference = sum(r[2] for r in results) * 0.5  # each rank's input, summed here by NumPy
    for _, _, _, total in results:
        np.testing.assert_array_equal(total, reference)


def _env_rank_and_size():
    from ferrovod.runner.common.util.env import get_env_rank_and_size

    return get_env_rank_and_size()


def test_get_env_rank_and_size_reads_what_the_launcher_set(monkeypatch):
    import ferrovod
    from ferrovod.runner.common.util.env import get_env_rank_and_size

    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(out):
        assert ferrovod.run(_env_rank_and_size, np=3) == [(0, 3), (1, 3), (2, 3)], out.getvalue()
    # Open MPI's and MPICH's names, the default, and a launcher that set only one of the two
    for prefix in ("FERROVOD_", "HOROVOD_", "OMPI_COMM_WORLD_", "PMI_"):
        monkeypatch.delenv(prefix + "RANK", raising=False)
        monkeypatch.delenv(prefix + "SIZE", raising=False)
    assert get_env_rank_and_size() == (0, 1)
    monkeypatch.setenv("PMI_RANK", "1")
    with pytest.raises(RuntimeError, match="PMI_SIZE"):
        get_env_rank_and_size()
    monkeypatch.setenv("PMI_SIZE", "4")
    assert get_env_rank_and_size() == (1, 4)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "5")
    assert get_env_rank_and_size() == (2, 5)


def test_common_util_build_probes_and_cache():
    from ferrovod.common import util

    assert util.extension_available("torch") and not util.extension_available("caffe")
    assert util.gloo_built() is True
    calls = []

    @util._cache
    def probe(x):
        calls.append(x)
        return x * 2

    assert (probe(3), probe(3), probe(4)) == (6, 6, 8) and calls == [3, 4]


def _raise_on_rank_one():
    import ferrovod as fv

    fv.init()
    if fv.rank() == 1:
        raise KeyError("no such shard on rank one")
    fv.barrier()  # rank 0 fails here once rank 1 is gone
    return "unreachable"


def test_run_names_the_rank_that_raised_with_its_traceback():
    import ferrovod

    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(out), pytest.raises(RuntimeError) as info:
        ferrovod.run(_raise_on_rank_one, np=2)
    text = str(info.value)
    assert text.startswith("ferrovod.run: rank 1 raised an exception"), text
    assert "KeyError: 'no such shard on rank one'" in text and "Traceback" in text, text
    assert "_raise_on_rank_one" in text, text


def _unpicklable():
    import threading

    return threading.Lock()


def test_run_reports_a_result_that_cannot_travel():
    import ferrovod

    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(out), pytest.raises(RuntimeError) as info:
        ferrovod.run(_unpicklable, np=2)
    assert "cannot be pickled" in str(info.value), info.value


def test_run_refuses_bad_arguments():
    import ferrovod

    with pytest.raises(ValueError, match="np"):
        ferrovod.run(_unpicklable, np=0)


def _rank_one_leaves_quietly():
    import ferrovod as fv

    fv.init()
    rank = fv.rank()
    fv.shutdown()
    if rank == 1:
        raise SystemExit(0)  # exits 0 with no result, as a worker an elastic job removed
    return rank


def test_run_says_which_rank_left_no_result():
    import ferrovod

    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(out), pytest.raises(RuntimeError) as info:
        ferrovod.run(_rank_one_leaves_quietly, np=2)
    assert "no result from rank(s) [1]" in str(info.value), info.value
