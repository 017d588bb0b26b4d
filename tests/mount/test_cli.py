"""The command line and the mount's life: foreground, --daemon, fstab form, systemd readiness, signals."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from tierfs.common.mountpoint_lock import holders
from tierfs.testing.harness import is_mounted

TIERFS = [sys.executable, "-m", "tierfs"]


def run_tierfs(*args, timeout=60, env=None):
    return subprocess.run([*TIERFS, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})


def wait_for(pred, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_foreground_mount_exits_0_on_sigterm_and_unmounts(tierfs_mount, mount_dirs):
    mnt, _ = mount_dirs
    with tierfs_mount(capacity="1M", rf=2) as m:
        assert is_mounted(mnt)
        m.process.send_signal(signal.SIGTERM)
        assert m.process.wait(timeout=20) == 0
        assert not is_mounted(mnt)


def test_foreground_mount_exits_0_on_sigint(tierfs_mount, mount_dirs):
    mnt, _ = mount_dirs
    with tierfs_mount(capacity="1M") as m:
        m.process.send_signal(signal.SIGINT)
        assert m.process.wait(timeout=20) == 0
        assert not is_mounted(mnt)


def test_external_unmount_ends_the_daemon_cleanly(tierfs_mount, mount_dirs):
    mnt, _ = mount_dirs
    with tierfs_mount(capacity="1M") as m:
        res = run_tierfs("umount", mnt)
        assert res.returncode == 0, res.stderr
        assert m.process.wait(timeout=20) == 0
        assert not is_mounted(mnt)


def test_daemon_returns_once_ready_and_umount_ends_it(dataset, mount_dirs, daemons):
    backing, files = dataset
    mnt, cache = mount_dirs
    res = run_tierfs("mount", backing, mnt, "--cache", cache, "--capacity", "1M", "--rf", "3", "--daemon")
    assert res.returncode == 0, res.stderr
    assert is_mounted(mnt)  # ready means mounted and answering, with no wait on our side
    status = json.loads((mnt / ".tierfs" / "status").read_bytes())
    assert status["rf"] == 3
    rel = next(iter(files))
    assert (mnt / rel).read_bytes() == (backing / rel).read_bytes()
    assert daemons()
    res = run_tierfs("umount", mnt)
    assert res.returncode == 0, res.stderr
    wait_for(lambda: not daemons(), what="the daemon to exit")
    assert not is_mounted(mnt)
    # the daemon's log never sits on the cache filesystem (a full cache disk must not cut it off: issue 11)
    from tierfs.daemon.fuse.mount import default_log_path

    log = default_log_path(str(mnt))
    try:
        assert not os.path.exists(cache / "tierfs.log") and not log.startswith(str(cache))
        with open(log) as f:
            text = f.read()
        assert "mounted" in text and text.endswith("\n")
    finally:
        os.unlink(log)


def test_daemon_reports_failure_with_exit_1_and_one_line(dataset, mount_dirs, daemons):
    backing, _ = dataset
    mnt, cache = mount_dirs
    # A cache too small for the largest file cannot work: refused before anything is mounted.
    res = run_tierfs("mount", backing, mnt, "--cache", cache, "--capacity", "1K", "--daemon")
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tierfs: error: "), res.stderr
    assert "capacity" in lines[0]
    assert not is_mounted(mnt)
    wait_for(lambda: not daemons(), what="the failed daemon to exit")


@pytest.mark.parametrize(
    ("args", "needle"),
    [(["mount", "B", "M"], "missing required options: cache, capacity"),
     (["mount", "B", "M", "--cache", "/tmp/c", "--capacity", "1G", "--rf", "0"], "rf: must be >= 1"),
     (["mount", "B", "M", "--cache", "/tmp/c", "--capacity", "1G", "--composition", "x"], "composition"),
     (["mount", "B", "M", "--cache", "/tmp/c", "--capacity", "1G", "--bogus", "1"], "unrecognized arguments"),
     (["B", "M", "-o", "cache=/tmp/c,capacity=1G,nm=zero"], "nm: expected an integer"),
     (["frobnicate"], "unknown command"),
     (["set", "M", "rf"], "expected KEY=VALUE"),
     (["set", "M", "seed=3"], "seed is fixed at mount time"),
     (["mount", "B", "M", "--cache", "/tmp/c", "--capacity", "-5G"], "capacity: must not be negative, got '-5G'"),
     (["B", "M", "-o", "cache=/tmp/c,capacity=-5G"], "capacity: must not be negative")],
)
def test_usage_errors_exit_2_with_one_line(args, needle):
    res = run_tierfs(*args)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tierfs: error: "), res.stderr
    assert needle in lines[0]


def test_runtime_errors_exit_1(tmp_path):
    res = run_tierfs("mount", tmp_path / "nope", tmp_path, "--cache", tmp_path / "c", "--capacity", "1G")
    assert res.returncode == 1 and "backing dir" in res.stderr
    res = run_tierfs("status", tmp_path)
    assert res.returncode == 1 and "not a tierfs mount" in res.stderr
    (tmp_path / "b" / "x").mkdir(parents=True)
    res = run_tierfs("mount", tmp_path / "b", tmp_path / "b" / "x", "--cache", tmp_path / "c", "--capacity", "1G")
    assert res.returncode == 1 and "must not contain each other" in res.stderr
    (tmp_path / "m").mkdir()
    res = run_tierfs("mount", tmp_path / "b", tmp_path / "m", "--cache", tmp_path / "b" / "c", "--capacity", "1G")
    assert res.returncode == 1 and "must not be inside the backing dir" in res.stderr
    assert not (tmp_path / "b" / "c").exists()


def test_fstab_form_daemonizes_and_ignores_generic_options(dataset, mount_dirs, daemons):
    backing, _ = dataset
    mnt, cache = mount_dirs
    opts = f"rw,nosuid,nodev,noexec,_netdev,nofail,x-systemd.automount,cache={cache},capacity=1M,rf=5,nm=4"
    res = run_tierfs(backing, mnt, "-o", opts)
    assert res.returncode == 0, res.stderr
    try:
        st = json.loads((mnt / ".tierfs" / "status").read_bytes())
        assert st["rf"] == 5
        with open("/proc/self/mounts") as f:
            line = next(ln for ln in f if ln.split()[1] == str(mnt))
        assert line.split()[0] == str(backing) and line.split()[2] == "fuse.tierfs"
    finally:
        run_tierfs("umount", mnt)
    wait_for(lambda: not daemons(), what="the daemon to exit")


@pytest.mark.skipif(shutil.which("mount.fuse3") is None, reason="mount.fuse3 not installed")
def test_mount_t_fuse_tierfs_goes_through_mount_fuse3(dataset, mount_dirs, daemons, tmp_path):
    """What an fstab line ``BACKING MNT fuse.tierfs cache=...,capacity=... 0 0`` runs."""
    backing, _ = dataset
    mnt, cache = mount_dirs
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "tierfs").write_text(f"#!/bin/sh\nexec {sys.executable} -m tierfs \"$@\"\n")
    (bindir / "tierfs").chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}
    res = subprocess.run(["mount.fuse3", f"tierfs#{backing}", str(mnt), "-o", f"nodev,cache={cache},capacity=1M"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    try:
        assert is_mounted(mnt)
        assert json.loads((mnt / ".tierfs" / "status").read_bytes())["cache_capacity"] == 1 << 20
    finally:
        run_tierfs("umount", mnt)
    wait_for(lambda: not daemons(), what="the daemon to exit")


def test_systemd_readiness_is_sent_once_the_mount_answers(dataset, mount_dirs, tmp_path):
    from tierfs.testing.harness import mounted

    backing, _ = dataset
    mnt, cache = mount_dirs
    sock_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    sock.settimeout(30)
    try:
        with mounted(backing, mnt, cache, "1M", env={"NOTIFY_SOCKET": sock_path}) as m:
            # the first mount's scan shows as systemd STATUS lines (start, every few seconds, end) first
            msgs = [sock.recv(4096).decode()]
            while "READY=1" not in msgs[-1].split("\n"):
                msgs.append(sock.recv(4096).decode())
            assert msgs[0].startswith("STATUS=scanning the backing dir: 0 entries")
            assert any(m_.startswith("STATUS=scanning the backing dir: ") and " 0 entries" not in m_
                       for m_ in msgs[:-1])
            assert is_mounted(mnt)
            m.process.send_signal(signal.SIGTERM)
            assert "STOPPING=1" in sock.recv(4096).decode().split("\n")
            assert m.process.wait(timeout=20) == 0
    finally:
        sock.close()


def test_status_set_and_their_errors(tierfs_mount, mount_dirs):
    mnt, _ = mount_dirs
    with tierfs_mount(capacity="1M", rf=2):
        res = run_tierfs("status", mnt, "--json")
        assert res.returncode == 0
        assert json.loads(res.stdout)["rf"] == 2
        res = run_tierfs("status", mnt)
        assert res.returncode == 0 and "epoch" in res.stdout and "cache" in res.stdout

        res = run_tierfs("set", mnt, "rf=7", "arf=score", "arf_wait=3")
        assert res.returncode == 0, res.stderr
        # it says what changed (and what was already so)
        assert res.stdout.splitlines() == ["rf: 2 -> 7", "arf: off -> score", "arf_wait: 3 (unchanged)"]
        res = run_tierfs("set", mnt, "arf_wait=2", "next-pass")
        assert res.stdout.splitlines() == ["arf_wait: 3 -> 2", "next-pass: sent"], res.stderr
        st = json.loads(run_tierfs("status", mnt, "--json").stdout)
        assert st["rf"] == 7 and st["arf"]["mode"] == "score"
        control = (mnt / ".tierfs" / "control").read_text()
        assert "rf=7\n" in control and "arf_wait=2\n" in control

        for bad, needle in [("rf=0", "rf: must be >= 1"), ("cache=/tmp", "cache cannot be changed"),
                            ("composition=zig", "composition")]:
            res = run_tierfs("set", mnt, bad)
            assert res.returncode == 2 and needle in res.stderr, res.stderr
        assert json.loads(run_tierfs("status", mnt, "--json").stdout)["rf"] == 7


#: ``tierfs set`` run in-process, counting the opens of the control file (an audit hook sees every ``open``) and
#: how often each value of the line is parsed (the one value parser, wrapped).
SET_PROBE = r"""
import collections, json, os, sys
import tierfs.common.options
from tierfs.cli import commands as cli
opens = collections.Counter()
def hook(event, args):
    if event == "open" and args[0] is not None and not isinstance(args[0], int) \
            and os.fsdecode(os.fspath(args[0])).endswith("/.tierfs/control"):
        opens["write" if args[2] & os.O_ACCMODE != os.O_RDONLY else "read"] += 1
sys.addaudithook(hook)
parsed = collections.Counter()
parse_value = tierfs.common.options.parse_value
def counting(key, text):
    parsed[f"{key}={text}"] += 1
    return parse_value(key, text)
tierfs.common.options.parse_value = counting
rc = cli.main(["set", sys.argv[1], "rf=7", "arf_wait=2", "next-pass"])
print(json.dumps({"rc": rc, "opens": opens, "parsed": {k: parsed[k] for k in ("rf=7", "arf_wait=2")}}))
"""


def test_set_parses_the_line_once_and_reads_the_control_file_once(tierfs_mount, mount_dirs):
    # (issue 25) it parsed the line four times and read the control file three times (before, to check, after):
    # what changed is known from the one read and the values parsed
    mnt, _ = mount_dirs
    with tierfs_mount(capacity="1M", rf=2):
        res = subprocess.run([sys.executable, "-c", SET_PROBE, str(mnt)], capture_output=True, text=True,
                             timeout=120, stdin=subprocess.DEVNULL)
        assert res.returncode == 0, res.stderr
        *printed, last = res.stdout.splitlines()
        assert printed == ["rf: 2 -> 7", "arf_wait: 3 -> 2", "next-pass: sent"]
        assert json.loads(last) == {"rc": 0, "opens": {"read": 1, "write": 1}, "parsed": {"rf=7": 1, "arf_wait=2": 1}}
        st = json.loads(run_tierfs("status", mnt, "--json").stdout)
        assert st["rf"] == 7 and st["passes_total"] == 1
        assert "arf_wait=2\n" in (mnt / ".tierfs" / "control").read_text()


def test_a_client_keeps_the_control_file_open_and_follows_a_remount(tierfs_mount, mount_dirs):
    from tierfs.client import Client

    mnt, _ = mount_dirs
    with tierfs_mount(capacity="1M", rf=2):
        client = Client(mnt)
        client.write("rf=3")
        fd = client._control_fd
        client.write("rf=4")  # the same descriptor: one write request, no open and release per write
        assert client._control_fd == fd and client.settings()["rf"] == "4"
    # the mount is gone and comes back: the descriptor kept belongs to the old one; the next write reopens
    with tierfs_mount(capacity="1M", rf=2):
        client.write("rf=5")
        assert client.settings()["rf"] == "5"  # (the old descriptor failed with ENOTCONN: opened again)
        with pytest.raises(ValueError, match="rf"):
            client.write("rf=0")
        client.close()
        assert client._control_fd is None


def test_allow_other_always_comes_with_default_permissions(tierfs_mount, mount_dirs):
    mnt, _ = mount_dirs
    with tierfs_mount(capacity="1M", allow_other=True):
        with open("/proc/self/mounts") as f:
            opts = next(ln for ln in f if ln.split()[1] == str(mnt)).split()[3].split(",")
        assert "allow_other" in opts and "default_permissions" in opts


def test_cache_dir_parent_must_exist_and_nothing_is_created(dataset, tmp_path):
    backing, _ = dataset
    (tmp_path / "m").mkdir()
    res = run_tierfs("mount", backing, tmp_path / "m", "--cache", tmp_path / "nonexistent" / "x", "--capacity", "1M")
    assert res.returncode == 1
    assert res.stderr.strip() == (f"tierfs: error: cannot create cache dir {tmp_path}/nonexistent/x: its parent "
                                  f"{tmp_path}/nonexistent does not exist (tierfs creates only the last component)")
    assert not (tmp_path / "nonexistent").exists()


def test_capacity_beyond_the_cache_filesystem_is_refused_with_both_numbers(dataset, tmp_path):
    backing, _ = dataset
    (tmp_path / "m").mkdir()
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    res = run_tierfs("mount", backing, tmp_path / "m", "--cache", tmp_path / "c", "--capacity", "1000T")
    assert res.returncode == 1
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith(f"tierfs: error: capacity 1000T ({1000 << 40} bytes) is more than the cache's filesystem")
    seen_free = int(line.split(" bytes = ")[1].split()[0])  # the disk is shared: near what we saw
    assert abs(seen_free - free) < 1 << 30
    assert not (tmp_path / "c").exists()  # refused before anything was created


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs")
def test_capacity_counts_what_the_cache_already_holds(tmp_path):
    """On a 16 MiB tmpfs whose cache dir holds 8 MiB, 20 MiB fits (free + held), 17 MiB over that does not."""
    from tierfs.common.options import MountConfig
    from tierfs.daemon.fuse.mount import MountError, check_paths

    fs = tmp_path / "fs"
    fs.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(fs)], check=True)
    try:
        (fs / "cache").mkdir()
        (fs / "cache" / "copy").write_bytes(b"x" * (8 << 20))
        (tmp_path / "b").mkdir()
        (tmp_path / "m").mkdir()
        st = os.statvfs(fs)
        room = st.f_bavail * st.f_frsize + (8 << 20)

        def config(capacity):
            return MountConfig(str(tmp_path / "b"), str(tmp_path / "m"), str(fs / "cache"), capacity)

        assert room > 8 << 20  # more than the free space alone
        check_paths(config(room))
        with pytest.raises(MountError, match=rf"= {room - (8 << 20)} free on .* \+ {8 << 20} already in the cache"):
            check_paths(config(room + 1))
    finally:
        subprocess.run(["umount", str(fs)], check=True)


def test_non_empty_mountpoint_is_refused_unless_nonempty(tierfs_mount, mount_dirs, dataset):
    mnt, cache = mount_dirs
    (mnt / "left-over").write_text("hidden by a mount")
    res = run_tierfs("mount", dataset[0], mnt, "--cache", cache, "--capacity", "1M")
    assert res.returncode == 1
    assert f"mountpoint {mnt} is not empty (1 entries would be hidden); give --nonempty" in res.stderr
    assert not is_mounted(mnt) and not cache.exists()
    with tierfs_mount(capacity="1M", nonempty=True):
        assert not (mnt / "left-over").exists()  # hidden, as asked
        assert is_mounted(mnt)
    assert (mnt / "left-over").read_text() == "hidden by a mount"


def test_control_takes_blanks_around_equals(tierfs_mount, mount_dirs):
    mnt, _ = mount_dirs
    with tierfs_mount(capacity="1M", rf=2) as m:
        # what a shell user types; one write through sh's echo
        subprocess.run(["sh", "-c", f'echo " rf = 5 " > {mnt}/.tierfs/control'], check=True)
        assert m.status()["rf"] == 5 and m.status()["last_error"] is None


def test_lru_does_not_need_twice_the_largest_file(dataset, mount_dirs):
    from tierfs.testing.harness import mounted

    backing, files = dataset
    mnt, cache = mount_dirs
    largest = max(files.values())
    with mounted(backing, mnt, cache, largest + 4096, policy="lru") as m:
        rel = max(files, key=files.get)
        assert len((mnt / rel).read_bytes()) == largest
        assert m.status()["cache_bytes"] <= largest + 4096


def test_fstab_remount_applies_live_options_and_refuses_fixed_changes(tierfs_mount, mount_dirs, dataset):
    """``mount -o remount`` runs the helper with the fstab line's options plus ``remount``: the live ones apply,
    the unchanged fixed ones pass, a changed fixed one is refused with what to do."""
    backing, _ = dataset
    mnt, cache = mount_dirs
    with tierfs_mount(capacity="1M", rf=2, seed=4) as m:
        line = f"defaults,_netdev,x-systemd.automount,cache={cache},capacity=1M,seed=4"
        res = run_tierfs(backing, mnt, "-o", f"remount,{line},rf=5,nm=4")
        assert res.returncode == 0, res.stderr
        assert res.stdout.splitlines() == ["rf: 2 -> 5", "nm: 8 -> 4"]
        assert m.status()["rf"] == 5
        for change, needle in [("seed=5", "seed is fixed at mount time (the mount has seed=4); unmount and mount"),
                               ("capacity=2M", "capacity is fixed at mount time"), ("rf=0", "rf: must be >= 1")]:
            res = run_tierfs(backing, mnt, "-o", f"remount,{line},{change}")
            assert res.returncode == 2 and needle in res.stderr, res.stderr
            assert len(res.stderr.strip().splitlines()) == 1
        assert m.status()["rf"] == 5 and is_mounted(mnt)
    res = run_tierfs(backing, mnt, "-o", f"remount,{line}")
    assert res.returncode == 1 and "not a tierfs mount" in res.stderr


def test_status_of_a_dead_mount_and_of_a_plain_dir_says_what_to_do(tierfs_mount, mount_dirs, tmp_path):
    mnt, _ = mount_dirs
    res = run_tierfs("status", tmp_path)
    assert res.returncode == 1
    assert "is not a tierfs mount (nothing is mounted there); mount one with 'tierfs mount BACKING" in res.stderr
    with tierfs_mount(capacity="1M") as m:
        m.process.kill()  # the daemon dies; the kernel keeps a dead mount
        m.process.wait(timeout=30)
        res = run_tierfs("status", mnt)
        assert res.returncode == 1
        (line,) = res.stderr.strip().splitlines()
        assert line == (f"tierfs: error: {mnt}: Transport endpoint is not connected: the tierfs daemon of this mount "
                        f"is gone (killed?) and the kernel keeps the dead mount; clear it with 'tierfs umount {mnt}' "
                        f"(or fusermount3 -uz {mnt}) and mount again: it resumes from its journal "
                        "(docs/operations.md, A dead mount)")
        res = run_tierfs("umount", mnt)  # the fix it names works
        assert res.returncode == 0, res.stderr
        assert not is_mounted(mnt)


#: A process wedged on a FUSE mount that never answers: one thread reads its own memory where a file of the mount
#: is mapped, through /proc/self/mem as a debugger or profiler does (the fault waits on the mount holding the
#: process's memory map), then the main thread asks to change the map (munmap, which queues for it).  Until the
#: mount answers, whoever reads the process's memory -- its /proc/PID/cmdline, environ -- waits too.  Any user can
#: make a process of theirs so; a hung network mount does it by accident.
WEDGE = """
import ctypes, mmap, os, sys, threading, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
size = os.path.getsize(sys.argv[1])
fd = os.open(sys.argv[1], os.O_RDONLY)
addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
spare = libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
mem = os.open("/proc/self/mem", os.O_RDONLY)
fault = threading.Thread(target=os.pread, args=(mem, 1, addr + size - 1), daemon=True)
fault.start()
while open(f"/proc/self/task/{fault.native_id}/stat").read().rsplit(")", 1)[1].split()[0] != "D":
    time.sleep(0.01)
print("faulting", flush=True)
libc.munmap(spare, mmap.PAGESIZE)
"""


def _threads_waiting(pid: int) -> bool:
    """Whether every thread of our child ``pid`` sleeps uninterruptibly (its own stat files: no memory read)."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            states.append(f.read().rsplit(")", 1)[1].split()[0])
    return bool(states) and all(s == "D" for s in states)


def test_cli_on_a_plain_dir_never_waits_on_a_process_wedged_on_a_fuse_mount(tmp_path):
    """`tierfs status/set/metrics/umount` where nothing is mounted answer at once, whatever other processes do:
    they once read every process's /proc/PID/cmdline (to say "tierfs is starting there"), and waited as long as
    any process stayed wedged on a FUSE mount (issue 46)."""
    from tierfs.testing.harness import passthrough

    source, hung, plain = tmp_path / "source", tmp_path / "hung", tmp_path / "plain"
    for d in (source, hung, plain):
        d.mkdir()
    (source / "big").write_bytes(os.urandom(4 << 20))
    hang = tmp_path / "hang"
    hang.write_text("read:big\n")  # its reads past the first byte never answer
    with passthrough(source, hung, hang=str(hang)):
        wedged = subprocess.Popen([sys.executable, "-c", WEDGE, str(hung / "big")], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert wedged.stdout is not None and wedged.stdout.readline() == "faulting\n"
            wait_for(lambda: _threads_waiting(wedged.pid), what="the child to wedge")
            for args in (["status", plain], ["set", plain, "rf=2"], ["metrics", plain], ["umount", plain]):
                try:
                    res = run_tierfs(*args, timeout=30)
                except subprocess.TimeoutExpired:
                    pytest.fail(f"tierfs {args[0]} on a plain dir waited on a process wedged on a FUSE mount")
                assert res.returncode == 1, res.stderr
                assert f"{plain} is not a tierfs mount (nothing is mounted there)" in res.stderr, res.stderr
        finally:
            wedged.kill()
            hang.write_text("")  # the fault is answered: the killed child can end
            wedged.wait(timeout=30)
            if wedged.stdout is not None:
                wedged.stdout.close()


def test_status_names_a_tierfs_that_is_starting_from_its_lock_on_the_mountpoint(mount_dirs, tmp_path):
    """A tierfs that has not mounted yet (here: its backing's statfs never answers) holds a lock on its mountpoint
    from the start; `tierfs status` there names its pid, found in /proc/locks (tierfs.common.mountpoint_lock)."""
    from tierfs.testing.harness import passthrough, wait_until

    mnt, cache = mount_dirs
    source, backing = tmp_path / "source", tmp_path / "backing"
    source.mkdir()
    backing.mkdir()
    (source / "a").write_bytes(b"x" * 100)
    hang = tmp_path / "hang"
    hang.write_text(".\n")
    with passthrough(source, backing, hang=str(hang)):
        daemon = subprocess.Popen([*TIERFS, "mount", backing, mnt, "--cache", cache, "--capacity", "1M"],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until(lambda: holders(str(mnt)) == [daemon.pid], what="the daemon's lock on its mountpoint")
            res = run_tierfs("status", mnt)
            assert res.returncode == 1
            assert res.stderr.startswith(f"tierfs: error: {mnt} is not a tierfs mount yet: tierfs (pid {daemon.pid}) "
                                         "is starting there"), res.stderr
        finally:
            daemon.kill()
            hang.write_text("")
            daemon.wait(timeout=30)
    assert holders(str(mnt)) == []  # the lock ends with the process


# ------------------------------------------------------------------------------------------------ issue 47


def test_umount_returns_once_the_daemon_has_finished_so_the_cache_can_go(tmp_path, mount_dirs, daemons):
    """``tierfs umount M && rm -rf CACHE``, and ``umount`` then an immediate remount, in a loop: umount returns
    once the daemon has exited, its index and journal written whole, so nothing races it.  (Before, umount
    returned as the kernel let the mount go, while the daemon still wrote its index of every copy: here, with
    thousands of copies, it was still running after most umounts.)"""
    from tierfs.daemon.cache.index import load_index
    from tierfs.daemon.cache.journal import load_position
    from tierfs.daemon.fuse.mount import default_log_path
    from tierfs.testing.harness import make_dataset

    backing = tmp_path / "many"
    make_dataset(backing, dirs=20, files_per_dir=250, max_size=2048, seed=4)
    mnt, cache = mount_dirs
    try:
        for round_ in range(5):
            res = run_tierfs("mount", backing, mnt, "--cache", cache, "--capacity", "64M", "--nm", "1", "--daemon")
            assert res.returncode == 0, res.stderr
            for d in os.listdir(mnt):  # every file, so that the index has thousands of copies to name
                for name in os.listdir(mnt / d):
                    assert (mnt / d / name).read_bytes() == (backing / d / name).read_bytes()
            res = run_tierfs("umount", mnt)
            assert res.returncode == 0, res.stderr
            assert not daemons(), f"round {round_}: umount returned while the daemon still ran"
            assert not is_mounted(mnt)
            fd = os.open(cache, os.O_RDONLY | os.O_DIRECTORY)
            try:
                index = load_index(fd)
            finally:
                os.close(fd)
            assert index is not None and len(index.names) == 5000, f"round {round_}: index.npz missing or partial"
            assert load_position(str(cache)) is not None, f"round {round_}: no journal, or not whole"
            if round_ % 2 == 0:
                shutil.rmtree(cache)  # (rm -rf CACHE: nothing writes into it any more)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(default_log_path(str(mnt)))


def test_umount_says_so_when_the_daemon_does_not_finish(tierfs_mount, mount_dirs):
    """A process that still holds the mountpoint's lock after the unmount (a daemon that does not finish) keeps
    umount waiting; at --timeout it says so and exits 1, so that ``umount && rm -rf CACHE`` removes nothing."""
    mnt, _ = mount_dirs
    fd = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)  # (before the mount: the directory under it)
    hold = "import fcntl, os, sys; fcntl.flock(int(sys.argv[1]), fcntl.LOCK_SH); print(flush=True); sys.stdin.read()"
    straggler = subprocess.Popen([sys.executable, "-c", hold, str(fd)], pass_fds=(fd,), stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
    try:
        assert straggler.stdout.readline() == "\n"  # it holds the lock
        with tierfs_mount(capacity="1M") as m:
            res = run_tierfs("umount", mnt, "--timeout", "0.5")
            assert m.process.wait(timeout=20) == 0  # the daemon itself finished
        assert res.returncode == 1 and not is_mounted(mnt)
        assert f"{mnt} is unmounted, but its tierfs daemon (pid {straggler.pid}) is still finishing after 0.5 s" \
            in res.stderr, res.stderr
        assert "wait for it to exit before removing its cache dir" in res.stderr
    finally:
        straggler.kill()
        straggler.communicate(timeout=10)  # (and closes its pipes)
        os.close(fd)


def test_the_defaults_mount_a_data_set_of_fewer_files_than_the_default_nm(tmp_path, mount_dirs):
    """5 files and no nm: the default nm (8) is lowered to 5 and said; an nm given above the files is refused
    with the most that works."""
    from tierfs.testing.harness import make_dataset, mounted

    mnt, cache = mount_dirs
    backing = tmp_path / "five"
    files = make_dataset(backing, dirs=1, files_per_dir=5, seed=3)
    with mounted(backing, mnt, cache, "1M") as m:
        assert m.status()["nm"] == 5
        for rel in files:
            assert (mnt / rel).read_bytes() == (backing / rel).read_bytes()
        assert "nm=8 (the default) is more mini-epochs than the data set has files: mounted with nm=5" in m.stderr()
    res = run_tierfs("mount", backing, mnt, "--cache", cache, "--capacity", "1M", "--nm", "6")
    assert res.returncode == 1 and "use at most 5" in res.stderr, res.stderr
