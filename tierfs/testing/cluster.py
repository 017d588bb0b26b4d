"""A Slurm cluster on one machine, for tests and benchmarks: ``slurmctld``, four ``slurmd`` nodes and a slow tier,
each in network namespaces of its own on one bridge, torn down whatever happens.

Each node is what a site's compute node is to a job: its own host name (a UTS namespace), its own mount table (a
mount namespace: the same paths on every node, each node's own mounts), its own processes (a PID namespace whose
first process, :func:`node_init`, reaps them and whose end ends them all), an address on the cluster's network,
``/etc/hosts`` naming the cluster's hosts (bound over the machine's in the node's mount namespace only), and:

- ``SITE/slow``: the shared slow tier, the same directory of the *slow* host mounted by sshfs over the node's
  link (the slow host's egress is throttled with ``tc tbf``: the nodes share its bandwidth, as they share an NFS
  server's).  sshfs numbers inodes per mount (each node its own); ``slow_tier="bind"`` binds the directory instead
  (every node the same numbers, as NFS; unthrottled);
- ``SITE/nvme``: the node's local disk (a directory of its own, ``ROOT/nodes/NAME/nvme``, bound there);
- ``SITE/mnt``: an empty directory where a job mounts tierfs.

Nothing outside ``ROOT`` is written: munge's key and socket, slurm.conf, the daemons' state, spool, logs and pid
files, sshd's keys and config all live there (munged in the machine's namespaces: its socket is a path; slurmctld
in the *ctl* host; sshd in the *slow* host, with its privilege-separation directory in a mount namespace of its
own).  Commands: ``python -m tierfs.testing.cluster up ROOT`` starts one and waits until its nodes are idle (then
``SLURM_CONF=ROOT/slurm.conf sbatch ...``), ``... down ROOT`` ends it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dslide.mpirun import children, descendants

__all__ = ["Cluster", "cluster", "node_init"]

NODES = 4
_BIN = Path(sys.executable).parent


@dataclass
class Cluster:
    """A running cluster: where it lives and how to reach it (from this machine's namespaces)."""

    root: Path
    tag: str  # (names its namespaces, bridge and links: two clusters on one machine do not meet)
    subnet: str  # "10.X.Y": host k is 10.X.Y.k
    nodes: list[str] = field(default_factory=lambda: [f"n{i + 1}" for i in range(NODES)])
    epilog: Path | None = None  # the site's Epilog script (run with PATH this Python's, TIERFS_MNT_BASE site/mnt)
    slow_rate: str = "400mbit"  # the slow host's egress (every node's reads of the slow tier), "" unthrottled
    #: how the nodes see the slow tier: ``sshfs`` (over the network; inode numbers per node) or ``bind`` (the same
    #: directory bound, as an NFS mount keeps the server's file ids: every node the same numbers; unthrottled)
    slow_tier: str = "sshfs"
    pids: dict[str, int] = field(default_factory=dict)  # (each host's namespaces: its ``unshare``)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)

    @property
    def site(self) -> Path:
        """The paths a job sees on every node: ``slow``, ``nvme``, ``mnt``."""
        return self.root / "site"

    @property
    def data(self) -> Path:
        """The slow tier's files (on the slow host; the nodes see them at ``site/slow``)."""
        return self.root / "slow-data"

    def env(self) -> dict[str, str]:
        """The environment of a Slurm command run from this machine (``sbatch``, ``squeue``, ``scancel``)."""
        return {**os.environ, "SLURM_CONF": str(self.root / "slurm.conf"),
                "PATH": f"{_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}", "TIERFS_MNT_BASE": str(self.site / "mnt"),
                # (the nodes share one kernel: UCX would take shared memory between them by the machine's id)
                "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0"}

    def slurm(self, *args: str, timeout: float = 60) -> str:
        """A Slurm command's output (``CalledProcessError`` with its stderr if it fails)."""
        return subprocess.run(list(args), env=self.env(), check=True, capture_output=True, text=True,
                              timeout=timeout).stdout

    def address(self, host: str) -> str:
        return f"{self.subnet}.{_HOSTS.index(host) + 1}" if host in _HOSTS else \
            f"{self.subnet}.{10 + self.nodes.index(host)}"

    def mounts(self, node: str) -> list[tuple[str, str]]:
        """(mount point, type) of the mounts ``node`` sees under ``ROOT``."""
        with open(f"/proc/{self.pids[node]}/mounts") as f:
            rows = [line.split()[1:3] for line in f]
        return [(p, t) for p, t in rows if p.startswith(str(self.root))]

    def processes(self, node: str) -> list[str]:
        """The names (``comm``) of ``node``'s processes but its first: found by walking down from it
        (:func:`dslide.mpirun.descendants`), never by reading other processes' command lines."""
        unshare = self.pids[node]
        names = []
        for pid in descendants(unshare) - set(children(unshare)):  # (its child: the node's first process)
            with contextlib.suppress(OSError):  # (gone meanwhile)
                names.append(Path(f"/proc/{pid}/comm").read_text().strip())
        return names

    def run_on(self, node: str, argv: Sequence[str], **kw: object) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in ``node``'s namespaces (as a site's admin would, by ssh)."""
        pid = str(self.pids[node])
        return subprocess.run(["nsenter", "-t", pid, "-n", "-m", "-u", "--", *argv], text=True,
                              capture_output=True, **kw)  # type: ignore[call-overload]

    def wait_idle(self, timeout: float = 60) -> None:
        """Until every node is idle (no job on it, nothing draining)."""
        end = time.monotonic() + timeout
        states = ""
        while time.monotonic() < end:
            with contextlib.suppress(subprocess.SubprocessError):
                states = self.slurm("sinfo", "-h", "-N", "-o", "%N %t", timeout=10)
                if states and all(line.split()[1] == "idle" for line in states.splitlines()):
                    return
            time.sleep(0.5)
        raise TimeoutError(f"the cluster's nodes are not idle after {timeout:.0f} s: {states}\n"
                           f"{self.log('ctld')[-3000:]}")

    def log(self, host: str) -> str:
        path = self.root / ("ctld/slurmctld.log" if host == "ctld" else f"nodes/{host}/slurmd.log")
        return path.read_text(errors="replace") if path.exists() else ""


_HOSTS = ("ctl", "slow")  # (10.X.Y.1, .2; the bridge is .254; nodes .10 up)


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), check=check, capture_output=True, text=True, timeout=60)


def _free_subnet() -> str:
    taken = _sh("ip", "-o", "-4", "addr").stdout
    for _ in range(100):
        subnet = f"10.{secrets.randbelow(100) + 150}.{secrets.randbelow(250) + 1}"
        if f"inet {subnet}." not in taken:
            return subnet
    raise RuntimeError("no free 10.x.y.0/24 subnet for the cluster's network")


def _network(c: Cluster, slow_rate: str) -> None:
    bridge = f"tfc{c.tag}"
    _sh("ip", "link", "add", bridge, "type", "bridge")
    _sh("ip", "addr", "add", f"{c.subnet}.254/24", "dev", bridge)
    _sh("ip", "link", "set", bridge, "up")
    for k, host in enumerate([*_HOSTS, *c.nodes]):
        ns, outer = f"tfc{c.tag}-{host}", f"tfc{c.tag}{k}"
        _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _sh("ip", "link", "set", outer, "master", bridge, "up")
        _sh("ip", "-n", ns, "addr", "add", f"{c.address(host)}/24", "dev", "eth0")
        _sh("ip", "-n", ns, "link", "set", "eth0", "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "-n", ns, "route", "add", "default", "via", f"{c.subnet}.254")
        if host == "slow" and slow_rate:  # (what the slow host sends: every node's reads of the slow tier)
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", slow_rate,
                "burst", "256kb", "latency", "100ms")


def _unnetwork(tag: str) -> None:
    for ns in _sh("ip", "netns", "list", check=False).stdout.split("\n"):
        name = ns.split(" ")[0]
        if name.startswith(f"tfc{tag}-"):
            _sh("ip", "netns", "delete", name, check=False)
    _sh("ip", "link", "delete", f"tfc{tag}", check=False)


def _write_config(c: Cluster) -> None:
    r = c.root
    for d in ("munge", "ctld/state", "ssh", "slow-run/sshd", "site/slow", "site/nvme", "site/mnt", "slow-data"):
        (r / d).mkdir(parents=True, exist_ok=True)
    for n in c.nodes:
        for d in ("spool", "nvme"):
            (r / "nodes" / n / d).mkdir(parents=True, exist_ok=True)
    os.chmod(r / "munge", 0o700)
    os.chmod(r / "slow-run" / "sshd", 0o755)
    key = r / "munge" / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    os.chmod(key, 0o400)
    hosts = ["127.0.0.1 localhost"] + [f"{c.address(h)} {h}" for h in (*_HOSTS, *c.nodes)]
    (r / "hosts").write_text("\n".join(hosts) + "\n")
    cpus = os.cpu_count() or 2
    nodes = "\n".join(f"NodeName={n} NodeAddr={c.address(n)} CPUs={cpus} State=UNKNOWN" for n in c.nodes)
    (r / "slurm.conf").write_text(f"""\
# a test cluster (tierfs.testing.cluster): everything under {r}
ClusterName=tfc{c.tag}
SlurmctldHost=ctl({c.address('ctl')})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge/munge.sock
StateSaveLocation={r}/ctld/state
SlurmctldPidFile={r}/ctld/slurmctld.pid
SlurmctldLogFile={r}/ctld/slurmctld.log
SlurmdSpoolDir={r}/nodes/%n/spool
SlurmdPidFile={r}/nodes/%n/slurmd.pid
SlurmdLogFile={r}/nodes/%n/slurmd.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
KillWait=10
MessageTimeout=10
SlurmdTimeout=60
InactiveLimit=0
MinJobAge=300
{f"Epilog={r}/epilog" if c.epilog else ""}
{nodes}
PartitionName=batch Nodes={','.join(c.nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
    if c.epilog is not None:  # (slurmd runs it with SLURM_JOB_ID and little else: a site's wrapper sets the rest)
        (r / "epilog").write_text(f"#!/bin/sh\nexport PATH={_BIN}:/usr/sbin:/usr/bin:/sbin:/bin "
                                  f"TIERFS_MNT_BASE={c.site / 'mnt'}\nexec {Path(c.epilog).resolve()}\n")
        os.chmod(r / "epilog", 0o755)
    _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(r / "ssh" / "host_key"))
    _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(r / "ssh" / "id"))
    shutil.copy(r / "ssh" / "id.pub", r / "ssh" / "authorized_keys")
    (r / "ssh" / "sshd_config").write_text(f"""\
ListenAddress {c.address('slow')}
HostKey {r}/ssh/host_key
AuthorizedKeysFile {r}/ssh/authorized_keys
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
PidFile {r}/slow-run/sshd.pid
Subsystem sftp internal-sftp
""")


# ================================================================================ one host's first process

def node_init(role: str, root: Path, name: str, slow_tier: str = "sshfs") -> int:
    """(The first process of a host's PID namespace, in its mount and UTS namespaces) Set the host up, run its
    daemon in the foreground, reap every process the namespace orphans, and end with the daemon: the kernel then
    ends the namespace's other processes (a job's, a tierfs daemon's) and the mount namespace with its mounts."""
    subprocess.run(["hostname", name], check=True)
    subprocess.run(["mount", "--bind", str(root / "hosts"), "/etc/hosts"], check=True)
    conf = str(root / "slurm.conf")
    if role == "ctl":
        argv = ["slurmctld", "-D", "-i", "-f", conf]
    elif role == "slow":
        subprocess.run(["mount", "--bind", str(root / "slow-run"), "/run"], check=True)
        argv = ["/usr/sbin/sshd", "-D", "-e", "-f", str(root / "ssh" / "sshd_config")]
    else:
        site = root / "site"
        subprocess.run(["mount", "--bind", str(root / "nodes" / name / "nvme"), str(site / "nvme")], check=True)
        if slow_tier == "bind":
            subprocess.run(["mount", "--bind", "-o", "ro", str(root / "slow-data"), str(site / "slow")], check=True)
        else:
            _sshfs(root, site / "slow")
        # (``ip netns exec`` mounted a sysfs of the network namespace over /sys, cgroups not in it; slurmd wants
        # cgroup v1's "systemd" hierarchy there even with proctrack/linuxproc, which uses none of it)
        # (or, where the kernel mounts no cgroup v1 hierarchy, cgroup v2 itself)
        cgroups = Path("/sys/fs/cgroup")
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "cgroups", str(cgroups)], check=True)
        (cgroups / "systemd").mkdir()
        if subprocess.run(["mount", "-t", "cgroup", "-o", "none,name=systemd", "cgroup", str(cgroups / "systemd")],
                          capture_output=True).returncode:
            subprocess.run(["umount", str(cgroups)], check=True)
            subprocess.run(["mount", "-t", "cgroup2", "cgroup2", str(cgroups)], check=True)
        argv = ["slurmd", "-D", "-N", name, "-f", conf]
    log = open(root / f"{name}.out", "ab")  # noqa: SIM115 (the daemon's until it ends)
    daemon = subprocess.Popen(argv, stdout=log, stderr=log)

    def stop(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            daemon.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return 0
        if pid == daemon.pid:
            return os.waitstatus_to_exitcode(status)


def _sshfs(root: Path, at: Path) -> None:
    """Mount the slow host's data set at ``at`` (retried until its sshd answers, 30 s)."""
    # (dir_cache=no: sshfs 3.7's directory cache can list a directory empty, libfuse/sshfs#375)
    options = ",".join((f"IdentityFile={root}/ssh/id", "StrictHostKeyChecking=no",
                                   "UserKnownHostsFile=/dev/null", "LogLevel=ERROR", "ro", "allow_other",
                                   "dir_cache=no", "reconnect", "ServerAliveInterval=15", "ServerAliveCountMax=8"))
    end = time.monotonic() + 30
    while True:
        done = subprocess.run(["sshfs", f"root@slow:{root}/slow-data", str(at), "-o", options],
                              capture_output=True, text=True)
        if done.returncode == 0:
            return
        if time.monotonic() > end:
            raise RuntimeError(f"sshfs: {done.stderr.strip()}")
        time.sleep(0.3)


# ========================================================================================== up and down

def _start_host(c: Cluster, role: str, name: str) -> None:
    ns = f"tfc{c.tag}-{name}"
    argv = ["ip", "netns", "exec", ns, "unshare", "--uts", "--mount", "--propagation", "private", "--pid",
            "--fork", "--mount-proc", "--kill-child=SIGTERM", sys.executable, "-m", "tierfs.testing.cluster",
            "init", role, str(c.root), name, c.slow_tier]
    with open(c.root / f"{name}.init", "ab") as err:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)
    c.procs[name] = proc
    c.pids[name] = proc.pid


def start(root: Path, **settings: str) -> Cluster:
    """A cluster in ``root`` (created), its nodes idle (:meth:`Cluster.wait_idle`); :func:`stop` ends it."""
    root = Path(root).resolve()
    c = Cluster(root, secrets.token_hex(3), _free_subnet(), **settings)  # type: ignore[arg-type]
    root.mkdir(parents=True, exist_ok=True)
    (root / "cluster.json").write_text(json.dumps({"tag": c.tag, "subnet": c.subnet}))
    try:
        _write_config(c)
        munged = subprocess.Popen(
            ["munged", "-F", "--force", f"--socket={root}/munge/munge.sock", f"--key-file={root}/munge/munge.key",
             f"--pid-file={root}/munge/munged.pid", f"--log-file={root}/munge/munged.log",
             f"--seed-file={root}/munge/munged.seed"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        c.procs["munged"] = munged
        c.pids["munged"] = munged.pid
        _network(c, c.slow_rate)
        _start_host(c, "ctl", "ctl")
        _start_host(c, "slow", "slow")
        for n in c.nodes:
            _start_host(c, "node", n)
        (root / "cluster.json").write_text(json.dumps({"tag": c.tag, "subnet": c.subnet, "pids": c.pids}))
        c.wait_idle(90)
    except BaseException:
        stop(c)
        raise
    return c


def stop(c: Cluster) -> None:
    """End every host (its namespaces, processes and mounts with it), munged and the network."""
    _end([c.pids[n] for n in [*c.nodes, "slow", "ctl"] if n in c.pids], c.pids.get("munged"))
    for proc in c.procs.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(1)  # (reaped: ended above)
    _unnetwork(c.tag)


def _end(hosts: list[int], munged: int | None, timeout: float = 30) -> None:
    """SIGTERM each host's first process (``unshare`` ignores it: its child is the host's :func:`node_init`, whose
    end ends the namespace), then munged; SIGKILL what is left after ``timeout`` (the unshare passes a SIGTERM
    on to its child as it dies: ``--kill-child``)."""
    def alive(pid: int, comm: str) -> bool:
        try:
            return Path(f"/proc/{pid}/comm").read_text().strip() == comm  # (not a pid reused by another)
        except OSError:
            return False

    hosts = [pid for pid in hosts if alive(pid, "unshare")]
    for pid in hosts:
        for first in children(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(first, signal.SIGTERM)
    end = time.monotonic() + timeout
    while any(alive(pid, "unshare") for pid in hosts) and time.monotonic() < end:
        time.sleep(0.1)
    for pid in [*hosts, *([munged] if munged and alive(munged, "munged") else [])]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL if pid != munged else signal.SIGTERM)


def down(root: Path) -> None:
    """End the cluster ``start`` left in ``root`` (from its ``cluster.json``): what ``up`` started, or what a
    killed test or benchmark could not end itself."""
    info = json.loads((Path(root) / "cluster.json").read_text())
    pids = info.get("pids", {})
    _end([pid for name, pid in pids.items() if name != "munged"], pids.get("munged"))
    _unnetwork(info["tag"])


@contextlib.contextmanager
def cluster(root: Path, **settings: str) -> Iterator[Cluster]:
    """:func:`start`, and :func:`stop` on the way out whatever happened."""
    c = start(root, **settings)
    try:
        yield c
    finally:
        stop(c)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tierfs.testing.cluster", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="(internal) a host's first process")
    init.add_argument("role", choices=("ctl", "slow", "node"))
    init.add_argument("root", type=Path)
    init.add_argument("name")
    init.add_argument("slow_tier", nargs="?", default="sshfs", choices=("sshfs", "bind"))
    up = sub.add_parser("up", help="start a cluster in ROOT and return once its nodes are idle")
    up.add_argument("root", type=Path)
    up.add_argument("--slow-rate", default=Cluster.slow_rate, help="the slow host's egress (tc tbf rate)")
    sub.add_parser("down", help="end the cluster in ROOT").add_argument("root", type=Path)
    args = p.parse_args(argv)
    if args.command == "init":
        return node_init(args.role, args.root, args.name, args.slow_tier)
    if args.command == "up":
        c = start(args.root, slow_rate=args.slow_rate)
        print(f"export SLURM_CONF={c.root / 'slurm.conf'}  # (then sbatch, squeue; down: {p.prog} down {c.root})")
        return 0
    down(args.root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
