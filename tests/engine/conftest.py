"""Engine tests: the tierfs engine and its FUSE operations called directly, without a mount (S3QL style).

``run(fn)`` drives an async test body with trio (pytest-trio is not used); ``open_engine`` builds an opened
:class:`Engine` over a small dataset; ``read_all`` opens and reads one file through the operations object the
way the kernel would.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

from tierfs.common.options import MountConfig, Settings
from tierfs.daemon.coordinator.engine import Engine
from tierfs.testing.harness import make_dataset


def run(fn: Callable[[], Awaitable[Any]]) -> Any:
    return trio.run(fn)


@pytest.fixture
def dataset(tmp_path):
    """4 class dirs x 8 files of 1..4096 bytes (total ~64 KiB): returns (backing path, {relpath: size})."""
    backing = tmp_path / "backing"
    files = make_dataset(backing, dirs=4, files_per_dir=8, max_size=4096, seed=3)
    return backing, files


@pytest.fixture
def open_engine(tmp_path, dataset):
    """Factory: ``open_engine(capacity=..., **settings)`` -> an opened Engine over ``dataset``; closed after."""
    backing, _ = dataset
    engines: list[Engine] = []

    def factory(capacity: int | None = None, *, cache: str | os.PathLike[str] | None = None,
                backing_dir: str | os.PathLike[str] | None = None, **settings: Any) -> Engine:
        # what the copies take on the cache disk (the cap counts allocated blocks, at least one per file)
        block = os.statvfs(tmp_path).f_frsize
        total = sum(max(block, -(-os.path.getsize(os.path.join(r, f)) // block) * block)
                    for r, _, fs in os.walk(backing_dir or backing) for f in fs)
        cfg = MountConfig(
            backing=os.fspath(backing_dir or backing),
            mountpoint=os.fspath(tmp_path / "mnt"),
            cache=os.fspath(cache or tmp_path / "cache"),
            capacity=capacity or int(total * 0.7),
            # revalidate=open: these tests change backing files and expect the next open to see it
            settings=Settings(**{"nm": 4, "rf": 2, "revalidate": "open", **settings}),
        )
        e = Engine(cfg)
        e.open()
        engines.append(e)
        return e

    yield factory
    for e in engines:
        e.close()


async def read_file(engine: Engine, fidx: int, chunk: int = 1 << 16) -> bytes:
    """Open, read to EOF and release one file through the engine (what a reader of the mount does)."""
    h = await engine.data.open_file(fidx)
    try:
        out = []
        off = 0
        while data := await engine.data.read(h, off, chunk):
            out.append(data)
            off += len(data)
        return b"".join(out)
    finally:
        await engine.data.release(h)


def backing_path(engine: Engine, fidx: int) -> str:
    """Where file ``fidx`` is in the engine's backing dir."""
    return os.path.join(engine.config.backing, os.fsdecode(engine.tree.file_path(fidx)))


def backing_bytes(engine: Engine, fidx: int) -> bytes:
    with open(backing_path(engine, fidx), "rb") as f:
        return f.read()


async def read_view(engine: Engine) -> int:
    """Read every file of the current view in serving order, checking bytes; returns how many were read."""
    assert engine.schedule.view is not None
    order = engine.schedule.view.order.tolist()
    for fidx in order:
        assert await read_file(engine, fidx) == backing_bytes(engine, fidx)
    return len(order)


async def settle(engine: Engine) -> None:
    """Wait until the next mini-epoch is known (its epoch planned by the engine's planner), the stager has
    nothing left to do (everything wanted is cached or failed) and the evicted copies are deleted."""
    for _ in range(2000):
        if engine.schedule.next_coords is not None and engine.stager.settled() and not engine.cache.deleting_bytes:
            return
        await trio.sleep(0.005)
    raise AssertionError("staging did not settle")


async def deleted(engine: Engine) -> None:
    """Wait until the copies evicted so far are deleted (the cache's deleting task unlinks them in a thread)."""
    for _ in range(2000):
        if not engine.cache.deleting_bytes:
            return
        await trio.sleep(0.005)
    raise AssertionError("evicted copies were not deleted")


def stage_all(engine: Engine) -> None:
    """Run the engine's background jobs until staging settles (the current and the next mini-epoch cached)."""

    async def main() -> None:
        async with trio.open_nursery() as n:
            await n.start(engine.run)
            await settle(engine)
            n.cancel_scope.cancel()

    run(main)


def read_passes(engine: Engine, passes: int) -> None:
    """Run the engine's background jobs while a reader reads ``passes`` whole passes (staging settled before
    each and after the last)."""

    async def main() -> None:
        async with trio.open_nursery() as n:
            await n.start(engine.run)
            for _ in range(passes):
                await settle(engine)
                await read_view(engine)
            await settle(engine)
            n.cancel_scope.cancel()

    run(main)


class Tools:
    """The helpers above, as one fixture (tests import nothing from conftest under --import-mode=importlib)."""

    run = staticmethod(run)
    read_file = staticmethod(read_file)
    read_view = staticmethod(read_view)
    settle = staticmethod(settle)
    deleted = staticmethod(deleted)
    stage_all = staticmethod(stage_all)
    read_passes = staticmethod(read_passes)
    backing_bytes = staticmethod(backing_bytes)
    backing_path = staticmethod(backing_path)


@pytest.fixture
def t() -> type[Tools]:
    return Tools
