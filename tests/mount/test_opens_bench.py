"""benchmarks/opens.py on tiny data, through real mounts: every file of each timed pass opened once, the daemon's
CPU read, the table written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_each_timed_pass_opens_every_file_of_the_pass_once(tmp_path, capsys, benchmark_module):
    bench = benchmark_module("opens")
    out = tmp_path / "opens.json"
    files, passes = 60, 3
    assert bench.main(["--files", str(files), "--size", "4K", "--nm", "1,3", "--think", "0,0.2", "--readers", "2",
                       "--passes", str(passes), "--rounds", "1", "--tmp", str(tmp_path / "work"),
                       "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["nm"], r["think_ms"]) for r in rows} == {(1, 0.0), (1, 0.2), (3, 0.0), (3, 0.2)}
    for r in rows:
        assert r["opens"] == passes * files // r["nm"], r
        assert r["opens_per_s"] > 0 and r["user_ms"] >= 0 and r["sys_ms"] >= 0
        assert r["python"] == sys.executable
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "`" in line]
    assert len(table) == 4  # a row per (nm, think)
