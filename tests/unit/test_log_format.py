"""The daemon's log lines (issue 47): a timestamp, ``tierfs[PID]`` and the level, once; under systemd, where
journald adds the time and the pid itself, the level and its ``<N>`` priority prefix only."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# (in a child: configure_logging replaces the root logger's handlers, pytest's own included)
CODE = """
import logging
from tierfs.daemon.fuse.mount import configure_logging
configure_logging("info")
logging.getLogger("tierfs").warning("the slow tier is behind the readers")
logging.getLogger("tierfs").info("mounted /mnt/x")
logging.getLogger("tierfs").debug("not shown at info")
"""


def _log(tmp_path: Path, journal: bool) -> str:
    out = tmp_path / "stderr"
    env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
    with open(out, "wb") as f:
        if journal:  # what systemd sets when stderr is the journal's stream
            st = os.fstat(f.fileno())
            env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
        subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, stdout=f, stderr=f, env=env, check=True,
                       timeout=60)
    return out.read_text()


def test_a_line_has_a_timestamp_the_pid_and_the_level_once(tmp_path):
    lines = _log(tmp_path, journal=False).splitlines()
    assert len(lines) == 2, lines
    stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d"
    assert re.fullmatch(stamp + r" tierfs\[\d+\] WARNING: the slow tier is behind the readers", lines[0]), lines
    assert re.fullmatch(stamp + r" tierfs\[\d+\] INFO: mounted /mnt/x", lines[1]), lines


def test_under_the_journal_a_line_has_its_priority_and_no_time_of_its_own(tmp_path):
    assert _log(tmp_path, journal=True).splitlines() == [
        "<4>WARNING: the slow tier is behind the readers", "<6>INFO: mounted /mnt/x"]
