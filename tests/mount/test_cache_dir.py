"""``--cache`` pointed at a directory that is not tierfs's: refused in one line, exit 1, nothing touched (issue 22).

The issue's cases through the command line: a scratch dir with a ``data/`` of the user's results and their own
``journal.json``/``tree.bin``/``index.npz``; a subdirectory in ``data/``; ``data/`` a symlink to another dir.
Also what must keep working: an empty dir is adopted, and a tierfs cache remounts with its copies used.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tierfs.testing.harness import is_mounted, mounted, snapshot

TIERFS = [sys.executable, "-m", "tierfs"]


def mount_refused(backing: Path, mnt: Path, cache: Path, *extra: str) -> str:
    """Mount with ``--cache cache``; assert exit 1 with one line and no mount; returns that line."""
    res = subprocess.run([*TIERFS, "mount", str(backing), str(mnt), "--cache", str(cache), "--capacity", "1M",
                          *extra], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1 and lines[0].startswith("tierfs: error: "), res.stderr
    assert not is_mounted(mnt)
    return lines[0]


def read(path: Path) -> bytes:
    # (in a subprocess with a deadline: a hung mount fails the test instead of hanging it)
    return subprocess.run(["cat", str(path)], capture_output=True, check=True, timeout=30).stdout


@pytest.mark.parametrize("mode", ["foreground", "daemon"])
def test_a_scratch_dir_with_the_users_files_is_refused_and_kept_byte_for_byte(dataset, mount_dirs, tmp_path, mode):
    backing, _ = dataset
    mnt, _ = mount_dirs
    scratch = tmp_path / "scratch"
    (scratch / "data").mkdir(parents=True)
    (scratch / "data" / "results.csv").write_text("epoch,loss\n1,0.52\n2,0.31\n")
    (scratch / "data" / "model.pt").write_bytes(os.urandom(20000))
    (scratch / "journal.json").write_text('{"experiment": 12}')
    (scratch / "tree.bin").write_bytes(os.urandom(300))
    (scratch / "index.npz").write_bytes(os.urandom(300))
    before = snapshot(scratch)
    line = mount_refused(backing, mnt, scratch, "--foreground" if mode == "foreground" else "--daemon")
    assert f"cache dir {scratch} is not empty and not a tierfs cache" in line
    assert "data/model.pt, data/results.csv" in line and "give --cache a new directory" in line
    assert snapshot(scratch) == before


def test_a_subdirectory_in_data_is_refused_with_nothing_deleted(dataset, mount_dirs, tmp_path):
    backing, _ = dataset
    mnt, _ = mount_dirs
    scratch = tmp_path / "scratch"
    (scratch / "data" / "checkpoints").mkdir(parents=True)
    (scratch / "data" / "checkpoints" / "step-100.pt").write_bytes(b"weights")
    (scratch / "data" / "results.csv").write_text("1,2\n")
    before = snapshot(scratch)
    line = mount_refused(backing, mnt, scratch)
    assert "data/checkpoints/ (a directory)" in line and "Is a directory" not in line
    assert snapshot(scratch) == before


def test_data_a_symlink_to_another_dir_is_refused_and_that_dir_intact(dataset, mount_dirs, tmp_path):
    backing, files = dataset
    mnt, cache = mount_dirs
    with mounted(backing, mnt, cache, "1M") as m:  # a real tierfs cache first
        read(m.path(next(iter(files))))
    other = tmp_path / "home-of-the-user"
    other.mkdir()
    (other / "thesis.tex").write_text("years")
    (other / "plots.png").write_bytes(os.urandom(1000))
    for name in os.listdir(cache / "data"):
        os.unlink(cache / "data" / name)
    os.rmdir(cache / "data")
    os.symlink(other, cache / "data")
    theirs, before = snapshot(other), snapshot(cache)
    line = mount_refused(backing, mnt, cache)
    assert f"data (a symlink to {other})" in line and "move those out" in line
    assert snapshot(other) == theirs and snapshot(cache) == before


def test_an_empty_dir_is_adopted_and_a_remount_uses_the_kept_copies(dataset, mount_dirs):
    backing, files = dataset
    mnt, cache = mount_dirs
    cache.mkdir()
    with mounted(backing, mnt, cache, "4M", rf=2) as m:
        for rel in sorted(files):
            assert read(m.path(rel)) == (backing / rel).read_bytes()
        kept = sorted(os.listdir(cache / "data"))
    assert kept and (cache / "CACHEDIR.TAG").is_file()
    with mounted(backing, mnt, cache, "4M", rf=2) as m:
        st = m.status()
        assert st["cache_bytes"] > 0
        copies = set(kept) & set(os.listdir(cache / "data"))
        assert copies  # the copies of the first mount are still there, not restaged under new names
        for rel in sorted(files):
            assert read(m.path(rel)) == (backing / rel).read_bytes()
        assert json.loads((mnt / ".tierfs" / "status").read_bytes())["reads"]["hits"] > 0


def test_a_cache_dir_swapped_for_a_link_while_mounted_gets_its_journal_and_index_at_unmount(dataset, mount_dirs,
                                                                                             tmp_path):
    # (issue 46, 11) Whoever may rename entries of the cache dir's parent moves the dir away and puts a link to
    # her own dir there: the daemon writes through the dir it opened, never the path.
    backing, files = dataset
    mnt, cache = mount_dirs
    hers = tmp_path / "hers"
    hers.mkdir()
    moved = tmp_path / "moved-away"
    with mounted(backing, mnt, cache, "4M", rf=100) as m:
        read(m.path(next(iter(files))))
        os.rename(cache, moved)
        os.symlink(hers, cache)
        subprocess.run(["sh", "-c", f"echo next-pass > '{m.path('.tierfs', 'control')}'"], check=True, timeout=30)
        assert m.status()["pass"] == 1
    assert os.listdir(hers) == []  # the journal, the index, their temp names: none through the link
    assert json.loads((moved / "journal.json").read_bytes())["pass"] == 1
    assert (moved / "index.npz").is_file()


def test_a_cache_dir_under_a_dir_every_user_may_write_is_refused_with_that_dir(dataset, mount_dirs, tmp_path):
    backing, _ = dataset
    mnt, _ = mount_dirs
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # (not sticky: anyone may swap the cache dir for a link)
    line = mount_refused(backing, mnt, shared / "cache", "--daemon")  # (a mount by mistake returns, unmounted after)
    assert f"cache dir {shared}/cache refused: {shared} is writable by every user (mode 0777, not sticky)" in line
    assert os.listdir(shared) == []
