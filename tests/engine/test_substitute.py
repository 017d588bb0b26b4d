"""substitute: a file name resolves, for the pass, to a view file of its directory, drawn without replacement."""

from __future__ import annotations

import os
import random

import pyfuse3

from tierfs.daemon.fuse.operations import TierOperations
from tierfs.daemon.serving.substitutions import SubstitutionStatistics

CTX = pyfuse3.RequestContext()  # (root: steers the schedule)


async def _lookup(ops: TierOperations, rel: str) -> pyfuse3.EntryAttributes:
    d, name = rel.split("/")
    parent = await ops.lookup(pyfuse3.ROOT_INODE, d.encode(), CTX)
    return await ops.lookup(parent.st_ino, name.encode(), CTX)


async def _open_read(ops: TierOperations, inode: int) -> bytes:
    fi = await ops.open(inode, os.O_RDONLY, CTX)
    try:
        return await ops.read(fi.fh, 0, 1 << 20)
    finally:
        await ops.release(fi.fh)


def test_names_resolve_to_view_files_of_their_directory_once_each_per_pass(open_engine, dataset, t):
    backing, files = dataset
    e = open_engine(substitute=True, listing="all", rf=1, advance="strict")
    ops = TierOperations(e)
    tree = e.tree

    def file_of(inode: int) -> str:
        return os.fsdecode(tree.file_path(e.names.file_index(inode)))

    async def main():
        names = sorted(files)  # what a dataset built once holds (listing=all lists every file)
        view = e.schedule.view
        per_dir = {}
        for f in view.files.tolist():
            per_dir.setdefault(os.fsdecode(tree.file_path(f)).split("/")[0], set()).add(os.fsdecode(tree.file_path(f)))
        served: dict[str, list[str]] = {}
        for rel in names:
            d = rel.split("/")[0]
            if len(served.get(d, [])) >= len(per_dir.get(d, ())):
                continue  # (one pass-worth per directory here)
            a = await _lookup(ops, rel)
            assert a.entry_timeout == 0 and a.attr_timeout > 0  # the entry is asked again; the attributes hold
            got = file_of(a.st_ino)
            assert got.split("/")[0] == d and got in per_dir[d]  # a view file of the same directory
            assert (await _lookup(ops, rel)).st_ino == a.st_ino  # the same name, the same file, this pass
            assert a.st_size == files[got]
            assert await _open_read(ops, a.st_ino) == (backing / got).read_bytes()
            served.setdefault(d, []).append(got)
        # drawn without replacement: every view file served once, and that ended the pass
        assert {d: sorted(v) for d, v in served.items()} == {d: sorted(v) for d, v in per_dir.items()}
        assert e.schedule.pos.passes_total == 1 and e.data.out_of_view == 0
        st = e.status()
        assert st.substitution.substituted > 0 and "tierfs_substituted_lookups_total" in st.to_prometheus()
        # a new pass (a new mini-epoch here): the names are drawn again, from the new view
        a = await _lookup(ops, names[0])
        f = e.names.file_index(a.st_ino)
        assert e.schedule.view.mask[f] or not len(e.schedule.view.files_in(int(tree.groups[f])))

    t.run(main)


def test_without_substitute_names_are_their_own_files(open_engine, dataset, t):
    _, files = dataset
    e = open_engine()
    ops = TierOperations(e)

    async def main():
        for rel in sorted(files)[:8]:
            a = await _lookup(ops, rel)
            assert os.fsdecode(e.tree.file_path(e.names.file_index(a.st_ino))) == rel
            assert a.entry_timeout > 0
        assert e.status().substitution == SubstitutionStatistics()  # (off: all zero)

    t.run(main)


def test_entries_served_two_passes_ago_are_stale_when_a_pass_begins_and_all_at_a_new_mini_epoch(
        open_engine, dataset, t):
    """The kernel's entries the substitutions hand over to be dropped (substitutions.py, "Stale entries"): when a
    pass begins, the names served as another file two passes ago and not looked up in the last pass; when a
    mini-epoch begins, every name resolved in the old one (served as its own file too)."""
    _, files = dataset
    e = open_engine(substitute=True, listing="all", nm=8, rf=3, advance="strict")
    ops = TierOperations(e)
    tree, subs = e.tree, e.names.substitutions
    assert subs is not None
    by_dir: dict[str, list[str]] = {}
    for rel in sorted(files):
        by_dir.setdefault(rel.split("/")[0], []).append(rel)

    def key(rel: str) -> tuple[int, int]:
        d, name = rel.split("/")
        dir_node = tree.child(0, d.encode())
        return dir_node, tree.child(dir_node, name.encode())

    async def one_pass(again: list[str]) -> tuple[set, set]:
        """Read the names ``again`` and then, per directory, unread names until each view file was served once
        (that ends the pass); the keys of the names served as another file and as their own."""
        passes = e.schedule.pos.passes_total
        others, own = set(), set()
        queue = list(again) + [r for rs in by_dir.values() for r in rs if r not in used]
        served: set[int] = set()
        for rel in queue:
            if e.schedule.pos.passes_total != passes:
                break
            in_view = {int(f) for f in e.schedule.view.files_in(key(rel)[0])}
            if not in_view or in_view <= served:
                continue
            a = await _lookup(ops, rel)
            f = e.names.file_index(a.st_ino)
            if f in served:
                continue  # (a name of a folder whose view files were all served: not needed)
            served.add(f)
            await _open_read(ops, a.st_ino)
            used.add(rel)
            (own if os.fsdecode(tree.file_path(f)) == rel else others).add(key(rel))
        assert e.schedule.pos.passes_total == passes + 1  # every view file served: the pass ended
        return others, own

    async def main():
        me = e.schedule.pos.mini_epoch
        others1, own1 = await one_pass([])
        assert others1 and not subs.stale  # nothing two passes old yet
        again = sorted(r for r in used if key(r) in others1)[:1]  # one name of pass 1 read again in pass 2
        others2, own2 = await one_pass(again)
        assert not subs.stale
        assert e.schedule.pos.mini_epoch == me  # (rf 3: pass 3 is of the same mini-epoch)
        others3, own3 = await one_pass([])  # its first lookup began pass 3: pass 1's are stale, but the one read
        assert sorted(subs.take_stale()) == sorted(others1 - {key(r) for r in again})  # again (pass 2's entry)
        assert subs.take_stale() == []  # handed over once
        await _lookup(ops, sorted(files)[0])  # begins pass 4, in a new mini-epoch: every entry of the old one
        assert e.schedule.pos.mini_epoch != me
        assert sorted(subs.take_stale()) == sorted(others2 | others3 | own1 | own2 | own3)

    used: set[str] = set()
    t.run(main)


def test_with_every_file_in_view_no_entry_is_stale_across_mini_epochs(open_engine, dataset, t):
    """``nm`` 1: every name is served as its own file, pass after pass; its kernel entry stays right (and holds the
    file's pages), so none is handed over to be dropped when a new mini-epoch (here: epoch) begins."""
    _, files = dataset
    e = open_engine(1 << 20, substitute=True, listing="all", nm=1, rf=1, advance="strict")
    ops = TierOperations(e)
    subs = e.names.substitutions
    assert subs is not None

    async def main():
        for _ in range(2):
            position = (e.schedule.pos.epoch, e.schedule.pos.mini_epoch)
            for rel in random.Random(len(subs.stale)).sample(sorted(files), len(files)):
                a = await _lookup(ops, rel)
                assert os.fsdecode(e.tree.file_path(e.names.file_index(a.st_ino))) == rel  # its own file
                await _open_read(ops, a.st_ino)
            assert (e.schedule.pos.epoch, e.schedule.pos.mini_epoch) != position  # every file read: a new one
        await _lookup(ops, sorted(files)[0])
        assert subs.take_stale() == [] and e.status().substitution.substituted == 0

    t.run(main)
