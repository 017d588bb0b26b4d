"""Batch plans (``/.tierfs/plan`` and ``consumed``): copies pinned for the pass, never stale, counted as opens."""

from __future__ import annotations

import errno
import json
import os

import pytest
import trio

from tierfs.common.protocol import format_indices, parse_indices
from tierfs.daemon.serving.batch_plans import PlanStatistics
from tierfs.daemon.tree.tree import fingerprint


async def _staged(e, t):
    async with trio.open_nursery() as n:
        await n.start(e.run)
        await t.settle(e)
        n.cancel_scope.cancel()


async def _plan(e) -> dict:
    return json.loads(await e.batch.plan_text(0))


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _fidx(e, rel: str) -> int:
    return next(f for f in range(e.tree.n_files) if os.fsdecode(e.tree.file_path(f)) == rel)


def _status_counts(e) -> tuple:
    s = e.status()
    return s.passes_total, s.reads.hits, s.reads.misses, s.opened_bytes, s.reads.out_of_view


def test_indices_round_trip():
    assert parse_indices("0-3,7,9-10") == [0, 1, 2, 3, 7, 9, 10]
    assert format_indices([10, 0, 1, 2, 3, 7, 9, 2]) == "0-3,7,9-10"
    for bad in ("", "a", "3-1", "-1", "1-"):
        with pytest.raises(ValueError, match="consumed"):
            parse_indices(bad)


def test_plan_lists_the_pass_with_checked_copies_and_reports_count_exactly_as_opens(open_engine, t):
    e = open_engine()

    async def main():
        await _staged(e, t)
        before = _status_counts(e)
        plan = await _plan(e)
        order = [os.fsdecode(e.tree.file_path(f)) for f in e.schedule.view.order.tolist()]
        assert [f["path"] for f in plan["files"]] == order
        pos = e.schedule.pos
        assert (plan["epoch"], plan["mini_epoch"], plan["pass"]) == (pos.epoch, pos.mini_epoch, pos.pass_index)
        copies = [i for i, f in enumerate(plan["files"]) if f["copy"]]
        assert copies, "the first mini-epoch is staged: its files have copies"
        for i in copies:
            f = plan["files"][i]
            fidx = e.schedule.view.order.tolist()[i]
            assert f["size"] == int(e.tree.sizes[fidx])
            assert f["fingerprint"] == list(fingerprint(e.tree.file_node(fidx).st))
            assert _read(f["copy"]) == t.backing_bytes(e, fidx)
            assert e.cache.get(fidx).opens >= 1  # pinned
        # report the copies read directly (twice: a report is idempotent), open the rest through the mount
        e.batch.consumed(plan["plan"], copies[: len(copies) // 2])
        e.batch.consumed(plan["plan"], copies)
        e.batch.consumed(plan["plan"], copies)
        for f in plan["files"]:
            if not f["copy"]:
                await t.read_file(e, _fidx(e, f["path"]))
        after = _status_counts(e)
        # one pass, every file one open: the copies as hits, counted in reads.plan; nothing left pinned
        assert after[0] == before[0] + 1
        assert after[1] - before[1] == len(copies) == e.status().reads.plan
        assert after[3] - before[3] == sum(f["size"] for f in plan["files"])
        assert after[4] == before[4]
        assert all(entry.opens == 0 for entry in e.cache.entries.values())
        assert e.status().plans == PlanStatistics(issued=1, pinned_plans=0, pinned_copies=0, reported=len(copies))
        # a late report about that plan counts nothing twice
        e.batch.consumed(plan["plan"], copies)
        assert e.status().reads.plan == len(copies)

    t.run(main)


def test_bad_reports_change_nothing(open_engine, t):
    e = open_engine()

    async def main():
        await _staged(e, t)
        plan = await _plan(e)
        n = len(plan["files"])
        no_copy = [i for i, f in enumerate(plan["files"]) if not f["copy"]]
        before = _status_counts(e)
        for text, why in ((f"consumed {plan['plan']} 0,{n}", "no index"),
                          (f"consumed {plan['plan'] + 1} 0", "no plan"),
                          ("consumed 1", "needs a plan number"),
                          (f"consumed {plan['plan']} 0\nrf=bogus", "rf")):
            with pytest.raises(ValueError, match=why):
                e.control_write(text.encode())
            assert why in e.last_error
        if no_copy:
            with pytest.raises(ValueError, match="no copy"):
                e.control_write(f"consumed {plan['plan']} 0,{no_copy[0]}".encode())
        assert _status_counts(e) == before
        assert e.status().reads.plan == 0

    t.run(main)


def test_plan_only_for_the_mounts_user_and_root(open_engine, t):
    e = open_engine()

    async def main():
        await _staged(e, t)
        with pytest.raises(PermissionError) as exc:
            await e.batch.plan_text(os.getuid() + 12345)
        assert exc.value.errno == errno.EACCES
        assert e.status().plans.issued == 0

    t.run(main)


def test_a_planned_copy_stays_until_its_pass_ends_and_a_changed_file_is_never_planned_again(open_engine, t):
    e = open_engine(rf=100)  # revalidate=open (conftest): every plan asks the backing

    async def main():
        await _staged(e, t)
        plan = await _plan(e)
        i = next(i for i, f in enumerate(plan["files"]) if f["copy"])
        copy = plan["files"][i]["copy"]
        ino = os.stat(copy).st_ino
        fidx = e.schedule.view.order.tolist()[i]
        old = t.backing_bytes(e, fidx)
        with open(os.path.join(e.config.backing, plan["files"][i]["path"]), "ab") as f:
            f.write(b"new bytes")
        # the change is found (an open through the mount, here of another file of the pass, does not matter):
        # a plan read now names no copy of the changed file, and reading it through the mount gives new bytes
        plan2 = await _plan(e)
        assert plan2["files"][i]["path"] == plan["files"][i]["path"]
        assert plan2["files"][i]["copy"] in (None,) or plan2["files"][i]["copy"] != copy
        assert await t.read_file(e, fidx) == old + b"new bytes"
        # ... and the copy the first plan named is still there, the same file with the old bytes, all pass long
        assert os.stat(copy).st_ino == ino and _read(copy) == old
        # the pass ends: only now does the copy go (and its replacement, if staged, has another name)
        e.control_write(b"next-pass")
        assert not os.path.exists(copy)

    t.run(main)


def test_switch_attempts_and_evictions_never_remove_planned_copies_mid_pass(open_engine, t):
    e = open_engine(rf=1, advance="ready")

    async def main():
        await _staged(e, t)  # the first mini-epoch and the next are staged: a switch may happen at any pass end
        plan = await _plan(e)
        named = {f["copy"]: os.stat(f["copy"]).st_ino for f in plan["files"] if f["copy"]}
        # eviction pressure from outside the view: reading files of later mini-epochs (not cached, not wanted)
        for fidx in [f for f in range(e.tree.n_files) if not e.schedule.wanted[f]][:4]:
            await t.read_file(e, fidx)
        e.policy.make_room(e.cache.capacity)  # the stager's own "make room" path
        for copy, ino in named.items():
            assert os.stat(copy).st_ino == ino
        # the pass ends by a report of every copy (and opens of the rest): rf=1 and the next is cached, so the
        # mini-epoch switches and the previous one is evicted -- the named copies go only now
        e.batch.consumed(plan["plan"], [i for i, f in enumerate(plan["files"]) if f["copy"]])
        for f in plan["files"]:
            if not f["copy"]:
                await t.read_file(e, _fidx(e, f["path"]))
        assert e.schedule.pos.mini_epoch == 1
        assert not any(os.path.exists(c) for c in named)

    t.run(main)


def test_lru_eviction_skips_planned_copies(open_engine, t, dataset):
    _, files = dataset
    e = open_engine(policy="lru", capacity=4 * (max(files.values()) + 4096))

    async def main():
        order = e.schedule.view.order.tolist()
        for fidx in order[:3]:
            await t.read_file(e, fidx)  # read-through: three copies
        plan = await _plan(e)
        named = {f["copy"]: os.stat(f["copy"]).st_ino for f in plan["files"] if f["copy"]}
        assert len(named) == 3
        for fidx in order[3:12]:  # far more than the cache holds: LRU evicts, but never a planned copy
            assert await t.read_file(e, fidx) == t.backing_bytes(e, fidx)
        for copy, ino in named.items():
            assert os.stat(copy).st_ino == ino
        e.control_write(b"next-pass")
        for fidx in order[12:20]:
            await t.read_file(e, fidx)
        assert not any(os.path.exists(c) for c in named)  # unpinned at the pass end: LRU took them

    t.run(main)


def test_plan_rendering_is_json_for_any_name(tmp_path):
    import numpy as np

    from tierfs.common.protocol import COPY_MTIME_NS
    from tierfs.daemon.cache.store import CacheEntry
    from tierfs.daemon.serving.batch_plans import Plan, PlanRenderer

    names = [b"plain/a.jpg", b'quote"and\\back/b', b"new\nline/c", b"latin1-\xff/d", "ünï/e".encode()]
    entry = CacheEntry(0, "0123456789abcdef-0123456789abcdef-1f", 1, 4096, (5, 6, 7, 8), None, (11, 12))
    plan = Plan(3, 1, 2, 0, 9, np.arange(len(names)), [entry, None, entry, None, entry])
    renderer = PlanRenderer(str(tmp_path / 'da"ta'))
    doc = json.loads(renderer.render(plan, names.__getitem__, [1, 2, 3, 4, 5]))
    assert (doc["plan"], doc["epoch"], doc["mini_epoch"], doc["pass"], doc["passes_total"]) == (3, 1, 2, 0, 9)
    assert [os.fsencode(f["path"]) for f in doc["files"]] == names
    assert [f["size"] for f in doc["files"]] == [1, 2, 3, 4, 5]
    assert doc["files"][0]["copy"] == os.path.join(str(tmp_path / 'da"ta'), entry.name)
    assert doc["files"][0]["fingerprint"] == [5, 6, 7, 8] and doc["files"][0]["copy_id"] == [11, 12]
    assert doc["copy_mtime_ns"] == COPY_MTIME_NS
    assert doc["files"][1]["copy"] is None and "fingerprint" not in doc["files"][1] and "copy_id" not in doc["files"][1]
    # rendered again, an entry kept is reused only while the file's copy and size are the same
    other = CacheEntry(0, "fedcba9876543210-fedcba9876543210-2a", 1, 4096, (5, 6, 7, 9), None, (13, 14))
    plan2 = Plan(4, 1, 2, 1, 9, np.arange(len(names)), [other, entry, None, None, entry])
    doc2 = json.loads(renderer.render(plan2, names.__getitem__, [1, 2, 3, 40, 5]))
    assert doc2["plan"] == 4 and [os.fsencode(f["path"]) for f in doc2["files"]] == names
    assert doc2["files"][0]["copy"].endswith(other.name) and doc2["files"][0]["copy_id"] == [13, 14]
    assert doc2["files"][1]["copy"].endswith(entry.name) and doc2["files"][2]["copy"] is None
    assert doc2["files"][3]["size"] == 40 and doc2["files"][4] == doc["files"][4]


def test_many_readers_plans_pin_each_copy_once_until_the_pass_ends(open_engine, t):
    from tierfs.daemon.serving.batch_plans import KEEP_PLANS

    e = open_engine()

    async def main():
        await _staged(e, t)
        plans = [await _plan(e) for _ in range(KEEP_PLANS + 6)]  # more readers than plans kept for late reports
        first = plans[0]
        pinned = [e.cache.get(_fidx(e, f["path"])) for f in first["files"] if f["copy"]]
        # one pin per copy for the pass, however many readers ask (each plan's own number still takes reports)
        assert pinned and all(entry.opens == 1 for entry in pinned)
        assert e.status().plans.pinned_copies == len(pinned) and e.status().plans.pinned_plans == len(plans)
        e.batch.consumed(first["plan"], [0])  # the first plan still takes reports
        e.control_write(b"next-pass")
        assert all(entry.opens == 0 for entry in pinned)
        await _plan(e)  # a plan of the new pass: the oldest of the pass that ended are forgotten
        with pytest.raises(ValueError, match="no plan"):
            e.batch.check_consumed(first["plan"], [0])

    t.run(main)
