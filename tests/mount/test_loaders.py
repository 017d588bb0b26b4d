"""The loader integrations (tierfs.loaders, tierfs.torch) against real mounts, and on a plain directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tierfs.client import Client
from tierfs.loaders import FileList, read_pass
from tierfs.testing.harness import wait_until

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402

from tierfs.torch import MiniEpochDataset, MiniEpochIterableDataset, read_file  # noqa: E402


def _bytes(path: str | Path) -> bytes:
    return Path(path).read_bytes()


def _rel(backing: Path, raw: bytes, files: dict[str, int]) -> str:
    """Which dataset file these bytes are (the test data's files are random and distinct)."""
    found = [r for r in files if files[r] == len(raw) and _bytes(backing / r) == raw]
    assert len(found) == 1
    return found[0]


def _labels_ok(backing: Path, pairs: list[tuple[str, int]]) -> None:
    classes = sorted(p.name for p in backing.iterdir() if p.is_dir())
    for rel, label in pairs:
        assert label == classes.index(rel.split("/")[0])


def _epoch(loader, backing: Path, files: dict[str, int]) -> list[str]:
    seen = []
    for data, labels in loader:
        pairs = [(_rel(backing, bytes(d.numpy()), files), int(y)) for d, y in zip(data, labels, strict=True)]
        _labels_ok(backing, pairs)
        seen += [r for r, _ in pairs]
    return seen


def _collate(batch):
    return [b[0] for b in batch], torch.tensor([b[1] for b in batch])


def test_map_dataset_follows_the_mini_epoch_with_workers_and_counts_as_opens(tierfs_mount, dataset):
    backing, files = dataset
    with tierfs_mount(capacity=sum(files.values()) // 2, nm=4, rf=1) as m:
        ds = MiniEpochDataset(m.mountpoint, report_every=3)  # workers report as they go, set_epoch the rest
        seen: list[set[str]] = []
        for epoch in range(2):
            wait_until(lambda: m.status()["next_ready"], what="staging")
            st0 = m.status()
            ds.set_epoch(epoch)
            view = {p.decode() for p in Client(m.mountpoint).order()}
            assert len(ds) == len(view)
            loader = DataLoader(ds, batch_size=5, shuffle=True, num_workers=2, collate_fn=_collate)
            got = _epoch(loader, backing, files)
            assert sorted(got) == sorted(view)  # the pass, each file once, right bytes and labels
            ds.flush()
            st = m.status()
            # counted exactly as one open per file: a whole pass (so rf=1 moves on), all from the copies
            assert st["passes_total"] == st0["passes_total"] + 1
            assert st["reads"]["hits"] - st0["reads"]["hits"] == len(view)
            assert st["reads"]["plan"] - st0["reads"]["plan"] == len(view)
            assert st["opened_bytes"] - st0["opened_bytes"] == sum(files[r] for r in view)
            assert st["served_bytes"] == st0["served_bytes"]  # not a byte through the daemon
            seen.append(set(got))
        ds.close()
        assert m.status()["mini_epoch"] == 2
        assert seen[0].isdisjoint(seen[1])  # each epoch of the loader was another mini-epoch


def test_iterable_dataset_and_file_list_count_each_pass(tierfs_mount, dataset, tmp_path):
    backing, files = dataset
    with tierfs_mount(capacity=sum(files.values()) // 2, nm=4, rf=4) as m:
        wait_until(lambda: m.status()["next_ready"], what="staging")
        st0 = m.status()
        view = sorted(p.decode() for p in Client(m.mountpoint).order())
        ds = MiniEpochIterableDataset(m.mountpoint, reader=lambda p: torch.tensor(list(_bytes(p)), dtype=torch.uint8),
                                      report_every=3)
        got = _epoch(DataLoader(ds, batch_size=4, num_workers=2, collate_fn=_collate), backing, files)
        assert sorted(got) == view
        st1 = m.status()
        assert st1["passes_total"] == st0["passes_total"] + 1
        assert st1["reads"]["plan"] - st0["reads"]["plan"] == len(view)
        # the file list: one "path label" line per file of the pass, the copies where cached
        lst = tmp_path / "list.txt"
        fl = FileList(m.mountpoint, lst)
        with fl.next_pass() as p:
            lines = lst.read_text().splitlines()
            assert len(lines) == len(p.files) == len(view)
            pairs = []
            for line in lines:
                path, label = line.rsplit(" ", 1)
                assert path.startswith(os.path.join(m.cache, "data"))  # a cached copy: read at the fast tier's speed
                pairs.append((_rel(backing, _bytes(path), files), int(label)))
            _labels_ok(backing, pairs)
            assert sorted(r for r, _ in pairs) == view
            assert m.status()["passes_total"] == st1["passes_total"]  # not counted before the pass is over
        st2 = m.status()
        assert st2["passes_total"] == st1["passes_total"] + 1
        assert st2["reads"]["hits"] - st1["reads"]["hits"] == len(view)
        assert st2["plans"]["pinned_copies"] == 0
        # an exception inside the pass reports nothing
        with pytest.raises(RuntimeError), fl.next_pass():
            raise RuntimeError("training failed")
        assert m.status()["passes_total"] == st2["passes_total"]


def test_without_a_mount_the_same_api_reads_plain_paths(dataset, tmp_path):
    backing, files = dataset
    p = read_pass(backing)
    assert p.mount is None and p.plan is None
    assert sorted(os.path.relpath(s.path, backing) for s in p.samples) == sorted(files)
    assert all(s.copy is None for s in p.samples)
    p.report_all()  # nothing to tell: a no-op
    ds = MiniEpochDataset(backing)
    for epoch in range(2):
        ds.set_epoch(epoch)
        got = _epoch(DataLoader(ds, batch_size=7, num_workers=2, collate_fn=_collate), backing, files)
        assert sorted(got) == sorted(files)
    it = MiniEpochIterableDataset(backing)
    assert sorted(_epoch(DataLoader(it, batch_size=7, collate_fn=_collate), backing, files)) == sorted(files)
    with FileList(backing, tmp_path / "l.txt").next_pass() as fp:
        lines = (tmp_path / "l.txt").read_text().splitlines()
        assert [ln.rsplit(" ", 1)[0] for ln in lines] == fp.paths()
        _labels_ok(backing, [(os.path.relpath(ln.rsplit(" ", 1)[0], backing), int(ln.rsplit(" ", 1)[1]))
                             for ln in lines])


def _damage(copies: list[str]) -> None:
    """What a cleaner or an admin may do in the cache dir: truncate, rewrite in place (same size), replace, and
    put a FIFO at a copy's name (an open of it must not block: not the loader's, not the daemon's)."""
    truncated, rewritten, replaced, fifo = copies[:4]
    os.unlink(fifo)
    os.mkfifo(fifo)
    os.truncate(truncated, 1)
    size = os.path.getsize(rewritten)
    with open(rewritten, "r+b") as f:
        f.write(b"\0" * size)
    tmp = replaced + ".new"
    Path(tmp).write_bytes(b"x" * os.path.getsize(replaced))
    os.rename(tmp, replaced)


def test_a_copy_damaged_after_the_plan_is_read_through_the_mount_and_repaired(tierfs_mount, dataset, tmp_path):
    backing, files = dataset
    with tierfs_mount(capacity=sum(files.values()) // 2, nm=4, rf=4) as m:
        wait_until(lambda: m.status()["next_ready"], what="staging")
        st0 = m.status()
        ds = MiniEpochDataset(m.mountpoint)
        ds.set_epoch(0)
        samples = ds.files.samples
        assert all(s.copy is not None for s in samples)
        _damage([s.copy for s in samples])
        # every sample still reads right: the four damaged ones through the mount, the rest from their copies
        got = _epoch(DataLoader(ds, batch_size=4, num_workers=2, collate_fn=_collate, timeout=60), backing, files)
        assert sorted(got) == sorted(os.path.relpath(s.path, m.mountpoint) for s in samples)
        ds.close()
        st1 = m.status()
        assert st1["passes_total"] == st0["passes_total"] + 1  # counted exactly: 4 opens and the rest reported
        assert st1["reads"]["plan"] - st0["reads"]["plan"] == len(samples) - 4
        assert st1["cache_repairs"] - st0["cache_repairs"] == 4  # the mount's open found them and repaired them
        # the file list (read by DALI or tf.data, which check nothing) never lists a damaged copy
        wait_until(lambda: all(s.copy for s in read_pass(m.mountpoint).samples), what="the repaired copies staged")
        _damage([s.copy for s in read_pass(m.mountpoint).samples])  # (the repaired copies are new files)
        lst = tmp_path / "list.txt"
        with FileList(m.mountpoint, lst).next_pass() as listed:
            paths = [line.rsplit(" ", 1)[0] for line in lst.read_text().splitlines()]
            through_mount = [x for x in paths if x.startswith(str(m.mountpoint))]
            assert len(through_mount) == 4 and len(paths) == len(samples)
            for x in paths:
                assert _bytes(x) == _bytes(backing / _rel(backing, _bytes(x), files))
            assert sum(s.copy is None for s in listed.files.samples) == 4


def test_persistent_workers_that_would_read_an_old_pass_fail_with_a_clear_error(tierfs_mount, dataset):
    backing, files = dataset
    with tierfs_mount(capacity=sum(files.values()) // 2, nm=4, rf=4) as m:
        wait_until(lambda: m.status()["next_ready"], what="staging")
        ds = MiniEpochDataset(m.mountpoint)
        ds.set_epoch(0)
        loader = DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True, collate_fn=_collate)
        assert sorted(_epoch(loader, backing, files)) == sorted(p.decode() for p in Client(m.mountpoint).order())
        ds.set_epoch(1)  # the workers still hold the dataset as it was: they must not read that pass again
        with pytest.raises(RuntimeError, match="persistent_workers=False"):
            _epoch(loader, backing, files)
        del loader
        ds.close()


def test_an_empty_file_is_an_empty_tensor_on_a_mount_and_without_one(tmp_path, mount_dirs):
    from tierfs.testing.harness import mounted

    backing = tmp_path / "data"
    for cls in ("a", "b"):
        (backing / cls).mkdir(parents=True)
        (backing / cls / "empty").write_bytes(b"")
        (backing / cls / "full").write_bytes(cls.encode() * 100)
    want = {"a/empty": b"", "a/full": b"a" * 100, "b/empty": b"", "b/full": b"b" * 100}
    mnt, cache = mount_dirs
    with mounted(backing, mnt, cache, "1M", policy="lru", view="full") as m:
        for f in want:
            assert (mnt / f).read_bytes() == want[f]  # read through: every file cached
        for root in (backing, mnt):
            ds = MiniEpochDataset(root)
            ds.set_epoch(0)
            got = {os.path.relpath(ds.files.samples[i].path, root): bytes(ds[i][0].numpy()) for i in range(len(ds))}
            assert got == want, root
            assert all(s.copy for s in ds.files.samples) == (root == mnt)  # on the mount: read from the copies
            ds.close()
            assert {f: bytes(read_file(str(root / f)).numpy()) for f in want} == want, root  # (unbuffered)
        assert m.status()["reads"]["plan"] == len(want)
