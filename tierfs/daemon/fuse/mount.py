"""The life of a mount: open the engine, mount, serve until unmounted or signalled, unmount, persist.

The order matters and is the same in the foreground, under ``--daemon`` and under systemd:

1. ``Engine.open()`` scans the backing tree and refuses a configuration that cannot work *before* anything is
   mounted, so a bad setting never leaves a half-made mount behind;
2. ``pyfuse3.init`` mounts; ``pyfuse3.main`` serves; the engine's staging tasks run beside it in one nursery;
3. once a ``stat`` of ``/.tierfs/status`` comes back through the kernel, the mount answers: systemd gets
   ``READY=1`` and a ``--daemon`` parent gets its go-ahead, so neither reports ready too early;
4. SIGTERM or SIGINT stop the mount (:func:`_stop_on_signal`); an external ``fusermount3 -u`` ends the main
   loop too.  SIGHUP only reopens the log (:func:`reopen_log`: logrotate's ``kill -HUP``, the unit's
   ``ExecReload=``), as a daemon's SIGHUP does; it never unmounts a dataset under a running job;
5. ``pyfuse3.close(unmount=True)`` always runs, then ``Engine.close()`` writes the journal, so a clean stop
   resumes exactly where it was.

**A stop within a bound.**  A push or an invalidation (pusher.py) can wait in the kernel on a page lock held by
a reader's READ, which only the main loop answers.  So a signal first closes the kernel calls and waits (up to
:data:`STOP_DRAIN_S`) for the one in flight while the main loop still serves, and only then ends the main loop.
Ended first, that call would stay in the kernel for good: its reference to ``/dev/fuse`` keeps the connection
open after the unmount, the process cannot exit and the reader waits forever.  If the call is still in the
kernel after the wait, the connection is aborted (:func:`abort_connection`), which fails what waits on it.
Readers then get a clean error (``ENOTCONN`` on an open file, ``ENOENT`` on a new open of the unmounted path);
pages already in the page cache stay correct.  A watchdog ends the process :data:`STOP_DEADLINE_S` seconds
after the signal whatever is still running (the journal is written atomically: at worst the last pass's
position is lost, as after a crash).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from tierfs.common.mountinfo import mount_at, mountpoint_file_name
from tierfs.common.mountpoint_lock import hold as hold_mountpoint
from tierfs.common.options import MountConfig, check_layout, format_size
from tierfs.daemon.cache.safepath import check_parents
from tierfs.daemon.runtime.memory import trim_heap, tune_malloc
from tierfs.daemon.runtime.threads import IDLE_THREAD_S, in_thread, keep_idle_threads

if TYPE_CHECKING:
    from types import ModuleType

    from tierfs.daemon.fuse.operations import TierOperations
    from tierfs.daemon.kernel.pusher import KernelCache
    from tierfs.daemon.tree.tree import ScanCount

log = logging.getLogger("tierfs")

__all__ = ["LOG_MAX_BYTES", "STOP_DEADLINE_S", "STOP_DRAIN_S", "JournalFormatter", "LogFormatter", "MountError",
           "RotatingLogHandler", "WholeLineHandler", "abort_connection", "check_paths", "configure_logging",
           "daemonize", "default_log_path", "fuse_connection", "fuse_options", "log_max_bytes", "raise_fd_limit",
           "reopen_log", "run_mount", "sd_notify"]

#: A daemon's log file is rotated at this size: renamed to ``NAME.log.1`` (one old file kept, so the two never
#: take more than twice this); ``TIERFS_LOG_MAX`` in the environment sets another size (tests use a small one).
LOG_MAX_BYTES = 16 << 20

#: Seconds a stop waits, still serving, for a push or invalidation in flight to leave the kernel before it
#: aborts the connection (normally milliseconds: a READ answered by the main loop lets it go).
STOP_DRAIN_S = 5.0
#: Seconds from the signal after which the process exits whatever is still running (a hung cache disk): the
#: documented bound of a stop, well under systemd's TimeoutStopSec=60 of the unit.
STOP_DEADLINE_S = 20.0


class MountError(Exception):
    """A failure to mount with a one-line reason for the user (exit status 1)."""


def check_paths(config: MountConfig, *, nonempty: bool = False) -> MountConfig:
    """Resolve the three paths and refuse layouts that cannot work, before anything is created.

    Refused: paths that would loop or write into the backing tree; a non-empty mountpoint unless ``nonempty``
    (mounting would hide what is there); a cache dir whose parent is missing (only the last component is
    created, 0700, so a typo never builds a tree); a capacity the cache's filesystem cannot give (its free
    space plus what the cache dir already holds).  Returns a config with absolute, resolved paths.
    """
    backing = os.path.realpath(config.backing)
    mountpoint = os.path.realpath(config.mountpoint)
    cache = os.path.realpath(config.cache)
    if not os.path.isdir(backing):
        raise MountError(f"backing dir {config.backing} does not exist or is not a directory")
    if _is_fuse_mount(mountpoint):
        raise MountError(f"{config.mountpoint} is already a FUSE mount (unmount it first: tierfs umount, or "
                         f"fusermount3 -uz if it says 'Transport endpoint is not connected')")
    if not os.path.isdir(mountpoint):
        raise MountError(f"mountpoint {config.mountpoint} does not exist or is not a directory")
    try:
        check_layout(backing, cache, mountpoint)
    except ValueError as exc:
        raise MountError(str(exc)) from None
    if not nonempty:
        try:
            entries = len(os.listdir(mountpoint))
        except OSError as exc:
            raise MountError(f"cannot list mountpoint {mountpoint}: {exc.strerror}") from None
        if entries:
            raise MountError(f"mountpoint {mountpoint} is not empty ({entries} entries would be hidden); "
                             f"give --nonempty (-o nonempty) to mount over them")
    exists = os.path.isdir(cache)
    if not exists:
        parent = os.path.dirname(cache)
        if not os.path.isdir(parent):
            raise MountError(f"cannot create cache dir {cache}: its parent {parent} does not exist "
                             f"(tierfs creates only the last component)")
    try:
        check_parents(config.cache)  # (the path as given: a symlink on it that another user could swap counts)
    except ValueError as exc:
        raise MountError(str(exc)) from None
    _check_capacity(config.capacity, cache if exists else os.path.dirname(cache), cache if exists else None)
    if not exists:
        try:
            os.mkdir(cache, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise MountError(f"cannot create cache dir {cache}: {exc.strerror}") from None
    if not os.access(cache, os.W_OK | os.X_OK):
        raise MountError(f"cache dir {cache} is not writable")
    return MountConfig(backing=backing, mountpoint=mountpoint, cache=cache, capacity=config.capacity,
                       settings=config.settings)


def _allocated_bytes(root: str) -> int:
    """Disk blocks held by the files under ``root`` (what ``du -s`` counts), without following links."""
    total = 0
    stack = [root]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
                        else:
                            total += entry.stat(follow_symlinks=False).st_blocks * 512
                    except OSError:
                        continue
        except OSError:
            continue
    return total


def _check_capacity(capacity: int, on: str, cache: str | None) -> None:
    """Refuse a capacity larger than the cache filesystem's free space plus what ``cache`` already holds."""
    try:
        st = os.statvfs(on)
    except OSError as exc:
        raise MountError(f"cannot check the free space of {on}: {exc.strerror}") from None
    free = st.f_bavail * st.f_frsize
    held = _allocated_bytes(cache) if cache else 0
    if capacity > free + held:
        raise MountError(
            f"capacity {format_size(capacity)} ({capacity} bytes) is more than the cache's filesystem can hold: "
            f"{format_size(free + held)} ({free + held} bytes = {free} free on {on} + {held} already in the cache "
            f"dir); lower --capacity to at most that"
        )


def _is_fuse_mount(path: str) -> bool:
    mounted = mount_at(path)
    return mounted is not None and mounted[1].startswith("fuse")


def fuse_connection(mountpoint: str) -> str | None:
    """The fusectl name (``/sys/fs/fuse/connections/NAME``) of the FUSE mount at ``mountpoint``, the topmost
    one there, from /proc/self/mountinfo: without touching the mount (which may not answer)."""
    mounted = mount_at(mountpoint)
    if mounted is None or not mounted[1].startswith("fuse"):
        return None
    major, minor = (int(x) for x in mounted[0].split(":"))
    return str(major << 20 | minor)  # the kernel's dev_t, which names the fusectl directory


def abort_connection(mountpoint: str, conn: str | None = None) -> bool:
    """Abort the FUSE connection ``conn`` (default: the mount at ``mountpoint``): every request waiting on its
    daemon fails (``ENOTCONN``), every page a READ locked is let go.  Through fusectl, which root and the
    mount's owner may write (its files belong to the owner); where fusectl is not mounted, root forces an
    unmount (``umount2(MNT_FORCE)`` aborts a FUSE connection first), only while ``conn`` is still mounted at
    ``mountpoint``.  True if aborted."""
    if conn is None:
        conn = fuse_connection(mountpoint)
        if conn is None:
            return False
    try:
        with open(f"/sys/fs/fuse/connections/{conn}/abort", "w") as f:
            f.write("1")
        return True
    except OSError:
        pass
    if os.geteuid() != 0 or fuse_connection(mountpoint) != conn:
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    # EBUSY (files still open) is fine: umount_begin aborted the connection before the busy check
    return libc.umount2(os.fsencode(mountpoint), 1) == 0 or ctypes.get_errno() == errno.EBUSY  # 1: MNT_FORCE


def fuse_options(config: MountConfig) -> set[str]:
    """The FUSE mount options: name the backing dir as the source, type ``fuse.tierfs``.

    ``allow_other`` always comes with ``default_permissions`` so the kernel checks the backing files' modes
    for other users instead of letting everyone read everything.  ``ro`` makes the mount read-only in the
    kernel's eyes (``statfs`` ``ST_RDONLY``, ``findmnt`` ``ro``); without it the mount is ``rw`` to the kernel
    only so that the control file can be written, and every other write is refused with EROFS by tierfs.
    """
    opts = {f"fsname={config.backing}", "subtype=tierfs"}
    if config.settings.allow_other:
        opts |= {"allow_other", "default_permissions"}
    if config.settings.ro:
        opts.add("ro")  # the kernel then refuses every write before it reaches us, control writes included
    return opts


def sd_notify(message: str) -> bool:
    """Send ``message`` to systemd's notify socket if there is one (``Type=notify`` units)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            sock.sendto(message.encode(), address)
        except OSError as exc:
            log.warning("cannot notify systemd: %s", exc)
            return False
    return True


class WholeLineHandler(logging.Handler):
    """Log records as whole lines, each with one ``write()``: a full disk drops a line, never cuts one.

    (A buffered stream writes what fits and leaves half a line behind for the next record to continue.)"""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd
        self.dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = (self.format(record) + "\n").encode(errors="replace")
        except Exception:
            self.handleError(record)
            return
        self.write_line(line)

    def write_line(self, line: bytes) -> None:
        try:
            n = os.write(self.fd, line)
        except OSError:
            self.dropped += 1
            return
        if n < len(line):  # a regular file on a full disk: take the partial line back
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, os.lseek(self.fd, 0, os.SEEK_CUR) - n)
            self.dropped += 1


class RotatingLogHandler(WholeLineHandler):
    """A daemon's log file, whole lines, rotated by size and reopened on SIGHUP.

    The file is the daemon's stdout and stderr too (:func:`daemonize`), so what does not go through logging --
    a traceback, a library's warning -- lands in it as well.  When a line would take it past ``max_bytes``, the
    file is first renamed to ``path + ".1"`` (replacing the older one) and a fresh ``path`` takes its place on
    descriptors 1 and 2, so the newest line is always in ``path``; a rename that fails (a read-only dir) is tried
    again after another ``max_bytes``.  :meth:`reopen` (SIGHUP) opens ``path`` again without renaming anything:
    after logrotate moved the file away, the next lines go to a new one at the same path."""

    def __init__(self, path: str, max_bytes: int) -> None:
        super().__init__(sys.stderr.fileno())
        self.path = path
        self.max_bytes = max_bytes
        self.rotations = 0
        self._rotate_at = max_bytes

    def write_line(self, line: bytes) -> None:
        try:
            size = os.fstat(self.fd).st_size
        except OSError:
            size = 0
        if size and size + len(line) > self._rotate_at:
            self._rotate(size)
        super().write_line(line)

    def reopen(self) -> None:
        """Write from now on to whatever file is at ``path`` (a new one if it was moved away).  ``OSError``
        (the dir gone, read-only) leaves the old file in use."""
        self.acquire()  # (not between a record's size check and its write)
        try:
            self._open_path()
        finally:
            self.release()

    def _rotate(self, size: int) -> None:
        try:
            os.replace(self.path, self.path + ".1")
            self._open_path()
        except OSError:
            self._rotate_at = size + self.max_bytes
            return
        self.rotations += 1

    def _open_path(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        for target in (sys.stdout.fileno(), self.fd):
            os.dup2(fd, target)
        os.close(fd)
        self._rotate_at = self.max_bytes


class LogFormatter(logging.Formatter):
    """A daemon's line, as syslog would write it, the time in ISO 8601 with milliseconds and the zone:
    ``2026-12-06T23:10:00.123+00:00 tierfs[4242] WARNING: message``, so a line can be placed on a job's
    timeline (and the two processes of a ``peers=mpi`` rank told apart)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s tierfs[%(process)d] %(levelname)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        when = datetime.datetime.fromtimestamp(record.created).astimezone()
        return when.isoformat(timespec="milliseconds")


class JournalFormatter(logging.Formatter):
    """A line for the journal, which adds the time, the unit and ``tierfs[PID]`` itself: the level only, after
    the ``<N>`` prefix journald reads as the line's priority (``journalctl -p warning`` then finds warnings)."""

    def __init__(self) -> None:
        super().__init__("%(levelname)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        return f"<{_SYSLOG_PRIORITY.get(record.levelno, 6)}>{super().format(record)}"


#: syslog's priority of each logging level (sd-daemon(3)'s ``<N>`` prefixes)
_SYSLOG_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


def _stderr_is_journal() -> bool:
    """Whether stderr is the journal's stream: ``JOURNAL_STREAM`` (``DEVICE:INODE``, set by systemd) names it.  A
    child of a service whose stderr was redirected keeps the variable, hence the comparison."""
    device, _, inode = os.environ.get("JOURNAL_STREAM", "").partition(":")
    try:
        st = os.fstat(sys.stderr.fileno())
        return (st.st_dev, st.st_ino) == (int(device), int(inode))
    except (OSError, ValueError):
        return False


def configure_logging(level: str, log_path: str | None = None) -> None:
    """Log to stderr -- a terminal, or the journal under systemd -- or (``log_path``, a daemon) to that file,
    rotated by size and reopened on SIGHUP (:func:`reopen_log`)."""
    handler = RotatingLogHandler(log_path, log_max_bytes()) if log_path else WholeLineHandler(sys.stderr.fileno())
    handler.setFormatter(JournalFormatter() if not log_path and _stderr_is_journal() else LogFormatter())
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler], force=True)


def reopen_log() -> bool:
    """SIGHUP: reopen the daemon's log file (after logrotate moved it); False when logging to stderr (a
    terminal, the journal: nothing to reopen) or when the file cannot be opened again."""
    handlers = [h for h in logging.getLogger().handlers if isinstance(h, RotatingLogHandler)]
    for handler in handlers:
        try:
            handler.reopen()
        except OSError as exc:
            log.error("SIGHUP: cannot reopen the log %s (%s): still writing to the file it was", handler.path,
                      exc.strerror)
            return False
    return bool(handlers)


def log_max_bytes() -> int:
    """The size a daemon's log is rotated at: ``TIERFS_LOG_MAX`` (a size, e.g. ``64K``) or :data:`LOG_MAX_BYTES`."""
    from tierfs.common.options import parse_size

    text = os.environ.get("TIERFS_LOG_MAX")
    try:
        return max(1, parse_size(text)) if text else LOG_MAX_BYTES
    except ValueError:
        return LOG_MAX_BYTES


def default_log_path(mountpoint: str) -> str:
    """Where a ``--daemon`` mount logs: never on the cache filesystem (a full cache disk must not cost the log):
    ``/var/log/tierfs/`` for root, ``$XDG_STATE_HOME/tierfs/`` (``~/.local/state``) for anyone else; the file
    is named after the mountpoint (``/mnt/imagenet`` -> ``mnt-imagenet.log``) and rotated by
    :class:`RotatingLogHandler`.  A foreground mount (``tierfs@.service`` runs one) logs to stderr: the journal."""
    if os.getuid() == 0:
        base = "/var/log/tierfs"
    else:
        base = os.path.join(os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"), "tierfs")
    os.makedirs(base, mode=0o700, exist_ok=True)
    return os.path.join(base, f"{mountpoint_file_name(mountpoint)}.log")


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (services start at 1024; loaders hold thousands of
    files open); returns (before, after)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def daemonize(log_path: str) -> tuple[Callable[[str | None], None], Callable[[ScanCount], None]]:
    """Fork; the parent waits for the child to report and exits 0 (ready) or 1 (failed, reason on stderr).

    Returns, in the child, the function that reports: ``report(None)`` for ready, ``report("reason")`` for a
    failure; and the scan's progress callback, which the parent shows on its terminal meanwhile
    (:class:`tierfs.daemon.fuse.scan_bar.ScanProgress`).  The child starts a new session and sends its output
    to ``log_path``.
    """
    from tierfs.daemon.fuse.scan_bar import ScanProgress
    from tierfs.daemon.tree.tree import ScanCount

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid > 0:
        os.close(write_end)
        progress = ScanProgress(sys.stderr)
        pending = b""
        while chunk := os.read(read_end, 4096):
            pending += chunk
            while pending.startswith(b"scan ") and b"\n" in pending:  # "scan ENTRIES FILES BYTES SECONDS TOTAL"
                line, pending = pending.split(b"\n", 1)
                entries, files, nbytes, seconds, total = line.split()[1:]
                progress.update(ScanCount(int(entries), int(files), int(nbytes), float(seconds),
                                          int(total) if int(total) >= 0 else None))
        progress.close()
        message = pending.decode(errors="replace").strip()
        if message == "ready":
            os._exit(0)
        if not message:
            # The child died without a word; its log says why -- unless it was killed, which leaves none there
            _, status = os.waitpid(pid, 0)
            message = _death(os.waitstatus_to_exitcode(status), log_path)
            if os.WIFSIGNALED(status):
                _log_for(pid, log_path, message)
        print(f"tierfs: error: {message}", file=sys.stderr)
        os._exit(1)

    os.close(read_end)
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    logfd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(devnull, 0)
    os.dup2(logfd, 1)
    os.dup2(logfd, 2)
    os.close(devnull)
    os.close(logfd)
    os.chdir("/")

    def report(failure: str | None) -> None:
        nonlocal write_end
        if write_end < 0:
            return
        with contextlib.suppress(OSError):
            os.write(write_end, b"ready" if failure is None else failure.encode())
        os.close(write_end)
        write_end = -1

    def scan_progress(count: ScanCount) -> None:
        if write_end >= 0:
            total = -1 if count.total is None else count.total
            with contextlib.suppress(OSError):  # (one short write: never split, never mixed with another)
                os.write(write_end, b"scan %d %d %d %.3f %d\n" % (count.entries, count.files, count.bytes,
                                                                  count.seconds, total))

    return report, scan_progress


def _death(code: int, log_path: str) -> str:
    """Why a ``--daemon`` child that ended before it was ready did, from its exit status ``code`` (negative: the
    signal).  SIGKILL before ready is most often the kernel's OOM killer: a first mount's scan is the daemon's
    peak (docs/operations.md sizes it), so the line names the memory cgroup's limit where there is one."""
    if code == -signal.SIGKILL:
        from tierfs.daemon.runtime.memory import cgroup_memory

        limit = cgroup_memory()[0]
        within = f"; the memory cgroup's limit is {format_size(limit)}" if limit is not None else ""
        return (f"the daemon was killed by signal 9 (SIGKILL) before the mount was ready: killed (out of memory?"
                f"{within}; see the kernel's log, dmesg, and the memory sizing in docs/operations.md)")
    if code < 0:
        return f"the daemon was killed by signal {-code} ({signal.Signals(-code).name}) before the mount was ready"
    return f"daemon exited with status {code} before the mount was ready (see {log_path})"


def _log_for(pid: int, log_path: str, message: str) -> None:
    """Write ``message`` into the daemon's log as the daemon ``pid`` would have (it was killed: it could not)."""
    record = logging.LogRecord("tierfs", logging.ERROR, __file__, 0, "%s", (message,), None)
    record.process = pid
    with contextlib.suppress(OSError):
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, (LogFormatter().format(record) + "\n").encode(errors="replace"))
        finally:
            os.close(fd)


async def _announce_when_answering(mountpoint: str, on_ready: Callable[[], None]) -> None:
    # The stat goes through the kernel to our own main loop, so it can only return once we are serving.
    # (abandoned on cancel: a stop before the first answer must not wait for this stat, which only the
    # main loop being stopped could answer)
    await in_thread(os.stat, os.path.join(mountpoint, ".tierfs", "status"), abandon_on_cancel=True)
    on_ready()  # (first: a terminal's scan progress ends before the log goes on)
    log.info("mounted %s", mountpoint)
    sd_notify("READY=1\nSTATUS=serving")


async def _stop_on_signal(cancel_scope: trio.CancelScope, ops: TierOperations, pyfuse3: ModuleType) -> None:
    """On SIGTERM or SIGINT: close the kernel calls while still serving, then end the main loop and the engine's
    tasks (see the module docstring).  On SIGHUP: reopen the log, and go on serving."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            if signum == signal.SIGHUP:
                if reopen_log():
                    log.info("SIGHUP: log reopened; still serving (SIGTERM unmounts)")
                else:
                    log.info("SIGHUP: no log file to reopen; still serving (SIGTERM unmounts)")
                continue
            log.info("%s: unmounting", signal.Signals(signum).name)
            sd_notify("STOPPING=1")
            _start_watchdog(STOP_DEADLINE_S)
            # (no more pushes or invalidations; the one in flight may return while the main loop still serves)
            if not await ops.kernel.close(STOP_DRAIN_S):
                log.warning("a page-cache push is still in the kernel after %g s: aborting the connection",
                            STOP_DRAIN_S)
            pyfuse3.terminate()
            cancel_scope.cancel()
            return


def _reopen_log_on_signal(signum: int, frame: object) -> None:
    reopen_log()


def _start_watchdog(seconds: float) -> None:
    def expire() -> None:
        log.error("still not stopped %g s after the signal: exiting now", seconds)
        os._exit(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


def _free_stuck_kernel_call(kernel: KernelCache, mountpoint: str, conn: str | None) -> None:
    """A kernel call still in flight holds ``/dev/fuse`` open and waits on a READ nobody will answer now:
    abort the connection, then give the call a moment to return."""
    if not kernel.in_kernel:
        return
    if not abort_connection(mountpoint, conn):
        log.error("cannot abort FUSE connection %s (fusectl not mounted at /sys/fs/fuse/connections and not "
                  "root): a push stays in the kernel until it is aborted; the process cannot exit until then",
                  conn)
        return
    deadline = time.monotonic() + 2.0
    while kernel.in_kernel and time.monotonic() < deadline:
        time.sleep(0.02)


async def _serve(config: MountConfig, ops: TierOperations, pyfuse3: ModuleType, on_ready: Callable[[], None]) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signal, nursery.cancel_scope, ops, pyfuse3)
        await nursery.start(ops.engine.run)
        nursery.start_soon(_announce_when_answering, config.mountpoint, on_ready)
        # An external unmount makes main() return: then the staging tasks have nothing left to do.
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


def run_mount(config: MountConfig, *, on_ready: Callable[[], None] = lambda: None,
              scan_progress: Callable[[ScanCount], None] = lambda count: None) -> None:
    """Mount and serve until unmounted or signalled.  Raises :class:`MountError` with a one-line reason.
    ``scan_progress`` hears of a first mount's scan (see ``Tree.scan``)."""
    import pyfuse3  # the FUSE binding is only needed here: the rest of the package imports without it

    from tierfs.daemon.coordinator.engine import Engine
    from tierfs.daemon.fuse.operations import PASSTHROUGH, TierOperations

    # SIGHUP before serving (a first scan can take minutes) reopens the log too, instead of ending the process;
    # serving, _stop_on_signal takes it over (trio puts this handler back when it returns)
    signal.signal(signal.SIGHUP, _reopen_log_on_signal)
    tune_malloc()
    before, after = raise_fd_limit()
    if after != before:
        log.info("file descriptor limit raised from %d to %d", before, after)
    link = None
    if config.settings.peers == "mpi":
        from tierfs.daemon.staging.peers import detach_from_launcher, join_mpi_group

        try:
            link = join_mpi_group(config.settings.peer_addr)
        except (ValueError, OSError) as exc:
            raise MountError(str(exc)) from None
        detach_from_launcher(link)
        # (the rank and the job's size are MPI's: every node's plan is cut by them)
        config = dataclasses.replace(config, settings=dataclasses.replace(
            config.settings, rank=link.rank, world_size=link.world_size))
        log.info("peers: rank %d of %d, serving at %s:%d", link.rank, link.world_size, *link.addresses[link.rank])
    # held until the serving process ends (the fd is never closed): how `tierfs status` sees that a mount is
    # starting there while the first scan runs, without looking at other processes (tierfs.common.mountpoint_lock)
    hold_mountpoint(config.mountpoint)
    engine = Engine(config, link)

    def scanning(count: ScanCount) -> None:
        # a long first scan shows in ``systemctl status`` (and in the log every few seconds)
        sd_notify(f"STATUS={count.line()}")
        scan_progress(count)

    try:
        engine.open(scanning)
    except (ValueError, OSError) as exc:
        engine.close()
        raise MountError(str(exc)) from None
    trim_heap()  # (the scan's small pieces, freed in the middle of the heap: HeapTrimmer does it from now on)

    ops = TierOperations(engine)
    try:
        if config.settings.passthrough != "off" and PASSTHROUGH:  # (the kernel's answer: status.passthrough)
            pyfuse3.init(ops, config.mountpoint, fuse_options(config), passthrough=True)
        else:
            pyfuse3.init(ops, config.mountpoint, fuse_options(config))
    except RuntimeError as exc:
        engine.close()
        raise MountError(f"cannot mount on {config.mountpoint}: {exc}") from None
    conn = fuse_connection(config.mountpoint)  # ours: the topmost FUSE mount there, just made
    keep_idle_threads(IDLE_THREAD_S)
    try:
        trio.run(_serve, config, ops, pyfuse3, on_ready)
    finally:
        _free_stuck_kernel_call(ops.kernel, config.mountpoint, conn)
        try:
            pyfuse3.close(unmount=True)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOENT):
                log.warning("unmount: %s", exc)
        engine.close()
        log.info("unmounted %s", config.mountpoint)
