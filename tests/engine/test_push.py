"""Pushing staged copies into the kernel page cache (``notify_store``), with a fake kernel."""

from __future__ import annotations

import errno
import os
import time
from types import SimpleNamespace

import trio

from tierfs.daemon.coordinator.engine import Engine
from tierfs.daemon.kernel.pusher import KernelCache


class FakeKernel:
    """What ``notify_store`` would leave in the page cache: inode -> bytes; knows only ``known`` inodes."""

    def __init__(self, known: set[int] | None = None) -> None:
        self.pages: dict[int, bytearray] = {}
        self.known = known
        self.invalidated: list[int] = []

    def notify_store(self, inode: int, offset: int, data: bytes) -> None:
        if self.known is not None and inode not in self.known:
            raise OSError(errno.ENOENT, "no such inode")
        buf = self.pages.setdefault(inode, bytearray())
        buf[offset:offset + len(data)] = data

    def invalidate_inode(self, inode: int, attr_only: bool = False) -> None:
        self.invalidated.append(inode)
        self.pages.pop(inode, None)

    def invalidate_entry(self, inode_p: int, name: bytes) -> None:
        raise OSError(errno.ENOENT, "no such entry")  # (no entries here: these tests have no names)


def _attach(e: Engine, kernel: FakeKernel, store=None) -> None:
    calls = kernel if store is None else SimpleNamespace(notify_store=store, invalidate_inode=kernel.invalidate_inode,
                                                            invalidate_entry=kernel.invalidate_entry)
    e.attach_kernel(KernelCache(calls))


async def _settled(e: Engine, t) -> None:
    await t.settle(e)
    for _ in range(400):
        if not e.pusher.queue and not e.pusher.inflight:
            return
        await trio.sleep(0.005)
    raise AssertionError("pusher did not settle")


def _run_with_stager(e: Engine, t, body) -> None:
    async def main():
        async with trio.open_nursery() as n:
            await n.start(e.run)
            await body()
            n.cancel_scope.cancel()

    t.run(main)


def test_staged_current_and_next_are_pushed_with_their_exact_bytes(open_engine, t):
    e = open_engine()
    kernel = FakeKernel()
    _attach(e, kernel)

    async def body():
        await _settled(e, t)
        want = set(e.schedule.current.tolist()) | set(e.schedule.next_files.tolist())
        assert {e.names.file_inode(f) for f in want} == set(kernel.pages)
        for f in want:
            assert bytes(kernel.pages[e.names.file_inode(f)]) == t.backing_bytes(e, f)
        assert e.pusher.pushed_bytes == sum(int(e.tree.sizes[f]) for f in want)
        # a switch pushes nothing twice, and the new next mini-epoch once staged
        before = e.pusher.pushed_bytes
        e.passes.request_advance()
        await _settled(e, t)
        nxt = set(e.schedule.next_files.tolist())
        assert e.pusher.pushed_bytes - before == sum(int(e.tree.sizes[f]) for f in nxt)
        for f in nxt:
            assert bytes(kernel.pages[e.names.file_inode(f)]) == t.backing_bytes(e, f)

    _run_with_stager(e, t, body)


def test_push_stays_within_the_budget(open_engine, t):
    e = open_engine()
    kernel = FakeKernel()
    _attach(e, kernel)
    e.pusher.budget = int(e.tree.sizes[e.schedule.current].sum()) // 2

    async def body():
        await _settled(e, t)
        assert 0 < sum(len(b) for b in kernel.pages.values()) <= e.pusher.budget

    _run_with_stager(e, t, body)


def test_inodes_unknown_to_the_kernel_are_pushed_once_listed(open_engine, t):
    e = open_engine()
    kernel = FakeKernel(known=set())
    _attach(e, kernel)

    async def body():
        await _settled(e, t)
        assert not kernel.pages and e.pusher.unknown  # nothing known yet: nothing stored, nothing read
        d = next(iter(e.pusher.unknown))
        files = set(e.pusher.unknown[d])
        kernel.known = {e.names.file_inode(f) for f in files}
        e.names.listed(d + 1)  # readdirplus of that directory handed the kernel the inodes of the view's files
        await _settled(e, t)
        shown = {f for f in files if e.schedule.view.mask[f]}
        assert shown and {e.names.file_inode(f) for f in shown} == set(kernel.pages)
        for f in shown:
            assert bytes(kernel.pages[e.names.file_inode(f)]) == t.backing_bytes(e, f)
        assert e.pusher.unknown.get(d, set()) == files - shown  # not listed: still waiting

    _run_with_stager(e, t, body)


def test_a_changed_backing_file_is_invalidated_and_pushed_anew(open_engine, t):
    e = open_engine()
    kernel = FakeKernel()
    _attach(e, kernel)

    async def body():
        await _settled(e, t)
        fidx = int(e.schedule.current[0])
        inode = e.names.file_inode(fidx)
        assert bytes(kernel.pages[inode]) == t.backing_bytes(e, fidx)
        path = os.path.join(e.config.backing, os.fsdecode(e.tree.file_path(fidx)))
        old = t.backing_bytes(e, fidx)
        time.sleep(0.01)
        with open(path, "wb") as f:
            f.write(bytes(b ^ 0xFF for b in old))  # same size, other bytes
        assert await t.read_file(e, fidx) == bytes(b ^ 0xFF for b in old)
        assert inode in kernel.invalidated
        await _settled(e, t)
        # never the old bytes: dropped, or pushed again from the new copy
        assert inode not in kernel.pages or bytes(kernel.pages[inode]) == bytes(b ^ 0xFF for b in old)

    _run_with_stager(e, t, body)


def test_a_push_racing_a_backing_change_is_invalidated_after_it_lands(open_engine, t):
    e = open_engine()
    kernel = FakeKernel()
    fidx = -1
    started = None

    def slow_store(inode: int, offset: int, data: bytes) -> None:
        # the backing file changes while this push is on its way; a racing open must wait for it
        if inode == e.names.file_inode(fidx) and data and not started.is_set():
            trio.from_thread.run_sync(started.set)
            time.sleep(0.2)
        kernel.notify_store(inode, offset, data)

    async def body():
        nonlocal fidx, started
        started = trio.Event()
        await t.settle(e)
        fidx = int(e.schedule.current[0])
        path = os.path.join(e.config.backing, os.fsdecode(e.tree.file_path(fidx)))
        old = t.backing_bytes(e, fidx)
        _attach(e, kernel, slow_store)
        e.pusher.reset(e.schedule.staging_order(), None)
        await started.wait()
        with open(path, "wb") as f:
            f.write(bytes(b ^ 0xFF for b in old))
        os.utime(path, ns=(1, 1))
        assert await t.read_file(e, fidx) == bytes(b ^ 0xFF for b in old)
        inode = e.names.file_inode(fidx)
        assert kernel.invalidated and kernel.invalidated[-1] == inode
        await _settled(e, t)
        assert inode not in kernel.pages or bytes(kernel.pages[inode]) == bytes(b ^ 0xFF for b in old)

    _run_with_stager(e, t, body)


def test_a_file_looked_up_is_pushed_once_the_kernel_has_read_the_reply(open_engine, t):
    """The lookup handler tells the pusher before the kernel has read its reply and made the inode: a push that
    races that reply finds no inode, and is tried again shortly instead of waiting for another lookup (a file of
    the next mini-epoch is never listed before its mini-epoch: nothing else would come)."""
    e = open_engine()
    kernel = FakeKernel(known=set())
    _attach(e, kernel)

    async def body():
        await _settled(e, t)
        nxt = [f for f in e.schedule.next_files.tolist() if f not in e.pusher.pushed]
        assert nxt and all(f in e.pusher.unknown.get(int(e.tree.groups[f]), set()) for f in nxt)
        async with trio.open_nursery() as n:
            for f in nxt:
                inode = e.names.file_inode(f)
                parent = int(e.tree.groups[f]) + 1  # (a directory's inode: its node + 1)
                assert e.names.lookup(parent, os.path.basename(e.tree.file_path(f))) == inode

                async def reply_read(inode=inode):  # the kernel reads the reply a little later
                    await trio.sleep(0.1)
                    kernel.known.add(inode)

                n.start_soon(reply_read)
        for _ in range(200):
            if all(e.names.file_inode(f) in kernel.pages for f in nxt):
                break
            await trio.sleep(0.01)
        assert {f for f in nxt if e.names.file_inode(f) not in kernel.pages} == set()
        for f in nxt:
            assert bytes(kernel.pages[e.names.file_inode(f)]) == t.backing_bytes(e, f)

    _run_with_stager(e, t, body)


def test_reads_side_by_side_of_a_pushed_file_whose_copy_was_damaged_read_the_backing_file(open_engine, t):
    # An open of pushed bytes pins the copy without opening it; the reads that reach the daemon later (the kernel
    # let the pages go) open it, and when it was damaged meanwhile, the one repair moves the handle to the backing
    # file -- both reads sent side by side get the backing's bytes, and the release leaves nothing pinned.
    e = open_engine()
    kernel = FakeKernel()
    _attach(e, kernel)

    async def body():
        await _settled(e, t)
        f = next(int(x) for x in e.schedule.current if e.tree.sizes[x] > 1)
        assert e.pusher.holds(f)
        entry = e.cache.get(f)
        handle = await e.data.open_file(f)
        assert handle.fd < 0 and handle.entry is entry and entry.opens == 1  # pinned, not opened
        with open(os.path.join(e.cache.data_path, entry.name), "r+b") as c:
            c.write(b"\0")  # (the copy is no longer the one committed: its mtime moves)
        want = t.backing_bytes(e, f)
        half = len(want) // 2
        got: dict[int, bytes] = {}

        async def read(offset: int) -> None:
            got[offset] = bytes(await e.data.read(handle, offset, len(want)))

        async with trio.open_nursery() as n:
            n.start_soon(read, 0)
            n.start_soon(read, half)
        assert got == {0: want, half: want[half:]}
        assert e.cache.repairs == 1 and handle.entry is None and handle.fd >= 0
        await e.data.release(handle)
        assert entry.opens == 0 and e.data.handles == 0

    _run_with_stager(e, t, body)
