"""The staging engine: next mini-epoch staged in storage order under the cap, atomically, then evicted."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
import trio
import trio.testing

from sampler.atomic import TEMP_PREFIX
from tierfs.common.options import MountConfig, Settings
from tierfs.daemon.cache.store import path_hash
from tierfs.daemon.coordinator.engine import Engine
from tierfs.daemon.schedule.schedule import Pending
from tierfs.testing.harness import make_dataset


async def _with_stager(e: Engine, body):
    async with trio.open_nursery() as n:
        await n.start(e.run)
        await body()
        n.cancel_scope.cancel()


def test_stages_current_then_next_in_storage_order(open_engine, t):
    e = open_engine()
    order: list[int] = []
    begin = e.stager._begin

    def spy(fidx):
        order.append(fidx)  # copies start in this order (they may finish out of order: several run at once)
        return begin(fidx)

    e.stager._begin = spy

    async def main():
        await _with_stager(e, lambda: t.settle(e))

    t.run(main)
    cur, nxt = e.schedule.current.tolist(), e.schedule.next_files.tolist()
    assert sorted(order) == sorted(cur + nxt)
    assert order == sorted(cur) + sorted(nxt)  # the current one first (nothing cached at mount), storage order
    assert e.passes.next_ready()
    assert e.status().prefetch.files_done == len(nxt)


def test_capacity_cap_holds_at_every_instant(open_engine, t):
    e = open_engine()
    seen: list[int] = []
    reserve = e.cache.reserve

    def spy(n):
        ok = reserve(n)
        seen.append(e.cache.used)
        assert e.cache.used <= e.cache.capacity
        return ok

    e.cache.reserve = spy

    async def sampler():
        while True:
            assert e.cache.disk_bytes() <= e.cache.capacity  # temp files included
            assert e.cache.used <= e.cache.capacity
            await trio.sleep(0)

    async def main():
        async with trio.open_nursery() as n:
            n.start_soon(sampler)
            await n.start(e.run)
            for _ in range(12):  # 3 epochs of 4 mini-epochs, 2 passes each
                await t.settle(e)
                await t.read_view(e)
                await t.read_view(e)
            n.cancel_scope.cancel()

    t.run(main)
    assert seen and max(seen) <= e.cache.capacity
    assert e.schedule.pos.epoch >= 2


def test_no_partial_file_is_ever_visible(open_engine, t):
    e = open_engine()
    names: set[str] = set()
    size_of = {path_hash(e.tree.file_path(f)): int(e.tree.sizes[f]) for f in range(e.tree.n_files)}

    async def watcher():
        while True:
            for name in os.listdir(e.cache.data_path):
                if not name.startswith(TEMP_PREFIX):
                    names.add(name)
                    st = os.stat(os.path.join(e.cache.data_path, name))
                    assert st.st_size == size_of[int(name.split("-")[0], 16)]  # complete when it has its name
            await trio.sleep(0)

    async def main():
        async with trio.open_nursery() as n:
            n.start_soon(watcher)
            await n.start(e.run)
            await t.settle(e)
            n.cancel_scope.cancel()

    t.run(main)
    assert names


def test_evicts_previous_mini_epoch_after_switch_but_not_open_files(open_engine, t):
    e = open_engine(rf=1)

    async def main():
        async with trio.open_nursery() as n:
            await n.start(e.run)
            await t.settle(e)
            first = e.schedule.current.tolist()
            keep = first[0]
            h = await e.data.open_file(keep)  # held open across the switch
            for f in e.schedule.view.order.tolist():
                if f != keep:
                    await t.read_file(e, f)
            assert e.schedule.pos.mini_epoch == 1
            entry = h.entry
            assert entry is not None and entry.doomed
            assert os.path.exists(os.path.join(e.cache.data_path, entry.name))  # still there while open
            assert all(e.cache.get(f) is None for f in first if f not in e.schedule.wanted.nonzero()[0])
            assert await e.data.read(h, 0, 1 << 20) == t.backing_bytes(e, keep)
            await e.data.release(h)
            assert e.cache.deleting_bytes >= entry.disk  # queued on release: the cache's task unlinks it
            await t.deleted(e)
            assert not os.path.exists(os.path.join(e.cache.data_path, entry.name))  # gone after its release
            n.cancel_scope.cancel()

    t.run(main)


def test_cache_files_are_private(open_engine, t):
    e = open_engine()

    async def main():
        await _with_stager(e, lambda: t.settle(e))

    t.run(main)
    assert stat.S_IMODE(os.stat(e.cache.path).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(e.cache.data_path).st_mode) == 0o700
    for name in os.listdir(e.cache.data_path):
        assert stat.S_IMODE(os.stat(os.path.join(e.cache.data_path, name)).st_mode) == 0o600


def test_bandwidth_cap_paces_backing_reads(open_engine):
    e = open_engine(bandwidth=1000)
    clock = trio.testing.MockClock(autojump_threshold=0)

    async def main():
        t0 = trio.current_time()
        for _ in range(5):
            await e.backing.throttle(500)
        # 2500 bytes at 1000 B/s: the fifth chunk may start only after 2 s
        assert trio.current_time() - t0 == pytest.approx(2.0)
        e.apply_settings(Settings(**{**e.settings.__dict__, "bandwidth": 0}), replan=False)
        t1 = trio.current_time()
        await e.backing.throttle(10**9)
        assert trio.current_time() == t1  # 0 = no cap

    trio.run(main, clock=clock)


@pytest.mark.parametrize("capacity_factor, nm, needle", [(None, 4, "largest file"), (3.0, 1, "nm >=")])
def test_impossible_configurations_refused_up_front(tmp_path, dataset, capacity_factor, nm, needle):
    backing, files = dataset
    biggest = max(files.values())
    capacity = int(biggest * 1.5) if capacity_factor is None else int(sum(files.values()) / capacity_factor)
    e = Engine(MountConfig(os.fspath(backing), os.fspath(tmp_path / "m"), os.fspath(tmp_path / "c"), capacity,
                           Settings(nm=nm)))
    with pytest.raises(ValueError, match=needle):
        e.open()
    e.close()


def test_cache_inside_backing_refused(tmp_path, dataset):
    backing, _ = dataset
    e = Engine(MountConfig(os.fspath(backing), os.fspath(tmp_path / "m"), os.fspath(backing / "cache"), 1 << 20))
    with pytest.raises(ValueError, match="inside the backing"):
        e.open()
    e.close()
    assert not (backing / "cache").exists()


def test_second_engine_on_same_cache_refused(open_engine, tmp_path, dataset):
    open_engine()
    backing, _ = dataset
    e = Engine(MountConfig(os.fspath(backing), "", os.fspath(tmp_path / "cache"), 1 << 20))
    with pytest.raises(ValueError, match="in use"):
        e.open()
    e.close()


def test_staging_yields_to_readers_and_still_finishes(open_engine, t, tmp_path):
    """While a reader keeps opening files, the copies of the next mini-epoch are paced (the stager waits, so
    that they use at most a share of a core, and says so in status); once reading stops they run at full
    speed, and every copy is whole."""
    backing = tmp_path / "many"
    make_dataset(backing, dirs=4, files_per_dir=400, max_size=2048, seed=5)
    e = open_engine(backing_dir=backing, nm=4)
    stop = trio.Event()

    async def reader():
        view = e.schedule.view.order.tolist()
        while not stop.is_set():
            for f in view:
                assert await t.read_file(e, f) == t.backing_bytes(e, f)
            await trio.sleep(0)

    async def main():
        async with trio.open_nursery() as n:
            await n.start(e.run)
            n.start_soon(reader)
            with trio.fail_after(30):
                while e.stager.statistics().yielded_seconds == 0:
                    await trio.sleep(0.01)
            stop.set()
            await t.settle(e)
            n.cancel_scope.cancel()

    t.run(main)
    assert e.status().staging.yielded_seconds > 0
    assert e.passes.next_ready()
    for f in e.schedule.next_files.tolist():
        entry = e.cache.get(f)
        assert entry is not None
        with open(os.path.join(e.cache.data_path, entry.name), "rb") as copy:
            assert copy.read() == t.backing_bytes(e, f)


def test_without_readers_staging_never_waits(open_engine, t):
    e = open_engine()

    async def main():
        await _with_stager(e, lambda: t.settle(e))

    t.run(main)
    assert e.stager.statistics().yielded_seconds == 0


def _mask(e: Engine, files: list[int]) -> np.ndarray:
    mask = np.zeros(e.tree.n_files, bool)
    mask[files] = True
    return mask


def test_staging_yields_only_while_it_is_ahead_of_the_readers(open_engine, t):
    """Readers first, but never at the price of a late mini-epoch: staging may yield only while the next one is
    staged further than it must be to be complete at three quarters of the current one's rf passes."""
    e = open_engine(rf=4)

    async def main():
        await _with_stager(e, lambda: t.settle(e))

    t.run(main)
    sch = e.schedule
    nxt = sch.next_files.tolist()
    assert nxt and not sch.pending_next and sch.staging_ahead(4)  # all staged: ahead
    sch.pending_next = Pending(e.tree.sizes, _mask(e, nxt))
    assert not sch.staging_ahead(4)  # nothing staged: behind from the first open on
    sch.pending_next = Pending(e.tree.sizes, _mask(e, nxt[: len(nxt) // 2]))  # half staged
    assert sch.staging_ahead(4)  # nothing read yet
    sch.pos.pass_index = 2  # half of the passes made: it must be all but done by now
    assert not sch.staging_ahead(4)
    assert sch.staging_ahead(100)  # with many passes to go it is ahead again
