"""Loaders that build their file list once, before the epoch loop, against real mounts: told when they do not
follow the view; one sampler line to follow it."""

from __future__ import annotations

import gc
import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

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


def test_listing_all_lists_every_file_while_the_view_stays_the_mini_epoch(tierfs_mount, dataset):
    _, files = dataset
    with tierfs_mount(capacity=sum(files.values()), nm=4, rf=2, listing="all") as m:
        listed = {os.path.relpath(p, m.mountpoint) for p in _listing(m.mountpoint)}
        assert listed == set(files)
        st = m.status()
        order = Client(m.mountpoint).order()
        assert st["view_files"] == len(order) < len(files)
        _read_all([m.path(p.decode()) for p in order])  # a pass of the view ends as it always did
        assert m.status()["passes_total"] == st["passes_total"] + 1


class _FolderDataset:
    """An ImageFolder-equivalent (torchvision's cannot be imported here): sorted class folders, ``samples`` of
    ``(path, class)``; an item is (index, bytes, class)."""

    def __init__(self, root: str) -> None:
        self.classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        self.samples = [(os.path.join(root, c, f), i) for i, c in enumerate(self.classes)
                        for f in sorted(os.listdir(os.path.join(root, c)))]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, label = self.samples[i]
        with open(path, "rb") as f:
            return i, f.read(), label


def _collate(batch):
    return batch


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # (8 workers on a 2-core test machine)
def test_a_dataset_built_once_with_the_sampler_reads_each_pass_once_across_two_ranks(mount_dirs):
    """The issue's done-when: a DataLoader over an ImageFolder-equivalent dataset built once, with MountSampler
    and persistent_workers=True, 4 workers, 2 ranks (two DataLoaders iterated at once, as two processes would)."""
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from tierfs.testing import make_dataset, mounted
    from tierfs.torch import MountSampler

    backing = Path(mount_dirs[0]).parent / "backing64"
    files = make_dataset(backing, dirs=4, files_per_dir=16, max_size=16 << 10, seed=5)
    total = sum(files.values())
    mnt, cache = mount_dirs
    nm, rf, epochs = 4, 2, 8
    with mounted(backing, mnt, cache, total, nm=nm, rf=rf, listing="all") as m:
        ds = _FolderDataset(m.mountpoint)  # built once: listing=all lists every file
        assert len(ds) == len(files)
        samplers = [MountSampler(ds, rank=r, world_size=2) for r in range(2)]
        loaders = [DataLoader(ds, batch_size=5, sampler=s, num_workers=4, persistent_workers=True,
                              collate_fn=_collate) for s in samplers]
        client = Client(m.mountpoint)
        st0 = m.status()
        positions = []
        with ThreadPoolExecutor(2) as pool:
            for epoch in range(epochs):
                for s in samplers:
                    s.set_epoch(epoch)
                st = m.status()
                order = [p.decode() for p in client.order()]
                positions.append((st["epoch"], st["mini_epoch"]))
                # (each epoch's iterators made here, so that the workers are forked by this thread alone)
                its = [iter(dl) for dl in loaders]
                runs = [pool.submit(lambda it: [item for batch in it for item in batch], it) for it in its]
                got = [r.result(timeout=_DEADLINE) for r in runs]
                assert samplers[0].indices.last_pass == samplers[1].indices.last_pass == st["passes_total"]
                assert len(got[0]) == len(got[1]) == -(-len(order) // 2)  # the same count on each rank
                read = [os.path.relpath(ds.samples[i][0], m.mountpoint) for g in got for i, _, _ in g]
                # every file of the pass, once; the odd pass pads one rank with the pass's first file
                assert sorted(set(read)) == sorted(order) and len(read) - len(order) == len(order) % 2
                assert [os.path.relpath(ds.samples[i][0], m.mountpoint) for i, _, _ in got[0]] == order[0::2]
                for g in got:
                    for i, data, label in g:
                        rel = os.path.relpath(ds.samples[i][0], m.mountpoint)
                        assert data == (backing / rel).read_bytes()
                        assert label == sorted(p.name for p in backing.iterdir()).index(rel.split("/")[0])
                # the pass ended (every rank's reads): the next epoch gets the next pass
                assert m.status()["passes_total"] == st["passes_total"] + 1
        del loaders, its, runs  # (the persistent workers stop now, while the mount serves)
        gc.collect()
        st = m.status()
        assert st["passes_total"] - st0["passes_total"] == epochs
        assert st["loader"]["follows_view"] and st["reads"]["out_of_view"] == 0
        mini_epochs = sorted(set(positions))
        assert len(mini_epochs) >= epochs // rf - 1  # mini-epochs advance (advance=ready may repeat one)
        # The slow tier: each mini-epoch is staged once while the previous one is read rf times, so nm*rf passes
        # (one epoch, data/rf per data-worth of samples) read the data once, plus the mini-epoch staged ahead.
        biggest = max(st["view_bytes"], st["prefetch"]["bytes_total"])
        assert st["backing_bytes_read"] <= total * epochs / (nm * rf) + 2 * biggest
        assert st["backing_bytes_read"] <= total * 1.5


def test_a_pass_left_unread_is_ended_by_rank_0_and_a_plain_directory_gives_every_index(tierfs_mount, dataset):
    from tierfs.loaders import PassIndices

    backing, files = dataset
    plain = PassIndices(_listing(str(backing)), rank=2, world_size=3)  # 32 files: 11 each, rank 2 padded
    assert plain.next_pass() == plain.next_pass() == [*range(2, 32, 3), 0]
    with tierfs_mount(capacity=sum(files.values()), nm=4, rf=4, listing="all") as m:
        paths = _listing(m.mountpoint)
        idx = PassIndices(paths, wait=0.5)
        first = idx.next_pass()
        _read_all([paths[i] for i in first[: len(first) // 2]])  # a break half way through the epoch
        passes = m.status()["passes_total"]
        second = idx.next_pass()  # waits 0.5 s, then ends the pass left unread
        assert idx.last_pass == passes + 1 == m.status()["passes_total"]
        assert sorted(second) == sorted(first) and second != first  # the same mini-epoch, a new order


def test_substitute_gives_a_loader_built_once_mini_epochs_with_no_change(mount_dirs):
    """The dataset built once, no sampler, substitute on: every read is a whole view file of the name's class
    folder (fstat agrees), the passes and mini-epochs advance with the reads, the slow tier is read about data/rf
    per data-worth of reads."""
    from tierfs.testing import make_dataset, mounted

    mnt, cache = mount_dirs
    backing = Path(mnt).parent / "backing_s"
    files = make_dataset(backing, dirs=4, files_per_dir=16, max_size=16 << 10, seed=7)
    by_bytes = {(backing / r).read_bytes(): r for r in files}
    assert len(by_bytes) == len(files)
    total, nm, rf, epochs = sum(files.values()), 4, 2, 4
    with mounted(backing, mnt, cache, total, nm=nm, rf=rf, listing="all", substitute=True,
                 composition="stratified") as m:
        names = _listing(m.mountpoint)  # built once: every file
        assert len(names) == len(files)

        def epoch(seed: int) -> list[tuple[str, str, int]]:
            out = []
            for p in random.Random(seed).sample(names, len(names)):  # (DataLoader(shuffle=True) order)
                with open(p, "rb") as f:
                    data = f.read()
                    out.append((os.path.relpath(p, m.mountpoint), by_bytes[data], os.fstat(f.fileno()).st_size))
            return out

        seen: set[str] = set()
        positions = set()
        with ThreadPoolExecutor(1) as pool:
            for e in range(epochs):
                positions.add((m.status()["epoch"], m.status()["mini_epoch"]))
                for name, got, size in pool.submit(epoch, e).result(timeout=_DEADLINE):
                    assert got.split("/")[0] == name.split("/")[0]  # the name's class folder: its label holds
                    assert size == files[got]  # whole, and stat agrees
                    seen.add(got)
        st = m.status()
        assert st["reads"]["out_of_view"] == 0 and st["substitution"]["substituted"] > 0
        assert st["loader"]["follows_view"]
        # the passes and mini-epochs advance with the reads: a pass ends once every view file was served, which
        # takes a pass-worth of reads (the view's size) and more where one folder's reads came first (its files
        # are then served again: a name resolves within its folder only); at most twice that here
        assert st["passes_total"] >= epochs * len(files) // (2 * st["view_files"])
        assert len(positions) >= 2 and len(seen) > len(files) // nm
        biggest = max(st["view_bytes"], st["prefetch"]["bytes_total"])
        assert st["backing_bytes_read"] <= total * epochs / rf + 2 * biggest
