"""benchmarks/loop.py on tiny data: every way of writing the loop, over the plain dir and through real mounts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("PIL")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]


TINY = ["--files", "96", "--workers", "1", "--batch", "8", "--rounds", "1", "--chunks", "1"]


def test_every_way_over_the_plain_dir_and_the_mount(tmp_path, benchmark_module):
    bench = benchmark_module("loop")
    out, png = tmp_path / "loop.json", tmp_path / "loop.png"
    assert bench.main([*TINY, "--nm", "1,3", "--pin", "off", "--tmp", str(tmp_path), "--out", str(out),
                       "--plot", str(png)]) == 0
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert {(r["way"], r["nm"]) for r in rows} == {(w, nm) for w in bench.WAYS for nm in (1, 3)}
    for r in rows:
        # a chunk is a data set's worth of samples in whole epochs (the plain side's first batch not counted)
        assert r["plain"]["samples"] >= 96 - 8 and r["mount"]["samples"] >= 96
        assert r["ratio"] > 0 and r["cpu_ratio"] > 0
        # (the plain side's one epoch is its first, whose start is not timed: no boundary in it)
        assert 0 <= r["plain"]["stall_s"] < r["plain"]["seconds"] and 0 < r["mount"]["stall_s"] < r["mount"]["seconds"]
        assert r["plain"]["daemon_cpu_ms_per_sample"] == 0  # (no daemon on the plain side)
        # the sides alternate, chunk by chunk, and each mount chunk is paired with the plain chunk before it
        (p0, p1), (m0, m1) = r["plain"]["chunk_times"][0], r["mount"]["chunk_times"][0]
        assert p0 < p1 <= m0 < m1
        rates = zip(r["plain"]["chunk_rates"], r["mount"]["chunk_rates"], strict=True)
        assert r["pair_ratios"] == [m / p for p, m in rates]
        for side in ("plain", "mount"):
            assert len(r[side]["chunk_idle"]) == 1 and 0 <= r[side]["idle_share"] <= 1
        # the plain dir in the mount's pass-sized epochs: the sampler's loop at nm > 1 only
        assert ("passes" in r) == (r["way"] == "sampler" and r["nm"] == 3), r
        if r["nm"] == 3:
            # the mount moved on by passes of a third: its first pass, then a chunk of a data set's samples,
            # three more (under substitution a pass ends when every view file was served, and a name in a folder
            # whose view files were all served is served again: fewer passes than reads / pass size)
            assert r["status"]["passes_total"] >= (2 if r["way"] == "substitute" else 4), r
    # the daemon's own CPU, of the ways that read through it (clock ticks of 10 ms: summed over their rows)
    assert sum(r["mount"]["daemon_cpu_ms_per_sample"] for r in rows if r["way"] != "minepoch") > 0
    assert len(res["summary"]) == 8 and png.stat().st_size > 0
    assert "| sampler | 1 | unpinned | 3 |" in bench.table(res["summary"])
    assert all(s["pairs"] == 1 and s["pairs_min"] == s["pairs_max"] for s in res["summary"])
    passes = next(r for r in rows if "passes" in r)
    # its epochs a third of the data set each (its first batch not timed)
    assert passes["passes"]["samples"] == 32 * passes["passes"]["passes"] - 8 >= 96
    assert passes["drain_ratio"] > 0 and passes["ratio_to_passes"] > 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="--pin needs 2 CPUs")
def test_pinned_and_unpinned_side_by_side(tmp_path, benchmark_module):
    bench = benchmark_module("loop")
    out, png = tmp_path / "loop.json", tmp_path / "loop.png"
    assert bench.main([*TINY, "--nm", "3", "--ways", "sampler", "--pin", "both", "--tmp", str(tmp_path),
                       "--out", str(out), "--plot", str(png)]) == 0
    rows = {r["pinned"]: r for r in json.loads(out.read_text())["rows"]}
    everything = sorted(os.sched_getaffinity(0))
    # pinned: the daemon on the first CPU, ahead of the box's other processes there; the loop on the others
    assert rows[True]["cpus"] == {"loop": everything[1:], "daemon": everything[:1], "daemon_nice": bench.DAEMON_NICE}
    assert rows[False]["cpus"] == {"loop": everything, "daemon": everything, "daemon_nice": os.nice(0)}
    assert os.sched_getaffinity(0) == set(everything)  # (this process's CPUs given back)
    for r in rows.values():
        assert r["mount"]["samples"] >= 96 and r["passes"]["samples"] >= 96 - 8
    table = bench.table(bench.summary(list(rows.values())))
    assert "| sampler | 1 | unpinned | 3 |" in table and "| sampler | 1 | pinned | 3 |" in table
