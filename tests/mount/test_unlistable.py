"""A class directory the daemon cannot list (issue 48, item 4): an NFS ``root_squash`` export with one 0700 class
dir, here a directory of another user's, 0700, under a daemon without ``CAP_DAC_OVERRIDE``.  Its files were left
out of the data set with no log line and no status field; now each such directory is logged (path, errno),
counted in ``status.tree`` and in ``tierfs status``, and ``unlistable=refuse`` refuses the mount naming it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tierfs.testing.harness import is_mounted, make_dataset, mounted, within

#: the daemon as root without the capabilities that let root read any directory (what root_squash makes of it)
NO_DAC = ("setpriv", "--inh-caps=-dac_override,-dac_read_search", "--bounding-set=-dac_override,-dac_read_search")

pytestmark = pytest.mark.skipif(os.getuid() != 0 or shutil.which("setpriv") is None,
                                reason="needs root and setpriv (to drop CAP_DAC_OVERRIDE)")


@pytest.fixture
def backing(tmp_path):
    """Three class dirs of 4 files; ``locked`` belongs to nobody, 0700: (the backing, the files outside it)."""
    root = tmp_path / "backing"
    files = make_dataset(root, dirs=3, files_per_dir=4, max_size=4096, seed=3)
    locked = root / "locked"
    os.rename(root / "class_002", locked)
    for name in os.listdir(locked):
        os.chown(locked / name, 65534, 65534)
    os.chown(locked, 65534, 65534)
    os.chmod(locked, 0o700)
    return root, {rel: size for rel, size in files.items() if not rel.startswith("class_002/")}


def test_a_directory_the_daemon_cannot_list_is_said_counted_and_shown(backing, mount_dirs):
    root, readable = backing
    mnt, cache = mount_dirs
    with mounted(root, mnt, cache, "1M", view="full", wrapper=NO_DAC) as m:
        st = m.status()
        assert st["dataset_files"] == len(readable) == 8  # (the locked dir's 4 files are not in the data set ...)
        assert st["tree"]["unlistable"] == 1  # (... and status says so)
        assert st["tree"]["unlistable_dirs"] == ["locked (EACCES: Permission denied)"]
        assert f"cannot list {root}/locked (EACCES: Permission denied)" in m.stderr()  # (the log)
        human = subprocess.run([sys.executable, "-m", "tierfs", "status", str(mnt)], capture_output=True, text=True,
                               timeout=60).stdout
        assert "1 directory of the backing dir could not be listed (first: locked (EACCES" in human
        metrics = within(str(mnt), lambda: Path(m.path(".tierfs", "metrics")).read_text())
        assert "tierfs_unlistable_dirs 1.0\n" in metrics
        assert within(str(mnt), lambda: sorted(os.listdir(m.path("locked")))) == []  # (listed, empty)


def test_unlistable_refuse_refuses_the_mount_with_one_line_naming_the_directory(backing, mount_dirs):
    root, _ = backing
    mnt, cache = mount_dirs
    res = subprocess.run([*NO_DAC, sys.executable, "-m", "tierfs", "mount", str(root), str(mnt), "--cache", str(cache),
                          "--capacity", "1M", "-o", "unlistable=refuse"], capture_output=True, text=True, timeout=60,
                         stdin=subprocess.DEVNULL)
    assert res.returncode == 1, res.stderr
    assert not is_mounted(mnt)
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"tierfs: error: cannot list {root}/locked (EACCES: Permission denied): "
                           "unlistable=refuse refuses the mount"), res.stderr


def test_a_daemon_that_may_read_every_directory_counts_none(backing, mount_dirs):
    """The same backing under root with its capabilities: every class dir listed, nothing said."""
    root, readable = backing
    mnt, cache = mount_dirs
    with mounted(root, mnt, cache, "1M", view="full", unlistable="refuse") as m:
        st = m.status()
        assert st["dataset_files"] == len(readable) + 4
        assert st["tree"]["unlistable"] == 0 and st["tree"]["unlistable_dirs"] == []
        assert "cannot list" not in m.stderr()
