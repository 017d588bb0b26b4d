"""Consumer names on a shared mount (issue 46): read only for the users who steer, never held up by another
user's wedged process, kept per process (not per pid), their warnings and their table bounded per user.

The requesters are real processes of other uids (started as root, then ``setuid``); a *wedged* one holds its own
memory map by reading its own mapping of a file on a FUSE mount that never answers (``/proc/self/mem``: the
kernel faults the page in with the map held) while another of its threads waits to change the map -- from then
on nobody can read its ``/proc/PID/environ`` until the hung mount lets go.  Every job runs under a deadline; the
wedged processes are killed and the hung mount aborted in the cleanup.
"""

from __future__ import annotations

import os
import select
import subprocess
import threading
import time

import pytest

from tierfs.daemon.access import Reader
from tierfs.daemon.schedule.consumers import ANONYMOUS, CONSUMER_ENV, MAX_CONSUMERS_PER_USER, process_start
from tierfs.testing.harness import abort_connection, make_dataset, mounted, passthrough

PYTHON = "/usr/bin/python3"  # (the venv's interpreter may sit where other users cannot run it)
NOBODY = 65534  # a member of nogroup, the steering group of these mounts where they have one
APT = 42  # another member of nogroup (its primary group)
STRANGER = 12345  # a uid with no entry: in no group, never steers

pytestmark = pytest.mark.skipif(os.getuid() != 0 or not os.access(PYTHON, os.X_OK),
                                reason="needs root and a system python3 to run as other users")

# As root: map FILE (a file of the hung mount, its reads past the first byte never answer) and open
# /proc/self/mem; become UID; then one thread reads the mapping's second page through /proc/self/mem (the
# kernel holds this process's memory map while it faults the page in: never), another asks to change the map
# (it waits, and from then on so does every reader of the map, ``environ`` included), and once wedged a third
# opens TARGET on the tierfs mount (whatever it does next may wait on the map: the test looks for the open
# descriptor in /proc/PID/fd, which never does).  Prints "wedged".
_WEDGE = r"""
import ctypes, os, sys, threading, time
hung, target, uid = sys.argv[1], sys.argv[2], int(sys.argv[3])
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
fd = os.open(hung, os.O_RDONLY)
addr = libc.mmap(None, 1 << 20, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
libc.madvise(addr, 1 << 20, 1)  # MADV_RANDOM: a fault reads its one page (past the first byte), no read-ahead
mem = os.open("/proc/self/mem", os.O_RDONLY)
os.setgroups([])
os.setresgid(65534, 65534, 65534)
os.setresuid(uid, uid, uid)
go_fault, go_write, go_open = threading.Event(), threading.Event(), threading.Event()
def fault():
    go_fault.wait()
    os.pread(mem, 1, addr + 65536)
def writer():
    go_write.wait()
    while True:
        libc.munmap(libc.mmap(None, 4096, 3, 0x22, -1, 0), 4096)  # (anonymous: the map's write lock)
def opener():
    go_open.wait()
    os.open(target, os.O_RDONLY)
for fn in (fault, writer, opener):
    threading.Thread(target=fn, daemon=True).start()
go_fault.set()
time.sleep(0.3)
go_write.set()
time.sleep(0.3)
os.write(1, b"wedged\n")
go_open.set()
time.sleep(3600)
"""

# Wait for "go" on stdin (anything else: exit), then open and read FILE; print "ok".
_OPEN_ON_GO = """
import sys
if sys.stdin.readline().strip() != 'go':
    sys.exit()
with open(sys.argv[1], 'rb') as f:
    f.read()
print('ok', flush=True)
"""

# Open FILE from N threads, one after the other (each thread a requester of its own); print "ok".
_OPEN_FROM_THREADS = """
import sys, threading
def read():
    with open(sys.argv[1], 'rb') as f:
        f.read()
for _ in range(int(sys.argv[2])):
    t = threading.Thread(target=read)
    t.start()
    t.join()
print('ok', flush=True)
"""


def _env(name: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != CONSUMER_ENV}
    return env if name is None else {**env, CONSUMER_ENV: name}


def _job(path: str, name: str | None, uid: int = 0, deadline: float = 20.0) -> None:
    """A process of ``uid`` named ``name`` opens and reads ``path``, within ``deadline`` seconds."""
    user = {} if uid == 0 else {"user": uid, "group": NOBODY, "extra_groups": []}
    p = subprocess.Popen([PYTHON, "-c", _OPEN_ON_GO, path], env=_env(name), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **user)
    try:
        out, err = p.communicate("go\n", timeout=deadline)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate(timeout=10)
    assert out.split() == ["ok"], err


def _line(p: subprocess.Popen, want: str, deadline: float) -> None:
    ready, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))
    assert ready, f"process {p.pid} did not say {want!r} in time"
    assert p.stdout.readline().strip() == want


def _read_environ(pid: int) -> None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            f.read()
    except OSError:
        pass  # (the process was killed: what matters is how long this took)


def _has_open(pid: int, path: str, deadline: float) -> None:
    """Wait until process ``pid`` holds ``path`` open (its open was answered)."""
    want = os.path.realpath(path)

    def holds() -> bool:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == want:
                    return True
            except OSError:
                pass
        return False

    while not holds():
        assert time.monotonic() < deadline, f"process {pid}'s open of {path} was not answered in time"
        time.sleep(0.05)


def _consumers(m) -> dict[str, dict]:
    return {c["name"]: c for c in m.status()["consumers"]["consumers"]}


@pytest.fixture
def shared(tmp_path, other_user):
    """``(backing, files, mountpoint)``: a dataset and a mountpoint other users can reach."""
    mnt, _ = other_user
    backing = tmp_path / "backing"
    files = make_dataset(backing, dirs=2, files_per_dir=4, max_size=4096, seed=5)
    return backing, sorted(files), mnt


def test_wedged_requesters_hold_up_no_other_users_open_nor_its_name(tmp_path, shared):
    """Twelve wedged processes -- six of a steering group's member, six of a user who does not steer -- open files
    on the mount.  Then the owner's named job and another member's open, before the wedge is let go, each counted
    under its own name; /proc/PID/stat of a wedged process reads (the start time the names are kept by)."""
    backing, rels, mnt = shared
    src, hung_mnt = tmp_path / "hung-src", tmp_path / "hung"
    src.mkdir()
    hung_mnt.mkdir()
    (src / "big.bin").write_bytes(os.urandom(1 << 20))
    hang = tmp_path / "hang"
    hang.write_text("read:big.bin\n")
    wedged: list[subprocess.Popen] = []
    with passthrough(src, hung_mnt, hang=str(hang)), \
            mounted(backing, mnt, tmp_path / "cache", "1M", nm=1, allow_other=True, group="nogroup") as m:
        try:
            for uid in [NOBODY] * 6 + [STRANGER] * 6:
                wedged.append(subprocess.Popen(
                    [PYTHON, "-c", _WEDGE, str(hung_mnt / "big.bin"), m.path(rels[0]), str(uid)],
                    env=_env(f"wedged-{uid}"), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True))
            deadline = time.monotonic() + 60
            for p in wedged:
                _line(p, "wedged", deadline)
            # The wedge is real: the first one's environment does not read (this thread stays stuck until the
            # hung mount is aborted below) -- while its /proc/PID/stat does.
            pid = wedged[0].pid
            for _ in range(30):  # (a read that ends came before the wedge held: its threads may lag, on a busy box)
                probe = threading.Thread(target=_read_environ, args=(pid,), daemon=True)
                probe.start()
                probe.join(1.0)
                if probe.is_alive():
                    break
            assert probe.is_alive(), "the wedge did not hold the process's memory map"
            start: list[int | None] = []
            stat = threading.Thread(target=lambda: start.append(process_start(pid)), daemon=True)
            stat.start()
            stat.join(20)
            assert start and start[0] is not None, "/proc/PID/stat of a wedged process did not read"
            # ... and so does its /proc/PID/status, where a member's groups come from (order, order0)
            readers: list[Reader] = []
            groups = threading.Thread(target=lambda: readers.append(Reader.of(NOBODY, pid)), daemon=True)
            groups.start()
            groups.join(20)
            assert readers and readers[0].gids, "/proc/PID/status of a wedged process did not read"
            for p in wedged:
                _has_open(p.pid, m.path(rels[0]), deadline)  # (each was answered: anonymous, if read at all)
            _job(m.path(rels[1]), "owner-job")
            _job(m.path(rels[2]), "member-job", uid=APT)
            assert probe.is_alive()  # both done while the wedge still held
            c = _consumers(m)
            assert c["owner-job"]["opens"] == 1 and c["member-job"]["opens"] == 1, c
            assert "wedged-12345" not in c  # a user who does not steer has no name (it was never read)
        finally:
            for p in wedged:
                p.kill()
            abort_connection(hung_mnt)  # (lets go of the wedged processes and of every reader of their maps)
            for p in wedged:
                p.communicate(timeout=30)


def _spawn_at(pid: int, path: str, name: str | None, uid: int) -> subprocess.Popen:
    """A process of ``uid`` named ``name`` that will read ``path`` (:data:`_OPEN_ON_GO`), started as pid
    ``pid`` (free: its process was reaped) by writing ``pid - 1`` to ``/proc/sys/kernel/ns_last_pid`` just
    before the fork.  Retried while another process on the machine forks in between."""
    user = {} if uid == 0 else {"user": uid, "group": NOBODY, "extra_groups": []}
    for _ in range(200):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        p = subprocess.Popen([PYTHON, "-c", _OPEN_ON_GO, path], env=_env(name), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, **user)
        if p.pid == pid:
            return p
        p.communicate("", timeout=20)  # (not the pid: it reads nothing, it exits)
        if os.path.exists(f"/proc/{pid}"):
            break
    pytest.fail(f"could not start a process as pid {pid}")


def _go(p: subprocess.Popen) -> None:
    out, _ = p.communicate("go\n", timeout=20)
    assert out.split() == ["ok"]


@pytest.mark.alone  # (it sets the machine's next pid: a process another test starts meanwhile takes it)
def test_a_reused_pid_is_not_the_consumer_that_had_it(tmp_path, shared):
    """A member's job named ``theirs`` reads and exits; root's unnamed job, then another job of the same member
    named ``mine`` get its pid in turn: each counted as itself, never as ``theirs``."""
    backing, rels, mnt = shared
    with mounted(backing, mnt, tmp_path / "cache", "1M", nm=1, allow_other=True, group="nogroup") as m:
        theirs = subprocess.Popen([PYTHON, "-c", _OPEN_ON_GO, m.path(rels[0])], env=_env("theirs"),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, user=NOBODY,
                                  group=NOBODY, extra_groups=[])
        _go(theirs)
        pid = theirs.pid
        _go(_spawn_at(pid, m.path(rels[1]), None, 0))  # root's job: anonymous
        time.sleep(0.05)  # (started a clock tick apart, as any two processes a python start apart are)
        _go(_spawn_at(pid, m.path(rels[2]), "mine", NOBODY))
        c = _consumers(m)
        assert c["theirs"]["opens"] == 1, c
        assert c[ANONYMOUS]["opens"] == 1 and c["mine"]["opens"] == 1


def test_a_flood_of_bad_names_logs_a_bounded_number_of_lines(tmp_path, shared):
    """200 requesters (threads) with a name that is not one, from a user with no rights and from the owner: the
    first never has its environment read, the owner gets one warning."""
    backing, rels, mnt = shared
    with mounted(backing, mnt, tmp_path / "cache", "1M", nm=1, allow_other=True) as m:
        for uid in (NOBODY, 0):
            user = {} if uid == 0 else {"user": uid, "group": NOBODY, "extra_groups": []}
            out = subprocess.run([PYTHON, "-c", _OPEN_FROM_THREADS, m.path(rels[0]), "200"], env=_env("not a name!"),
                                 capture_output=True, text=True, timeout=120, **user)
            assert out.stdout.split() == ["ok"], out.stderr
        lines = [line for line in m.stderr().splitlines() if "is not a consumer name" in line]
        assert len(lines) == 1 and "uid 0" in lines[0], lines


def test_one_users_names_are_capped(tmp_path, shared):
    """The owner starts MAX_CONSUMERS_PER_USER + 8 jobs, each named, each reading a file: the table keeps that
    user's first MAX_CONSUMERS_PER_USER, the others read as the anonymous consumer."""
    backing, rels, mnt = shared
    extra = 8
    with mounted(backing, mnt, tmp_path / "cache", "1M", nm=1, consumer_timeout=600) as m:
        for i in range(MAX_CONSUMERS_PER_USER + extra):
            out = subprocess.run(["head", "-c", "1", m.path(rels[0])], env=_env(f"job{i}"), capture_output=True,
                                 timeout=20)
            assert out.returncode == 0, out.stderr
        c = _consumers(m)
        named = sorted(n for n in c if n != ANONYMOUS)
        assert len(named) == MAX_CONSUMERS_PER_USER, named
        assert c[ANONYMOUS]["opens"] == extra
        assert all(c[n]["state"] == "live" for n in named)
