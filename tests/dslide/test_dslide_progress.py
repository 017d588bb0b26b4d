"""``dslide train`` on a terminal: a progress bar per pass on stderr (captured in a pty, as a person sees it),
the JSON lines as they are; without a terminal (a pipe, as under mpiexec) a plain line per pass on stderr, and
nothing with ``--progress off``."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tierfs.testing.harness import in_pty

DSLIDE = [sys.executable, "-m", "dslide"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("xc")
    subprocess.run([*DSLIDE, "gen", str(out), "--points", "400", "--features", "64", "--labels", "32", "--shards",
                    "4"], check=True, capture_output=True, timeout=300)
    return out


def _train(data) -> list[str]:
    return [*DSLIDE, "train", "--train", str(data / "train"), "--epochs", "2", "--hidden", "8", "--budget", "16",
            "--threads", "1"]


def _json_lines(text: str) -> list[dict]:
    return [json.loads(ln[ln.index("{"):]) for ln in text.splitlines() if "{" in ln]


def test_train_shows_a_bar_per_pass_on_a_terminal_and_the_same_json(data):
    plain = subprocess.run(_train(data), capture_output=True, text=True, timeout=600)
    assert plain.returncode == 0, plain.stderr
    # no terminal: plain lines, the pass's last one with its samples (no bar, no carriage return)
    assert "\r" not in plain.stderr and re.search(r"^pass 2/2: [\d,]+ samples, [\d,]+ samples/s$", plain.stderr, re.M)
    assert [ln.split(":")[0] for ln in plain.stderr.splitlines() if "(so far)" not in ln] == ["pass 1/2", "pass 2/2"]
    with in_pty(_train(data)) as run:
        out = run.read(timeout=600)
        assert run.process.wait(timeout=60) == 0, out
    text = out.decode()
    for n in (1, 2):
        assert re.search(rf"pass {n}/2: +\d+%\|.*\| [0-4]/4", text), text
    if re.search(r"\| [1-4]/4", text):  # (a pass quicker than the bar's 0.2 s redraw shows only 0/4)
        assert "samples/s" in text  # any redraw after a file shows the samples and their rate
    records = _json_lines(text)
    expected = _json_lines(plain.stdout)
    assert [r["pass"] for r in records] == [1, 2] and len(records) == len(expected)
    for got, want in zip(records, expected, strict=True):
        assert got.keys() == want.keys() and got["loss"] == want["loss"]  # the same lines, as a person sees them


def test_progress_off_leaves_stderr_empty(data):
    res = subprocess.run([*_train(data), "--progress", "off"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stderr == "", res.stderr
