"""Every mode through a real mount: whatever the options, a loader reads only correct bytes under the cap."""

from __future__ import annotations

import hashlib
import os

import pytest


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.mark.parametrize("options", [
    {"advance": "strict", "rf": 1},
    {"policy": "lru"},
    {"verify": "xxhash"},
    {"composition": "stratified"},
    {"composition": "contiguous", "rf": "auto"},
    {"composition": "reservoir"},
    {"view": "full"},
    {"rank": 1, "world_size": 2, "arf": "score", "arf_wait": 1},
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_modes_read_correct_bytes(tierfs_mount, dataset, options):
    backing, files = dataset
    capacity = sum(files.values()) // 2
    with tierfs_mount(capacity=capacity, **{"nm": 4, "rf": 2, **options}) as m:
        mnt = m.mountpoint
        for _ in range(6):
            listed = []
            for d in sorted(os.listdir(mnt)):
                listed += [f"{d}/{n}" for n in os.listdir(os.path.join(mnt, d))]
            assert listed
            for rel in listed:
                assert _digest(m.path(rel)) == _digest(os.path.join(backing, rel))
            if options.get("arf"):
                m.control("feedback loss=1\n")
            st = m.status()
            assert st["cache_bytes"] <= st["cache_capacity"] == capacity
        st = m.status()
        assert st["passes_total"] >= 5
        if options.get("view") == "full" or options.get("policy") == "lru":
            assert st["view_files"] == len(files)
        if options.get("world_size"):
            assert st["view_files"] < len(files) // 4
