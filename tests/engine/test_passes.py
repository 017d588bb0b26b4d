"""Passes and mini-epochs: when a pass ends, rf, advance, ARF feedback, compositions, sharding, view, lru."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from tierfs.common.options import Settings


async def _staged(e, t):
    async with trio.open_nursery() as n:
        await n.start(e.run)
        await t.settle(e)
        n.cancel_scope.cancel()


def test_pass_ends_when_every_view_file_was_read(open_engine, t):
    e = open_engine(rf=3)

    async def main():
        order = e.schedule.view.order.tolist()
        for f in order[:-1]:
            await t.read_file(e, f)
            await t.read_file(e, f)  # re-reading does not count twice
        assert e.schedule.pos.pass_index == 0
        await t.read_file(e, order[-1])
        assert e.schedule.pos.pass_index == 1 and e.schedule.pos.rf_effective == [1]

    t.run(main)


def test_pass_ends_on_next_pass_and_on_root_relist_after_a_read(open_engine, t):
    e = open_engine(rf=10)

    async def main():
        e.names.list_dir(1)
        e.names.list_dir(1)
        assert e.schedule.pos.pass_index == 0  # listing without reading ends nothing
        await t.read_file(e, e.schedule.view.order.tolist()[0])
        e.names.list_dir(1)
        assert e.schedule.pos.pass_index == 1
        e.control_write(b"next-pass\n")
        assert e.schedule.pos.pass_index == 2

    t.run(main)


def test_pass_ends_once_every_rank_finished_its_share(open_engine, t):
    """``next-pass pass=P rank=R/W`` (a sampler's rank done with its share, its loader's dropped batch unread):
    the pass ends when all W ranks said so about the pass that runs; a repeat, a report about an older pass or
    one of another rank count does not end it."""
    e = open_engine(rf=10)

    async def main():
        await t.read_file(e, e.schedule.view.order.tolist()[0])
        p = e.schedule.pos.passes_total
        e.control_write(f"next-pass pass={p} rank=1/3\nnext-pass pass={p} rank=1/3\n".encode())
        e.control_write(f"next-pass pass={p - 1 if p else p + 1} rank=0/3\n".encode())  # (not the pass that runs)
        e.control_write(f"next-pass pass={p} rank=0/2\n".encode())  # (another count: starts afresh)
        e.control_write(f"next-pass pass={p} rank=0/3\nnext-pass pass={p} rank=1/3\n".encode())
        assert e.schedule.pos.passes_total == p
        e.control_write(f"next-pass pass={p} rank=2/3\n".encode())
        assert e.schedule.pos.passes_total == p + 1
        e.control_write(f"next-pass pass={p} rank=2/3\n".encode())  # (late: that pass is over)
        assert e.schedule.pos.passes_total == p + 1

    t.run(main)


def test_under_listing_all_a_root_listing_ends_no_pass(open_engine, t):
    """A listing=all mount serves datasets built once: a rank that lists the root to build its dataset after the
    others began reading must not end their pass."""
    e = open_engine(rf=10, listing="all")

    async def main():
        await t.read_file(e, e.schedule.view.order.tolist()[0])
        e.names.list_dir(1)
        assert e.schedule.pos.pass_index == 0

    t.run(main)


def test_ready_repeats_until_next_is_cached_then_switches(open_engine, t):
    e = open_engine(rf=2, rf_max=8)  # (a ceiling above the passes made here)

    async def main():
        for _ in range(4):  # no stager: the next mini-epoch never becomes ready
            await t.read_view(e)
        assert e.schedule.pos.mini_epoch == 0 and e.schedule.pos.rf_effective == [4]
        await _staged(e, t)
        await t.read_view(e)
        assert e.schedule.pos.mini_epoch == 1 and e.schedule.pos.rf_effective == [5, 0]
        await t.read_view(e)
        await t.read_view(e)
        assert e.schedule.pos.rf_effective[:2] == [5, 2]

    t.run(main)


def test_every_file_once_per_epoch_across_mini_epochs(open_engine, t):
    e = open_engine(rf=1)

    async def main():
        seen = []
        async with trio.open_nursery() as n:
            await n.start(e.run)
            while e.schedule.pos.epoch == 0:
                await t.settle(e)
                seen.extend(e.schedule.view.files.tolist())
                await t.read_view(e)
            n.cancel_scope.cancel()
        assert sorted(seen) == list(range(e.tree.n_files))

    t.run(main)


def test_advance_command_leaves_as_soon_as_next_is_cached(open_engine, t):
    e = open_engine(rf=50)

    async def main():
        e.control_write(b"advance\n")
        assert e.schedule.pos.mini_epoch == 0  # not staged yet
        await _staged(e, t)  # staging completes -> switch at once
        assert e.schedule.pos.mini_epoch == 1 and e.schedule.pos.rf_effective == [0, 0]
        await _staged(e, t)
        e.control_write(b"advance")
        assert e.schedule.pos.mini_epoch == 2

    t.run(main)


def test_score_feedback_drives_arf(open_engine, t):
    e = open_engine(rf=50, arf="score", arf_wait=2)

    async def main():
        await _staged(e, t)
        for loss in (1.0, 0.9, 0.95, 0.97):  # two passes without improvement -> advance
            await t.read_view(e)
            e.control_write(f"feedback loss={loss} train_err=0.1 val_err=0.2\n".encode())
        assert e.schedule.pos.mini_epoch == 1
        st = e.status()
        assert st.arf.mode == "score" and st.arf.score is not None
        assert [h["decision"] for h in st.arf.history][-1] == "advance"
        assert st.rf_effective[0] == 4

    t.run(main)


def test_feedback_with_arf_off_is_recorded_but_never_advances(open_engine, t):
    e = open_engine(rf=50)

    async def main():
        await _staged(e, t)
        for _ in range(5):
            e.control_write(b"feedback loss=1 train_err=0.5 val_err=0.5 score=3\n")
        assert e.schedule.pos.mini_epoch == 0 and len(e.status().arf.history) == 5

    t.run(main)


def test_rf_auto_from_measured_rates(open_engine, t):
    e = open_engine(rf="auto")
    e.stager._bytes, e.stager._busy = 1000, 1.0  # 1000 B/s staging
    e.schedule.consumption_bps = 3500.0  # a reader 3.5x faster
    assert e.passes.rf_now() == 4
    assert e.status().rf == 4 and e.status().rf_setting == "auto"


@pytest.mark.parametrize("composition", ["random", "stratified", "contiguous", "reservoir"])
def test_compositions(open_engine, t, composition):
    e = open_engine(composition=composition, rf=1, advance="strict")
    plan = e.schedule.plan(0)
    assert sorted(np.concatenate(plan).tolist()) == list(range(e.tree.n_files))
    assert all(int(e.tree.sizes[p].sum()) <= e.config.capacity // 2 for p in plan)
    if composition == "stratified":
        # every directory keeps its share in every mini-epoch
        for p in plan:
            counts = np.bincount(e.tree.groups[p], minlength=len(e.tree.nodes))
            assert (counts[np.unique(e.tree.groups[:e.tree.n_files])] >= 1).all()

    async def main():
        seen = []
        while e.schedule.pos.epoch == 0:
            seen.extend(e.schedule.view.files.tolist())
            await t.read_view(e)
        assert sorted(seen) == list(range(e.tree.n_files))

    t.run(main)


def test_rank_world_size_shard_the_plan(open_engine, tmp_path, t):
    e0 = open_engine(cache=tmp_path / "c0", rank=0, world_size=2)
    e1 = open_engine(cache=tmp_path / "c1", rank=1, world_size=2)
    for j in range(len(e0.schedule.plan(0))):
        a, b = set(e0.schedule.plan(0)[j].tolist()), set(e1.schedule.plan(0)[j].tolist())
        assert not a & b
    union = set(np.concatenate(e0.schedule.plan(0)).tolist()) | set(np.concatenate(e1.schedule.plan(0)).tolist())
    assert union == set(range(e0.tree.n_files))
    assert set(e0.schedule.view.files.tolist()).isdisjoint(e1.schedule.view.files.tolist())


def test_view_full_shows_everything_and_stages_mini_epochs(open_engine, t):
    e = open_engine(view="full", rf=1)
    assert len(e.schedule.view) == e.tree.n_files
    names = {n for n, _ in e.names.list_dir(1)}
    assert names == {f"class_{d:03d}".encode() for d in range(4)}

    async def main():
        await _staged(e, t)
        assert len(e.cache.entries) == len(e.schedule.current) + len(e.schedule.next_files)

    t.run(main)


def test_lru_reads_through_under_the_cap(open_engine, t):
    e = open_engine(policy="lru")
    assert e.settings.view == "full" and len(e.schedule.view) == e.tree.n_files

    async def main():
        for _ in range(2):
            for f in e.schedule.view.order.tolist():
                assert await t.read_file(e, f) == t.backing_bytes(e, f)
                assert e.cache.used <= e.cache.capacity
        assert e.schedule.pos.passes_total == 2
        # the most recently read files are the cached ones
        last = e.schedule.view.order.tolist()
        hits = e.data.hits
        await t.read_file(e, list(e.cache.entries)[-1])
        assert e.data.hits == hits + 1
        assert len(last) == e.tree.n_files

    t.run(main)
    assert e.data.misses > 0 and e.cache.used <= e.cache.capacity


def test_settings_change_keeps_current_epoch_plan(open_engine, t):
    e = open_engine(capacity=1 << 20, nm=4)
    cur = e.schedule.current.copy()
    e.control_write(b"nm=2\n")
    assert e.settings.nm == 2 and (e.schedule.current == cur).all()
    assert len(e.schedule.plan(0)) == 4 and len(e.schedule.plan(1)) == 2
    assert isinstance(e.settings, Settings)


def test_empty_shares_are_skipped(open_engine, t):
    # 32 files, 2 ranks x 30 mini-epochs: some shares are empty; a rank never sits on an empty view
    e = open_engine(capacity=1 << 20, nm=30, rank=1, world_size=2, rf=1, advance="strict")
    assert any(len(p) == 0 for p in e.schedule.plan(0))

    async def main():
        seen = []
        while e.schedule.pos.epoch == 0:
            assert len(e.schedule.view) > 0
            seen.extend(e.schedule.view.files.tolist())
            await t.read_view(e)
        assert sorted(seen) == sorted(np.concatenate(e.schedule.plan(0)).tolist())

    t.run(main)


def test_feedback_after_the_switch_is_about_the_mini_epoch_trained_on(open_engine, t):
    # The rf-th pass ends when its last file is opened, so the trainer's feedback on it arrives after the
    # switch: it must be scored within the mini-epoch it trained on, and its "advance" must not skip the new one.
    e = open_engine(rf=2, arf="score", arf_wait=1)

    async def main():
        await _staged(e, t)
        await t.read_view(e)
        e.control_write(b"feedback loss=1\n")
        assert e.status().arf.history[-1]["mini_epoch"] == 0
        await _staged(e, t)
        await t.read_view(e)  # the 2nd pass: tierfs switches at the last open
        assert (e.schedule.pos.mini_epoch, e.schedule.pos.pass_index) == (1, 0)
        e.control_write(b"feedback loss=2\n")  # worse than 1 within mini-epoch 0: "advance", about mini-epoch 0
        h = e.status().arf.history[-1]
        assert (h["epoch"], h["mini_epoch"], h["pass"], h["decision"]) == (0, 0, 2, "advance")
        await _staged(e, t)
        assert (e.schedule.pos.mini_epoch, e.schedule.pos.pass_index) == (1, 0)  # not applied to the new mini-epoch
        await t.read_view(e)
        e.control_write(b"feedback loss=5\n")  # the first score of mini-epoch 1: nothing to compare with yet
        h = e.status().arf.history[-1]
        assert (h["epoch"], h["mini_epoch"], h["pass"], h["decision"]) == (0, 1, 1, "continue")
        assert (e.schedule.pos.mini_epoch, e.schedule.pos.pass_index) == (1, 1)
        e.control_write(b"feedback loss=6\n")  # about the current mini-epoch: applied
        await _staged(e, t)
        assert e.schedule.pos.mini_epoch == 2

    t.run(main)


def test_feedback_is_about_the_last_completed_pass_across_a_restart(open_engine, t):
    e = open_engine(rf=1)

    async def main():
        await _staged(e, t)
        await t.read_view(e)

    t.run(main)
    assert e.schedule.pos.mini_epoch == 1 and e.passes.last_pass == (0, 0)
    e.close()
    e2 = open_engine(rf=1)
    assert e2.passes.last_pass == (0, 0)
    e2.control_write(b"feedback loss=1\n")
    assert e2.status().arf.history[-1]["mini_epoch"] == 0


def test_consumption_runs_from_one_pass_start_to_the_next(open_engine, t):
    # A pass whose files are all opened at once and consumed afterwards (a few big shards) must not look
    # infinitely fast to rf=auto: the pass lasts until the next one begins.
    e = open_engine(rf="auto", advance="strict")

    async def main():
        await t.read_view(e)  # every open within milliseconds: the first estimate is far too high
        first_guess = e.schedule.consumption_bps
        pass_bytes = e.data.opened_bytes
        await trio.sleep(0.5)  # the loader still consuming what it opened
        await t.read_file(e, e.schedule.view.order.tolist()[0])
        assert e.schedule.consumption_bps <= pass_bytes / 0.5
        assert e.schedule.consumption_bps < first_guess / 5

    t.run(main)


def test_lru_keeps_each_miss_while_the_evicted_copies_are_deleted_in_the_background(open_engine, t):
    e = open_engine(policy="lru")

    async def main():
        async with trio.open_nursery() as n:
            await n.start(e.run)
            kept = 0
            for _ in range(2):
                for f in e.schedule.view.order.tolist():
                    assert await t.read_file(e, f) == t.backing_bytes(e, f)
                    # the miss was copied into the room its evictions make once deleted, not read past the cache
                    assert e.cache.get(f) is not None
                    kept += 1
                    assert e.cache.used <= e.cache.capacity
            await t.deleted(e)
            assert e.cache.committed == e.cache.disk_bytes() and kept == 2 * e.tree.n_files
            n.cancel_scope.cancel()

    t.run(main)
    assert e.data.misses > e.tree.n_files  # (the cache holds a part: the second pass missed too)
