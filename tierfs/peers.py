"""Peers: the nodes of one job stage from each other's caches (``peers=mpi``, issue 27).

**The group.**  The daemons are started by the job's launcher, one rank per node (``mpiexec -n N tierfs mount
... -o peers=mpi`` or ``srun``).  MPI is used for membership only: each daemon opens a TCP listening socket,
the ranks ``allgather`` their addresses once (:func:`join_mpi_group`) and finalize MPI.  The bytes go over
plain TCP, because a rank that dies makes MPI point-to-point calls hang, or the launcher abort the whole job,
while a daemon that dies must be a *peer miss* for the others: a socket gives a deadline (``peer_timeout``)
and ``ECONNREFUSED``.

**Who holds what.**  Every node derives the same plans from the seed, so without asking it knows which rank
staged each file in epoch 0: that rank *owns* the file (:func:`plan_owners`), keeps its copy beyond its
mini-epochs while its cap allows (``MetPolicy``: eviction drops copies it does not own first), and is the peer
asked for it.  When the nodes' caches together hold the data set, the slow tier is then read once per job.

**Fetching** (:meth:`PeerGroup.source_for`, :class:`PeerFetch`, in the copier's worker thread): the stager
asks the owner for the file's bytes *of the version this node's tree knows* (size, mtime, inode, ctime -- the
fingerprint its copies are named by) and of the same path; the owner answers with its committed copy only if
its own tree holds that same version, and the copier checks the header (size and fingerprint) and, under
``verify=xxhash``, the bytes' hash against the owner's, then the backing file's ``fstat`` against the
fingerprint after the bytes landed, as after a backing copy.  The bytes land through the copier's temp file
and rename.  Anything else -- refused, a deadline passed, not held, another version, a short read -- is a peer
miss: counted by reason, and the file is copied from the backing as without peers.  A peer that refused or
timed out is not asked again for :data:`DOWN_S` seconds (one dead peer costs one deadline, not one per file).

**Serving** (:class:`PeerServer`): threads, never the trio thread.  A request's lookup and pin of the copy run
on the trio thread through ``trio.from_thread`` (the cache's state is the trio thread's); the bytes go by
``os.sendfile`` from the copy, pinned (:class:`~tierfs.pins.PinKeeper`) so that an eviction meanwhile only
dooms it, and unpinned after.  A copy being written is not in the cache's index yet: "not held".
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hmac
import logging
import os
import secrets
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import trio
import xxhash

from tierfs.cache import CacheEntry, CacheStore
from tierfs.copier import PeerMissed
from tierfs.copies import CopyDamaged, open_copy
from tierfs.options import Settings, parse_peer_addr
from tierfs.schedule import make_plan
from tierfs.tree import Fingerprint, Tree

__all__ = ["DOWN_S", "MISS_REASONS", "PeerFetch", "PeerGroup", "PeerLink", "PeerMiss", "PeerServer",
           "PeerStatistics", "PeerStats", "PinsForPeers", "detach_from_launcher", "join_mpi_group", "listen",
           "plan_owners"]

log = logging.getLogger("tierfs")

DOWN_S = 5.0  # seconds a peer that refused or timed out is not asked again
SERVING = 16  # requests served at once; more wait to be accepted (each thread holds a copy's descriptor)
CHUNK = 1 << 20
_MAGIC = b"TFP1"
_REQUEST = struct.Struct("!4s16sIQQ4q")  # magic, the job's token, requester's rank, file index, path hash, fingerprint
_ANSWER = struct.Struct("!4sBQ4qQB")  # magic, status, size, fingerprint of the copy, digest, has digest
_OK, _NOT_HELD, _OTHER_VERSION, _UNKNOWN = 0, 1, 2, 3
#: why a peer did not give a file (status ``peers.misses``): ``down`` -- not asked, it refused or timed out
#: less than DOWN_S ago
MISS_REASONS = ("refused", "timeout", "not_held", "other_version", "short", "digest", "error", "down")


class PeerMiss(PeerMissed):
    """The peer did not give the file (``reason``: one of :data:`MISS_REASONS`): copy it from the backing."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}{': ' + detail if detail else ''}")
        self.reason = reason


# ============================================================================================= the group

@dataclass
class PeerLink:
    """This node's place in the group: its rank, everyone's address (by rank), its listening socket, and the
    job's token (random, drawn by rank 0 and given to every rank with the addresses): a request without it is
    not answered, so the port serves the job's nodes, not whoever on the network connects to it."""

    rank: int
    world_size: int
    addresses: list[tuple[str, int]]
    listener: socket.socket | None
    token: bytes = dataclasses.field(repr=False)

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None


def listen(peer_addr: str) -> tuple[socket.socket, tuple[str, int]]:
    """A listening socket on ``peer_addr`` and the address the others reach it at."""
    host, port = parse_peer_addr(peer_addr)
    sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                backlog=128)
    bound = sock.getsockname()
    announced = host if host not in ("", "0.0.0.0", "::") else socket.gethostbyname(socket.gethostname())
    return sock, (announced, bound[1])


def join_mpi_group(peer_addr: str) -> PeerLink:
    """(``peers=mpi``, before the mount opens) Listen, allgather the ranks' addresses over MPI, finalize MPI.

    A rank that cannot listen tells the others through the same allgather: every rank then fails with the
    reason (``ValueError``), none waits for it."""
    from mpi4py import MPI  # (only a daemon that joins a group loads MPI)

    comm = MPI.COMM_WORLD
    sock: socket.socket | None = None
    try:
        sock, addr = listen(peer_addr)
        mine: tuple[str, int] | str = addr
    except (OSError, ValueError) as exc:
        mine = f"rank {comm.Get_rank()} cannot listen on peer_addr={peer_addr or '(any)'}: {exc}"
    everyone = comm.allgather(mine)
    token = comm.bcast(secrets.token_bytes(16) if comm.Get_rank() == 0 else None, root=0)
    rank, size = comm.Get_rank(), comm.Get_size()
    MPI.Finalize()  # (membership only: nothing of MPI is used again, so a dead rank can hang nothing)
    # mpiexec (hydra, with -disable-auto-cleanup) tells the ranks left when one dies with SIGUSR1, whose default
    # action ends the process: here a dead peer is a peer miss, so this daemon goes on serving.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    failed = [a for a in everyone if isinstance(a, str)]
    if failed:
        if sock is not None:
            sock.close()
        raise ValueError(f"peers=mpi: {failed[0]}")
    return PeerLink(rank, size, [tuple(a) for a in everyone], sock, token)  # type: ignore[misc]


def detach_from_launcher(link: PeerLink) -> None:
    """(``peers=mpi``, once the group is joined) Serve from a child in a session of its own; the rank's process
    stays the launcher's, forwards SIGTERM/SIGINT/SIGHUP to it and exits with its status.

    When one rank dies, mpiexec (hydra) kills the processes of the other ranks -- even with
    ``-disable-auto-cleanup`` it does so for some of them, by a race -- while here a dead peer must be a peer
    miss for the others.  The launcher's kill reaches only the process it started: the mount goes on in the
    child, which a job's end (``scancel``: every process of the job; Ctrl-C at mpiexec: forwarded) still
    stops."""
    pid = os.fork()
    if pid == 0:
        os.setsid()
        return
    link.close()  # (the child serves on it)

    def forward(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    _, status = os.waitpid(pid, 0)  # (a forwarded signal's handler runs; the wait goes on: PEP 475)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def plan_owners(disk_sizes: np.ndarray, groups: np.ndarray, settings: Settings, capacity: int) -> np.ndarray:
    """The rank that stages each file in epoch 0 of the plan every node derives (int32 per file): who owns
    it.  One plan per rank, made once at mount (seconds at millions of files and many ranks)."""
    owners = np.full(len(disk_sizes), -1, np.int32)
    for r in range(settings.world_size):
        plan, _ = make_plan(disk_sizes, groups, dataclasses.replace(settings, rank=r), capacity, 0)
        for piece in plan:
            owners[piece] = r
    return owners


@dataclass(frozen=True)
class PeerStats:
    """One peer, as this node sees it."""

    rank: int
    address: str
    alive: bool  # the last contact succeeded (and was no longer than DOWN_S ago a refusal or a timeout)
    last_contact: float | None  # wall clock of the last answer from it (a file, or "not held")
    fetched_files: int
    fetched_bytes: int
    served_files: int  # files this node sent it
    served_bytes: int
    misses: int  # files asked of it (or not asked: down) that came from the backing instead


@dataclass(frozen=True)
class PeerStatistics:
    enabled: bool
    rank: int
    world_size: int
    address: str  # where this node serves ("" without peers)
    fetched_files: int  # copies staged from peers instead of the slow tier
    fetched_bytes: int
    served_files: int  # copies sent to peers
    served_bytes: int
    misses: dict[str, int]  # files a peer did not give, by reason (MISS_REASONS): copied from the backing
    alive: int  # peers whose last contact succeeded
    strangers: int  # connections turned away: no (or another job's) token
    owned_files: int  # files this node owns (staged in epoch 0) and keeps while its cap allows
    owned_cached_files: int  # of those, cached now
    peers: tuple[PeerStats, ...]


class _Peer:
    """Counters of one peer (under the group's lock)."""

    def __init__(self, rank: int, address: tuple[str, int]) -> None:
        self.rank, self.address = rank, address
        self.down_until = 0.0
        self.alive = True
        self.last_contact: float | None = None
        self.fetched_files = self.fetched_bytes = self.served_files = self.served_bytes = self.misses = 0


class PeerGroup:
    """The peers of this node: whom to ask for a file, and what came from and went to each (see the module
    docstring).  Counted from the copier's and the server's threads, under one lock; without a link (no
    ``peers``) it asks nobody."""

    def __init__(self, link: PeerLink | None, tree: Tree, *, owners: np.ndarray | None, settings: Settings) -> None:
        self.link = link
        self.tree = tree
        self.owners = owners
        self.timeout = settings.peer_timeout
        self.rank = link.rank if link is not None else settings.rank
        self.peers = {r: _Peer(r, a) for r, a in enumerate(link.addresses) if r != self.rank} if link else {}
        self._lock = threading.Lock()
        self._misses = dict.fromkeys(MISS_REASONS, 0)
        self._strangers = 0
        self._owned: np.ndarray | None = None  # (owned())

    @property
    def enabled(self) -> bool:
        return bool(self.peers)

    def owned(self) -> np.ndarray | None:
        """A mask of the files this node owns (made once: the owners never change); None without peers."""
        if self.owners is None or not self.enabled:
            return None
        if self._owned is None:
            self._owned = self.owners == self.rank
        return self._owned

    def source_for(self, fidx: int) -> PeerFetch | None:
        """(trio thread, as the stager makes a copy job) The peer to ask for ``fidx``: its owner, unless that is
        this node or down (a miss, counted: the backing is read)."""
        if not self.enabled or self.owners is None:
            return None
        owner = int(self.owners[fidx])
        peer = self.peers.get(owner)
        if peer is None:
            return None
        if peer.down_until > time.monotonic():
            self._miss(peer, "down")
            return None
        return PeerFetch(self, peer, fidx, self.tree.path_hash_of(fidx))

    # ------------------------------------------------------------------------------- counted (any thread)

    def _miss(self, peer: _Peer, reason: str) -> None:
        with self._lock:
            self._misses[reason] += 1
            peer.misses += 1
            if reason in ("refused", "timeout"):
                peer.down_until = time.monotonic() + DOWN_S
                peer.alive = False
            elif reason != "down":
                peer.last_contact, peer.alive = time.time(), True

    def _fetched(self, peer: _Peer, nbytes: int) -> None:
        with self._lock:
            peer.fetched_files += 1
            peer.fetched_bytes += nbytes
            peer.last_contact, peer.alive = time.time(), True

    def stranger(self) -> None:
        """A connection without this job's token was turned away."""
        with self._lock:
            self._strangers += 1

    def served(self, rank: int, nbytes: int) -> None:
        """The server sent a copy of ``nbytes`` to ``rank``."""
        peer = self.peers.get(rank)
        if peer is not None:
            with self._lock:
                peer.served_files += 1
                peer.served_bytes += nbytes

    def statistics(self, cache: CacheStore) -> PeerStatistics:
        """(trio thread) The snapshot; ``cache`` answers how much of the owned share is cached."""
        owned = self.owned()
        owned_files = int(np.count_nonzero(owned)) if owned is not None else 0
        owned_cached = int(np.count_nonzero(cache.held(len(owned)) & owned)) if owned is not None else 0
        now = time.monotonic()
        with self._lock:
            peers = tuple(PeerStats(p.rank, f"{p.address[0]}:{p.address[1]}", p.alive and p.down_until <= now,
                                    p.last_contact, p.fetched_files, p.fetched_bytes, p.served_files,
                                    p.served_bytes, p.misses) for p in self.peers.values())
            misses, strangers = dict(self._misses), self._strangers
        link = self.link
        return PeerStatistics(
            enabled=self.enabled, rank=self.rank, world_size=link.world_size if link else 1,
            address=f"{link.addresses[link.rank][0]}:{link.addresses[link.rank][1]}" if link else "",
            fetched_files=sum(p.fetched_files for p in peers), fetched_bytes=sum(p.fetched_bytes for p in peers),
            served_files=sum(p.served_files for p in peers), served_bytes=sum(p.served_bytes for p in peers),
            misses=misses, alive=sum(p.alive for p in peers), strangers=strangers, owned_files=owned_files,
            owned_cached_files=owned_cached, peers=peers)


# ========================================================================================== fetching

def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise PeerMiss("short", f"the peer closed the connection after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


class PeerFetch:
    """One file asked of one peer: what the copier calls (:meth:`fetch_into`, in its worker thread)."""

    def __init__(self, group: PeerGroup, peer: _Peer, fidx: int, path_hash: int) -> None:
        self.group, self.peer, self.fidx, self.path_hash = group, peer, fidx, path_hash

    def fetch_into(self, dst: int, expected: Fingerprint, hasher: xxhash.xxh3_64 | None,
                   alive: Callable[[], None]) -> int:
        """Write the peer's copy of the version ``expected`` to ``dst`` (hashing it into ``hasher``); its
        size.  :class:`PeerMiss` (counted) if the peer does not give exactly that: the caller starts over
        from the backing."""
        try:
            n = self._fetch(dst, expected, hasher, alive)
        except PeerMiss as miss:
            self.group._miss(self.peer, miss.reason)
            raise
        except TimeoutError as exc:
            self.group._miss(self.peer, "timeout")
            raise PeerMiss("timeout", str(exc)) from None
        except OSError as exc:
            reason = "refused" if exc.errno in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH) else \
                "short" if exc.errno in (errno.ECONNRESET, errno.EPIPE) else "error"
            self.group._miss(self.peer, reason)
            raise PeerMiss(reason, str(exc)) from None
        self.group._fetched(self.peer, n)
        return n

    def _fetch(self, dst: int, expected: Fingerprint, hasher: xxhash.xxh3_64 | None,
               alive: Callable[[], None]) -> int:
        with socket.create_connection(self.peer.address, timeout=self.group.timeout) as sock:
            assert self.group.link is not None
            sock.sendall(_REQUEST.pack(_MAGIC, self.group.link.token, self.group.rank, self.fidx, self.path_hash,
                                       *expected))
            magic, status, size, *rest = _ANSWER.unpack(_recv_exactly(sock, _ANSWER.size))
            fp, digest, has_digest = tuple(rest[:4]), rest[4], rest[5]
            if magic != _MAGIC:
                raise PeerMiss("error", "not a tierfs peer")
            if status != _OK:
                raise PeerMiss("not_held" if status in (_NOT_HELD, _UNKNOWN) else "other_version")
            if fp != expected or size != expected[0]:
                raise PeerMiss("other_version", f"the peer sent {fp}, asked {expected}")  # (its bug: refused)
            total = 0
            buf = bytearray(min(CHUNK, max(size, 1)))
            view = memoryview(buf)
            while total < size:
                n = sock.recv_into(view[:min(len(buf), size - total)])
                if n == 0:
                    raise PeerMiss("short", f"{total} of {size} bytes")
                alive()
                chunk = view[:n]
                if hasher is not None:
                    hasher.update(chunk)
                while chunk:
                    chunk = chunk[os.write(dst, chunk):]
                total += n
        if hasher is not None and has_digest and hasher.intdigest() != digest:
            raise PeerMiss("digest", "the bytes received do not hash to the peer's copy's xxh3")
        return total


# =========================================================================================== serving

class PinsForPeers(Protocol):
    """What the server needs of the pin keeper (:class:`~tierfs.pins.PinKeeper` implements it)."""

    def for_peer(self, entry: CacheEntry) -> None:
        """Keep ``entry`` on disk while it is sent."""

    def peer_done(self, entry: CacheEntry) -> None:
        """It was sent (or the send failed): undo :meth:`for_peer`."""


class PeerServer:
    """Sends this node's committed copies to its peers (see the module docstring); :meth:`run` in the mount's
    nursery, the sockets in threads of their own."""

    def __init__(self, group: PeerGroup, tree: Tree, cache: CacheStore, pins: PinsForPeers) -> None:
        self.group, self.tree, self.cache, self.pins = group, tree, cache, pins
        self._token: trio.lowlevel.TrioToken | None = None
        self._slots = threading.BoundedSemaphore(SERVING)

    async def run(self) -> None:
        """Accept connections in a thread until cancelled (the listening socket then closes)."""
        link = self.group.link
        if link is None or link.listener is None or not self.group.enabled:
            return
        self._token = trio.lowlevel.current_trio_token()
        listener = link.listener
        accepting = threading.Thread(target=self._accept, args=(listener,), name="tierfs-peer-accept", daemon=True)
        accepting.start()
        try:
            await trio.sleep_forever()
        finally:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # (wakes the accept)
            link.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            self._slots.acquire()  # (released as a request's thread ends: a deadline bounds each)
            try:
                conn, _ = listener.accept()
            except OSError:
                self._slots.release()
                return  # closed: the mount ends
            threading.Thread(target=self._serve_in_slot, args=(conn,), name="tierfs-peer", daemon=True).start()

    def _serve_in_slot(self, conn: socket.socket) -> None:
        try:
            self._serve(conn)
        finally:
            self._slots.release()

    def _serve(self, conn: socket.socket) -> None:
        """(a thread) One request: the copy, or why not."""
        with conn:
            conn.settimeout(self.group.timeout)
            try:
                magic, token, rank, fidx, path_hash, *fp = _REQUEST.unpack(_recv_exactly(conn, _REQUEST.size))
            except (PeerMiss, OSError, struct.error):
                return
            link = self.group.link
            if magic != _MAGIC or link is None or not hmac.compare_digest(token, link.token):
                self.group.stranger()
                return
            try:
                lent = trio.from_thread.run_sync(self._lend, fidx, path_hash, tuple(fp), trio_token=self._token)
            except trio.RunFinishedError:
                return
            if not isinstance(lent, CacheEntry):
                with contextlib.suppress(OSError):
                    conn.sendall(_ANSWER.pack(_MAGIC, lent, 0, 0, 0, 0, 0, 0, 0))
                return
            try:
                self._send(conn, rank, lent)
            finally:
                with contextlib.suppress(trio.RunFinishedError):
                    trio.from_thread.run_sync(self.pins.peer_done, lent, trio_token=self._token)

    def _lend(self, fidx: int, path_hash: int, fp: Fingerprint) -> CacheEntry | int:
        """(trio thread) The copy of ``fidx`` pinned for sending, or the status that says why not: the
        requester's file must be this node's (path and version) and its copy committed."""
        tree = self.tree
        if fidx >= tree.n_files or tree.path_hash_of(fidx) != path_hash:
            return _UNKNOWN
        if not tree.holds(fidx, fp):
            return _OTHER_VERSION  # (one of the two trees is stale: the requester's stat decides its own copy)
        entry = self.cache.get(fidx)
        if entry is None or entry.doomed or not tree.holds(fidx, entry.fp):
            return _NOT_HELD
        self.pins.for_peer(entry)
        return entry

    def _send(self, conn: socket.socket, rank: int, entry: CacheEntry) -> None:
        """(the request's thread) The header and the copy's bytes, by ``sendfile``; a copy found damaged is
        "not held" (the data path repairs it at its next open)."""
        try:
            fd = open_copy(self.cache.data_fd, entry.name, entry.size, entry.copy_id)
        except (CopyDamaged, OSError):
            with contextlib.suppress(OSError):
                conn.sendall(_ANSWER.pack(_MAGIC, _NOT_HELD, 0, 0, 0, 0, 0, 0, 0))
            return
        try:
            conn.sendall(_ANSWER.pack(_MAGIC, _OK, entry.size, *entry.fp, entry.digest or 0,
                                      entry.digest is not None))
            with open(fd, "rb", closefd=False) as f:
                sent = conn.sendfile(f, 0, entry.size) if entry.size else 0  # (os.sendfile, waiting within the timeout)
            if sent == entry.size:  # (else the copy shrank under us: the requester sees a short read, a miss)
                self.group.served(rank, sent)
        except OSError:
            return  # the requester went (its deadline): its miss
        finally:
            os.close(fd)
