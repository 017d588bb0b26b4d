"""MountSampler reading the cached copies directly: a dataset built once with a ``loader`` (as torchvision's
ImageFolder reads its files) gets the pass's copies without a FUSE request, every read counted exactly once."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tierfs.testing.harness import ImageFolderLike, read_bytes, wait_until

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402

from tierfs.client.torch import CopyLoader  # noqa: E402
from tierfs.torch import MountSampler  # noqa: E402

_DEADLINE = 120  # seconds for a DataLoader to deliver a batch (a hung mount fails the test; mounted() aborts it)


def _items(loader) -> list[tuple[int, int, bytes]]:
    return [item for batch in loader for item in batch]


def _check(items, ds: ImageFolderLike, backing: Path, mountpoint: str) -> None:
    """Every item's bytes and label are its file's in the backing dir."""
    for i, label, data in items:
        path, want = ds.samples[i]
        rel = os.path.relpath(path, mountpoint)
        assert label == want == ds.classes.index(rel.split("/")[0])
        assert data == (backing / rel).read_bytes(), rel


def _opens(st: dict) -> int:
    return st["reads"]["hits"] + st["reads"]["misses"]


@pytest.mark.alone  # (timed: a pass read slower than wait=10 s is ended by the sampler, under other tests' load too)
@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_the_sampler_reads_copies_directly_and_counts_each_read_once(tierfs_mount, dataset, context):
    """4 persistent workers (2 spawned), 6 DataLoader epochs: each the mount's next pass, its files read once,
    right bytes and labels, most from copies (``reads.plan``), and the last pass ended by the sampler's reporting
    thread with no call after the loop."""
    backing, files = dataset
    epochs = 6 if context == "fork" else 3
    with tierfs_mount(capacity=sum(files.values()), nm=4, rf=2, listing="all") as m:
        ds = ImageFolderLike(m.mountpoint)
        assert len(ds) == len(files)
        sampler = MountSampler(ds, wait=10)  # (a pass that would not end fails in seconds)
        assert isinstance(ds.loader, CopyLoader) and ds.loader.loader is read_bytes
        loader = DataLoader(ds, batch_size=3, sampler=sampler, num_workers=4 if context == "fork" else 2,
                            persistent_workers=True, collate_fn=list, multiprocessing_context=context,
                            timeout=_DEADLINE)
        wait_until(lambda: m.status()["next_ready"], what="staging")
        st0 = m.status()
        read = 0
        for epoch in range(epochs):
            if epoch:  # the pass that ran was read whole: the sampler's thread reads the next as the mount starts it
                wait_until(lambda: sampler.reports.ahead_ready, timeout=30, what="the next pass read ahead")
            sampler.set_epoch(epoch)
            items = _items(loader)
            assert sampler.indices.last_pass == st0["passes_total"] + epoch  # each epoch is the next pass
            assert len(items) == len({i for i, _, _ in items}) == sampler.indices.pass_files  # each file once
            _check(items, ds, backing, m.mountpoint)
            read += len(items)
        assert sampler.reports.read_ahead == epochs - 1  # (every iter() after the first found it ready)
        # the last pass ends with no call after the loop: the sampler's thread reports its last reads
        wait_until(lambda: m.status()["passes_total"] == st0["passes_total"] + epochs, timeout=30,
                   what="the last pass to end")
        st = m.status()
        assert _opens(st) - _opens(st0) == read  # every read counted once: opens through the mount + reported
        assert st["reads"]["plan"] - st0["reads"]["plan"] > read // 2  # most read from copies, no FUSE open
        assert st["reads"]["out_of_view"] == 0 and st["loader"]["follows_view"]
        folder = sampler.reports.shared.folder
        sampler.close()
        assert not os.path.exists(folder)  # its pass files are gone
        # after close: every file through the mount (opens), the workers' loader included
        items = _items(loader)
        _check(items, ds, backing, m.mountpoint)
        wait_until(lambda: m.status()["passes_total"] == st0["passes_total"] + epochs + 1, timeout=30,
                   what="the pass after close to end")
        assert m.status()["reads"]["plan"] == st["reads"]["plan"]


def test_a_damaged_copy_is_read_through_the_mount_and_the_pass_still_ends(tierfs_mount, dataset):
    backing, files = dataset
    with tierfs_mount(capacity=sum(files.values()), nm=4, rf=2, listing="all") as m:
        wait_until(lambda: m.status()["next_ready"], what="staging")
        ds = ImageFolderLike(m.mountpoint)
        sampler = MountSampler(ds, wait=10)  # (a pass that would not end fails in seconds)
        first = list(sampler)  # (read in the main process: no workers)
        _check([ds[i] for i in first], ds, backing, m.mountpoint)
        share = list(sampler)  # (reports the first pass's reads: it ends)
        st0 = m.status()
        assert sampler.indices.last_pass == st0["passes_total"]
        copies = sampler.indices.copies
        assert copies and set(copies) <= set(share)
        victims = list(copies.values())[:2]
        os.truncate(victims[0].copy, 1)  # damaged in the cache dir after the plan named it
        os.unlink(victims[1].copy)  # and gone
        items = [ds[i] for i in share]
        _check(items, ds, backing, m.mountpoint)  # the right bytes all the same: through the mount
        sampler.close()
        st = m.status()
        assert st["passes_total"] == st0["passes_total"] + 1  # the pass ended: each file counted once
        assert _opens(st) - _opens(st0) == len(share)
        assert st["reads"]["plan"] - st0["reads"]["plan"] == len(copies) - 2


def test_without_a_loader_or_with_direct_off_every_file_is_read_through_the_mount(tierfs_mount, dataset, tmp_path):
    backing, files = dataset
    plain = ImageFolderLike(str(backing))
    assert MountSampler(plain).reports is None and plain.loader is read_bytes  # not a mount: nothing wrapped
    with tierfs_mount(capacity=sum(files.values()), nm=4, rf=2, listing="all") as m:
        wait_until(lambda: m.status()["next_ready"], what="staging")
        st0 = m.status()
        off = ImageFolderLike(m.mountpoint)
        sampler = MountSampler(off, direct=False)
        assert sampler.reports is None and off.loader is read_bytes
        bare = ImageFolderLike(m.mountpoint, loader=False)
        assert MountSampler(bare).reports is None and not hasattr(bare, "loader")
        for ds in (off, bare):
            _check([ds[i] for i in sampler], ds, backing, m.mountpoint)
        st = m.status()
        assert st["passes_total"] >= st0["passes_total"] + 1 and st["reads"]["plan"] == st0["reads"]["plan"]


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_a_pass_read_ahead_and_ended_by_hand_before_iter_is_not_used(tierfs_mount, dataset):
    """The thread reads the next pass once the last was read whole; ``next-pass`` written before the next
    ``iter()`` ends that pass: the sampler then yields the mount's current pass, not the one it read ahead."""
    backing, files = dataset
    with tierfs_mount(capacity=sum(files.values()), nm=4, rf=2, listing="all") as m:
        wait_until(lambda: m.status()["next_ready"], what="staging")
        ds = ImageFolderLike(m.mountpoint)
        sampler = MountSampler(ds, wait=10)
        sampler.reports.STALE = 0.0  # (checked at once: no need to wait a second)
        loader = DataLoader(ds, batch_size=3, sampler=sampler, num_workers=2, persistent_workers=True,
                            collate_fn=list, timeout=_DEADLINE)
        st0 = m.status()
        _check(_items(loader), ds, backing, m.mountpoint)
        wait_until(lambda: sampler.reports.ahead_ready, timeout=30, what="the next pass read ahead")
        assert m.status()["passes_total"] == st0["passes_total"] + 1
        m.control("next-pass")  # (ends the pass read ahead, unread)
        items = _items(loader)
        st = m.status()
        assert sampler.reports.read_ahead == 0
        assert sampler.indices.last_pass == st0["passes_total"] + 2  # the pass after it
        assert len(items) == len({i for i, _, _ in items}) == sampler.indices.pass_files
        _check(items, ds, backing, m.mountpoint)
        sampler.close()
        wait_until(lambda: m.status()["passes_total"] == st0["passes_total"] + 3, timeout=30,
                   what="that pass to end")
        assert m.status()["reads"]["out_of_view"] == st["reads"]["out_of_view"] == 0


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_an_epoch_that_leaves_files_unread_is_not_read_ahead_and_rank_0_ends_its_pass(tierfs_mount, dataset):
    """``drop_last=True`` leaves the pass's last file unread: the thread does not read ahead (the share was not
    read whole), and the next ``iter()`` waits ``wait`` seconds, ends the pass and yields the next one."""
    backing, files = dataset
    with tierfs_mount(capacity=sum(files.values()), nm=4, rf=2, listing="all") as m:
        wait_until(lambda: m.status()["next_ready"], what="staging")
        ds = ImageFolderLike(m.mountpoint)
        sampler = MountSampler(ds, wait=1)
        n = len(sampler)
        loader = DataLoader(ds, batch_size=n - 1, sampler=sampler, num_workers=2, persistent_workers=True,
                            collate_fn=list, drop_last=True, timeout=_DEADLINE)
        st0 = m.status()
        items = _items(loader)
        assert sampler.indices.pass_files == n and len(items) == n - 1  # (the last file dropped)
        _check(items, ds, backing, m.mountpoint)
        time.sleep(0.5)  # (time enough for the thread to look, every 20 ms)
        assert not sampler.reports.ahead_ready and m.status()["passes_total"] == st0["passes_total"]
        items = _items(loader)  # rank 0 ends the pass left unread after 1 s
        assert sampler.indices.last_pass == st0["passes_total"] + 1 and sampler.reports.read_ahead == 0
        p = sampler.indices.pass_files  # (that pass may be of the next mini-epoch: a file more or less)
        assert len(items) == len({i for i, _, _ in items}) == p // (n - 1) * (n - 1)
        _check(items, ds, backing, m.mountpoint)
        sampler.close()
        assert m.status()["reads"]["out_of_view"] == 0
