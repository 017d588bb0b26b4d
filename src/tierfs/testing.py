"""Mount tierfs in a subprocess and always clean up: for tests, benchmarks and the demo.

``mounted()`` starts ``python -m tierfs mount ...`` in the foreground, waits until ``/.tierfs/status`` answers
(or the process dies, which raises with its stderr), yields, and on the way out sends SIGTERM, waits, kills if
it must, and lazily unmounts (``fusermount3 -uz``) whatever is left -- a failing test never leaves a mount or
a process behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

__all__ = ["Mounted", "force_unmount", "is_mounted", "mounted"]


def is_mounted(path: str | os.PathLike[str]) -> bool:
    path = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == path for line in f)


def force_unmount(path: str | os.PathLike[str]) -> None:
    """Lazy unmount if still mounted; never raises."""
    if is_mounted(path):
        subprocess.run(["fusermount3", "-uz", os.fspath(path)], capture_output=True, check=False)


@dataclass
class Mounted:
    """A live mount: its paths and the daemon process."""

    mountpoint: str
    backing: str
    cache: str
    process: subprocess.Popen[bytes]
    stderr_path: str

    def path(self, *parts: str) -> str:
        return os.path.join(self.mountpoint, *parts)

    def status(self) -> dict:
        with open(self.path(".tierfs", "status"), "rb") as f:
            return json.loads(f.read())

    def control(self, text: str) -> None:
        """Write ``text`` to the control file in one write (raises ``OSError`` with EINVAL on bad input)."""
        fd = os.open(self.path(".tierfs", "control"), os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)

    def stderr(self) -> str:
        with open(self.stderr_path, errors="replace") as f:
            return f.read()


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
            **options: object) -> Iterator[Mounted]:
    """Mount tierfs (foreground subprocess); ``options`` are mount options, e.g. ``rf=4, nm=8``."""
    mountpoint, backing, cache = os.fspath(mountpoint), os.fspath(backing), os.fspath(cache)
    cmd = [sys.executable, "-m", "tierfs", "mount", backing, mountpoint, "--cache", cache,
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
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"tierfs did not mount within {timeout} s: {m.stderr().strip()}")
            time.sleep(0.05)
        yield m
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        force_unmount(mountpoint)
        errfile.close()
        with contextlib.suppress(OSError):
            os.unlink(errfile.name)


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
