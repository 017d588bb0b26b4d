"""Reaching the cache dir so that no other user can redirect what the daemon writes there (issue 46, 11).

The daemon -- often root -- writes its state files (journal, index, saved tree, copies) into the cache dir.  A
user who can rename entries of a directory on the way to it (its parent, or any directory above, up to ``/``)
can swap the cache dir, or a directory above it, for a symlink to a place she chose, and root would write
there.  Two defences, both here and in store.py:

* the cache dir is opened **once**, and every file in it is reached through that descriptor (``openat``,
  ``renameat``: :func:`sampler.atomic.atomic_write` with ``dir_fd``), so a swap after the mount opened it
  changes nothing;
* before it is opened, the path to it is walked from ``/`` one name at a time (:func:`open_parent`), and a
  directory on the way that another user could change is **refused**: one owned by a user other than root and
  the daemon's, or writable by others (group or world) without the sticky bit -- a sticky directory such as
  ``/tmp`` lets a user rename only her own entries, and one of hers on the way is refused in turn.  A group
  that is the daemon user's own private group (its name, its primary group, no other member) is the user.
  A symlink on the way is followed only if root or the daemon's user owns it, and the directories it leads
  through are checked the same way.

Refusing, not warning: a warning in a daemon's log is read after the fact, and the fix (``chmod o-w,g-w`` or
``+t`` on the directory named, or another cache dir) takes a minute.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import os
import pwd
import stat

__all__ = ["check_parents", "open_parent"]

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_LINKS = 40  # symlinks followed on one path (the kernel's own limit)


def open_parent(path: str, *, create: bool = False) -> tuple[int, str]:
    """A descriptor of the directory that holds ``path`` and the last name of ``path``, reached from ``/`` one
    name at a time with every directory on the way checked (see the module docstring).  ``create``: make missing
    directories on the way (0700).  ``ValueError`` naming ``path`` and the directory at fault."""
    names = [n for n in os.path.abspath(path).split("/") if n]
    if not names:
        raise ValueError(f"cache dir {path}: / cannot be a cache dir")
    last = names.pop()
    uid = os.getuid()
    stack = [(os.open("/", _DIR), "/")]  # the directories walked into, and their paths as walked
    todo = names
    links = 0
    try:
        while True:
            _check_dir(stack[-1][0], stack[-1][1], path, uid)
            if not todo:
                fd = stack.pop()[0]
                return fd, last
            name = todo.pop(0)
            if name == ".." and len(stack) > 1:
                os.close(stack.pop()[0])
                continue
            if name in (".", ".."):
                continue
            dir_fd, where = stack[-1]
            shown = os.path.join(where, name)
            try:
                stack.append((_open_dir(dir_fd, name, create=create), shown))
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise ValueError(f"cannot open cache dir {path}: {shown}: {exc.strerror}") from None
                target = _link_target(dir_fd, name, shown, path, uid)
                links += 1
                if links > _MAX_LINKS:
                    raise ValueError(f"cannot open cache dir {path}: too many symlinks on the way") from None
                if target.startswith("/"):
                    while len(stack) > 1:
                        os.close(stack.pop()[0])
                todo = [n for n in target.split("/") if n] + todo
    finally:
        for fd, _ in stack:
            os.close(fd)


def check_parents(path: str) -> None:
    """``ValueError`` if another user could swap ``path`` or a directory on the way to it (:func:`open_parent`)."""
    fd, _ = open_parent(path)
    os.close(fd)


def _open_dir(dir_fd: int, name: str, *, create: bool) -> int:
    try:
        return os.open(name, _DIR, dir_fd=dir_fd)
    except FileNotFoundError:
        if not create:
            raise
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    return os.open(name, _DIR, dir_fd=dir_fd)


def _link_target(dir_fd: int, name: str, shown: str, path: str, uid: int) -> str:
    """Where the symlink ``name`` in ``dir_fd`` points, if it is one that root or the daemon's user owns."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        target = os.readlink(name, dir_fd=dir_fd) if stat.S_ISLNK(st.st_mode) else None
    except OSError as exc:
        raise ValueError(f"cannot open cache dir {path}: {shown}: {exc.strerror}") from None
    if target is None:
        raise ValueError(f"cannot open cache dir {path}: {shown} is not a directory")
    if st.st_uid not in (0, uid):
        raise ValueError(f"cache dir {path} refused: the symlink {shown} on the way belongs to {_user(st.st_uid)}, "
                         f"who could point it elsewhere and have tierfs write there; name the directory itself")
    return target


def _check_dir(fd: int, where: str, path: str, uid: int) -> None:
    """``ValueError`` if anyone but root and ``uid`` can rename what is in the directory ``fd``."""
    st = os.fstat(fd)
    why = None
    if st.st_uid not in (0, uid):
        why = f"{where} belongs to {_user(st.st_uid)}"
    elif st.st_mode & stat.S_ISVTX:
        return  # (sticky: each user renames only her own entries, and one of hers on the way is refused)
    elif st.st_mode & stat.S_IWOTH:
        why = f"{where} is writable by every user (mode {stat.S_IMODE(st.st_mode):04o}, not sticky)"
    elif st.st_mode & stat.S_IWGRP and not _private_group(st.st_gid, uid):
        why = (f"{where} is writable by group {_group(st.st_gid)} (mode {stat.S_IMODE(st.st_mode):04o}, "
               f"not sticky)")
    if why is not None:
        raise ValueError(f"cache dir {path} refused: {why}, so another user could replace what is in it with a "
                         f"symlink and have tierfs (as {_user(uid)}) write where she chose; use a cache dir whose "
                         f"parents only root and {_user(uid)} can change (chmod g-w,o-w or +t {where}), or another "
                         f"cache dir")


def _private_group(gid: int, uid: int) -> bool:
    """Whether ``gid`` is ``uid``'s user-private group (its name, its primary group, no other member listed)."""
    try:
        user, group = pwd.getpwuid(uid), grp.getgrgid(gid)
    except KeyError:
        return False
    return user.pw_gid == gid and group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name} (gid {gid})"
    except KeyError:
        return f"gid {gid}"
