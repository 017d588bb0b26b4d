"""The cache dir is tierfs's own, proven before anything in it is read, rewritten or deleted (issue 22).

Each refusal leaves every file exactly as it was (compared byte for byte, and the listing itself); an empty dir
and a cache made by an older release (no marker, but its lock and only tierfs's names) are adopted; a ``data/``
replaced by a symlink while mounted is never followed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import trio

from sampler.atomic import TEMP_PREFIX
from tierfs.common.options import MountConfig, Settings
from tierfs.daemon.cache.store import MARKER_NAME
from tierfs.daemon.fuse.mount import MountError, check_paths
from tierfs.testing.harness import snapshot


def users_scratch(cache: Path) -> None:
    """The issue's case: a scratch dir that already has a data/ with results and the user's own journal.json,
    tree.bin and index.npz (names tierfs also uses)."""
    (cache / "data").mkdir(parents=True)
    (cache / "data" / "results.csv").write_text("epoch,loss\n1,0.5\n")
    (cache / "data" / "model.pt").write_bytes(os.urandom(5000))
    (cache / "journal.json").write_text('{"my": "notes"}')
    (cache / "tree.bin").write_bytes(b"\x00my tree" * 10)
    (cache / "index.npz").write_bytes(b"PK my index")


def test_a_scratch_dir_with_a_users_files_is_refused_and_nothing_changes(open_engine, tmp_path):
    cache = tmp_path / "scratch"
    users_scratch(cache)
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"not empty and not a tierfs cache .*data/model\.pt, data/results\.csv"):
        open_engine(cache=cache)
    assert snapshot(cache) == before  # no lock, no marker, no journal written, nothing deleted


def test_a_subdirectory_in_data_is_refused_before_anything_is_deleted(open_engine, tmp_path):
    cache = tmp_path / "scratch"
    (cache / "data" / "runs" / "7").mkdir(parents=True)
    (cache / "data" / "runs" / "7" / "log.txt").write_text("mine")
    (cache / "data" / "notes.txt").write_text("mine too")
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"data/runs/ \(a directory\)"):
        open_engine(cache=cache)
    assert snapshot(cache) == before


def test_a_symlinked_data_dir_is_refused_and_its_target_untouched(open_engine, tmp_path):
    e = open_engine()  # a real tierfs cache, then its data/ replaced by a link to a user's dir
    cache = Path(e.config.cache)
    e.close()
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "thesis.tex").write_text("years of work")
    (other / "0123456789abcdef-0123456789abcdef-1").write_text("named like a copy")
    for name in os.listdir(cache / "data"):
        os.unlink(cache / "data" / name)
    os.rmdir(cache / "data")
    os.symlink(other, cache / "data")
    before, theirs = snapshot(cache), snapshot(other)
    with pytest.raises(ValueError, match=rf"holds what tierfs did not write: data \(a symlink to {other}\)"):
        open_engine()
    assert snapshot(cache) == before and snapshot(other) == theirs


def test_a_stranger_in_a_marked_cache_refuses_the_mount_and_is_kept(open_engine, tmp_path):
    e = open_engine()
    cache = Path(e.config.cache)
    e.close()
    (cache / "data" / "garbage").write_bytes(b"?")
    (cache / f"{TEMP_PREFIX}mine").write_bytes(b"a temp-looking name tierfs never writes")
    (cache / "lockfile-link").symlink_to("/etc/passwd")
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"holds what tierfs did not write: \.tmp-mine, data/garbage, lockfile-link "
                                         r"\(a symlink to /etc/passwd\); .*move those out"):
        open_engine()
    assert snapshot(cache) == before
    os.unlink(cache / "data" / "garbage")
    os.unlink(cache / f"{TEMP_PREFIX}mine")
    os.unlink(cache / "lockfile-link")
    assert open_engine().cache.entries is not None  # moved out: mounts again


def test_another_programs_cache_tag_is_not_tierfs_marker(open_engine, tmp_path):
    cache = tmp_path / "target"
    cache.mkdir()
    (cache / MARKER_NAME).write_text("Signature: 8a477f597d28d172789f06886806bc55\n# made by cargo\n")
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"CACHEDIR\.TAG \(not tierfs's\)"):
        open_engine(cache=cache)
    assert snapshot(cache) == before


def test_an_empty_dir_is_adopted_and_marked(open_engine, tmp_path):
    cache = tmp_path / "empty"
    cache.mkdir(mode=0o755)
    e = open_engine(cache=cache)
    assert (cache / MARKER_NAME).read_text().startswith("Signature: 8a477f597d28d172789f06886806bc55\n")
    assert "tierfs cache" in (cache / MARKER_NAME).read_text()
    assert os.stat(cache).st_mode & 0o777 == 0o700
    e.close()


def _stage(e, t) -> None:
    """Run the engine until its staging has settled."""

    async def stage():
        async with trio.open_nursery() as n:
            await n.start(e.run)
            await t.settle(e)
            n.cancel_scope.cancel()

    t.run(stage)


def test_a_tierfs_cache_remounts_and_keeps_its_copies(open_engine, t):
    e = open_engine(rf=2)

    _stage(e, t)
    cached = {f: en.name for f, en in e.cache.entries.items()}
    assert cached
    e.close()
    e2 = open_engine(rf=2)
    assert {f: en.name for f, en in e2.cache.entries.items()} == cached


def test_an_older_release_cache_without_the_marker_is_adopted_when_every_name_is_tierfs(open_engine, t):
    e = open_engine(rf=2)

    _stage(e, t)
    cached = {f: en.name for f, en in e.cache.entries.items()}
    cache = Path(e.config.cache)
    e.close()
    os.unlink(cache / MARKER_NAME)  # what a release before the marker left: lock, journal, tree, index, data/
    assert "lock" in os.listdir(cache)
    e2 = open_engine(rf=2)
    assert {f: en.name for f, en in e2.cache.entries.items()} == cached
    assert (cache / MARKER_NAME).is_file()


def test_tierfs_names_without_the_lock_or_the_marker_are_the_users(open_engine, tmp_path):
    cache = tmp_path / "looks-like-one"
    (cache / "data").mkdir(parents=True)
    (cache / "journal.json").write_text('{"version": 1, "epoch": 3, "mini_epoch": 0, "pass": 0}')
    (cache / "data" / "0123456789abcdef-0123456789abcdef-1").write_text("mine")
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"no CACHEDIR\.TAG, no lock"):
        open_engine(cache=cache)
    assert snapshot(cache) == before


def test_data_replaced_by_a_symlink_while_mounted_is_never_followed(open_engine, tmp_path, t):
    e = open_engine(rf=2)
    cache = Path(e.config.cache)
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "keep.txt").write_text("mine")

    async def main():
        async with trio.open_nursery() as n:
            await n.start(e.run)
            await t.settle(e)
            assert e.cache.entries
            fidx = next(iter(e.cache.entries))
            # someone swaps data/ for a link to their own dir while the mount serves
            os.rename(cache / "data", tmp_path / "old-data")
            os.symlink(other, cache / "data")
            assert e.cache.data_dir_lost()
            assert await e.data_dir_lost() is not None  # not made again through the link
            # a read is still served (from the backing: the copy's dir is gone from the cache)
            assert await t.read_file(e, fidx) == t.backing_bytes(e, fidx)
            await trio.sleep(0.2)
            n.cancel_scope.cancel()

    t.run(main)
    assert snapshot(other) == {"keep.txt": b"mine"}  # nothing staged into, nor deleted from, the link's target
    assert os.path.islink(cache / "data")


# ------------------------------------------------------- the way to the cache dir (issue 46, 11)
# The daemon (often root) writes its state files into the cache dir.  Once open, every one goes through the dir's
# descriptor: swapping the dir for a symlink redirects nothing.  And a dir that another user could swap is refused.

def _swap_for_a_link(cache: Path, tmp_path: Path) -> tuple[Path, Path]:
    """What a user who may rename entries of the cache dir's parent does: moves the dir away and puts a link to
    her own dir in its place.  Returns (where the real dir is now, her dir)."""
    hers = tmp_path / "hers"
    hers.mkdir()
    moved = tmp_path / "moved-away"
    os.rename(cache, moved)
    os.symlink(hers, cache)
    return moved, hers


def _journalled_pass(cache: Path) -> int | None:
    try:
        return json.loads((cache / "journal.json").read_bytes())["pass"]
    except (OSError, ValueError):
        return None


def test_a_cache_dir_swapped_for_a_link_after_the_mount_opened_it_gets_every_state_file(open_engine, tmp_path, t):
    e = open_engine(rf=2)
    cache = Path(e.config.cache)
    os.unlink(cache / "journal.json")  # (written at open: what is there at the end was written after the swap)
    real, hers = _swap_for_a_link(cache, tmp_path)
    e.control_write(b"next-pass\n")  # a journal write, through the engine's own call

    async def main():  # the background jobs: the journal writer and the saved tree of the first scan
        async with trio.open_nursery() as n:
            await n.start(e.run)
            e.control_write(b"next-pass\n")
            with trio.fail_after(30):  # (wherever they went: the assertions below say where)
                while not any((d / "tree.bin").exists() and _journalled_pass(d) == 2 for d in (real, hers)):
                    await trio.sleep(0.01)
            n.cancel_scope.cancel()

    t.run(main)
    e.close()  # the journal and the index, at unmount
    assert os.listdir(hers) == []  # not a byte, not a temp name, where the link points
    assert {"journal.json", "tree.bin", "index.npz"} <= set(os.listdir(real))
    assert _journalled_pass(real) == 2  # both next-pass: after the swap
    assert os.path.islink(cache)


def test_a_cache_dir_whose_parent_every_user_may_write_is_refused(open_engine, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # (no sticky bit: anyone may rename the cache dir away and put a link there)
    with pytest.raises(ValueError, match=rf"cache dir {shared}/cache refused: {shared} is writable by every user "
                                         r"\(mode 0777, not sticky\).*chmod g-w,o-w or \+t"):
        open_engine(cache=shared / "cache")
    assert os.listdir(shared) == []  # refused before anything was made
    with pytest.raises(ValueError, match=rf"{shared} is writable by every user"):
        open_engine(cache=shared / "deeper" / "cache")  # (any directory on the way: checked from / down)
    os.chmod(shared, 0o1777)  # sticky, as /tmp: a user renames only her own entries
    assert open_engine(cache=shared / "cache").cache.dir_fd >= 0


def test_mount_refuses_a_cache_dir_whose_parent_every_user_may_write(tmp_path):
    (tmp_path / "backing").mkdir()
    (tmp_path / "mnt").mkdir()
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, shared / "link")  # (a link in a dir anyone may write: she may point it elsewhere)
    for cache in (shared / "cache", shared / "link" / "cache"):
        cfg = MountConfig(backing=str(tmp_path / "backing"), mountpoint=str(tmp_path / "mnt"), cache=str(cache),
                          capacity=1 << 20, settings=Settings())
        with pytest.raises(MountError, match=rf"{shared} is writable by every user"):
            check_paths(cfg)
    assert os.listdir(real) == [] and sorted(os.listdir(shared)) == ["link"]


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory to another user")
def test_a_cache_dir_another_user_could_swap_is_refused(open_engine, tmp_path):
    nobody = 65534
    theirs = tmp_path / "theirs"  # a dir of another user's on the way
    theirs.mkdir()
    os.chown(theirs, nobody, nobody)
    with pytest.raises(ValueError, match=rf"{theirs} belongs to .*uid {nobody}"):
        open_engine(cache=theirs / "cache")
    group = tmp_path / "project"  # writable by a group that is not the daemon user's own
    group.mkdir()
    os.chown(group, 0, nobody)
    os.chmod(group, 0o775)
    with pytest.raises(ValueError, match=rf"{group} is writable by group .*gid {nobody}"):
        open_engine(cache=group / "cache")
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    os.symlink(real, link)
    os.lchown(link, nobody, nobody)  # a link on the way that another user may point elsewhere
    with pytest.raises(ValueError, match=rf"the symlink {link} on the way belongs to"):
        open_engine(cache=link / "cache")
    assert os.listdir(theirs) == [] and os.listdir(group) == [] and os.listdir(real) == []
    os.lchown(link, 0, 0)  # root's own link: followed, and the dir it leads to is checked
    assert open_engine(cache=link / "cache").cache.dir_fd >= 0
    assert "cache" in os.listdir(real)
