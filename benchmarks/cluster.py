"""A four-node Slurm cluster (issue 51): dslide across the nodes, one job per mode, the slow tier shared and slow.

The cluster is ``tierfs.testing.cluster``'s (slurmctld, four slurmd nodes in namespaces of their own, the slow tier
an sshfs mount of one host whose link is throttled to ``--slow-rate``).  Each mode is one ``sbatch`` of four
nodes, one rank each, training ``--epochs`` epochs of an XC data set (``dslide gen``), the nodes' caches emptied
before it:

* ``direct``: full shuffle from the slow tier, no tierfs (``dslide train --train SLOW``: rank 0 reads every file
  of every epoch over its sshfs and sends the points to the others);
* ``sharded``: a tierfs mount per node without peers (``rank=``, ``world_size=`` from the launcher): each node
  stages its share of every epoch from the slow tier (``--read node``);
* ``peers``: ``examples/slurm/train.sbatch`` as a site runs it (``peers=mpi``, ``rf`` ``--rf``);
* ``peers-auto``: the same with ``rf=auto``: rf 1 (a full shuffle of the data set every epoch) once staging keeps up.

sshfs numbers inodes per mount, so each node sees its own numbers (tierfs: ``stable_inodes=auto``, a copy known by
size, mtime and ctime); ``--stable`` gives the nodes the slow tier's directory bound instead (as NFS keeps the
server's file ids: the same numbers on every node, the inode in a copy's identity; unthrottled): the peers' bytes
of the two runs compare the two identities.

Per mode: the bytes the slow host sent (its link's counter: sshfs's and ssh's overhead included) in all and after
the first epoch, the tierfs daemons' ``backing_bytes_read`` and ``peers.fetched_bytes``, the job's seconds, the
training samples/s, the last pass's rf and the test P@1 after each epoch.  ``python benchmarks/cluster.py`` is
the docs' run (a few minutes on a 2-core box; root); writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tierfs.testing import cluster as slurm  # noqa: E402

MODES = ("direct", "sharded", "peers", "peers-auto")
_SHARDED = """#!/bin/bash
#SBATCH --ntasks-per-node=1
set -euo pipefail
export SLURM_OVERLAP=1
mnt=$TIERFS_MNT_BASE/$SLURM_JOB_ID
srun --ntasks-per-node=1 mkdir -p "$mnt"
mpiexec -n "$SLURM_NNODES" -ppn 1 bash -c 'exec tierfs mount "$0" "$1" --cache "$2" --capacity "$3" \
    -o "$4,rank=$PMI_RANK,world_size=$PMI_SIZE"' "$TIERFS_DATA" "$mnt" "$TIERFS_CACHE" "$TIERFS_CAPACITY" \
    "$TIERFS_OPTIONS" &
for _ in $(seq 300); do
    srun --ntasks-per-node=1 --quiet test -e "$mnt/.tierfs/status" 2>/dev/null && break
    sleep 1
done
mpiexec -n "$SLURM_NTASKS" dslide train --train "$mnt" --read node --control "$mnt/.tierfs/control" "$@"
srun --ntasks-per-node=1 --output "$TIERFS_REPORT/%N.json" tierfs status --json "$mnt"
srun --ntasks-per-node=1 tierfs umount "$mnt"
wait
"""
_DIRECT = """#!/bin/bash
#SBATCH --ntasks-per-node=1
set -euo pipefail
mpiexec -n "$SLURM_NTASKS" dslide train --train "$TIERFS_DATA" "$@"
"""


def _slow_sent(c: slurm.Cluster) -> int:
    """Bytes the slow host's link has sent."""
    out = subprocess.run(["ip", "-n", f"tfc{c.tag}-slow", "-j", "-s", "link", "show", "eth0"], check=True,
                         capture_output=True, text=True).stdout
    return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])


def run_mode(c: slurm.Cluster, mode: str, args: argparse.Namespace, data: int, blocks: int) -> dict:
    out = c.root / "runs" / mode
    out.mkdir(parents=True)
    for n in c.nodes:  # (each mode from cold caches)
        shutil.rmtree(c.root / "nodes" / n / "nvme" / "tierfs", ignore_errors=True)
    script = ROOT / "examples" / "slurm" / "train.sbatch"
    if mode in ("sharded", "direct"):
        script = out / "job.sbatch"
        script.write_text(_SHARDED if mode == "sharded" else _DIRECT)
    nm = args.nm
    capacity = blocks // 4 + 2 * blocks // (4 * nm) + 2 * blocks // args.shards
    rf = "auto" if mode == "peers-auto" else str(args.rf)
    train = c.site / "slow" / "xc" / "train"
    env = {**c.env(), "TIERFS_DATA": str(train), "TIERFS_CACHE": str(c.site / "nvme" / "tierfs"),
           "TIERFS_CAPACITY": str(capacity), "TIERFS_OPTIONS": f"nm={nm},rf={rf},seed=1,composition=random",
           "TIERFS_REPORT": str(out)}
    # (direct: a pass is an epoch; tierfs modes: the passes of --epochs at rf --rf -- rf=auto makes more epochs of
    # them -- the records say which epoch each pass was in)
    passes = args.epochs if mode == "direct" else args.epochs * nm * args.rf
    sent0, t0 = _slow_sent(c), time.monotonic()
    job = subprocess.run(
        ["sbatch", "--parsable", "--nodes=4", "--output", str(out / "job.out"), str(script),
         "--epochs", str(passes), "--test", str(c.site / "slow" / "xc" / "test.txt"), "--hidden", "64",
         "--budget", "64", "--batch", "32", "--threads", "1", "--eval-points", "0", "--seed", "4"],
        env=env, check=True, capture_output=True, text=True).stdout.strip()
    sent_after_first = None
    while True:
        state = c.slurm("scontrol", "show", "job", job)
        if sent_after_first is None and (out / "job.out").exists():
            recs = _records(out)
            if _epoch_of(recs, mode) >= 1:
                sent_after_first = _slow_sent(c)
        if not any(s in state for s in ("JobState=PENDING", "JobState=RUNNING", "JobState=COMPLETING")):
            break
        if time.monotonic() - t0 > args.mode_timeout:
            subprocess.run(["scancel", job], env=c.env())
            raise RuntimeError(f"{mode}: over {args.mode_timeout} s")
        time.sleep(0.5)
    seconds, sent = time.monotonic() - t0, _slow_sent(c) - sent0
    recs = _records(out)
    if "ExitCode=0:0" not in state or not recs:
        raise RuntimeError(f"{mode}: {state}\n{(out / 'job.out').read_text()[-3000:]}")
    reports = {n: json.loads((out / f"{n}.json").read_text()) for n in c.nodes} if mode != "direct" else {}
    return {
        "mode": mode, "seconds": round(seconds, 1), "passes": len(recs),
        "slow_MiB": round(sent / 2**20, 2), "data_MiB": round(data / 2**20, 2),
        "slow_MiB_after_epoch_0": round((sent0 + sent - (sent_after_first or sent0 + sent)) / 2**20, 2),
        "backing_MiB": round(sum(r["backing_bytes_read"] for r in reports.values()) / 2**20, 2),
        "peers_MiB": round(sum(r["peers"]["fetched_bytes"] for r in reports.values()) / 2**20, 2),
        "samples_per_s": round(sum(r["samples_per_s"] for r in recs) / len(recs), 1),
        "rf_last": recs[-1].get("tierfs", {}).get("rf") if mode != "direct" else 1,
        "p_at_1": [r["p_at_1"] for r in recs],
        # the inode number each node sees for one file: numbered per node by sshfs, the same bound (--stable)
        "inodes": [c.run_on(n, ["stat", "-c", "%i", str(train / sorted(os.listdir(c.data / "xc" / "train"))[-1])]
                            ).stdout.strip() for n in c.nodes],
    }


def _records(out: Path) -> list[dict]:
    text = (out / "job.out").read_text(errors="replace") if (out / "job.out").exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _epoch_of(recs: list[dict], mode: str) -> int:
    """The epoch the job is in, by its records so far (direct: one a pass; else the mount's, rank 0's)."""
    if mode == "direct" or not recs:
        return len(recs)
    return int(recs[-1].get("tierfs", {}).get("epoch") or 0)


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--nm", type=int, default=4)
    p.add_argument("--rf", type=int, default=2)
    p.add_argument("--shards", type=int, default=32)
    p.add_argument("--points", type=int, default=12800)
    p.add_argument("--slow-rate", default="40mbit")
    p.add_argument("--mode-timeout", type=float, default=600)
    p.add_argument("--stable", action="store_true",
                   help="the slow tier's directory bound on every node (stable inode numbers), not sshfs")
    p.add_argument("--root", type=Path, default=Path("/tmp/tierfs-cluster-bench"))
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cluster.json")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupted)  # (a kill ends the cluster too: the context manager's exit)
    shutil.rmtree(args.root, ignore_errors=True)
    results = []
    with slurm.cluster(args.root, slow_rate=args.slow_rate, slow_tier="bind" if args.stable else "sshfs") as c:
        subprocess.run([sys.executable, "-m", "dslide", "gen", str(c.data / "xc"), "--points", str(args.points),
                        "--features", "2000", "--labels", "500", "--shards", str(args.shards), "--seed", "2",
                        "--test-points", "2000"], check=True, capture_output=True)
        files = list((c.data / "xc" / "train").iterdir())
        data, blocks = sum(f.stat().st_size for f in files), sum(os.stat(f).st_blocks * 512 for f in files)
        for mode in args.modes.split(","):
            res = run_mode(c, mode, args, data, blocks)
            print(json.dumps(res), flush=True)
            results.append(res)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                   indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
