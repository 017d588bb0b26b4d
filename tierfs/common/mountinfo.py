"""What is mounted where, from ``/proc/self/mountinfo``: the one reader of the mount table.

Read without touching any mount (a hung FUSE mount answers nothing; the table does).  Paths there escape blanks,
tabs, newlines and backslashes as octal (``\\040``); they are unescaped here, once.
"""

from __future__ import annotations

import os
import re

__all__ = ["fstype_of_dev", "mount_at", "mountinfo", "mountpoint_file_name"]

_ESCAPE = re.compile(rb"\\([0-7]{3})")


def mountinfo() -> list[tuple[str, bytes, str]]:
    """(``major:minor``, mount point, filesystem type) of every mount this process sees, in mount order."""
    out = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            fields = line.split()
            where = _ESCAPE.sub(lambda m: bytes([int(m[1], 8)]), fields[4])
            out.append((fields[2].decode(), where, fields[fields.index(b"-") + 1].decode()))
    return out


def mount_at(path: str | os.PathLike[str]) -> tuple[str, str] | None:
    """(``major:minor``, filesystem type) of the topmost mount whose mount point is ``path``; None where nothing
    is mounted there, or the table cannot be read.  ``path`` is made absolute, not resolved: resolving would
    stat the mount point, which a hung mount never answers (resolve it first where it may be a symlink)."""
    where = os.fsencode(os.path.abspath(path))
    found = None
    try:
        table = mountinfo()
    except OSError:
        return None
    for dev, point, fstype in table:
        if point == where:
            found = (dev, fstype)  # (a later line is mounted over an earlier one)
    return found


def fstype_of_dev(dev: int) -> str | None:
    """The filesystem type of the mount whose files have ``st_dev`` ``dev`` (the topmost, where several share
    it); None where none does, or the table cannot be read."""
    want = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        table = mountinfo()
    except OSError:
        return None
    found = None
    for got, _, fstype in table:
        if got == want:
            found = fstype
    return found


def mountpoint_file_name(mountpoint: str) -> str:
    """``/mnt/imagenet`` -> ``mnt-imagenet``: a mount's files outside it (its log, its textfile) are named so; a
    ``-`` in a component is doubled, so two mountpoints never share a name."""
    return os.path.abspath(mountpoint).strip("/").replace("-", "--").replace("/", "-") or "root"
