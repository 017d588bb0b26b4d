"""Who asks: the mount's owner and root steer it and see what it names; other users are served, within a budget.

An ``allow_other`` mount (always with ``default_permissions``: the kernel checks the backing's modes on dataset
paths) is shared, and three things must hold for the users who are not the mount's (docs/tierfs.md, "Several
users"):

* **Nothing names a file they could not list.**  ``/.tierfs/status``, ``order``, ``order0`` and ``plan`` name
  files (``status`` in its errors) and ``plan`` also cached paths: they are the owner's, mode 0400
  (:data:`CONTROL_MODES`, the one table the modes are reported from and opens are checked against).  ``metrics``
  holds numbers only and stays readable by all; ``control`` shows the settings to all and takes writes from the
  owner only.
* **They cannot steer.**  Whoever cannot write ``control`` cannot end a pass either: only the opens and root
  listings of those who may (:meth:`Steering.steers`) count (the engine asks); everyone else is served uncounted.
* **They cannot starve the others of descriptors.**  Every open dataset file holds one descriptor in the daemon
  (its copy or its backing file).  :class:`FdBudget` keeps a reserve of the descriptor limit for the daemon's own
  work and caps what the other users hold: one of them gets ``EMFILE`` past its share, nobody else does.

The owner is the daemon's user, which never changes while it runs; root is privileged because the kernel lets
root read every file anyway.  A mount run by root for others (systemd's units) names a **steering group**
(``group=trainers``): its members steer like the owner -- their opens and root listings move the schedule, they
read ``status``, ``order`` and ``order0`` and write ``control`` (the files are then that group's, modes 0440 and
0664, so the kernel's ``default_permissions`` check agrees) -- while cached paths (``plan``, the ``cache_path``
attribute) stay the owner's and root's: the cache dir is 0700.  Membership is read once, at mount time
(:meth:`Steering.of_group`): a user added to the group later steers from the next mount.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import resource
import stat
from collections import Counter
from dataclasses import dataclass

import numpy as np

__all__ = ["CONTROL_MODES", "OWNER_UID", "FdBudget", "FdBudgetStatistics", "Reader", "Steering", "listable_dirs",
           "may_open_control_file", "privileged"]

#: The daemon's user: the mount's owner.
OWNER_UID = os.getuid()

#: Modes of ``/.tierfs`` and its files (owned by the daemon's user): what the kernel checks other users against
#: (``default_permissions``) and what :func:`may_open_control_file` checks again on open.
CONTROL_MODES: dict[bytes, int] = {
    b".tierfs": stat.S_IFDIR | 0o555,
    b"control": stat.S_IFREG | 0o644,  # the settings, no names; written by the owner only
    b"metrics": stat.S_IFREG | 0o444,  # numbers only: for monitoring by anyone
    b"status": stat.S_IFREG | 0o400,  # last_error and staging errors name files
    b"order": stat.S_IFREG | 0o400,
    b"order0": stat.S_IFREG | 0o400,
    b"plan": stat.S_IFREG | 0o400,  # names files and the paths of their cached copies
}

#: Share of the descriptor limit kept for the daemon's own work (staging streams, pushes, cache and backing
#: threads, the journal, the log), at most :data:`_RESERVE_MAX`: dataset handles never take it.
_RESERVE_SHARE = 4
_RESERVE_MAX = 1024


def privileged(uid: int) -> bool:
    """The mount's owner or root: may read cached paths and the files that name files, write ``control``, and
    move the schedule by reading (the cache dir is 0700: theirs)."""
    return uid in (0, OWNER_UID)


def may_open_control_file(name: bytes, uid: int, *, write: bool) -> bool:
    """Whether ``uid`` may open ``/.tierfs/<name>`` (for writing if ``write``) on a mount without a steering
    group: :meth:`Steering.may_open` of the owner and root alone."""
    return Steering().may_open(name, uid, write=write)


#: What a steering group may do with each file that is the owner's alone otherwise (``plan`` stays theirs).
_GROUP_BITS = {b"status": stat.S_IRGRP, b"order": stat.S_IRGRP, b"order0": stat.S_IRGRP,
               b"control": stat.S_IRGRP | stat.S_IWGRP}


@dataclass(frozen=True)
class Steering:
    """Who may steer the mount: its owner, root, and the members (``uids``) of the steering group ``gid``
    (none by default).  See the module docstring."""

    gid: int | None = None
    uids: frozenset[int] = frozenset()

    @classmethod
    def of_group(cls, group: str) -> Steering:
        """The steering group named ``group`` (a name or a number; ``""``: none), its members as of now: those
        listed in it and those whose primary group it is.  ``ValueError`` for a group that does not exist."""
        if not group:
            return cls()
        try:
            g = grp.getgrgid(int(group)) if group.isdigit() else grp.getgrnam(group)
        except KeyError:
            raise ValueError(f"group: no such group {group!r} (see getent group)") from None
        uids = {p.pw_uid for p in pwd.getpwall() if p.pw_gid == g.gr_gid or p.pw_name in g.gr_mem}
        return cls(g.gr_gid, frozenset(uids))

    def steers(self, uid: int) -> bool:
        """Whether ``uid``'s opens and root listings move the schedule (and it may write ``control``)."""
        return privileged(uid) or uid in self.uids

    def mode(self, name: bytes) -> int:
        """The mode ``/.tierfs/<name>`` shows: :data:`CONTROL_MODES`, plus the group's bits when there is one."""
        mode = CONTROL_MODES[name]
        return mode | _GROUP_BITS.get(name, 0) if self.gid is not None else mode

    def may_open(self, name: bytes, uid: int, *, write: bool) -> bool:
        """The modes of :meth:`mode` as the kernel reads them, for the owner, root (who reads everything), the
        group's members and the others."""
        mode = self.mode(name)
        if privileged(uid):
            return not write or bool(mode & stat.S_IWUSR)
        if uid in self.uids:
            return bool(mode & (stat.S_IWGRP if write else stat.S_IRGRP))
        return bool(mode & (stat.S_IWOTH if write else stat.S_IROTH))


@dataclass(frozen=True)
class FdBudgetStatistics:
    """What ``status`` shows under ``fd_budget``."""

    reserve: int  # kept for the daemon's own work: no dataset handle takes it
    others_limit: int  # handles all users other than the owner and root may hold together
    per_user_limit: int  # ... and any one of them
    others_held: int  # handles they hold now
    refused: int  # opens refused with EMFILE by this budget since mount


def _limits() -> tuple[int, int, int, int]:
    """(limit, reserve, others' limit, one other user's limit), from the limit in force now (an operator may
    change it on a running daemon with ``prlimit``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = soft if soft != resource.RLIM_INFINITY else hard
    limit = limit if limit != resource.RLIM_INFINITY else 1 << 20
    reserve = min(limit // _RESERVE_SHARE, _RESERVE_MAX)
    handles = limit - reserve
    return limit, reserve, handles // 2, handles // 4


class FdBudget:
    """Descriptors held by open dataset handles, per requesting user (see the module docstring).

    Every handle may hold one descriptor; all handles together stay out of the daemon's reserve, those of users
    other than the owner and root within half of the rest, and each such user within a quarter -- so a user who
    opens without end gets ``EMFILE`` alone, and the owner always has half the handles and the daemon its
    reserve.  Owned by the data path: :meth:`take` before a handle opens its descriptor, :meth:`give` when it
    is released (or its open failed)."""

    def __init__(self) -> None:
        self._held: Counter[int] = Counter()  # uid -> handles held
        self._total = 0
        self._others = 0
        self._refused = 0

    def take(self, uid: int) -> None:
        """Count one more handle for ``uid``; ``OSError(EMFILE)`` (nothing counted) past its share."""
        limit, reserve, others_limit, per_user = _limits()
        other = not privileged(uid)
        if self._total >= limit - reserve or (other and (self._others >= others_limit
                                                         or self._held[uid] >= per_user)):
            self._refused += 1
            raise OSError(errno.EMFILE, "too many files open by this user on the mount")
        self._held[uid] += 1
        self._total += 1
        self._others += other

    def give(self, uid: int) -> None:
        """A handle of ``uid`` let go of its descriptor."""
        left = self._held[uid] - 1
        if left:
            self._held[uid] = left
        else:
            del self._held[uid]
        self._total -= 1
        self._others -= not privileged(uid)

    def statistics(self) -> FdBudgetStatistics:
        _, reserve, others_limit, per_user = _limits()
        return FdBudgetStatistics(reserve, others_limit, per_user, self._others, self._refused)


@dataclass(frozen=True)
class Reader:
    """A requester as the kernel's permission check sees it: its filesystem uid and every group it holds.

    Used where the daemon, not the kernel, decides what a user may see (the names in ``order``/``order0``)."""

    uid: int
    gids: frozenset[int]

    @classmethod
    def of(cls, uid: int, pid: int) -> Reader:
        """The reader behind a request of ``uid`` from process ``pid``: its groups from ``/proc/PID/status``
        (``Gid:`` -- the filesystem gid -- and ``Groups:``).  That file is built from the process's credentials,
        never from its memory map, so a process wedged in a page fault does not hold this read up.  A process
        gone (or a pid not of ``uid`` any more) holds no group: it sees only what others may see."""
        gids: set[int] = set()
        try:
            with open(f"/proc/{pid}/status", "rb") as f:
                lines = {k: v.split() for k, _, v in (line.partition(b":") for line in f)}
            if int(lines[b"Uid"][3]) == uid:
                gids = {int(lines[b"Gid"][3]), *map(int, lines.get(b"Groups", []))}
        except (OSError, KeyError, IndexError, ValueError):
            pass
        return cls(uid, frozenset(gids))

    def access_bits(self, meta: np.ndarray) -> np.ndarray:
        """The ``rwx`` bits (0-7) this reader has on each row of ``meta`` (``int64 [row, (mode, nlink, uid, gid,
        rdev)]``, a tree's table of distinct attributes), as ``generic_permission`` picks them: the owner's
        bits for the owner, the group's for a member, the others' for everyone else; every bit for root."""
        mode, uid, gid = meta[:, 0], meta[:, 2], meta[:, 3]
        if self.uid == 0:
            return np.full(len(meta), 7, np.int64)
        member = np.isin(gid, np.fromiter(self.gids, np.int64, len(self.gids)))
        return np.where(uid == self.uid, mode >> 6, np.where(member, mode >> 3, mode)) & 7


def listable_dirs(reader: Reader, parents: np.ndarray, meta: np.ndarray, meta_idx: np.ndarray) -> np.ndarray:
    """Per node of a tree (``parents``: each node's parent, the root its own; ``meta``/``meta_idx``: its
    attribute rows), whether ``reader`` may list it: read and search it, and search every directory above it.
    (Meaningful for directories; ``parents`` must lead every node to node 0.)"""
    bits = reader.access_bits(meta)[meta_idx]
    searchable = (bits & 1).astype(bool)
    reach = searchable.copy()  # searchable, and so is every directory above
    while True:
        above = reach[parents]
        step = reach & above
        if np.array_equal(step, reach):
            break
        reach = step
    return reach & (bits & 4).astype(bool)
