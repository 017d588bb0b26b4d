"""benchmarks/convergence.py's machinery on tiny data: a plain-directory run and a run through a real mount."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_one_seed_of_two_configurations(tmp_path):
    spec = importlib.util.spec_from_file_location("convergence", ROOT / "benchmarks" / "convergence.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["convergence"] = bench  # dataclasses look their module up
    spec.loader.exec_module(bench)
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
