"""Issue 6 item 6 end to end: tierfs mounted over XC shard files, ``mpiexec -n 2 dslide train`` from the mount
with ``--control``, ARF (``arf=score``) fed by the trainer's feedback, and the effective rf changing in status.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from dslide.mpirun import job_env, run_mpi
from tierfs.testing.harness import mounted

pytestmark = pytest.mark.mount

PASSES, RF = 12, 6


@pytest.fixture(scope="module", autouse=True)
def _fuse_available():
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        pytest.fail("this test mounts tierfs: it needs /dev/fuse and fusermount3 (apt-get install fuse3)")


def test_two_ranks_train_from_the_mount_and_drive_arf(tmp_path):
    data = tmp_path / "data"
    subprocess.run([sys.executable, "-m", "dslide", "gen", data, "--points", "1600", "--features", "500",
                    "--labels", "100", "--shards", "8", "--seed", "2"],
                   env=job_env(), check=True, capture_output=True, timeout=120)  # fmt: skip
    mnt, cache = tmp_path / "mnt", tmp_path / "cache"
    mnt.mkdir()
    # 8 shards in 4 mini-epochs of 2; room for the current and the next mini-epoch, not for the data set.
    # ARF as a user turns it on: arf=score with the mount's default arf_weights, which weigh the training loss
    # alone (a repeat always lowers it: that ARF never acted).  The trainer's defaults with --control hold out
    # 5 % of the training points and report their loss as score=, which overrides the weights.  arf_wait=1
    # only makes ARF leave on the first pass that fails to improve, so that 12 passes reach 3 mini-epochs.
    with mounted(data / "train", mnt, cache, "700K", rf=RF, nm=4, arf="score", arf_wait=1, seed=1) as m:
        result = run_mpi(2, ["-m", "dslide", "train", "--train", mnt, "--test", data / "test.txt",
                             "--epochs", PASSES, "--hidden", 32, "--budget", 32, "--batch", 8, "--threads", 1,
                             "--seed", 4, "--eval-points", 50, "--control", mnt / ".tierfs" / "control"],
                         timeout=240)  # fmt: skip
        status = m.status()
    assert not result.timed_out, result.stderr[-3000:]
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [r["pass"] for r in records] == list(range(1, PASSES + 1))  # rank 0 alone prints
    # rank 0 alone shows its progress (a rank's stderr is a pipe: plain lines), one line per pass with what the
    # mount did for it; mini-epochs counted from 1, as tierfs status counts them
    shown = [ln for ln in result.stderr.splitlines() if ln.startswith("pass ") and "(so far)" not in ln]
    assert [ln.split()[1] for ln in shown] == [f"{p}/{PASSES}" for p in range(1, PASSES + 1)], result.stderr
    assert all(re.search(r"  epoch 1 mini-epoch [1-4]/4: [\d,]+ samples, [\d,]+ samples/s, hits [\d.]+%, "
                         r"slow tier [\d.]+[KMG]?/s, stall [\d.]+ s$", ln) for ln in shown), shown
    assert " mini-epoch 1/4:" in shown[0] and "\r" not in result.stderr

    # The trainer followed the view: each pass's file list came from the mount as it stood.
    assert all(r["files"] == 2 for r in records)
    positions = [(r["tierfs"]["epoch"], r["tierfs"]["mini_epoch"]) for r in records]
    assert len(set(positions)) >= 3, " ".join(f"{h['mini_epoch']}:{h['score']}" for h in status["arf"]["history"])
    assert positions == sorted(positions)

    # One open per file per pass (rank 0 reads, the other rank receives): no read out of view, none doubled.
    assert status["reads"]["out_of_view"] == 0
    assert status["reads"]["hits"] + status["reads"]["misses"] == 2 * PASSES
    assert status["last_error"] is None

    # ~5 % of each pass's 400 points are held out (never trained on) and scored after every pass; the feedback
    # carried their loss as the score -- not anything measured on the test file.
    for r in records:
        assert 5 <= 400 - (r["samples"] - sum(x["samples"] for x in records if x["pass"] == r["pass"] - 1)) <= 40
        assert r["val_points"] >= 5 and r["val_err"] == pytest.approx(1 - r["val_p_at_1"])
    history = status["arf"]["history"]
    assert len(history) == PASSES
    assert [h["score"] for h in history] == pytest.approx([r["val_loss"] for r in records], rel=1e-5)

    # ARF acted: some mini-epochs were left before rf passes.
    assert any(h["decision"] == "advance" for h in history), history
    done = status["rf_effective"][:-1]
    assert done and min(done) < RF and max(status["rf_effective"]) <= RF, status["rf_effective"]
