"""A job that loops over collectives until one rank fails in the way ``MODE`` names.

``python failure.py MODE VICTIM PIDDIR``: every rank writes ``PIDDIR/rank-R.pid`` and then loops; the
victim rank, after a few steps,

- ``raise``:   raises inside :func:`abort_on_failure` (the CLI edge);
- ``hook``:    raises outside it, so only the ``sys.excepthook`` installed by ``get_comm`` can end the job;
- ``exit``:    calls ``sys.exit(3)`` (a handled runtime error on one rank only);
- ``compute``: raises while every other rank is busy computing, not waiting in a collective;
- ``wait``:    does nothing special: the test kills it (SIGKILL) from outside.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

from dslide.mpicomm import abort_on_failure, get_comm


def step(comm, i: int) -> None:
    local = np.full((4, 3), float(comm.rank + i), dtype=np.float32)
    hidden = comm.allgather(local)
    comm.allreduce_sum(hidden)


def main(comm, mode: str, victim: int) -> None:
    for i in range(1_000_000):
        if comm.rank == victim and i == 20:
            if mode in ("raise", "hook"):
                raise RuntimeError(f"injected failure on rank {comm.rank}")
            if mode == "exit":
                sys.exit(3)
            if mode == "compute":
                time.sleep(1.0)  # let the others get deep into their computation first
                raise RuntimeError("injected failure while the others compute")
        if mode == "compute" and comm.rank != victim and i == 20:
            deadline = time.monotonic() + 3600
            while time.monotonic() < deadline:  # a long stretch with no MPI call at all
                sum(range(10_000))
        step(comm, i)
        time.sleep(0.01)


if __name__ == "__main__":
    mode, victim, piddir = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    comm = get_comm()
    (piddir / f"rank-{comm.rank}.pid").write_text(str(os.getpid()))
    if mode == "hook":
        main(comm, mode, victim)
    else:
        with abort_on_failure(comm, prog="failure"):
            main(comm, mode, victim)
