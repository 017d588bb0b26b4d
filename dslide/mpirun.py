"""Run ``mpiexec`` jobs from Python (tests, benchmarks): always with a deadline, never leaving a rank behind.

Hydra puts its proxy and every rank in sessions of their own, so killing ``mpiexec``'s process group does not
reach them.  :class:`MpiJob` therefore remembers every descendant of ``mpiexec`` it has seen (walked down from
``mpiexec``'s pid, ``/proc/PID/task/TID/children``) and, on a timeout or when the test is done, sends SIGTERM to
``mpiexec`` (Hydra then stops the ranks) and SIGKILL, by pid, to whatever is still alive.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

SRC = Path(__file__).resolve().parents[1]
# The venv's mpiexec (the ``mpich`` wheel) first: it matches the libmpi mpi4py loads.
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")


def job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a job: one thread per rank, the source tree importable, no stray MPI variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_", "MPI_LOCAL"))}
    env.update(
        NUMBA_NUM_THREADS="1",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra or {})
    return env


def children(pid: int) -> list[int]:
    """The children of process ``pid``, from its threads' ``/proc/PID/task/TID/children``: only the job's own
    processes are looked at, never every process of the machine (a process stuck on a hung FUSE mount elsewhere
    cannot make this wait)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    kids: list[int] = []
    for tid in tids:
        try:
            kids += map(int, Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
        except OSError:
            continue
    return kids


def parent(pid: int) -> int:
    """The parent of process ``pid`` (``/proc/PID/stat``: the fields after the command name's last ')')."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid`` still parented within its tree (walked down from ``pid``)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children(todo.pop()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _mpmd_arguments(n: int, argv: Sequence[str], rank_argv: dict[int, Sequence[str]],
                    rank_prefix: dict[int, Sequence[str]]) -> list[str]:
    """``-n N python ARGV``, or runs of ranks with the same command joined by ``:`` (ranks are numbered in
    that order)."""
    for name, given in (("rank_argv", rank_argv), ("rank_prefix", rank_prefix)):
        if any(not 0 <= r < n for r in given):
            raise ValueError(f"{name} names ranks {sorted(given)}, the job has {n}")
    runs: list[tuple[int, list[str]]] = []
    for r in range(n):
        command = [*map(str, rank_prefix.get(r, ())), sys.executable, *map(str, rank_argv.get(r, argv))]
        if runs and runs[-1][1] == command:
            runs[-1] = (runs[-1][0] + 1, command)
        else:
            runs.append((1, command))
    out: list[str] = []
    for count, command in runs:
        out += [*([":"] if out else []), "-n", str(count), *command]
    return out


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool


class MpiJob:
    """``mpiexec -n N python ARGS`` started in the background; use as a context manager.

    Hydra runs more ranks than cores without a flag (oversubscription), so ``-n 4`` works on 2 cores.
    ``rank_argv`` gives some ranks arguments of their own (an MPMD launch, ``-n 3 python A : -n 1 python B``):
    how a test gives one rank a fault the others do not have, as one node of a real job may.  ``rank_prefix``
    puts a command before some ranks' ``python`` (``nsenter --net=/run/netns/NODE``: a benchmark's node in a
    network namespace of its own).  ``launcher_args`` go to mpiexec itself (``-disable-auto-cleanup``: a rank
    that dies leaves the others running).
    """

    def __init__(
        self,
        n: int,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        rank_argv: dict[int, Sequence[str]] | None = None,
        launcher_args: Sequence[str] = (),
        rank_prefix: dict[int, Sequence[str]] | None = None,
    ) -> None:
        if MPIEXEC is None:
            raise FileNotFoundError("mpiexec not found next to the interpreter or on PATH")
        self.argv = [MPIEXEC, *launcher_args, *_mpmd_arguments(n, argv, rank_argv or {}, rank_prefix or {})]
        # Files, not pipes: a chatty job must never block on a full pipe while the test polls it.
        self._stdout = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv,
            env=job_env(env),
            cwd=cwd,
            stdout=self._stdout,
            stderr=self._stderr,
            text=True,
            start_new_session=True,
        )
        self.seen: set[int] = set()

    def track(self) -> None:
        """Remember the job's current processes (call while it runs; the harness also does on cleanup)."""
        if self.proc.poll() is None:
            self.seen |= descendants(self.proc.pid)

    def stdout_so_far(self) -> str:
        """What the job has printed on stdout until now (it keeps running)."""
        with open(self._stdout.fileno(), closefd=False) as f:
            f.seek(0)
            return f.read()

    def rank_pids(self) -> dict[int, int]:
        """The job's rank processes by rank (from ``PMI_RANK`` in their environment), as far as seen yet (of a rank
        with several processes, one of them)."""
        return {rank: pid for pid, rank in self._ranks().items()}

    def processes_of_rank(self, rank: int) -> list[int]:
        """Every process of ``rank`` seen yet: the one the launcher started and any it forked."""
        return [pid for pid, r in self._ranks().items() if r == rank]

    def _ranks(self) -> dict[int, int]:
        """The rank (``PMI_RANK`` in its environment) of each of the job's processes seen yet that has one."""
        self.track()
        ranks = {}
        for pid in self.seen:
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for item in environ:
                if item.startswith(b"PMI_RANK="):
                    ranks[pid] = int(item[9:])
        return ranks

    def wait(self, timeout: float) -> Result:
        """Wait up to ``timeout`` s; on expiry stop the whole job and report ``timed_out``."""
        deadline = time.monotonic() + timeout
        timed_out = False
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.track()
            time.sleep(0.2)
        if self.proc.poll() is None:
            timed_out = True
            self.stop()
        self.proc.wait()
        return Result(
            self.proc.returncode,
            self._read(self._stdout),
            self._read(self._stderr),
            time.monotonic() - self.started,
            timed_out,
        )

    @staticmethod
    def _read(stream: IO[str]) -> str:
        stream.flush()
        stream.seek(0)
        return stream.read()

    def stop(self) -> None:
        """SIGTERM to mpiexec (Hydra stops the ranks), then SIGKILL to every process of the job still alive."""
        self.track()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for pid in sorted(self.seen):
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        self.seen.clear()

    def __enter__(self) -> MpiJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self._stdout.close()
        self._stderr.close()


def run_mpi(
    n: int, argv: Sequence[str], timeout: float = 60, env: dict[str, str] | None = None, cwd: Path | None = None
) -> Result:
    """Run a job to completion (or to ``timeout``, then stop it) and return what it printed."""
    with MpiJob(n, argv, env=env, cwd=cwd) as job:
        return job.wait(timeout)
