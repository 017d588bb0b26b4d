"""Files the backing gains during a mount (issue 48 item 6, its second half): a rescan as each epoch starts takes
them into the tree's room, hidden, and they join the mini-epochs as the first epoch planned with them starts --
listed, looked up, in views and ``order``, staged and served -- while every number the kernel holds stays."""

from __future__ import annotations

import os

import pytest
import trio

NEW = {"class_000/zz_new.bin": b"new in an old class" * 50, "class_new/a.bin": b"a" * 3000,
       "class_new/b.bin": b"b" * 10}


@pytest.mark.slow
def test_files_the_backing_gains_join_a_later_epoch_without_a_remount(open_engine, t):
    e = open_engine(rf=1, advance="strict")
    n0 = e.tree.n_files
    before = [(e.tree.file_path(f), e.tree.inode_of(f)) for f in range(n0)]
    class_000 = e.names.lookup(1, b"class_000")
    for rel, data in NEW.items():
        path = os.path.join(e.config.backing, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)

    def new_files() -> dict[str, int]:
        """The new files the mount looks up now (by name, as the kernel does), with their file index."""
        out = {}
        for rel in NEW:
            d, name = rel.split("/")
            parent = e.names.lookup(1, d.encode())
            inode = e.names.lookup(parent, name.encode()) if parent is not None else None
            if inode is not None:
                out[rel] = e.tree.fidx_of(inode - 1)
        return out

    async def main():
        hidden_seen = False
        async with trio.open_nursery() as n:
            await n.start(e.run)
            with trio.fail_after(60):
                while len(new_files()) < len(NEW):
                    await t.settle(e)
                    if e.tree.joining:  # (taken by a rescan, not joined: in no listing, view or order)
                        hidden_seen = True
                        assert not new_files() and e.trees.statistics().joining == len(NEW)
                        assert not any(p.startswith(b"class_new") for p in e.names.order_text().splitlines())
                    await t.read_view(e)
                    await trio.sleep(0.05)
                joined = new_files()
                epoch = e.schedule.pos.epoch
                seen: set[int] = set()
                while e.schedule.pos.epoch == epoch:  # (the rest of the epoch they joined)
                    await t.settle(e)
                    seen |= set(e.schedule.view.order.tolist())
                    await t.read_view(e)  # (their bytes, from their copies or the backing)
                assert set(joined.values()) <= seen, "a file that joined is in a view of its epoch"
                for rel, fidx in joined.items():
                    assert await t.read_file(e, fidx) == NEW[rel]
                n.cancel_scope.cancel()
        assert hidden_seen
        # no number the kernel may hold changed; the new directory holds its files, by name
        assert [(e.tree.file_path(f), e.tree.inode_of(f)) for f in range(n0)] == before
        assert e.names.lookup(1, b"class_000") == class_000 and e.tree.n_files == n0 + len(NEW)
        assert e.tree.names_of(e.tree.children(e.names.lookup(1, b"class_new") - 1)) == [b"a.bin", b"b.bin"]
        st = e.trees.statistics()
        assert (st.added, st.joining, st.left_out) == (len(NEW), 0, 0) and st.rescans >= 1

    t.run(main)


@pytest.mark.slow
def test_rescan_never_keeps_the_tree_as_mounted(open_engine, t):
    e = open_engine(rf=1, advance="strict", rescan="never")
    n0 = e.tree.n_files
    assert e.tree.n_slots == n0  # (no room kept)
    with open(os.path.join(e.config.backing, "class_000", "zz_new.bin"), "wb") as f:
        f.write(b"new")

    async def main():
        async with trio.open_nursery() as n:
            await n.start(e.run)
            for _ in range(10):  # (two and a half epochs)
                await t.settle(e)
                await t.read_view(e)
                await trio.sleep(0.3)
            n.cancel_scope.cancel()

    t.run(main)
    assert e.schedule.pos.epoch >= 2 and e.tree.n_files == n0 and e.trees.statistics().rescans == 0
