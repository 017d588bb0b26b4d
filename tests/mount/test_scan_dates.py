"""A backing holding a file dated past 2262-04-11 (above 2**63 ns: ext4, xfs bigtime and btrfs store such dates --
archives, bad clocks, ``touch -d``) at mount time (issue 48, item 1): the scan refused the mount with
``OverflowError: Python int too large to convert to C long``; now it keeps the nearest date an int64 holds and the
mount serves the file."""

from __future__ import annotations

import os
import subprocess

from tierfs.testing.harness import make_dataset, mounted, read_bytes, within

FAR = 10413792000 * 10**9  # 2300-01-01T00:00:00Z in ns


def test_a_mount_over_a_file_dated_2300_serves_it(tmp_path, mount_dirs):
    backing = tmp_path / "backing"
    make_dataset(backing, dirs=2, files_per_dir=3, max_size=4096, seed=5)
    far = backing / "class_000" / "far.bin"
    far.write_bytes(b"from the far future\n")
    os.utime(far, ns=(FAR, FAR))
    assert far.stat().st_mtime_ns == FAR  # (the backing's filesystem keeps it: ext4 with 256-byte inodes, xfs...)
    mnt, cache = mount_dirs
    with mounted(backing, mnt, cache, "1M", view="full") as m:
        assert m.status()["dataset_files"] == 7
        assert within(str(mnt), lambda: read_bytes(m.path("class_000", "far.bin"))) == b"from the far future\n"
        seen = within(str(mnt), lambda: os.stat(m.path("class_000", "far.bin")))
        assert seen.st_mtime_ns == 2**63 - 1  # (the latest an int64 of ns holds: 2262-04-11)
        assert subprocess.run(["cat", m.path("class_000", "far.bin")], capture_output=True, timeout=30).stdout == \
            b"from the far future\n"
