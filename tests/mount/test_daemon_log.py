"""Where a daemon logs, as the docs say (usage.md, operations.md), and that its log is rotated (issue 22).

``/var/log/tierfs/<mountpoint with / as ->.log`` for root, never on the cache disk; rotated at ``TIERFS_LOG_MAX``
bytes (16 MiB unless set: a small one here) to ``.log.1``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tierfs.testing import is_mounted

CAP = 300  # bytes: a mount and an unmount at log_level=debug write several times that


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
            assert all(line.startswith("tierfs: ") for line in text.splitlines())  # whole lines only
    finally:
        for p in (log, old):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
