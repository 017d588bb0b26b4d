"""Real FUSE mounts.  Every mount goes through :func:`tierfs.testing.harness.mounted`, which always unmounts."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time

import pytest

from tierfs.common.mountpoint_lock import holders
from tierfs.testing.harness import force_unmount, make_dataset, mounted


def pytest_collection_modifyitems(items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.mount)


@pytest.fixture(scope="session", autouse=True)
def _fuse_available():
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        pytest.fail("mount tests need /dev/fuse and fusermount3 (apt-get install fuse3)")


@pytest.fixture
def dataset(tmp_path):
    """A small dataset: 4 class dirs x 8 files of up to 64 KiB; returns (backing path, {relpath: size})."""
    backing = tmp_path / "backing"
    files = make_dataset(backing, dirs=4, files_per_dir=8, max_size=64 << 10, seed=1)
    return backing, files


@pytest.fixture
def mount_dirs(tmp_path):
    """Fresh, empty mountpoint and cache dirs; lazily unmounted at the end whatever happened."""
    mnt = tmp_path / "mnt"
    cache = tmp_path / "cache"
    mnt.mkdir()
    yield mnt, cache
    force_unmount(mnt)


@pytest.fixture
def tierfs_mount(dataset, mount_dirs):
    """A factory: ``with tierfs_mount(capacity=..., rf=2) as m:`` mounts the ``dataset`` fixture."""
    backing, _ = dataset
    mnt, cache = mount_dirs

    def factory(capacity="1M", **options):
        return mounted(backing, mnt, cache, capacity, **options)

    return factory


@pytest.fixture
def wait_position():
    """``wait_position(m, (epoch, mini_epoch))``: poll ``m``'s status until it is there; returns that status."""

    def wait(m, want: tuple[int, int], timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            st = m.status()
            if (st["epoch"], st["mini_epoch"]) == want:
                return st
            assert time.monotonic() < deadline, f"{m.mountpoint} did not reach {want}: {st}"
            time.sleep(0.05)

    return wait


@pytest.fixture
def other_user():
    """``(mountpoint, as_nobody)``: a mountpoint that another user can reach (outside pytest's 0700 tmp dir) and
    ``as_nobody(code, *args)``, which runs Python ``code`` as user nobody and returns its output's words.
    Skipped unless root with a system python3 (the venv's interpreter may sit where nobody cannot run it)."""
    python = "/usr/bin/python3"
    if os.getuid() != 0 or not os.access(python, os.X_OK):
        pytest.skip("needs root and a system python3 to read as another user")
    mnt = tempfile.mkdtemp(prefix="tierfs-other-")
    os.chmod(mnt, 0o755)

    def as_nobody(code: str, *args: str) -> list[str]:
        return subprocess.run([python, "-c", code, *args], capture_output=True, text=True, check=True,
                              user=65534, group=65534, timeout=60).stdout.split()

    try:
        yield mnt, as_nobody
    finally:
        force_unmount(mnt)
        os.rmdir(mnt)


@pytest.fixture
def daemons(mount_dirs):
    """``daemons()``: the pids of the daemons of this test's mountpoint, from their lock on it
    (:mod:`tierfs.common.mountpoint_lock`), looked up through a descriptor of the mountpoint's own directory, so never
    through a mount on it (nor through other processes' command lines); any left at the end are killed."""
    mnt, _ = mount_dirs
    fd = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    underneath = f"/proc/self/fd/{fd}"  # (opens and stats the directory the fd holds, not what is mounted there)
    try:
        yield lambda: holders(underneath)
        for pid in holders(underneath):
            if pid > 0:
                os.kill(pid, signal.SIGKILL)
    finally:
        os.close(fd)
