"""A backing dir with real per-request latency: sshfs over a delayed link into a network namespace.

Why this and not a sleep in a FUSE shim: the issues this serves (19, 11) are about what a dataset on a network
filesystem does to tierfs -- a round trip per request, a TCP connection that can stop answering -- so the
latency must come from a real network filesystem over a real network path:

* a network namespace ``tfsnet-PID`` joined to this one by a veth pair (``10.213.X.1`` here, ``.2`` there);
* ``sshd`` running inside the namespace (its own host key and authorized key, in a temp dir), which serves the
  ``source`` dir of the one shared filesystem through its sftp subsystem;
* a user-space TCP relay (this file, ``python netbacking.py relay``, one process) on 127.0.0.1 that forwards to
  sshd across the veth and holds every chunk for ``delay`` seconds in each direction: this kernel has no
  ``netem``, and a relay is also a process we can ``SIGSTOP`` to stall the link, as a server that stops
  answering does (the TCP connection stays up, requests just wait: an NFS ``hard`` mount's behaviour);
* ``sshfs -o cache=no`` with the kernel's attribute, entry and negative caches off, so every ``stat``, ``open``,
  ``readdir`` and read of the mount is a round trip (set ``kernel_cache=True`` to leave the kernel's defaults),
  and ``noforget``: sshfs numbers inodes itself and, without it, gives a path a new number whenever the kernel
  forgets its inode (memory pressure; another process's ``drop_caches``) -- tierfs's fingerprint has the inode,
  so every file copied after that would be found changed and copied twice (measured: a single ``echo 2 >
  /proc/sys/vm/drop_caches`` mid-run took a 2-epoch run from 63 to 86-93 MiB read); an NFS server's file
  handles keep their inode numbers.

``net_backing(source, delay=0.25e-3)`` is a context manager yielding a :class:`NetBacking`: ``root`` (the sshfs
mount), ``rtt()`` (median of timed ``os.stat`` calls on it), ``stall()``/``resume()`` (SIGSTOP/SIGCONT of the
relay) and ``stalled()`` (a context manager).  Teardown runs whatever happened: resume, abort the FUSE
connection if the mount does not let go, unmount, kill sshfs, the relay and sshd, delete the namespace and the
veth, delete the temp dir.  Root is required.

Run ``python benchmarks/netbacking.py [--delay-ms 0.25]`` to see the RTT it achieves on this machine.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import os
import selectors
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tierfs.daemon.fuse.mount import abort_connection, fuse_connection

__all__ = ["NetBacking", "net_backing", "relay_main"]

_HERE = Path(__file__).resolve()


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip() or f'exit {r.returncode}'}")
    return r


# --------------------------------------------------------------------------------------------- the relay


def relay_main(listen_port: int, target: tuple[str, int], delay: float, ready_fd: int | None = None) -> None:
    """Forward TCP connections from 127.0.0.1:``listen_port`` to ``target``, each chunk ``delay`` seconds late.

    One thread, one selector, one heap of due sends: order within a direction is kept (due times are
    monotonic per direction), and a chunk is never merged with a later one before it is due, so a request's
    latency is its own.  Reading stops on a direction whose pending bytes exceed 8 MiB (back-pressure).
    """
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(("127.0.0.1", listen_port))
    lsock.listen(16)
    lsock.setblocking(False)
    # select(2), not epoll: epoll_wait's timeout is whole milliseconds, which would round a 0.25 ms delay to 1 ms
    sel = selectors.SelectSelector()
    sel.register(lsock, selectors.EVENT_READ, None)
    due: list[tuple[float, int, socket.socket, bytes]] = []  # (when, seq, destination, data)
    pending: dict[socket.socket, int] = {}
    peer: dict[socket.socket, socket.socket] = {}
    seq = 0
    if ready_fd is not None:
        os.write(ready_fd, b"ok")
        os.close(ready_fd)

    def close_pair(s: socket.socket) -> None:
        for x in (s, peer.get(s)):
            if x is None:
                continue
            with contextlib.suppress(KeyError, ValueError):
                sel.unregister(x)
            peer.pop(x, None)
            pending.pop(x, None)
            x.close()

    while True:
        timeout = max(0.0, due[0][0] - time.monotonic()) if due else None
        for key, _ev in sel.select(timeout):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            if s is lsock:
                client, _ = lsock.accept()
                upstream = socket.create_connection(target)
                for x in (client, upstream):
                    x.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    x.setblocking(True)
                    sel.register(x, selectors.EVENT_READ, None)
                    pending[x] = 0
                peer[client], peer[upstream] = upstream, client
                continue
            if s not in peer:
                continue
            try:
                data = s.recv(1 << 20)
            except OSError:
                data = b""
            if not data:
                close_pair(s)
                continue
            dst = peer[s]
            seq += 1
            heapq.heappush(due, (time.monotonic() + delay, seq, dst, data))
            pending[dst] = pending.get(dst, 0) + len(data)
            if pending[dst] > 8 << 20:
                with contextlib.suppress(KeyError, ValueError):
                    sel.unregister(s)
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, _, dst, data = heapq.heappop(due)
            if dst not in peer:
                continue
            try:
                dst.sendall(data)
            except OSError:
                close_pair(dst)
                continue
            pending[dst] -= len(data)
            src = peer[dst]
            if pending[dst] <= 8 << 20:
                with contextlib.suppress(KeyError, ValueError):
                    sel.register(src, selectors.EVENT_READ, None)


# --------------------------------------------------------------------------------------------- the backing


@dataclass
class NetBacking:
    """A live network backing: ``root`` is the sshfs mount of ``source``."""

    root: Path
    source: Path
    delay: float
    relay: subprocess.Popen[bytes]
    sshd: subprocess.Popen[bytes]
    sshfs: subprocess.Popen[bytes]
    netns: str
    veth: str = ""  # the namespace's end of the link: what the server sends leaves through it
    _stalled: bool = field(default=False, repr=False)

    def wire(self) -> tuple[int, int]:
        """(bytes, packets) the server has sent over the link so far (its qdisc's counters): the slow tier's reads
        as they crossed the wire, headers included."""
        words = _run("ip", "netns", "exec", self.netns, "tc", "-s", "qdisc", "show", "dev", self.veth).stdout.split()
        i = words.index("Sent")
        return int(words[i + 1]), int(words[i + 3])

    def rtt(self, samples: int = 200) -> float:
        """Median seconds of an ``os.stat`` of the mount's root (one round trip with the kernel caches off)."""
        times = []
        for _ in range(samples):
            t0 = time.perf_counter()
            os.stat(self.root)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def rtt_stats(self, samples: int = 200) -> dict[str, float]:
        times = []
        for _ in range(samples):
            t0 = time.perf_counter()
            os.stat(self.root)
            times.append(time.perf_counter() - t0)
        times.sort()
        return {"p50_ms": times[len(times) // 2] * 1e3, "p90_ms": times[int(len(times) * 0.9)] * 1e3,
                "min_ms": times[0] * 1e3}

    def stall(self) -> None:
        """Stop the link: SIGSTOP the relay (the connection stays open, every request waits)."""
        self.relay.send_signal(signal.SIGSTOP)
        self._stalled = True

    def resume(self) -> None:
        self.relay.send_signal(signal.SIGCONT)
        self._stalled = False

    @contextlib.contextmanager
    def stalled(self) -> Iterator[None]:
        self.stall()
        try:
            yield
        finally:
            self.resume()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(host: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout} s")


@contextlib.contextmanager
def net_backing(source: str | os.PathLike[str], delay: float = 0.25e-3, *, kernel_cache: bool = False,
                workdir: str | os.PathLike[str] | None = None, rate: str | None = None) -> Iterator[NetBacking]:
    """Serve ``source`` over sshfs through a relay that delays each direction by ``delay`` seconds; ``rate`` (e.g.
    ``400mbit``): the server's side of the link throttled by ``tc tbf`` (a 1 ms bucket).

    Yields a :class:`NetBacking`; everything it started is gone when the block exits.
    """
    if os.geteuid() != 0:
        raise PermissionError("net_backing needs root (network namespaces, veth, sshd)")
    for tool in ("sshd", "sshfs", "ssh-keygen", "ip"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            raise RuntimeError(f"{tool} not found: apt-get install openssh-server sshfs iproute2")
    source = Path(source).resolve()
    tmp = Path(tempfile.mkdtemp(prefix="netbacking-", dir=workdir))
    tag = os.getpid() % 250 + 1
    netns, veth_host, veth_ns = f"tfsnet-{os.getpid()}", f"tfh{os.getpid()}", f"tfn{os.getpid()}"
    host_ip, ns_ip = f"10.213.{tag}.1", f"10.213.{tag}.2"
    made_ns = made_veth = False
    sshd = relay = sshfs = None
    mnt = tmp / "mnt"
    try:
        mnt.mkdir()
        # the network path: a namespace and a veth pair
        _run("ip", "netns", "add", netns)
        made_ns = True
        _run("ip", "link", "add", veth_host, "type", "veth", "peer", "name", veth_ns)
        made_veth = True
        _run("ip", "link", "set", veth_ns, "netns", netns)
        _run("ip", "addr", "add", f"{host_ip}/24", "dev", veth_host)
        _run("ip", "link", "set", veth_host, "up")
        _run("ip", "netns", "exec", netns, "ip", "addr", "add", f"{ns_ip}/24", "dev", veth_ns)
        _run("ip", "netns", "exec", netns, "ip", "link", "set", veth_ns, "up")
        _run("ip", "netns", "exec", netns, "ip", "link", "set", "lo", "up")
        tbf = ["tbf", "rate", rate, "burst", "64kb", "latency", "100ms"] if rate else ["pfifo"]  # (counters)
        _run("ip", "netns", "exec", netns, "tc", "qdisc", "replace", "dev", veth_ns, "root", *tbf)
        # sshd inside the namespace, keys of its own
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / "host_key"))
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / "client_key"))
        shutil.copy(tmp / "client_key.pub", tmp / "authorized_keys")
        os.makedirs("/run/sshd", exist_ok=True)
        sftp = next((p for p in ("/usr/lib/openssh/sftp-server", "/usr/libexec/openssh/sftp-server",
                                 "/usr/lib/ssh/sftp-server") if Path(p).exists()), "internal-sftp")
        (tmp / "sshd_config").write_text(
            f"ListenAddress {ns_ip}\nPort 22\nHostKey {tmp / 'host_key'}\nPidFile {tmp / 'sshd.pid'}\n"
            f"AuthorizedKeysFile {tmp / 'authorized_keys'}\nPermitRootLogin yes\nPasswordAuthentication no\n"
            f"UsePAM no\nStrictModes no\nSubsystem sftp {sftp}\nLogLevel ERROR\nMaxStartups 100\n"
        )
        sshd = subprocess.Popen(["ip", "netns", "exec", netns, shutil.which("sshd") or "/usr/sbin/sshd", "-D",
                                 "-e", "-f", str(tmp / "sshd_config")],
                                stdout=subprocess.DEVNULL, stderr=open(tmp / "sshd.log", "wb"))  # noqa: SIM115
        _wait_port(ns_ip, 22, 10)
        # the relay, here, on loopback
        port = _free_port()
        rfd, wfd = os.pipe()
        relay = subprocess.Popen([sys.executable, str(_HERE), "relay", "--port", str(port), "--target",
                                  f"{ns_ip}:22", "--delay", repr(delay), "--ready-fd", str(wfd)],
                                 pass_fds=(wfd,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(wfd)
        with os.fdopen(rfd, "rb") as r:
            if r.read(2) != b"ok":
                raise RuntimeError("the relay did not start")
        # sshfs through the relay
        opts = ["cache=no", "noforget", "StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", f"IdentityFile="
                f"{tmp / 'client_key'}", f"Port={port}", "Ciphers=aes128-gcm@openssh.com", "Compression=no",
                "LogLevel=ERROR", "BatchMode=yes"]
        if not kernel_cache:
            opts += ["attr_timeout=0", "entry_timeout=0", "negative_timeout=0"]
        sshfs = subprocess.Popen(["sshfs", "-f", "-o", ",".join(opts), f"root@127.0.0.1:{source}", str(mnt)],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=open(tmp / "sshfs.log", "wb"))  # noqa: SIM115
        deadline = time.monotonic() + 20
        while fuse_connection(str(mnt)) is None:
            if sshfs.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sshfs did not mount: {(tmp / 'sshfs.log').read_text().strip()}")
            time.sleep(0.05)
        nb = NetBacking(mnt, source, delay, relay, sshd, sshfs, netns, veth_ns)
        yield nb
    finally:
        if relay is not None and relay.poll() is None:
            relay.send_signal(signal.SIGCONT)
        if fuse_connection(str(mnt)) is not None:
            r = subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True, timeout=10, check=False)
            if r.returncode != 0:
                abort_connection(str(mnt))
                subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True, check=False)
        for p in (sshfs, relay, sshd):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
        if sshd is not None:  # `ip netns exec` forwards the signal; make sure the daemon itself is gone
            with contextlib.suppress(OSError, ValueError):
                os.kill(int((tmp / "sshd.pid").read_text()), signal.SIGTERM)
        if made_veth:
            _run("ip", "link", "del", veth_host, check=False)
        if made_ns:
            _run("ip", "netns", "del", netns, check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    r = sub.add_parser("relay", help="(internal) run the delaying TCP relay")
    r.add_argument("--port", type=int, required=True)
    r.add_argument("--target", required=True)
    r.add_argument("--delay", type=float, required=True)
    r.add_argument("--ready-fd", type=int)
    ap.add_argument("--delay-ms", type=float, default=0.25, help="one-way delay in ms (0.25 = 0.5 ms RTT)")
    ap.add_argument("--source", type=Path, help="dir to serve (default: a temp dir with one file)")
    args = ap.parse_args(argv)
    if args.cmd == "relay":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        host, port = args.target.rsplit(":", 1)
        relay_main(args.port, (host, int(port)), args.delay, args.ready_fd)
        return
    with tempfile.TemporaryDirectory() as src:
        source = args.source or Path(src)
        if args.source is None:
            (source / "f").write_bytes(os.urandom(110 << 10))
        with net_backing(source, args.delay_ms / 1e3) as nb:
            print(f"sshfs mount {nb.root} of {source}, relay delay {args.delay_ms} ms each way")
            print("os.stat RTT:", {k: round(v, 3) for k, v in nb.rtt_stats().items()},
                  f"load {os.getloadavg()[0]:.2f}")
            with nb.stalled():
                t0 = time.monotonic()
                time.sleep(0.5)
            print(f"stalled and resumed after {time.monotonic() - t0:.2f} s; RTT now {nb.rtt(50) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
