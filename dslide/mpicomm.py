"""The MPI implementation of :class:`dslide.comm.Comm`, the launch detection, and the job's failure edge.

Every collective uses mpi4py's buffer methods (``Allgatherv``, ``Allreduce``, ``Bcast``) on numpy arrays, so
nothing is pickled on the hot path.  :func:`get_comm` picks the implementation: a process that ``mpiexec``
did not start, or a job of one rank, gets :class:`~dslide.comm.SerialComm` and never imports mpi4py.

Byte accounting
---------------
``bytes_sent`` counts the payload bytes *this rank* sends, as the bandwidth-optimal ring algorithms would
send them.  It is exact for that model and independent of the algorithm MPICH happens to pick for a message
size (recursive doubling, Bruck and Rabenseifner send the same total per rank for equal blocks and a
power-of-two P); headers, acknowledgements and shared-memory copies are not counted.  The same model gives
the data-parallel baseline (:func:`dataparallel_allreduce_bytes`), so the two figures compare like with like.

- ``allgather`` of blocks ``b_0 .. b_{P-1}`` (bytes, total ``T``): in step ``s`` rank ``r`` forwards block
  ``r - s`` to ``r + 1``, so it sends every block but ``b_{r+1}``: ``T - b_{(r+1) mod P}``, which is
  ``(P-1)/P x T`` for equal blocks.  The block widths themselves travel first, as an allgather of one int64
  per rank: ``8 (P-1)`` bytes more.
- ``allreduce`` of ``n`` elements: a ring reduce-scatter over chunks ``c_0 .. c_{P-1}`` (``n // P``, the first
  ``n % P`` one element longer) sends every chunk but ``c_{r+1}``, the ring allgather of the reduced chunks
  every chunk but ``c_{r+2}``: ``(2n - c_{(r+1) mod P} - c_{(r+2) mod P}) x itemsize``, i.e. ``2(P-1)/P`` of
  the buffer.
- ``bcast`` of a pickled object of ``m`` bytes: a binomial tree; a rank sends ``8 + m`` bytes (length, then
  payload) to each of its children.  Only what rank 0 reads goes this way -- each pass's file list and the
  parsed points of each file -- never anything inside a training step.
- ``barrier`` sends no payload.

Failure
-------
An exception in one rank must end the whole job: otherwise the rank exits, MPICH's ``MPI_Finalize`` waits
for the others and they wait in their next collective forever.  :func:`ends_job_on_failure` (on the CLI's
``main``: a non-zero exit status too), :func:`abort_on_failure` (a ``with`` block) and the ``sys.excepthook``
that :func:`get_comm` installs turn a failure on one rank into ``MPI_Abort`` of all.  A rank
that *dies* (SIGKILL, OOM killer) is handled by Hydra, which kills the other ranks and exits non-zero at once;
if ``mpiexec`` or its proxy dies instead, ``PR_SET_PDEATHSIG`` ends the orphaned ranks.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, ParamSpec

import numpy as np

from dslide.comm import Comm, SerialComm

__all__ = [
    "MpiComm",
    "abort_on_failure",
    "dataparallel_allreduce_bytes",
    "ends_job_on_failure",
    "get_comm",
    "launched_by_mpi",
    "ring_allgather_bytes",
    "ring_allreduce_bytes",
    "threads_per_rank",
    "tree_bcast_children",
]

# Environment variables a process manager sets in every rank: MPICH/Hydra and Intel MPI (PMI), Open MPI,
# PMIx launchers (Slurm's srun --mpi=pmix).  The value is the job size.
_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")
_INT64 = 8
P = ParamSpec("P")


# -- the accounting model (pure functions, tested without MPI) ---------------------------------------------


def ring_allgather_bytes(block_bytes: list[int] | np.ndarray, rank: int) -> int:
    """Bytes ``rank`` sends in a ring allgather of blocks of ``block_bytes`` (rank order)."""
    size = len(block_bytes)
    if size == 1:
        return 0
    return int(sum(block_bytes)) - int(block_bytes[(rank + 1) % size])


def ring_allreduce_bytes(count: int, itemsize: int, size: int, rank: int) -> int:
    """Bytes ``rank`` sends in a ring allreduce (reduce-scatter, then allgather) of ``count`` elements."""
    if size == 1:
        return 0
    base, extra = divmod(count, size)

    def chunk(i: int) -> int:
        return base + (1 if i < extra else 0)

    return (2 * count - chunk((rank + 1) % size) - chunk((rank + 2) % size)) * itemsize


def dataparallel_allreduce_bytes(model_bytes: int, size: int) -> float:
    """Bytes per rank per step of a data-parallel ring allreduce of the whole model: ``2(P-1)/P x bytes``."""
    return 2.0 * (size - 1) / size * model_bytes


def tree_bcast_children(rank: int, size: int, root: int = 0) -> int:
    """How many ranks ``rank`` sends to in a binomial-tree broadcast from ``root`` (MPICH's tree)."""
    relative = (rank - root) % size
    children = 0
    mask = 1
    # A rank receives from the rank that differs in its lowest set bit and sends to relative + 2**k for
    # every 2**k below that bit (every 2**k for the root) that exists.
    while mask < size:
        if relative & mask:
            break
        if relative + mask < size:
            children += 1
        mask <<= 1
    return children


# -- launch detection ----------------------------------------------------------------------------------------


def launched_by_mpi() -> int:
    """The job size a process manager announced in the environment, or 0 when none started this process."""
    for name in _SIZE_VARIABLES:
        value = os.environ.get(name)
        if value:
            try:
                return int(value)
            except ValueError:
                continue
    return 0


def threads_per_rank() -> int | None:
    """The default HOGWILD threads of one rank: this node's cores shared among its ranks, so ``mpiexec -n 2``
    on 2 cores runs 2 x 1 threads, not 2 x 2.  None outside MPI (then all cores are the process's)."""
    local = os.environ.get("MPI_LOCALNRANKS") or os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    if launched_by_mpi() <= 1 or not local or not local.isdigit():
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, int(local)))


_JOB: MpiComm | None = None  # this process's communicator once get_comm made one


def get_comm() -> Comm:
    """The communicator for this process: :class:`MpiComm` in a job of two or more ranks, else SerialComm.

    Outside ``mpiexec`` (or with ``-n 1``) mpi4py is never imported, so one process needs no MPI library at
    all.  In a real job this also installs the failure handling described in the module docstring.  Every
    call returns the same MpiComm, so byte counts accumulate in one place.
    """
    global _JOB
    if _JOB is not None:
        return _JOB
    if launched_by_mpi() <= 1:
        return SerialComm()
    comm = MpiComm()
    if comm.size == 1:
        return SerialComm()
    _install_failure_handling(comm)
    _JOB = comm
    return comm


# -- the communicator ----------------------------------------------------------------------------------------


class MpiComm:
    """:class:`~dslide.comm.Comm` over an mpi4py communicator (``COMM_WORLD`` unless given).

    Besides ``bytes_sent`` it keeps ``bytes_by_op`` (the same bytes split by collective), ``calls`` and
    ``seconds`` (wall time spent inside collectives, waiting for slower ranks included).
    """

    def __init__(self, mpi_comm: Any = None) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self._comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        self.rank: int = self._comm.Get_rank()
        self.size: int = self._comm.Get_size()
        self.bytes_sent = 0
        self.bytes_by_op: dict[str, int] = {"allgather": 0, "allreduce": 0, "bcast": 0}
        self.calls: dict[str, int] = {"allgather": 0, "allreduce": 0, "bcast": 0, "barrier": 0}
        self.seconds = 0.0
        self._node: MpiComm | None = None

    def _count(self, op: str, nbytes: int, started: float) -> None:
        self.bytes_sent += nbytes
        self.bytes_by_op[op] += nbytes
        self.calls[op] += 1
        self.seconds += time.perf_counter() - started

    def allgather(self, local: np.ndarray) -> np.ndarray:
        """Concatenate every rank's ``local`` along axis 1 in rank order (axis 0 for 1-D arrays)."""
        started = time.perf_counter()
        local = np.asarray(local)
        axis = 0 if local.ndim == 1 else 1
        widths = np.empty(self.size, dtype=np.int64)
        self._comm.Allgather(np.array([local.shape[axis]], dtype=np.int64), widths)
        # Gather with the concatenation axis in front, where every rank's block is one contiguous run.
        send = np.ascontiguousarray(np.moveaxis(local, axis, 0))
        inner = int(np.prod(send.shape[1:], dtype=np.int64))
        recv = np.empty((int(widths.sum()), *send.shape[1:]), dtype=local.dtype)
        counts = widths * inner
        displs = np.concatenate(([0], np.cumsum(counts)[:-1]))
        self._comm.Allgatherv(send, [recv, (counts, displs)])
        out = np.ascontiguousarray(np.moveaxis(recv, 0, axis))
        nbytes = _INT64 * (self.size - 1) + ring_allgather_bytes(counts * local.itemsize, self.rank)
        self._count("allgather", nbytes, started)
        return out

    def _allreduce(self, buf: np.ndarray, op: Any) -> np.ndarray:
        started = time.perf_counter()
        send = np.ascontiguousarray(buf)
        out = np.empty_like(send)
        self._comm.Allreduce(send, out, op=op)
        self._count("allreduce", ring_allreduce_bytes(send.size, send.itemsize, self.size, self.rank), started)
        return out

    def allreduce_sum(self, buf: np.ndarray) -> np.ndarray:
        return self._allreduce(buf, self._MPI.SUM)

    def allreduce_max(self, buf: np.ndarray) -> np.ndarray:
        return self._allreduce(buf, self._MPI.MAX)

    def bcast(self, obj: object, root: int = 0) -> object:
        started = time.perf_counter()
        if self.rank == root:
            payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
            length = np.array([payload.size], dtype=np.int64)
        else:
            length = np.empty(1, dtype=np.int64)
        self._comm.Bcast(length, root=root)
        if self.rank != root:
            payload = np.empty(int(length[0]), dtype=np.uint8)
        self._comm.Bcast(payload, root=root)
        result = obj if self.rank == root else pickle.loads(payload.tobytes())
        nbytes = tree_bcast_children(self.rank, self.size, root) * (_INT64 + int(length[0]))
        self._count("bcast", nbytes, started)
        return result

    def node_comm(self) -> MpiComm:
        """The ranks sharing this rank's node (MPI's ``COMM_TYPE_SHARED``: the launcher's hosts), made once."""
        if self._node is None:
            self._node = MpiComm(self._comm.Split_type(self._MPI.COMM_TYPE_SHARED, key=self.rank))
        return self._node

    def barrier(self) -> None:
        started = time.perf_counter()
        self._comm.Barrier()
        self.calls["barrier"] += 1
        self.seconds += time.perf_counter() - started

    def abort(self, code: int = 1) -> None:
        """End every rank of the job now; ``mpiexec`` exits with a non-zero status."""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        # Hydra forwards a rank's output asynchronously and stops forwarding once the abort arrives: give it a
        # moment, or the one line saying why the job ended can be lost.
        time.sleep(0.25)
        self._comm.Abort(code)
        # MPI_Abort may return once Hydra has the request (seen with MPICH 5 while other ranks compute);
        # this rank must not go on either way.
        os._exit(code)


# -- failure handling ----------------------------------------------------------------------------------------


def _exit_code(exc: BaseException) -> int:
    if isinstance(exc, SystemExit):
        code = exc.code
        if code is None:
            return 0
        return code if isinstance(code, int) else 1
    if isinstance(exc, KeyboardInterrupt):
        return 130
    return 1


def _abort_for(comm: Comm, exc: BaseException, prog: str) -> None:
    code = _exit_code(exc)
    if comm.size == 1 or code == 0:
        return
    if not isinstance(exc, SystemExit):
        if os.environ.get("DSLIDE_DEBUG"):
            traceback.print_exc()
        print(f"{prog}: rank {comm.rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
    comm.abort(code)


@contextlib.contextmanager
def abort_on_failure(comm: Comm, prog: str = "dslide") -> Iterator[None]:
    """Run the body; if it fails on this rank, say why on stderr and end the whole job.

    A non-zero ``SystemExit`` (a usage error, or a handled runtime error) aborts the job with that code; any
    other exception prints ``prog: rank R: Type: message`` (the traceback too with ``DSLIDE_DEBUG=1``) and
    aborts with 1.  With one rank the exception simply propagates.
    """
    try:
        yield
    except BaseException as exc:
        _abort_for(comm, exc, prog)
        raise


def ends_job_on_failure(main: Callable[P, int]) -> Callable[P, int]:
    """Decorate a CLI ``main`` that returns an exit status: in an MPI job, a non-zero status (or an exception)
    on any one rank aborts every rank with that status instead of leaving the others waiting in a collective.

    Before :func:`get_comm` made an MpiComm (a usage error while parsing) MPI is not running and a rank that
    exits simply exits; Hydra then ends the job.  Outside MPI this is the plain function.
    """

    @functools.wraps(main)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> int:
        try:
            code = main(*args, **kwargs)
        except BaseException as exc:
            if _JOB is not None:
                _abort_for(_JOB, exc, "dslide")
            raise
        if code and _JOB is not None:
            _JOB.abort(int(code))
        return code

    return wrapper


def _install_failure_handling(comm: MpiComm) -> None:
    previous = sys.excepthook

    def excepthook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        previous(exc_type, exc, tb)
        comm.abort(1)

    sys.excepthook = excepthook
    _die_with_parent()


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank when its parent (Hydra's proxy) dies, so no rank outlives its job."""
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    # The parent may have died before prctl took effect: then this rank is already an orphan.
    if os.getppid() != parent:
        os._exit(1)
