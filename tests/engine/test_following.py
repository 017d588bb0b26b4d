"""A loader that does not follow the view is told so: logged once with the fix, in status, summary and metrics."""

from __future__ import annotations

import json
import logging

from tierfs.cli.status_text import format_status
from tierfs.daemon.schedule.loader_watch import MIN_OPENS, STUCK_FACTOR


def _loader(e) -> dict:
    return json.loads(e.status().to_json())["loader"]


def _warned_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "does not" in r.getMessage()]


def test_a_file_list_built_once_over_the_whole_tree_is_told_within_one_pass(open_engine, t, caplog):
    e = open_engine()  # 32 files, nm 4: a view of about 8
    listed = list(range(e.tree.n_files))  # what a loader that listed the whole tree once reads

    async def main():
        assert _loader(e) == {"follows_view": True, "warning": None, "warnings": 0}
        view = len(e.schedule.view)
        for n, f in enumerate(listed * 2, 1):
            await t.read_file(e, f)
            if n == max(MIN_OPENS, view) - 1:
                assert _loader(e)["follows_view"]  # (not before a pass-worth of opens)
        loader = _loader(e)
        assert not loader["follows_view"] and "listing=all" in loader["warning"]
        assert "MountSampler" in loader["warning"]
        assert "tierfs_loader_off_view 1" in e.status().to_prometheus()
        summary = format_status(json.loads(e.status().to_json()))
        assert "does not follow the view" in summary and "(README.md)" in summary  # whole, not cut

    with caplog.at_level(logging.WARNING, logger="tierfs"):
        t.run(main)
    assert len(_warned_lines(caplog)) == 1  # logged once, however long it goes on


def test_a_loader_that_follows_the_view_is_never_warned_and_a_good_pass_clears_a_warning(open_engine, t, caplog):
    e = open_engine(rf=3)

    async def main():
        for _ in range(4):
            await t.read_view(e)
        assert _loader(e)["follows_view"] and e.status().loader.warnings == 0
        outside = [f for f in range(e.tree.n_files) if not e.schedule.view.mask[f]]
        for f in (outside * 4)[:max(MIN_OPENS, len(e.schedule.view)) + 1]:
            await t.read_file(e, f)
        assert not _loader(e)["follows_view"]
        e.passes.end_pass()  # (next-pass) then a pass read in view
        for _ in range(2):
            await t.read_view(e)
        assert _loader(e)["follows_view"] and _loader(e)["warnings"] == 1
        assert "tierfs_loader_off_view 0" in e.status().to_prometheus()

    with caplog.at_level(logging.WARNING, logger="tierfs"):
        t.run(main)


def test_a_pass_that_never_ends_while_reads_go_on_is_told(open_engine, t, caplog):
    e = open_engine()

    async def main():
        view = e.schedule.view.order.tolist()
        part = view[:-1]  # a loader that drops a file of every pass (drop_last), reading the rest again
        passes = e.schedule.pos.passes_total
        n = 0
        while n < STUCK_FACTOR * max(MIN_OPENS, len(view)):
            for f in part:
                await t.read_file(e, f)
                n += 1
        assert e.schedule.pos.passes_total == passes
        loader = _loader(e)
        assert not loader["follows_view"] and "does not end" in loader["warning"]

    with caplog.at_level(logging.WARNING, logger="tierfs"):
        t.run(main)
    assert len([m for m in _warned_lines(caplog) if "does not end" in m]) == 1


def test_lru_never_warns(open_engine, t):
    e = open_engine(policy="lru")

    async def main():
        for _ in range(STUCK_FACTOR + 1):
            for f in range(4):
                for _ in range(MIN_OPENS):
                    await t.read_file(e, f)
        assert _loader(e)["follows_view"]

    t.run(main)
