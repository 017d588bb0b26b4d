"""substitute: a file name resolves, for the pass, to a view file of its directory, drawn without replacement."""

from __future__ import annotations

import os

import pyfuse3

from tierfs.fs import TierOperations
from tierfs.substitute import SubstitutionStatistics

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
        assert e.status().substitution == SubstitutionStatistics(enabled=False, substituted=0, rounds=0)

    t.run(main)
