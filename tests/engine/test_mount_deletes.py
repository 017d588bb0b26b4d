"""A remount whose cache holds copies no longer wanted (issue 47): the count and the reason in the log, and --
beyond ``cache.MOUNT_DELETES_AT_ONCE`` -- the deletions made in the background once the mount runs, not before it
answers (34k copies held a crash remount 72 s, silent)."""

from __future__ import annotations

import os

import trio

from tierfs.daemon.cache import store as cache_module
from tierfs.daemon.cache.journal import JOURNAL_NAME


def _restart_at_the_start(open_engine, t) -> tuple[set[str], str]:
    """A mount that made 5 passes (at mini-epoch 2 of 4, its copies those of mini-epochs 2 and 3), closed, its
    position journal removed: the remount starts at mini-epoch 0 and those copies are unwanted.  Returns the
    copies' names and the data dir."""
    e = open_engine(rf=2)
    t.read_passes(e, 5)
    assert e.schedule.pos.mini_epoch == 2
    names = {en.name for en in e.cache.entries.values()}
    data = e.cache.data_path
    e.close()
    os.unlink(os.path.join(e.config.cache, JOURNAL_NAME))  # (after close, which writes it)
    return names, data


def test_a_few_unwanted_copies_go_before_the_mount_answers_with_their_reason(open_engine, t, caplog):
    names, data = _restart_at_the_start(open_engine, t)
    with caplog.at_level("INFO", logger="tierfs"):
        e = open_engine(rf=2)
    kept = {en.name for en in e.cache.entries.values()}
    gone = names - kept
    assert gone and not gone & set(os.listdir(data))
    said = [r.getMessage() for r in caplog.records if "cached copies" in r.getMessage()]
    assert said == [f"deleting {len(gone)} cached copies: they are of files outside the mini-epochs now wanted "
                    "(mini-epoch 1/4 of epoch 1, where the mount resumes, and the next)"]


def test_many_unwanted_copies_are_deleted_after_the_mount_answers(open_engine, t, caplog, monkeypatch):
    names, data = _restart_at_the_start(open_engine, t)
    monkeypatch.setattr(cache_module, "MOUNT_DELETES_AT_ONCE", 0)  # (what thousands of copies do)
    with caplog.at_level("INFO", logger="tierfs"):
        e = open_engine(rf=2)
        gone = names - {en.name for en in e.cache.entries.values()}
        # the mount answers with them still on disk, counted in the cache (the cap holds), and says so
        assert gone and gone <= set(os.listdir(data))
        assert e.cache.deleting_bytes > 0 and e.status().cache_bytes >= e.cache.deleting_bytes
        warned = [r for r in caplog.records if "deleting them in the background" in r.getMessage()]
        assert len(warned) == 1 and warned[0].getMessage().startswith(f"{len(gone)} cached copies are of files "
                                                                      "outside the mini-epochs now wanted")

        async def main():
            async with trio.open_nursery() as n:
                await n.start(e.run)
                with trio.fail_after(30):
                    while e.cache.deleting_bytes:
                        await trio.sleep(0.01)
                n.cancel_scope.cancel()

        t.run(main)
    assert not gone & set(os.listdir(data))
    assert any(r.getMessage().startswith(f"deleted the {len(gone)} cached copies left from the mount in ")
               for r in caplog.records)
