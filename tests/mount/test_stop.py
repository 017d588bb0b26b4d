"""A clean stop, always (issue 22, item 3): SIGTERM or SIGINT while staging runs, pushes go into the
page cache and four readers read.  On the old code a push stayed in the kernel (``fuse_dev_write`` waiting on a
page lock held by a reader's READ that the stopped main loop never answered): the process never exited, a
reader waited in ``read()`` until the connection was aborted.

Readers are processes, so one stuck in the kernel can be freed (the connection aborted) and killed; each
compares every file it reads with the backing's bytes and ends at the first clean error of a stopped mount.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from tierfs.daemon.fuse.mount import STOP_DEADLINE_S
from tierfs.testing.harness import abort_connection, is_mounted, make_dataset, mounted

# Reads the mount in a loop until it stops: exit 0 after a clean end (the errors a stopped mount gives, or the
# mountpoint's own empty dir once unmounted), 3 on a wrong byte, 4 on any other error.
_READER = r"""
import errno, hashlib, json, os, random, sys
mnt, digests, seed = sys.argv[1], json.load(open(sys.argv[2])), int(sys.argv[3])
clean = {errno.ENOTCONN, errno.ECONNABORTED, errno.EIO, errno.ENOENT}
rng, n = random.Random(seed), 0
try:
    while True:
        dirs = os.listdir(mnt)  # (listing the root again ends a pass: the mini-epochs turn over)
        if not dirs:
            print("unmounted", n)
            sys.exit(0)
        for d in dirs:
            names = os.listdir(os.path.join(mnt, d))
            for name in rng.sample(names, min(6, len(names))):
                with open(os.path.join(mnt, d, name), "rb") as f:
                    got = hashlib.sha256(f.read()).hexdigest()
                if got != digests[f"{d}/{name}"]:
                    print("wrong bytes", d, name)
                    sys.exit(3)
                n += 1
except OSError as exc:
    print(errno.errorcode.get(exc.errno, exc.errno), n)
    sys.exit(0 if exc.errno in clean else 4)
"""

_ITERATIONS = 12
_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # (SIGHUP reopens the log: test_daemon_log.py)
_READER_DEADLINE_S = 15.0  # after the daemon is gone, a reader still running is stuck


def _push_waiting(pid: int) -> bool:
    """A thread of the daemon is blocked in a call on ``/dev/fuse``: a page-cache push (or an invalidation)
    waiting on a page lock that a reader's READ holds -- the moment the old code could not stop from.
    (Replies to requests never block; /proc/PID/task/TID/syscall gives the blocked call and its arguments.)"""
    fuse_fds = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == "/dev/fuse":
                    fuse_fds.add(int(fd))
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/syscall") as f:
                call = f.read().split()
            if len(call) > 1 and call[0] not in ("running", "-1") and int(call[1], 16) in fuse_fds:
                return True
    return False


def _stacks(pid: int) -> str:
    """The kernel stacks of ``pid``'s threads that are inside FUSE (what a stuck stop looks like)."""
    out = []
    with contextlib.suppress(OSError):
        for tid in sorted(os.listdir(f"/proc/{pid}/task")):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/stack") as f:
                frames = [line.split()[-1] for line in f]
                if any("fuse" in fr or "folio" in fr for fr in frames):
                    out.append(f"{tid}: " + " < ".join(frames[:4]))
    return "; ".join(out) or "no thread in FUSE"


def test_a_signal_under_staging_pushes_and_readers_always_stops_within_the_bound(tmp_path):
    """Each round: a fresh cache (staging and pushes at full speed), four readers, then a signal -- mostly the
    moment a push is seen waiting in the kernel (within a random time), otherwise at a random one."""
    backing, mnt = tmp_path / "b", tmp_path / "m"
    files = make_dataset(backing, dirs=4, files_per_dir=24, min_size=256 << 10, max_size=1 << 20, seed=22)
    digests = {rel: hashlib.sha256((backing / rel).read_bytes()).hexdigest() for rel in files}
    digest_file = tmp_path / "digests.json"
    digest_file.write_text(json.dumps(digests))
    mnt.mkdir()
    rng = random.Random(22)
    for it in range(_ITERATIONS):
        sig = _SIGNALS[it % len(_SIGNALS)]
        cache = tmp_path / f"c{it}"
        with mounted(backing, mnt, cache, "24M", nm=8, rf=1) as m:
            readers = [subprocess.Popen([sys.executable, "-c", _READER, str(mnt), str(digest_file), str(it * 4 + i)],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                       for i in range(4)]
            try:
                if rng.random() < 2 / 3:
                    deadline = time.monotonic() + rng.uniform(0.2, 2.0)
                    while not _push_waiting(m.process.pid) and time.monotonic() < deadline:
                        time.sleep(0.002)
                else:
                    time.sleep(rng.uniform(0.0, 1.0))
                m.process.send_signal(sig)
                try:
                    m.process.wait(STOP_DEADLINE_S + 10)
                except subprocess.TimeoutExpired:
                    pytest.fail(f"round {it}: the daemon did not exit within {STOP_DEADLINE_S + 10:g} s of "
                                f"{sig.name} ({_stacks(m.process.pid)})")
                assert m.process.returncode == 0, (it, sig.name, m.stderr()[-2000:])
                assert not is_mounted(mnt), f"round {it}: a mount left behind"
                for r in readers:
                    try:
                        out, _ = r.communicate(timeout=_READER_DEADLINE_S)
                    except subprocess.TimeoutExpired:
                        pytest.fail(f"round {it}: a reader still runs {_READER_DEADLINE_S:g} s after the daemon "
                                    f"exited ({sig.name}): {_stacks(r.pid)}")
                    assert r.returncode == 0, f"round {it} ({sig.name}): reader ended with {out.strip()!r}"
                log = m.stderr()
                assert "unmounted" in log and "Traceback" not in log, log[-3000:]
            finally:
                if any(r.poll() is None for r in readers) or m.process.poll() is None:
                    # (by its number: a daemon that unmounted lazily left no path to find it by)
                    abort_connection(mnt, m.connection)
                for r in readers:
                    if r.poll() is None:
                        r.kill()
                    r.wait(10)
