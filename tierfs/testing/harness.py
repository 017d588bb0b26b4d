"""Mount tierfs in a subprocess and always clean up: for tests, benchmarks and the demo.

``mounted()`` starts ``python -m tierfs mount ...`` in the foreground, waits until ``/.tierfs/status`` answers
(or the process dies, which raises with its stderr), yields, and on the way out sends SIGTERM, waits, kills if
it must, and lazily unmounts (``fusermount3 -uz``) whatever is left -- a failing test never leaves a mount or
a process behind.  ``synthetic_tree()`` makes a tree of millions of files from arrays, with no file behind
them: engine tests and benchmarks resume an engine over it (its ``tree.bin`` in the cache dir) at that scale.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pty
import random
import select
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tierfs.client import Client
from tierfs.common.mountinfo import mount_at
from tierfs.daemon.fuse.mount import abort_connection as abort_fuse_connection
from tierfs.daemon.fuse.mount import fuse_connection

if TYPE_CHECKING:
    from tierfs.daemon.tree.tree import Tree

__all__ = ["ImageFolderLike", "Mounted", "PassthroughMount", "abort_connection", "force_unmount", "in_pty",
           "is_mounted", "mounted", "passthrough", "read_bytes", "snapshot", "synthetic_tree", "wait_until"]


def is_mounted(path: str | os.PathLike[str]) -> bool:
    return mount_at(path) is not None


def within(mnt: str, fn: Callable[[], object], seconds: float = 20.0) -> object:
    """``fn()`` (its result, or the OSError it raised) in a thread; one still running after ``seconds`` is a
    hang: the FUSE connection of ``mnt`` is aborted (so it lets go) and ``AssertionError`` fails the test."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except OSError as exc:
            out.append(exc)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(seconds)
    if th.is_alive():
        abort_connection(mnt)
        th.join(10)
        raise AssertionError(f"an operation on {mnt} hung for more than {seconds} s (connection aborted)")
    return out[0]


def process_cpu(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of process ``pid`` so far (all its threads), from ``/proc/PID/stat``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def wait_until(pred: Callable[[], object], timeout: float = 30.0, what: str = "the condition") -> None:
    """Poll ``pred`` every 20 ms until it is true; ``AssertionError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.02)


def abort_connection(path: str | os.PathLike[str], connection: str | None = None) -> bool:
    """Abort the FUSE connection of the mount at ``path``, or ``connection`` (its fusectl name, see
    :attr:`Mounted.connection`: the only handle left once a daemon lazily unmounted): every request waiting on
    its daemon fails, so a hung mount lets go of its readers.  True if aborted.  As root, mounts fusectl first
    where it is missing (systemd mounts it at boot; a container may not)."""
    fusectl = "/sys/fs/fuse/connections"
    if os.geteuid() == 0 and os.path.isdir(fusectl) and not is_mounted(fusectl):
        subprocess.run(["mount", "-t", "fusectl", "fusectl", fusectl], capture_output=True, check=False)
    return abort_fuse_connection(os.path.realpath(path), connection)


def force_unmount(path: str | os.PathLike[str]) -> None:
    """Lazy unmount if still mounted; never raises."""
    if is_mounted(path):
        subprocess.run(["fusermount3", "-uz", os.fspath(path)], capture_output=True, check=False)


def end_mount_job(job: Any, mountpoints: Sequence[str | os.PathLike[str]]) -> None:
    """Stop ``job`` (a :class:`dslide.mpirun.MpiJob` of daemons: every process it started, by pid) and take down
    every mount it left: aborted (a daemon killed mid-request leaves its readers waiting), then unmounted."""
    job.stop()
    for m in mountpoints:
        if is_mounted(m):
            abort_connection(m)
        force_unmount(m)
    job.__exit__(None, None, None)


@dataclass
class Mounted:
    """A live mount: its paths and the daemon process."""

    mountpoint: str
    backing: str
    cache: str
    process: subprocess.Popen[bytes]
    stderr_path: str
    connection: str | None = None  # its fusectl name (/sys/fs/fuse/connections/NAME), read once mounted

    def path(self, *parts: str) -> str:
        return os.path.join(self.mountpoint, *parts)

    def status(self) -> dict:
        return Client(self.mountpoint).status()

    def control(self, text: str) -> None:
        """Write ``text`` to the control file in one write, unchecked, so a test sees what the mount does with
        it (``OSError`` EINVAL on bad input)."""
        fd = os.open(self.path(".tierfs", "control"), os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)

    def stderr(self) -> str:
        with open(self.stderr_path, errors="replace") as f:
            return f.read()


class InPty:
    """A command whose stdin, stdout and stderr are a terminal (a pty), as a person runs it (:func:`in_pty`)."""

    def __init__(self, cmd: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        self._master, slave = pty.openpty()
        self.process = subprocess.Popen(list(cmd), stdin=slave, stdout=slave, stderr=slave, close_fds=True,
                                        env={**os.environ, **(env or {})})
        os.close(slave)
        self.output = b""

    def read(self, until: bytes | None = None, timeout: float = 60.0) -> bytes:
        """What the terminal has shown so far, once ``until`` is in it, or once the command and every process
        holding the terminal have ended (``until`` None); ``TimeoutError`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        while until is None or until not in self.output:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"waited {timeout} s for {until!r}; the terminal showed {self.output[-2000:]!r}")
            if select.select([self._master], [], [], min(left, 0.5))[0]:
                try:
                    chunk = os.read(self._master, 1 << 16)
                except OSError:  # EIO: no process holds the terminal any more
                    chunk = b""
                if not chunk:
                    break
                self.output += chunk
        return self.output

    def close(self, timeout: float = 30.0) -> None:
        """SIGTERM the command if it still runs (SIGKILL after ``timeout``), and close the terminal."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        os.close(self._master)


@contextlib.contextmanager
def in_pty(cmd: Sequence[str], env: Mapping[str, str] | None = None) -> Iterator[InPty]:
    """Run ``cmd`` on a terminal of its own, to see what a person sees (progress bars draw only on terminals)."""
    run = InPty(cmd, env)
    try:
        yield run
    finally:
        run.close()


def _args(options: Mapping[str, object]) -> list[str]:
    out: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is not None and value is not False:
            out += [flag, str(value)]
    return out


@contextlib.contextmanager
def mounted(backing: str | os.PathLike[str], mountpoint: str | os.PathLike[str], cache: str | os.PathLike[str],
            capacity: int | str, *, timeout: float = 30.0, env: Mapping[str, str] | None = None,
            wrapper: Sequence[str] = (), **options: object) -> Iterator[Mounted]:
    """Mount tierfs (foreground subprocess); ``options`` are mount options, e.g. ``rf=4, nm=8``; ``wrapper``
    runs the daemon under a command, e.g. ``("prlimit", "--nofile=256:4096")``.  ``TIERFS_TEST_PASSTHROUGH`` in
    the environment is the ``passthrough`` of every mount that names none (a suite run with ``all``: every
    cached open in passthrough)."""
    mountpoint, backing, cache = os.fspath(mountpoint), os.fspath(backing), os.fspath(cache)
    if "passthrough" not in options and os.environ.get("TIERFS_TEST_PASSTHROUGH"):
        options = {**options, "passthrough": os.environ["TIERFS_TEST_PASSTHROUGH"]}
    cmd = [*wrapper, sys.executable, "-m", "tierfs", "mount", backing, mountpoint, "--cache", cache,
           "--capacity", str(capacity), *_args(options)]
    errfile = tempfile.NamedTemporaryFile(prefix="tierfs-stderr-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=errfile, stderr=errfile,
                            env={**os.environ, **(env or {})})
    m = Mounted(mountpoint, backing, cache, proc, errfile.name)
    try:
        deadline = time.monotonic() + timeout
        status = os.path.join(mountpoint, ".tierfs", "status")
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tierfs exited with {proc.returncode} before mounting: {m.stderr().strip()}")
            if is_mounted(mountpoint) and os.path.exists(status):
                m.connection = fuse_connection(os.path.realpath(mountpoint))
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"tierfs did not mount within {timeout} s: {m.stderr().strip()}")
            time.sleep(0.05)
        yield m
    finally:
        if proc.poll() is not None and proc.returncode != 0:
            # the daemon died under the test: show why (pytest prints captured stderr of a failing test)
            print(f"tierfs daemon exited with {proc.returncode}:\n{m.stderr()[-5000:]}", file=sys.stderr)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                # a daemon that does not stop may be stuck in the kernel: abort its connection to free it
                abort_connection(mountpoint, m.connection)
                proc.kill()
                proc.wait(timeout=10)
        if is_mounted(mountpoint):
            abort_connection(mountpoint, m.connection)
        force_unmount(mountpoint)
        log = m.stderr()
        if "Traceback" in log:  # a bug in the daemon, even one it survived: show it with the test's output
            print(f"tierfs daemon log:\n{log[-8000:]}", file=sys.stderr)
        errfile.close()
        with contextlib.suppress(OSError):
            os.unlink(errfile.name)


@dataclass
class PassthroughMount:
    """A read-only passthrough FUSE mount of ``source`` at ``mountpoint`` (:mod:`tierfs.testing.mirrorfs`): a backing
    dir whose daemon a test can kill (its mount then answers ENOTCONN) and start again at the same path.
    ``hang``: a file listing paths (relative to ``source``, one a line) whose opens do not answer while they are
    listed (a line ``.``: nor does ``statfs``; ``read:PATH``: its reads past the first byte).  ``count``: a file
    that holds the bytes its reads served so far (:meth:`served`).  ``renumber``: new inode numbers after each
    forget and each start (sshfs without ``noforget``)."""

    source: str
    mountpoint: str
    hang: str | None = None
    count: str | None = None
    renumber: bool = False
    process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> None:
        """Start the daemon and wait until the mount answers (``fusermount3 -uz`` a dead one first)."""
        if self.process is not None and self.process.stderr is not None:
            self.process.stderr.close()  # (the daemon before, killed)
        cmd = [sys.executable, "-m", "tierfs.testing.mirrorfs", self.source, self.mountpoint]
        if self.hang is not None:
            cmd += ["--hang", self.hang]
        if self.count is not None:
            cmd += ["--count", self.count]
        if self.renumber:
            cmd.append("--renumber")
        self.process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while not is_mounted(self.mountpoint):
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                raise RuntimeError(f"passthrough exited with {self.process.returncode}: {err}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"passthrough did not mount {self.mountpoint} within {timeout} s")
            time.sleep(0.02)

    def served(self) -> int:
        """The bytes the daemon's reads served so far (needs ``count``)."""
        assert self.count is not None
        try:
            with open(self.count) as f:
                return int(f.read() or 0)
        except FileNotFoundError:
            return 0

    def kill(self) -> None:
        """SIGKILL the daemon: its mount stays, and answers every call with ENOTCONN (a crashed sshfs)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def unmount(self) -> None:
        """Detach the mount (lazily: a dead one cannot be unmounted otherwise), leaving the empty mountpoint."""
        force_unmount(self.mountpoint)


@contextlib.contextmanager
def passthrough(source: str | os.PathLike[str], mountpoint: str | os.PathLike[str], *,
                hang: str | None = None, count: str | None = None,
                renumber: bool = False) -> Iterator[PassthroughMount]:
    """Mount a :class:`PassthroughMount`; on the way out kill it, abort its connection and unmount it."""
    pt = PassthroughMount(os.path.realpath(source), os.path.realpath(mountpoint), hang, count, renumber)
    try:
        pt.start()
        yield pt
    finally:
        if pt.process is not None and pt.process.poll() is None:
            pt.process.terminate()
            try:
                pt.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pt.process.kill()
                pt.process.wait(timeout=10)
        if is_mounted(pt.mountpoint):
            abort_connection(pt.mountpoint)
        pt.unmount()
        if pt.process is not None and pt.process.stderr is not None:
            pt.process.stderr.close()


def read_bytes(path: str) -> bytes:
    """A file's bytes: the ``loader`` of :class:`ImageFolderLike` (a plain function, as ImageFolder's is)."""
    with open(path, "rb") as f:
        return f.read()


class ImageFolderLike:
    """torchvision's ImageFolder rules, for the loader tests (torchvision does not import beside the project's
    torch): sorted class folders, ``samples`` of ``(path, class)``, a file read with ``self.loader(path)``
    (``loader=False``: none, the bytes read directly); an item is (index, class, the file's bytes)."""

    def __init__(self, root: str, loader: bool = True) -> None:
        self.classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        self.samples = [(os.path.join(root, c, f), i) for i, c in enumerate(self.classes)
                        for f in sorted(os.listdir(os.path.join(root, c)))]  # fmt: skip
        if loader:
            self.loader = read_bytes

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[int, int, bytes]:
        path, label = self.samples[i]
        return i, label, self.loader(path) if hasattr(self, "loader") else read_bytes(path)


def make_dataset(root: str | os.PathLike[str], *, dirs: int = 4, files_per_dir: int = 8, min_size: int = 1,
                 max_size: int = 64 << 10, seed: int = 0) -> dict[str, int]:
    """Write a small class-folder dataset of random bytes under ``root``; returns ``{relpath: size}``.

    Names are ``class_DDD/file_FFFFF.bin``; sizes are uniform in ``[min_size, max_size]``; same seed, same bytes.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    out: dict[str, int] = {}
    for d in range(dirs):
        cls = os.path.join(os.fspath(root), f"class_{d:03d}")
        os.makedirs(cls, exist_ok=True)
        for i in range(files_per_dir):
            size = int(rng.integers(min_size, max_size + 1))
            rel = f"class_{d:03d}/file_{i:05d}.bin"
            with open(os.path.join(cls, f"file_{i:05d}.bin"), "wb") as f:
                f.write(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
            out[rel] = size
    return out


def make_tar_shards(backing: str | os.PathLike[str], shards: int, seed: int) -> dict[str, dict[str, bytes]]:
    """Write ``shard-NNNNNN.tar`` files (with tarfile) of samples in webdataset's naming (``KEY.cls``,
    ``KEY.bin``), of different sizes; returns {shard name: {member name: bytes}}."""
    rnd = random.Random(seed)
    os.makedirs(backing, exist_ok=True)
    made = {}
    for s in range(shards):
        members = {}
        for i in range(rnd.randint(3, 8)):
            key = f"s{s:03d}_{i:03d}"
            members[f"{key}.cls"] = str(rnd.randrange(10)).encode()
            members[f"{key}.bin"] = rnd.randbytes(rnd.randint(1, 12 << 10))
        name = f"shard-{s:06d}.tar"
        with tarfile.open(os.path.join(backing, name), "w") as tar:
            for member, data in members.items():
                info = tarfile.TarInfo(member)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        made[name] = members
    return made


def make_parquet_files(backing: str | os.PathLike[str], files: int,
                       seed: int) -> dict[str, list[tuple[int, int, bytes]]]:
    """Write ``part-NNNNN.parquet`` files of rows (id, label, payload); returns {file name: rows}."""
    import pyarrow as pa  # (the test extra's)
    import pyarrow.parquet as pq

    rnd = random.Random(seed)
    os.makedirs(backing, exist_ok=True)
    made, next_id = {}, 0
    for f in range(files):
        rows = []
        for _ in range(rnd.randint(20, 120)):
            rows.append((next_id, rnd.randrange(10), rnd.randbytes(rnd.randint(1, 400))))
            next_id += 1
        name = f"part-{f:05d}.parquet"
        table = pa.table({"id": [r[0] for r in rows], "label": [r[1] for r in rows], "payload": [r[2] for r in rows]})
        pq.write_table(table, os.path.join(backing, name), row_group_size=32)
        made[name] = rows
    return made


def synthetic_tree(root: str | os.PathLike[str], *, dirs: int, per_dir: int, size: int) -> Tree:
    """A tree of ``dirs`` x ``per_dir`` files of ``size`` bytes made from arrays, no file behind them, rooted at
    the real directory ``root`` (a saved tree is loaded only for the root it was saved for).  Save it as the
    cache dir's ``tree.bin`` (``opening.TREE_NAME``) beside a journal and an engine opened on that cache resumes
    over it.  Built through the scan's own assembly (``tree._Scan``), as a scan of such a tree would be."""
    import numpy as np

    from tierfs.daemon.tree.tree import KIND_DIR, KIND_FILE, _Batch, _Scan, path_hash

    root_st = os.stat(root)
    scan = _Scan(root_st, frozenset())
    t = 1_700_000_000 * 10**9

    def batch(names: list[bytes], kind: int, mode: int, first_ino: int, hashes: np.ndarray) -> _Batch:
        k = len(names)
        columns = np.tile(np.array([size if kind == KIND_FILE else 4096, -(-size // 512), t, t], np.int64), (k, 1))
        return _Batch(names, np.full(k, kind, np.int8), [(mode, 1, 0, 0, 0)], np.zeros(k, np.int32),
                      np.arange(first_ino, first_ino + k, dtype=np.uint64), columns, hashes)

    dir_names = [b"d%05d" % d for d in range(dirs)]
    scan.add(0, b"", batch(dir_names, KIND_DIR, 0o040755, 1 << 32, np.zeros(dirs, np.uint64)))
    scan.levels.append(scan.count)
    for d, dname in enumerate(dir_names):
        names = [b"f%08d.bin" % (d * per_dir + i) for i in range(per_dir)]
        hashes = np.fromiter((path_hash(dname + b"/" + n) for n in names), np.uint64, per_dir)
        scan.add(1 + d, dname + b"/", batch(names, KIND_FILE, 0o100644, (1 << 33) + d * per_dir, hashes))
    scan.levels.append(scan.count)
    return scan.tree()



def snapshot(root: str | os.PathLike[str]) -> dict[str, bytes | str]:
    """Every entry under ``root`` (symlinks not followed): file bytes, link texts (``"-> TEXT"``), ``"dir"``: what
    a test compares before and after to show that nothing under ``root`` changed."""
    out: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = "-> " + os.readlink(p)
            elif os.path.isdir(p):
                out[rel] = "dir"
            else:
                with open(p, "rb") as f:
                    out[rel] = f.read()
    return out


#: the scan in a fresh interpreter set up as the daemon is (its modules imported, malloc tuned): one JSON line
_SCAN_MEMORY = """
import json, os, sys
import pyfuse3, trio  # noqa: F401  (what the daemon has loaded when it scans)
import tierfs.daemon.coordinator.engine, tierfs.daemon.fuse.operations  # noqa: F401
from tierfs.daemon.runtime.memory import trim_heap, tune_malloc
from tierfs.daemon.tree.tree import Tree
tune_malloc()
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
trim_heap()
before = status("VmRSS")
tree = Tree.scan(fd, sys.argv[1])
peak = status("VmHWM")
trim_heap()
print(json.dumps({"files": tree.n_files, "before": before, "peak": peak, "after": status("VmRSS")}))
"""


def scan_memory(root: str | os.PathLike[str], timeout: float = 600.0) -> dict[str, int]:
    """What scanning ``root`` costs a process set up as the daemon is: ``files``; ``before`` (RSS before the
    scan), ``peak`` (the process's high-water mark) and ``after`` (RSS with the tree made), in bytes."""
    out = subprocess.run([sys.executable, "-c", _SCAN_MEMORY, os.fspath(root)], capture_output=True, text=True,
                         check=True, timeout=timeout)
    return json.loads(out.stdout)
