"""``mpiexec -n P dslide train`` end to end on a plain directory: one JSON line per pass from rank 0 with the
exact bytes per step, and a bad shard (seen by rank 0 alone) ending the whole job with exit 1."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from dslide.gen import write_dataset
from dslide.model import shard_bounds
from dslide.mpicomm import ring_allgather_bytes, ring_allreduce_bytes
from dslide.mpirun import job_env, run_mpi

HIDDEN, BATCH = 16, 64


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("xc")
    # 4 shards of 128 points: every batch is full, so every step sends the same bytes
    write_dataset(out, 512, 300, 60, shards=4, test_points=64, seed=5)
    return out


def train(size: int, train_dir, test, *extra) -> object:
    argv = ["-m", "dslide", "train", "--train", train_dir, "--test", test, "--epochs", 1, "--hidden", HIDDEN,
            "--batch", BATCH, "--budget", 16, "--threads", 1, "--eval-points", 32, *extra]  # fmt: skip
    return run_mpi(size, argv, timeout=180)


def expected_step_bytes(size: int, rank: int) -> int:
    widths = [hi - lo for lo, hi in (shard_bounds(HIDDEN, size, r) for r in range(size))]
    gather = 8 * (size - 1) + ring_allgather_bytes([BATCH * w * 4 for w in widths], rank)
    rowmax = ring_allreduce_bytes(BATCH, 4, size, rank)
    stats = ring_allreduce_bytes(BATCH * 4, 8, size, rank)
    dh = ring_allreduce_bytes(BATCH * HIDDEN, 4, size, rank)
    return gather + rowmax + stats + dh


@pytest.mark.parametrize("size", [2, 4])
def test_train_reports_exact_bytes_per_step(dataset, size):
    result = train(size, dataset / "train", dataset / "test.txt")
    assert not result.timed_out and result.returncode == 0, result.stderr[-2000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("{")]  # rank 0 alone prints
    record = json.loads(line)
    assert record["steps"] == 512 // BATCH and record["files"] == 4
    assert record["comm_bytes_per_step"] == expected_step_bytes(size, 0)
    assert record["comm_bytes"] > record["comm_bytes_per_step"] * record["steps"]  # + file lists, data, eval
    assert 0 <= record["p_at_1"] <= 1


def test_a_bad_shard_read_by_rank_0_ends_the_job(dataset, tmp_path):
    train_dir = tmp_path / "train"
    train_dir.mkdir()
    for part in sorted((dataset / "train").iterdir()):
        (train_dir / part.name).write_bytes(part.read_bytes())
    bad = train_dir / "part-00002.txt"
    lines = bad.read_text().splitlines()
    lines[5] = "3,oops 1:0.5"
    bad.write_text("\n".join(lines) + "\n")
    result = train(2, train_dir, dataset / "test.txt")
    assert not result.timed_out, "the other rank was left waiting"
    assert result.returncode == 1, result.stderr[-2000:]
    assert f"{bad}:6:" in result.stderr and "Traceback" not in result.stderr


def test_a_two_rank_checkpoint_resumes_bit_for_bit(dataset, tmp_path):
    straight = train(2, dataset / "train", dataset / "test.txt", "--epochs", 2)
    first = train(2, dataset / "train", dataset / "test.txt", "--checkpoint", tmp_path / "ck")
    shutil.copytree(tmp_path / "ck", tmp_path / "ck-for-4")
    resumed = train(2, dataset / "train", dataset / "test.txt", "--epochs", 2, "--checkpoint", tmp_path / "ck",
                    "--resume")  # fmt: skip
    for result in (straight, first, resumed):
        assert not result.timed_out and result.returncode == 0, result.stderr[-2000:]
    want = json.loads(straight.stdout.strip().splitlines()[-1])
    got = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert got["pass"] == want["pass"] == 2
    assert (got["loss"], got["p_at_1"], got["steps"]) == (want["loss"], want["p_at_1"], want["steps"])
    assert got["train_err"] == want["train_err"] and 0 <= got["train_err"] <= 1
    # one process evaluates the 2-rank checkpoint (no mpiexec): the figure the resumed job printed
    alone = subprocess.run([sys.executable, "-m", "dslide", "eval", "--checkpoint", tmp_path / "ck", "--test",
                            dataset / "test.txt", "--eval-points", "32"], env=job_env(), capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    assert alone.returncode == 0, alone.stderr[-2000:]
    assert json.loads(alone.stdout)["p_at_1"] == pytest.approx(got["p_at_1"], abs=1e-9)
    # 4 ranks take the 2-rank shards over and continue the same trajectory (float rounding apart)
    other = train(4, dataset / "train", dataset / "test.txt", "--epochs", 2, "--checkpoint", tmp_path / "ck-for-4",
                  "--resume")  # fmt: skip
    assert not other.timed_out and other.returncode == 0, other.stderr[-2000:]
    four = json.loads(other.stdout.strip().splitlines()[-1])
    assert four["steps"] == want["steps"] and four["loss"] == pytest.approx(want["loss"], rel=1e-5)
    # 3 ranks cannot split 8 selection blocks: every rank says so and the job ends with 1
    three = train(3, dataset / "train", dataset / "test.txt", "--epochs", 2, "--checkpoint", tmp_path / "ck",
                  "--resume")  # fmt: skip
    assert not three.timed_out and three.returncode == 1
    assert "it can be read by 1, 2, 4, 8 ranks, this job has 3" in three.stderr
