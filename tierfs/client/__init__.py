"""The client side of tierfs: everything that runs inside a user's training job, and the one way to read
``status`` and write ``control`` lines.

* :class:`Client` (here): a mount's control dir -- ``status``, ``metrics``, ``order``, the batch ``plan``,
  settings and commands written to ``control``, ``consumed`` reports;
* :mod:`tierfs.client.direct`: a cached copy opened directly (``open_cached``);
* :mod:`tierfs.client.loaders`: loaders on batch plans, no torch (``read_pass``, ``FileList``, ``PassIndices``);
* :mod:`tierfs.client.torch`: the PyTorch datasets and samplers (imports torch).

Users import the last three by their short names, ``tierfs.direct``, ``tierfs.loaders`` and ``tierfs.torch``:
each is a face that re-exports its module here.  The client side imports only :mod:`tierfs.common.protocol` (what the
mount and its clients agree on) and :mod:`tierfs.common.options`, never a daemon module: a training job loads neither
trio, pyfuse3 nor xxhash (tests/unit/test_layering.py).  Also used by ``tierfs status`` / ``tierfs set``, by the
test helper (``tierfs.testing.harness.Mounted``) and by dslide's feedback writer.

Writes are checked with the mount's own parser first (:func:`tierfs.common.protocol.parse_control`, against the
settings the mount reports), so a bad line fails here with the mount's message and never reaches it; each write
is one ``write(2)``, so a line is never split.

A client is made from any path that names the mount: the mountpoint, its ``.tierfs`` dir, a file in it (what
``dslide train --control MOUNT/.tierfs/control`` passes), or any path below the mountpoint.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tierfs.common.options import Settings, apply_assignments, parse_assignments
from tierfs.common.protocol import (
    CONTROL_DIR,
    CONTROL_FILES,
    CONTROL_WRITE_MAX,
    EMPTY_WRITE,
    Assignments,
    format_indices,
    parse_control,
    parse_plan,
)

__all__ = ["Client", "NotAMount", "find_mount"]

_REPORT_CHARS = CONTROL_WRITE_MAX // 4  # longest ``consumed`` write: far below FUSE's write size, so never split


class NotAMount(ValueError):
    """The path is not on a tierfs mount (no ``.tierfs/status`` above it)."""


def find_mount(path: str | os.PathLike[str]) -> Path:
    """The mountpoint of the tierfs mount that ``path`` names or lies in."""
    p = Path(os.path.abspath(path))
    if p.name in CONTROL_FILES and p.parent.name == CONTROL_DIR:
        p = p.parent
    if p.name == CONTROL_DIR:
        p = p.parent
    for candidate in (p, *p.parents):
        if (candidate / CONTROL_DIR / "status").exists():
            return candidate
    raise NotAMount(f"{path} is not a tierfs mount (no {CONTROL_DIR}/status)")


class Client:
    """Reads and writes a mount's control dir (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.mountpoint = find_mount(path)
        self.dir = self.mountpoint / CONTROL_DIR
        self._control_fd: int | None = None  # kept open for the next write (see write)

    def close(self) -> None:
        """Close the control file if a write left it open."""
        fd, self._control_fd = self._control_fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            self.close()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_control_fd": None}  # (a descriptor means nothing in another process)

    def _read(self, name: str) -> bytes:
        # 1 MiB reads: the files show size 0 (/proc style), so a plain read() would grow its buffer from 8 KiB,
        # one FUSE request per step; a plan is hundreds of KiB
        chunks = []
        with open(self.dir / name, "rb", buffering=0) as f:
            while chunk := f.read(1 << 20):
                chunks.append(chunk)
        return b"".join(chunks)

    def status(self) -> dict[str, Any]:
        """The status object (one consistent snapshot)."""
        status = json.loads(self._read("status"))
        if not isinstance(status, dict):
            raise ValueError(f"{self.dir}/status is not a JSON object")
        return status

    def metrics(self) -> str:
        return self._read("metrics").decode()

    def settings(self) -> dict[str, str]:
        """The settings in force, as the control file shows them (``KEY=VALUE``)."""
        return dict(parse_assignments(self._read("control").decode()))

    def order(self, *, nul: bool = False) -> list[bytes]:
        """The current pass's paths in serving order (``order0`` with ``nul``: every name, as it is)."""
        if nul:
            return self._read("order0").split(b"\0")[:-1]
        return self._read("order").splitlines()

    def plan(self) -> dict[str, Any]:
        """A batch plan of the current pass (see docs/tierfs.md, "Batch plans"): its copies stay pinned until the
        pass ends; report what was read from them with :meth:`consumed`.  ``PermissionError`` for other users."""
        return parse_plan(self._read("plan"), f"{self.dir}/plan")

    def consumed(self, plan_id: int, indices: list[int]) -> None:
        """Report direct reads of plan ``plan_id``'s copies (its file positions ``indices``); each counts as one
        open served from the cache, at most once per plan.  Long reports go in several writes of whole lines."""
        text = format_indices(indices)
        while text:
            # one line per write, well under a FUSE write's size, cut at a comma (never inside a number)
            cut = len(text) if len(text) <= _REPORT_CHARS else text.rindex(",", 0, _REPORT_CHARS)
            self.write(f"consumed {plan_id} {text[:cut]}", check=False)
            text = text[cut + 1:]

    def check(self, text: str) -> None:
        """``ValueError`` with the mount's own message if the mount would refuse ``text``."""
        parse_control(text, _as_settings(self.settings()))

    def write(self, text: str, *, check: bool = True) -> None:
        """Write ``text`` (lines of ``KEY=VALUE`` items or commands) in one ``write(2)``.

        ``ValueError`` if it is refused (checked here first, or EINVAL from the mount, with its ``last_error``);
        ``OSError`` for anything else."""
        if check:
            self.check(text)
        data = text.encode() if text.endswith("\n") else (text + "\n").encode()
        # The control file stays open for the next write (a loader reports every few dozen samples: an open and
        # a release per report were two of its three round trips); each write is still applied on its own.
        # (no O_TRUNC: the kernel would follow it with a GETATTR and a security xattr question)
        for attempt in (0, 1):
            if self._control_fd is None:
                self._control_fd = os.open(self.dir / "control", os.O_WRONLY | os.O_CLOEXEC)
            try:
                written = os.write(self._control_fd, data)
                break
            except OSError as exc:
                if exc.errno == errno.EINVAL:
                    raise ValueError(self.status().get("last_error") or "refused by the mount") from None
                self.close()
                if attempt or exc.errno not in (errno.ENOTCONN, errno.EBADF, errno.ENODEV):
                    raise  # (once more with a fresh open only if the one kept belonged to an older mount)
        if written != len(data):
            raise OSError(errno.EIO, f"{self.dir}/control: short write ({written} of {len(data)} bytes)")

    def set(self, assignments: Assignments, shown: dict[str, str], commands: Sequence[str] = ()) -> dict[str, str]:
        """Write ``assignments`` and then ``commands`` (``next-pass``, ``advance``) in one write, checked against
        ``shown`` (the settings :meth:`settings` read: no second read); returns the settings the control file
        shows after it.  ``ValueError`` with the mount's message if it would refuse them (nothing written)."""
        after = assignments.applied_to(_as_settings(shown))
        if not (assignments.items or commands):
            raise ValueError(EMPTY_WRITE)
        self.write(assignments.lines() + "".join(f"{c}\n" for c in commands), check=False)
        return after.as_items()


def _as_settings(shown: dict[str, str]) -> Settings:
    """The settings a control file shows, as the mount holds them."""
    return apply_assignments(Settings(), shown.items(), live_only=False)
