"""Issue 11: ``mpiexec -n 2 dslide train --checkpoint`` killed (SIGKILL) inside its saves, again and again.

The job saves after every pass (a small data set, a large model: ~8 MB a checkpoint).  The test times one save
(from its directory's appearance to the manifest naming it), then kills one rank or both at a random point of
the next.  After every kill the latest complete checkpoint loads (in one process, re-sharded) and holds at least
every pass the job reported, and besides it the directory holds at most the save the kill interrupted (what an
earlier kill left is gone: ``--resume`` removes it); the job resumed after the last kill ends bit for bit where
a job that was never killed ends.  The seed of the random kill points is in every failure message.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dslide.checkpoint import MANIFEST, load_model, read_manifest
from dslide.comm import SerialComm
from dslide.gen import write_dataset
from dslide.mpirun import MpiJob, run_mpi

PASSES, KILLS = 24, 5  # a kill cycle makes at most 3 passes


def train_argv(xc: Path, ck: Path, *extra: object) -> list[object]:
    return ["-m", "dslide", "train", "--train", xc / "train", "--test", xc / "test.txt", "--epochs", PASSES,
            "--hidden", 32, "--batch", 128, "--budget", 16, "--threads", 1, "--eval-points", 8, "--checkpoint", ck,
            *extra]  # fmt: skip


def records(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def step_of(name: str) -> int:
    return int(re.match(r"ck-s(\d+)-", name).group(1))


def shards(ck: Path) -> dict[str, np.ndarray]:
    manifest = read_manifest(ck)
    out = {}
    for name in manifest["shards"]:
        with np.load(ck / manifest["dir"] / name) as z:
            out.update({f"{name}/{k}": z[k] for k in z.files})
    return out


def until(job: MpiJob, done: Callable[[], bool], what: str) -> float:
    """Poll ``done`` until it holds (then return when), failing if the job ends or a minute passes first."""
    deadline = time.monotonic() + 60
    while not done():
        assert job.proc.poll() is None, f"the job ended waiting for {what}: {job.wait(1).stderr[-2000:]}"
        assert time.monotonic() < deadline, f"no {what} within a minute"
        time.sleep(0.002)
    return time.monotonic()


def next_save(job: MpiJob, ck: Path) -> float:
    """Wait until the job's next save begins (its directory appears); returns when."""
    live = step_of(read_manifest(ck)["dir"])
    return until(job, lambda: any(p.name.startswith("ck-s") and step_of(p.name) > live for p in ck.iterdir()), "save")


def save_seconds(job: MpiJob, ck: Path) -> float:
    """How long the job's next save takes, from its directory's appearance to the manifest naming it."""
    live = read_manifest(ck)["dir"]
    started = next_save(job, ck)
    return until(job, lambda: read_manifest(ck)["dir"] != live, "commit") - started


def check_after_kill(ck: Path, reported: int, why: str) -> bool:
    """The latest complete checkpoint loads and holds every reported pass; the only other thing in the directory
    is the save the kill interrupted.  Returns whether there was one."""
    manifest = read_manifest(ck)
    _, meta = load_model(ck, SerialComm())
    assert meta["passes"] >= reported, why
    live = ck / manifest["dir"]
    assert sorted(p.name for p in live.iterdir()) == sorted(manifest["shards"]), why
    others = [p.name for p in ck.iterdir() if p.name not in (MANIFEST, live.name)]
    unfinished = [name for name in others if name.startswith("ck-s")]
    # at most one: the save the kill interrupted (a newer step), or the checkpoint a finished save was removing
    assert len(unfinished) <= 1 and all(step_of(name) != step_of(live.name) for name in unfinished), (others, why)
    assert all(name.startswith(".tmp-checkpoint.json.") for name in set(others) - set(unfinished)), (others, why)
    return bool(others)


def test_kills_at_random_points_during_checkpoints_resume_bit_for_bit(tmp_path: Path) -> None:
    xc = tmp_path / "xc"
    write_dataset(xc, 128, 200, 6000, shards=1, test_points=8, seed=2)  # 1 step a pass, ~8 MB a checkpoint
    straight = run_mpi(2, train_argv(xc, tmp_path / "straight"), timeout=180)
    assert not straight.timed_out and straight.returncode == 0, straight.stderr[-2000:]

    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    ck = tmp_path / "ck"
    kills = mid_save = 0
    while kills < KILLS:
        with MpiJob(2, train_argv(xc, ck, *(["--resume"] if kills else []))) as job:
            until(job, lambda: records(job.stdout_so_far()), "a report")  # loaded, trained, saved a pass
            delay = rng.uniform(0, save_seconds(job, ck))
            victims = rng.choice([(0,), (1,), (0, 1)])
            next_save(job, ck)
            time.sleep(delay)
            pids = job.rank_pids()
            for rank in victims:
                os.kill(pids[rank], signal.SIGKILL)
            result = job.wait(30)
        assert not result.timed_out, f"the job hung after ranks {victims} were killed"
        assert result.returncode != 0, f"finished before kill {kills + 1}: raise PASSES"
        kills += 1
        reported = max((r["pass"] for r in records(result.stdout)), default=0)
        why = f"seed {seed}, kill {kills}: ranks {victims} {delay:.3f} s into a save"
        mid_save += check_after_kill(ck, reported, why)

    final = run_mpi(2, train_argv(xc, ck, "--resume"), timeout=180)
    assert not final.timed_out and final.returncode == 0, final.stderr[-2000:]
    want, got = records(straight.stdout)[-1], records(final.stdout)[-1]
    assert got["pass"] == want["pass"] == PASSES
    assert [got[k] for k in ("steps", "loss", "train_err", "p_at_1")] == [
        want[k] for k in ("steps", "loss", "train_err", "p_at_1")
    ], f"seed {seed}"
    a, b = shards(tmp_path / "straight"), shards(ck)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=f"{k}, seed {seed}")
    assert {p.name for p in ck.iterdir()} == {MANIFEST, read_manifest(ck)["dir"]}
    print(f"seed {seed}: {kills} kills, {mid_save} inside a save")
