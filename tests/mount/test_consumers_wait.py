"""Jobs that wait for nobody (issue 48, item 8): on a mount read by named jobs (``TIERFS_CONSUMER``), an operator's
``cat`` holds no job, and a job that exited is dropped at once -- not after ``consumer_timeout``.

``consumer_timeout`` is 600 s here: the old code's wait (measured 60.1 s at the default) would outlast each job's
deadline, so a wait for nobody fails the test instead of slowing it.  The jobs are real processes named in their
environment, each under a deadline and killed in the cleanup; the mount fixture aborts the connection if needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tierfs.daemon.schedule.consumers import CONSUMER_ENV
from tierfs.testing.harness import Mounted, abort_connection, wait_until, within

#: One job: ``MOUNT PASSES OUT EXIT``: PASSES passes (list the root, each class folder, read every file listed).
#: After its first file it writes OUT.ready and waits for OUT.go.  EXIT ``now``: it exits after OUT.go (a job
#: stopped early); ``on-file``: it exits once OUT.exit exists; ``no``: it makes its passes.  At the end it writes
#: OUT, the longest time a listing of the root took (where a job ahead waits for the others).
_JOB = r"""
import json, os, sys, time
mnt, passes, out, how = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
longest = 0.0
for i in range(passes):
    t = time.monotonic()
    dirs = os.listdir(mnt)
    longest = max(longest, time.monotonic() - t)
    for d in dirs:
        for name in os.listdir(os.path.join(mnt, d)):
            with open(os.path.join(mnt, d, name), "rb") as f:
                f.read()
            if i == 0 and not os.path.exists(out + ".ready"):
                open(out + ".ready", "w").close()
                while not os.path.exists(out + ".go"):
                    time.sleep(0.01)
                if how == "now":
                    sys.exit(0)
            while how == "on-file":
                if os.path.exists(out + ".exit"):
                    sys.exit(0)
                time.sleep(0.01)
with open(out, "w") as f:
    json.dump({"longest_root_listing_s": longest}, f)
"""

_TIMEOUT = 600  # consumer_timeout: far beyond every deadline below
_DEADLINE = 90.0  # seconds for a job's passes (a few on an idle machine)


def _env(name: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != CONSUMER_ENV}
    return env if name is None else {**env, CONSUMER_ENV: name}


def _start(mnt, jobs: dict[str, tuple[int, str]], tmp_path) -> dict[str, subprocess.Popen]:
    """Start ``jobs`` (name -> (passes, exit)), each named in its environment; returns once each read a file."""
    procs = {}
    for name, (passes, how) in jobs.items():
        procs[name] = subprocess.Popen([sys.executable, "-c", _JOB, str(mnt), str(passes), str(tmp_path / name),
                                        how], env=_env(name), stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_until(lambda: all(os.path.exists(tmp_path / f"{n}.ready") for n in jobs), timeout=60,
               what="every job reading")
    return procs


def _go(tmp_path, names) -> None:
    for name in names:
        (tmp_path / f"{name}.go").touch()


def _stop(procs: dict[str, subprocess.Popen], m: Mounted) -> None:
    """End every job.  One still running may be waiting in the daemon (a listing of the root), where not even
    SIGKILL reaches it until the daemon answers: the mount's connection is aborted first."""
    if any(p.poll() is None for p in procs.values()):
        abort_connection(m.mountpoint, m.connection)
    for p in procs.values():
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=10)


def _finish(proc: subprocess.Popen, deadline: float, what: str) -> None:
    try:
        _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} did not make its passes within {_DEADLINE:g} s: it waits for nobody")
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]


def _by_name(st: dict) -> dict[str, dict]:
    return {c["name"]: c for c in st["consumers"]["consumers"]}


def _operator(m: Mounted, *cmd: str) -> None:
    """An operator's command (no consumer name in its environment) on the mount, under a deadline: one that
    waits in the daemon is freed by aborting the mount's connection (SIGKILL alone does not reach it)."""
    p = subprocess.Popen(cmd, env=_env(None), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    try:
        _, err = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        abort_connection(m.mountpoint, m.connection)
        p.kill()
        p.communicate(timeout=10)
        pytest.fail(f"an operator's {' '.join(cmd)} waited 30 s for the named jobs")
    assert p.returncode == 0, err.decode(errors="replace")


def _a_view_file(mnt: str) -> str:
    def first() -> str:
        d = sorted(os.listdir(mnt))[0]
        return os.path.join(mnt, d, sorted(os.listdir(os.path.join(mnt, d)))[0])

    path = within(mnt, first)
    assert isinstance(path, str), path
    return path


def test_an_operators_cat_holds_no_named_job(tierfs_mount, tmp_path):
    nm, rf = 2, 2
    passes = 2 * nm * rf
    procs: dict[str, subprocess.Popen] = {}
    with tierfs_mount(capacity="4M", nm=nm, rf=rf, advance="strict", consumer_timeout=_TIMEOUT) as m:
        try:
            _operator(m, "cat", _a_view_file(m.mountpoint))  # before the job: the anonymous readers
            deadline = time.monotonic() + _DEADLINE
            procs = _start(m.mountpoint, {"job": (passes, "no")}, tmp_path)
            _operator(m, "cat", _a_view_file(m.mountpoint))  # while it reads: a cat ...
            _operator(m, "ls", m.mountpoint)  # ... and an ls
            _go(tmp_path, ["job"])
            _finish(procs["job"], deadline, "the named job")
        finally:
            _stop(procs, m)
        with open(tmp_path / "job") as f:
            longest = json.load(f)["longest_root_listing_s"]
        assert longest < 30, f"the job waited {longest:.1f} s for the operator's cat"
        st = m.status()
        c = _by_name(st)
        assert c["job"]["passes_total"] == passes and c["job"]["state"] == "live"
        assert c["anonymous"]["state"] == "new" and st["consumers"]["drops"] == 0
        assert (st["epoch"], st["mini_epoch"]) == (2, 0)  # the mount moved with the job alone
        assert "no longer count passes while job" in m.stderr()


def test_a_job_that_exited_holds_no_other(tierfs_mount, tmp_path):
    """Three jobs: ``stopped`` exits as soon as it read a file (early stopping), ``stops-later`` exits while
    ``job`` waits for it; ``job`` makes all its passes, each of the others dropped once, the log says why."""
    nm, rf = 2, 2
    passes = 2 * nm * rf
    procs: dict[str, subprocess.Popen] = {}
    with tierfs_mount(capacity="4M", nm=nm, rf=rf, advance="strict", consumer_timeout=_TIMEOUT) as m:
        try:
            deadline = time.monotonic() + _DEADLINE
            procs = _start(m.mountpoint, {"job": (passes, "no"), "stopped": (passes, "now"),
                                          "stops-later": (passes, "on-file")}, tmp_path)
            _go(tmp_path, procs)
            _finish(procs["stopped"], deadline, "the job stopped early")  # (reaped: its pid is gone)

            def waits() -> bool:  # for stops-later only: stopped, which exited, dropped (within ALIVE_EVERY)
                c = _by_name(m.status())
                return c["job"]["waiting_s"] is not None and c["stopped"]["state"] == "dropped"

            wait_until(waits, timeout=_DEADLINE, what="the job waiting for the one alive, the one gone dropped")
            assert _by_name(m.status())["stops-later"]["state"] == "live"
            (tmp_path / "stops-later.exit").touch()  # it exits during the wait
            _finish(procs["stops-later"], deadline, "the job that stops later")
            _finish(procs["job"], deadline, "the job that goes on")
        finally:
            _stop(procs, m)
        st = m.status()
        c = _by_name(st)
        assert c["job"]["passes_total"] == passes and c["job"]["state"] == "live"
        assert c["stopped"]["state"] == c["stops-later"]["state"] == "dropped"
        assert c["stopped"]["drops"] == c["stops-later"]["drops"] == 1 and st["consumers"]["drops"] == 2
        log = m.stderr()
        for name in ("stopped", "stops-later"):
            line = next((x for x in log.splitlines() if f"consumer {name} dropped" in x), None)
            assert line is not None and "none of its processes is alive (it exited or was killed: pid" in line, log
