"""The namespace through TierOperations called directly: resolution, listings, /.tierfs, read-only."""

from __future__ import annotations

import errno
import json
import os
import stat
import tracemalloc
from types import SimpleNamespace

import pyfuse3
import pytest

from tierfs.daemon.fuse import operations as fs
from tierfs.daemon.fuse.operations import TierOperations
from tierfs.daemon.tree.tree import CONTROL_INODES
from tierfs.testing.harness import make_dataset

CTX = pyfuse3.RequestContext()  # a request by root (uid 0): who may see and steer everything


async def _walk(ops: TierOperations, inode: int, prefix: str = "") -> dict[str, int]:
    """Every path listed below ``inode`` (one opendir per directory), mapped to its inode."""
    out = {}
    fh = await ops.opendir(inode, CTX)
    for name, child in ops._dirs[fh][1]:
        path = prefix + os.fsdecode(name)
        out[path] = child
        attr = await ops.getattr(child, CTX)
        if stat.S_ISDIR(attr.st_mode):
            out.update(await _walk(ops, child, path + "/"))
    await ops.releasedir(fh)
    return out


async def _resolve(ops: TierOperations, path: str) -> pyfuse3.EntryAttributes:
    inode = pyfuse3.ROOT_INODE
    attr = None
    for part in path.split("/"):
        attr = await ops.lookup(inode, os.fsencode(part), CTX)
        inode = attr.st_ino
    assert attr is not None
    return attr


async def _read(ops: TierOperations, inode: int, flags: int = os.O_RDONLY) -> bytes:
    fi = await ops.open(inode, flags, CTX)
    try:
        out, off = [], 0
        while data := await ops.read(fi.fh, off, 1 << 16):
            out.append(data)
            off += len(data)
        return b"".join(out)
    finally:
        await ops.release(fi.fh)


def test_every_backing_path_resolves_and_reads(open_engine, dataset, t):
    backing, files = dataset
    e = open_engine()
    ops = TierOperations(e)

    async def main():
        for rel, size in files.items():
            attr = await _resolve(ops, rel)
            assert attr.st_size == size
            assert await _read(ops, attr.st_ino) == (backing / rel).read_bytes()
        # a name that is not there is a negative entry the kernel keeps (ENOENT to the caller, no more lookups)
        class_dir = (await _resolve(ops, sorted(files)[0].split("/")[0])).st_ino
        for parent, name in ((pyfuse3.ROOT_INODE, b"nope"), (class_dir, b".tierfs"),
                             (CONTROL_INODES[b".tierfs"], b"nope")):
            neg = await ops.lookup(parent, name, CTX)
            assert neg.st_ino == 0 and neg.entry_timeout >= 60

    t.run(main)
    assert e.data.out_of_view == len(files) - len(e.schedule.view.files) or e.data.out_of_view > 0


def test_root_lists_view_and_every_data_dir(open_engine, dataset, t):
    _, files = dataset
    e = open_engine()
    ops = TierOperations(e)

    async def main():
        listed = await _walk(ops, pyfuse3.ROOT_INODE)
        dirs = sorted({rel.split("/")[0] for rel in files})
        assert [p for p in listed if "/" not in p] == dirs  # dirs by name, .tierfs never listed
        shown = [p for p in listed if "/" in p]
        view = {os.fsdecode(e.tree.file_path(f)) for f in e.schedule.view.files.tolist()}
        assert set(shown) == view and len(shown) == len(view)
        # each directory lists its files in serving order
        order = [os.fsdecode(p) for p in e.names.order_text().splitlines()]
        for d in dirs:
            assert [p for p in shown if p.startswith(d + "/")] == [p for p in order if p.startswith(d + "/")]

    t.run(main)


def test_listing_is_a_frozen_snapshot_and_order_reshuffles_each_pass(open_engine, t):
    e = open_engine(capacity=1 << 20, nm=1, rf=100)
    ops = TierOperations(e)

    async def main():
        fh = await ops.opendir(pyfuse3.ROOT_INODE, CTX)
        before = list(ops._dirs[fh][1])
        orders = [e.names.order_text()]
        for _ in range(3):
            await t.read_view(e)  # every view file read: the pass ends
            orders.append(e.names.order_text())
        assert list(ops._dirs[fh][1]) == before  # the open listing did not move
        await ops.releasedir(fh)
        assert len(set(orders)) == len(orders)  # a fresh serving order every pass
        assert all(sorted(o.splitlines()) == sorted(orders[0].splitlines()) for o in orders)

    t.run(main)


def test_control_dir_hidden_but_resolvable(open_engine, t):
    e = open_engine()
    ops = TierOperations(e)

    async def main():
        names = [n for n, _ in e.names.list_dir(pyfuse3.ROOT_INODE)]
        assert b".tierfs" not in names
        d = await ops.lookup(pyfuse3.ROOT_INODE, b".tierfs", CTX)
        assert stat.S_ISDIR(d.st_mode)
        listed = sorted(await _walk(ops, d.st_ino))
        assert listed == ["control", "metrics", "order", "order0", "plan", "status"]
        for name in ("control", "status", "order", "order0", "metrics"):
            a = await ops.lookup(d.st_ino, name.encode(), CTX)
            assert a.st_ino == CONTROL_INODES[name.encode()]
            assert a.attr_timeout >= 60  # constant attributes: the kernel keeps them (the content is per open)
        status = json.loads(await _read(ops, CONTROL_INODES[b"status"]))
        assert status["view_files"] == len(e.schedule.view.files)
        assert (await _read(ops, CONTROL_INODES[b"order"])) == e.names.order_text()
        assert b"rf=2" in await _read(ops, CONTROL_INODES[b"control"])

    t.run(main)


def test_every_mutating_call_is_erofs_and_backing_untouched(open_engine, dataset, t):
    backing, files = dataset
    before = {rel: (backing / rel).stat() for rel in files}
    e = open_engine()
    ops = TierOperations(e)

    async def main():
        f = await _resolve(ops, next(iter(files)))
        d = await _resolve(ops, next(iter(files)).split("/")[0])
        calls = [
            lambda: ops.create(d.st_ino, b"new", 0o644, os.O_WRONLY, CTX),
            lambda: ops.mkdir(d.st_ino, b"sub", 0o755, CTX),
            lambda: ops.mknod(d.st_ino, b"node", stat.S_IFREG | 0o644, 0, CTX),
            lambda: ops.unlink(d.st_ino, b"file_00000.bin", CTX),
            lambda: ops.rmdir(pyfuse3.ROOT_INODE, b"class_000", CTX),
            lambda: ops.rename(d.st_ino, b"a", d.st_ino, b"b", 0, CTX),
            lambda: ops.symlink(d.st_ino, b"l", b"target", CTX),
            lambda: ops.link(f.st_ino, d.st_ino, b"hard", CTX),
            lambda: ops.setxattr(f.st_ino, b"user.x", b"1", CTX),
            lambda: ops.removexattr(f.st_ino, b"user.x", CTX),
            lambda: ops.open(f.st_ino, os.O_WRONLY, CTX),
            lambda: ops.open(f.st_ino, os.O_RDWR, CTX),
            lambda: ops.open(f.st_ino, os.O_RDONLY | os.O_TRUNC, CTX),
        ]
        names = ("update_mode", "update_size", "update_mtime", "update_atime", "update_uid", "update_gid")
        attr = await ops.getattr(f.st_ino, CTX)
        for field in names:
            sf = SimpleNamespace(**{n: n == field for n in names})
            calls.append(lambda sf=sf: ops.setattr(f.st_ino, attr, sf, None, CTX))
        for call in calls:
            with pytest.raises(pyfuse3.FUSEError) as exc:
                await call()
            assert exc.value.errno == errno.EROFS, call
        with pytest.raises(pyfuse3.FUSEError) as exc:
            await ops.access(f.st_ino, os.W_OK, CTX)
        assert exc.value.errno == errno.EROFS
        assert await ops.access(f.st_ino, os.R_OK, CTX)
        assert await ops.access(CONTROL_INODES[b"control"], os.W_OK, CTX)
        # status, order and metrics cannot be opened for writing either
        with pytest.raises(pyfuse3.FUSEError):
            await ops.open(CONTROL_INODES[b"status"], os.O_WRONLY, CTX)

    t.run(main)
    after = {rel: (backing / rel).stat() for rel in files}
    assert {k: (v.st_size, v.st_mtime_ns, v.st_mode) for k, v in before.items()} == {
        k: (v.st_size, v.st_mtime_ns, v.st_mode) for k, v in after.items()}
    assert sorted(p.name for p in backing.iterdir()) == sorted({r.split("/")[0] for r in files})


def test_attributes_are_read_only_copies(open_engine, dataset, t):
    backing, files = dataset
    e = open_engine()
    ops = TierOperations(e)

    async def main():
        rel = next(iter(files))
        a = await _resolve(ops, rel)
        st = (backing / rel).stat()
        assert a.st_size == st.st_size and a.st_mtime_ns == st.st_mtime_ns
        # the backing file's own modes and blocks (a read-only dataset to every tool: issue 14; writes get EROFS)
        assert a.st_mode == st.st_mode and a.st_blocks == st.st_blocks

    t.run(main)


def test_symlinks_shown_with_their_own_text(tmp_path, open_engine, t):
    backing = tmp_path / "links"
    (backing / "cls").mkdir(parents=True)
    (backing / "cls" / "a.bin").write_bytes(b"a" * 100)
    (tmp_path / "outside").write_bytes(b"secret")
    os.symlink(tmp_path / "outside", backing / "cls" / "escape")
    os.symlink("a.bin", backing / "cls" / "rel")
    os.symlink(tmp_path, backing / "dirlink")
    e = open_engine(capacity=1 << 20, backing_dir=backing, nm=1)
    ops = TierOperations(e)

    async def main():
        for name, text in ((b"cls/escape", os.fsencode(tmp_path / "outside")), (b"cls/rel", b"a.bin"),
                           (b"dirlink", os.fsencode(tmp_path))):
            a = await _resolve(ops, os.fsdecode(name))
            assert stat.S_ISLNK(a.st_mode)
            assert await ops.readlink(a.st_ino, CTX) == text
            with pytest.raises(pyfuse3.FUSEError):
                await ops.open(a.st_ino, os.O_RDONLY, CTX)  # the kernel follows links itself, never we
        listed = await _walk(ops, pyfuse3.ROOT_INODE)
        assert {"cls", "dirlink", "cls/escape", "cls/rel", "cls/a.bin"} <= set(listed)
        assert "dirlink/outside" not in listed

    t.run(main)
    assert e.tree.n_files == 1  # nothing was taken from beyond a link


def test_a_bug_is_eio_not_a_dead_mount(open_engine, t, monkeypatch):
    e = open_engine()
    ops = TierOperations(e)

    async def boom(_fidx):
        raise RuntimeError("a bug")

    monkeypatch.setattr(e.data, "open_file", boom)

    async def main():
        f = e.schedule.view.order.tolist()[0]
        with pytest.raises(pyfuse3.FUSEError) as exc:
            await ops.open(e.names.file_inode(f), os.O_RDONLY, CTX)
        assert exc.value.errno == errno.EIO

    t.run(main)


_SENT = ("st_ino", "st_mode", "st_nlink", "st_uid", "st_gid", "st_rdev", "st_size", "st_blocks", "st_blksize",
         "st_atime_ns", "st_mtime_ns", "st_ctime_ns", "attr_timeout")


@pytest.mark.parametrize("settings", [{"view": "full"}, {}, {"substitute": True, "listing": "all"}],
                         ids=["full", "mini-epoch", "substitute"])
def test_readdir_sends_each_entry_as_getattr_answers_it(open_engine, tmp_path, t, monkeypatch, settings):
    """readdirplus builds its entries from the tree's arrays a chunk at a time (a find of a million files), not
    through getattr: the same attributes, in every directory of mixed entries, however the kernel's buffer
    splits the listing."""
    backing = tmp_path / "mixed"
    make_dataset(backing, dirs=3, files_per_dir=300, max_size=600, seed=5)  # (more entries than a chunk)
    d = backing / "class_000"
    os.chmod(sorted(d.iterdir())[7], 0o600)  # (one file unlike the others in its chunk)
    os.link(sorted(d.iterdir())[3], backing / "class_001" / "second_name.bin")
    os.symlink("file_00000.bin", d / "sym")
    os.mkfifo(d / "fifo")
    (d / "sub").mkdir()
    e = open_engine(backing_dir=backing, **settings)
    ops = TierOperations(e)
    sent: list[tuple[bytes, int, dict[str, int]]] = []
    room = [0]

    def reply(token: object, name: bytes, attr: pyfuse3.EntryAttributes, off: int) -> bool:
        # the kernel's buffer: takes ``room`` entries, copying each as readdir_reply does
        if room[0] == 0:
            return False
        room[0] -= 1
        sent.append((name, off, {f: getattr(attr, f) for f in (*_SENT, "entry_timeout")}))
        return True

    monkeypatch.setattr(pyfuse3, "readdir_reply", reply)

    async def main() -> None:
        dirs = [pyfuse3.ROOT_INODE, *[i for _, i in e.names.list_dir(pyfuse3.ROOT_INODE)]]
        for dir_inode, buffer in zip(dirs, (1000, 97, 256, 5, 1000), strict=False):
            fh = await ops.opendir(dir_inode, CTX)
            expected = list(ops._dirs[fh][1])
            sent.clear()
            while True:  # the kernel asks again from the last offset it got, until an empty reply
                before, room[0] = len(sent), buffer
                await ops.readdir(fh, sent[-1][1] if sent else 0, None)  # type: ignore[arg-type]
                if len(sent) == before:
                    break
            await ops.releasedir(fh)
            assert [(name, a["st_ino"]) for name, _, a in sent] == expected
            assert [off for _, off, _ in sent] == list(range(1, len(expected) + 1))
            for name, _, a in sent:
                want = await ops.getattr(a["st_ino"], CTX)
                assert a == {**{f: getattr(want, f) for f in _SENT}, "entry_timeout": a["entry_timeout"]}, name
                regular = stat.S_ISREG(want.st_mode)
                assert a["entry_timeout"] == (0 if regular and "substitute" in settings else fs.ATTR_TIMEOUT)
                if "substitute" not in settings:  # (there a lookup draws a view file)
                    assert (await ops.lookup(dir_inode, name, CTX)).st_ino == a["st_ino"]
            kinds = {stat.S_IFMT(a["st_mode"]) for _, _, a in sent}
            assert dir_inode != dirs[1] or kinds >= {stat.S_IFREG, stat.S_IFLNK, stat.S_IFIFO, stat.S_IFDIR}

    t.run(main)


def test_an_open_listing_holds_no_python_object_per_entry(open_engine, tmp_path):
    """A listing is a snapshot kept until ``releasedir``: of a directory of 20,000 files, a few arrays -- not a
    list of (name, inode) tuples (~130 bytes an entry), which a find of a million files made and dropped for
    each of its directories."""
    backing = tmp_path / "flat"
    make_dataset(backing, dirs=1, files_per_dir=20_000, max_size=1, seed=2)
    e = open_engine(backing_dir=backing, view="full")
    flat = next(i for _, i in e.names.list_dir(pyfuse3.ROOT_INODE))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        listing = e.names.list_dir(flat)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(listing) == 20_000
    assert held / 20_000 <= 24, f"{held / 20_000:.0f} bytes an entry"


def test_the_kernel_keeps_a_listing_only_while_every_handle_that_fills_it_lists_the_same_order(tmp_path):
    """KernelListings' answers (cache, keep) per opendir: the same view keeps the kernel's copy; another view
    drops it when no handle of the old one is open, and is not cached while one is (one cache, two orders)."""
    import numpy as np

    from tierfs.daemon.serving.namespace import KernelListings, Listing
    from tierfs.testing.harness import synthetic_tree

    tree = synthetic_tree(tmp_path, dirs=3, per_dir=2, size=1)
    d1, d2 = (int(i) + 1 for i in tree.children(0)[:2])  # two directories' inodes
    lists = KernelListings(tree)

    def listing(key: int | None) -> Listing:
        return Listing(np.zeros(0, np.int64), names=[], key=key)

    a, b, never = listing(7), listing(8), listing(None)
    assert lists.opened(d1, a) == (False, False)  # (stock pyfuse3: nothing asked of the kernel)
    lists.available = True
    assert lists.opened(d1, never) == (False, False)  # the root, /.tierfs, a view=mini-epoch directory
    assert lists.opened(d1, a) == (True, False)  # the first of its view: filled afresh
    assert lists.opened(d1, a) == (True, True)  # the same view: what the kernel holds is kept
    assert lists.opened(d2, b) == (True, False)  # (per directory)
    assert lists.opened(d1, b) == (False, True)  # two of view 7 still open: not cached, nothing dropped
    lists.released(d1, b, False)
    lists.released(d1, a, True)
    assert lists.opened(d1, b) == (False, True)  # one of view 7 still open
    lists.released(d1, a, True)
    assert lists.opened(d1, b) == (True, False)  # none open: view 8 fills it afresh
    assert lists.opened(d1, a) == (False, True)
    st = lists.statistics()
    assert (st.kernel_cache, st.opened, st.kept, st.readdirs) == (True, 9, 1, 0)
