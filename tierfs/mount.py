"""The life of a mount: open the engine, mount, serve until unmounted or signalled, unmount, persist.

The order matters and is the same in the foreground, under ``--daemon`` and under systemd:

1. ``Engine.open()`` scans the backing tree and refuses a configuration that cannot work *before* anything is
   mounted, so a bad setting never leaves a half-made mount behind;
2. ``pyfuse3.init`` mounts; ``pyfuse3.main`` serves; the engine's staging tasks run beside it in one nursery;
3. once a ``stat`` of ``/.tierfs/status`` comes back through the kernel, the mount answers: systemd gets
   ``READY=1`` and a ``--daemon`` parent gets its go-ahead, so neither reports ready too early;
4. SIGTERM, SIGINT or SIGHUP end the main loop; an external ``fusermount3 -u`` ends it too;
5. ``pyfuse3.close(unmount=True)`` always runs, then ``Engine.close()`` writes the journal, so a clean stop
   resumes exactly where it was.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import re
import signal
import socket
import sys
from collections.abc import Callable

import trio

from tierfs.options import MountConfig, format_size

log = logging.getLogger("tierfs")

__all__ = ["LOG_MAX_BYTES", "MountError", "RotatingLogHandler", "WholeLineHandler", "check_paths", "daemonize",
           "default_log_path", "fuse_options", "log_max_bytes", "raise_fd_limit", "run_mount", "sd_notify"]

#: A daemon's log file is rotated at this size: renamed to ``NAME.log.1`` (one old file kept, so the two never
#: take more than twice this); ``TIERFS_LOG_MAX`` in the environment sets another size (tests use a small one).
LOG_MAX_BYTES = 16 << 20


class MountError(Exception):
    """A failure to mount with a one-line reason for the user (exit status 1)."""


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


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
    if _inside(mountpoint, backing) or _inside(backing, mountpoint):
        raise MountError(f"mountpoint {mountpoint} and backing dir {backing} must not contain each other")
    if _inside(cache, backing):
        raise MountError(f"cache dir {cache} must not be inside the backing dir {backing} (it is never written)")
    if _inside(cache, mountpoint) or _inside(mountpoint, cache):
        raise MountError(f"cache dir {cache} and mountpoint {mountpoint} must not contain each other")
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
    # /proc/self/mounts writes blanks and backslashes in paths as octal escapes (\040)
    try:
        with open("/proc/self/mounts") as f:
            return any(_unescape(line.split()[1]) == path and line.split()[2].startswith("fuse") for line in f)
    except OSError:
        return False


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


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
    """A daemon's log file, whole lines, rotated by size.

    The file is the daemon's stdout and stderr too (:func:`daemonize`), so what does not go through logging --
    a traceback, a library's warning -- lands in it as well.  When a line takes it to ``max_bytes``, the file is
    renamed to ``path + ".1"`` (replacing the older one) and a fresh ``path`` takes its place on descriptors 1
    and 2; a rename that fails (a read-only dir) is tried again after another ``max_bytes``."""

    def __init__(self, path: str, max_bytes: int) -> None:
        super().__init__(sys.stderr.fileno())
        self.path = path
        self.max_bytes = max_bytes
        self.rotations = 0
        self._rotate_at = max_bytes

    def emit(self, record: logging.LogRecord) -> None:
        super().emit(record)
        try:
            size = os.fstat(self.fd).st_size
        except OSError:
            return
        if size >= self._rotate_at:
            self._rotate(size)

    def _rotate(self, size: int) -> None:
        try:
            os.replace(self.path, self.path + ".1")
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        except OSError:
            self._rotate_at = size + self.max_bytes
            return
        for target in (sys.stdout.fileno(), self.fd):
            os.dup2(fd, target)
        os.close(fd)
        self._rotate_at = self.max_bytes
        self.rotations += 1


def log_max_bytes() -> int:
    """The size a daemon's log is rotated at: ``TIERFS_LOG_MAX`` (a size, e.g. ``64K``) or :data:`LOG_MAX_BYTES`."""
    from tierfs.options import parse_size

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
    name = os.path.abspath(mountpoint).strip("/").replace("-", "--").replace("/", "-") or "root"
    return os.path.join(base, f"{name}.log")


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (services start at 1024; loaders hold thousands of
    files open); returns (before, after)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def daemonize(log_path: str) -> Callable[[str | None], None]:
    """Fork; the parent waits for the child to report and exits 0 (ready) or 1 (failed, reason on stderr).

    Returns, in the child, the function that reports: ``report(None)`` for ready, ``report("reason")`` for a
    failure.  The child starts a new session and sends its output to ``log_path``.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid > 0:
        os.close(write_end)
        chunks = []
        while chunk := os.read(read_end, 4096):
            chunks.append(chunk)
        message = b"".join(chunks).decode(errors="replace").strip()
        if message == "ready":
            os._exit(0)
        if not message:
            # The child died without a word; its log says why.
            _, status = os.waitpid(pid, 0)
            message = f"daemon exited with status {os.waitstatus_to_exitcode(status)} before the mount was ready " \
                      f"(see {log_path})"
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

    return report


async def _announce_when_answering(mountpoint: str, on_ready: Callable[[], None]) -> None:
    # The stat goes through the kernel to our own main loop, so it can only return once we are serving.
    await trio.to_thread.run_sync(os.stat, os.path.join(mountpoint, ".tierfs", "status"))
    log.info("mounted %s", mountpoint)
    sd_notify("READY=1\nSTATUS=serving")
    on_ready()


async def _stop_on_signal(cancel_scope: trio.CancelScope, pyfuse3) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("%s: unmounting", signal.Signals(signum).name)
            sd_notify("STOPPING=1")
            pyfuse3.terminate()
            cancel_scope.cancel()
            return


async def _serve(config: MountConfig, engine, pyfuse3, on_ready: Callable[[], None]) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signal, nursery.cancel_scope, pyfuse3)
        await nursery.start(engine.run)
        nursery.start_soon(_announce_when_answering, config.mountpoint, on_ready)
        # An external unmount makes main() return: then the staging tasks have nothing left to do.
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


_M_MMAP_THRESHOLD = -3  # mallopt parameters (glibc's malloc.h)
_M_ARENA_MAX = -8
_MMAP_THRESHOLD = 128 << 10  # glibc's default


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None  # not glibc: its own defaults


def tune_malloc() -> None:
    """Make freed numpy arrays leave the daemon's memory.  By default glibc serves an allocation of 128 KiB or
    more by a mapping of its own only until one is freed, then raises that threshold to the freed size (up to
    32 MiB): the scan's and each plan's temporaries -- tens of MB at a million files -- then come from the
    heap, and the holes they leave stay resident (~80 bytes a file after a first mount).  A fixed threshold
    keeps every big array in its own mapping, returned when freed; two arenas keep the worker threads'
    small allocations from spreading over one heap each."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
        libc.mallopt(_M_ARENA_MAX, 2)


def trim_malloc() -> None:
    """Give the heap's free pages back (after the scan: its small pieces are freed in the middle of the heap,
    where glibc never trims by itself)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def run_mount(config: MountConfig, *, on_ready: Callable[[], None] = lambda: None) -> None:
    """Mount and serve until unmounted or signalled.  Raises :class:`MountError` with a one-line reason."""
    import pyfuse3  # the FUSE binding is only needed here: the rest of the package imports without it

    from tierfs.engine import Engine
    from tierfs.fs import TierOperations

    tune_malloc()
    before, after = raise_fd_limit()
    if after != before:
        log.info("file descriptor limit raised from %d to %d", before, after)
    engine = Engine(config)
    try:
        # a long first scan shows in ``systemctl status`` (and in the log every few seconds)
        engine.open(lambda n, secs: sd_notify(f"STATUS=scanning the backing dir: {n:,} entries in {secs:.0f} s"))
    except (ValueError, OSError) as exc:
        engine.close()
        raise MountError(str(exc)) from None
    trim_malloc()

    ops = TierOperations(engine)
    try:
        pyfuse3.init(ops, config.mountpoint, fuse_options(config))
    except RuntimeError as exc:
        engine.close()
        raise MountError(f"cannot mount on {config.mountpoint}: {exc}") from None
    try:
        trio.run(_serve, config, engine, pyfuse3, on_ready)
    finally:
        try:
            pyfuse3.close(unmount=True)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOENT):
                log.warning("unmount: %s", exc)
        engine.close()
        log.info("unmounted %s", config.mountpoint)
