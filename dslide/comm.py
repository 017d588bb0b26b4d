"""The communication edge of the trainer: the model calls these collectives and nothing else.

:class:`SerialComm` is the one-process implementation (no MPI import at all); the MPI implementation lives in
:mod:`dslide.mpicomm`.  Every collective counts the bytes this rank sends, so the JSON output and the
benchmarks can report exact communication per step.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

__all__ = ["Comm", "SerialComm"]


class Comm(Protocol):
    rank: int
    size: int
    bytes_sent: int

    def allgather(self, local: np.ndarray) -> np.ndarray:
        """Concatenate every rank's ``local`` along axis 1 (rank order); shapes differ only on axis 1."""
        ...

    def allreduce_sum(self, buf: np.ndarray) -> np.ndarray:
        """Element-wise sum over ranks (a new array)."""
        ...

    def allreduce_max(self, buf: np.ndarray) -> np.ndarray:
        """Element-wise max over ranks (a new array)."""
        ...

    def bcast(self, obj: object, root: int = 0) -> object:
        """``obj`` from ``root`` on every rank (small Python objects: seeds, file lists)."""
        ...

    def barrier(self) -> None: ...

    def node_comm(self) -> Comm:
        """The ranks on this rank's node (its rank 0 reads the node's files for them: ``--read node``)."""
        ...

    def abort(self, code: int = 1) -> None:
        """End the whole job now (every rank), with exit status ``code``."""
        ...


class SerialComm:
    """One process: every collective is the identity and sends nothing."""

    rank = 0
    size = 1

    def __init__(self) -> None:
        self.bytes_sent = 0

    def allgather(self, local: np.ndarray) -> np.ndarray:
        return np.array(local, copy=True)

    def allreduce_sum(self, buf: np.ndarray) -> np.ndarray:
        return np.array(buf, copy=True)

    def allreduce_max(self, buf: np.ndarray) -> np.ndarray:
        return np.array(buf, copy=True)

    def bcast(self, obj: object, root: int = 0) -> object:
        return obj

    def barrier(self) -> None:
        pass

    def node_comm(self) -> Comm:
        return self

    def abort(self, code: int = 1) -> None:
        raise SystemExit(code)
