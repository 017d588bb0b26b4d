"""benchmarks/convergence.py's machinery on tiny data: a plain-directory run and a run through a real mount."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_one_seed_of_two_configurations(tmp_path, benchmark_module):
    bench = benchmark_module("convergence")
    out = tmp_path / "out"
    assert bench.main(["--smoke", "--seeds", "1", "--out", str(out), "--tmp", str(tmp_path),
                       "--only", "full,score nm=8 rf<=8"]) == 0  # fmt: skip
    res = json.loads((out / "results.json").read_text())
    full, arf = res["runs"]["full"][0], res["runs"]["score nm=8 rf<=8"][0]
    assert full["visits"] == arf["visits"] or abs(full["visits"] - arf["visits"]) < 0.1 * full["visits"]
    assert full["backing_bytes_read"] == 2 * res["data_bytes"]  # every pass over the plain directory
    assert 0 < arf["backing_bytes_read"] <= 2 * res["data_bytes"]
    assert arf["last_error"] is None and len(arf["arf_history"]) == 16  # one feedback line per pass
    assert sum(arf["rf_effective"]) == 16 and all(0 < c["p_at_1"] <= 1 for c in arf["curve"])
    assert [r["config"] for r in res["rows"]] == ["full", "score nm=8 rf<=8"]
    assert (out / "convergence.png").stat().st_size > 0 and (out / "convergence_arf.png").stat().st_size > 0


def test_a_dataset_built_once_with_the_sampler_and_with_substitution(tmp_path, benchmark_module):
    """The issue-23 rows: dslide's file list built once over a listing=all mount, each pass the sampler's files,
    or every name every pass under substitute; the same sample visits as the re-listing loader."""
    bench = benchmark_module("convergence")
    out = tmp_path / "out"
    assert bench.main(["--smoke", "--seeds", "1", "--out", str(out), "--tmp", str(tmp_path),
                       "--grid", "loaders", "--only", "sampler nm=8 rf=4,substitute nm=8 rf=4"]) == 0  # fmt: skip
    res = json.loads((out / "results.json").read_text())
    sampler, subst = res["runs"]["sampler nm=8 rf=4"][0], res["runs"]["substitute nm=8 rf=4"][0]
    points = bench.SMOKE.points * bench.SMOKE.epochs
    for run in (sampler, subst):  # the same budget: each point visited `epochs` times, less the held-out 5 %
        assert 0.9 * points <= run["visits"] <= points and len(run["curve"]) == bench.SMOKE.epochs
        assert run["last_error"] is None and 0 < run["backing_bytes_read"] <= 2 * res["data_bytes"]
    # the sampler: one dslide pass per tierfs pass, every file in view
    assert sampler["passes_total"] == 16 and sampler["reads"]["out_of_view"] == 0
    assert sampler["loader_watch"]["follows_view"] and sampler["substitution"]["enabled"] is False
    # substitution: every name every pass, served as view files; the passes follow the reads
    assert subst["substitution"]["enabled"] and subst["substitution"]["substituted"] > 0
    assert subst["passes_total"] >= 2 and len(subst["rf_effective"]) >= 2
