"""What a node's memory limit meets (issue 48, item 7): ``status.memory`` shows the memory cgroup's limit and charge
beside the RSS, and a ``--daemon`` mount whose daemon is killed (SIGKILL: the OOM killer) before it is ready says
so -- "killed (out of memory?)" -- on the terminal and in its log, which was left empty.  (The scan's peak itself:
tests/engine/test_scan.py.)"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tierfs.daemon.runtime.memory import cgroup_memory
from tierfs.testing.harness import make_dataset, mounted, passthrough

LIMIT = 1 << 30


def _own_memory_cgroup() -> Path | None:
    """This process's memory cgroup directory where a child may be made in it (root, v2 or v1), else None."""
    from tierfs.daemon.runtime.memory import _cgroup_dirs

    found = _cgroup_dirs()
    if found is None or os.getuid() != 0:
        return None
    return Path(found[0][0])


@pytest.fixture
def cgroup():
    """A memory cgroup of its own with a 1 GiB limit, below this process's; removed at the end."""
    parent = _own_memory_cgroup()
    if parent is None:
        pytest.skip("needs root and a memory cgroup to make a child in")
    made = parent / f"tierfs-test-{os.getpid()}"
    try:
        made.mkdir()
        limit_file = "memory.max" if (made / "memory.max").exists() else "memory.limit_in_bytes"
        (made / limit_file).write_text(str(LIMIT))
    except OSError as exc:
        with contextlib.suppress(OSError):
            made.rmdir()
        pytest.skip(f"cannot make a memory cgroup here: {exc}")
    try:
        yield made
    finally:
        deadline = time.monotonic() + 10
        while True:
            try:
                made.rmdir()
                break
            except OSError:  # (its last process not reaped yet)
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def test_status_memory_shows_the_cgroups_limit_and_charge(dataset, mount_dirs, cgroup):
    backing, _ = dataset
    mnt, cache = mount_dirs
    into = ("sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(cgroup))
    with mounted(backing, mnt, cache, "1M", wrapper=into) as m:
        memory = m.status()["memory"]
        assert memory["cgroup_limit_bytes"] == LIMIT
        assert 0 < memory["cgroup_charge_bytes"] < LIMIT
        assert memory["rss_bytes"] > 0
        human = subprocess.run([sys.executable, "-m", "tierfs", "status", str(mnt)], capture_output=True, text=True,
                               timeout=60).stdout
        assert "of its 1G limit" in human


def test_status_memory_says_where_there_is_no_limit(dataset, mount_dirs):
    """Outside a limited cgroup the limit is None (no limit found above it either), the charge what the cgroup
    holds where there is one."""
    if cgroup_memory()[0] is not None:
        pytest.skip("this process runs under a memory limit")
    backing, _ = dataset
    mnt, cache = mount_dirs
    with mounted(backing, mnt, cache, "1M") as m:
        memory = m.status()["memory"]
        assert memory["cgroup_limit_bytes"] is None
        assert set(memory) >= {"rss_bytes", "cgroup_limit_bytes", "cgroup_charge_bytes"}


@pytest.mark.skipif(os.getuid() != 0, reason="the daemon's log of root is at a known path (/var/log/tierfs)")
def test_a_daemon_killed_before_it_is_ready_says_killed_out_of_memory(tmp_path, mount_dirs, daemons):
    """The daemon's scan waits on a backing that does not answer (a passthrough whose ``statfs`` hangs) and is
    killed with SIGKILL, as the OOM killer would: the parent that waits for readiness says so, and writes it into
    the daemon's log."""
    source = tmp_path / "source"
    make_dataset(source, dirs=2, files_per_dir=2, max_size=1024, seed=2)
    hang = tmp_path / "hang"
    hang.write_text(".\n")  # (statfs of the backing's root: the scan asks it for the count of entries)
    inner = tmp_path / "inner"
    inner.mkdir()
    mnt, cache = mount_dirs
    log = Path("/var/log/tierfs") / (str(mnt).strip("/").replace("-", "--").replace("/", "-") + ".log")
    with contextlib.suppress(FileNotFoundError):
        log.unlink()
    try:
        with passthrough(source, inner, hang=str(hang)):
            proc = subprocess.Popen([sys.executable, "-m", "tierfs", "mount", str(inner), str(mnt), "--cache",
                                     str(cache), "--capacity", "1M", "--daemon"], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                deadline = time.monotonic() + 60
                while not daemons():  # (the daemon holds its mountpoint from before its scan)
                    assert proc.poll() is None, proc.communicate()
                    assert time.monotonic() < deadline, "no daemon"
                    time.sleep(0.05)
                time.sleep(0.5)  # (into its scan, which waits on the backing)
                assert proc.poll() is None
                for pid in daemons():
                    os.kill(pid, signal.SIGKILL)
                hang.write_text("")  # (a FUSE call already sent waits for its answer, even killed: let it come)
                _, err = proc.communicate(timeout=60)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
        assert proc.returncode == 1
        assert "the daemon was killed by signal 9 (SIGKILL) before the mount was ready: killed (out of memory?" \
            in err, err
        text = log.read_text()
        assert "ERROR: the daemon was killed by signal 9 (SIGKILL) before the mount was ready: killed (out of " \
            "memory?" in text, text
    finally:
        with contextlib.suppress(FileNotFoundError):
            log.unlink()
