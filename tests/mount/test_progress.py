"""Progress where a person waits: a first mount's scan on the terminal, for a foreground and a --daemon mount
(captured in a pty, as a person sees it), and nothing extra without a terminal."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tierfs.testing.harness import abort_connection, force_unmount, in_pty, is_mounted, make_dataset, wait_until

SCAN = re.compile(rb"tierfs: scanning: (?: *\d+% \d+/)?(\d+)[ ,]")
TIERFS = [sys.executable, "-m", "tierfs"]


@pytest.fixture
def tree(tmp_path):
    """1 + 3 dirs + 600 files: the scan's entries.  Yields (backing, mountpoint, cache, entries)."""
    backing = tmp_path / "backing"
    files = make_dataset(backing, dirs=3, files_per_dir=200, max_size=512, seed=5)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    yield backing, mnt, tmp_path / "cache", 1 + 3 + len(files)
    if is_mounted(mnt):
        subprocess.run([*TIERFS, "umount", str(mnt)], capture_output=True, timeout=60)
    if is_mounted(mnt):
        abort_connection(mnt)
    force_unmount(mnt)


def _mount_args(backing, mnt, cache) -> list[str]:
    return [*TIERFS, "mount", str(backing), str(mnt), "--cache", str(cache), "--capacity", "1M"]


def _ends_on_the_total(out: bytes, entries: int) -> None:
    counts = [int(n) for n in SCAN.findall(out)]
    assert counts and counts[-1] == entries, out  # the bar ends on the scan's total
    # the files and bytes found, the time and the rate (a fraction and the time left when the total is known)
    assert re.search(rb", \d+ files, [\d.]+[KMGT]? \[[\d:]+( left)?, [\d.]+[kMGT]?/s\]", out), out


def test_a_foreground_mounts_scan_shows_progress_until_it_answers(tree):
    backing, mnt, cache, entries = tree
    with in_pty(_mount_args(backing, mnt, cache)) as run:
        out = run.read(until=b"mounted ")  # the log line once the mount answers
        assert is_mounted(mnt)
        _ends_on_the_total(out, entries)
        bar_end = out.rindex(b"/s]")
        assert b"\n" in out[bar_end:out.index(b"mounted ")]  # the bar was ended before the log went on


def test_a_daemon_mounts_scan_shows_progress_on_the_terminal_it_was_started_from(tree):
    backing, mnt, cache, entries = tree
    with in_pty([*_mount_args(backing, mnt, cache), "--daemon"]) as run:
        out = run.read()  # to the end: the parent returns once the mount answers
        assert run.process.wait(timeout=60) == 0, out
        assert is_mounted(mnt)
        _ends_on_the_total(out, entries)
        assert b"error" not in out and out.rstrip().endswith(b"/s]"), out  # the bar, then nothing


def test_without_a_terminal_a_daemon_mount_prints_nothing(tree):
    backing, mnt, cache, _ = tree
    res = subprocess.run([*_mount_args(backing, mnt, cache), "--daemon"], capture_output=True, text=True,
                         timeout=60, stdin=subprocess.DEVNULL)
    assert res.returncode == 0 and res.stdout == "" and res.stderr == "", res.stderr
    subprocess.run([*TIERFS, "umount", str(mnt)], capture_output=True, timeout=60)
    wait_until(lambda: not is_mounted(mnt), what="the unmount")
