"""Reads: cache or backing, fingerprint checks, changed / vanished files, an unreachable backing dir."""

from __future__ import annotations

import errno
import os
import shutil
import time

import pytest
import trio

import tierfs.daemon.serving.datapath as datapath_mod
from tierfs.daemon.backing.calls import BackingError


async def _staged(e, t):
    async with trio.open_nursery() as n:
        await n.start(e.run)
        await t.settle(e)
        n.cancel_scope.cancel()


def _replace_in_backing(e, f: int, data: bytes) -> None:
    """Put a new file holding ``data`` in place of ``f``'s backing file (a rename: a new inode)."""
    path = os.path.join(e.config.backing, os.fsdecode(e.tree.file_path(f)))
    with open(path + ".new", "wb") as fh:
        fh.write(data)
    os.replace(path + ".new", path)


def test_hits_misses_and_out_of_view_are_counted(open_engine, t):
    e = open_engine()

    async def main():
        await _staged(e, t)
        cur = e.schedule.view.order.tolist()
        outside = [f for f in range(e.tree.n_files) if not e.schedule.wanted[f]]
        assert await t.read_file(e, cur[0]) == t.backing_bytes(e, cur[0])
        assert (e.data.hits, e.data.misses, e.data.out_of_view) == (1, 0, 0)
        before = e.status().backing_bytes_read
        data = await t.read_file(e, outside[0])
        assert data == t.backing_bytes(e, outside[0])
        assert (e.data.hits, e.data.misses, e.data.out_of_view) == (1, 1, 1)
        assert e.status().backing_bytes_read == before + len(data)
        assert e.cache.get(outside[0]) is None  # a read outside the view does not pollute the cache
        assert e.data.served_bytes == len(data) + len(t.backing_bytes(e, cur[0]))
        assert e.data.opened_bytes == e.data.served_bytes  # each file opened once and read whole

    t.run(main)


def test_current_files_fetched_on_demand_so_each_byte_is_read_once(open_engine, t):
    e = open_engine()  # the stager is not running: every current file is fetched by its reader

    async def main():
        n = await t.read_view(e)
        assert e.data.misses == n and e.data.hits == 0
        assert e.status().backing_bytes_read == e.status().view_bytes or e.schedule.pos.mini_epoch == 0
        assert e.schedule.pos.pass_index == 1
        await t.read_view(e)
        assert e.data.hits == n  # the second pass is all cache

    t.run(main)


def test_changed_backing_file_is_restaged_and_served_new(open_engine, t):
    e = open_engine(rf=100)

    async def main():
        await _staged(e, t)
        f = e.schedule.view.order.tolist()[0]
        path = os.path.join(e.config.backing, os.fsdecode(e.tree.file_path(f)))
        old_name = e.cache.get(f).name
        with open(path, "wb") as fh:
            fh.write(b"new content, new size")
        h = await e.data.open_file(f)
        assert not h.keep_cache  # the kernel must drop its pages of the old content
        assert await e.data.read(h, 0, 1000) == b"new content, new size"
        await e.data.release(h)
        assert e.tree.file_node(f).st.st_size == len(b"new content, new size")
        await _staged(e, t)
        assert e.cache.get(f) is not None and e.cache.get(f).name != old_name
        assert not os.path.exists(os.path.join(e.cache.data_path, old_name))
        assert await t.read_file(e, f) == b"new content, new size"

    t.run(main)


def test_the_kernel_is_told_the_old_size_until_the_old_versions_page_cache_reader_closes(open_engine, t):
    """The kernel cuts page-cache reads at the size it was last told, and asks for attributes whenever it likes
    (an fstat after a read): while a handle of the old version reads through the page cache, a file found
    changed is shown with the old version's attributes (tests/mount/test_faults.py has the kernel's side)."""
    e = open_engine(rf=100)

    async def main():
        await _staged(e, t)
        f = e.schedule.view.order.tolist()[0]
        old = t.backing_bytes(e, f)
        old_st = e.tree.file_node(f).st
        h_old = await e.data.open_file(f)
        assert h_old.keep_cache
        _replace_in_backing(e, f, b"short")
        h_new = await e.data.open_file(f)  # finds the change: direct_io
        assert h_new.direct_io and e.tree.file_node(f).st.st_size == 5
        assert e.versions.kernel_stat(f) == old_st
        assert await e.data.read(h_new, 0, 1000) == b"short"
        await e.data.release(h_new)
        assert e.versions.kernel_stat(f) == old_st  # the old version's reader is still open
        assert await e.data.read(h_old, 0, len(old) + 1) == old
        await e.data.release(h_old)
        assert e.versions.kernel_stat(f).st_size == 5

    t.run(main)


def test_same_size_rewrite_detected_by_mtime_and_inode(open_engine, t):
    e = open_engine(rf=100)

    async def main():
        await _staged(e, t)
        f = e.schedule.view.order.tolist()[0]
        new = bytes(255 - b for b in t.backing_bytes(e, f))
        _replace_in_backing(e, f, new)  # same size, new inode
        assert await t.read_file(e, f) == new

    t.run(main)


def test_vanished_file_is_enoent(open_engine, t):
    e = open_engine()

    async def main():
        await _staged(e, t)
        f = e.schedule.view.order.tolist()[0]
        os.unlink(os.path.join(e.config.backing, os.fsdecode(e.tree.file_path(f))))
        with pytest.raises(BackingError) as exc:
            await e.data.open_file(f)
        assert exc.value.errno == errno.ENOENT
        assert e.cache.get(f) is None

    t.run(main)


def test_unreachable_backing_dir_is_eio_never_empty(open_engine, t, tmp_path):
    e = open_engine()

    async def main():
        await _staged(e, t)
        cached = e.schedule.view.order.tolist()[0]
        uncached = next(f for f in range(e.tree.n_files) if e.cache.get(f) is None)
        h = await e.data.open_file(uncached)
        shutil.rmtree(e.config.backing)  # the backing dir is gone (an unmounted or lost network share)
        for f in (cached, uncached):
            with pytest.raises(BackingError) as exc:
                await e.data.open_file(f)
            assert exc.value.errno == errno.EIO
        await e.data.release(h)

    t.run(main)


def test_backing_read_error_is_eio(open_engine, t, monkeypatch):
    e = open_engine()

    async def main():
        f = next(f for f in range(e.tree.n_files) if not e.schedule.current_mask[f])
        h = await e.data.open_file(f)

        def broken(*_a):
            raise OSError(errno.EIO, "I/O error")

        monkeypatch.setattr(os, "pread", broken)
        with pytest.raises(BackingError) as exc:
            await e.data.read(h, 0, 100)
        assert exc.value.errno == errno.EIO
        monkeypatch.undo()
        await e.data.release(h)

    t.run(main)


def test_verify_xxhash_catches_a_corrupted_copy(open_engine, t):
    e = open_engine(verify="xxhash")

    async def main():
        await _staged(e, t)
        f = e.schedule.view.order.tolist()[0]
        entry = e.cache.get(f)
        assert entry.digest is not None
        path = os.path.join(e.cache.data_path, entry.name)
        with open(path, "r+b") as fh:  # same size, same name: only the content check can tell
            first = fh.read(1)
            fh.seek(0)
            fh.write(bytes([first[0] ^ 0xFF]))
        entry.verified = False
        assert await t.read_file(e, f) == t.backing_bytes(e, f)
        assert "xxhash" in e.last_error
        assert e.cache.get(f) is None or e.cache.get(f) is not entry

    t.run(main)


def test_strict_fetches_on_demand_and_switches_after_exactly_rf(open_engine, t):
    e = open_engine(rf=1, advance="strict")

    async def main():
        await t.read_view(e)  # no stager: the next mini-epoch is not staged, strict switches anyway
        assert (e.schedule.pos.mini_epoch, e.schedule.pos.pass_index) == (1, 0)
        n = await t.read_view(e)
        assert e.data.misses >= n and e.data.stall_seconds > 0
        assert e.schedule.pos.mini_epoch == 2

    t.run(main)


def test_cached_reads_are_whole_whether_or_not_the_copy_is_in_the_page_cache(open_engine, t):
    # Warm bytes are copied on the trio thread (RWF_NOWAIT); the rest comes from a worker thread.  Either way a
    # read returns every byte up to EOF: a short read would look like EOF to the kernel.
    e = open_engine()

    async def main():
        await _staged(e, t)
        fidx = max(e.schedule.view.order.tolist(), key=lambda f: int(e.tree.sizes[f]))
        want = t.backing_bytes(e, fidx)
        for cold in (False, True):
            h = await e.data.open_file(fidx)
            try:
                assert h.entry is not None
                if cold:  # drop the copy's pages (best effort: dirty pages stay until written back)
                    os.fdatasync(h.fd)
                    os.posix_fadvise(h.fd, 0, 0, os.POSIX_FADV_DONTNEED)
                assert bytes(await e.data.read(h, 0, len(want) + 4096)) == want
                assert bytes(await e.data.read(h, 1, 3)) == want[1:4]
                assert await e.data.read(h, len(want), 10) == b""
                assert await e.data.read(h, len(want) + 100, 10) == b""
            finally:
                await e.data.release(h)

    t.run(main)


@pytest.mark.slow
def test_a_lent_copy_outlives_its_eviction_until_the_lease_ends(open_engine, t):
    e = open_engine()

    async def main():
        await _staged(e, t)
        fidx = e.schedule.view.order.tolist()[0]
        path = await e.data.lend(fidx)
        assert path is not None and os.path.exists(path)
        with open(path, "rb") as f:
            assert f.read() == t.backing_bytes(e, fidx)
        assert (e.data.hits, e.data.lent, e.data.misses) == (1, 1, 0)
        committed = e.cache.committed
        disk = e.cache.get(fidx).disk
        e.cache.evict(fidx)  # a mini-epoch switch, say, right after the answer
        assert os.path.exists(path), "unlinked before the reader could open it"
        assert e.cache.committed == committed  # still counted against the capacity
        assert await e.data.lend(fidx) is None  # no longer cached
        e.pins.return_leases(now=time.monotonic() + datapath_mod.LEND_SECONDS + 1)
        assert not os.path.exists(path)
        assert e.cache.committed == committed - disk
        # the keeper task returns leases by itself too
        other = e.schedule.view.order.tolist()[1]
        path = await e.data.lend(other)
        e.cache.evict(other)
        async with trio.open_nursery() as n:
            n.start_soon(e.pins.run)
            with trio.fail_after(datapath_mod.LEND_SECONDS + 5):
                while os.path.exists(path):
                    await trio.sleep(0.05)
            n.cancel_scope.cancel()
        assert e.pins.statistics().leases == 0

    t.run(main)


def test_a_big_lru_miss_is_served_from_the_backing_while_it_is_copied(open_engine, t, tmp_path):
    backing = tmp_path / "big"
    (backing / "c").mkdir(parents=True)
    data = os.urandom(3 << 20)
    (backing / "c" / "big.bin").write_bytes(data)
    e = open_engine(policy="lru", capacity=16 << 20, backing_dir=backing)

    async def main():
        async with trio.open_nursery() as n:
            await n.start(e.run)
            h = await e.data.open_file(0)
            assert h.entry is None  # the reader did not wait for the whole copy: it reads the backing file
            off, got = 0, []
            while chunk := await e.data.read(h, off, 1 << 20):
                got.append(chunk)
                off += len(chunk)
            await e.data.release(h)
            assert b"".join(got) == data
            with trio.fail_after(30):
                while e.cache.get(0) is None:  # ... while the copy was made beside it
                    await trio.sleep(0.01)
            h = await e.data.open_file(0)
            assert h.entry is not None
            assert await e.data.read(h, 0, len(data)) == data
            await e.data.release(h)
            assert (e.data.misses, e.data.hits) == (1, 1)
            n.cancel_scope.cancel()

    t.run(main)
