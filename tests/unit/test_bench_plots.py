"""The benchmarks' plots drawn from their saved results (benchmarks/results): tick labels that do not overlap,
axes that name what they count."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]


def _overlapping(labels) -> list[tuple[str, str]]:
    boxes = [(t.get_text(), t.get_window_extent()) for t in labels if t.get_text()]
    return [(a, b) for (a, ba), (b, bb) in itertools.combinations(boxes, 2) if ba.overlaps(bb)]


def test_datapath_plot_labels_do_not_overlap(benchmark_module):
    datapath = benchmark_module("datapath")
    rows = datapath.rows_of_table((ROOT / "benchmarks/results/datapath.md").read_text())
    assert len(rows) > 20 and {r.unit for r in rows} == {"GiB/s", "files/s"}
    fig = datapath.figure(rows)
    fig.canvas.draw()
    for ax in fig.axes:
        labels = ax.get_yticklabels()
        assert len([t for t in labels if t.get_text()]) == sum(r.unit == ax.get_xlabel() for r in rows)
        assert not _overlapping(labels)


@pytest.mark.parametrize(("workload", "unit"), [("images", "images/s"), ("shards", "shards/s")])
def test_tierfs_bench_rate_axis_names_what_it_counts(workload, unit, benchmark_module):
    bench = benchmark_module("tierfs_bench")
    args, results = bench.load_results(ROOT / "benchmarks/results/tierfs_bench.json")
    wl = {"images": bench.Workload.images, "shards": bench.Workload.shards}[workload](float(args["scale"]))
    fig = bench.figure([r for r in results if r.workload == workload], wl)
    assert fig.axes[2].get_ylabel() == f"{unit} (steady)"
