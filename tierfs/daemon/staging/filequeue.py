"""A queue of file indices that takes millions at once without a Python object per file.

A switch hands the stager and the pusher the next mini-epoch's files (up to millions), on the trio thread, while
every reader of the mount waits: a ``deque`` of them cost 0.1 s per million files there.  This queue keeps that
order as the array it came in, with a cursor, and the few files put before or after it (a changed file staged
next, a failed one retried later) in small deques.  It answers the ``deque`` methods its two users call.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

import numpy as np

__all__ = ["FileQueue"]


class FileQueue:
    def __init__(self, files: np.ndarray | None = None) -> None:
        self._front: deque[int] = deque()
        self._files = files if files is not None else np.zeros(0, np.int64)
        self._at = 0
        self._back: deque[int] = deque()

    def __len__(self) -> int:
        return len(self._front) + len(self._files) - self._at + len(self._back)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __iter__(self) -> Iterator[int]:
        yield from self._front
        yield from self._files[self._at:].tolist()
        yield from self._back

    def first(self) -> int:
        """The file at the front (IndexError when empty)."""
        if self._front:
            return self._front[0]
        if self._at < len(self._files):
            return int(self._files[self._at])
        return self._back[0]

    def popleft(self) -> int:
        if self._front:
            return self._front.popleft()
        if self._at < len(self._files):
            self._at += 1
            return int(self._files[self._at - 1])
        return self._back.popleft()

    def appendleft(self, fidx: int) -> None:
        self._front.appendleft(fidx)

    def extendleft(self, files: Iterable[int]) -> None:
        """As ``deque.extendleft``: each goes to the front in turn (so they end up in reverse order)."""
        self._front.extendleft(files)

    def append(self, fidx: int) -> None:
        self._back.append(fidx)
