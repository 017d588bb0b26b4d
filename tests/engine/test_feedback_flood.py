"""A flood of ``feedback`` lines keeps the daemon's memory bounded (issue 46, 7: 54 -> 707 MB in 20 s).

A member of the steering group may write ``feedback`` as fast as she likes, under as many consumer names as she
can start processes with: the ARF history (the mount's, and each consumer's) keeps the newest
``HISTORY_KEPT`` observations, the table of per-consumer controllers the ``ARFS_KEPT`` fed most recently, and the
journal the same history as memory.  Counted in entries, not in RSS: what is kept must not grow with the flood.
"""

from __future__ import annotations

import pytest
import trio

from sampler.arf import HISTORY_KEPT
from tierfs.common.options import Settings
from tierfs.common.protocol import CONTROL_WRITE_MAX
from tierfs.daemon.cache.journal import load_position
from tierfs.daemon.schedule import schedule
from tierfs.daemon.schedule.arfs import ARFS_KEPT, ConsumerArfs
from tierfs.daemon.schedule.consumers import ANONYMOUS

LINES_PER_WRITE = 800
WRITES_PER_NAME = 2
NAMES = 125  # 125 x 2 x 800 = 200,000 feedback lines


@pytest.mark.slow
def test_a_feedback_flood_from_many_consumers_keeps_history_and_controllers_bounded(open_engine):
    e = open_engine(rf=50, arf="score", arf_wait=1000)  # (scored, never an advance: the flood is all there is)
    anonymous_lines = 0
    for i in range(NAMES):
        who = ANONYMOUS if i % 5 == 0 else f"sweep{i}"
        for w in range(WRITES_PER_NAME):
            data = "".join(f"feedback loss={1 + (j % 97) / 100} val_err=0.{w}\n"
                           for j in range(LINES_PER_WRITE)).encode()
            assert len(data) <= CONTROL_WRITE_MAX  # (one write() the kernel hands over whole: see control_file.py)
            writer = e.control_writer(who)
            assert writer.write(0, data) == len(data)
            anonymous_lines += LINES_PER_WRITE if who == ANONYMOUS else 0
        assert len(e.passes.arf.history) <= HISTORY_KEPT
        assert len(e.passes.consumer_arfs) <= ARFS_KEPT
    assert anonymous_lines > HISTORY_KEPT
    # the mount's own: the newest observations, numbered on from the ones dropped
    assert len(e.passes.arf.history) == HISTORY_KEPT
    assert e.passes.arf.history[-1]["pass"] == anonymous_lines
    history = e.passes.arf.history
    assert [h["pass"] for h in history] == list(range(anonymous_lines - HISTORY_KEPT + 1, anonymous_lines + 1))
    # the named ones: the last name fed kept its newest observations; the first ones were forgotten
    last = f"sweep{NAMES - 1}"
    assert len(e.passes.arf_of(last).history) == HISTORY_KEPT
    assert len(e.passes.consumer_arfs) == ARFS_KEPT
    assert e.passes.arf_of("sweep1").history == []  # (a fresh controller: sweep1 had been fed 1,600 lines)
    # the journal keeps what memory keeps
    e.passes.save_journal()
    pos = load_position(e.config.cache)
    assert pos is not None and pos.arf_history == e.passes.arf.history


def test_consumer_arfs_keeps_the_ones_fed_last_and_starts_afresh_after_new_settings():
    arfs = ConsumerArfs()
    s = Settings(arf="score")
    first = arfs.of("a", s)
    first.observe({"loss": 1.0}, (0, 0))
    for i in range(ARFS_KEPT - 1):
        arfs.of(f"x{i}", s)
    assert arfs.of("a", s) is first  # fed again: now the most recent, so x0 is the one that goes next
    arfs.of("newcomer", s)
    assert len(arfs) == ARFS_KEPT and arfs.of("a", s) is first
    assert arfs.of("x0", s).history == []  # forgotten, made afresh
    changed = arfs.of("a", Settings(arf="score", arf_wait=7))
    assert changed is not first and changed.controller.wait == 7


def test_advance_lines_grow_the_journalled_passes_per_mini_epoch_no_further_than_kept(open_engine, t, monkeypatch):
    # ``rf_effective`` gets an entry per switch, and a steering writer may ask for a switch as often as staging
    # allows: it keeps the newest RF_EFFECTIVE_KEPT (a small bound here, to see it with a few switches).
    monkeypatch.setattr(schedule, "RF_EFFECTIVE_KEPT", 3)
    e = open_engine(rf=50)

    async def main():
        async with trio.open_nursery() as n:
            await n.start(e.run)
            for _ in range(6):
                await t.settle(e)
                e.control_write(b"next-pass\nadvance\n")
            n.cancel_scope.cancel()

    t.run(main)
    assert e.schedule.pos.passes_total == 6 and e.schedule.pos.epoch >= 1  # (six switches were made)
    assert e.schedule.pos.rf_effective == [1, 1, 0]
    assert load_position(e.config.cache).rf_effective == [1, 1, 0]
