"""PyTorch datasets that follow a tierfs mount's mini-epochs and read the cached copies directly.

Importing this module imports torch (``import tierfs`` never does)::

    from torch.utils.data import DataLoader
    from tierfs.torch import MiniEpochDataset

    ds = MiniEpochDataset("/mnt/imagenet/train", transform=decode_and_augment)
    for epoch in range(epochs):
        ds.set_epoch(epoch)                     # this pass's files: the plan of the current mini-epoch
        for x, y in DataLoader(ds, batch_size=256, shuffle=True, num_workers=8):
            ...
    ds.close()                                  # reports what the last pass read

* **Follows the mini-epoch.**  :meth:`MiniEpochDataset.set_epoch` (call it before each epoch, as with a
  ``DistributedSampler``) reports what the previous pass read and reads the batch plan of the current pass;
  ``len(ds)`` is that pass's size.
* **Labels never shift**: the index of the sample's class folder among the sorted class folders, read once.
* **Reads the fast tier directly**: a cached file is read from its copy (no FUSE request), checked against
  the plan first (``fstat`` of the descriptor read, or one ``lstat`` before a ``reader`` of paths); a file
  without a copy, or whose copy is gone or damaged, through the mount.
* **Counts exactly.**  Workers report what they read from copies every ``report_every`` samples (256: one
  control write, on a descriptor each worker keeps open), and mark each sample in a shared array;
  ``set_epoch`` and ``close`` report what is left.  tierfs counts each file of a plan once, so passes, ``rf``,
  ARF and ``status`` see these reads as opens.
* **Works with ``DataLoader(num_workers>0)``** (fork or spawn: the marks live in shared memory).  With
  ``persistent_workers=True`` workers would keep the pass of the epoch they started with: a worker that finds
  ``set_epoch`` moved on since raises ``RuntimeError`` saying so (rather than read the old pass); use
  ``persistent_workers=False`` (the default) so each epoch's workers get the new pass.
* **No mount**: on a plain directory it is an ``ImageFolder`` of raw bytes (every file every epoch).

The sample is ``(transform(reader(path)), target_transform(label))``; ``reader`` defaults to the file's bytes as
a ``uint8`` tensor (what ``torchvision.io.read_file`` returns), so ``transform`` can be
``torchvision.io.decode_image`` and friends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info

from tierfs.client import Client
from tierfs.client.loaders import PassFiles, PassIndices, Sample, find_classes, read_pass, read_path, read_sample

__all__ = ["MiniEpochDataset", "MiniEpochIterableDataset", "MountSampler", "MountShards", "read_file"]

_UNREAD, _READ, _REPORTED, _VIA_MOUNT = 0, 1, 2, 3

log = logging.getLogger(__name__)


def read_file(path: str) -> torch.Tensor:
    """The file's bytes as a 1-D ``uint8`` tensor (:func:`tierfs.loaders.read_path`)."""
    return _tensor(read_path(path))


def _tensor(data: bytes) -> torch.Tensor:
    """``data`` as a 1-D ``uint8`` tensor of its own (an empty file gives an empty tensor)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


class _SharedViews:
    """An object holding tensors in shared memory and numpy views of them (an element access costs a tenth of a
    tensor's, per sample): pickled without the views, rebuilt (``_views``) over the shared tensors as unpickled in
    a spawned worker (pickled, they would be copies)."""

    _VIEWS: tuple[str, ...] = ()

    def _views(self) -> None:
        raise NotImplementedError

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in self._VIEWS}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._views()


class _Common:
    def __init__(self, root: str | os.PathLike[str], transform: Callable[[Any], Any] | None,
                 target_transform: Callable[[int], Any] | None, reader: Callable[[str], Any] | None,
                 extensions: Sequence[str] | None, report_every: int) -> None:
        if report_every < 1:
            raise ValueError(f"report_every must be >= 1, got {report_every}")
        self.root = os.path.abspath(root)
        self.transform = transform
        self.target_transform = target_transform
        self.reader = reader  # None: the bytes as a tensor (the copy checked with fstat on the fd it reads)
        self.extensions = extensions
        self.report_every = report_every
        self.classes = find_classes(self.root)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}

    def _item(self, p: PassFiles, i: int) -> tuple[Any, Any, bool]:
        sample = p.samples[i]
        data, from_copy = read_sample(sample, self.reader)
        if self.reader is None:
            data = _tensor(data)
        if self.transform is not None:
            data = self.transform(data)
        label: Any = sample.label if self.target_transform is None else self.target_transform(sample.label)
        return data, label, from_copy


class MiniEpochDataset(_SharedViews, _Common, Dataset):
    """A map-style dataset of the current pass of a class-folder tree (see the module docstring)."""

    _VIEWS = ("_epochs_np", "_marks_np")

    def __init__(self, root: str | os.PathLike[str], transform: Callable[[Any], Any] | None = None,
                 target_transform: Callable[[int], Any] | None = None, *, reader: Callable[[str], Any] | None = None,
                 extensions: Sequence[str] | None = None, report_every: int = 256) -> None:
        super().__init__(root, transform, target_transform, reader, extensions, report_every)
        self._pass: PassFiles | None = None
        self._epochs = torch.zeros(1, dtype=torch.int64).share_memory_()  # set_epoch calls, seen by every worker
        self._epoch_loaded = 0  # the set_epoch call this copy of the dataset holds the pass of
        self._marks = torch.zeros(0, dtype=torch.uint8)
        self._views()
        self._pending: list[int] = []  # read from copies here (a worker), not reported yet

    @property
    def files(self) -> PassFiles:
        if self._pass is None:
            self._load()
        assert self._pass is not None
        return self._pass

    def _load(self) -> None:
        self._pass = read_pass(self.root, self.classes, extensions=self.extensions)
        self._marks = torch.zeros(len(self._pass), dtype=torch.uint8).share_memory_()
        self._views()
        self._pending = []

    def _views(self) -> None:
        self._epochs_np, self._marks_np = self._epochs.numpy(), self._marks.numpy()

    def set_epoch(self, epoch: int) -> None:
        """Start a pass: report what the previous one read, read the current pass's plan.  (``epoch`` is for
        the familiar call; tierfs's own position decides what the pass holds.)"""
        if self._pass is not None:
            self.flush()
        self._load()
        self._epochs += 1
        self._epoch_loaded = int(self._epochs[0])

    def flush(self) -> None:
        """Report every sample read from a copy and not reported yet (workers' included)."""
        if self._pass is not None:
            todo = torch.nonzero(self._marks == _READ).flatten().tolist()
            self._pass.report(todo)
            self._marks[todo] = _REPORTED

    def close(self) -> None:
        """Report what is left of the last pass (call after training; ``with`` does it too)."""
        self.flush()

    def __enter__(self) -> MiniEpochDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        if self._epoch_loaded != self._epochs_np[0]:
            raise RuntimeError("MiniEpochDataset: set_epoch moved to another pass since this DataLoader worker "
                               "started (persistent_workers=True keeps the old pass): use persistent_workers=False")
        p = self.files
        data, label, from_copy = self._item(p, i)
        if from_copy:
            self._marks_np[i] = _READ
            self._pending.append(i)
            if len(self._pending) >= self.report_every:
                done, self._pending = self._pending, []
                p.report(done)
                self._marks_np[done] = _REPORTED
        return data, label


class MiniEpochIterableDataset(_Common, IterableDataset):
    """An iterable dataset: each ``iter()`` (each epoch, in each worker) is one pass of the current view, in
    the mount's serving order (already a fresh shuffle), split between the ``DataLoader``'s workers; each
    worker reports what it read as it goes and at the end of its share."""

    def __init__(self, root: str | os.PathLike[str], transform: Callable[[Any], Any] | None = None,
                 target_transform: Callable[[int], Any] | None = None, *, reader: Callable[[str], Any] | None = None,
                 extensions: Sequence[str] | None = None, report_every: int = 256) -> None:
        super().__init__(root, transform, target_transform, reader, extensions, report_every)

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        p = read_pass(self.root, self.classes, extensions=self.extensions)
        info = get_worker_info()
        share = range(len(p)) if info is None else range(info.id, len(p), info.num_workers)
        pending: list[int] = []
        try:
            for i in share:
                data, label, from_copy = self._item(p, i)
                if from_copy:
                    pending.append(i)
                    if len(pending) >= self.report_every:
                        p.report(pending)
                        pending = []
                yield data, label
        finally:
            p.report(pending)


def dataset_paths(dataset: Any) -> list[str]:
    """The file paths of a map-style dataset, by index: ``.samples`` or ``.imgs`` (``(path, target)`` pairs, as
    torchvision's ``ImageFolder``/``DatasetFolder`` hold them), ``.files`` or ``.paths``, or the dataset itself
    if it is a sequence of paths."""
    for attr in ("samples", "imgs"):
        pairs = getattr(dataset, attr, None)
        if pairs is not None:
            return [os.fspath(p[0]) for p in pairs]
    for attr in ("files", "paths"):
        paths = getattr(dataset, attr, None)
        if paths is not None:
            return [os.fspath(p) for p in paths]
    if isinstance(dataset, Sequence) and all(isinstance(p, (str, os.PathLike)) for p in dataset):
        return [os.fspath(p) for p in dataset]
    raise TypeError(f"{type(dataset).__name__}: no file paths (.samples, .imgs, .files, .paths, or a list of "
                    "paths) to follow a tierfs mount by")


class MountSampler(Sampler[int]):
    """The one line that makes a dataset built once follow a tierfs mount::

        ds = ImageFolder("/mnt/imagenet/train")      # built once, over a listing=all mount: every file
        sampler = MountSampler(ds, rank=rank, world_size=world_size)
        loader = DataLoader(ds, batch_size=256, sampler=sampler, num_workers=8, persistent_workers=True)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)                 # (as with DistributedSampler; tierfs decides the pass)
            for x, y in loader:                      # one DataLoader epoch = one tierfs pass
                ...

    Each ``iter()`` (each time the ``DataLoader`` starts an epoch, in the main process) yields the indices of
    the current pass's files in the mount's serving order (a fresh shuffle every pass): the dataset's indices,
    so labels never shift and the dataset is never rebuilt (``persistent_workers=True`` works).
    ``rank``/``world_size``: the processes reading this mount, each taking every ``world_size``-th file of the
    pass, padded as ``DistributedSampler`` pads (the same count on every rank).  A rank waits for the previous
    pass to end (every rank's reads) before it starts the next; see :class:`tierfs.loaders.PassIndices` for what
    happens to a pass left unread.  Files of the view the dataset does not hold are skipped; a dataset that
    cannot follow the mount (built by listing a mount without ``listing=all``: it holds one mini-epoch) fails
    at once with :class:`tierfs.loaders.DatasetNotFollowing`, saying the fix, and so does any pass of which it
    holds no file (never an empty epoch).  Off a mount (a plain directory, a laptop copy): every index every
    epoch, shuffled as ``DistributedSampler`` shuffles (``shuffle``, ``seed`` + the epoch of :meth:`set_epoch`,
    the same split and padding).

    **``drop_last``**: a ``DataLoader(drop_last=True)`` (timm's train loader) drops the last partial batch, so
    files of the pass go unread and the pass cannot end by its reads.  Tell the sampler
    (``batch_size=``, ``drop_last=True``, the loader's): each rank's share is then padded to whole batches (the
    first files of the pass read again, as ``DistributedSampler`` pads ranks) -- every file of every pass read,
    every batch full, no wait.  Untold, the pass ends at once when every rank has started its next ``iter()``
    (each rank tells the mount its share is done): the dropped files are not read this pass.

    **Cached files are read from the fast tier directly** when the dataset reads files with a ``loader``
    attribute, as torchvision's ``ImageFolder`` and ``DatasetFolder`` do (``loader(path)``), and the mount gives
    this user its batch plan (the mount's user or root): the sampler wraps that ``loader`` so that, for a file
    of the pass with a cached copy, it is called with the copy's path (checked against the plan right before,
    as :func:`tierfs.loaders.read_sample` checks it) instead of the path through the mount -- the same bytes
    without a FUSE request.  Everything else (no copy, a copy gone or damaged, a path not of the pass) is read
    through the mount as written.  The workers mark what they read in shared memory; a thread of the main
    process reports it to the mount (``consumed``) every 0.2 s, at the next ``iter()`` and at :meth:`close`
    (and at exit), so passes, ``rf`` and ``status`` count these reads as opens and a pass ends once its last file
    is read; once the rank's share was all read, that thread also reads the next pass as the mount starts it, so
    the next ``iter()`` finds it ready (no wait on the mount between epochs).  ``direct=False`` leaves the loader
    alone (every file through the mount).  A dataset without a ``loader`` reads through the mount.

    ``dataset``: any map-style dataset with ``.samples``/``.imgs`` (ImageFolder and friends), ``.files`` or
    ``.paths``, or a list of paths (see :func:`dataset_paths`).  The dataset must hold every file: build it over
    a mount with ``listing=all`` (every file listed, while the view, the order and the passes stay the
    mini-epoch's).
    """

    def __init__(self, dataset: Any, mount: str | os.PathLike[str] | None = None, *, rank: int = 0,
                 world_size: int = 1, wait: float = 60.0, direct: bool = True, batch_size: int | None = None,
                 drop_last: bool = False, shuffle: bool = True, seed: int = 0) -> None:
        if drop_last and batch_size is None:
            raise ValueError("MountSampler(drop_last=True) needs the DataLoader's batch_size= too (to pad each "
                             "rank's share to whole batches)")
        paths = dataset_paths(dataset)
        hint = "" if drop_last else (
            "; give MountSampler(..., batch_size=B, drop_last=True) the DataLoader's batch_size and drop_last "
            "so that every file is read and no pass waits")
        self.indices = PassIndices(paths, mount, rank=rank, world_size=world_size, wait=wait,
                                   batch=batch_size if drop_last and batch_size else 1, who="MountSampler",
                                   hint=hint)
        self.shuffle, self.seed = shuffle, seed
        self.epoch = 0
        self.reports: CopyReports | None = None
        loader = getattr(dataset, "loader", None)
        if direct and self.indices.client is not None and callable(loader):
            self.reports = CopyReports(self.indices.client.mountpoint, paths, self.indices)
            inner = loader.loader if isinstance(loader, CopyLoader) else loader  # (a second sampler's)
            dataset.loader = CopyLoader(inner, self.reports.shared)
            self._close = weakref.finalize(self, self.reports.close)

    def set_epoch(self, epoch: int) -> None:
        """Kept for the familiar loop (``DistributedSampler.set_epoch``); the mount's position decides the pass."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.indices.client is None:
            return iter(self._plain())
        if self.reports is None:
            return iter(self.indices.next_pass())
        return iter(self.reports.next_share())

    def _plain(self) -> list[int]:
        """Off a mount: this rank's indices as ``DistributedSampler(shuffle, seed, drop_last=False)`` yields them."""
        n = self.indices.size
        if not self.shuffle:
            return self.indices.split(list(range(n)))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return self.indices.split(torch.randperm(n, generator=g).tolist())

    def __len__(self) -> int:
        return self.indices.peek()

    def close(self) -> None:
        """Report the last reads from copies and stop the reporting thread (done at exit too).  The sampler
        still works after it, every file through the mount."""
        if self.reports is not None:
            self._close()
            self.reports = None


class SharedPass(_SharedViews):
    """What a :class:`MountSampler` shares with the ``DataLoader``'s workers: the pass's number, a mark per
    dataset index (shared memory, fork or spawn), and the folder where each pass's copies are written."""

    _VIEWS = ("passes_np", "marks_np")

    def __init__(self, n: int, folder: str) -> None:
        self.folder = folder
        self.passes = torch.zeros(1, dtype=torch.int64).share_memory_()
        self.marks = torch.zeros(n, dtype=torch.uint8).share_memory_()
        self._views()

    def _views(self) -> None:
        self.passes_np, self.marks_np = self.passes.numpy(), self.marks.numpy()

    def copies_file(self, n: int) -> str:
        return os.path.join(self.folder, f"pass-{n}.pickle")


class CopyLoader:
    """A dataset's ``loader`` wrapped by :class:`MountSampler`: a path of the pass with a copy is read from the
    copy (checked first; else through the mount), any other path of the pass through the mount, and either marked
    read; a path not of the pass goes to ``loader`` as it is."""

    def __init__(self, loader: Callable[[str], Any], shared: SharedPass) -> None:
        self.loader, self.shared = loader, shared
        self._pass = 0
        # path -> (dataset index, its Sample's fields; None: no copy), for this rank's share of the pass
        self._share: dict[str, tuple[int, tuple[Any, ...] | None]] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"loader": self.loader, "shared": self.shared, "_pass": 0, "_share": {}}

    def _load(self) -> None:
        n = int(self.shared.passes_np[0])
        try:
            with open(self.shared.copies_file(n), "rb") as f:
                self._share = pickle.load(f)
        except FileNotFoundError:  # (a pass already replaced: read through the mount)
            self._share = {}
        self._pass = n

    def __call__(self, path: Any) -> Any:
        if self._pass != self.shared.passes_np[0]:
            self._load()
        hit = self._share.get(path if type(path) is str else os.fspath(path))
        if hit is None:
            return self.loader(path)
        i, fields = hit
        if fields is None:
            data, from_copy = self.loader(path), False
        else:
            data, from_copy = read_sample(Sample._make(fields), self.loader)
        marks = self.shared.marks_np
        if from_copy:
            marks[i] = _READ
        elif marks[i] == _UNREAD:
            marks[i] = _VIA_MOUNT  # (counted by the mount as it opened it: not reported, only seen read)
        return data


class _Prepared(NamedTuple):
    """A pass handed to the workers as ``shared.copies_file(number)``."""

    number: int
    share: list[int]  # this rank's dataset indices, as the sampler yields them
    plan_id: int | None
    plan_index: dict[int, int]  # dataset index -> position in the plan, for the files with a copy
    entries: dict[str, tuple[int, tuple[Any, ...] | None]]  # what CopyLoader loads: path -> (index, copy's fields)
    at: float  # (time.monotonic() when read)
    after: int | None  # (read ahead: the mount's pass it followed, ``PassIndices.last_pass`` before)


class CopyReports:
    """The main process's side of :class:`CopyLoader`: hands each pass's share to the workers and reports what
    they read from copies (a thread: every :attr:`EVERY` seconds, and at once when the share was all read;
    :meth:`close`).  Once the share was all read the thread also reads the next pass as soon as the mount starts
    it, so that the next ``iter()`` finds it ready (:meth:`next_share`)."""

    EVERY = 0.2  # seconds between reports of what was read
    TICK = 0.02  # seconds between the thread's looks at whether the share was all read
    TAIL = 256  # (the share's last indices, looked at first: the DataLoader hands them out last)
    STALE = 1.0  # a pass read ahead longer ago than this is checked against the mount's position before use

    def __init__(self, mount: str | os.PathLike[str], paths: list[str], indices: PassIndices) -> None:
        self.paths = paths
        self.indices = indices  # (the thread reads passes with it only between a share read whole and next_share)
        self.shared = SharedPass(len(paths), tempfile.mkdtemp(prefix="tierfs-sampler-"))
        self.client = Client(mount)  # (its own: the sampler's is used by the main thread meanwhile)
        self.lock = threading.Lock()
        self.current: _Prepared | None = None
        self._unique = np.empty(0, dtype=np.int64)  # the current share's indices, once each
        self._tail = self._unique  # its last TAIL indices as yielded
        self._ahead: _Prepared | None = None  # the next pass, read by the thread
        self._waiting = False  # the main thread reads the next pass itself: the thread leaves ``indices`` alone
        self.read_ahead = 0  # passes the thread had ready when iter() asked (statistics)
        self.errors = 0  # reports the mount refused or could not take (logged once)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def ahead_ready(self) -> bool:
        """Whether the thread has the next pass ready for the next ``iter()``."""
        return self._ahead is not None

    def next_share(self) -> list[int]:
        """This rank's share of the next pass, handed to the workers: the one the thread read ahead, else read
        now (waiting for the pass that ran to end, see :class:`PassIndices`)."""
        with self.lock:
            self._flush()  # (the last reads of the pass that ran: it ends once they are counted)
            ahead, self._ahead = self._ahead, None
            if ahead is not None and time.monotonic() - ahead.at > self.STALE \
                    and self.client.status()["passes_total"] != self.indices.last_pass:
                ahead = None  # (ended meanwhile, by next-pass: the reads would be another pass's)
            self._waiting = ahead is None
        if ahead is None:
            try:
                ahead = self._prepare(self.indices.next_pass(plan=True))
            finally:
                with self.lock:
                    self._waiting = False
        else:
            self.read_ahead += 1
        if not os.path.exists(self.shared.copies_file(ahead.number)):  # (the thread's write failed: say why)
            self._write(ahead)
        with self.lock:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.shared.copies_file(ahead.number - 1))
            self.shared.marks_np[:] = _UNREAD
            self.current, self._unique = ahead, np.unique(np.array(ahead.share, dtype=np.int64))
            self._tail = np.array(ahead.share[-self.TAIL:], dtype=np.int64)
            self.shared.passes_np[0] = ahead.number  # (last: a worker that sees it finds the file whole)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tierfs-sampler-reports", daemon=True)
            self._thread.start()
        return ahead.share

    def _prepare(self, share: list[int]) -> _Prepared:
        """``share`` (the pass ``indices`` read last) as the pass after the current one."""
        copies, paths = self.indices.copies, self.paths
        # (plain tuples: a named tuple pickles and loads 3x slower, and every worker loads them first in a pass)
        entries = {paths[i]: (i, None if (c := copies.get(i)) is None else tuple(c)) for i in share}
        return _Prepared(int(self.shared.passes_np[0]) + 1, share, self.indices.plan_id,
                         {i: c.index for i, c in copies.items()}, entries, time.monotonic(), None)

    def _write(self, p: _Prepared) -> None:
        """Write pass ``p`` for the workers (read only once ``passes_np`` shows its number)."""
        path = self.shared.copies_file(p.number)
        try:
            with open(path, "wb") as f:
                pickle.dump(p.entries, f, pickle.HIGHEST_PROTOCOL)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise

    def flush(self) -> None:
        with self.lock:
            self._flush()

    def _flush(self) -> None:
        if self.current is None or self.current.plan_id is None:
            return
        marks, share = self.shared.marks_np, self._unique
        done = share[marks[share] == _READ]
        marks[done] = _REPORTED
        # (a read marked by a worker still reading the pass before, as this one began, is not this plan's)
        index = [k for i in done.tolist() if (k := self.current.plan_index.get(i)) is not None]
        if not index:
            return
        try:
            self.client.consumed(self.current.plan_id, index)
        except (OSError, ValueError) as exc:  # (the mount gone, or the plan too old: nothing to count it)
            self.errors += 1
            if self.errors == 1:
                log.warning("MountSampler: reads from copies not reported to %s: %s", self.client.mountpoint, exc)

    def _run(self) -> None:
        flushed = polled = whole_at = 0.0
        whole_of = -1  # the pass found read whole (at whole_at)
        while not self._stop.wait(self.TICK):
            now = time.monotonic()
            with self.lock:
                current = self.current
                whole = current is not None and self._read_whole()
                if whole and current is not None and whole_of != current.number:
                    whole_of, whole_at = current.number, now
                # (then the next pass is looked for every TICK for EVERY seconds, every EVERY after: other
                # ranks may take a while)
                due = now - polled >= (self.TICK if now - whole_at < self.EVERY else self.EVERY)
                if whole and due and self._ahead is None and not self._waiting:
                    self._flush()
                    flushed = polled = now
                    try:
                        after = self.indices.last_pass
                        if (share := self.indices.poll_pass()) is not None:
                            self._ahead = self._prepare(share)._replace(after=after)
                            self._write(self._ahead)
                    except Exception as exc:  # (iter() does it again, and says what is wrong)
                        if self._ahead is None:
                            self.indices.last_pass = after  # (a pass taken but not kept is iter()'s to read again)
                        self._waiting = True  # (no more looking ahead this pass)
                        log.debug("MountSampler: the next pass of %s not read ahead: %r", self.client.mountpoint, exc)
                elif now - flushed >= self.EVERY:
                    self._flush()
                    flushed = now

    def _read_whole(self) -> bool:
        """Whether every file of the share was read (the last ones handed out looked at first: cheap)."""
        marks, share = self.shared.marks_np, self._unique
        return share.size > 0 and not (marks[self._tail] == _UNREAD).any() and not (marks[share] == _UNREAD).any()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            if self._thread.is_alive():  # (stuck in a write to a mount that does not answer: exit all the same)
                log.warning("MountSampler: %s does not answer; the last reads were not reported",
                            self.client.mountpoint)
                shutil.rmtree(self.shared.folder, ignore_errors=True)
                return
        with self.lock:
            self._flush()
            if self._ahead is not None:  # (not iterated: the sampler's next iter() yields it, through the mount)
                self.indices.last_pass = self._ahead.after
            self.current = self._ahead = None
            self.shared.passes_np[0] = -1  # (no such pass: a worker reads every path through the mount)
        self.client.close()
        shutil.rmtree(self.shared.folder, ignore_errors=True)


def _expand(urls: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[str]:
    """A shard list as webdataset takes it: a brace pattern (``shard-{000000..000019}.tar``, expanded as
    webdataset expands it, with ``braceexpand``) or a sequence of paths."""
    if isinstance(urls, (str, os.PathLike)):
        url = os.fspath(urls)
        if "{" not in url:
            return [url]
        try:
            from braceexpand import braceexpand
        except ImportError as e:
            raise ImportError(f"{url!r}: a brace pattern needs the braceexpand package (webdataset installs it); "
                              "or give a list of paths") from e
        return list(braceexpand(url))
    return [os.fspath(u) for u in urls]


class MountShards(IterableDataset):
    """A shard list that follows a tierfs mount, for WebDataset (where the brace URL goes) and for Parquet::

        shards = MountShards("/mnt/laion/shard-{000000..000999}.tar", rank=rank, world_size=world_size)
        ds = wds.DataPipeline(shards, wds.tarfile_to_samples(), wds.shuffle(1000), wds.decode("pil"), ...)
        loader = DataLoader(ds, batch_size=256, num_workers=8, persistent_workers=True)
        for epoch in range(epochs):
            shards.set_epoch(epoch)                  # the current pass's shards, for every worker
            for batch in loader:                     # one DataLoader epoch = one tierfs pass
                ...

    ``urls``: every shard of the data set under the mount, as a brace pattern or a list of paths (the names are
    given: no listing, no ``listing=all`` needed; a list globbed over a mount without ``listing=all`` holds one
    mini-epoch and fails at once with :class:`tierfs.loaders.DatasetNotFollowing`, saying the fix).
    :meth:`set_epoch`, in the main process before each epoch, draws the current pass with
    :class:`tierfs.loaders.PassIndices` -- ``order0``'s shards in serving order, rank ``rank`` taking every
    ``world_size``-th one, once the previous pass ended (rank 0 ends a pass left unread after ``wait`` seconds) --
    and puts it in shared memory, where the ``DataLoader``'s workers (fork or spawn, persistent or not) take it.
    Iterating yields ``{"url": path}`` per shard, as webdataset's ``SimpleShardList`` does, each worker taking every
    ``num_workers``-th shard of the rank's share: the node split and the worker split both, with ``split_by_node``
    and ``split_by_worker``'s semantics (no padding: ranks may get a shard more or less, as there), so add neither
    to the pipeline.  :meth:`files` yields the same shards as paths (``pyarrow.parquet.ParquetFile``,
    ``pyarrow.dataset.dataset``).  Iterated in the main process (``num_workers=0``, or no ``DataLoader``), an
    iteration with no :meth:`set_epoch` since the last one draws the pass itself.

    A worker that finds the pass drawn over when it starts (``set_epoch`` was not called before this epoch: it
    would read the last pass's shards again, out of view) raises ``RuntimeError``.  Not on a mount: every
    shard, every epoch, in the list's order.  (``wds.WebDataset(urls)`` copies its list once, so it cannot
    follow the view: start a ``wds.DataPipeline`` with this instead.)
    """

    def __init__(self, urls: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
                 mount: str | os.PathLike[str] | None = None, *, rank: int = 0, world_size: int = 1,
                 wait: float = 60.0) -> None:
        self.urls = _expand(urls)
        self.indices = PassIndices(self.urls, mount, rank=rank, world_size=world_size, wait=wait, pad=False,
                                   who="MountShards")
        # the pass drawn for this epoch, shared with every worker: [draws, the mount's pass, shards, positions...]
        self._drawn = torch.full((3 + len(self.urls),), -1, dtype=torch.int64).share_memory_()
        self._drawn[0] = 0
        self._iterated = 0  # the draw the main process last iterated (main process only)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Draw the current pass for the coming epoch (see the class); ``epoch`` is kept for the familiar call."""
        self.epoch = epoch
        positions = self.indices.next_pass()
        n, last = len(positions), self.indices.last_pass
        self._drawn[3:3 + n] = torch.tensor(positions, dtype=torch.int64)
        self._drawn[1:3] = torch.tensor([-1 if last is None else last, n])
        self._drawn[0] += 1  # (last: a worker that sees the new count finds the pass whole)

    def files(self) -> Iterator[str]:
        """This worker's shards of the drawn pass, as paths (see the class)."""
        info = get_worker_info()
        if info is None and int(self._drawn[0]) == self._iterated:
            self.set_epoch(self.epoch + 1)  # the main process iterates again: the next pass
        draws, passes, n = self._drawn[:3].tolist()
        if draws == 0:
            raise RuntimeError("MountShards: no pass drawn: call shards.set_epoch(epoch) before each epoch, in the "
                               "main process (DataLoader workers take the pass it draws)")
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        share = self._drawn[3 + worker:3 + n:workers].tolist()
        if info is None:
            self._iterated = draws
        elif share and self.indices.client is not None and self.indices.client.status()["passes_total"] != passes:
            # (only this worker opens its shards: their pass cannot be over unless it was drawn for another epoch)
            raise RuntimeError(f"MountShards: pass {passes} of {self.indices.client.mountpoint} is over: call "
                               "shards.set_epoch(epoch) before each epoch, in the main process (this worker "
                               "would read the last pass's shards again)")
        for i in share:
            yield self.urls[i]

    def __iter__(self) -> Iterator[dict[str, str]]:
        for url in self.files():
            yield {"url": url}
