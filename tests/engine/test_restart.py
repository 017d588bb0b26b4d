"""Restart: the position journal and the self-describing cache survive clean and killed stops."""

from __future__ import annotations

import json
import os

import pytest
import trio

from sampler.atomic import TEMP_PREFIX
from tierfs.daemon.tree import keeper as opening
from tierfs.daemon.tree.tree import fingerprint


def test_clean_restart_resumes_position_and_keeps_copies(open_engine, tmp_path, t):
    e = open_engine(rf=2)
    t.read_passes(e, 5)
    where = (e.schedule.pos.epoch, e.schedule.pos.mini_epoch, e.schedule.pos.pass_index)
    cached = {f: en.name for f, en in e.cache.entries.items()}
    order = e.names.order_text()
    assert where != (0, 0, 0)
    e.close()
    e2 = open_engine(rf=2)
    assert (e2.schedule.pos.epoch, e2.schedule.pos.mini_epoch, e2.schedule.pos.pass_index) == where
    assert {f: en.name for f, en in e2.cache.entries.items()} == cached
    assert e2.names.order_text() == order  # the same pass, the same serving order
    assert e2.schedule.pos.rf_effective == e.schedule.pos.rf_effective


def test_killed_restart_resumes_and_cleans_temps(open_engine, tmp_path, t):
    e = open_engine(rf=2)
    t.read_passes(e, 3)
    where = (e.schedule.pos.epoch, e.schedule.pos.mini_epoch, e.schedule.pos.pass_index)
    cached = set(e.cache.entries)
    # a kill: no close(); the lock goes with the process, so drop it by hand, and leave temp files behind
    e.cache.close()
    data = e.cache.data_path
    with open(os.path.join(data, f"{TEMP_PREFIX}4242-17"), "wb") as f:  # a copy cut short (temp_copy_name)
        f.write(b"x" * 100)
    with open(os.path.join(e.config.cache, f"{TEMP_PREFIX}journal.json.123"), "wb") as f:
        f.write(b"{")
    e2 = open_engine(rf=2)
    assert (e2.schedule.pos.epoch, e2.schedule.pos.mini_epoch, e2.schedule.pos.pass_index) == where
    assert set(e2.cache.entries) == cached
    names = set(os.listdir(data))
    assert not any(n.startswith(TEMP_PREFIX) for n in names)
    assert not any(n.startswith(TEMP_PREFIX) for n in os.listdir(e.config.cache))
    assert e2.cache.used == sum(en.disk for en in e2.cache.entries.values())


def test_restart_drops_copies_whose_backing_changed(open_engine, t):
    e = open_engine(rf=2)
    t.read_passes(e, 1)
    victim = next(iter(e.cache.entries))
    path = os.path.join(e.config.backing, os.fsdecode(e.tree.file_path(victim)))
    e.close()
    with open(path, "ab") as f:
        f.write(b"more")
    e2 = open_engine(rf=2)
    # mounted at once from the saved tree; the background rescan finds the change and drops the copy
    assert e2.trees.statistics().source == "saved"

    async def main():
        async with trio.open_nursery() as n:
            await n.start(e2.run)
            with trio.fail_after(20):
                while e2.trees.statistics().rescan != "done":
                    await trio.sleep(0.02)
            assert e2.trees.statistics().changed == 1
            await t.settle(e2)
            copy = e2.cache.get(victim)  # dropped, or staged again from the new file
            assert copy is None or copy.fp == fingerprint(os.stat(path))
            n.cancel_scope.cancel()
        assert await t.read_file(e2, victim) == t.backing_bytes(e2, victim)  # the new bytes, never the copy

    t.run(main)
    assert len(os.listdir(e2.cache.data_path)) == len(e2.cache.entries)


def test_a_remount_answers_from_the_saved_tree_and_sees_what_changed(open_engine, t, dataset, monkeypatch):
    backing, files = dataset
    # (the file added below is seconds old: taken at once, not left for the next rescan as one being written)
    monkeypatch.setattr(opening, "ADD_SETTLE_S", 0.0)
    e = open_engine(rf=2)
    t.read_passes(e, 1)
    e.close()
    gone = sorted(files)[0]
    os.unlink(backing / gone)
    (backing / "class_000" / "added.bin").write_bytes(b"new")
    e2 = open_engine(rf=2)
    assert e2.trees.statistics().source == "saved" and e2.tree.n_files == len(files)
    fidx = next(f for f in range(e2.tree.n_files) if os.fsdecode(e2.tree.file_path(f)) == gone)

    async def main():
        with pytest.raises(OSError):
            await t.read_file(e2, fidx)  # unconfirmed fingerprint: the open asks the backing, which says ENOENT
        async with trio.open_nursery() as n:
            await n.start(e2.run)
            with trio.fail_after(20):
                while e2.trees.statistics().rescan != "done":
                    await trio.sleep(0.02)
            n.cancel_scope.cancel()
        assert (e2.trees.statistics().added, e2.trees.statistics().removed) == (1, 1)

    t.run(main)
    e2.close()
    e3 = open_engine(rf=2)  # the next mount has the new tree
    assert e3.tree.n_files == len(files) and e3.trees.statistics().source == "saved"


def test_journal_is_valid_json_after_every_pass(open_engine, t):
    e = open_engine(rf=1)
    t.read_passes(e, 3)
    with open(os.path.join(e.config.cache, "journal.json")) as f:
        j = json.load(f)
    pos = e.schedule.pos
    assert (j["epoch"], j["mini_epoch"], j["pass"]) == (pos.epoch, pos.mini_epoch, pos.pass_index)


def test_an_lru_remount_keeps_its_copies(open_engine, t):
    """policy=lru is a read-through cache: what was copied in stays across a remount (it used to be evicted at
    mount, every copy being "unwanted" to a policy that walks no plan)."""
    e = open_engine(policy="lru", view="full")

    async def main():
        async with trio.open_nursery() as n:
            await n.start(e.run)
            for f in range(e.tree.n_files // 2):
                assert await t.read_file(e, f) == t.backing_bytes(e, f)
            n.cancel_scope.cancel()

    t.run(main)
    cached = {f: en.name for f, en in e.cache.entries.items()}
    assert cached
    e.close()
    e2 = open_engine(policy="lru", view="full")
    assert {f: en.name for f, en in e2.cache.entries.items()} == cached
    assert sorted(os.listdir(e2.cache.data_path)) == sorted(cached.values())


def test_a_clean_remount_takes_its_copies_from_the_index_and_still_trusts_no_copy(open_engine, t):
    """A clean unmount writes CACHE/index.npz; the next mount takes the copies it describes without a stat each
    (the same entries a full check finds), drops the names gone from data/, and a copy damaged in between is
    still never served: the open's check repairs it and the bytes come from the backing."""
    e = open_engine(rf=2)
    t.read_passes(e, 3)
    before = {f: (en.name, en.disk, en.fp, en.copy_id, en.digest) for f, en in e.cache.entries.items()}
    e.close()
    index = os.path.join(e.cache.path, "index.npz")
    assert os.path.exists(index) and len(before) >= 3
    deleted, damaged = sorted(before)[:2]
    os.unlink(os.path.join(e.cache.data_path, before[deleted][0]))
    with open(os.path.join(e.cache.data_path, before[damaged][0]), "r+b") as f:
        f.write(b"\0")  # same size, other bytes: ctime and mtime move

    e2 = open_engine(rf=2)
    assert not os.path.exists(index)  # taken (a crash from here on leaves none behind)
    got = {f: (en.name, en.disk, en.fp, en.copy_id, en.digest) for f, en in e2.cache.entries.items()}
    assert got == {f: v for f, v in before.items() if f != deleted}

    async def main():
        for f in range(e2.tree.n_files):
            assert await t.read_file(e2, f) == t.backing_bytes(e2, f)

    t.run(main)
    assert e2.cache.get(damaged) is None or e2.cache.get(damaged).name != before[damaged][0]
    assert e2.cache.repairs >= 1
    kept = {f: (en.name, en.disk, en.fp, en.copy_id) for f, en in e2.cache.entries.items()}
    e2.close()
    os.unlink(index)  # as after a crash: every copy is checked the slow way, with the same result
    e3 = open_engine(rf=2)
    assert {f: (en.name, en.disk, en.fp, en.copy_id) for f, en in e3.cache.entries.items()} == kept


def test_a_remount_over_a_grown_data_set_adapts_nm_and_says_so(open_engine, dataset, tmp_path, t, caplog):
    """(issue 48) the data set grew so that nm=4 no longer fits the capacity: the remount (a journal in the cache
    dir) mounts with the fewest mini-epochs that fit and says so -- an fstab mount keeps coming back; a first
    mount with the same settings is refused with the fix."""
    backing, files = dataset
    e = open_engine(capacity=64 << 10, nm=4)  # (the copies take 32 blocks of 4 KiB: 2 mini-epochs of 16 fit)
    t.read_passes(e, 2)
    e.close()
    for i in range(40):  # (72 blocks: 4 mini-epochs of 18 no longer fit 32 KiB each)
        (backing / "grown").mkdir(exist_ok=True)
        (backing / "grown" / f"n{i}.bin").write_bytes(os.urandom(100 + i))
    with pytest.raises(ValueError, match="nm=4 does not fit"):
        open_engine(capacity=64 << 10, nm=4, cache=tmp_path / "fresh")  # (a first mount: the user's choice)
    e1 = open_engine(capacity=64 << 10, nm=4)  # (from the saved tree: its rescan finds and saves the new files)
    saved = os.stat(os.path.join(e1.config.cache, "tree.bin")).st_mtime_ns

    async def rescanned():
        async with trio.open_nursery() as n:
            await n.start(e1.run)
            with trio.fail_after(30):
                while os.stat(os.path.join(e1.config.cache, "tree.bin")).st_mtime_ns == saved:
                    await trio.sleep(0.01)
            n.cancel_scope.cancel()

    t.run(rescanned)
    e1.close()
    with caplog.at_level("WARNING", logger="tierfs"):
        e2 = open_engine(capacity=64 << 10, nm=4)
    assert e2.tree.n_files == len(files) + 40
    assert e2.settings.nm > 4 and e2.schedule.nm_in_force() == e2.settings.nm
    said = [r.getMessage() for r in caplog.records if "data set changed" in r.getMessage()]
    assert len(said) == 1 and f"mounted with nm={e2.settings.nm} instead of 4" in said[0], said
    t.read_passes(e2, 2)  # (it serves: passes go on)
    assert e2.schedule.pos.passes_total >= 2
    e2.close()
    with pytest.raises(ValueError, match="nm=5 does not fit"):  # (another nm than the last mount's: refused)
        open_engine(capacity=64 << 10, nm=5)
