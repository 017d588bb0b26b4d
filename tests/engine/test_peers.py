"""Peers (issue 27) without MPI or FUSE: two engines of one job (rank 0 and 1 of 2) in one trio run, each with a
real listening socket on 127.0.0.1 and a cache of its own over one backing dir; a copy of a file the other node
owns comes from that node's cache; a peer that offers another version, refuses or stalls is a miss, and the
file comes from the backing.  (The same over real mounts and ``mpiexec -n 4``: tests/mpi/test_peers.py.)"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import socket
import time
from pathlib import Path

import pytest
import trio

from tierfs import peers
from tierfs.copier import copy_into_cache
from tierfs.engine import Engine
from tierfs.options import MountConfig, Settings
from tierfs.peers import PeerLink, listen
from tierfs.testing import make_dataset
from tierfs.tree import fingerprint


def _disk_total(backing) -> int:
    block = os.statvfs(backing).f_frsize
    return sum(max(block, -(-os.path.getsize(os.path.join(r, f)) // block) * block)
               for r, _, fs in os.walk(backing) for f in fs)


@pytest.fixture
def pair(tmp_path, dataset):
    """Factory: ``pair(addresses=None, capacity=None, backing=..., **settings)`` -> [engine of rank 0, engine of
    rank 1], opened, each listening on 127.0.0.1; ``addresses`` replaces the group's (a dead or stalled peer);
    ``backing`` the data set (default: the ``dataset`` fixture's).  Caps: together they hold the data set,
    singly its half plus two mini-epochs' shares."""
    made: list[Engine] = []

    def factory(addresses=None, capacity=None, backing=dataset[0], **settings) -> list[Engine]:
        socks = [listen("127.0.0.1") for _ in range(2)]
        addrs = addresses or [a for _, a in socks]
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
    while engines[0].current_mini_epoch < until:
        await _settled(engines, t)
        for e in engines:
            await t.read_view(e)
            e.request_advance()  # (rf is high: passes never switch, advance does, the next one being staged)
    assert all(e.current_mini_epoch == until for e in engines)
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


def test_a_request_without_the_jobs_token_gets_no_byte(pair, t):
    a, b = pair()

    def ask(token: bytes) -> bytes:
        """Ask ``a`` for a file it holds, as a peer would, with ``token``; what came back."""
        fidx = int(next(f for f in a.schedule.current if a.cache.get(int(f)) is not None))
        request = peers._REQUEST.pack(peers._MAGIC, token, 1, fidx, a.tree.path_hash_of(fidx),
                                      *fingerprint(a.tree.file_node(fidx).st))
        with socket.create_connection(a.peers.link.addresses[0], timeout=10) as sock:
            sock.sendall(request)
            got = bytearray()
            while chunk := sock.recv(1 << 16):
                got += chunk
        return bytes(got)

    async def main() -> None:
        async with _running(a, b) as n:
            await _settled([a, b], t)
            stranger = await trio.to_thread.run_sync(ask, bytes(16))
            member = await trio.to_thread.run_sync(ask, a.peers.link.token)
            n.cancel_scope.cancel()
        assert stranger == b""  # (not even a "not held")
        assert len(member) > peers._ANSWER.size  # the header and the bytes: the same request with the token
        assert a.peers.statistics(a.cache).strangers == 1

    t.run(main)


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
            b.request_advance()
            await t.settle(b)
            b.request_advance()
            with trio.fail_after(60):  # (a deadline of 0.5 s per peer call; the peer is then skipped DOWN_S)
                await _walk([b], t, (1, 1))
            n.cancel_scope.cancel()

    try:
        t.run(main)
    finally:
        silent.close()
    p = b.peers.statistics(b.cache)
    assert p.misses[peer] >= 1 and p.fetched_files == 0
    assert p.peers[0].alive is False or p.misses["down"] > 0


def test_placement_keeps_owned_copies_and_evicts_the_others_first(pair, t):
    a, b = pair()

    async def main() -> None:
        async with _running(a, b) as n:
            await _walk([a, b], t, (0, 3))
            for e in (a, b):
                owned = e.peers.owned()
                held = e.cache.held(e.tree.n_files)
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
                assert e.next_ready()
                assert e.cache.disk_bytes() <= e.config.capacity
                p = e.peers.statistics(e.cache)
                assert 0 < p.owned_cached_files < p.owned_files
            n.cancel_scope.cancel()

    t.run(main)


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
