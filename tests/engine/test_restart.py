"""Restart: the position journal and the self-describing cache survive clean and killed stops."""

from __future__ import annotations

import json
import os

import trio

from tierfs.atomic import TEMP_PREFIX


def _progress(e, t, passes: int) -> None:
    async def main():
        async with trio.open_nursery() as n:
            await n.start(e.run)
            for _ in range(passes):
                await t.settle(e)
                await t.read_view(e)
            await t.settle(e)
            n.cancel_scope.cancel()

    t.run(main)


def test_clean_restart_resumes_position_and_keeps_copies(open_engine, tmp_path, t):
    e = open_engine(rf=2)
    _progress(e, t, 5)
    where = (e.pos.epoch, e.pos.mini_epoch, e.pos.pass_index)
    cached = {f: en.name for f, en in e.cache.entries.items()}
    order = e.order_text()
    assert where != (0, 0, 0)
    e.close()
    e2 = open_engine(rf=2)
    assert (e2.pos.epoch, e2.pos.mini_epoch, e2.pos.pass_index) == where
    assert {f: en.name for f, en in e2.cache.entries.items()} == cached
    assert e2.order_text() == order  # the same pass, the same serving order
    assert e2.pos.rf_effective == e.pos.rf_effective


def test_killed_restart_resumes_and_cleans_temps(open_engine, tmp_path, t):
    e = open_engine(rf=2)
    _progress(e, t, 3)
    where = (e.pos.epoch, e.pos.mini_epoch, e.pos.pass_index)
    cached = set(e.cache.entries)
    # a kill: no close(); the lock goes with the process, so drop it by hand, and leave temp files behind
    e.cache.close()
    data = e.cache.data_path
    with open(os.path.join(data, f"{TEMP_PREFIX}half-copied"), "wb") as f:
        f.write(b"x" * 100)
    with open(os.path.join(e.config.cache, f"{TEMP_PREFIX}journal.json.123"), "wb") as f:
        f.write(b"{")
    with open(os.path.join(data, "garbage"), "wb") as f:
        f.write(b"?")
    e2 = open_engine(rf=2)
    assert (e2.pos.epoch, e2.pos.mini_epoch, e2.pos.pass_index) == where
    assert set(e2.cache.entries) == cached
    names = set(os.listdir(data))
    assert not any(n.startswith(TEMP_PREFIX) for n in names) and "garbage" not in names
    assert not any(n.startswith(TEMP_PREFIX) for n in os.listdir(e.config.cache))
    assert e2.cache.used == sum(en.size for en in e2.cache.entries.values())


def test_restart_drops_copies_whose_backing_changed(open_engine, t):
    e = open_engine(rf=2)
    _progress(e, t, 1)
    victim = next(iter(e.cache.entries))
    path = os.path.join(e.config.backing, os.fsdecode(e.tree.file_path(victim)))
    e.close()
    with open(path, "ab") as f:
        f.write(b"more")
    e2 = open_engine(rf=2)
    assert victim not in e2.cache.entries
    assert len(os.listdir(e2.cache.data_path)) == len(e2.cache.entries)


def test_journal_is_valid_json_after_every_pass(open_engine, t):
    e = open_engine(rf=1)
    _progress(e, t, 3)
    with open(os.path.join(e.config.cache, "journal.json")) as f:
        j = json.load(f)
    assert (j["epoch"], j["mini_epoch"], j["pass"]) == (e.pos.epoch, e.pos.mini_epoch, e.pos.pass_index)
