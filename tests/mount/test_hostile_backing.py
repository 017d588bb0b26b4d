"""Issue 22: no backing object can hold a thread forever -- through real mounts.

A FIFO that takes a dataset file's name, a file whose opens hang, a FUSE backing whose daemon dies and comes
back: every read has a deadline (a reader still waiting after it is a hang: the FUSE connection is aborted and
the test fails), and ``mounted``/``passthrough`` unmount whatever is left.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time

import pytest

from sampler.atomic import TEMP_PREFIX
from tierfs.daemon.cache.store import allocated, cache_block, path_hash
from tierfs.testing.harness import abort_connection, make_dataset, mounted, passthrough, wait_until, within


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _status(m) -> dict:
    st = within(m.mountpoint, m.status)
    assert isinstance(st, dict), st
    return st


def test_a_fifo_in_a_later_mini_epoch_never_stops_staging_the_schedule_or_other_readers(tmp_path):
    backing, mnt = tmp_path / "b", tmp_path / "m"
    files = make_dataset(backing, dirs=4, files_per_dir=5, max_size=4096, seed=5)
    mnt.mkdir()
    with mounted(backing, mnt, tmp_path / "c", "4M", nm=4, rf=1) as m:
        wait_until(lambda: _status(m)["next_ready"])
        view = set(within(str(mnt), lambda: _read(m.path(".tierfs", "order")).decode().split()))
        fifo = sorted(set(files) - view)[0]
        os.unlink(backing / fifo)
        os.mkfifo(backing / fifo)
        try:
            named = False
            seen = [(_status(m)["epoch"], _status(m)["mini_epoch"])]
            for _ in range(2 * 4):  # through the FIFO's mini-epoch, into the next epoch
                deadline = time.monotonic() + 30
                while True:
                    st = _status(m)
                    named |= any(u["file"] == fifo and "FIFO" in u["why"] for u in st["staging"].get("unstaged", ())) \
                        and fifo in (st["last_error"] or "")
                    if (st["epoch"], st["mini_epoch"]) != seen[-1]:
                        break
                    assert time.monotonic() < deadline, f"the schedule stopped at {seen[-1]}: {st}"
                    within(str(mnt), lambda: m.control("next-pass\n"))
                    time.sleep(0.05)
                seen.append((st["epoch"], st["mini_epoch"]))
            assert named and st["staging"].get("skipped", 0) >= 1, st["staging"]
            # ~40 reads of the FIFO's name: each fails at once, none holds a thread
            for _ in range(40):
                got = within(str(mnt), lambda: _read(m.path(fifo)), 10)
                assert isinstance(got, OSError) and got.errno == errno.ENOENT, got
            for rel in sorted(set(files) - {fifo}):  # every other file, cached or not, still reads whole
                assert within(str(mnt), lambda rel=rel: _read(m.path(rel))) == _read(backing / rel)
            assert m.process.poll() is None
        finally:
            for _ in range(64):  # (the old code opened it blocking: a writer's open lets such a reader go)
                try:
                    os.close(os.open(backing / fifo, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    break


def test_a_file_whose_opens_hang_holds_a_few_threads_and_every_other_file_is_served(tmp_path):
    """The backing is a FUSE mount whose opens of one file never answer (its server hangs on it): the reads of
    that file fail with EIO after ``backing_timeout`` or at once, and do not use up the backing threads."""
    data, inner, outer, hang = tmp_path / "data", tmp_path / "inner", tmp_path / "outer", tmp_path / "hang"
    files = make_dataset(data, dirs=4, files_per_dir=10, max_size=4096, seed=6)
    inner.mkdir()
    outer.mkdir()
    with passthrough(data, inner, hang=str(hang)) as pt, \
            mounted(inner, outer, tmp_path / "c", "16M", nm=4, rf=1000, backing_timeout=2) as m:
        try:
            wait_until(lambda: _status(m)["next_ready"] and _status(m)["staging"]["inflight"] == 0)
            view = set(within(str(outer), lambda: _read(m.path(".tierfs", "order")).decode().split()))
            cached = {rel for rel in files if within(str(outer), lambda rel=rel: _cached(m.path(rel)))}
            uncached = sorted(set(files) - cached - view)
            stuck, others = uncached[0], uncached[1:]
            hang.write_text(stuck + "\n")
            results: list[object] = []
            readers = [threading.Thread(target=lambda: results.append(_safe_read(m.path(stuck))), daemon=True)
                       for _ in range(40)]
            for th in readers:
                th.start()
            for th in readers:
                th.join(30)
            if any(th.is_alive() for th in readers):
                abort_connection(str(outer))
                pytest.fail("a reader of the hanging file hung past 30 s")
            assert len(results) == 40 and all(isinstance(r, OSError) and r.errno == errno.EIO for r in results)
            assert others
            for rel in others:  # the backing threads are not used up: uncached files still read whole
                assert within(str(outer), lambda rel=rel: _read(m.path(rel))) == _read(data / rel)
            assert m.process.poll() is None
        finally:
            pt.kill()  # its hung opens answer ENOTCONN: tierfs's threads in them can end, and tierfs stop


def _cached(path: str) -> bool:
    try:
        return bool(os.getxattr(path, "user.tierfs.cache_path"))
    except OSError:
        return False


def _safe_read(path: str) -> bytes | OSError:
    try:
        return _read(path)
    except OSError as exc:
        return exc


def test_a_dead_fuse_backing_keeps_cached_files_served_and_is_taken_back_by_itself(tmp_path):
    """The backing is a FUSE mount (sshfs, rclone) whose daemon is SIGKILLed: cached files go on being served,
    with no storm of backing requests, status says ``lost``; once it is mounted again at the same path, tierfs
    takes it back by itself and serves every file, uncached ones too, byte for byte."""
    data, inner, outer = tmp_path / "data", tmp_path / "inner", tmp_path / "outer"
    files = make_dataset(data, dirs=4, files_per_dir=8, max_size=16 << 10, seed=7)
    inner.mkdir()
    outer.mkdir()
    with passthrough(data, inner) as pt, \
            mounted(inner, outer, tmp_path / "c", "16M", nm=4, rf=100000, revalidate=1, backing_timeout=2) as m:
        wait_until(lambda: _status(m)["next_ready"] and _status(m)["staging"]["inflight"] == 0)
        cached = sorted(rel for rel in files if within(str(outer), lambda rel=rel: _cached(m.path(rel))))
        uncached = sorted(set(files) - set(cached))
        assert cached and uncached
        pt.kill()
        before = _status(m)
        # ten revalidate periods: every fingerprint goes stale and every open asks (the old code dropped the copies
        # it could not confirm, and re-stated everything in a loop)
        end = time.monotonic() + 10
        rounds = 0
        while time.monotonic() < end:
            for rel in cached:
                assert within(str(outer), lambda rel=rel: _read(m.path(rel))) == _read(data / rel), rel
            rounds += 1
        got = within(str(outer), lambda: _read(m.path(uncached[0])), 10)
        assert isinstance(got, OSError) and got.errno == errno.EIO, got
        st = _status(m)
        b = st["backing"]
        assert b["state"] == "lost" and "not connected" in b["reason"] and b["lost_since"] is not None, b
        # no re-stat storm: a handful of requests found it gone, everything since was refused without one
        assert b["requests"] - before["backing"]["requests"] < 50, (before["backing"], b)
        assert b["refused"] > 0 and st["reads"]["hits"] - before["reads"]["hits"] >= rounds * len(cached)
        assert st["cache_files"] >= len(cached)  # no copy was dropped
        pt.unmount()  # the empty mountpoint is not the dataset: not taken back
        time.sleep(2)
        assert _status(m)["backing"]["state"] == "lost"
        pt.start()  # the same tree at the same path, a new FUSE connection (a new st_dev)
        wait_until(lambda: _status(m)["backing"]["state"] == "ok", timeout=30, what="the backing taken back")
        for rel in sorted(files):
            assert within(str(outer), lambda rel=rel: _read(m.path(rel))) == _read(data / rel), rel
        assert _status(m)["backing"]["recoveries"] == 1 and m.process.poll() is None


def test_a_file_whose_copy_hangs_is_skipped_and_the_schedule_moves_to_its_mini_epoch(tmp_path):
    """A file of a later mini-epoch whose opens hang in a FUSE backing: when its mini-epoch is next, staging gives
    its copy up after ``backing_timeout`` (the rest of the mini-epoch stages), ``advance`` moves the schedule there
    (``advance=ready``), status names the file and why; its reader gets EIO, the other files read whole; once the
    server answers again the abandoned copy never lands: ``data/`` holds what the cache counts, nothing more."""
    data, inner, outer, hang = tmp_path / "data", tmp_path / "inner", tmp_path / "outer", tmp_path / "hang"
    files = make_dataset(data, dirs=4, files_per_dir=10, max_size=4096, seed=8)
    inner.mkdir()
    outer.mkdir()
    cache = tmp_path / "c"
    with passthrough(data, inner, hang=str(hang)) as pt, \
            mounted(inner, outer, cache, "16M", nm=4, rf=1000, backing_timeout=2) as m:
        try:
            wait_until(lambda: _status(m)["next_ready"] and _status(m)["staging"]["inflight"] == 0)
            view = set(within(str(outer), lambda: _read(m.path(".tierfs", "order")).decode().split()))
            cached = {rel for rel in files if within(str(outer), lambda rel=rel: _cached(m.path(rel)))}
            stuck = sorted(set(files) - view - cached)[0]  # in a mini-epoch after the next one
            hang.write_text(stuck + "\n")
            for _ in range(4):  # advance until the stuck file's mini-epoch is the current one
                st = _status(m)
                at = (st["epoch"], st["mini_epoch"])
                within(str(outer), lambda: m.control("advance\n"))
                wait_until(lambda at=at: (_status(m)["epoch"], _status(m)["mini_epoch"]) != at, timeout=60,
                           what=f"the schedule to move on from {at} (the stuck file's mini-epoch next)")
                view = set(within(str(outer), lambda: _read(m.path(".tierfs", "order")).decode().split()))
                if stuck in view:
                    break
            assert stuck in view
            st = _status(m)["staging"]
            assert st.get("stuck") == 1 and st["skipped"] >= 1, st
            assert any(u["file"] == stuck and "abandoned" in u["why"] for u in st["unstaged"]), st["unstaged"]
            assert stuck in (_status(m)["last_error"] or "")
            for rel in sorted(view - {stuck}):  # the rest of its mini-epoch was staged, and reads whole
                assert within(str(outer), lambda rel=rel: _cached(m.path(rel))), rel
                assert within(str(outer), lambda rel=rel: _read(m.path(rel))) == _read(data / rel), rel
            got = within(str(outer), lambda: _read(m.path(stuck)), 30)
            assert isinstance(got, OSError) and got.errno == errno.EIO, got
            hang.write_text("")  # the server answers again: the abandoned copy completes in its thread
            wait_until(lambda: _status(m)["staging"]["stuck"] == 0, what="the abandoned copy's thread to return")
            # it is staged again (it is current); nothing but what the cache counts is in data/
            wait_until(lambda: within(str(outer), lambda: _cached(m.path(stuck))), what="the file staged again")
            wait_until(lambda: _accounted(m, cache), what="status cache_bytes to equal the disk usage of data/")
            copies = [n for n in os.listdir(cache / "data") if n.startswith(f"{path_hash(stuck.encode()):016x}-")]
            assert copies == [os.path.basename(os.getxattr(m.path(stuck), "user.tierfs.cache_path").decode())]
            assert not [n for n in os.listdir(cache / "data") if n.startswith(TEMP_PREFIX)]
            assert within(str(outer), lambda: _read(m.path(stuck))) == _read(data / stuck)
            assert m.process.poll() is None
        finally:
            hang.write_text("")
            pt.kill()


def _accounted(m, cache) -> bool:
    """Nothing in flight, and ``cache_bytes`` is what the files in the cache's data/ occupy on disk."""
    st = _status(m)
    block = cache_block(str(cache))
    on_disk = 0
    for n in os.listdir(cache / "data"):
        with contextlib.suppress(FileNotFoundError):  # (evicted meanwhile: the next look agrees)
            on_disk += allocated(os.stat(cache / "data" / n, follow_symlinks=False), block)
    return st["staging"]["inflight"] == 0 and st["cache_bytes"] == on_disk
