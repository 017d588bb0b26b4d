"""The live progress line of a training job (tierfs.client.progress): what it says, and who says it."""

from __future__ import annotations

import io
import time

import pytest

from tierfs.client.progress import PassFigures, PassProgress, launcher_rank, position


def test_the_launcher_s_rank_decides_who_shows_progress():
    assert launcher_rank({}) == 0
    assert launcher_rank({"PMI_RANK": "1"}) == 1 and launcher_rank({"OMPI_COMM_WORLD_RANK": "3"}) == 3
    assert launcher_rank({"RANK": "2", "PMI_RANK": "0"}) == 2  # (torchrun's first)
    out = io.StringIO()
    quiet = PassProgress(None, out, mode="lines", rank=1)
    quiet.start(1, 2)
    quiet.advance(100)
    assert quiet.finish() is None and out.getvalue() == "" and quiet.mode == "off"


def test_a_pipe_gets_one_plain_line_per_pass():
    out = io.StringIO()  # (not a terminal: auto means lines)
    progress = PassProgress(None, out, rank=0)
    assert progress.mode == "lines"
    for n in (1, 2):
        progress.start(n, 2)
        progress.advance(600)
        progress.advance(600)
        figures = progress.finish()
        assert figures is not None and figures.samples == 1200
    lines = out.getvalue().splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["pass 1/2", "pass 2/2"]
    assert all(ln.split(": ")[1].startswith("1,200 samples, ") and ln.endswith(" samples/s") for ln in lines)


def test_the_mount_s_figures_read_as_a_person_reads_them():
    f = PassFigures(samples=1200, seconds=2.0, hits=98, misses=2, slow_tier_bytes=3 << 20, stall_seconds=0.25)
    assert f.text() == "1,200 samples, 600 samples/s, hits 98.0%, slow tier 1.5M/s, stall 0.2 s"
    assert PassFigures(5, 1.0, hits=0, misses=0, slow_tier_bytes=0, stall_seconds=0.0).text() == \
        "5 samples, 5 samples/s, hits -, slow tier 0/s, stall 0.0 s"
    assert f.text(short=True) == "600/s hits 98% slow 1.5M/s stall 0.2s"
    assert PassFigures(150_000, 1.0).text(short=True) == "150k/s"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_fits_an_80_column_terminal_with_every_figure(monkeypatch):
    """(issue 47) tqdm cut the figures off at 80 columns: the bar's line keeps the pass, the count and every
    figure (rate, hits, slow tier, stall) within the terminal's width."""
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("LINES", "24")
    out = _Terminal()
    progress = PassProgress(None, out, rank=0)
    assert progress.mode == "bar"
    progress.start(3, 4, total=120_000)
    progress._start, progress._now = (0, 0, 0, 0.0), (98_000, 2_000, 12_345 << 20, 12.5)  # (a mount's counters)
    for _ in range(3):
        time.sleep(0.25)  # (the bar redraws at most every 0.2 s)
        progress.advance(40_000)
    frames = [f.strip("\x1b[A").rstrip() for f in out.getvalue().split("\r") if f.strip()]
    assert frames, out.getvalue()
    for frame in frames:
        assert len(frame) <= 80, frame
    last = frames[-1]
    assert last.startswith("pass 3/4: 100%|") and "| 120000/120000, " in last, last
    assert all(w in last for w in ("/s hits 98% slow ", "stall 12.5s")), last


def test_positions_count_from_one_as_tierfs_status_does():
    st = {"epoch": 0, "mini_epoch": 2, "nm": 8, "pass": 0}
    assert position(st) == "epoch 1 mini-epoch 3/8"
    assert position({"epoch": 4, "policy": "lru"}) == "epoch 5" and position(None) == ""


def test_a_bad_mode_is_refused():
    with pytest.raises(ValueError, match="one of auto, bar, lines, off"):
        PassProgress(None, io.StringIO(), mode="tqdm")
