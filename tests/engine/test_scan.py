"""The scan's edges (issue 48): its memory at its peak (the figure a node's limit is set by), timestamps an int64 of
nanoseconds cannot hold, and directories it cannot list (said, counted, or refused)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tierfs.daemon.tree.tree import Tree
from tierfs.testing.harness import scan_memory

FAR = 10413792000 * 10**9  # 2300-01-01T00:00:00Z in ns: above 2**63


def _scan(path) -> Tree:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return Tree.scan(fd, str(path))
    finally:
        os.close(fd)


def test_a_scan_keeps_a_date_past_2262_as_the_latest_an_int64_holds(tmp_path):
    root = tmp_path / "backing"
    (root / "d").mkdir(parents=True)
    (root / "d" / "far.bin").write_bytes(b"x" * 10)
    (root / "d" / "near.bin").write_bytes(b"y" * 20)
    os.utime(root / "d" / "far.bin", ns=(FAR, FAR))
    os.utime(root / "d", ns=(FAR, FAR))  # (a directory too)
    if (root / "d" / "far.bin").stat().st_mtime_ns != FAR:
        pytest.skip("this filesystem does not keep dates past 2262")
    t = _scan(root)  # (was: OverflowError: Python int too large to convert to C long)
    assert t.n_files == 2
    far = t.child(t.child(0, b"d"), b"far.bin")
    assert t.attributes(far)[7] == 2**63 - 1
    assert t.attributes(t.child(0, b"d"))[7] == 2**63 - 1
    near = t.child(t.child(0, b"d"), b"near.bin")
    assert t.attributes(near)[7] == (root / "d" / "near.bin").stat().st_mtime_ns  # (the others as they are)




@pytest.fixture
def fast_tmp(tmp_path):
    """A temporary dir in memory where there is one (/dev/shm: 200,000 files made in seconds, not a minute on a
    busy disk), else ``tmp_path``; removed at the end."""
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        yield tmp_path
        return
    made = tempfile.mkdtemp(prefix="tierfs-test-scan-", dir="/dev/shm")
    try:
        yield Path(made)
    finally:
        shutil.rmtree(made, ignore_errors=True)


@pytest.mark.slow
def test_the_scans_peak_memory_is_at_most_250_bytes_a_file(fast_tmp):
    """200,000 files in 200 directories (names as ImageNet's are long): the scan's own peak, above the interpreter's
    memory before it, at most 250 bytes a file (it was ~350 when every name was an object of its own and the
    arrays were copied all at once at the end: 143 MB for 300,000 files, what a 120 MB cgroup killed)."""
    root = fast_tmp / "backing"
    for d in range(200):
        sub = root / f"n{d:08d}"
        sub.mkdir(parents=True)
        dfd = os.open(sub, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for i in range(1000):
                os.close(os.open(f"n{d:08d}_{i:06d}.JPEG", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=dfd))
        finally:
            os.close(dfd)
    got = scan_memory(root, timeout=300)
    assert got["files"] == 200_000
    assert (got["peak"] - got["before"]) / got["files"] <= 250, got


_UNPRIVILEGED_SCAN = """
import json, logging, os, sys
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from tierfs.daemon.tree.tree import Tree
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
try:
    tree = Tree.scan(fd, sys.argv[1], unlistable=sys.argv[2])
except ValueError as exc:
    print(json.dumps({"refused": str(exc)}))
else:
    print(json.dumps({"files": tree.n_files, "unlistable": tree.unlistable,
                      "dirs": [[os.fsdecode(p), e] for p, e in tree.unlistable_dirs]}))
"""


#: root without the capabilities that let it read any directory (what an NFS root_squash export makes of it)
_NO_DAC = ("setpriv", "--inh-caps=-dac_override,-dac_read_search", "--bounding-set=-dac_override,-dac_read_search")


def _scan_unprivileged(root, mode: str) -> tuple[dict, str]:
    """A scan of ``root`` without CAP_DAC_OVERRIDE: (what it found, its log)."""
    res = subprocess.run([*_NO_DAC, sys.executable, "-c", _UNPRIVILEGED_SCAN, str(root), mode], capture_output=True,
                         text=True, check=True, timeout=120)
    return json.loads(res.stdout), res.stderr


@pytest.fixture
def closed_classes(tmp_path):
    """A backing with 2 open class dirs, 12 closed ones (nobody's, 0700) and one nobody's we may read but not
    search (0744): its names list, its entries cannot be seen."""
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv (to drop CAP_DAC_OVERRIDE)")
    root = tmp_path / "backing"
    for name, mode in [("open_a", 0o755), ("open_b", 0o755), *((f"shut_{i:02d}", 0o700) for i in range(12)),
                       ("unsearchable", 0o744)]:
        (root / name).mkdir(parents=True)
        for i in range(3):
            (root / name / f"{i}.bin").write_bytes(b"x")
        if not name.startswith("open_"):
            os.chown(root / name, 65534, 65534)
        os.chmod(root / name, mode)
    return root


def test_directories_a_scan_cannot_list_are_said_a_few_by_name_and_counted(closed_classes):
    got, log = _scan_unprivileged(closed_classes, "skip")
    assert got["files"] == 6  # (the two open class dirs)
    assert got["unlistable"] == 13  # (12 closed, and the one whose entries cannot be seen)
    assert len(got["dirs"]) == 10 and all(err == 13 for _, err in got["dirs"])  # (the first 10 by name: EACCES)
    said = [line for line in log.splitlines() if line.startswith("cannot list ")]
    assert len(said) == 10  # (a line each for the first ones ...)
    assert f"cannot list {closed_classes}/shut_00 (EACCES: Permission denied)" in log
    assert "13 directories of the backing dir could not be listed (the first 10 named above)" in log  # (... then one)


def test_unlistable_refuse_makes_the_scan_fail_naming_the_directory(closed_classes):
    got, _ = _scan_unprivileged(closed_classes, "refuse")
    assert got["refused"].startswith(f"cannot list {closed_classes}/shut_00 (EACCES: Permission denied) (and 11 "
                                     "more): unlistable=refuse refuses the mount")


def test_a_backing_whose_root_cannot_be_listed_is_refused_never_an_empty_data_set(tmp_path):
    """(A tier's I/O error -- sshfs reconnecting, an NFS outage -- or a root the daemon may not read) No file seen
    and a directory unlistable: the scan fails naming it, where it made an empty data set before (a mount then
    failed with "nm=4 is more mini-epochs than the data set has files: use at most 0")."""
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv (to drop CAP_DAC_OVERRIDE)")
    root = tmp_path / "backing"
    (root / "class").mkdir(parents=True)
    (root / "class" / "0.bin").write_bytes(b"x")
    os.chown(root, 65534, 65534)
    os.chmod(root, 0o744)  # (its names list, its entries cannot be seen: as a tier that fails every lstat)
    got, _ = _scan_unprivileged(root, "skip")
    assert got["refused"] == f"no file of the backing dir could be seen: cannot list {root} (EACCES: Permission denied)"
