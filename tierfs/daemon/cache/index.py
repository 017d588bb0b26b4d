"""The cache's index, saved at a clean unmount (``CACHE/index.npz``) so that a remount takes its copies from it.

``data/`` stays the truth (see store.py): at a remount every name in it is listed, and an indexed name whose
path and fingerprint still match the tree becomes an entry without a ``stat`` of its copy -- 125,000 copies
cost seconds of ``stat`` and parsing at mount time, the index a fraction of that.  A copy is trusted no more
than before: every open and lend checks it against its entry (``copies.open_copy``), and a name is never
reused, so a name still in ``data/`` is the copy the index describes or a damaged one that the first open
repairs.  Names the index lacks (staged after it was written, or any name after a crash: no index then) take
the slow way, one ``stat`` each.  Read, written and removed through the cache dir's descriptor, never its path
(see store.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from sampler.atomic import atomic_open
from tierfs.daemon.tree.tree import Fingerprint, Tree

__all__ = ["INDEX_NAME", "SavedIndex", "indexed_copies", "load_index", "save_index"]

log = logging.getLogger("tierfs")

INDEX_NAME = "index.npz"
INDEX_FORMAT = 1


@dataclass(frozen=True)
class SavedIndex:
    names: list[str]
    path_hashes: np.ndarray  # uint64
    fps: np.ndarray  # int64 [n, 4]: (size, mtime_ns, ino, ctime_ns) of the backing file copied
    disks: np.ndarray  # int64: disk bytes of the copy
    digests: np.ndarray  # uint64 (0 with has_digest False: none)
    has_digest: np.ndarray  # bool
    copy_ids: np.ndarray  # int64 [n, 2]: (inode, ctime_ns) of the copy as committed


Row = tuple[str, int, Fingerprint, int, "int | None", tuple[int, int]]


def save_index(dir_fd: int, rows: Iterable[Row]) -> None:
    """Write (name, path hash, fingerprint, disk bytes, digest, copy id) of each copy atomically into the cache
    dir ``dir_fd``; a disk that cannot take it (full) is logged: the next mount then stats every copy."""
    try:
        _write(dir_fd, list(rows))
    except OSError as exc:
        log.warning("the cache index was not saved (%s): the next mount checks every copy", exc)


def _write(dir_fd: int, rows: list[Row]) -> None:
    with atomic_open(INDEX_NAME, dir_fd=dir_fd) as f:
        np.savez(f, version=np.array(INDEX_FORMAT),
                 names=np.frombuffer("\n".join(r[0] for r in rows).encode(), np.uint8),
                 path_hashes=np.array([r[1] for r in rows], np.uint64),
                 fps=np.array([r[2] for r in rows], np.int64).reshape(-1, 4),
                 disks=np.array([r[3] for r in rows], np.int64),
                 digests=np.array([r[4] or 0 for r in rows], np.uint64),
                 has_digest=np.array([r[4] is not None for r in rows], bool),
                 copy_ids=np.array([r[5] for r in rows], np.int64).reshape(-1, 2))


def load_index(dir_fd: int) -> SavedIndex | None:
    """The index saved in the cache dir ``dir_fd``, or None (none, another format, damaged)."""
    try:
        return _read(dir_fd)
    except ValueError:
        return None


def _read(dir_fd: int) -> SavedIndex | None:
    """The index saved in the cache dir ``dir_fd``; None if there is none or it is of another format;
    ``ValueError`` saying what is wrong if it is damaged (whatever its bytes make zipfile or numpy raise: a bad
    CRC, a cut, a flipped byte in a header)."""
    try:
        fd = os.open(INDEX_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"it cannot be opened: {exc.strerror or exc}") from None
    try:
        with open(fd, "rb") as f:
            start = f.read(4)
            if start != b"PK\x03\x04":
                raise ValueError("it is empty" if not start else "it is not a zip of arrays")
            f.seek(0)
            with np.load(f, allow_pickle=False) as z:
                a = {k: z[k] for k in z.files}
        if int(a["version"]) != INDEX_FORMAT:
            return None
        text = a["names"].tobytes().decode()
    except OSError as exc:
        raise ValueError(f"it cannot be read: {exc.strerror or exc}") from None
    except (zipfile.BadZipFile, ValueError) as exc:  # ("Bad CRC-32 for file 'fps.npy'", "File is not a zip file")
        raise ValueError(str(exc)[:120]) from None
    except EOFError:
        raise ValueError("it is cut short") from None
    except Exception:  # (a flipped byte in a member's header or a field zipfile cannot take: it raises anything)
        raise ValueError("a part of it is damaged") from None
    names = text.split("\n") if text else []
    n = len(names)
    want = {"path_hashes": ((n,), "u"), "fps": ((n, 4), "i"), "disks": ((n,), "i"), "digests": ((n,), "u"),
            "has_digest": ((n,), "b"), "copy_ids": ((n, 2), "i")}  # (shape, dtype kind)
    if any(k not in a or (a[k].shape, a[k].dtype.kind) != w for k, w in want.items()):
        raise ValueError(f"its arrays do not describe its {n} copies")
    return SavedIndex(names, a["path_hashes"], a["fps"], a["disks"], a["digests"], a["has_digest"], a["copy_ids"])


def indexed_copies(dir_fd: int, tree: Tree, listed: list[str], *, need_digest: bool
                   ) -> list[tuple[int, str, Fingerprint, int, int | None, tuple[int, int]]]:
    """(file index, name, fingerprint, disk bytes, digest, copy id) of each listed copy that the index saved in
    the cache dir ``dir_fd`` describes and whose backing file ``tree`` still knows with the same path and
    fingerprint.  The index is removed: it is written again at the next clean unmount (a crash leaves none, so
    no stale one).  A damaged one is said (the copies then take the slow way), never a refused mount."""
    try:
        index = _read(dir_fd)
    except ValueError as exc:
        index = None
        log.warning("the cache dir's %s is damaged (%s): removed; the %d copies in data/ are checked one by one "
                    "instead (a stat each), as after a crash", INDEX_NAME, exc, len(listed))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(INDEX_NAME, dir_fd=dir_fd)
    if index is None or not index.names:
        return []
    present = set(listed)
    fidx = tree.files_of_path_hashes(index.path_hashes)
    ok = np.fromiter((n in present for n in index.names), bool, len(index.names)) & (fidx >= 0)
    ok[ok] = tree.holds_many(fidx[ok], index.fps[ok])
    if need_digest:
        ok &= index.has_digest
    out = []
    for i in np.flatnonzero(ok).tolist():
        size, mtime, ino, ctime = index.fps[i].tolist()
        copy_ino, copy_ctime = index.copy_ids[i].tolist()
        out.append((int(fidx[i]), index.names[i], (size, mtime, ino, ctime), int(index.disks[i]),
                    int(index.digests[i]) if index.has_digest[i] else None, (copy_ino, copy_ctime)))
    return out
