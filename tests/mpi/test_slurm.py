"""A site's recipe run for real (issue 51): a four-node Slurm cluster on this machine (``tierfs.testing.cluster``:
slurmctld, four slurmd in network, mount, UTS and PID namespaces of their own, munge, a slow tier the nodes mount
by sshfs over a throttled link), jobs submitted with ``sbatch examples/slurm/train.sbatch`` that mount tierfs on
every node with ``peers=mpi`` and train dslide across the nodes from the mounts (``--read node``), the site's
Epilog (``examples/slurm/epilog.sh``) behind them.  Every job has a deadline (``scancel`` past it); the cluster,
its namespaces, processes and mounts end with the module."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tierfs.testing import cluster as slurm
from tierfs.testing.harness import wait_until

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SHARDS, NM, RF = 16, 4, 2
EPOCHS = 3  # of the data set: NM * RF passes each
_JOB_S = 240  # the longest a job may take


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    for tool in ("slurmctld", "slurmd", "munged", "sshd", "sshfs"):
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            pytest.fail(f"the cluster tests need {tool} (scripts/setup.sh installs slurm-wlm, munge, sshfs, "
                        "openssh-server)")
    root = tmp_path_factory.mktemp("cluster")
    with slurm.cluster(root, epilog=ROOT / "examples" / "slurm" / "epilog.sh") as c:
        subprocess.run([sys.executable, "-m", "dslide", "gen", str(c.data / "xc"), "--points", "3200",
                        "--features", "500", "--labels", "100", "--shards", str(SHARDS), "--seed", "2"],
                       check=True, capture_output=True, timeout=120)
        yield c


def _data_bytes(c: slurm.Cluster) -> int:
    return sum(f.stat().st_size for f in (c.data / "xc" / "train").iterdir())


def _submit(c: slurm.Cluster, name: str, passes: int, **env: str) -> tuple[str, Path]:
    """``sbatch`` the site's job script on the four nodes; (job id, the directory of its output and report)."""
    out = c.root / "jobs" / name
    out.mkdir(parents=True)
    blocks = sum(os.stat(f).st_blocks * 512 for f in (c.data / "xc" / "train").iterdir())
    # each node's cap: its quarter of the data set (the files it owns), two mini-epochs of its share, a little more
    capacity = blocks // 4 + 2 * blocks // (4 * NM) + 2 * blocks // SHARDS
    job_env = {**c.env(), "TIERFS_DATA": str(c.site / "slow" / "xc" / "train"),
               "TIERFS_CACHE": str(c.site / "nvme" / "tierfs"), "TIERFS_CAPACITY": str(capacity),
               "TIERFS_OPTIONS": f"nm={NM},rf={RF},seed=1,peer_timeout=2", "TIERFS_REPORT": str(out), **env}
    job = subprocess.run(
        ["sbatch", "--parsable", "--nodes=4", "--output", str(out / "job.out"),
         str(ROOT / "examples" / "slurm" / "train.sbatch"), "--epochs", str(passes), "--test",
         str(c.site / "slow" / "xc" / "test.txt"), "--hidden", "32", "--budget", "32", "--batch", "16",
         "--threads", "1", "--eval-points", "100", "--seed", "4"],
        env=job_env, check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    return job, out


def _state(c: slurm.Cluster, job: str) -> str:
    """The job's state and exit code, as ``scontrol`` shows them (``JobState=COMPLETED ExitCode=0:0``)."""
    show = c.slurm("scontrol", "show", "job", job)
    return " ".join(w for w in show.split() if w.startswith(("JobState=", "ExitCode=")))


def _finished(c: slurm.Cluster, job: str, timeout: float = _JOB_S) -> str:
    try:
        wait_until(lambda: "JobState=PENDING" not in (s := _state(c, job)) and "RUNNING" not in s
                   and "COMPLETING" not in s, timeout=timeout, what=f"job {job} to end")
    finally:
        subprocess.run(["scancel", job], env=c.env(), capture_output=True, timeout=30)
    return _state(c, job)


def _left_behind(c: slurm.Cluster) -> dict[str, list]:
    """Per node: its tierfs mounts, and its processes other than the node's own (slurmd, sshfs and its ssh)."""
    left: dict[str, list] = {}
    for n in c.nodes:
        mounts = [m for m in c.mounts(n) if m[1].startswith("fuse.tierfs") or m[0].startswith(str(c.site / "mnt"))]
        procs = [name for name in c.processes(n) if name not in ("slurmd", "sshfs", "ssh")]
        if mounts or procs:
            left[n] = mounts + procs
    return left


def _reports(out: Path, c: slurm.Cluster) -> dict[str, dict]:
    return {n: json.loads((out / f"{n}.json").read_text()) for n in c.nodes}


def test_jobs_mount_every_node_train_from_the_mounts_and_find_the_caches_warm(site):
    """Job 1: three epochs, slow tier read once (each node its share in epoch 0, from the peers after); no mount
    left.  Job 2 over the same caches: the slow tier read for nothing (each node's owned share kept)."""
    c = site
    data = _data_bytes(c)
    passes = EPOCHS * NM * RF
    runs = {}
    for name in ("first", "second"):
        job, out = _submit(c, name, passes)
        state = _finished(c, job)
        log = (out / "job.out").read_text(errors="replace")
        assert "JobState=COMPLETED ExitCode=0:0" in state, f"{state}\n{log[-4000:]}\n{c.log('n1')[-2000:]}"
        records = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
        assert [r["pass"] for r in records] == list(range(1, passes + 1)), log[-3000:]
        runs[name] = (records, _reports(out, c))
        wait_until(lambda: not _left_behind(c), timeout=60, what=f"the nodes to be clean: {_left_behind(c)}")

    records, reports = runs["first"]
    # every pass is the union of the four nodes' shares: the whole data set each epoch, each file once
    assert sum(r["files"] for r in records) == EPOCHS * SHARDS * RF
    slow = sum(r["backing_bytes_read"] for r in reports.values())
    from_peers = sum(r["peers"]["fetched_bytes"] for r in reports.values())
    assert slow <= data * 1.01, (slow, data)  # epoch 0: the data set once; after it <= 1 %
    # (each later epoch a node reads its share, of which it owns about a quarter: the rest, ~3/4 of the data set
    # an epoch for the four, from the peers)
    assert from_peers >= data * (EPOCHS - 1) * 0.6, (from_peers, data)
    assert all(r["peers"]["world_size"] == 4 and r["peers"]["alive"] == 3 for r in reports.values())
    assert records[-1]["p_at_1"] > records[0]["p_at_1"]  # (it learned)

    records, reports = runs["second"]
    slow = sum(r["backing_bytes_read"] for r in reports.values())
    assert slow <= data * 0.01, (slow, data)  # warm from its first epoch


def test_scancel_mid_epoch_leaves_no_mount_and_no_process(site):
    c = site
    job, out = _submit(c, "cancelled", 1000)
    wait_until(lambda: "pass 2/" in ((out / "job.out").read_text(errors="replace") if (out / "job.out").exists()
                                     else ""), timeout=_JOB_S, what="the job to train")
    assert len([m for n in c.nodes for m in c.mounts(n) if m[1].startswith("fuse.tierfs")]) == 4
    subprocess.run(["scancel", job], env=c.env(), check=True, capture_output=True, timeout=30)
    state = _finished(c, job, timeout=120)
    assert "JobState=CANCELLED" in state, state
    wait_until(lambda: not _left_behind(c), timeout=60, what=f"the nodes to be clean: {_left_behind(c)}")
