"""benchmarks/loop.py on tiny data: every way of writing the loop, over the plain dir and through real mounts."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("PIL")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]


def test_every_way_over_the_plain_dir_and_the_mount(tmp_path):
    spec = importlib.util.spec_from_file_location("loop", ROOT / "benchmarks" / "loop.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["loop"] = bench
    spec.loader.exec_module(bench)
    out, png = tmp_path / "loop.json", tmp_path / "loop.png"
    assert bench.main(["--files", "96", "--nm", "1,3", "--workers", "1", "--batch", "8", "--rounds", "1",
                       "--chunks", "1", "--tmp", str(tmp_path), "--out", str(out), "--plot", str(png)]) == 0
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert {(r["way"], r["nm"]) for r in rows} == {(w, nm) for w in bench.WAYS for nm in (1, 3)}
    for r in rows:
        # a chunk is a data set's worth of samples in whole epochs (the plain side's first batch not counted)
        assert r["plain"]["samples"] >= 96 - 8 and r["mount"]["samples"] >= 96
        assert r["ratio"] > 0 and r["cpu_ratio"] > 0
        if r["nm"] == 3:
            # the mount moved on by passes of a third: its first pass, then a chunk of a data set's samples,
            # three more (under substitution a pass ends when every view file was served, and a name in a folder
            # whose view files were all served is served again: fewer passes than reads / pass size)
            assert r["status"]["passes_total"] >= (2 if r["way"] == "substitute" else 4), r
    assert len(res["summary"]) == 8 and png.stat().st_size > 0
    assert "| sampler | 1 | 3 |" in bench.table(res["summary"])
