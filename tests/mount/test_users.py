"""Several users on one ``allow_other`` mount (issue 22): another user learns no name it could not list from
``/.tierfs/``, cannot starve the others of the daemon's descriptors, and cannot move the schedule."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys

from tierfs.testing.harness import make_dataset, mounted, wait_until

_CONTROL_FILES = ("order", "order0", "plan", "status", "metrics", "control")

# As nobody: read each control file; print {name: its text, or the errno's name}.
_READ_CONTROL_FILES = """
import errno, json, os, sys
out = {}
for name in sys.argv[2:]:
    try:
        with open(os.path.join(sys.argv[1], '.tierfs', name), 'rb') as f:
            out[name] = f.read().decode('utf-8', 'replace')
    except OSError as e:
        out[name] = errno.errorcode[e.errno]
print(json.dumps(out))
"""


def test_other_users_learn_no_names_from_the_control_files(tmp_path, other_user):
    """A 0700 directory's file names reach nobody through order, order0, plan, status (its errors), metrics or
    control; the mount's owner still reads them all."""
    mnt, as_nobody = other_user
    backing = tmp_path / "backing"
    make_dataset(backing, dirs=1, files_per_dir=2, min_size=4096, max_size=4096, seed=1)
    hidden = backing / "hidden"
    hidden.mkdir(mode=0o700)
    for i in range(8):
        (hidden / f"secret_{i}.bin").write_bytes(os.urandom(64 << 10))
    # One mini-epoch of everything, staged one file at a time at 64 KiB/s: six of the hidden files are removed
    # from the backing before the stager gets to most of them, so its error (status.last_error) names one (and
    # they leave the order: issue 48); the other two stay in the order.
    with mounted(backing, mnt, tmp_path / "cache", "16M", nm=1, rf=1000, staging_streams=1, bandwidth="64K",
                 allow_other=True) as m:
        for f in sorted(hidden.iterdir())[2:]:
            f.unlink()

        def staging_error_names_a_secret() -> bool:
            st = m.status()
            idle = st["staging"]["queued"] == 0 and st["staging"]["inflight"] == 0
            return idle and "secret_" in (st["last_error"] or "")

        wait_until(staging_error_names_a_secret, timeout=60, what="a staging error naming a hidden file")
        with open(m.path(".tierfs", "order"), "rb") as f:
            assert b"hidden/secret_" in f.read()  # the owner (root here) sees them
        seen = json.loads(" ".join(as_nobody(_READ_CONTROL_FILES, mnt, *_CONTROL_FILES)))
        assert "secret_" in (m.status()["last_error"] or "")  # (still named while nobody read it)
        leaks = {name: text for name, text in seen.items() if "secret" in text}
        assert not leaks, leaks
        assert {seen[n] for n in ("order", "order0", "plan", "status")} == {"EACCES"}  # their modes say so
        assert "tierfs_view_files 10" in seen["metrics"]  # the figures stay everyone's
        assert "rf=1000" in seen["control"]


def test_one_user_holding_descriptors_starves_nobody_else(dataset, tmp_path, other_user):
    """nobody opens files without end on a daemon limited to 512 descriptors: it gets EMFILE past its share,
    while root's opens all succeed and status.fds stays a count."""
    backing, files = dataset
    mnt, _ = other_user
    rels = sorted(files)
    with mounted(backing, mnt, tmp_path / "cache", "8M", nm=1, allow_other=True,
                 wrapper=("prlimit", "--nofile=512:512")) as m:
        assert m.status()["fd_limit"] == 512
        holder = subprocess.Popen(
            ["/usr/bin/python3", "-c", _HOLD, m.path(rels[0]), "600"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, user=65534, group=65534, extra_groups=[])
        try:
            ready, _, _ = select.select([holder.stdout], [], [], 120)
            assert ready, "nobody's opens did not finish"
            held, refused = (int(w) for w in holder.stdout.readline().split())
            assert held > 0 and refused == 600 - held > 0
            # root, meanwhile: every file, read whole, with a deadline
            out = subprocess.run([sys.executable, "-c", _READ_ALL, m.mountpoint, *rels], capture_output=True,
                                 text=True, timeout=120)
            assert out.returncode == 0, out.stderr
            assert [int(n) for n in out.stdout.split()] == [files[r] for r in rels]
            st = m.status()
            assert 0 < st["fds"] <= st["fd_limit"]
            budget = st["fd_budget"]
            assert held == budget["others_held"] <= budget["per_user_limit"] and budget["refused"] >= refused
        finally:
            holder.communicate("", timeout=60)  # nobody closes everything and exits
        wait_until(lambda: m.status()["fd_budget"]["others_held"] == 0, what="nobody's handles released")
        assert m.process.poll() is None


_HOLD = """
import os, sys
fds, refused = [], 0
for _ in range(int(sys.argv[2])):
    try:
        fds.append(os.open(sys.argv[1], os.O_RDONLY))
    except OSError:
        refused += 1
print(len(fds), refused, flush=True)
sys.stdin.read()
"""

_READ_ALL = """
import os, sys
for rel in sys.argv[2:]:
    with open(os.path.join(sys.argv[1], rel), 'rb') as f:
        print(len(f.read()))
"""

# N times: list the root and read one file of the view; then list the root once more.
_LIST_AND_READ = """
import os, sys
for _ in range(int(sys.argv[2])):
    dirs = [os.path.join(sys.argv[1], d) for d in sorted(os.listdir(sys.argv[1]))]
    path = next(os.path.join(d, n) for d in dirs for n in sorted(os.listdir(d)))  # (a dir may have none)
    with open(path, 'rb') as f:
        f.read()
os.listdir(sys.argv[1])
print('done')
"""


def test_other_users_reads_and_listings_do_not_move_the_schedule(dataset, tmp_path, other_user):
    """nobody lists the root and reads a file 12 times: served, and nobody's schedule moves; the owner's (root's)
    listing after a read still ends the pass."""
    backing, files = dataset
    mnt, as_nobody = other_user
    with mounted(backing, mnt, tmp_path / "cache", sum(files.values()), nm=4, rf=2, allow_other=True) as m:
        before = m.status()
        assert as_nobody(_LIST_AND_READ, mnt, "12") == ["done"]
        after = m.status()
        where = ("epoch", "mini_epoch", "pass", "passes_total")
        assert [after[k] for k in where] == [before[k] for k in where]
        served = after["reads"]["hits"] + after["reads"]["misses"]
        assert served == before["reads"]["hits"] + before["reads"]["misses"] + 12  # served, not counted
        out = subprocess.run([sys.executable, "-c", _LIST_AND_READ, mnt, "1"], capture_output=True, text=True,
                             timeout=60)
        assert out.stdout.split() == ["done"], out.stderr
        assert m.status()["passes_total"] == before["passes_total"] + 1


def test_a_steering_groups_members_steer_a_mount_run_by_root(dataset, tmp_path, other_user):
    """A mount run by root for its users (systemd's way) with group=nogroup: nobody's listings and reads move the
    schedule, nobody reads status and order and writes control; plan stays root's."""
    backing, files = dataset
    mnt, as_nobody = other_user
    with mounted(backing, mnt, tmp_path / "cache", sum(files.values()), nm=4, rf=2, allow_other=True,
                 group="nogroup") as m:
        before = m.status()
        seen = json.loads(" ".join(as_nobody(_READ_CONTROL_FILES, mnt, *_CONTROL_FILES)))
        assert seen["plan"] == "EACCES" and json.loads(seen["status"])["epoch"] == before["epoch"]
        assert seen["order"].splitlines() and seen["order0"]
        assert as_nobody(_LIST_AND_READ, mnt, "3") == ["done"]
        assert m.status()["passes_total"] == before["passes_total"] + 3  # each listing after a read ended one
        assert as_nobody(_WRITE_CONTROL, mnt, "rf=3") == ["ok"]
        assert m.status()["rf"] == 3


_WRITE_CONTROL = """
import os, sys
with open(os.path.join(sys.argv[1], '.tierfs', 'control'), 'w') as f:
    f.write(sys.argv[2] + '\\n')
print('ok')
"""
