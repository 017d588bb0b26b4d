"""Loaders that build their file list once, before the epoch loop, against real mounts: told when they do not
follow the view; one sampler line to follow it."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tierfs.client import Client
from tierfs.summary import format_status

_DEADLINE = 120  # seconds for one epoch's reads (a hung mount fails the test; mounted() aborts it after)


def _read_all(paths: list[str]) -> list[bytes]:
    """Read each path whole, in order, in a thread with a deadline."""
    def work() -> list[bytes]:
        return [Path(p).read_bytes() for p in paths]

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(work).result(timeout=_DEADLINE)


def _listing(root: str) -> list[str]:
    """What a loader built once holds: every file its one listing found, sorted (ImageFolder's order)."""
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)


def test_a_file_list_built_once_is_told_with_the_fix(tierfs_mount, dataset):
    backing, files = dataset
    with tierfs_mount(capacity=sum(files.values()), nm=4, rf=1, advance="strict") as m:
        paths = _listing(m.mountpoint)  # listed once: the first mini-epoch
        assert 0 < len(paths) < len(files)
        for _ in range(4):  # the loop a training script runs over its one file list
            for p, data in zip(paths, _read_all(paths), strict=True):
                assert data == (backing / os.path.relpath(p, m.mountpoint)).read_bytes()
        st = m.status()
        assert st["reads"]["out_of_view"] >= 2 * len(paths)
        assert st["loader"]["follows_view"] is False and st["loader"]["warnings"] >= 1
        assert "MountSampler" in st["loader"]["warning"]
        assert "tierfs_loader_off_view 1" in Client(m.mountpoint).metrics()
        assert "does not follow the view" in format_status(st)
        log = m.stderr()
        assert log.count("does not follow the view") == 1 and "listing=all" in log


def test_a_loader_that_relists_each_pass_is_not_warned(tierfs_mount, dataset):
    _, files = dataset
    with tierfs_mount(capacity=sum(files.values()), nm=4, rf=1, advance="strict") as m:
        for _ in range(6):
            _read_all(_listing(m.mountpoint))
        st = m.status()
        assert st["passes_total"] >= 5 and st["loader"] == {"follows_view": True, "warning": None, "warnings": 0}
        assert "does not follow" not in m.stderr()
