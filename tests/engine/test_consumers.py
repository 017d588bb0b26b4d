"""Consumers (consumers.py): passes per job, each its own order, the wait bounded by ``consumer_timeout``, ARF
decided by every live consumer -- the engine driven directly, the consumer named as ``operations.py`` names it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import trio
import trio.testing

from tierfs.cli.status_text import WIDTH, format_status
from tierfs.daemon.access import OWNER_UID
from tierfs.daemon.schedule import consumers
from tierfs.daemon.schedule.consumers import ANONYMOUS, MAX_CONSUMERS, MAX_CONSUMERS_PER_USER


async def _read(e, fidx: int, who: str) -> None:
    h = await e.data.open_file(fidx, OWNER_UID, who)
    await e.data.release(h)


async def _read_pass(e, who: str) -> None:
    """One pass of ``who``: its listing of the root (which may wait), then every view file in its order."""
    await e.passes.begin_pass(OWNER_UID, who, relisted=True)
    for f in e.consumers.view_of(who).order.tolist():
        await _read(e, f, who)


def _passes(e, who: str) -> int:
    return e.consumers.get(who).passes


def test_the_mount_moves_when_every_live_consumer_made_rf_passes(open_engine, t):
    e = open_engine(rf=2, advance="strict", consumer_timeout=30)

    async def main():
        await e.passes.begin_pass(OWNER_UID, "b", relisted=True)
        b_order = e.consumers.view_of("b").order.tolist()
        await _read(e, b_order[0], "b")  # b takes part
        await _read_pass(e, "a")
        await _read_pass(e, "a")
        assert _passes(e, "a") == 2 and e.schedule.pos.pass_index == 0 and e.schedule.pos.mini_epoch == 0
        for f in b_order[1:]:
            await _read(e, f, "b")
        assert e.schedule.pos.pass_index == 1 and e.schedule.pos.mini_epoch == 0
        await _read_pass(e, "b")
        assert e.schedule.pos.mini_epoch == 1 and e.schedule.pos.rf_effective == [2, 0]
        assert _passes(e, "a") == _passes(e, "b") == 0
        st = {c.name: c for c in e.consumers.statistics(30).consumers}
        assert st["a"].passes_total == st["b"].passes_total == 2 and st["a"].state == st["b"].state == "live"

    t.run(main)


def test_each_consumer_lists_and_orders_the_same_view_its_own_way(open_engine, t):
    e = open_engine(rf=3)

    async def main():
        anonymous, a, b = e.names.order_text(), e.names.order_text("a"), e.names.order_text("b")
        assert anonymous == e.schedule.view.order_text()  # a reader that names nothing: as before consumers
        assert a != b and sorted(a.splitlines()) == sorted(b.splitlines()) == sorted(anonymous.splitlines())
        assert list(e.names.list_dir(1, OWNER_UID, "a")) == list(e.names.list_dir(1, OWNER_UID, "b"))  # folders
        d = e.names.list_dir(1)[0][1]
        la, lb = list(e.names.list_dir(d, OWNER_UID, "a")), list(e.names.list_dir(d, OWNER_UID, "b"))
        assert sorted(la) == sorted(lb) and (la != lb or len(la) < 2)
        await _read(e, int(e.schedule.view.order[0]), "b")  # b takes part
        await _read_pass(e, "a")
        assert (_passes(e, "a"), _passes(e, "b"), e.schedule.pos.pass_index) == (1, 0, 0)
        e.names.list_dir(1, OWNER_UID, "b")  # b's listing after a read ends b's pass, nothing of a's
        assert _passes(e, "a") == _passes(e, "b") == 1 and e.schedule.pos.pass_index == 1
        e.control_write(b"next-pass\n", "a")  # a's own pass only
        assert (_passes(e, "a"), _passes(e, "b"), e.schedule.pos.pass_index) == (2, 1, 1)

    t.run(main)


def test_a_consumer_ahead_waits_at_most_consumer_timeout_then_the_laggard_is_dropped_and_rejoins(open_engine, t):
    e = open_engine(rf=2, advance="strict", consumer_timeout=0.3)
    # trio's clock made virtual: it stands still unless jumped, so a machine under load (the process stalled past
    # the 0.3 s timeout before the check ran) cannot change what is seen -- the test was flaky on a loaded box
    clock = trio.testing.MockClock()

    async def main():
        await _read(e, int(e.schedule.view.order[0]), "slow")
        await _read_pass(e, "fast")
        await _read_pass(e, "fast")
        assert e.schedule.pos.mini_epoch == 0
        waited = False

        async def nudge():
            nonlocal waited
            await trio.testing.wait_all_tasks_blocked()  # fast parked in its wait for slow
            waited = e.consumers.get("fast").waiting_since is not None
            clock.jump(0.29)
            await trio.testing.wait_all_tasks_blocked()
            assert e.consumers.get("slow").state == "live"  # not before consumer_timeout ...
            clock.jump(0.02)  # ... and at it

        async with trio.open_nursery() as n:
            n.start_soon(nudge)
            await e.passes.begin_pass(OWNER_UID, "fast", relisted=True)  # waits for slow, then drops it
        assert waited
        slow = e.consumers.get("slow")
        assert slow.state == "dropped" and e.consumers.drops == 1
        assert e.schedule.pos.mini_epoch == 1 and e.consumers.get("fast").passes == 0
        # it rejoins at the mount's position: its next listing, then its first open of a view file
        await e.passes.begin_pass(OWNER_UID, "slow", relisted=True)
        await _read(e, int(e.schedule.view.order[0]), "slow")
        assert slow.state == "live" and slow.passes == 0

    trio.run(main, clock=clock)


def test_arf_leaves_early_only_when_every_live_consumer_says_advance(open_engine, t):
    e = open_engine(rf=8, arf="score", arf_wait=1)

    async def main():
        for who in ("a", "b"):
            await _read(e, int(e.schedule.view.order[0]), who)
        for loss in (1.0, 2.0):  # no better: a's ARF says advance
            e.control_write(f"feedback loss={loss}\n".encode(), "a")
        assert e.consumers.get("a").advance_vote and not e.schedule.advance_requested  # b's has not
        for loss in (1.0, 2.0):
            e.control_write(f"feedback loss={loss}\n".encode(), "b")
        assert e.schedule.advance_requested  # (the switch waits for the next mini-epoch to be staged)

    t.run(main)


def test_status_shows_each_consumer(open_engine, t):
    e = open_engine(rf=2)

    async def main():
        assert "consumers" not in format_status(e.status().as_dict())  # one anonymous reader: as before
        for who in ("lr0.1", "lr0.01"):
            await _read(e, int(e.schedule.view.order[0]), who)
        st = e.status()
        assert [(c.name, c.state, c.opens) for c in st.consumers.consumers] == [
            ("lr0.01", "live", 1), ("lr0.1", "live", 1)]
        text = format_status(st.as_dict())
        assert "consumers  2 live of 2" in text and "  lr0.1 " in text and "1/" in text
        assert all(len(line) <= WIDTH for line in text.splitlines())
        prom = st.to_prometheus()
        assert 'tierfs_consumer_opens_total{consumer="lr0.1"} 1' in prom and "tierfs_consumers_live 2" in prom
        assert prom.count("# TYPE tierfs_consumer_opens_total") == 1

    t.run(main)


# A process named by its environment, with THREADS threads of its own: prints their thread ids (pids to FUSE: a
# request carries the calling thread's), then waits until its stdin closes.
_NAMED = """
import sys, threading
stop = threading.Event()
threads = [threading.Thread(target=stop.wait) for _ in range(int(sys.argv[1]))]
for t in threads:
    t.start()
print(*(t.native_id for t in threads), flush=True)
sys.stdin.read()
stop.set()
"""


def _named(name: str, threads: int = 0) -> tuple[subprocess.Popen, list[int]]:
    """A process started with ``TIERFS_CONSUMER=name`` and its thread ids (its own pid first)."""
    env = {**os.environ, "TIERFS_CONSUMER": name}
    p = subprocess.Popen([sys.executable, "-c", _NAMED, str(threads)], env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    return p, [p.pid, *map(int, p.stdout.readline().split())]


def _end(p: subprocess.Popen) -> None:
    p.communicate("", timeout=30)


def test_only_users_who_steer_have_names(open_engine, t):
    """The owner and the steering group's members are named from their environment; anyone else is the anonymous
    consumer, and a gone process too."""
    e = open_engine(group="nogroup")  # (nobody, 65534, is a member)
    p, (pid,) = _named("job1")
    try:
        async def main():
            assert await e.consumers.name_of(pid, OWNER_UID) == "job1"
            assert await e.consumers.name_of(pid, 65534) == "job1"
            assert await e.consumers.name_of(pid, 12345) == ANONYMOUS  # served uncounted: nothing read
        t.run(main)
    finally:
        _end(p)

    async def gone():
        assert await e.consumers.name_of(pid, 65534) == ANONYMOUS  # (its start time is gone with it)
    t.run(gone)


def test_warnings_about_one_users_names_are_rate_limited(open_engine, t, caplog, monkeypatch):
    """Forty threads of a process whose name is not one, each read (a thread is a requester of its own): one
    warning, not forty; the next one after WARN_EVERY says how many were left out."""
    e = open_engine()
    p, tids = _named("not a name!", threads=40)
    try:
        async def main():
            with caplog.at_level(logging.WARNING, logger="tierfs"):
                for tid in tids:
                    assert await e.consumers.name_of(tid, OWNER_UID) == ANONYMOUS
            lines = [r.getMessage() for r in caplog.records if "is not a consumer name" in r.getMessage()]
            assert len(lines) == 1, lines
            monkeypatch.setattr(consumers, "PID_TTL", 0.0)  # (read again, now that a minute has "passed")
            monkeypatch.setattr(consumers, "WARN_EVERY", 0.0)
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="tierfs"):
                assert await e.consumers.name_of(tids[0], OWNER_UID) == ANONYMOUS
            assert [r.getMessage() for r in caplog.records][-1].endswith(
                f"({len(tids) - 1} more such warnings about uid {OWNER_UID} left out)")
        t.run(main)
    finally:
        _end(p)


def test_a_users_named_consumers_are_capped_and_the_rest_read_as_anonymous(open_engine, t):
    """One user's names past MAX_CONSUMERS_PER_USER, all live, read as the anonymous consumer; another user's
    names still join; one of the first user's dropped makes room; the table never passes MAX_CONSUMERS."""
    e = open_engine(consumer_timeout=30)
    first = int(e.schedule.view.order[0])

    async def join(name: str, uid: int) -> str:
        who = e.consumers.admit(name, uid)
        await _read(e, first, who)  # live: never forgotten for another
        return who

    async def main():
        got = [await join(f"a{i}", 1000) for i in range(MAX_CONSUMERS_PER_USER + 8)]
        assert got == [f"a{i}" for i in range(MAX_CONSUMERS_PER_USER)] + [ANONYMOUS] * 8
        assert sum(c.uid == 1000 for c in e.consumers._table.values()) == MAX_CONSUMERS_PER_USER
        assert await join("b0", 1001) == "b0"  # another user is not held back by the first one's names
        e.consumers.drop(e.consumers.get("a3"), "gone")
        assert await join("a-new", 1000) == "a-new" and "a3" not in e.consumers._table
        for uid in range(2000, 2000 + MAX_CONSUMERS // MAX_CONSUMERS_PER_USER + 1):
            for i in range(MAX_CONSUMERS_PER_USER):
                await join(f"u{uid}-{i}", uid)
        assert len(e.consumers._table) <= MAX_CONSUMERS

    t.run(main)


# ------------------------------------------------------------------ jobs that wait for nobody (issue 48, item 8)
# trio's clock made virtual (as above) and moved by the test alone: a wait the old code made shows as the
# consumer_timeout (30 s) the test jumps it by, whatever the machine's load, and a test that would hang on it ends.


async def _begin_pass(e, clock, who: str) -> float:
    """``who`` lists the root; if it waits there, the clock is jumped by consumer_timeout (the old code's wait):
    the virtual seconds it waited."""
    start = trio.current_time()

    async def nudge():
        await trio.testing.wait_all_tasks_blocked()
        if e.consumers.get(who).waiting_since is not None:
            clock.jump(e.settings.consumer_timeout)

    async with trio.open_nursery() as n:
        n.start_soon(nudge)
        await e.passes.begin_pass(OWNER_UID, who, relisted=True)
    return trio.current_time() - start


async def _read_pass_timed(e, clock, who: str) -> float:
    waited = await _begin_pass(e, clock, who)
    for f in e.consumers.view_of(who).order.tolist():
        await _read(e, f, who)
    return waited


def test_an_anonymous_reader_never_holds_named_jobs(open_engine, t, caplog):
    """An operator's ``cat`` and ``ls`` (no TIERFS_CONSUMER) before and while a named job reads: the job makes its
    rf passes per mini-epoch without waiting; once no named job is live the anonymous readers count again."""
    e = open_engine(rf=2, advance="strict", consumer_timeout=30)
    clock = trio.testing.MockClock()

    async def main():
        await _read(e, int(e.schedule.view.order[0]), ANONYMOUS)  # an operator's cat, alone: it counts
        assert e.consumers.get(ANONYMOUS).state == "live"
        with caplog.at_level(logging.INFO, logger="tierfs"):
            waited = await _read_pass_timed(e, clock, "a")  # a named job joins: the anonymous readers step aside
        assert e.consumers.get(ANONYMOUS).state == "new"
        assert any("no longer count passes while a" in r.getMessage() for r in caplog.records)
        waited += await _begin_pass(e, clock, ANONYMOUS)  # an operator's ls: it never waits ...
        await _read(e, int(e.schedule.view.order[1]), ANONYMOUS)  # ... and its cat joins nothing
        for _ in range(5):  # two more mini-epochs, nobody waited for
            waited += await _read_pass_timed(e, clock, "a")
        assert waited == 0, "a named job waited for the anonymous readers"
        assert e.schedule.pos.mini_epoch == 3 and e.consumers.drops == 0
        assert e.consumers.get(ANONYMOUS).state == "new" and e.consumers.get("a").state == "live"
        e.consumers.drop(e.consumers.get("a"), "test")  # no named job live: the anonymous readers count again
        await _read(e, int(e.schedule.view.order[0]), ANONYMOUS)
        assert e.consumers.get(ANONYMOUS).state == "live"

    trio.run(main, clock=clock)


def _exited(p: subprocess.Popen) -> None:
    """``p`` ends (its stdin closed) and stays a zombie: not reaped, as by a launcher that has not looked yet."""
    p.stdin.close()

    def zombie() -> bool:
        with open(f"/proc/{p.pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"

    deadline = time.monotonic() + 30
    while not zombie():
        assert time.monotonic() < deadline, "the named process did not exit"
        time.sleep(0.01)


async def _named_reads(e, pid: int, name: str) -> None:
    """Process ``pid`` reads as consumer ``name``, and it opens the first file of the view (it takes part)."""
    assert await e.consumers.name_of(pid, OWNER_UID) == name
    await _read(e, int(e.schedule.view.order[0]), name)


def test_a_job_that_exited_is_dropped_at_once_and_the_log_says_which_and_why(open_engine, t, caplog):
    e = open_engine(rf=2, advance="strict", consumer_timeout=30)
    p, (pid,) = _named("early-stopped")
    clock = trio.testing.MockClock()
    try:
        t.run(lambda: _named_reads(e, pid, "early-stopped"))  # it takes part, then stops
        _exited(p)  # (a zombie: gone all the same)

        async def main():
            await _read_pass(e, "a")
            await _read_pass(e, "a")
            with caplog.at_level(logging.WARNING, logger="tierfs"):
                waited = await _begin_pass(e, clock, "a")  # would wait for the job that exited
            assert waited == 0, "a waited for a job that had exited"
            assert e.consumers.get("early-stopped").state == "dropped" and e.schedule.pos.mini_epoch == 1
            lines = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
            assert len(lines) == 1 and lines[0].startswith("consumer early-stopped dropped")
            assert f"none of its processes is alive (it exited or was killed: pid {pid}," in lines[0]

        trio.run(main, clock=clock)
    finally:
        if not p.stdin.closed:
            p.stdin.close()
        p.wait(timeout=30)
        p.stdout.close()


def test_a_job_that_exits_during_the_wait_is_dropped_within_alive_every(open_engine, t, caplog):
    e = open_engine(rf=2, advance="strict", consumer_timeout=30)
    p, (pid,) = _named("b")
    clock = trio.testing.MockClock()
    try:
        t.run(lambda: _named_reads(e, pid, "b"))

        async def main():
            await _read_pass(e, "a")
            await _read_pass(e, "a")
            start = trio.current_time()

            async def nudge():
                await trio.testing.wait_all_tasks_blocked()  # a waits for b, which is alive
                assert e.consumers.get("a").waiting_since is not None and e.consumers.get("b").state == "live"
                _end(p)  # b exits (reaped)
                clock.jump(consumers.ALIVE_EVERY + 0.05)
                await trio.testing.wait_all_tasks_blocked()
                if e.consumers.get("a").waiting_since is not None:
                    clock.jump(30)  # (the old code: the whole consumer_timeout)

            with caplog.at_level(logging.WARNING, logger="tierfs"):
                async with trio.open_nursery() as n:
                    n.start_soon(nudge)
                    await e.passes.begin_pass(OWNER_UID, "a", relisted=True)
            assert trio.current_time() - start < 1, "a waited consumer_timeout for a job that had exited"
            assert e.consumers.get("b").state == "dropped" and e.schedule.pos.mini_epoch == 1
            assert any(r.getMessage().startswith("consumer b dropped") and "none of its processes is alive"
                       in r.getMessage() for r in caplog.records)

        trio.run(main, clock=clock)
    finally:
        _end(p)


def test_after_the_named_jobs_exited_an_unnamed_job_moves_the_mount(open_engine, t):
    """A sweep's jobs all exited, an unnamed job reads next: it counts again (they no longer keep it out), and
    its wait, once ahead, drops them at once -- the mount moves on with it."""
    e = open_engine(rf=2, advance="strict", consumer_timeout=30)
    p, (pid,) = _named("sweep0")
    clock = trio.testing.MockClock()
    try:
        t.run(lambda: _named_reads(e, pid, "sweep0"))
        _end(p)

        async def main():
            waited = 0.0
            for _ in range(3):
                waited += await _read_pass_timed(e, clock, ANONYMOUS)
            assert waited == 0, "the unnamed job waited for a job that had exited"
            assert e.consumers.get("sweep0").state == "dropped" and e.consumers.get(ANONYMOUS).state == "live"
            assert e.schedule.pos.mini_epoch == 1

        trio.run(main, clock=clock)
    finally:
        if p.poll() is None:
            _end(p)

def test_a_consumers_processes_are_bounded_and_the_dead_go_first(open_engine, t, monkeypatch):
    """Past PROCESSES_KEPT requesters the dead are forgotten first, so a live one seen long ago (a job's main
    process, between the DataLoader workers of two epochs) keeps the job alive."""
    monkeypatch.setattr(consumers, "PROCESSES_KEPT", 4)
    e = open_engine()
    main_p, (main_pid,) = _named("job")
    workers = [_named("job") for _ in range(6)]
    try:
        async def go():
            assert await e.consumers.name_of(main_pid, OWNER_UID) == "job"
            for i, (w, (wpid,)) in enumerate(workers):
                assert await e.consumers.name_of(wpid, OWNER_UID) == "job"
                _end(w)  # each epoch's workers exit before the next epoch's start
                e.consumers.get("job").swept_at = -1.0  # (the once-a-second sweep: due at every new one here)
                assert len(e.consumers.get("job").processes) <= 4, i
            job = e.consumers.get("job")
            assert consumers.process_start(main_pid) in {s for p, s in job.processes if p == main_pid}
            assert e.consumers.gone(job) is None  # its main process is alive
        t.run(go)
    finally:
        for w, _ in workers:
            if w.poll() is None:
                _end(w)
        _end(main_p)
