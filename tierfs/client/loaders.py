"""Loader integrations on batch plans: one pass of a class-folder dataset, read from the fast tier directly.

A loader that reads a tierfs mount through ``open()`` pays a few FUSE round trips per file; one that reads the
*batch plan* (``/.tierfs/plan``, see docs/tierfs.md) reads the cached copies itself and pays one request per
pass.  This module is the part every integration shares, with no torch import:

* :func:`read_pass` -- the files of the current pass under a dataset root (a class-folder tree, as torchvision's
  ``ImageFolder`` reads it), each with its label, the path of its cached copy when there is one, and the path
  through the mount (what to read when there is none, or when the copy is gone);
* :class:`PassFiles` -- that pass, and :meth:`PassFiles.report` to tell the mount what was read from copies
  (``consumed``), so passes, ``rf``, ARF and ``status`` count these reads exactly as opens;
* :class:`FileList` -- a ``path label`` file list of the pass (DALI's ``file_list``, tf.data), rewritten every
  pass, with a context manager that reports the pass when it ends.

``tierfs.torch`` builds the PyTorch datasets on it.

**Labels never shift.**  The classes are the sorted sub-directories of the root, read once (a tierfs mount lists
every directory in every mini-epoch, so a class with no file in the current view keeps its index).

**No mount, no change.**  On a plain directory (a laptop, a copy of the data) the same calls walk the tree:
every file every pass, sorted, no copies, nothing reported; code runs unchanged.  On a mount whose plan this
user may not read (not the mount's user nor root), the pass comes from ``order0`` and every file is read
through the mount (its open counts it).
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from sampler.atomic import atomic_write
from tierfs.client import Client, NotAMount, find_mount
from tierfs.common.protocol import CONTROL_DIR, COPY_OPEN_FLAGS, RankShare, copy_matches

log = logging.getLogger(__name__)

__all__ = ["DatasetNotFollowing", "FileList", "PassFiles", "PassIndices", "Sample", "copy_intact", "find_classes",
           "open_sample", "read_pass", "read_path", "read_plan", "read_sample", "tierfs_mount"]


class Sample(NamedTuple):
    """One file of a pass: ``path`` (through the mount, or the plain path), its ``label``, and ``copy``, the cached
    copy to read instead (None: read ``path``); ``index`` is its position in the plan (for ``consumed``);
    ``size`` and ``copy_id`` (inode, ctime_ns) are the copy's identity as committed (:func:`copy_intact`).
    (A named tuple: a pass makes one per file, and a tuple is made several times faster than a dataclass.)"""

    path: str
    label: int
    copy: str | None = None
    # (a field named like the tuple method it shadows, tuple.index: the name users read stays)
    index: int = -1  # type: ignore[assignment]
    size: int = -1
    copy_id: tuple[int, int] | None = None


def copy_intact(sample: Sample) -> bool:
    """Whether the sample's copy is the one the plan named: a regular file with the committed size, inode,
    ctime and landing mtime (one ``lstat``).  The cache dir is not trusted -- a cleaner may delete, truncate or
    replace a copy, and a pass that ended early lets its copies go -- so a reader checks before it reads."""
    if sample.copy is None or sample.copy_id is None:
        return False
    try:
        st = os.stat(sample.copy, follow_symlinks=False)
    except OSError:
        return False
    return copy_matches(st, sample.size, sample.copy_id)


def tierfs_mount(root: str | os.PathLike[str]) -> Path | None:
    """The mountpoint of the tierfs mount that ``root`` lies in, or None (a plain directory)."""
    try:
        return find_mount(root)
    except NotAMount:
        return None


def find_classes(root: str | os.PathLike[str]) -> list[str]:
    """The sorted class folders under ``root`` (label = index in this list), as ``ImageFolder`` finds them."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and e.name != CONTROL_DIR)
    if not classes:
        raise FileNotFoundError(errno.ENOENT, f"no class folders under {root}")
    return classes


def _wanted(name: str, extensions: tuple[str, ...] | None) -> bool:
    return extensions is None or name.lower().endswith(extensions)


@dataclass
class PassFiles:
    """The files of one pass under ``root`` (serving order on a mount, sorted on a plain directory)."""

    root: str
    classes: list[str]
    samples: list[Sample]
    mount: Path | None = None
    plan: int | None = None  # the plan's number; None without a plan (nothing to report)
    position: tuple[int, int, int] | None = None  # (epoch, mini_epoch, pass) the plan was read at
    _client: Client | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.samples)

    def paths(self) -> list[str]:
        """What to read, per sample: the copy if there is one, else the path (a file list for tf.data)."""
        return [s.copy or s.path for s in self.samples]

    def labels(self) -> list[int]:
        return [s.label for s in self.samples]

    def report(self, indices: Sequence[int]) -> None:
        """Tell the mount that the samples at ``indices`` (positions in :attr:`samples`) were read from their
        copies; samples read through the mount are skipped (their open counted them).  Idempotent: a sample
        reported twice counts once.  Nothing to do without a plan."""
        if self.plan is None or self.mount is None:
            return
        idx = [self.samples[i].index for i in indices if self.samples[i].copy is not None]
        if idx:
            if self._client is None:
                self._client = Client(self.mount)
            self._client.consumed(self.plan, idx)

    def drop_damaged(self) -> None:
        """Check every copy now (:func:`copy_intact`) and read the ones that fail through the mount: for a
        reader that cannot check each copy itself (a file list handed to DALI or tf.data)."""
        self.samples = [s if s.copy is None or copy_intact(s) else s._replace(copy=None, copy_id=None)
                        for s in self.samples]

    def report_all(self) -> None:
        """The whole pass was read (a DALI or tf.data epoch): report every copy."""
        self.report(range(len(self.samples)))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None}  # (a loader's worker makes its own)


def _walk(root: str, classes: list[str], extensions: tuple[str, ...] | None) -> list[Sample]:
    samples = []
    for label, cls in enumerate(classes):
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, cls)):
            dirnames.sort()
            samples += [Sample(os.path.join(dirpath, n), label) for n in sorted(filenames) if _wanted(n, extensions)]
    return samples


def read_pass(root: str | os.PathLike[str], classes: list[str] | None = None, *,
              extensions: Sequence[str] | None = None) -> PassFiles:
    """The current pass's files under ``root`` with their labels (see the module docstring).

    On a tierfs mount this reads a batch plan: the copies it names stay pinned until the pass ends.  Files
    outside the class folders (directly in ``root``) are left out, as ``ImageFolder`` leaves them out;
    ``extensions`` (e.g. ``(".jpeg", ".jpg")``, case-insensitive) keeps only those names."""
    root = os.path.abspath(root)
    classes = classes if classes is not None else find_classes(root)
    ext = tuple(e.lower() for e in extensions) if extensions else None
    mount = tierfs_mount(root)
    if mount is None:
        return PassFiles(root, classes, _walk(root, classes, ext))
    label_of = {c: i for i, c in enumerate(classes)}
    prefix = os.path.relpath(root, mount)
    prefix = "" if prefix == "." else prefix + "/"
    cut = len(prefix)
    client = Client(mount)
    samples: list[Sample] = []

    def label(rel: str) -> int | None:
        """The label of a mount-relative path, None if it is not a sample under ``root``."""
        if not rel.startswith(prefix):
            return None
        cls, sep, rest = rel[cut:].partition("/")
        return label_of[cls] if sep and cls in label_of and _wanted(rest, ext) else None

    try:
        plan = client.plan()
    except PermissionError:  # not the mount's user nor root: the order file, every file through the mount
        for rel in map(os.fsdecode, client.order(nul=True)):
            if (lab := label(rel)) is not None:
                samples.append(Sample(os.path.join(mount, rel), lab))
        return PassFiles(root, classes, samples, mount)
    base = os.path.join(mount, "")
    samples = [_planned(base, i, f, lab) for i, f in enumerate(plan["files"])
               if (lab := label(f["path"])) is not None]
    return PassFiles(root, classes, samples, mount, plan["plan"], (plan["epoch"], plan["mini_epoch"], plan["pass"]),
                     client)


def _planned(base: str, index: int, f: dict[str, Any], label: int) -> Sample:
    """The sample of a plan's file ``index`` (``base``: the mountpoint and a slash)."""
    copy = f["copy"]
    return Sample(base + f["path"], label, copy, index, f["size"], tuple(f["copy_id"]) if copy else None)


def read_plan(mount: str | os.PathLike[str], prefix: str = "") -> PassFiles:
    """Every file of the current pass whose mount-relative path starts with ``prefix``, from a batch plan, in
    serving order, label 0: for a loader of files that are not in class folders (shards)."""
    mount = Path(os.path.abspath(mount))
    client = Client(mount)
    plan = client.plan()
    base = os.path.join(mount, "")
    samples = [_planned(base, i, f, 0) for i, f in enumerate(plan["files"]) if f["path"].startswith(prefix)]
    return PassFiles(str(mount / prefix), [], samples, mount, plan["plan"],
                     (plan["epoch"], plan["mini_epoch"], plan["pass"]), client)


def _checked_copy(sample: Sample) -> int | None:
    """A descriptor of the sample's copy if it opens and ``fstat`` finds it intact (as :func:`copy_intact`,
    with no second path lookup), else None."""
    if sample.copy is None or sample.copy_id is None:
        return None
    try:
        fd = os.open(sample.copy, COPY_OPEN_FLAGS)
    except OSError:
        return None
    if copy_matches(os.fstat(fd), sample.size, sample.copy_id):
        return fd
    os.close(fd)
    return None


def open_sample(sample: Sample) -> tuple[BinaryIO, bool]:
    """The sample opened for reading (unbuffered), and whether it is the copy: the copy if it is intact
    (checked with ``fstat`` on the descriptor returned), else the path through the mount (whose open repairs a
    damaged copy and counts the read)."""
    fd = _checked_copy(sample)
    if fd is not None:
        return io.FileIO(fd, "rb"), True
    return open(sample.path, "rb", buffering=0), False


def read_path(path: str) -> bytes:
    """The file's bytes, read unbuffered: a buffered ``open()`` before Python 3.14 also asks whether the file is
    a terminal, which on a FUSE mount is one more request to the daemon, every file."""
    with open(path, "rb", buffering=0) as f:
        return f.readall()


def read_sample(sample: Sample, reader: Callable[[str], Any] | None = None) -> tuple[Any, bool]:
    """The sample's data and whether its copy was read (only those are reported).

    Without ``reader``: its bytes -- from the copy if it is intact (``fstat`` of the descriptor read), in one
    read of the size the check confirmed (a read fewer than reading to the end: with many reader threads each
    system call is a handoff of Python's lock), else through the mount.  With one: ``reader(copy)`` if the copy
    is intact (:func:`copy_intact`, checked right before), else ``reader(path)`` through the mount."""
    if reader is None:
        fd = _checked_copy(sample)
        if fd is not None:
            try:
                data = os.read(fd, sample.size) if sample.size < _ONE_READ else None
                if data is None:
                    with io.FileIO(fd, "rb", closefd=False) as f:
                        data = f.readall()
            finally:
                os.close(fd)
            if len(data) == sample.size:  # (else truncated since the check: read it through the mount)
                return data, True
        return read_path(sample.path), False
    if copy_intact(sample):
        try:
            return reader(sample.copy), True  # type: ignore[arg-type]
        except FileNotFoundError:
            pass
    return reader(sample.path), False


_ONE_READ = 1 << 30  # read(2) returns at most ~2 GiB; bigger copies are read to their end


class FileList:
    """A ``path label`` file list of each pass, for DALI's ``file_list`` or tf.data, rewritten every pass::

        files = FileList("/mnt/imagenet/train", "/tmp/train.txt")
        for epoch in range(epochs):
            with files.next_pass() as p:            # writes /tmp/train.txt: this pass, copies where cached
                pipe = make_pipeline(file_list=p.list_path)   # or tf.data.Dataset.from_tensor_slices(...)
                train_one_epoch(pipe)
            # a normal exit reports the whole pass as read; an exception reports nothing

    Each line is the file to read (the cached copy, else the path through the mount) and its label.  A
    reader of the list reads every file once per pass, so on a normal exit every copy is reported consumed
    (files without a copy are counted by their open).  DALI splits a line at its last space: paths with a
    newline cannot be listed (they are refused with ``ValueError``).
    """

    def __init__(self, root: str | os.PathLike[str], list_path: str | os.PathLike[str], *,
                 extensions: Sequence[str] | None = None) -> None:
        self.root = os.path.abspath(root)
        self.list_path = os.fspath(list_path)
        self.extensions = extensions
        self.classes = find_classes(self.root)

    def write(self) -> PassFiles:
        """Read the current pass and write its list (atomically); the caller reports it."""
        p = read_pass(self.root, self.classes, extensions=self.extensions)
        p.drop_damaged()  # (the list's reader reads copies unchecked)
        lines = []
        for path, label in zip(p.paths(), p.labels(), strict=True):
            if "\n" in path or "\r" in path:
                raise ValueError(f"{path!r}: a file list line cannot hold a newline")
            lines.append(f"{path} {label}\n")
        atomic_write(self.list_path, os.fsencode("".join(lines)), mode=0o644)
        return p

    @contextlib.contextmanager
    def next_pass(self) -> Iterator[PassFilesList]:
        p = self.write()
        yield PassFilesList(self.list_path, p)
        p.report_all()


@dataclass(frozen=True)
class PassFilesList:
    """What :meth:`FileList.next_pass` yields: the list's path and the pass it holds."""

    list_path: str
    files: PassFiles

    def paths(self) -> list[str]:
        return self.files.paths()

    def labels(self) -> list[int]:
        return self.files.labels()


class PassIndices:
    """The positions, in a file list built once, of the current pass's files, in serving order, this rank's
    share: what :class:`tierfs.torch.MountSampler` yields (no torch here).

    ``paths`` are the files the loader's dataset holds (on the mount: built over a ``listing=all`` mount, which
    lists every file while the view, the order and the passes stay the mini-epoch's).  Each :meth:`next_pass`
    reads ``/.tierfs/order0`` (or a batch plan: ``plan=True``) and returns the positions of the pass's files, rank
    ``rank`` of ``world_size``
    taking every ``world_size``-th one (``order[rank::world_size]``), padded as ``DistributedSampler`` pads so
    that every rank gets the same count (the first files of the pass read again); ``pad=False``:
    ``order[rank::world_size]`` as it is (a rank may get one file fewer, as webdataset's ``split_by_node`` splits
    shards).

    The ranks share one mount and must each start a pass only once the previous one ended (all its files read,
    by every rank): :meth:`next_pass` tells the mount that this rank is done with its share
    (``next-pass pass=P rank=R/W``: the pass ends once every rank said so, even if a ``drop_last`` or a
    ``break`` left files of it unread) and waits for the mount's pass count to move past the pass it last
    returned.  If it does not within ``wait`` seconds (a rank that never comes back, or a dataset that lacks
    some files of the view), rank 0 ends the pass (``next-pass``) and the others wait for that; the mount's
    ``status`` then counts the files left unread.  With ``world_size=1`` nobody else reads the pass, so it is
    ended at once (no wait).  A wait longer than :attr:`NOTICE` seconds is said (a warning
    on the ``tierfs`` logger: stderr unless logging is configured), as is a pass ended with files left unread.
    ``batch``: each rank's share is padded (as above) to a multiple of it, so that a ``DataLoader`` with
    ``drop_last=True`` and that batch size drops nothing and every file of the pass is read.  Not on a mount:
    every file, every pass (no ``batch`` padding).

    **A list that cannot follow the view fails at once** (:class:`DatasetNotFollowing`, with the fix for this
    mount's options): one that holds no file outside the current mini-epoch while the mount has others -- a
    list built by listing a mount that lists only the view (``listing=view``, the default), or built before a
    remount to ``listing=all`` -- and, at any pass, a list that holds none of the pass's files (never an
    empty epoch).  A list of names (a brace pattern, a CSV) needs no listing and works under either.
    """

    NOTICE = 5.0  # seconds of waiting for another rank before the wait is said

    def __init__(self, paths: Sequence[str | os.PathLike[str]], mount: str | os.PathLike[str] | None = None, *,
                 rank: int = 0, world_size: int = 1, wait: float = 60.0, pad: bool = True, batch: int = 1,
                 who: str = "PassIndices", hint: str = "") -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if not paths:
            raise ValueError("no files: the dataset is empty")
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self.rank, self.world_size, self.wait, self.pad, self.batch = rank, world_size, wait, pad, batch
        self.who = who  # (what the messages call the loader)
        self.hint = hint  # (how to avoid a pass left unread, for the messages that say one was)
        self._told_unread = False
        found = tierfs_mount(mount if mount is not None else os.fspath(paths[0]))
        self.client = Client(found) if found is not None else None
        self.size = len(paths)  # the list's files
        self._index: dict[bytes, int] = {}
        if self.client is not None:
            base = os.path.join(os.fspath(self.client.mountpoint), "")
            for i, p in enumerate(paths):
                full = os.path.abspath(os.fspath(p))
                if not full.startswith(base):
                    raise ValueError(f"{os.fspath(p)!r} is not under the mount {self.client.mountpoint}")
                self._index[os.fsencode(full[len(base):])] = i
        self.last_pass: int | None = None  # the mount's passes_total of the pass last returned
        self.pass_files = 0  # files of that pass (all ranks)
        self.missing = 0  # files of that pass the list does not hold (never read: rank 0 ends such a pass)
        self.plan_id: int | None = None  # the batch plan of that pass (``next_pass(plan=True)``), if one was read
        self.copies: dict[int, Sample] = {}  # this rank's files of the pass with a copy in it, by position in paths
        self._plans = True  # False once the mount refused this user its plan
        if self.client is not None:
            self._check_not_one_view()

    def _fix(self) -> str:
        """What makes a list built once hold every file, for this mount's options."""
        assert self.client is not None
        if self.client.settings().get("listing") == "all":
            return (f"{self.client.mountpoint} lists every file now (listing=all), so build the list again (once, "
                    "before the epoch loop) and give it to a new sampler")
        return (f"remount {self.client.mountpoint} with --listing all (every file listed, the view and the passes "
                "unchanged) and build the list after that; or name the files (a brace pattern or a list of every "
                "path: no listing needed); or, without the sampler, re-create the dataset each pass "
                "(docs/pytorch.md)")

    def _check_not_one_view(self) -> None:
        """:class:`DatasetNotFollowing` if the list holds nothing but the current view's files while the mount has
        more: built by listing a mount that lists only the view, it would get none of the next mini-epoch's."""
        assert self.client is not None
        st = self.client.status()
        if st["dataset_files"] <= st["view_files"] or len(self._index) > st["view_files"]:
            return
        _, order = self._current()
        if set(self._index) <= set(order):
            raise DatasetNotFollowing(
                f"{self.who}: all {len(self._index):,} files of the list are in the current mini-epoch of "
                f"{self.client.mountpoint} ({st['view_files']:,} of its {st['dataset_files']:,} files): it was "
                "built by listing the mount, which shows only the mini-epoch, and from the next one on it would "
                f"get no files. Fix: {self._fix()}")

    def _current(self) -> tuple[int, list[bytes]]:
        """(passes_total, order) of one pass: read until the pass does not change in between."""
        assert self.client is not None
        while True:
            before = self.client.status()["passes_total"]
            order = self.client.order(nul=True)
            if self.client.status()["passes_total"] == before:
                return before, order

    def _wait_for_new_pass(self, order: bool = True) -> tuple[int, list[bytes]]:
        """The next pass once the one last returned ended (the other ranks may still read their last files);
        rank 0 ends a pass left unread after ``wait`` seconds (at once if the list lacks some of its files).
        ``order=False``: only the pass's number (an empty order; the caller reads the pass from a plan)."""
        assert self.client is not None
        current = self._current if order else self._passes
        passes, got = current()
        if passes == self.last_pass and self.world_size > 1:
            # (this rank is done with its share: the pass ends once every rank said so, files dropped or not)
            with contextlib.suppress(OSError, ValueError):  # (then rank 0 ends it after ``wait``)
                self.client.write(RankShare(passes, self.rank, self.world_size).line(), check=False)
        start, ended, said = time.monotonic(), False, False
        while passes == self.last_pass:
            waited = time.monotonic() - start
            alone = self.world_size == 1  # (nobody else reads the pass: it is over for good)
            if self.rank == 0 and not ended and (self.missing or alone or waited >= self.wait):
                self.client.write("next-pass", check=False)
                ended = True
                if not self.missing:
                    self._said_unread(passes, waited)
            elif not said and waited >= self.NOTICE:
                said = True
                log.warning("%s rank %d: waiting for pass %d of %s to end: the other ranks still read it, or left "
                            "files of it unread (DataLoader(drop_last=True), a break); rank 0 ends it after %g s "
                            "(wait=)%s", self.who, self.rank, passes, self.client.mountpoint, self.wait, self.hint)
            elif waited >= 2 * self.wait:
                raise TimeoutError(f"rank {self.rank}: pass {passes} of {self.client.mountpoint} did not end within "
                                   f"{waited:.0f} s (rank 0 ends a pass left unread after {self.wait:g} s)")
            time.sleep(0.02)
            passes, got = current()
        return passes, got

    def _said_unread(self, passes: int, waited: float) -> None:
        """Rank 0 ended pass ``passes`` left unread: said every time it waited, once if it did not."""
        assert self.client is not None
        if waited < self.NOTICE and self._told_unread:
            return
        self._told_unread = True
        log.warning("%s: pass %d of %s had files left unread (DataLoader(drop_last=True) drops the last partial "
                    "batch; or the epoch loop broke off): ended %s%s", self.who, passes, self.client.mountpoint,
                    "at once" if waited < self.NOTICE else f"after waiting {waited:.0f} s", self.hint)

    def _passes(self) -> tuple[int, list[bytes]]:
        assert self.client is not None
        return self.client.status()["passes_total"], []

    def next_pass(self, *, plan: bool = False) -> list[int]:
        """This rank's positions of the next pass (waiting for the previous one to end, see the class).

        ``plan``: read the pass from a batch plan instead (its copies pinned until the pass ends): :attr:`copies`
        then holds this rank's files that have a copy, by position in ``paths``, as :class:`Sample` (``index``:
        the position in plan :attr:`plan_id`, to report with ``consumed``).  For a user the mount does not give
        its plan, or not on a mount, :attr:`copies` stays empty (every file is read through the mount)."""
        self.plan_id, self.copies = None, {}
        if self.client is None:
            return self._share(list(range(self.size)))
        plan = plan and self._plans
        passes, order = self._wait_for_new_pass(order=not plan)
        return self._take(passes, order, plan)

    def poll_pass(self) -> list[int] | None:
        """``next_pass(plan=True)`` if the pass last returned has ended, else ``None`` at once (one ``status``
        read: no wait, and a pass left unread is not ended here)."""
        if self.client is None:
            return self.next_pass(plan=True)
        passes, order = self._passes() if self._plans else self._current()
        if passes == self.last_pass:
            return None
        self.plan_id, self.copies = None, {}
        return self._take(passes, order, self._plans)

    def _take(self, passes: int, order: list[bytes], plan: bool) -> list[int]:
        """Pass ``passes`` (its ``order``, or its plan under ``plan``) as this rank's positions; see next_pass."""
        assert self.client is not None
        files: list[dict[str, Any]] = []
        if plan:
            try:
                got = self.client.plan()
            except PermissionError:
                self._plans = False
                passes, order = self._current()
            else:  # (the plan's own pass and order: the same pass unless it ended meanwhile, and then its next)
                passes, files, self.plan_id = got["passes_total"], got["files"], got["plan"]
                order = [os.fsencode(f["path"]) for f in files]
        at = [(i, k) for k, p in enumerate(order) if (i := self._index.get(p)) is not None]
        if order and not at:  # (an empty epoch trains on nothing, silently: never)
            raise DatasetNotFollowing(
                f"{self.who}: none of the {len(order):,} files of pass {passes} of {self.client.mountpoint} is in "
                f"the list ({self.size:,} files): a list built by listing the mount holds one mini-epoch only. "
                f"Fix: {self._fix()}")
        self.last_pass, self.pass_files, self.missing = passes, len(order), len(order) - len(at)
        share = self._share([i for i, _ in at])
        if files:
            base = os.path.join(os.fspath(self.client.mountpoint), "")
            mine = set(share)
            self.copies = {i: _planned(base, k, files[k], 0) for i, k in at if i in mine and files[k]["copy"]}
        return share

    def peek(self) -> int:
        """How many positions :meth:`next_pass` would return now (``len`` of a sampler)."""
        if self.client is None:
            return len(self._share(list(range(self.size))))
        _, order = self._current()
        return len(self._share([i for p in order if (i := self._index.get(p)) is not None]))

    def _share(self, own: list[int]) -> list[int]:
        return self.split(own, self.batch if self.client is not None else 1)

    def split(self, own: list[int], batch: int = 1) -> list[int]:
        """This rank's part of ``own`` (a pass's positions, in order): every ``world_size``-th, padded as the
        class says (each rank's count a multiple of ``batch``)."""
        if not own or not self.pad:
            return own[self.rank::self.world_size]
        per = -(-len(own) // self.world_size)
        per = -(-per // batch) * batch
        need = per * self.world_size - len(own)
        padded = own + (own * (need // len(own) + 1))[:need]
        return padded[self.rank::self.world_size]


class DatasetNotFollowing(ValueError):
    """A list built once that cannot follow the mount's passes (it holds one mini-epoch); the message says the
    fix for this mount's options."""
