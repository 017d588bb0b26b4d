"""``tierfs plan``: on a tree of small files (where ``du -sb`` undercounts what the cache holds) it gives the nm
the mount then takes at that capacity, and the mount refuses one fewer."""

from __future__ import annotations

import json
import subprocess
import sys

from sampler.iomodel import mini_epochs_needed
from tierfs.options import format_size_at_least
from tierfs.testing import make_dataset, mounted

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
        assert f"tierfs mount {backing} MOUNTPOINT --cache DIR --capacity 1M --nm {nm} --rf " in text.stdout
    assert "\naccuracy     in our convergence study" in text.stdout
    assert "\nrf           " in text.stdout and "(rf >= EB1 / B2)" in text.stdout  # --consumption gives a number


def test_plan_refuses_a_capacity_below_two_copies_of_the_largest_file(tmp_path):
    make_dataset(tmp_path / "b", dirs=1, files_per_dir=3, min_size=100_000, max_size=100_000, seed=1)
    res = run_tierfs("plan", tmp_path / "b", "--capacity", "64K", "--measure", "0")
    assert res.returncode == 1
    assert res.stderr.strip().startswith("tierfs: error: capacity 64K cannot hold two copies of the largest file")
    copy = -(-100_000 // 4096) * 4096  # 4K blocks without --cache-disk
    assert res.stderr.strip().endswith(f"use at least {format_size_at_least(2 * copy)}")
