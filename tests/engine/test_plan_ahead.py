"""Plans and views made ahead, off the trio thread (issues 22, 25): the request that ends an epoch's last pass
never plans, and the request that ends any pass never makes the next pass's view (a permutation of the
mini-epoch and a mask of the tree).

The big test resumes an engine over a saved tree of 2,000,000 files (the path a remount takes: ``tree.bin`` and
the journal in the cache dir), so the planning it moves off the trio thread costs what it costs at scale.
"""

from __future__ import annotations

import os
import threading
import tracemalloc

import pytest
import trio

import tierfs.daemon.schedule.schedule
from sampler.plan import serving_order
from tierfs.daemon.cache.journal import load_position
from tierfs.daemon.schedule.consumers import ANONYMOUS
from tierfs.daemon.schedule.view import View
from tierfs.daemon.tree.keeper import TREE_NAME
from tierfs.testing.harness import synthetic_tree


@pytest.fixture
def plan_threads(monkeypatch):
    """The thread of every ``plan_epoch`` call the schedule makes (the real planner runs; only its caller's
    thread is noted)."""
    threads: list[int] = []
    real = tierfs.daemon.schedule.schedule.plan_epoch

    def noted(*args, **kwargs):
        threads.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(tierfs.daemon.schedule.schedule, "plan_epoch", noted)
    return threads


@pytest.fixture
def view_threads(monkeypatch):
    """The thread of every view the schedule makes (the real :class:`View`; only its maker's thread is noted)."""
    threads: list[int] = []

    class Noted(View):
        def __init__(self, *args, **kwargs) -> None:
            threads.append(threading.get_ident())
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(tierfs.daemon.schedule.schedule, "View", Noted)
    return threads


async def _until(what: str, pred, timeout: float = 120.0) -> None:
    with trio.move_on_after(timeout):
        while not pred():
            await trio.sleep(0.02)
        return
    raise AssertionError(f"timed out waiting for {what}")


def _engine_of_2m_files(open_engine, tmp_path, dataset, rf: int = 1):
    """An engine resumed over a saved tree of 2,000,000 files of 4 KiB, ``nm=2, advance=strict``."""
    backing, _ = dataset
    cache = tmp_path / "big-cache"
    settings = dict(capacity=8 << 30, cache=cache, nm=2, rf=rf, advance="strict")  # 2 x 3.8 GiB of 4 KiB
    open_engine(**settings).close()  # a cache dir of tierfs's own, with a journal at (0, 0, 0)
    synthetic_tree(backing, dirs=1000, per_dir=2000, size=4096).save(os.fspath(cache / TREE_NAME))
    e = open_engine(**settings)
    assert e.tree.n_files == 2_000_000 and e.trees.statistics().source == "saved"
    return e


@pytest.mark.slow
def test_ending_an_epochs_last_pass_at_2m_files_never_plans_on_the_trio_thread(open_engine, tmp_path, dataset, t,
                                                                                plan_threads):
    e = _engine_of_2m_files(open_engine, tmp_path, dataset)

    async def main():
        trio_thread = threading.get_ident()
        plan_threads.clear()
        async with trio.open_nursery() as n:
            # the planner alone (the rest of ``run`` would rescan a backing without these files), as run starts it
            e.schedule.plans_ahead = True
            n.start_soon(e.planner.run)
            e.control_write(b"next-pass\n")  # rf=1: mini-epoch 1, the epoch's last
            assert e.passes.current_mini_epoch == (0, 1)
            e.control_write(b"next-pass\n")  # its last pass: the switch into epoch 1 is due
            assert trio_thread not in plan_threads, "a request planned on the trio thread"
            await _until("the switch into epoch 1", lambda: e.passes.current_mini_epoch == (1, 0))
            assert e.schedule.pos.rf_effective == [1, 1, 0] and not e.schedule.pos.switch_due
            assert len(e.schedule.view) == len(e.schedule.plans[1][0]) > 900_000
            await _until("epoch 2 planned ahead", lambda: 2 in e.schedule.plans)
            n.cancel_scope.cancel()
        assert plan_threads and trio_thread not in plan_threads
        assert len(plan_threads) >= e.planner.made >= 2  # epochs 1 and 2

    t.run(main)


def _is_the_pass_view(sch) -> bool:
    """The view shown is the current mini-epoch's, in the order of the pass (as a view made inline has it)."""
    v, pos = sch.view, sch.pos
    return ((v.epoch, v.mini_epoch, v.pass_index) == (pos.epoch, pos.mini_epoch, pos.pass_index)
            and (v.order == serving_order(sch.current, seed=sch.settings.seed, epoch=pos.epoch,
                                          mini_epoch=pos.mini_epoch, pass_index=pos.pass_index)).all()
            and int(v.mask.sum()) == len(sch.current) and bool(v.mask[sch.current].all()))


@pytest.mark.slow
def test_ending_passes_mini_epochs_and_an_epoch_at_2m_files_makes_no_view_in_the_request(
        open_engine, tmp_path, dataset, t, plan_threads, view_threads):
    """What the request that ends a pass did at 2M files once its plan was made ahead: the next pass's serving
    order (a permutation of a million files) and mask, ~25 of the ~45 ms it held every reader (issue 25, 3:
    under 50 ms; docs/benchmarks.md, "Epoch boundary").  Now the planner makes both views a pass may need next
    in a worker thread, and the request takes the one it needs."""
    e = _engine_of_2m_files(open_engine, tmp_path, dataset, rf=2)
    sch = e.schedule

    async def main():
        trio_thread = threading.get_ident()
        async with trio.open_nursery() as n:
            sch.plans_ahead = True  # the planner alone, as run starts it
            n.start_soon(e.planner.run)
            for expected in [(0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0)]:  # a pass, a mini-epoch, a pass, an epoch
                await _until("the views made ahead", lambda: sch.view_job() is None and 1 in sch.plans)
                view_threads.clear()
                plan_threads.clear()
                e.control_write(b"next-pass\n")
                assert (*e.passes.current_mini_epoch, sch.pos.pass_index) == expected
                assert trio_thread not in view_threads + plan_threads, "the request made a view or a plan"
                assert _is_the_pass_view(sch)
                assert e.consumers.view_of(ANONYMOUS) is sch.view  # (an unnamed reader's listing: no view made)
            n.cancel_scope.cancel()
        stats = sch.statistics()
        assert (stats.views_ahead, stats.views_inline) == (4, 0)

    t.run(main)


def test_a_pass_whose_view_is_not_made_yet_gets_it_made_in_the_request_and_counted(open_engine):
    e = open_engine(capacity=1 << 20, nm=2, rf=2, advance="strict")
    sch = e.schedule
    sch.plans_ahead = True  # as while the engine runs, its planner behind (a reader raced through the pass)
    job = sch.view_job()  # the next pass's
    assert job is not None and job.key[1:] == (0, 0, 1)
    early = job.make()
    sch.set_disk_size(0, int(sch.disk_sizes[0]))  # a file changed while it was made: its bytes may be wrong
    assert not sch.adopt_view(job, early)
    e.control_write(b"next-pass\n")
    assert sch.view is not early and _is_the_pass_view(sch) and sch.pos.pass_index == 1
    assert (sch.statistics().views_ahead, sch.statistics().views_inline) == (0, 1)
    made = {}
    while (job := sch.view_job()) is not None:  # the next pass's and the next mini-epoch's first
        made[job.key[1:]] = job.make()
        assert sch.adopt_view(job, made[job.key[1:]])
    assert set(made) == {(0, 0, 2), (0, 1, 0)} and made[(0, 0, 2)].mask is sch.view.mask  # (the same files)
    e.control_write(b"next-pass\n")  # rf=2: the switch
    assert sch.view is made[(0, 1, 0)] and _is_the_pass_view(sch)
    assert (sch.statistics().views_ahead, sch.statistics().views_inline) == (1, 1)
    assert sch.view_job().key[1:] == (0, 1, 1)  # (epoch 1 is not planned yet: no next mini-epoch's view)


def test_a_whole_tree_view_is_made_ahead_only_in_the_last_eighth_of_a_pass(open_engine):
    """Under ``view=full`` a view is every file of the tree in the pass's order: a second order kept ahead all
    the time is 4 bytes a file the memory budget of a whole-tree mount (test_memory.py) has no room for, so the
    next pass's is wanted only once the pass is in its last eighth -- and then the request that ends the pass
    takes it, as under ``view=mini-epoch``."""
    e = open_engine(capacity=1 << 20, nm=2, rf=2, view="full")
    sch = e.schedule
    sch.plans_ahead = True  # as while the engine runs
    order = sch.view.order.tolist()
    first_of_tail = len(order) - len(order) // 8
    assert len(order) >= 16
    for fidx in order[:first_of_tail - 1]:
        e.passes.file_opened(fidx, 0, os.getuid())
        assert sch.view_job() is None  # (no second order of the tree before the pass's tail)
    e.passes.file_opened(order[first_of_tail - 1], 0, os.getuid())  # into the last eighth
    job = sch.view_job()
    assert job is not None and job.key[1:] == (0, 0, 1) and job.mask is sch.view.mask
    made = job.make()
    assert sch.adopt_view(job, made) and sch.view_job() is None
    for fidx in order[first_of_tail:]:
        e.passes.file_opened(fidx, 0, os.getuid())
    assert sch.pos.pass_index == 1 and sch.view is made  # the pass ended: it took the view made ahead
    assert (sch.statistics().views_ahead, sch.statistics().views_inline) == (1, 0)
    assert len(made) == len(order) and sorted(made.order.tolist()) == sorted(order)
    assert sch.view_job() is None  # the new pass: nothing ahead until its own last eighth


@pytest.mark.slow
def test_a_switch_at_2m_files_makes_no_python_object_per_file(open_engine, tmp_path, dataset):
    """The request that switches mini-epochs holds every reader of the mount (issue 25: under 50 ms at 2M files,
    docs/benchmarks.md).  What made it take 0.3-1.5 s was a Python object per file of the mini-epoch -- sets of
    the pending files, a deque of the staging order, the ``tolist()`` that fed them: 122 bytes traced per file
    of the tree.  Arrays and masks cost a few bytes per file; the bound here leaves room for those only."""
    e = _engine_of_2m_files(open_engine, tmp_path, dataset)
    e.schedule.plan(1)  # (made now, as the planner would have made it by then: planning is not measured here)
    for expected in [(0, 1), (1, 0)]:  # within an epoch, and into the next one
        tracemalloc.start()
        try:
            e.control_write(b"next-pass\n")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert e.passes.current_mini_epoch == expected
        assert len(e.schedule.pending_next) + len(e.schedule.pending_current) > 900_000  # (nothing is cached)
        assert peak / e.tree.n_files < 24, f"{peak / e.tree.n_files:.1f} bytes per file at the switch to {expected}"


def test_a_switch_due_while_the_next_epoch_is_planned_is_made_when_the_plan_lands(open_engine, t):
    e = open_engine(capacity=1 << 20, nm=2, rf=1, advance="strict")
    e.schedule.plans_ahead = True  # as while the planner runs and has not handed over epoch 1's plan yet
    e.control_write(b"next-pass\n")  # into mini-epoch 1, the epoch's last: what comes after is not planned
    inline = e.schedule.statistics().views_inline
    assert e.passes.current_mini_epoch == (0, 1) and e.schedule.next_coords is None and not len(e.schedule.next_files)
    assert not e.passes.next_ready()
    e.control_write(b"next-pass\n")  # the last pass ends: the switch is due, the view stays
    assert e.passes.current_mini_epoch == (0, 1) and e.schedule.pos.switch_due and e.schedule.pos.pass_index == 1
    assert len(e.schedule.view) == len(e.schedule.plans[0][1])

    async def main():
        async with trio.open_nursery() as n:
            n.start_soon(e.planner.run)
            await _until("the switch", lambda: e.passes.current_mini_epoch == (1, 0))
            n.cancel_scope.cancel()

    t.run(main)
    assert not e.schedule.pos.switch_due and e.schedule.pos.rf_effective == [1, 1, 0]
    assert (e.schedule.view.files == e.schedule.plans[1][0]).all()
    # (the planner made the view before it told the engine: the switch took it ready-made)
    assert e.schedule.statistics().views_inline == inline + 1  # (the pass shown meanwhile: no planner ran)
    assert e.schedule.statistics().views_ahead == 1 and _is_the_pass_view(e.schedule)


def test_a_due_switch_never_takes_the_view_from_a_reader_who_began_the_pass_shown_meanwhile(open_engine, t):
    e = open_engine(capacity=1 << 20, nm=2, rf=1, advance="strict")
    e.schedule.plans_ahead = True  # as while the planner runs and has not handed over epoch 1's plan yet
    e.control_write(b"next-pass\n")
    e.control_write(b"next-pass\n")
    assert e.passes.current_mini_epoch == (0, 1) and e.schedule.pos.switch_due

    async def main():
        order = e.schedule.view.order.tolist()
        await t.read_file(e, order[0])  # a reader begins the pass shown while epoch 1 is planned
        async with trio.open_nursery() as n:
            n.start_soon(e.planner.run)
            await _until("the plan of epoch 1", lambda: e.schedule.next_coords is not None)
            n.cancel_scope.cancel()
        assert e.passes.current_mini_epoch == (0, 1) and e.schedule.pos.switch_due  # the reader's view stays
        for f in order[1:]:
            assert await t.read_file(e, f) == t.backing_bytes(e, f)
        assert e.passes.current_mini_epoch == (1, 0) and not e.schedule.pos.switch_due  # switched at the pass's end
        assert e.schedule.pos.rf_effective == [1, 2, 0]

    t.run(main)


def test_a_due_switch_is_journalled_and_made_when_the_mount_resumes(open_engine, t):
    e = open_engine(capacity=1 << 20, nm=2, rf=1, advance="strict")
    e.schedule.plans_ahead = True  # as while the planner runs, epoch 1's plan not landed
    e.control_write(b"next-pass\n")
    e.control_write(b"next-pass\n")
    assert e.passes.current_mini_epoch == (0, 1) and e.schedule.pos.switch_due
    e.close()
    assert load_position(e.config.cache).switch_due
    e2 = open_engine(capacity=1 << 20, nm=2, rf=1, advance="strict")
    assert e2.passes.current_mini_epoch == (1, 0) and not e2.schedule.pos.switch_due
    assert e2.schedule.pos.rf_effective == [1, 1, 0] and e2.schedule.pos.pass_index == 0


def test_a_plan_made_with_settings_replaced_meanwhile_is_not_kept(open_engine):
    e = open_engine(capacity=1 << 20, nm=2, rf=1)
    sch = e.schedule
    sch.plans_ahead = True
    job = sch.plan_job()  # what the planner takes: epoch 1, with nm=2
    assert job is not None and job.epoch == 1 and job.settings.nm == 2
    sizes = job.sizes.copy()
    sch.set_disk_size(0, 1 << 19)  # a file grew while the job ran: the job's sizes are not written
    assert (job.sizes == sizes).all() and sch.disk_sizes[0] == 1 << 19
    e.control_write(b"nm=4\n")
    assert not sch.adopt(job, *job.make(), e.cache) and 1 not in sch.plans
    again = sch.plan_job()
    assert again is not None and again.epoch == 1 and again.settings.nm == 4
    sch.adopt(again, *again.make(), e.cache)
    assert len(sch.plans[1]) == 4 and sch.plan_job() is None


def test_a_plan_that_cannot_be_made_is_reported_and_made_once_it_can(open_engine, t):
    e = open_engine(capacity=1 << 20, mini_epoch_size=256 << 10, rf=1)  # (the data set: one mini-epoch)
    sch = e.schedule
    sch.plans_ahead = True  # as while the engine runs
    e.control_write(b"mini_epoch_size=200K\n")  # epoch 1 is to be planned again
    assert 1 not in sch.plans and sch.next_coords is None
    size = int(sch.disk_sizes[0])
    sch.set_disk_size(0, 1 << 20)  # then a file grows past half the cache

    async def main():
        async with trio.open_nursery() as n:
            n.start_soon(e.planner.run)
            await _until("the failure reported", lambda: e.status().last_error is not None)
            assert "epoch 1 cannot be planned" in e.status().last_error and 1 not in sch.plans
            sch.set_disk_size(0, size)
            e.planner.notify()
            await _until("the plan", lambda: 1 in sch.plans)
            n.cancel_scope.cancel()
        assert e.status().last_error is None

    t.run(main)


def test_an_unnamed_reader_that_has_opened_nothing_lists_the_mounts_pass(open_engine):
    """A reader not counted yet joins at the mount's pass: its listing is the mount's view, made ahead -- not a
    view of the pass it was first seen in, made in its listing's request (a permutation of the mini-epoch)."""
    e = open_engine(capacity=1 << 20, nm=2, rf=2, advance="strict")
    e.control_write(b"next-pass\n")  # (written by the unnamed consumer, which opened nothing: it is not live)
    assert e.schedule.pos.pass_index == 1 and e.consumers.get(ANONYMOUS).state == "new"
    assert e.consumers.view_of(ANONYMOUS) is e.schedule.view


def test_a_replan_while_the_view_of_a_due_switch_is_made_plans_again_and_switches_then(open_engine, t, monkeypatch):
    """Between a plan landing and the switch it allows, the planner makes the switch's view (an await): new
    settings written meanwhile drop that plan, and the switch waits for the next one."""
    e = open_engine(capacity=1 << 20, nm=2, rf=1, advance="strict")
    sch = e.schedule
    sch.plans_ahead = True  # as while the planner runs and has not handed over epoch 1's plan yet
    e.control_write(b"next-pass\n")
    e.control_write(b"next-pass\n")
    assert e.passes.current_mini_epoch == (0, 1) and sch.pos.switch_due
    started, release = threading.Event(), threading.Event()
    real = tierfs.daemon.schedule.schedule.ViewJob.make

    def held(job):
        if job.key[1:] == (1, 0, 0):
            started.set()
            assert release.wait(60), "the test never released the view"
        return real(job)

    monkeypatch.setattr(tierfs.daemon.schedule.schedule.ViewJob, "make", held)

    async def main():
        async with trio.open_nursery() as n:
            n.start_soon(e.planner.run)
            await _until("the view of the switch under way", started.is_set)
            e.control_write(b"nm=4\n")  # epoch 1's plan is dropped: it is planned again with nm=4
            release.set()
            await _until("the switch", lambda: e.passes.current_mini_epoch == (1, 0))
            n.cancel_scope.cancel()

    t.run(main)
    assert len(sch.plans[1]) == 4 and not sch.pos.switch_due and _is_the_pass_view(sch)
