"""rf means what the user set (issue 26): the ceiling on repetition (``rf_max``), every file in every epoch, and a
slow tier shown as what it is.

Staging is made slower than reading with the ``bandwidth`` cap (one token bucket for staging and readers), or
left out altogether (no ``run()``: nothing stages ahead, so the next mini-epoch is never ready).
"""

from __future__ import annotations

import json

import pytest
import trio

from tierfs.cli.status_text import format_status

_SLOW = 16_000  # bytes/s: a mini-epoch of the test data set (about 16 KiB) stages in about a second


async def _read_passes(e, t, mini_epochs: int) -> None:
    """Read whole views, as a loader faster than staging does, until ``mini_epochs`` switches were made."""
    while len(e.schedule.pos.rf_effective) <= mini_epochs:
        await t.read_view(e)


def test_ready_never_repeats_past_the_ceiling_without_staging(open_engine, t):
    # No stager: the next mini-epoch is never staged; ready used to repeat the first one for ever.
    e = open_engine(rf=1, rf_max=3)

    async def main():
        for _ in range(7):
            await t.read_view(e)
        assert e.schedule.pos.rf_effective == [3, 3, 1]
        assert e.status().stall_seconds > 0  # the switched-to mini-epochs' files were fetched as they were opened

    t.run(main)


@pytest.mark.slow
@pytest.mark.parametrize("rf", [1, "auto"])
def test_passes_stay_within_the_ceiling_when_staging_is_slower_than_reading(open_engine, t, rf):
    e = open_engine(rf=rf, rf_max=3, bandwidth=_SLOW, advance="ready")

    async def main():
        async with trio.open_nursery() as n:
            await n.start(e.run)
            await _read_passes(e, t, 4)
            st = e.status()
            n.cancel_scope.cancel()
        made = list(st.rf_effective[:-1])
        assert made and max(made) <= 3, made
        assert st.rf_max == 3
        if rf == "auto":
            # the IO model wanted more than the ceiling lets it use, and both are shown
            assert st.rf == 3 and st.rf_wanted is not None and st.rf_wanted > 3
            metrics = st.to_prometheus()
            assert f"tierfs_rf_wanted {float(st.rf_wanted)}\n" in metrics and "tierfs_rf_max 3.0\n" in metrics

    t.run(main)


def test_an_integer_rf_above_rf_max_is_what_the_user_gets(open_engine, t):
    e = open_engine(rf=5, rf_max=2, advance="strict")

    async def main():
        for _ in range(5):
            await t.read_view(e)
        assert e.schedule.pos.rf_effective == [5, 0]
        assert e.passes.rf_ceiling() == 5

    t.run(main)


def test_rf_auto_uses_the_io_model_within_the_ceiling(open_engine):
    e = open_engine(rf="auto", rf_max=6)
    e.stager._bytes, e.stager._busy = 1000, 1.0  # 1000 B/s staging
    e.schedule.consumption_bps = 55_000.0  # readers 55x faster
    st = e.status()
    assert (st.rf, st.rf_wanted, st.rf_max) == (6, 55, 6)
    e.control_write(b"rf_max=60\n")
    assert e.status().rf == 55


def test_lowering_rf_max_live_moves_a_mini_epoch_already_past_it_on(open_engine, t):
    e = open_engine(rf=1, rf_max=10)

    async def main():
        for _ in range(4):
            await t.read_view(e)  # no stager: repeated while the next is not staged
        assert e.schedule.pos.rf_effective == [4]
        e.control_write(b"rf_max=3\n")
        assert e.schedule.pos.rf_effective == [4, 0]
        assert b"rf_max=3\n" in e.control_text()

    t.run(main)


@pytest.mark.slow
@pytest.mark.parametrize("settings", [
    dict(rf=1, rf_max=2, advance="ready"),
    dict(rf=2, advance="strict"),
    dict(rf="auto", rf_max=2, advance="ready"),
    dict(rf=8, rf_max=3, arf="score", arf_wait=1),
], ids=["ready", "strict", "auto", "arf"])
def test_every_epoch_serves_every_file_whatever_advance_does(open_engine, t, settings):
    # Readers faster than staging, over two whole epochs: the mini-epochs of each epoch, however often each was
    # repeated or however early it was left, together showed -- and the readers opened -- every file.
    e = open_engine(bandwidth=2 * _SLOW, **settings)

    async def main():
        opened: dict[int, set[int]] = {}
        async with trio.open_nursery() as n:
            await n.start(e.run)
            loss = 1.0
            while e.schedule.pos.epoch < 2:
                epoch = e.schedule.pos.epoch
                view = e.schedule.view.order.tolist()
                await t.read_view(e)
                opened.setdefault(epoch, set()).update(view)
                if settings.get("arf") == "score":
                    loss += 0.1  # never better: ARF says "advance" after every pass
                    e.control_write(f"feedback loss={loss}\n".encode())
            st = e.status()
            n.cancel_scope.cancel()
        assert opened[0] == opened[1] == set(range(e.tree.n_files))
        assert max(st.rf_effective[:-1]) <= e.passes.rf_ceiling()

    t.run(main)


def test_passes_ended_by_next_pass_alone_are_no_slow_tier_behind_readers(open_engine, t, caplog):
    # Nothing staged ahead and passes past rf, as below, but ended by next-pass with nothing read: no reader is
    # behind, so no "slow tier behind the readers ... the readers consume 0/s" warning (issue 47).
    e = open_engine(rf=1, rf_max=3, bandwidth=1 << 20)

    async def main():
        with caplog.at_level("INFO", logger="tierfs"):
            for _ in range(5):
                e.passes.next_pass()
            st = e.status()
            assert st.passes_total == 5 and st.slow_tier.state == "ok" and st.slow_tier.episodes == 0
            assert "slow tier behind" not in format_status(json.loads(st.to_json()))
            assert not [r for r in caplog.records if "slow tier is behind" in r.getMessage()]

    t.run(main)


def test_a_slow_tier_is_shown_with_its_cause_and_fix_once_per_episode(open_engine, t, caplog):
    # No stager: nothing is staged ahead, so passes past rf repeat (ready) and the ceiling switches unstaged.
    e = open_engine(rf=1, rf_max=3, bandwidth=1 << 20)

    async def main():
        with caplog.at_level("INFO", logger="tierfs"):
            for _ in range(2):
                await t.read_view(e)
            st = e.status()
            # (each pass end past rf that repeats counts the pass it begins)
            assert st.slow_tier.state == "repeating" and st.slow_tier.repeats_beyond_rf == 2
            await t.read_view(e)  # the ceiling: switched before the next was staged
            st = e.status()
            tier = st.slow_tier
            assert tier.state == "stalling" and tier.stalled_switches == 1 and tier.repeats_beyond_rf == 2
            assert "staging reads the slow tier at" in tier.why and "the readers consume" in tier.why
            assert "a larger bandwidth cap (now 1M/s)" in tier.fix and "accept the stalls" in tier.fix
            assert "capacity >= " in tier.fix and "nm=1" in tier.fix
            metrics = st.to_prometheus()
            assert "tierfs_slow_tier_behind 1.0\n" in metrics and "tierfs_repeats_beyond_rf_total 2.0\n" in metrics
            assert "tierfs_stalled_switches_total 1.0\n" in metrics
            text = format_status(json.loads(st.to_json()))
            assert "warning    slow tier behind the readers" in text and "to fix it:" in text
            assert max(map(len, text.splitlines())) <= 100
            for _ in range(4):
                await t.read_view(e)  # the same episode: repeats and stalls, no new log line
            behind = [r for r in caplog.records if "slow tier is behind" in r.getMessage()]
            assert len(behind) == 1 and behind[0].levelname == "WARNING"
            assert "to fix it" in behind[0].getMessage()

            async with trio.open_nursery() as n:  # staging catches up: the episode ends at the next switch
                await n.start(e.run)
                for _ in range(3):  # (the mini-epoch in progress may be past rf already: the one after it)
                    await t.settle(e)
                    await t.read_view(e)  # rf passes, the next one staged
                n.cancel_scope.cancel()
            assert e.status().slow_tier.state == "ok"
            assert e.status().to_prometheus().count("tierfs_slow_tier_behind 0.0\n") == 1
            assert "slow tier behind" not in format_status(json.loads(e.status().to_json()))
            for _ in range(2):
                await t.read_view(e)  # behind again: a second episode, a second line
            assert sum("slow tier is behind" in r.getMessage() for r in caplog.records) == 2
            assert e.status().slow_tier.episodes == 2

    t.run(main)
