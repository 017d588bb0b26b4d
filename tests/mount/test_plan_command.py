"""``tierfs plan``: on a tree of small files (where ``du -sb`` undercounts what the cache holds) it gives the nm
the mount then takes at that capacity, and the mount refuses one fewer."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

from sampler.iomodel import mini_epochs_needed
from tierfs.client import Client
from tierfs.common.options import format_size_at_least
from tierfs.testing.harness import make_dataset, mounted

TIERFS = [sys.executable, "-m", "tierfs"]


def run_tierfs(*args):
    return subprocess.run([*TIERFS, *map(str, args)], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def test_plan_gives_the_nm_the_mount_accepts_on_small_files(tmp_path):
    backing = tmp_path / "backing"
    files = make_dataset(backing, dirs=3, files_per_dir=200, max_size=512, seed=5)
    (tmp_path / "mnt").mkdir()
    (tmp_path / "disk").mkdir()  # where the cache will be: its blocks
    capacity = 1 << 20
    res = run_tierfs("plan", backing, "--capacity", "1M", "--cache-disk", tmp_path / "disk", "--measure", "0.2",
                     "--json")
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    nm = plan["nm"]
    assert plan["files"] == len(files) and plan["logical_bytes"] == sum(files.values())
    assert plan["disk_bytes"] >= len(files) * plan["block"]  # each small file costs a whole block
    assert nm > mini_epochs_needed(sum(files.values()), capacity)  # what du -sb would have said
    assert plan["backing_bytes_per_s"] > 0 and plan["cache_bytes_per_s"] > 0
    assert not list((tmp_path / "disk").iterdir())  # the write test left nothing

    refused = run_tierfs("mount", backing, tmp_path / "mnt", "--cache", tmp_path / "disk" / "c", "--capacity", "1M",
                         "--nm", nm - 1)
    assert refused.returncode == 1 and f"use nm >= {nm}" in refused.stderr, refused.stderr
    with mounted(backing, tmp_path / "mnt", tmp_path / "disk" / "cache", capacity, nm=nm) as m:
        assert m.status()["nm"] == nm

    text = run_tierfs("plan", backing, "--capacity", "1M", "--measure", "0.2", "--consumption", "10M")
    assert text.returncode == 0, text.stderr
    if plan["block"] == 4096:  # (without --cache-disk plan counts 4K blocks)
        assert f"tierfs mount {backing} /mnt/backing --cache DIR --capacity 1M --nm {nm} --rf " in text.stdout
    assert "\naccuracy     rf " in text.stdout and "convergence study" in text.stdout
    assert "\nrf           " in text.stdout and "(rf >= EB1 / B2)" in text.stdout  # --consumption gives a number


def test_plan_refuses_a_capacity_below_two_copies_of_the_largest_file(tmp_path):
    make_dataset(tmp_path / "b", dirs=1, files_per_dir=3, min_size=100_000, max_size=100_000, seed=1)
    res = run_tierfs("plan", tmp_path / "b", "--capacity", "64K", "--measure", "0")
    assert res.returncode == 1
    assert res.stderr.strip().startswith("tierfs: error: capacity 64K cannot hold two copies of the largest file")
    copy = -(-100_000 // 4096) * 4096  # 4K blocks without --cache-disk
    assert res.stderr.strip().endswith(f"use at least {format_size_at_least(2 * copy)}")


# ------------------------------------------------------------------------------------------------ issue 47


def test_the_printed_mount_command_runs_as_printed(dataset, mount_dirs, daemons, tmp_path):
    """Relative paths in, the command out: run from another dir exactly as printed, by a user who has not put
    this environment on PATH (a fresh clone: the command names ``.venv/bin/tierfs``), it mounts with the listing
    the README's recipe needs, serves, and unmounts."""
    from tierfs.daemon.fuse.mount import default_log_path

    backing, files = dataset
    mnt, _ = mount_dirs
    (tmp_path / "disk").mkdir()
    env = {**os.environ, "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}  # (no venv)
    res = subprocess.run([*TIERFS, "plan", "backing", "--capacity", "1M", "--cache-disk", "disk", "--mountpoint", "mnt",
                          "--measure", "0.2"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    line = res.stdout.splitlines()[-1]
    assert line.startswith("mount with   "), res.stdout
    argv = shlex.split(line.removeprefix("mount with   "))
    assert argv[argv.index("--cache") + 1] == str(tmp_path / "disk" / "tierfs-cache")
    if shutil.which("tierfs", path=env["PATH"]) is None:
        assert argv[0] == os.path.join(os.path.dirname(sys.executable), "tierfs"), argv
    try:
        ran = subprocess.run(argv, cwd="/", env=env, capture_output=True, text=True, timeout=120,
                             stdin=subprocess.DEVNULL)
        assert ran.returncode == 0, ran.stderr  # --daemon: back once the mount answers
        settings = Client(str(mnt)).settings()
        assert settings["listing"] == "all" and settings["nm"] == argv[argv.index("--nm") + 1]
        listed = {f"{d}/{n}" for d in os.listdir(mnt) for n in os.listdir(mnt / d)}
        assert listed == set(files)  # the README's recipe: a dataset built once sees every file
        for rel in files:
            assert (mnt / rel).read_bytes() == (backing / rel).read_bytes()
        assert run_tierfs("umount", mnt).returncode == 0
        assert not daemons()
    finally:
        if os.path.exists(default_log_path(str(mnt))):
            os.unlink(default_log_path(str(mnt)))


def test_plan_says_how_steady_its_rate_tests_were_and_its_accuracy_note_is_of_its_rf(dataset, tmp_path):
    backing, _ = dataset
    (tmp_path / "disk").mkdir()
    for consumption in ("1K", "100T"):  # a loader slower than the tiers (rf 1), one far faster (rf above 4)
        res = run_tierfs("plan", backing, "--capacity", "1M", "--cache-disk", tmp_path / "disk", "--measure", "0.4",
                         "--consumption", consumption)
        assert res.returncode == 0, res.stderr
        text = res.stdout.replace("\n             ", " ")  # (a long line wraps)
        assert re.search(r"backing read \S+/s \(slices \S+-\S+/s[;)]", text), text
        assert re.search(r"cache disk write \S+/s \(slices \S+-\S+/s[;)]", text), text
        rf = int(re.search(r"^rf +(\d+):", text, re.M).group(1))
        assert (rf == 1) == (consumption == "1K") and (rf > 4) == (consumption == "100T")
        assert re.search(rf"^accuracy +rf {rf} ", text, re.M), text  # of the rf advised, not of another
    plan = json.loads(run_tierfs("plan", backing, "--capacity", "1M", "--cache-disk", tmp_path / "disk",
                                 "--measure", "0.4", "--json").stdout)
    for tier in ("backing", "cache"):
        low, high = plan[f"{tier}_spread"]
        assert low <= plan[f"{tier}_bytes_per_s"] * (1 + 1e-9) and plan[f"{tier}_bytes_per_s"] <= high * (1 + 1e-9)
