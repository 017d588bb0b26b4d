"""Faults and bad input at the engine (issues 11 and 19), without a mount: the parts called directly."""

from __future__ import annotations

import errno
import logging
import os
import random
import shutil
import string
import subprocess

import pytest
import trio

import tierfs.daemon.schedule.policy
from tierfs.common.options import OPTIONS
from tierfs.daemon.backing.calls import BackingError
from tierfs.daemon.fuse.mount import WholeLineHandler
from tierfs.daemon.staging.stager import StreamTuner
from tierfs.testing.harness import make_dataset


async def _staged(e, t):
    async with trio.open_nursery() as n:
        await n.start(e.run)
        await t.settle(e)
        n.cancel_scope.cancel()


def _path(e, fidx: int) -> str:
    return os.path.join(e.config.backing, os.fsdecode(e.tree.file_path(fidx)))


def test_a_failed_verification_during_an_eviction_leaks_no_capacity(open_engine, t):
    """Issue 11 F: the xxhash check pinned by editing ``opens`` by hand; an eviction racing a failed check left
    its bytes counted as doomed with opens=0 and the file on disk."""
    e = open_engine(verify="xxhash", rf=100)

    async def main():
        await _staged(e, t)
        f = e.schedule.view.order.tolist()[0]
        entry = e.cache.get(f)
        with open(os.path.join(e.cache.data_path, entry.name), "r+b") as fh:
            b = fh.read(1)
            fh.seek(0)
            fh.write(bytes([b[0] ^ 1]))
        async with trio.open_nursery() as n:
            n.start_soon(t.read_file, e, f)  # starts the check (pinned), the eviction comes meanwhile
            await trio.sleep(0)
            e.cache.evict(f)
        assert e.cache.doomed_bytes == 0
        assert e.cache.committed == e.cache.disk_bytes() == sum(x.disk for x in e.cache.entries.values())
        assert not os.path.exists(os.path.join(e.cache.data_path, entry.name))

    t.run(main)


def test_a_vanished_file_or_subdirectory_is_enoent_and_leaves_the_mini_epochs(open_engine, t):
    """(issue 48: a backing reshaped mid-epoch answered EIO for every file of a removed directory, 25,936 times)
    a file gone from its directory, or with its directory, from a live backing root: ENOENT, found gone (out of
    every view and lookup); it is served again by the next mount once it is back."""
    e = open_engine()
    gone = []

    async def main():
        await _staged(e, t)
        outside = [f for f in range(e.tree.n_files) if not e.schedule.wanted[f]]
        a = outside[0]
        b = next(f for f in outside if os.path.dirname(_path(e, f)) != os.path.dirname(_path(e, a)))
        gone.append(b)
        os.unlink(_path(e, a))
        with pytest.raises(BackingError) as exc:
            await e.data.open_file(a)
        assert exc.value.errno == errno.ENOENT  # the file is gone from a directory that is there
        moved = os.path.dirname(_path(e, b)) + ".away"
        os.rename(os.path.dirname(_path(e, b)), moved)
        with pytest.raises(BackingError) as exc:
            await e.data.open_file(b)
        assert exc.value.errno == errno.ENOENT  # its directory is gone from a live root: so is the file
        assert e.tree.gone[[a, b]].all() and e.trees.statistics().gone == 2
        node = e.tree.file_node(b)
        assert e.names.lookup(node.parent + 1, node.name) is None
        os.rename(moved, os.path.dirname(_path(e, b)))

    t.run(main)
    e.close()
    e2 = open_engine()  # (a remount: back in the data set)
    assert not e2.tree.gone.any()
    t.run(lambda: _read_back(e2, t, gone[0]))


async def _read_back(e, t, fidx: int) -> None:
    assert await t.read_file(e, fidx) == t.backing_bytes(e, fidx)


def test_a_rewrite_that_puts_size_and_mtime_back_is_seen_by_ctime(open_engine, t):
    e = open_engine(rf=100)

    async def main():
        await _staged(e, t)
        f = e.schedule.view.order.tolist()[0]
        path = _path(e, f)
        st = os.stat(path)
        old = t.backing_bytes(e, f)
        with open(path, "r+b") as fh:  # same inode, same size
            fh.write(bytes(b ^ 0x55 for b in old))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime put back, as rsync -t or touch -r do
        assert await t.read_file(e, f) == bytes(b ^ 0x55 for b in old)

    t.run(main)


def test_revalidate_seconds_bounds_how_stale_an_open_may_be(open_engine, t):
    e = open_engine(rf=100, revalidate="30")

    async def main():
        await _staged(e, t)
        f = e.schedule.view.order.tolist()[0]
        old = t.backing_bytes(e, f)
        with open(_path(e, f) + ".new", "wb") as fh:
            fh.write(b"the new version")
        os.replace(_path(e, f) + ".new", _path(e, f))
        requests = e.backing.statistics().requests
        assert await t.read_file(e, f) == old  # confirmed moments ago: the copy, whole, and no backing call
        assert e.backing.statistics().requests == requests
        e.reval.confirmed[f] -= 31  # the fingerprint is now older than revalidate
        assert await t.read_file(e, f) == b"the new version"
        assert e.reval.statistics().open_checks == 1 and f in e.versions.changed_files

    t.run(main)


def test_the_revalidator_renews_fingerprints_ahead_of_the_readers(open_engine, t):
    e = open_engine(rf=100, revalidate="0.2")

    async def main():
        async with trio.open_nursery() as n:
            await n.start(e.run)
            await t.settle(e)
            f = e.schedule.view.order.tolist()[-1]
            with open(_path(e, f) + ".new", "wb") as fh:
                fh.write(b"changed behind our back")
            os.replace(_path(e, f) + ".new", _path(e, f))
            with trio.fail_after(10):
                while f not in e.versions.changed_files:  # found by the background re-stat, not by an open
                    await trio.sleep(0.02)
            assert e.reval.statistics().changed >= 1 and e.reval.statistics().open_checks == 0
            n.cancel_scope.cancel()
        assert await t.read_file(e, f) == b"changed behind our back"

    t.run(main)


def test_a_round_renews_what_the_readers_may_reach_not_the_whole_view(open_engine, tmp_path, t, monkeypatch):
    """Under ``view=full`` a round re-stated every unread file of the tree -- a million ``lstat`` every
    ``revalidate / 2`` seconds at a million files, a core of the daemon's and of the backing server's, for files
    nobody was about to open (docs/benchmarks.md, "A million files").  Now it renews those the readers may reach
    before the next round at their rate (at least REVALIDATE_AHEAD_MIN, 100 here); the rest, if opened, get the
    open's own check."""
    monkeypatch.setattr(tierfs.daemon.schedule.policy, "REVALIDATE_AHEAD_MIN", 100)
    backing = tmp_path / "many"
    make_dataset(backing, dirs=4, files_per_dir=300, max_size=64)
    e = open_engine(backing_dir=backing, view="full", revalidate="0.2")
    before = e.reval.confirmed.copy()

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(e.reval.run)
            with trio.fail_after(30):
                while e.reval.checked < 300:  # three rounds of the window
                    await trio.sleep(0.02)
            n.cancel_scope.cancel()

    t.run(main)
    order = e.schedule.unread()
    renewed = e.reval.confirmed > before
    assert len(order) == e.tree.n_files == 1200
    assert not e.cache.cached(e.schedule.next_files).any()  # (no copy of the next mini-epoch to renew besides)
    assert renewed[order[:100]].all()
    assert not renewed[order[100:]].any()


@pytest.mark.slow
def test_fuzzed_control_writes_fail_cleanly_and_change_nothing(open_engine):
    e = open_engine()
    rng = random.Random(11)
    keys = ["rf", "nm", "arf", "arf_k", "bandwidth", "revalidate", "backing_timeout", "staging_streams",
            "mini_epoch_size", "composition", "cache", "policy", "seed", "bogus", "arf_weights", "advance"]
    values = ["-1", "0", "1e999", "nan", "inf", "99999999999999999999", str(10**30), "1e20", "", "\x00", "../..",
              "/etc/passwd", "x" * 300, "1,2", "auto", "hard", "open", "never", "é", "3.5", "-0", "0x10"]
    before = e.control_text()
    live = "\n".join(line for line in before.decode().splitlines() if OPTIONS[line.split("=")[0]].live).encode()
    refused = 0
    for i in range(10_000):
        kind = rng.random()
        if kind < 0.6:
            line = f"{rng.choice(keys)}={rng.choice(values)}"
        elif kind < 0.8:
            line = "".join(rng.choice(string.printable + "\x00\xff") for _ in range(rng.randrange(1, 80)))
        elif kind < 0.9:
            line = "feedback " + f"{rng.choice(['loss', 'val_err', 'x'])}={rng.choice(values)}"
        else:
            line = rng.choice(values) * rng.randrange(1, 4000)
        data = line.encode("utf-8", "surrogateescape") if i % 97 else b"rf=2\n" + b"A" * (1 << 20)
        try:
            e.control_write(data)
        except ValueError:
            refused += 1
            assert e.last_error is not None and len(e.last_error) <= 500
            continue
        e.control_write(live)  # an accepted write: put the settings back for the next one
    assert refused > 5000
    assert e.control_text() == before


@pytest.mark.parametrize("text", ["rf=99999999999999999999", f"nm={10**30}", "bandwidth=1e20", "arf_wait=1e9",
                                  "revalidate=-1", "backing_timeout=0", "staging_streams=65", "seed=-1",
                                  "revalidate=nan", "arf_k=inf"])
def test_absurd_values_are_refused(open_engine, text):
    e = open_engine()
    before = e.control_text()
    with pytest.raises(ValueError):
        e.control_write(text.encode())
    assert e.control_text() == before and text.split("=")[0] in e.last_error


@pytest.mark.slow
@pytest.mark.parametrize("full_of", ["space", "inodes"])
def test_a_staging_error_stays_visible_until_staging_works(open_engine, t, tmp_path, full_of):
    """Any good control write used to clear an ENOSPC last_error; a staging error is the stager's, kept until
    a copy succeeds.  The cache is on a tiny tmpfs, full (of bytes or of inodes): reads are still correct
    (from the backing), the cap holds, and staging resumes by itself once there is room."""
    cache = tmp_path / "tiny"
    cache.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k,nr_inodes=64", "tmpfs", str(cache)], check=True)
    try:
        e = open_engine(cache=cache / "c", capacity=1 << 20, nm=1, rf=100)
        fillers = []
        for i in range(10_000):  # take what is left: one big file, or every inode
            path = cache / f"filler{i}"
            try:
                with open(path, "wb") as f:
                    fillers.append(path)
                    if full_of == "space":
                        f.write(b"\0" * (1 << 20))
            except OSError:
                break

        async def main():
            async with trio.open_nursery() as n:
                await n.start(e.run)
                with trio.fail_after(60):
                    while e.stager.error is None:
                        await trio.sleep(0.02)
                assert "No space" in e.last_error
                e.control_write(b"rf=50\n")
                assert "No space" in e.last_error  # still there: the control write was fine, staging is not
                for f in range(e.tree.n_files):
                    assert await t.read_file(e, f) == t.backing_bytes(e, f)
                assert e.cache.used <= e.cache.capacity
                for path in fillers:
                    os.unlink(path)
                with trio.fail_after(60):  # retried (each failed file after RETRY_AFTER), and now it works
                    while e.stager.error is not None or len(e.cache.entries) < e.tree.n_files \
                            or not e.stager.settled():
                        await trio.sleep(0.05)
                assert e.last_error is None and len(e.cache.entries) == e.tree.n_files
                n.cancel_scope.cancel()

        t.run(main)
        e.close()
    finally:
        subprocess.run(["umount", "-l", str(cache)], check=False)


def test_dir_symlink_swaps_never_lead_outside(open_engine, t, tmp_path):
    e = open_engine(view="full")

    async def main():
        await _staged(e, t)
        outside = [f for f in range(e.tree.n_files) if e.cache.get(f) is None]
        f = outside[0]
        d = os.path.dirname(_path(e, f))
        secret = tmp_path / "secret"
        secret.mkdir()
        (secret / os.path.basename(_path(e, f))).write_bytes(b"secret")
        shutil.move(d, d + ".real")
        os.symlink(secret, d)  # the directory is now a symlink to elsewhere
        with pytest.raises(BackingError) as exc:
            await e.data.open_file(f)
        assert exc.value.errno in (errno.ENOENT, errno.EIO)
        os.unlink(d)
        shutil.move(d + ".real", d)
        assert await t.read_file(e, f) == t.backing_bytes(e, f)

    t.run(main)


def test_the_stream_tuner_climbs_while_it_pays_and_settles_where_it_stops_paying():
    def run(tier) -> int:  # tier(n): the rate n streams get
        tuner = StreamTuner("auto")
        for _ in range(60):
            tuner.observe(tier(tuner.streams))
        return tuner.streams

    assert run(lambda n: 1000.0 * n) == 64  # latency-bound: every doubling pays, up to the limit
    assert run(lambda n: 1000.0 * min(n, 16)) in (16, 32)  # saturates at 16: it stays there (probing above)
    assert run(lambda n: 1000.0 / n) in (1, 2)  # a disk that reads best alone: it comes down
    fixed = StreamTuner(8)
    for _ in range(100):
        fixed.done(1 << 20, queued=100)
    assert fixed.streams == 8
    tuner = StreamTuner("auto")
    start = tuner.streams
    tuner.back_off()
    assert tuner.streams == start // 2 >= 1  # the backing pushed back: half as many


def test_log_lines_are_whole_even_on_a_full_disk(tmp_path):
    d = tmp_path / "logfs"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(d)], check=True)
    try:
        fd = os.open(d / "tierfs.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        handler = WholeLineHandler(fd)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger = logging.getLogger("tierfs-test-log")
        logger.addHandler(handler)
        logger.propagate = False
        for i in range(400):
            logger.warning("line %05d %s", i, "x" * 50)
        os.close(fd)
        text = (d / "tierfs.log").read_text()
        assert text.endswith("\n") and handler.dropped > 0
        assert all(len(line) == len("line 00000 ") + 50 for line in text.splitlines())
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def test_a_file_deleted_before_it_is_staged_never_stops_the_mini_epochs(open_engine, t):
    """Found by the soak: staging a deleted file failed with ENOENT, the next mini-epoch stayed "not ready" for
    good and ``advance=ready`` never switched again.  A file that cannot be staged now no longer holds it up."""
    e = open_engine(rf=1)
    for fidx in e.schedule.next_files.tolist()[:3]:
        os.unlink(_path(e, fidx))

    async def main():
        async with trio.open_nursery() as n:
            await n.start(e.run)
            await t.settle(e)
            assert e.passes.next_ready()
            seen = {e.passes.current_mini_epoch}
            for _ in range(6):
                e.control_write(b"advance\n")
                with trio.fail_after(20):
                    while e.passes.current_mini_epoch in seen:
                        await t.settle(e)
                        e.control_write(b"advance\n")
                        await trio.sleep(0.01)
                seen.add(e.passes.current_mini_epoch)
            n.cancel_scope.cancel()

    t.run(main)
