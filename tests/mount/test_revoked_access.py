"""Issue 46, item 2: access re-checked when the backing changes, on an ``allow_other`` mount read by another user.

The kernel checks the modes and owners the mount reported (``default_permissions``) and keeps them for the
attribute timeout.  A file replaced on the backing by a private one (``cp private tmp && mv tmp name``), or
rewritten and ``chmod 600``'d, must not hand its new bytes to a user whose kernel still holds the old 0644; a
``chmod 700`` of a class directory on the backing must close it to that user within the revalidation interval,
without a remount.  Every read by the other user runs in a subprocess with a deadline; ``mounted`` aborts the
FUSE connection of a mount left hanging.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from tierfs.testing.harness import make_dataset, mounted, wait_until, within

PRIVATE = b"PRIVATE-BYTES-" * 512

# As nobody: per path, stat it (``stat``) or open and read it twice (``read``: the second is a retry), or list it
# (``list``); print per path what came back: "ok", "private" (bytes of PRIVATE were read) or the errno's name.
_AS_OTHER = """
import errno, json, os, sys
out = []
for what, path in zip(sys.argv[1::2], sys.argv[2::2]):
    try:
        if what == 'stat':
            os.stat(path)
            out.append('ok')
        elif what == 'list':
            os.listdir(path)
            out.append('ok')
        else:
            for _ in range(2):
                try:
                    with open(path, 'rb') as f:
                        data = f.read()
                    out.append('private' if b'PRIVATE-BYTES-' in data else 'ok')
                except OSError as e:
                    out.append(errno.errorcode[e.errno])
    except OSError as e:
        out.append(errno.errorcode[e.errno])
print(json.dumps(out))
"""


def _as_other(as_nobody, *pairs: str) -> list[str]:
    """Run the probes of ``pairs`` (what, path, what, path, ...) as nobody (a 60 s deadline: ``other_user``)."""
    return json.loads(" ".join(as_nobody(_AS_OTHER, *pairs)))


def _cached(path: str) -> bool:
    try:
        return bool(os.getxattr(path, "user.tierfs.cache_path"))
    except OSError:
        return False


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _replace_by_private(path: str) -> None:
    """``cp private tmp && mv tmp name``: a new inode, mode 0600, owned by root."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(PRIVATE)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def _rewrite_then_chmod(path: str) -> None:
    """The same inode rewritten in place, then ``chmod 600``."""
    with open(path, "r+b") as f:
        f.write(PRIVATE)
        f.truncate()
    os.chmod(path, 0o600)


@pytest.mark.parametrize("policy", ["met", "lru"])
@pytest.mark.parametrize("change", [_replace_by_private, _rewrite_then_chmod], ids=["replaced", "rewritten"])
def test_a_file_made_private_on_the_backing_gives_its_new_bytes_to_nobody_who_saw_it_public(
        tmp_path, other_user, policy, change):
    """nobody stats an uncached 0644 file through the mount (the kernel keeps 0644); the backing file is made
    private; nobody's open fails with EACCES (the kernel checks again, on the new mode) and never reads a byte
    of the new content; root, who may, reads the new bytes at once."""
    mnt, as_nobody = other_user
    backing = tmp_path / "backing"
    files = make_dataset(backing, dirs=4, files_per_dir=4, min_size=4096, max_size=4096, seed=46)
    # revalidate=600: nothing but the open itself finds the change (the background re-stat would tell the kernel
    # first, and then the kernel alone refuses)
    with mounted(backing, mnt, tmp_path / "cache", "16M", nm=4, rf=1000, revalidate=600, policy=policy,
                 allow_other=True) as m:
        if policy == "met":
            wait_until(lambda: m.status()["next_ready"] and m.status()["staging"]["inflight"] == 0)
        rel = next(r for r in sorted(files) if not within(mnt, lambda r=r: _cached(m.path(r))))
        assert _as_other(as_nobody, "stat", m.path(rel)) == ["ok"]
        change(str(backing / rel))
        got = _as_other(as_nobody, "read", m.path(rel))
        assert got == ["EACCES", "EACCES"], got
        assert within(mnt, lambda: _read(m.path(rel))) == PRIVATE  # root: the new version, first try
        assert _as_other(as_nobody, "read", m.path(rel)) == ["EACCES", "EACCES"]
        others = sorted(set(files) - {rel})[:3]
        assert _as_other(as_nobody, *[x for r in others for x in ("read", m.path(r))]) == ["ok"] * 6
        assert m.process.poll() is None


def test_a_class_directory_closed_on_the_backing_closes_to_other_users_without_a_remount(tmp_path, other_user):
    """nobody lists a class directory and reads a file in it (the kernel keeps the directory's 0755 and the
    entries); the directory is ``chmod 700``'d on the backing: within the revalidation interval nobody's listing
    and opens in it fail with EACCES, root's still work; opened again (0755), nobody reads it again."""
    mnt, as_nobody = other_user
    backing = tmp_path / "backing"
    files = make_dataset(backing, dirs=3, files_per_dir=4, min_size=4096, max_size=4096, seed=47)
    with mounted(backing, mnt, tmp_path / "cache", "16M", nm=1, rf=1000, revalidate=2, allow_other=True) as m:
        closed = "class_001"
        inside = sorted(r for r in files if r.startswith(closed + "/"))
        probes = ["list", m.path(closed), *[x for r in inside for x in ("read", m.path(r))]]
        assert _as_other(as_nobody, *probes) == ["ok"] * (1 + 2 * len(inside))
        os.chmod(backing / closed, 0o700)
        deadline = time.monotonic() + 60
        while (got := _as_other(as_nobody, *probes)) != ["EACCES"] * (1 + 2 * len(inside)):
            assert "private" not in got
            assert time.monotonic() < deadline, f"still open to nobody after 60 s: {got}"
            time.sleep(0.2)
        assert within(mnt, lambda: sorted(os.listdir(m.path(closed)))) == [r.split("/")[1] for r in inside]
        assert within(mnt, lambda: _read(m.path(inside[0]))) == _read(backing / inside[0])
        other = sorted(r for r in files if r.startswith("class_002/"))[0]
        assert _as_other(as_nobody, "list", m.path("class_002"), "read", m.path(other)) == ["ok"] * 3
        os.chmod(backing / closed, 0o755)
        deadline = time.monotonic() + 60
        while (got := _as_other(as_nobody, *probes)) != ["ok"] * (1 + 2 * len(inside)):
            assert time.monotonic() < deadline, f"still closed to nobody after 60 s: {got}"
            time.sleep(0.2)
        assert m.process.poll() is None



def test_a_directory_closed_while_unmounted_is_closed_from_the_next_mount_on(tmp_path, other_user):
    """A remount over the same cache answers from the saved tree and rescans in the background; a ``chmod 700``
    made while unmounted closes the directory to nobody from that mount on, not from the one after (under
    ``revalidate=never`` only the rescan can see it)."""
    mnt, as_nobody = other_user
    backing = tmp_path / "backing"
    files = make_dataset(backing, dirs=3, files_per_dir=4, min_size=4096, max_size=4096, seed=48)
    closed = "class_002"
    inside = sorted(r for r in files if r.startswith(closed + "/"))
    options = dict(nm=1, rf=1000, revalidate="never", allow_other=True)
    with mounted(backing, mnt, tmp_path / "cache", "16M", **options) as m:
        assert _as_other(as_nobody, "list", m.path(closed), "read", m.path(inside[0])) == ["ok"] * 3
    os.chmod(backing / closed, 0o700)
    with mounted(backing, mnt, tmp_path / "cache", "16M", **options) as m:
        wait_until(lambda: m.status()["tree"]["rescan"] == "done", what="the rescan after the saved tree")
        assert m.status()["tree"]["source"] == "saved"
        got = _as_other(as_nobody, "list", m.path(closed), "read", m.path(inside[0]))
        assert got == ["EACCES"] * 3, got
        assert within(mnt, lambda: _read(m.path(inside[0]))) == _read(backing / inside[0])  # root's
