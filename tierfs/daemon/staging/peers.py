"""Peers: the nodes of one job stage from each other's caches (``peers=mpi``, issue 27).

**The group.**  The daemons are started by the job's launcher, one rank per node (``mpiexec -n N tierfs mount
... -o peers=mpi`` or ``srun``).  MPI is used for membership only: each daemon opens a TCP listening socket,
the ranks ``allgather`` their addresses once (:func:`join_mpi_group`) and finalize MPI.  The bytes go over
plain TCP, because a rank that dies makes MPI point-to-point calls hang, or the launcher abort the whole job,
while a daemon that dies must be a *peer miss* for the others: a socket gives a deadline (``peer_timeout``)
and ``ECONNREFUSED``.  With the addresses each rank gathers a Diffie-Hellman key share (RFC 7919's ffdhe2048):
rank 0 draws the job's token and scatters it to each rank XORed with a key only the two of them derive, so
not even MPI's network carries it in clear.  A node listens on the address it announces (by default the host
name's, not every interface) and connects to its peers from it: the addresses the group lets in.

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
miss: counted by reason, and the file is copied from the backing as without peers.

**A peer that is down** (it refused or timed out) is not asked: every request for it is a "down" miss at once,
without a connection, for a window of :data:`DOWN_S` seconds (at least ``peer_timeout``).  When the window ends,
exactly one request is the *probe* (meanwhile the others are "down" misses, never a second connection): if the
peer answers, it is up and its window starts over; if not, the window doubles, up to :data:`DOWN_MAX_S`.  The
requests that were already waiting when it went down end by their own deadlines, at about the same time, so a
stalled peer (its port accepts, nothing answers: a stopped daemon, a hung node) costs the others about one
``peer_timeout`` per window, never one per file or per stream (``peers.peers[].waited_s`` counts it).

**Connections** are kept: a request's connection, once its answer (and the bytes) came whole, waits in a pool of
at most :data:`POOL` per peer for the next request to that peer, for at most :data:`KEEP_S` seconds; the
server keeps it :data:`IDLE_S`.  A pooled connection the server closed meanwhile (it ends before the answer) is
tried again once on a new one: neither a miss nor a reason to think the peer down.

**Serving** (:class:`PeerServer`): threads, never the trio thread.  One thread, the *doorman*, accepts every
connection at once (a full pool never stops the accepting) and holds it, non-blocking, until it proves the job's
token: a connection from an address that is not one of the job's (the peers' announced addresses) is closed at
accept; one that has not sent a proven request by its deadline (``peer_timeout`` after its accept, for the whole
request, however slowly its bytes come) is closed; of at most :data:`PENDING` unproven connections the oldest is
closed as another comes (idle or trickling sockets cost the port nothing a real peer needs: it proves itself
within a round trip).  A proven request waits for one of :data:`SERVING` server threads until the same deadline.
Once answered (and its bytes sent) the connection gets a new hello, a fresh nonce, and goes back to the doorman,
which holds it, non-blocking, until its next request proves the token for that nonce (``peer_timeout`` from the
request's first byte) or :data:`IDLE_S` passes: at most :data:`POOL` such kept connections per rank (the oldest
goes), apart from the unproven ones, so that neither kind can push out the other.
A request's lookup and pin of the copy run on the trio thread through ``trio.from_thread`` (the cache's state is
the trio thread's); the bytes go by ``os.sendfile`` from the copy, pinned
(:class:`~tierfs.daemon.serving.pins.PinKeeper`) so
that an eviction meanwhile only dooms it, and unpinned after.  A copy being written is not in the cache's index
yet: "not held".

**The wire** (TCP; a connection carries one request after another; integers big-endian; ``MAC(label, ...)`` is
HMAC-SHA256 keyed with the job's token over the label and the parts, concatenated)::

    server -> client  hello    "TFP3" | server nonce (16 random bytes, fresh per request)
    client -> server  request  "TFP3" | rank u32 | file index u64 | path hash u64 | fingerprint 4 x i64
                               | client nonce (16) | MAC("request", server nonce, the request's bytes before it)
    server -> client  answer   "TFP3" | status u8 | size u64 | fingerprint 4 x i64 | xxh3 u64 | has xxh3 u8
                               | MAC("answer", client nonce, server nonce, the answer's bytes before it)
    server -> client  the copy's ``size`` bytes (status 0 only)
    server -> client  hello    (the next request's, a new nonce) ...

The token itself never crosses the port: a request proves it for one server nonce only, so a request seen on the
network and sent again (on another connection, or later on the same one: another nonce) gets no byte, and an
answer proves the server holds it (a process that took a dead peer's port cannot feed a node).  What the MACs do
not cover: the copy's bytes (unencrypted, and an attacker *on the path* could alter them; under ``verify=xxhash``
they are checked against the proven xxh3, which is not a cryptographic hash) -- the peers' network must be the
cluster's own.  A status other than 0 (1 not held, 2 another version, 3 no such file) ends the answer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import hmac
import logging
import os
import queue
import secrets
import selectors
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

from tierfs.common.options import Settings, parse_peer_addr
from tierfs.daemon.cache.copy_check import CopyDamaged, open_copy
from tierfs.daemon.cache.store import CacheEntry, CacheStore
from tierfs.daemon.schedule.schedule import make_plan
from tierfs.daemon.staging.copier import PeerMissed
from tierfs.daemon.tree.tree import Fingerprint, Tree

__all__ = ["DOWN_MAX_S", "DOWN_S", "IDLE_S", "KEEP_S", "MISS_REASONS", "POOL", "PeerFetch", "PeerGroup", "PeerLink",
           "PeerMiss", "PeerServer", "PeerStatistics", "PeerStats", "PinsForPeers", "detach_from_launcher",
           "join_mpi_group", "listen", "plan_owners"]

log = logging.getLogger("tierfs")

#: the first window (seconds, at least peer_timeout) a peer that refused or timed out is not asked in; each probe
#: that fails doubles it, up to DOWN_MAX_S: a stalled peer costs a node one peer_timeout a minute at most, and one
#: that recovered is asked again within a minute
DOWN_S = 5.0
DOWN_MAX_S = 60.0
#: kept connections: at most this many idle per peer (client) and per rank (server; its threads serve as many at
#: once), each kept IDLE_S by the server and KEEP_S by the client (less: it rarely meets one the server closed)
POOL = 16
IDLE_S = 60.0
KEEP_S = 30.0
SERVING = 16  # proven requests served at once (a thread each, holding a copy's descriptor); more wait their turn
#: accepted connections not yet proven; beyond, the oldest is closed (a real peer proves itself within a round
#: trip: to push it out, an attacker must open this many connections in that time)
PENDING = 1024
CHUNK = 1 << 20
_MAGIC = b"TFP3"
_NONCE = 16
_HELLO = struct.Struct(f"!4s{_NONCE}s")  # magic, server nonce
_REQUEST = struct.Struct(f"!4sIQQ4q{_NONCE}s")  # magic, rank, file index, path hash, fingerprint, client nonce
_ANSWER = struct.Struct("!4sBQ4qQB")  # magic, status, size, fingerprint of the copy, digest, has digest
_MAC = hashlib.sha256().digest_size  # (each request and answer is followed by its MAC)
_OK, _NOT_HELD, _OTHER_VERSION, _UNKNOWN = 0, 1, 2, 3
#: why a peer did not give a file (status ``peers.misses``): ``down`` -- not asked, it refused or timed out and
#: its window (or another request's probe) is not over
MISS_REASONS = ("refused", "timeout", "not_held", "other_version", "short", "digest", "error", "down")
_DOWN = ("refused", "timeout")  # a miss that marks the peer down
_ANSWERED = ("not_held", "other_version", "digest")  # a miss that proves the peer up (a proven answer)


class PeerMiss(PeerMissed):
    """The peer did not give the file (``reason``: one of :data:`MISS_REASONS`): copy it from the backing."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}{': ' + detail if detail else ''}")
        self.reason = reason


# ============================================================================================= the group

@dataclass
class PeerLink:
    """This node's place in the group: its rank, everyone's address (by rank), its listening socket, and the
    job's token (random, drawn by rank 0 and given to every rank with the addresses): a request that does not
    prove it (module docstring, "The wire") is not answered, so the port serves the job's nodes, not whoever on
    the network connects to it."""

    rank: int
    world_size: int
    addresses: list[tuple[str, int]]
    listener: socket.socket | None
    token: bytes = dataclasses.field(repr=False)

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    def member_hosts(self) -> frozenset[str]:
        """The numeric addresses of the job's nodes (a connection from any other is closed at accept)."""
        hosts: set[str] = set()
        for host, _ in self.addresses:
            try:
                # (an IPv4 or IPv6 address is a str: the stub's int is another family's)
                hosts.update(_numeric(str(info[4][0]))
                             for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
            except OSError as exc:
                log.warning("peers: cannot resolve the address %s a peer announced (%s): it is not let in", host, exc)
        return frozenset(hosts)


def _numeric(host: str) -> str:
    """``host`` as accept() names it on any socket: an IPv4 address seen on a dual-stack socket is itself."""
    return host.removeprefix("::ffff:") if "." in host else host


def listen(peer_addr: str) -> tuple[socket.socket, tuple[str, int]]:
    """A listening socket on ``peer_addr`` and the address the others reach it at.  Empty: the host name's
    address, only it (the one announced; ``0.0.0.0`` or ``::`` listen on every interface, announcing the host
    name's address)."""
    host, port = parse_peer_addr(peer_addr)
    own = socket.gethostbyname(socket.gethostname())
    sock = socket.create_server((host or own, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                backlog=PENDING)  # (connections wait here only while the doorman is busy)
    bound = sock.getsockname()
    return sock, (own if host in ("0.0.0.0", "::") else bound[0], bound[1])


def _mac(token: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(token, b"".join((label, *parts)), hashlib.sha256).digest()


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
        mine = f"rank {comm.Get_rank()} cannot listen on peer_addr={peer_addr or '(the host name)'}: {exc}"
    rank, size = comm.Get_rank(), comm.Get_size()
    secret, share = _key_share()
    everyone, shares = zip(*comm.allgather((mine, share)), strict=True)
    # (the token crosses MPI's network wrapped for each rank by a key only rank 0 and that rank can derive)
    token = secrets.token_bytes(_TOKEN) if rank == 0 else b""
    wrapped = comm.scatter([_wrap(token, secret, shares[r]) if r else b"" for r in range(size)] if rank == 0
                           else None, root=0)
    if rank != 0:
        token = _wrap(wrapped, secret, shares[0])
    MPI.Finalize()  # (membership only: nothing of MPI is used again, so a dead rank can hang nothing)
    # mpiexec (hydra, with -disable-auto-cleanup) tells the ranks left when one dies with SIGUSR1, whose default
    # action ends the process: here a dead peer is a peer miss, so this daemon goes on serving.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    failed = [a for a in everyone if isinstance(a, str)]
    if not all(1 < s < _DH_PRIME - 1 for s in shares):  # (only ours run here: a share corrupted on the way)
        failed.append("a rank's key share is invalid: the job's token cannot be trusted")
    if failed:
        if sock is not None:
            sock.close()
        raise ValueError(f"peers=mpi: {failed[0]}")
    if not peer_addr and size > 1 and addr[0].startswith("127."):
        log.warning("peers: this node's host name resolves to %s, which peers on other nodes cannot reach: set "
                    "peer_addr to its address on the cluster's network", addr[0])
    return PeerLink(rank, size, [tuple(a) for a in everyone], sock, token)


#: The job's token: a key of HMAC-SHA256 (bytes)
_TOKEN = 32
#: RFC 7919's ffdhe2048 group (a safe prime, generator 2): the ranks' key shares to wrap the token with
_DH_PRIME = int(
    "FFFFFFFFFFFFFFFFADF85458A2BB4A9AAFDC5620273D3CF1D8B9C583CE2D3695A9E13641146433FBCC939DCE249B3EF97D2FE363630C"
    "75D8F681B202AEC4617AD3DF1ED5D5FD65612433F51F5F066ED0856365553DED1AF3B557135E7F57C935984F0C70E0E68B77E2A689DAF"
    "3EFE8721DF158A136ADE73530ACCA4F483A797ABC0AB182B324FB61D108A94BB2C8E3FBB96ADAB760D7F4681D4F42A3DE394DF4AE56E"
    "DE76372BB190B07A7C8EE0A6D709E02FCE1CDF7E2ECC03404CD28342F619172FE9CE98583FF8E4F1232EEF28183C3FE3B1B4C6FAD733"
    "BB5FCBC2EC22005C58EF1837D1683B2C6F34A26C1B2EFFA886B423861285C97FFFFFFFFFFFFFFFF", 16)


def _key_share() -> tuple[int, int]:
    """A rank's Diffie-Hellman secret (256 bits, as RFC 7919 asks of ffdhe2048 at least 225) and share."""
    secret = secrets.randbits(256) | 1 << 255
    return secret, pow(2, secret, _DH_PRIME)


def _wrap(token: bytes, secret: int, share: int) -> bytes:
    """``token`` XORed with a key derived from this rank's ``secret`` and the other's ``share`` (the same call
    unwraps it): what a rank's token looks like on MPI's network, where a sniffer cannot derive the key."""
    key = hashlib.sha256(b"tierfs peers token" + pow(share, secret, _DH_PRIME).to_bytes(256, "big")).digest()
    return bytes(t ^ k for t, k in zip(token, key, strict=True))


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


def plan_owners(disk_sizes: np.ndarray, groups: np.ndarray, settings: Settings, capacity: int,
                slots: int = 0) -> np.ndarray:
    """The rank that stages each file in epoch 0 of the plan every node derives (int32 per file, ``slots`` of
    them if more: the tree's room, files the backing gains, is owned by none): who owns it.  One plan per rank,
    made once at mount (seconds at millions of files and many ranks)."""
    owners = np.full(max(slots, len(disk_sizes)), -1, np.int32)
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
    alive: bool  # not down: it has not refused or timed out since its last answer
    last_contact: float | None  # wall clock of the last answer from it (a file, or "not held")
    fetched_files: int
    fetched_bytes: int
    served_files: int  # files this node sent it
    served_bytes: int
    misses: int  # files asked of it (or not asked: down) that came from the backing instead
    backoff_s: float  # while down, the window it is not asked in (0: up); doubles with each failed probe
    probes: int  # requests that asked it after a window, it being down
    waited_s: float  # wall-clock seconds copies waited on it in requests that ended as a miss (overlaps once)
    connections: int  # connections this node opened to it
    requests: int  # requests sent to it on them (more than connections: connections reused)


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
    alive: int  # peers not down
    strangers: int  # connections turned away: no (or another job's) token
    owned_files: int  # files this node owns (staged in epoch 0) and keeps while its cap allows
    owned_cached_files: int  # of those, cached now
    waited_s: float  # the peers' waited_s, summed
    probes: int  # the peers' probes, summed
    connections: int  # connections this node opened to its peers
    requests: int  # requests it sent on them
    kept_connections: int  # connections from peers this node's server holds open for their next request
    peers: tuple[PeerStats, ...]


class _Peer:
    """One peer's state as a client sees it: up or down (its window, the probe), the kept connections, the
    counters (under the group's lock)."""

    def __init__(self, rank: int, address: tuple[str, int]) -> None:
        self.rank, self.address = rank, address
        self.down = False  # it refused or timed out, and has not answered since
        self.down_until = 0.0  # (monotonic, while down) no request before: then one probe
        self.backoff_s = 0.0  # (while down) the window's length
        self.probing = False  # (while down) the probe is out
        self.probes = 0
        self.waited_s = 0.0
        self.waited_until = 0.0  # (monotonic) the end of the last wait counted in waited_s
        self.pool: list[tuple[socket.socket, float]] = []  # idle proven connections, when each was put back
        self.last_contact: float | None = None
        self.fetched_files = self.fetched_bytes = self.served_files = self.served_bytes = self.misses = 0
        self.connections = self.requests = 0


class PeerGroup:
    """The peers of this node: whom to ask for a file, whether each is up (the backoff and its probe), its kept
    connections, and what came from and went to each (see the module docstring).  Counted from the copier's and
    the server's threads, under one lock; without a link (no ``peers``) it asks nobody."""

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
        self._kept = 0  # (the server's doorman's) connections from peers held for their next request
        self._closed = False
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
        this node or down and not due a probe (a miss, counted: the backing is read)."""
        if not self.enabled or self.owners is None:
            return None
        owner = int(self.owners[fidx])
        peer = self.peers.get(owner)
        if peer is None:
            return None
        with self._lock:
            down = peer.down and (peer.probing or peer.down_until > time.monotonic())
        if down:
            self._ended(peer, "down", probe=False, started=time.monotonic())
            return None
        return PeerFetch(self, peer, fidx, self.tree.path_hash_of(fidx))

    def close(self) -> None:
        """Close the kept connections (the mount ends); a connection given back later is closed at once."""
        with self._lock:
            self._closed = True
            socks = [sock for peer in self.peers.values() for sock, _ in peer.pool]
            for peer in self.peers.values():
                peer.pool = []
        for sock in socks:
            sock.close()

    # ---------------------------------------------------------------------- the copier's threads (fetching)

    def _admit(self, peer: _Peer) -> bool | None:
        """May a request go to ``peer`` now: False (it is up), True (it is down and this request is the probe:
        :meth:`_ended` must follow), None (down: a miss)."""
        with self._lock:
            if not peer.down:
                return False
            if peer.probing or time.monotonic() < peer.down_until:
                return None
            peer.probing = True
            peer.probes += 1
            return True

    def _ended(self, peer: _Peer, reason: str | None, *, probe: bool, started: float, nbytes: int = 0) -> None:
        """A request to ``peer`` started at ``started`` (monotonic) ended: a file of ``nbytes`` (``reason``
        None) or a miss for ``reason``.  An answer ends a down; a refusal or timeout starts one (unless one runs:
        the requests already waiting end by their deadlines), and a probe's failure doubles it."""
        now = time.monotonic()
        with self._lock:
            if probe:
                peer.probing = False
            if reason is None or reason in _ANSWERED:
                peer.down, peer.backoff_s, peer.last_contact = False, 0.0, time.time()
            elif reason in _DOWN or probe:
                first = max(DOWN_S, self.timeout)
                if not peer.down or probe:
                    peer.backoff_s = min(2 * peer.backoff_s, max(DOWN_MAX_S, first)) if probe and peer.down \
                        else first
                    peer.down_until = now + peer.backoff_s
                peer.down = True
            if reason is None:
                peer.fetched_files += 1
                peer.fetched_bytes += nbytes
                return
            self._misses[reason] += 1
            peer.misses += 1
            if reason != "down":  # (wall clock: the waits of several streams at once count once)
                peer.waited_s += max(now - max(started, peer.waited_until), 0.0)
                peer.waited_until = max(peer.waited_until, now)

    def _connection(self, peer: _Peer) -> tuple[socket.socket, bool]:
        """A kept connection to ``peer`` (True) or a new one (False); ``OSError`` if it cannot be opened."""
        stale = []
        sock = None
        with self._lock:
            now = time.monotonic()
            while peer.pool:
                kept, since = peer.pool.pop()
                if now - since < KEEP_S:
                    sock = kept
                    break
                stale.append(kept)  # (the server closes it about now, if it has not yet)
            if sock is not None:
                peer.requests += 1
        for kept in stale:
            kept.close()
        if sock is not None:
            return sock, True
        return self._connect(peer), False

    def _connect(self, peer: _Peer) -> socket.socket:
        """A new connection to ``peer`` (from this node's announced address: the one its peers let in)."""
        link = self.link
        assert link is not None
        sock = socket.create_connection(peer.address, timeout=self.timeout,
                                        source_address=(link.addresses[link.rank][0], 0))
        with self._lock:
            peer.connections += 1
            peer.requests += 1
        return sock

    def _keep(self, peer: _Peer, sock: socket.socket) -> None:
        """``sock`` ended a request whole: kept for the next one, unless :data:`POOL` are kept already."""
        with self._lock:
            if not self._closed and len(peer.pool) < POOL:
                peer.pool.append((sock, time.monotonic()))
                return
        sock.close()

    # ------------------------------------------------------------------------------- counted (any thread)

    def stranger(self) -> None:
        """A connection without this job's token was turned away."""
        with self._lock:
            self._strangers += 1

    def kept(self, n: int) -> None:
        """The server holds ``n`` connections from peers for their next request."""
        with self._lock:
            self._kept = n

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
        with self._lock:
            peers = tuple(PeerStats(p.rank, f"{p.address[0]}:{p.address[1]}", not p.down, p.last_contact,
                                    p.fetched_files, p.fetched_bytes, p.served_files, p.served_bytes, p.misses,
                                    p.backoff_s if p.down else 0.0, p.probes, round(p.waited_s, 3),
                                    p.connections, p.requests) for p in self.peers.values())
            misses, strangers, kept = dict(self._misses), self._strangers, self._kept
        link = self.link
        return PeerStatistics(
            enabled=self.enabled, rank=self.rank, world_size=link.world_size if link else 1,
            address=f"{link.addresses[link.rank][0]}:{link.addresses[link.rank][1]}" if link else "",
            fetched_files=sum(p.fetched_files for p in peers), fetched_bytes=sum(p.fetched_bytes for p in peers),
            served_files=sum(p.served_files for p in peers), served_bytes=sum(p.served_bytes for p in peers),
            misses=misses, alive=sum(p.alive for p in peers), strangers=strangers, owned_files=owned_files,
            owned_cached_files=owned_cached, waited_s=round(sum(p.waited_s for p in peers), 3),
            probes=sum(p.probes for p in peers), connections=sum(p.connections for p in peers),
            requests=sum(p.requests for p in peers), kept_connections=kept, peers=peers)


# ========================================================================================== fetching

class _Gone(PeerMiss):
    """The connection ended before the answer's first byte: on a kept one, the server closed it meanwhile."""

    def __init__(self, detail: str) -> None:
        super().__init__("short", detail)


def _recv_exactly(sock: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes by ``deadline`` (monotonic) however they trickle in: ``TimeoutError`` past it; :class:`_Gone`
    if the connection ends (or is reset) before the first, a "short" :class:`PeerMiss` after it."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{len(buf)} of {n} bytes by the deadline")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(buf))
        except (ConnectionResetError, BrokenPipeError) as exc:
            if buf:
                raise
            raise _Gone(str(exc)) from None
        if not chunk:
            if not buf:
                raise _Gone("the peer closed the connection")
            raise PeerMiss("short", f"the peer closed the connection after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


@dataclass(frozen=True)
class _Answer:
    """A proven answer's header (module docstring, "The wire")."""

    status: int
    size: int
    fp: Fingerprint
    digest: int
    has_digest: bool


class PeerFetch:
    """One file asked of one peer: what the copier calls (:meth:`fetch_into`, in its worker thread)."""

    def __init__(self, group: PeerGroup, peer: _Peer, fidx: int, path_hash: int) -> None:
        self.group, self.peer, self.fidx, self.path_hash = group, peer, fidx, path_hash

    def fetch_into(self, dst: int, expected: Fingerprint, hasher: xxhash.xxh3_64 | None,
                   alive: Callable[[], None]) -> int:
        """Write the peer's copy of the version ``expected`` to ``dst`` (hashing it into ``hasher``); its
        size.  :class:`PeerMiss` (counted) if the peer does not give exactly that, or is down: the caller starts
        over from the backing."""
        group, peer = self.group, self.peer
        started = time.monotonic()
        probe = group._admit(peer)
        if probe is None:
            group._ended(peer, "down", probe=False, started=started)
            raise PeerMiss("down", "it refused or timed out, and its window is not over (or another probes it)")
        reason = "error"
        try:
            n = self._fetch(dst, expected, hasher, alive)
            reason = ""
        except PeerMiss as miss:
            reason = miss.reason
            raise
        except TimeoutError as exc:
            reason = "timeout"
            raise PeerMiss(reason, str(exc)) from None
        except OSError as exc:
            reason = "refused" if exc.errno in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH) else \
                "short" if exc.errno in (errno.ECONNRESET, errno.EPIPE) else "error"
            raise PeerMiss(reason, str(exc)) from None
        finally:  # (whatever ended it: the probe is given back)
            group._ended(peer, reason or None, probe=probe, started=started, nbytes=0 if reason else n)
        return n

    def _fetch(self, dst: int, expected: Fingerprint, hasher: xxhash.xxh3_64 | None,
               alive: Callable[[], None]) -> int:
        group, peer = self.group, self.peer
        sock, kept = group._connection(peer)
        whole = False  # (the exchange ended where the next one starts: the connection may be kept)
        try:
            try:
                answer = self._ask(sock, expected)
            except _Gone:
                if not kept:
                    raise
                sock.close()  # (the server closed the kept connection meanwhile: once more, on a new one)
                sock = group._connect(peer)
                answer = self._ask(sock, expected)
            if answer.status != _OK:
                whole = True
                raise PeerMiss("not_held" if answer.status in (_NOT_HELD, _UNKNOWN) else "other_version")
            sent = answer.fp  # (the same check as before kept connections: the answer against the request)
            if sent != expected or answer.size != expected[0]:
                raise PeerMiss("other_version", f"the peer sent {sent}, asked {expected}")  # (its bug)
            total = self._receive(sock, dst, answer.size, hasher, alive)
            whole = True
        finally:
            if whole:
                group._keep(peer, sock)
            else:
                sock.close()
        if hasher is not None and answer.has_digest and hasher.intdigest() != answer.digest:
            raise PeerMiss("digest", "the bytes received do not hash to the peer's copy's xxh3")
        return total

    def _ask(self, sock: socket.socket, expected: Fingerprint) -> _Answer:
        link = self.group.link
        assert link is not None
        deadline = time.monotonic() + self.group.timeout  # (the hello and the answer's header: one deadline)
        return _ask(sock, link.token, link.rank, self.fidx, self.path_hash, expected, deadline)

    def _receive(self, sock: socket.socket, dst: int, size: int, hasher: xxhash.xxh3_64 | None,
                 alive: Callable[[], None]) -> int:
        """The copy's ``size`` bytes, written to ``dst``."""
        sock.settimeout(self.group.timeout)  # (the bytes: a deadline per chunk, however large the file)
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
        return total


def _ask(sock: socket.socket, token: bytes, rank: int, fidx: int, path_hash: int, expected: Fingerprint,
         deadline: float) -> _Answer:
    """The request's exchange up to the copy's bytes (module docstring, "The wire"): the answer's header, once
    it proves the token (else :class:`PeerMiss`)."""
    magic, server_nonce = _HELLO.unpack(_recv_exactly(sock, _HELLO.size, deadline))
    if magic != _MAGIC:
        raise PeerMiss("error", f"not a tierfs peer of this version (hello {magic!r}, expected {_MAGIC!r})")
    client_nonce = secrets.token_bytes(_NONCE)
    request = _REQUEST.pack(_MAGIC, rank, fidx, path_hash, *expected, client_nonce)
    sock.settimeout(max(deadline - time.monotonic(), 0.001))
    try:
        sock.sendall(request + _mac(token, b"request", server_nonce, request))
    except (ConnectionResetError, BrokenPipeError) as exc:
        raise _Gone(str(exc)) from None
    raw = _recv_exactly(sock, _ANSWER.size + _MAC, deadline)
    head = raw[:_ANSWER.size]
    if not hmac.compare_digest(raw[_ANSWER.size:], _mac(token, b"answer", client_nonce, server_nonce, head)):
        raise PeerMiss("error", "the answer does not prove this job's token")
    magic, status, size, *rest = _ANSWER.unpack(head)
    return _Answer(status, size, tuple(rest[:4]), rest[4], bool(rest[5]))


# =========================================================================================== serving

class PinsForPeers(Protocol):
    """What the server needs of the pin keeper (:class:`~tierfs.daemon.serving.pins.PinKeeper` implements it)."""

    def for_peer(self, entry: CacheEntry) -> None:
        """Keep ``entry`` on disk while it is sent."""

    def peer_done(self, entry: CacheEntry) -> None:
        """It was sent (or the send failed): undo :meth:`for_peer`."""


@dataclass
class _Caller:
    """An accepted connection on its way to a proven request (the doorman's), then the request (a server
    thread's), then, kept, on its way to the next request (the doorman's again)."""

    conn: socket.socket
    deadline: float  # (monotonic) its proven request answered by then, or the connection closed
    nonce: bytes  # the server's, sent in the latest hello
    received: bytearray = dataclasses.field(default_factory=bytearray)
    rank: int = -1  # (once a request proved the token) the rank it came from


@dataclass(frozen=True)
class _Proven:
    """A request that proved the job's token: what a server thread answers."""

    caller: _Caller
    rank: int
    fidx: int
    path_hash: int
    fp: Fingerprint
    client_nonce: bytes


class _Doorman:
    """Accepts every connection to the port and keeps those from the job's addresses, non-blocking, until each
    proves the token in a request (then handed to the server threads' queue) or is closed: past its deadline, or
    the oldest of more than :data:`PENDING`.  A connection whose request was answered comes back (:meth:`keep`)
    and is held the same way for its next one, up to :data:`IDLE_S`, at most :data:`POOL` per rank.  :meth:`run`
    in a thread of its own; :meth:`stop` and :meth:`keep` from any."""

    def __init__(self, listener: socket.socket, link: PeerLink, group: PeerGroup,
                 proven: queue.SimpleQueue[_Proven | None]) -> None:
        self.listener, self.token, self.group, self.proven = listener, link.token, group, proven
        self.members = link.member_hosts()
        # (each in insertion order: the oldest first, the earliest deadline first)
        self.pending: dict[socket.socket, _Caller] = {}  # accepted, not proven yet
        self.idle: dict[socket.socket, _Caller] = {}  # kept, waiting for the next request (IDLE_S)
        self.asking: dict[socket.socket, _Caller] = {}  # kept, the next request coming in (peer_timeout)
        self._idle_of: dict[int, int] = {}  # idle callers by rank
        self._back: list[_Caller] = []  # answered, from the server threads (under _lock)
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._stopping = False
        self._sel = selectors.DefaultSelector()

    def stop(self) -> None:
        self._stopping = True
        self._wake()

    def keep(self, caller: _Caller) -> None:
        """(a server thread) ``caller`` was answered and sent its next hello: hold it for its next request
        (closed at once if the doorman stopped)."""
        with self._lock:
            held = not self._stopping
            if held:
                self._back.append(caller)
        if held:
            self._wake()
        else:
            caller.conn.close()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # (a full pipe: it wakes already)
            self._wake_w.send(b"x")

    def run(self) -> None:
        self.listener.setblocking(False)
        self._wake_r.setblocking(False)
        self._sel.register(self.listener, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        held = (self.pending, self.asking, self.idle)
        try:
            while not self._stopping:
                first = min((next(iter(d.values())).deadline for d in held if d), default=None)
                events = self._sel.select(None if first is None else max(first - time.monotonic(), 0))
                for key, _ in events:
                    if key.fileobj is self.listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._readmit()
                    elif key.data is not None and key.data.conn.fileno() >= 0:  # (not closed this round)
                        self._receive(key.data)
                now = time.monotonic()
                for d in held:
                    while d and (due := next(iter(d.values()))).deadline <= now:
                        self._turn_away(due, counted=d is not self.idle)  # (an idle one's peer let it go)
                self.group.kept(len(self.idle) + len(self.asking))
        finally:
            with self._lock:
                self._stopping = True
                back, self._back = self._back, []
            for caller in back:
                caller.conn.close()
            for d in held:
                for caller in list(d.values()):
                    self._turn_away(caller, counted=False)
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()

    def _accept(self) -> None:
        """Every connection waiting (at most 128 a round: the callers already in get their turn)."""
        for _ in range(128):
            try:
                conn, addr = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # (out of descriptors: the oldest unproven caller's is the one to give back)
                    first = next(iter(self.pending.values()), None)
                    if first is None:
                        time.sleep(0.05)
                    else:
                        self._turn_away(first)
                    return
                continue  # (a connection reset before its accept, or a network error Linux passes on: the next)
            if _numeric(addr[0]) not in self.members:
                conn.close()  # (not one of the job's nodes: not even a hello)
                self.group.stranger()
                continue
            caller = _Caller(conn, time.monotonic() + self.group.timeout, secrets.token_bytes(_NONCE))
            try:
                conn.setblocking(False)
                if conn.send(_HELLO.pack(_MAGIC, caller.nonce)) != _HELLO.size:
                    raise BlockingIOError  # (a fresh connection's buffer takes the 20 bytes, or it is gone)
            except OSError:
                conn.close()
                continue
            if len(self.pending) >= PENDING:
                self._turn_away(next(iter(self.pending.values())))
            self.pending[conn] = caller
            self._sel.register(conn, selectors.EVENT_READ, caller)

    def _readmit(self) -> None:
        """The connections the server threads answered, held for their next request."""
        with contextlib.suppress(OSError):
            self._wake_r.recv(4096)
        with self._lock:
            back, self._back = self._back, []
        for caller in back:
            if self._idle_of.get(caller.rank, 0) >= POOL:  # (the rank's oldest: its client keeps no more)
                self._turn_away(next(c for c in self.idle.values() if c.rank == caller.rank), counted=False)
            caller.received = bytearray()
            caller.deadline = time.monotonic() + IDLE_S
            caller.conn.setblocking(False)
            self.idle[caller.conn] = caller
            self._idle_of[caller.rank] = self._idle_of.get(caller.rank, 0) + 1
            self._sel.register(caller.conn, selectors.EVENT_READ, caller)

    def _take(self, caller: _Caller) -> dict[socket.socket, _Caller]:
        """Take ``caller`` out of the callers held (and the selector's); where it was."""
        self._sel.unregister(caller.conn)
        for held in (self.pending, self.asking, self.idle):
            if held.pop(caller.conn, None) is not None:
                if held is self.idle:
                    self._idle_of[caller.rank] -= 1
                return held
        raise KeyError(caller)

    def _receive(self, caller: _Caller) -> None:
        """What ``caller`` sent; once its request is whole, proven (to the server threads) or turned away."""
        size = _REQUEST.size + _MAC
        try:
            chunk = caller.conn.recv(size - len(caller.received))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if caller.conn in self.idle:
            if not chunk:
                self._turn_away(caller, counted=False)  # (its peer let a kept connection go)
                return
            self._take(caller)  # (the next request's first bytes: its deadline from now)
            caller.deadline = time.monotonic() + self.group.timeout
            self.asking[caller.conn] = caller
            self._sel.register(caller.conn, selectors.EVENT_READ, caller)
        caller.received += chunk
        if chunk and len(caller.received) < size:
            return
        self._take(caller)
        request = bytes(caller.received[:_REQUEST.size])
        if not chunk or not hmac.compare_digest(bytes(caller.received[_REQUEST.size:]),
                                                _mac(self.token, b"request", caller.nonce, request)):
            caller.conn.close()  # (gone early, another job's, or a request proven for another nonce: a replay)
            self.group.stranger()
            return
        _, rank, fidx, path_hash, *fp, client_nonce = _REQUEST.unpack(request)
        caller.rank = rank
        self.proven.put(_Proven(caller, rank, fidx, path_hash, tuple(fp), client_nonce))

    def _turn_away(self, caller: _Caller, counted: bool = True) -> None:
        self._take(caller)
        caller.conn.close()
        if counted:
            self.group.stranger()


class PeerServer:
    """Sends this node's committed copies to its peers (see the module docstring); :meth:`run` in the mount's
    nursery, the sockets in threads of their own: the doorman's, and :data:`SERVING` server threads."""

    def __init__(self, group: PeerGroup, tree: Tree, cache: CacheStore, pins: PinsForPeers) -> None:
        self.group, self.tree, self.cache, self.pins = group, tree, cache, pins
        self._token: trio.lowlevel.TrioToken | None = None
        self._key = b""  # the job's token (run())
        self._proven: queue.SimpleQueue[_Proven | None] = queue.SimpleQueue()  # (run()'s: the doorman's to the threads)
        self._doorman: _Doorman | None = None  # (run()'s)

    async def run(self) -> None:
        """Accept and serve in threads until cancelled (the listening socket then closes)."""
        link = self.group.link
        if link is None or link.listener is None or not self.group.enabled:
            return
        self._token, self._key = trio.lowlevel.current_trio_token(), link.token
        self._proven = queue.SimpleQueue()  # (a fresh one: a run after a failed one finds no stale stop)
        doorman = self._doorman = _Doorman(link.listener, link, self.group, self._proven)
        threads = [threading.Thread(target=doorman.run, name="tierfs-peer-door", daemon=True)]
        threads += [threading.Thread(target=self._serve_proven, name="tierfs-peer", daemon=True)
                    for _ in range(SERVING)]
        for thread in threads:
            thread.start()
        try:
            await trio.sleep_forever()
        finally:
            doorman.stop()
            for _ in range(SERVING):
                self._proven.put(None)
            threads[0].join(5)  # (the doorman answers at once: its listener closes after it let go of it)
            link.close()

    def _serve_proven(self) -> None:
        """(a server thread) Proven requests, one at a time, until ``None``; a connection answered whole goes
        back to the doorman with its next hello."""
        assert self._doorman is not None
        while (request := self._proven.get()) is not None:
            caller = request.caller
            kept = False
            try:
                if time.monotonic() < caller.deadline:  # (else it waited too long: its peer gave up)
                    kept = self._serve(request) and self._next_hello(caller)
            finally:
                if kept:
                    self._doorman.keep(caller)
                else:
                    caller.conn.close()

    def _next_hello(self, caller: _Caller) -> bool:
        """(a server thread) The next request's hello, a fresh nonce, sent on ``caller``'s connection."""
        caller.nonce = secrets.token_bytes(_NONCE)
        try:
            caller.conn.settimeout(self.group.timeout)
            caller.conn.sendall(_HELLO.pack(_MAGIC, caller.nonce))
        except OSError:
            return False
        return True

    def _serve(self, request: _Proven) -> bool:
        """(a server thread) One proven request: the copy, or why not; whether the answer went whole."""
        conn, deadline = request.caller.conn, request.caller.deadline
        conn.setblocking(True)
        try:
            lent = trio.from_thread.run_sync(self._lend, request.fidx, request.path_hash, request.fp,
                                             trio_token=self._token)
        except trio.RunFinishedError:
            return False
        if not isinstance(lent, CacheEntry):
            try:
                conn.settimeout(max(deadline - time.monotonic(), 0.001))
                conn.sendall(self._answer(request, lent, 0, (0, 0, 0, 0), None))
            except OSError:
                return False
            return True
        try:
            return self._send(conn, request, lent)
        finally:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self.pins.peer_done, lent, trio_token=self._token)

    def _answer(self, request: _Proven, status: int, size: int, fp: Fingerprint, digest: int | None) -> bytes:
        head = _ANSWER.pack(_MAGIC, status, size, *fp, digest or 0, digest is not None)
        return head + _mac(self._key, b"answer", request.client_nonce, request.caller.nonce, head)

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

    def _send(self, conn: socket.socket, request: _Proven, entry: CacheEntry) -> bool:
        """(a server thread) The header and the copy's bytes, by ``sendfile``; a copy found damaged is "not
        held" (the data path repairs it at its next open).  Whether the answer went whole."""
        conn.settimeout(max(request.caller.deadline - time.monotonic(), 0.001))  # (the header: by the deadline)
        try:
            fd = open_copy(self.cache.data_fd, entry.name, entry.size, entry.copy_id)
        except (CopyDamaged, OSError):
            try:
                conn.sendall(self._answer(request, _NOT_HELD, 0, (0, 0, 0, 0), None))
            except OSError:
                return False
            return True
        try:
            conn.sendall(self._answer(request, _OK, entry.size, entry.fp, entry.digest))
            conn.settimeout(self.group.timeout)  # (the bytes, to a proven peer: a deadline per send)
            with open(fd, "rb", closefd=False) as f:
                sent = conn.sendfile(f, 0, entry.size) if entry.size else 0  # (os.sendfile, waiting within the timeout)
            if sent != entry.size:
                return False  # (the copy shrank under us: the requester sees a short read, a miss)
            self.group.served(request.rank, sent)
            return True
        except OSError:
            return False  # the requester went (its deadline): its miss
        finally:
            os.close(fd)
