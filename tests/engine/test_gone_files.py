"""Files that leave the backing during a mount (issue 48 item 6: a backing that changes shape): out of the view,
the listings and ``order`` at once, the pass ends without them, never staged again."""

from __future__ import annotations

import errno
import os

import pytest
import trio

from tierfs.daemon.backing.calls import BackingError


@pytest.mark.slow
def test_a_view_file_gone_mid_pass_leaves_the_view_and_the_pass_ends_without_it(open_engine, t):
    e = open_engine(rf=100)

    async def main():
        async with trio.open_nursery() as n:
            await n.start(e.run)
            await t.settle(e)
            order = e.schedule.view.order.tolist()
            gone, rest = order[0], order[1:]
            next_gone = e.schedule.next_files.tolist()[0]
            os.unlink(t.backing_path(e, gone))
            os.unlink(t.backing_path(e, next_gone))
            with pytest.raises(BackingError) as exc:  # (its copy is not trusted past revalidate=open)
                await e.data.open_file(gone)
            assert exc.value.errno == errno.ENOENT
            assert e.tree.path(gone + 1) not in e.names.order_text().splitlines()
            passes = e.schedule.pos.passes_total
            for f in rest:
                assert await t.read_file(e, f) == t.backing_bytes(e, f)
            assert e.schedule.pos.passes_total == passes + 1  # (ended by the reads of every file left)
            assert gone not in e.schedule.view.order.tolist() and len(e.schedule.view) == len(rest)
            listed = e.names.list_dir(e.tree.file_node(rest[0]).parent + 1)
            assert gone + 2 not in listed.inodes.tolist()
            # the next mini-epoch's gone file: found by its copy or its re-stat, never waited for, never retried
            with pytest.raises(BackingError):
                await e.data.open_file(next_gone)
            skipped = e.stager.skipped
            await trio.sleep(6)  # (past the stager's retry time)
            assert e.stager.skipped == skipped and next_gone not in e.stager.queue
            assert e.tree.gone_files == 2 and e.trees.statistics().gone == 2
            e.control_write(b"advance\n")
            await t.settle(e)
            assert next_gone not in e.schedule.view.order.tolist()
            n.cancel_scope.cancel()

    t.run(main)
