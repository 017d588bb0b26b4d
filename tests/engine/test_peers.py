"""Peers (issue 27) without MPI or FUSE: two engines of one job (rank 0 and 1 of 2) in one trio run, each with a
real listening socket on 127.0.0.1 and a cache of its own over one backing dir; a copy of a file the other node
owns comes from that node's cache; a peer that offers another version, refuses or stalls is a miss, and the
file comes from the backing.  (The same over real mounts and ``mpiexec -n 4``: tests/mpi/test_peers.py.)"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import secrets
import select
import socket
import threading
import time
from pathlib import Path

import pytest
import trio

from tierfs.common.options import MountConfig, Settings
from tierfs.daemon.coordinator.engine import Engine
from tierfs.daemon.staging import peers
from tierfs.daemon.staging.copier import copy_into_cache
from tierfs.daemon.staging.peers import PeerLink, listen
from tierfs.daemon.tree.tree import fingerprint
from tierfs.testing.harness import make_dataset


def _disk_total(backing) -> int:
    block = os.statvfs(backing).f_frsize
    return sum(max(block, -(-os.path.getsize(os.path.join(r, f)) // block) * block)
               for r, _, fs in os.walk(backing) for f in fs)


@pytest.fixture
def pair(tmp_path, dataset):
    """Factory: ``pair(addresses=None, capacity=None, backing=..., **settings)`` -> [engine of rank 0, engine of
    rank 1], opened, each listening on 127.0.0.1; ``addresses`` replaces the group's (a dead or stalled peer; a
    function: of the listening addresses, as when a relay stands in the way);
    ``backing`` the data set (default: the ``dataset`` fixture's).  Caps: together they hold the data set,
    singly its half plus two mini-epochs' shares."""
    made: list[Engine] = []

    def factory(addresses=None, capacity=None, backing=dataset[0], **settings) -> list[Engine]:
        socks = [listen("127.0.0.1") for _ in range(2)]
        addrs = [a for _, a in socks]
        addrs = addresses(addrs) if callable(addresses) else addresses or addrs
        token = secrets.token_bytes(16)  # (the job's: rank 0 draws it, MPI gives it to every rank)
        for r, (sock, _) in enumerate(socks):
            link = PeerLink(r, 2, list(addrs), sock, token)
            cfg = MountConfig(backing=os.fspath(backing), mountpoint=os.fspath(tmp_path / f"mnt{r}"),
                              cache=os.fspath(tmp_path / f"cache{r}"),
                              capacity=capacity or int(_disk_total(backing) * 0.8),
                              settings=Settings(**{"nm": 4, "rf": 50, "seed": 5, "rank": r, "world_size": 2,
                                                   "peers": "mpi", "peer_timeout": 0.5, **settings}))
            e = Engine(cfg, link)
            e.open()
            made.append(e)
        return made[-2:]

    yield factory
    for e in made:
        e.close()


@contextlib.asynccontextmanager
async def _running(*engines):
    """A nursery with ``engines`` running in it (``cancel_scope.cancel()`` ends them)."""
    async with trio.open_nursery() as n:
        for e in engines:
            await n.start(e.run)
        yield n


async def _settled(engines, t) -> None:
    for e in engines:
        await t.settle(e)


async def _walk(engines, t, until: tuple[int, int]) -> None:
    """Advance every engine mini-epoch by mini-epoch (each switch once the next one is staged) to ``until``,
    reading every view on the way and checking its bytes."""
    while engines[0].passes.current_mini_epoch < until:
        await _settled(engines, t)
        for e in engines:
            await t.read_view(e)
            e.passes.request_advance()  # (rf is high: passes never switch, advance does, the next one being staged)
    assert all(e.passes.current_mini_epoch == until for e in engines)
    await _settled(engines, t)


def test_after_the_first_epoch_a_node_stages_from_its_peer_and_reads_no_backing_bytes(pair, t):
    engines = pair()

    async def main() -> None:
        async with _running(*engines) as n:
            await _walk(engines, t, (1, 0))
            before = [e.backing.statistics().bytes_read for e in engines]
            await _walk(engines, t, (2, 1))
            after = [e.backing.statistics().bytes_read for e in engines]
            n.cancel_scope.cancel()
        assert after == before  # epoch 1 and the start of 2: every copy from the other node's cache
        for e in engines:
            p = e.peers.statistics(e.cache)
            assert p.fetched_files > 0 and p.served_files > 0, p
            assert p.owned_cached_files == p.owned_files > 0  # the owned share stayed (the caps allow it)
            assert e.cache.disk_bytes() <= e.config.capacity

    t.run(main)
    assert sum(e.peers.statistics(e.cache).misses["not_held"] for e in engines) == 0


def test_a_peer_holding_another_version_is_refused_and_the_backing_copied(pair, t):
    a, b = pair()

    async def main() -> None:
        async with _running(a, b) as n:
            await _settled([a, b], t)
            fidx = int(next(f for f in a.schedule.current if a.cache.get(int(f)) is not None))
            path = os.path.join(a.config.backing, os.fsdecode(a.tree.file_path(fidx)))
            old = Path(path).read_bytes()
            with open(path, "r+b") as f:  # same size, other bytes, a later mtime: another version
                f.write(bytes(255 - c for c in old))
            os.utime(path, ns=(time.time_ns() + 10**9,) * 2)
            new = Path(path).read_bytes()
            # rank 1 copies it as it would after its own stat of the backing saw the change (a's tree has not yet)
            b.tree.update_stat(fidx, os.stat(path))
            node = b.tree.file_node(fidx)
            copied = await trio.to_thread.run_sync(functools.partial(
                copy_into_cache, b.backing.root_fd, b.backing.dev, node.path, fingerprint(node.st), b.cache.data_fd,
                b.cache.next_serial(), sparse=False, hash_content=False, throttle=None, block=b.cache.block,
                peer=b.peers.source_for(fidx)))
            n.cancel_scope.cancel()
        assert not copied.from_peer
        assert Path(b.cache.data_path, copied.name).read_bytes() == new != old
        assert b.peers.statistics(b.cache).misses["other_version"] == 1
        assert b.peers.statistics(b.cache).fetched_files == 0

    t.run(main)


def _held_by(a: Engine, b: Engine) -> int:
    """A file of at least 256 bytes ``a`` owns and holds (``b`` asks ``a`` for it)."""
    return next(int(f) for f in a.schedule.current if a.cache.get(int(f)) is not None
                and int(a.peers.owners[f]) == a.peers.rank and a.cache.get(int(f)).size >= 256)


def _recv_all(sock: socket.socket) -> bytes:
    """Everything the other side sends until it closes (within 10 s)."""
    got = bytearray()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        sock.settimeout(deadline - time.monotonic())
        try:
            chunk = sock.recv(1 << 16)
        except ConnectionResetError:
            break
        if not chunk:
            break
        got += chunk
    return bytes(got)


def test_a_request_without_the_jobs_token_gets_no_byte(pair, t):
    a, b = pair()

    def ask(token: bytes) -> bytes:
        """Ask ``a`` for a file it holds, as a peer would, with ``token``; what came after the hello."""
        fidx = _held_by(a, b)
        with socket.create_connection(a.peers.link.addresses[0], timeout=10) as sock:
            try:
                answer = peers._ask(sock, token, 1, fidx, a.tree.path_hash_of(fidx),
                                    fingerprint(a.tree.file_node(fidx).st), time.monotonic() + 10)
            except peers.PeerMiss:
                return b""
            return answer.size.to_bytes(8, "big") + peers._recv_exactly(sock, answer.size, time.monotonic() + 10)

    async def main() -> None:
        async with _running(a, b) as n:
            await _settled([a, b], t)
            stranger = await trio.to_thread.run_sync(ask, bytes(16))
            member = await trio.to_thread.run_sync(ask, a.peers.link.token)
            n.cancel_scope.cancel()
        assert stranger == b""  # (not even a "not held")
        assert len(member) > 8  # the header and the bytes: the same request with the token
        assert a.peers.statistics(a.cache).strangers == 1

    t.run(main)


class _Relay:
    """A TCP relay on 127.0.0.1 in front of ``target`` that records what each connection's client sent (a
    sniffer on the path) and what came back; it connects to ``target`` from ``source`` (a node outside the
    job when not 127.0.0.1).  While ``stalled`` is set it forwards nothing, and accepts connections and holds
    them without a byte (a stopped daemon: its port accepts, nothing answers).  A thread, one connection
    forwarded at a time (those after it wait in the backlog); closed by :meth:`close`."""

    def __init__(self, target: tuple[str, int], source: str = "127.0.0.1", stalled: bool = False) -> None:
        self.target, self.source = target, source
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        self.sent: list[bytes] = []  # per connection: client -> target
        self.answered: list[bytes] = []  # per connection: target -> client
        self.accepted = 0
        self.held: list[socket.socket] = []  # accepted while stalled
        self.stalled = threading.Event()
        if stalled:
            self.stalled.set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with contextlib.suppress(OSError):
            while not self._stop.is_set():
                client, _ = self.listener.accept()
                self.accepted += 1
                if self.stalled.is_set():
                    self.held.append(client)
                    continue
                with client, socket.create_connection(self.target, timeout=10,
                                                      source_address=(self.source, 0)) as server:
                    self._pump(client, server)

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        sent, answered = bytearray(), bytearray()
        self.sent.append(sent)
        self.answered.append(answered)
        ends = {client: (server, sent), server: (client, answered)}
        deadline = time.monotonic() + 30
        while ends and time.monotonic() < deadline and not self._stop.is_set():
            if self.stalled.is_set():
                self._stop.wait(0.05)
                continue
            readable, _, _ = select.select(list(ends), [], [], 0.1)
            for sock in readable:
                other, record = ends[sock]
                try:
                    chunk = sock.recv(1 << 16)
                except OSError:
                    chunk = b""
                if not chunk:
                    with contextlib.suppress(OSError):
                        other.shutdown(socket.SHUT_WR)
                    del ends[sock]
                    continue
                record += chunk
                with contextlib.suppress(OSError):
                    other.sendall(chunk)

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self._thread.join(15)
        for sock in self.held:
            sock.close()


def _fetch(a: Engine, b: Engine, fidx: int, tmp_path) -> int:
    """(a thread) ``b`` asks ``a`` for ``fidx`` as its stager does; the bytes' count, or -1 for a miss."""
    got = _fetch_or_why(a, b, fidx, tmp_path / f"fetched-{fidx}")
    return got if isinstance(got, int) else -1


def _fetch_or_why(a: Engine, b: Engine, fidx: int, path: Path) -> int | str:
    """(a thread) ``b`` asks ``a`` for ``fidx`` into ``path`` as its stager does: the bytes' count, or the
    miss's reason ("down" too when the stager would not even make the request)."""
    with open(path, "wb") as dst:
        fetch = b.peers.source_for(fidx)
        if fetch is None:
            return "down"
        assert fetch.peer.rank == a.peers.rank
        try:
            return fetch.fetch_into(dst.fileno(), fingerprint(b.tree.file_node(fidx).st), None, lambda: None)
        except peers.PeerMiss as miss:
            return miss.reason


def _held_files(a: Engine) -> list[int]:
    """Files ``a`` owns and holds (its peer asks ``a`` for them)."""
    return [int(f) for f in a.schedule.current
            if a.cache.get(int(f)) is not None and int(a.peers.owners[f]) == a.peers.rank]


def test_a_sniffed_request_sent_again_gets_no_byte(pair, t, tmp_path):
    # rank 1 reaches rank 0 through a relay that records its requests: two files, asked on one kept connection.
    # The first request's recording, sent again on a new connection from the same address, and the second's,
    # sent again on a connection that has just carried a proven request, must get nothing of the files (today's
    # token went in clear, and a kept connection's next request gets a nonce of its own)
    relay: list[_Relay] = []

    def through_relay(real):
        relay.append(_Relay(real[0]))
        return [relay[0].address, real[1]]

    a, b = pair(addresses=through_relay)
    one = peers._REQUEST.size + peers._MAC

    async def main() -> tuple[list[int], list[bytes], bytes, bytes]:
        async with _running(a, b) as n:
            await _settled([a, b], t)
            files = [f for f in _held_files(a) if a.cache.get(f).size >= 256][:2]
            got = [await trio.to_thread.run_sync(_fetch, a, b, f, tmp_path) for f in files]
            data = [(tmp_path / f"fetched-{f}").read_bytes() for f in files]

            def replay_first() -> bytes:
                with socket.create_connection(relay[0].target, timeout=10) as sock:
                    sock.sendall(relay[0].sent[0][:one])
                    return _recv_all(sock)

            def replay_second() -> bytes:
                with socket.create_connection(relay[0].target, timeout=10) as sock:  # (a member's, a file first)
                    fidx = files[0]
                    answer = peers._ask(sock, a.peers.link.token, 1, fidx, a.tree.path_hash_of(fidx),
                                        fingerprint(a.tree.file_node(fidx).st), time.monotonic() + 10)
                    assert peers._recv_exactly(sock, answer.size, time.monotonic() + 10) == data[0]
                    sock.sendall(relay[0].sent[0][one:2 * one])
                    return _recv_all(sock)

            first = await trio.to_thread.run_sync(replay_first)
            second = await trio.to_thread.run_sync(replay_second)
            n.cancel_scope.cancel()
        return got, data, first, second

    try:
        got, data, first, second = t.run(main)
    finally:
        relay[0].close()
    assert got == [len(d) for d in data] and min(got) >= 256  # (the member's fetches, through the relay ...)
    assert len(relay[0].sent) == 1 and len(relay[0].sent[0]) == 2 * one  # (... two requests on one connection)
    assert all(d in relay[0].answered[0] for d in data)
    for answer in (first, second):
        assert not any(d in answer or d[:64] in answer for d in data)
        assert len(answer) <= peers._HELLO.size  # the challenge, and nothing after it
    assert a.peers.statistics(a.cache).strangers == 2


def test_a_connection_from_outside_the_job_is_dropped_at_accept(pair, t, tmp_path):
    # rank 1 holds the token but its connections reach rank 0 from 127.0.0.2, no address of the job's
    relay: list[_Relay] = []

    def from_outside(real):
        relay.append(_Relay(real[0], source="127.0.0.2"))
        return [relay[0].address, real[1]]

    a, b = pair(addresses=from_outside)

    async def main() -> int:
        async with _running(a, b) as n:
            await _settled([a, b], t)
            got = await trio.to_thread.run_sync(_fetch, a, b, _held_by(a, b), tmp_path)
            n.cancel_scope.cancel()
        return got

    try:
        got = t.run(main)
    finally:
        relay[0].close()
    assert got == -1 and relay[0].answered == [b""]  # not a byte, not even the challenge
    assert a.peers.statistics(a.cache).strangers == 1 and a.peers.statistics(a.cache).served_files == 0


class _Flood:
    """An attack on ``target``'s peer port from an address of the job (another user on one of its nodes), in a
    thread: ``idle`` connections kept open that send nothing (a new wave each second, the last one closed:
    the port may close them), and ``slow`` ones that send a byte each 1/16 s (reopened when closed).  Bounded:
    it stops at :meth:`close` or after 120 s."""

    def __init__(self, target: tuple[str, int], idle: int = 2000, slow: int = 32) -> None:
        self.target, self.idle_n, self.slow_n = target, idle, slow
        self.idle: list[socket.socket] = []
        self.slow: list[socket.socket] = []
        self.opened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _open(self) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.connect_ex(self.target)  # (not waited for: beyond a full backlog it stays half-open)
        self.opened += 1
        return sock

    def _run(self) -> None:
        deadline = time.monotonic() + 120
        next_wave = 0.0
        while not self._stop.is_set() and time.monotonic() < deadline:
            if time.monotonic() >= next_wave:
                for sock in self.idle:
                    sock.close()
                self.idle = []
                for _ in range(self.idle_n // 200):  # (200 at a time: a backlog's worth, not a SYN flood)
                    self.idle += [self._open() for _ in range(200)]
                    if self._stop.wait(0.02):
                        break
                next_wave = time.monotonic() + 1.0
            self.slow += [self._open() for _ in range(self.slow_n - len(self.slow))]
            for sock in list(self.slow):
                try:
                    sock.send(b"\x00")
                except BlockingIOError:
                    pass  # (still connecting)
                except OSError:
                    sock.close()
                    self.slow.remove(sock)
            self._stop.wait(1 / 16)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30)
        for sock in self.idle + self.slow:
            sock.close()


@pytest.fixture
def many_fds():
    """The soft limit on open files raised for a flood (2,000 sockets and the port's side of them)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 8192 if hard == resource.RLIM_INFINITY else min(hard, 8192)
    if want < 6000:
        pytest.skip(f"the hard limit on open files ({hard}) is too low for 2,000 connections each side")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.slow
def test_under_idle_and_slow_connections_the_peers_keep_fetching(pair, t, many_fds):
    # 2,000 idle connections and 32 trickling a byte at a time at rank 0's port, from an address of the job:
    # epochs 1 and 2 still come from the other node's cache, every copy (none from the slow tier)
    engines = pair(peer_timeout=2)
    a = engines[0]

    async def main() -> None:
        async with _running(*engines) as n:
            await _walk(engines, t, (1, 0))
            before = [e.backing.statistics().bytes_read for e in engines]
            fetched = engines[1].peers.statistics(engines[1].cache).fetched_files
            flood = _Flood(a.peers.link.addresses[0])
            try:
                await trio.sleep(1.5)  # (the first wave in, the trickles going)
                with trio.fail_after(120):
                    await _walk(engines, t, (3, 1))
                assert flood.opened >= 2000 + 32
            finally:
                await trio.to_thread.run_sync(flood.close)
            after = [e.backing.statistics().bytes_read for e in engines]
            n.cancel_scope.cancel()
        assert after == before, [e.peers.statistics(e.cache).misses for e in engines]
        assert engines[1].peers.statistics(engines[1].cache).fetched_files > fetched  # (from rank 0, under the flood)
        assert a.peers.statistics(a.cache).strangers >= 2000  # (the flood, turned away)

    t.run(main)


def test_by_default_the_port_listens_on_the_announced_address_only():
    sock, announced = listen("")
    with sock:
        assert sock.getsockname() == announced  # (not 0.0.0.0: every interface, the job's network or not)
    sock, announced = listen("0.0.0.0")  # (every interface, when asked for)
    with sock:
        assert sock.getsockname()[0] == "0.0.0.0" and announced[0] != "0.0.0.0"


@pytest.mark.parametrize("peer", ["refused", "timeout"])
def test_a_dead_or_stalled_peer_is_a_miss_and_the_file_comes_from_the_backing(pair, t, peer):
    # rank 1's peer (rank 0) is a closed port, or a socket that accepts and never answers
    silent = socket.create_server(("127.0.0.1", 0))
    closed = socket.create_server(("127.0.0.1", 0))
    dead = closed.getsockname()
    closed.close()
    gone = dead if peer == "refused" else silent.getsockname()
    _, b = pair(addresses=[gone, ("127.0.0.1", 1)])

    async def main() -> None:
        async with trio.open_nursery() as n:
            await n.start(b.run)
            await t.settle(b)
            b.passes.request_advance()
            await t.settle(b)
            b.passes.request_advance()
            with trio.fail_after(60):  # (a deadline of 0.5 s per peer call; then down, probed once a window)
                await _walk([b], t, (1, 1))
            n.cancel_scope.cancel()

    try:
        t.run(main)
    finally:
        silent.close()
    p = b.peers.statistics(b.cache)
    assert p.misses[peer] >= 1 and p.fetched_files == 0
    assert p.peers[0].alive is False or p.misses["down"] > 0


def test_a_stalled_peer_costs_one_timeout_per_window_not_one_per_file(pair, t, tmp_path):
    # rank 1's peer (rank 0) accepts and never answers (a stopped daemon, a hung node) while rank 1 stages a whole
    # epoch of its files, 4 streams at once: only the requests already out when it went down, and one probe per
    # window, reach it; every other request for its files is a "down" miss without a connection
    backing = tmp_path / "many"
    make_dataset(backing, dirs=4, files_per_dir=32, max_size=4096, seed=6)
    relay: list[_Relay] = []

    def stalled(real):
        relay.append(_Relay(real[0], stalled=True))
        return [relay[0].address, real[1]]

    _, b = pair(addresses=stalled, backing=backing, staging_streams=4)

    async def main() -> None:
        async with trio.open_nursery() as n:
            await n.start(b.run)
            with trio.fail_after(120):
                await _walk([b], t, (2, 0))  # (epoch 1 whole: its files rank 0 owns asked of rank 0)
            n.cancel_scope.cancel()

    try:
        t.run(main)
    finally:
        relay[0].close()
    p = b.peers.statistics(b.cache)
    peer = p.peers[0]
    timeout = b.config.settings.peer_timeout
    assert p.fetched_files == 0 and p.misses["down"] >= 20  # (every file correct: _walk read them, the backing's)
    assert relay[0].accepted == peer.connections == p.misses["timeout"]  # (each connection: one timeout)
    assert peer.probes <= 3 and relay[0].accepted <= 4 + peer.probes  # (the streams out at once, the probes)
    assert peer.waited_s <= (2 + peer.probes) * timeout + 0.5, peer  # (those out at once waited together)
    assert not peer.alive and peer.backoff_s >= peers.DOWN_S


def test_the_window_doubles_while_a_peer_stays_down_and_starts_over_once_a_probe_is_answered(
        pair, t, tmp_path, monkeypatch):
    # (the first window 2 s, then 4 s, the cap: the copies asked "within it" start well inside it on a loaded box)
    monkeypatch.setattr(peers, "DOWN_S", 2.0)
    monkeypatch.setattr(peers, "DOWN_MAX_S", 4.0)
    relay: list[_Relay] = []

    def through_relay(real):
        relay.append(_Relay(real[0], stalled=True))
        return [relay[0].address, real[1]]

    a, b = pair(addresses=through_relay)
    asked = iter(range(1000))

    async def at_once(k: int) -> list[int | str]:
        """``k`` copies ask rank 0 for a file at once: each one's bytes or its miss's reason."""
        fidx = _held_by(a, b)
        results: list[int | str] = []

        async def one() -> None:
            path = tmp_path / f"asked-{next(asked)}"
            results.append(await trio.to_thread.run_sync(_fetch_or_why, a, b, fidx, path))

        async with trio.open_nursery() as n:
            for _ in range(k):
                n.start_soon(one)
        return sorted(results, key=str)

    async def main() -> None:
        async with _running(a, b) as n:
            await _settled([a, b], t)
            size = a.cache.get(_held_by(a, b)).size

            def stats() -> peers.PeerStats:
                return b.peers.statistics(b.cache).peers[0]

            async def window_over() -> None:
                await trio.sleep(stats().backoff_s + 0.1)

            with trio.fail_after(60):
                assert await at_once(1) == ["timeout"]  # stalled: down, the first window
                assert stats().backoff_s == 2.0 and relay[0].accepted == 1 and not stats().alive
                assert await at_once(3) == ["down"] * 3  # within it: misses at once, no connection
                assert relay[0].accepted == 1
                await window_over()
                # the window over: of 4 copies at once one probes, on a connection of its own; the others are
                # "down" misses, never a second connection.  It fails: the window doubles
                assert await at_once(4) == ["down"] * 3 + ["timeout"]
                assert relay[0].accepted == 2 and stats().probes == 1 and stats().backoff_s == 4.0
                await window_over()
                assert await at_once(1) == ["timeout"]
                assert relay[0].accepted == 3 and stats().probes == 2 and stats().backoff_s == 4.0  # (the cap)
                relay[0].stalled.clear()  # it recovers: the next probe is answered, the peer is up
                await window_over()
                assert await at_once(1) == [size]
                assert stats().probes == 3 and stats().alive and stats().backoff_s == 0
                assert await at_once(1) == [size] and relay[0].accepted == 4  # (on the probe's, kept)
                relay[0].stalled.set()  # down again: the first window again, not the doubled one
                assert await at_once(1) == ["timeout"]
                assert stats().backoff_s == 2.0 and stats().probes == 3
            n.cancel_scope.cancel()
        p = b.peers.statistics(b.cache)
        assert p.fetched_files == 2 and p.misses["timeout"] == 4 and p.misses["down"] == 6

    try:
        t.run(main)
    finally:
        relay[0].close()


def test_kept_connections_carry_many_requests(pair, t):
    engines = pair(staging_streams=4)

    async def main() -> None:
        async with _running(*engines) as n:
            await _walk(engines, t, (2, 1))
            kept = [e.peers.statistics(e.cache).kept_connections for e in engines]
            n.cancel_scope.cancel()
        assert all(0 < k <= 4 for k in kept)  # (each node's server holds the other's kept connections)

    t.run(main)
    for e in engines:
        p = e.peers.statistics(e.cache)
        assert p.fetched_files >= 8 and sum(p.misses.values()) == 0
        assert 0 < p.connections <= 4 < p.requests  # (at most one a stream; a request a file)
        assert p.requests == p.fetched_files and p.peers[0].connections == p.connections


def test_a_kept_connection_the_peer_closed_meanwhile_is_tried_again_and_is_no_miss(pair, t, tmp_path,
                                                                                   monkeypatch):
    monkeypatch.setattr(peers, "IDLE_S", 0.3)  # (the server lets a kept connection go after 0.3 s, the client
    a, b = pair()  # keeps it KEEP_S: it meets one closed)

    async def main() -> tuple[list[int], int]:
        async with _running(a, b) as n:
            await _settled([a, b], t)
            files = _held_files(a)[:2]
            got = [await trio.to_thread.run_sync(_fetch, a, b, files[0], tmp_path)]
            await trio.sleep(1.0)  # (the server closed it)
            closed = a.peers.statistics(a.cache).kept_connections
            got.append(await trio.to_thread.run_sync(_fetch, a, b, files[1], tmp_path))
            n.cancel_scope.cancel()
        return got, closed

    got, closed = t.run(main)
    p = b.peers.statistics(b.cache)
    assert closed == 0 and min(got) >= 0 and p.fetched_files == 2 and sum(p.misses.values()) == 0
    assert p.connections == 2 and p.requests == 3  # (the second file: asked on the closed one, then a new one)
    assert p.peers[0].alive and a.peers.statistics(a.cache).strangers == 0


def test_placement_keeps_owned_copies_and_evicts_the_others_first(pair, t):
    a, b = pair()

    async def main() -> None:
        async with _running(a, b) as n:
            await _walk([a, b], t, (0, 3))
            for e in (a, b):
                owned = e.peers.owned()
                held = e.cache.held(e.tree.n_slots)
                # every file owned so far is still cached, past its mini-epoch; nothing else but the wanted ones
                staged = [int(f) for m in range(3) for f in e.schedule.plans[0][m]]
                assert all(held[f] for f in staged)
                assert not (held & ~owned & ~e.schedule.wanted).any()
                assert e.cache.disk_bytes() <= e.config.capacity
            n.cancel_scope.cancel()

    t.run(main)


def test_a_cap_too_small_for_the_owned_share_gives_up_owned_copies_for_the_mini_epochs(pair, t, dataset):
    # a third of the data set: two mini-epochs fit, the owned half does not -- the mini-epochs get their room
    a, b = pair(capacity=_disk_total(dataset[0]) // 3)

    async def main() -> None:
        async with _running(a, b) as n:
            await _walk([a, b], t, (1, 2))
            for e in (a, b):
                assert e.passes.next_ready()
                assert e.cache.disk_bytes() <= e.config.capacity
                p = e.peers.statistics(e.cache)
                assert 0 < p.owned_cached_files < p.owned_files
            n.cancel_scope.cancel()

    t.run(main)


@pytest.mark.slow
def test_after_the_first_epoch_the_staging_rate_is_the_peers_not_the_slow_tiers(pair, t, tmp_path):
    # The slow tier: backing reads capped at 32 kB/s (a peer's bytes are not: they are not the backing's), so the
    # first epoch's 256 KiB a node took at least 7 s.  What rf=auto reads (``rf_wanted``: consumption over this
    # rate) must be the rate the next mini-epochs stage at now, from the peer: a mount's average kept the slow
    # tier's (here at most twice the cap after epoch 1, and about as many epochs again to forget it).
    slow = 32_000
    backing = tmp_path / "big"
    make_dataset(backing, dirs=4, files_per_dir=8, min_size=16 << 10, max_size=16 << 10, seed=4)
    engines = pair(backing=backing, bandwidth=slow)

    async def main() -> None:
        async with _running(*engines) as n:
            await _walk(engines, t, (1, 3))
            n.cancel_scope.cancel()
        for e in engines:
            assert e.peers.statistics(e.cache).fetched_files > 0
            assert e.stager.bytes_per_s() > 4 * slow, (e.stager.bytes_per_s(), e.stager.statistics())
            assert e.status().staging.bytes_per_s == pytest.approx(e.stager.bytes_per_s(), rel=0.2)

    t.run(main)
