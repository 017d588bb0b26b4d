"""Where a daemon logs, as the docs say (usage.md, operations.md), and that its log is rotated (issue 22); that
its lines carry a timestamp, one ``tierfs[PID]`` and the level, and that SIGHUP reopens it and never unmounts
(issue 47: logrotate's ``kill -HUP``, the unit's ``ExecReload=``).

``/var/log/tierfs/<mountpoint with / as ->.log`` for root (``$XDG_STATE_HOME/tierfs/`` for anyone else), never on
the cache disk; rotated at ``TIERFS_LOG_MAX`` bytes (16 MiB unless set: a small one here) to ``.log.1``.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tierfs.testing.harness import is_mounted, wait_until, within

CAP = 300  # bytes: a mount and an unmount at log_level=debug write several times that
#: ``2026-12-06T23:10:00.123+00:00 tierfs[4242] WARNING: message``: ISO 8601 with milliseconds and the zone
LINE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d tierfs\[(\d+)\] "
                  r"(DEBUG|INFO|WARNING|ERROR|CRITICAL): (.*)")


def log_lines(text: str) -> list[re.Match[str]]:
    """Every line of a log, parsed: each must be a whole, well-formed line with one prefix."""
    lines = text.splitlines()
    parsed = [LINE.fullmatch(line) for line in lines]
    assert all(parsed), [line for line, m in zip(lines, parsed, strict=True) if not m]
    assert not [m for m in parsed if m and m.group(3).startswith("tierfs")], "a doubled prefix"
    return [m for m in parsed if m]


def log_path(mnt: Path, state_home: Path) -> Path:
    """The documented path of the log of a daemon mounted at ``mnt`` (root's, or this user's state dir)."""
    name = str(mnt).strip("/").replace("-", "--").replace("/", "-") + ".log"
    return Path("/var/log/tierfs") / name if os.getuid() == 0 else state_home / "tierfs" / name


@pytest.mark.skipif(os.getuid() != 0, reason="the documented path is root's (/var/log/tierfs)")
def test_a_daemon_logs_where_the_docs_say_and_rotates_its_log(dataset, mount_dirs, daemons):
    backing, files = dataset
    mnt, cache = mount_dirs
    log = Path("/var/log/tierfs") / (str(mnt).strip("/").replace("-", "--").replace("/", "-") + ".log")
    old = Path(f"{log}.1")
    env = {**os.environ, "TIERFS_LOG_MAX": str(CAP)}
    try:
        res = subprocess.run([sys.executable, "-m", "tierfs", "mount", str(backing), str(mnt), "--cache", str(cache),
                              "--capacity", "1M", "--log-level", "debug", "--daemon"], capture_output=True, text=True,
                             timeout=60, stdin=subprocess.DEVNULL, env=env)
        assert res.returncode == 0, res.stderr
        for rel in sorted(files)[:4]:
            subprocess.run(["cat", str(mnt / rel)], capture_output=True, check=True, timeout=30)
        res = subprocess.run([sys.executable, "-m", "tierfs", "umount", str(mnt)], capture_output=True, text=True,
                             timeout=60)
        assert res.returncode == 0, res.stderr
        deadline = time.monotonic() + 30
        while daemons():
            assert time.monotonic() < deadline, "the daemon did not exit"
            time.sleep(0.05)
        assert not is_mounted(mnt)
        assert log.is_file() and old.is_file(), sorted(os.listdir(log.parent))
        assert not any(p.name.endswith(".log") for p in cache.iterdir())  # never on the cache disk
        current, previous = log.read_text(), old.read_text()
        assert "unmounted" in current  # the last line is in the current file
        for text in (current, previous):
            assert text.endswith("\n")
            longest = max(len(line) + 1 for line in text.splitlines())
            assert len(text.encode()) <= max(CAP, longest)  # rotated before a line would pass the cap
            log_lines(text)  # whole lines only
    finally:
        for p in (log, old):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()


def test_sighup_to_a_foreground_mount_leaves_it_serving(tierfs_mount, dataset):
    """Under systemd (foreground, logging to the journal) ``systemctl reload`` sends SIGHUP: it must never unmount
    the dataset under a running job.  Its log lines (stderr here) carry a timestamp, the pid and the level."""
    _, files = dataset
    first = sorted(files)[0]
    with tierfs_mount() as m:
        m.process.send_signal(signal.SIGHUP)
        wait_until(lambda: "SIGHUP" in m.stderr(), what="the SIGHUP logged")
        assert m.process.poll() is None and is_mounted(m.mountpoint)
        data = within(m.mountpoint, lambda: Path(m.path(first)).read_bytes())
        assert isinstance(data, bytes) and len(data) == files[first]
        assert "no log file to reopen; still serving" in m.stderr()
        lines = log_lines(m.stderr())
    assert {int(x.group(1)) for x in lines} == {m.process.pid}
    assert any(x.group(2) == "INFO" and x.group(3) == f"mounted {m.mountpoint}" for x in lines)


def test_sighup_reopens_a_daemons_log_where_logrotate_moved_it(dataset, mount_dirs, daemons, tmp_path):
    """logrotate renames the log and sends SIGHUP: the daemon goes on serving and writes its next lines to a new
    file at the documented path; the renamed file gets none of them."""
    backing, files = dataset
    mnt, cache = mount_dirs
    state = tmp_path / "state"
    log = log_path(mnt, state)
    moved = Path(f"{log}.rotated")
    env = {**os.environ, "XDG_STATE_HOME": str(state)}
    try:
        res = subprocess.run([sys.executable, "-m", "tierfs", "mount", str(backing), str(mnt), "--cache", str(cache),
                              "--capacity", "1M", "--daemon"], capture_output=True, text=True, timeout=60,
                             stdin=subprocess.DEVNULL, env=env)
        assert res.returncode == 0, res.stderr
        (pid,) = daemons()
        wait_until(lambda: f"mounted {mnt}" in log.read_text(), what="the mount logged")  # (after the go-ahead)
        os.rename(log, moved)
        os.kill(pid, signal.SIGHUP)
        wait_until(log.exists, what="the log reopened at its path")
        wait_until(lambda: "SIGHUP: log reopened" in log.read_text(), what="the reopening logged")
        for rel in sorted(files)[:2]:  # still serving
            data = within(str(mnt), lambda rel=rel: (mnt / rel).read_bytes())
            assert isinstance(data, bytes) and len(data) == files[rel]
        assert daemons() == [pid] and is_mounted(mnt)
        res = subprocess.run([sys.executable, "-m", "tierfs", "umount", str(mnt)], capture_output=True, text=True,
                             timeout=60)
        assert res.returncode == 0, res.stderr
        wait_until(lambda: not daemons(), what="the daemon's exit")
        new, old = log_lines(log.read_text()), log_lines(moved.read_text())
        assert any(x.group(3) == f"mounted {mnt}" for x in old)
        assert any(x.group(3) == f"unmounted {mnt}" for x in new)
        assert not any("unmounted" in x.group(3) for x in old)
        assert {int(x.group(1)) for x in new + old} == {pid}
    finally:
        for p in (log, moved):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
