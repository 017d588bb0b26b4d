"""pyfuse3's request loop as scripts/pyfuse3 builds it (``nonblocking-loop.patch``, issue 23): the daemon reads the
FUSE device without blocking, taking queued requests at once, and many readers at once still get every byte, every
open counted, and the mount's other work (``status``) answered while the queue stays full."""

from __future__ import annotations

import importlib.metadata
import os
import threading

import pytest

from tierfs.testing.harness import within

DEADLINE = 60.0  # seconds the whole burst may take before the test calls the mount hung (and aborts it)


def _build() -> int:
    local = importlib.metadata.version("pyfuse3").partition("+")[2]
    return int(local[len("tierfs"):]) if local.startswith("tierfs") and local[len("tierfs"):].isdigit() else 0


pytestmark = pytest.mark.skipif(_build() < 2, reason="stock pyfuse3: scripts/pyfuse3/install.sh builds the patched one")


def _fuse_fd_flags(pid: int) -> int:
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != "/dev/fuse":
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except FileNotFoundError:
            continue
        return int(fields["flags"].strip(), 8)
    raise AssertionError(f"daemon {pid} holds no /dev/fuse descriptor")


def test_the_daemon_reads_the_fuse_device_without_blocking(tierfs_mount):
    with tierfs_mount(capacity="4M") as m:
        assert _fuse_fd_flags(m.process.pid) & os.O_NONBLOCK


def test_sixteen_readers_at_once_get_every_byte_and_every_open_is_counted(dataset, tierfs_mount):
    backing, files = dataset
    want = {rel: (backing / rel).read_bytes() for rel in files}
    rounds, readers = 6, 16
    with tierfs_mount(capacity="4M", nm=1, view="full") as m:
        before = m.status()["reads"]
        bad: list[str] = []
        statuses: list[int] = []

        def reader(k: int) -> None:
            names = sorted(want)
            for _ in range(rounds):
                for rel in names[k % len(names):] + names[:k % len(names)]:
                    with open(m.path(rel), "rb") as f:
                        if f.read() != want[rel]:
                            bad.append(rel)
                if k == 0:  # the mount's other tasks are served while the others keep the queue full
                    statuses.append(m.status()["reads"]["hits"])

        def burst() -> None:
            threads = [threading.Thread(target=reader, args=(k,)) for k in range(readers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        assert within(m.mountpoint, burst, DEADLINE) is None
        assert bad == []
        assert len(statuses) == rounds
        after = m.status()["reads"]
        opened = (after["hits"] + after["misses"]) - (before["hits"] + before["misses"])
        assert opened == rounds * readers * len(want)
