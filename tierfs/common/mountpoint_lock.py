"""A daemon's lock on its mountpoint: how the command line finds a tierfs that is starting, from the mountpoint
itself.

A first mount scans the backing dir before it mounts (minutes on a large data set); meanwhile the mountpoint is a
plain directory, and ``tierfs status`` there could only say that nothing is mounted.  So the daemon holds a shared
``flock`` on the mountpoint directory for its whole life, taken before the scan (:func:`hold`).  The kernel lists
the holder's pid in ``/proc/locks`` and drops the lock when the process ends, however it ends: nothing is written
anywhere, nothing goes stale, and a reused pid never inherits it.  :func:`holders` reads it back.

Never by scanning other processes' ``/proc/PID/cmdline``: reading one waits on that process's memory map, which a
process stuck in a page fault on a FUSE mount that never answers holds for as long as it is stuck (any user can
make one), so a scan hangs with it.  ``/proc/locks`` is the kernel's own table and waits on no process.
"""

from __future__ import annotations

import contextlib
import fcntl
import os

__all__ = ["hold", "holders"]

_LOCKS = "/proc/locks"


def hold(mountpoint: str) -> int:
    """Take the shared lock on the directory ``mountpoint`` for as long as the returned fd stays open (the
    process's life: it is never closed); -1 where the lock cannot be taken (a mountpoint on a filesystem without
    flock): the mount goes on, only ``tierfs status`` cannot tell that it is starting."""
    try:
        fd = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # (shared: it never keeps another mount from starting)
    except OSError:
        os.close(fd)
        return -1
    return fd


def holders(path: str) -> list[int]:
    """The pids of the other processes that :func:`hold` the directory ``path`` (0 for one outside this pid
    namespace); [] where none does or ``path`` cannot be looked at.

    ``path`` is stat'ed: call this only where nothing is mounted (``mounts.mount_at``), so no FUSE daemon is
    asked.  The lock's key in ``/proc/locks`` (device as the kernel numbers the filesystem, and inode) is learnt
    from a shared lock of our own on ``path`` where we may open it, since ``stat`` gives another device number
    than the table on some filesystems (btrfs subvolumes); from ``stat`` where we may not.
    """
    me = os.getpid()
    try:
        st = os.stat(path)
    except OSError:
        return []
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        fd = -1  # (not ours to read: the key comes from stat)
    try:
        if fd >= 0:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        with open(_LOCKS, "rb") as f:
            table = [line.split() for line in f]
    except OSError:
        return []
    finally:
        if fd >= 0:
            os.close(fd)  # (lets our lock go)
    # "N: FLOCK ADVISORY READ PID MAJ:MIN:INO 0 EOF"; waiters are listed as "N: -> FLOCK ..." (not holders)
    locks = [(int(f[4]), f[5]) for f in table if len(f) >= 6 and f[1] == b"FLOCK" and f[4].lstrip(b"-").isdigit()]
    inode = b":%d" % st.st_ino
    mine = {key for pid, key in locks if pid == me and key.endswith(inode)}
    key = mine.pop() if len(mine) == 1 else b"%02x:%02x:%d" % (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    return sorted({pid for pid, k in locks if k == key and pid != me})
