"""The cache dir is tierfs's own, proven before anything in it is read, rewritten or deleted (issue 22).

Each refusal leaves every file exactly as it was (compared byte for byte, and the listing itself); an empty dir
and a cache made by an older release (no marker, but its lock and only tierfs's names) are adopted; a ``data/``
replaced by a symlink while mounted is never followed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from sampler.atomic import TEMP_PREFIX
from tierfs.cache import MARKER_NAME
from tierfs.testing import snapshot


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
