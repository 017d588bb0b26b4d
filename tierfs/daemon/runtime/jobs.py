"""How the mount's background work runs: every job for the life of the mount, a failure logged and never a dead
mount (:func:`supervised`, :func:`once`), and the tasks a part starts while it serves (:class:`Background`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

__all__ = ["Background", "once", "supervised"]

log = logging.getLogger("tierfs")


class Background:
    """A part's tasks started while it serves requests (a copy made beside its reader, a close left until after a
    reply, an invalidation): they run in the nursery of :meth:`run`, which the engine starts for the life of the
    mount.  Without it (engine tests, before the mount runs) :meth:`start_soon` starts nothing and says so."""

    def __init__(self) -> None:
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None

    @property
    def running(self) -> bool:
        return self._nursery is not None

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> bool:
        """Start ``fn(*args)`` in the background; False (nothing started) while :meth:`run` does not run."""
        if self._nursery is None:
            return False
        self._nursery.start_soon(fn, *args)
        return True


async def supervised(name: str, task: Callable[[], Awaitable[None]], failures: dict[str, str] | None = None) -> None:
    """Run a background task for the life of the mount; a bug in it is logged and the task started again
    (after a second), never a dead mount: readers are served whether or not staging or pushing works.

    A task that keeps failing is said once, not every second: its first failure with the traceback, then a line
    a minute with the count.  While it fails, ``failures[name]`` says so (the engine shows it as
    ``status.last_error``); once a run of it has lasted a minute, that goes, and the log says it runs again."""
    quiet_s = 60.0  # a failing task is logged again at most this often; a run this long ends its failures
    failed = 0  # failures in a row
    said = -quiet_s  # (monotonic) when the last of them was logged

    async def forgive() -> None:
        nonlocal failed
        await trio.sleep(quiet_s)
        log.info("the %s runs again (after %d failures)", name, failed)
        failed = 0
        if failures is not None:
            failures.pop(name, None)

    while True:
        error: Exception | None = None
        async with trio.open_nursery() as nursery:
            if failed:
                nursery.start_soon(forgive)
            try:
                await task()
            except Exception as exc:
                error = exc
            nursery.cancel_scope.cancel()
        if error is None:  # (it returned: it works)
            failed = 0
            if failures is not None:
                failures.pop(name, None)
        else:
            cause: BaseException = error
            # (the one exception inside the task's own nurseries' groups: what went wrong, not "1 sub-exception";
            # Python 3.10 has no BaseExceptionGroup to test for)
            inner: tuple[object, ...] = getattr(cause, "exceptions", ())
            while len(inner) == 1 and isinstance(inner[0], BaseException):
                cause = inner[0]
                inner = getattr(cause, "exceptions", ())
            failed += 1
            why = f"{type(cause).__name__}: {cause}"
            if failures is not None:
                failures[name] = (f"the {name} failed{f' {failed} times in a row' if failed > 1 else ''} "
                                  f"(restarted every second): {why}")
            if failed == 1:
                log.error("the %s failed; restarting it", name, exc_info=error)
                said = time.monotonic()
            elif time.monotonic() - said >= quiet_s:
                log.error("the %s keeps failing (%d times in a row, restarted every second): %s", name, failed,
                          why)
                said = time.monotonic()
        await trio.sleep(1.0)


async def once(name: str, task: Callable[[], Awaitable[None]]) -> None:
    """A background job that runs once: a failure is logged, never a dead mount."""
    try:
        await task()
    except OSError as exc:  # a full or failing disk: said once, the mount goes on
        log.warning("the %s failed: %s", name, exc.strerror or exc)
    except ValueError:
        log.exception("the %s failed", name)
