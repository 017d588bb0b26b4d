"""Damaged state files under a real mount (issue 48, item 4): a ``tree.bin`` whose first header numpy's parser
chokes on (``TokenError``) and an ``index.npz`` with a bad CRC-32 refused every mount with an exception's name;
a garbage journal was silent and a journal past the plan skipped the rest of its epoch.  Now each is said in the
daemon's log, naming the file, and the mount serves every file's bytes.  (The engine tests damage each file in
every way: tests/engine/test_damaged_state.py.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tierfs.daemon.cache.journal import load_position
from tierfs.daemon.tree.tree import Tree
from tierfs.testing.harness import within


def _warnings(log: str, name: str) -> list[str]:
    return [line for line in log.splitlines() if "WARNING" in line and name in line]


def _serves_every_file(m, backing: Path, files: dict[str, int]) -> None:
    for rel in sorted(files):
        assert within(m.mountpoint, lambda rel=rel: Path(m.path(rel)).read_bytes(), 30) == (backing / rel).read_bytes()


def _used(tierfs_mount, backing: Path, files: dict[str, int], cache: Path) -> None:
    """A mount that read every file and stopped cleanly: its tree, index and journal in the cache dir."""
    with tierfs_mount(nm=2) as m:
        _serves_every_file(m, backing, files)
    assert all((cache / n).is_file() for n in ("tree.bin", "index.npz", "journal.json"))


def _flip(path: Path, at: int) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[:at] + bytes([raw[at] ^ 0x5A]) + raw[at + 1:])


def test_a_damaged_tree_and_index_are_said_and_the_mount_serves(tierfs_mount, dataset, mount_dirs):
    backing, files = dataset
    _, cache = mount_dirs
    _used(tierfs_mount, backing, files, cache)
    tree = cache / "tree.bin"
    raw = tree.read_bytes()
    hlen = int.from_bytes(raw[8:10], "little")
    brace = raw.rindex(b"}", 0, 10 + hlen)
    tree.write_bytes(raw[:brace] + b" " + raw[brace + 1:])  # (numpy's header parser: TokenError)
    index = cache / "index.npz"
    raw = index.read_bytes()
    npy = raw.index(b"\x93NUMPY", raw.index(b"fps.npy"))
    _flip(index, npy + 10 + int.from_bytes(raw[npy + 8:npy + 10], "little") + 5)  # (zipfile: Bad CRC-32)
    with tierfs_mount(nm=2) as m:
        st = within(m.mountpoint, m.status)
        assert st["tree"]["source"] == "scan"
        _serves_every_file(m, backing, files)
        log = m.stderr()
    for name, cost in (("tree.bin", "scanned instead"), ("index.npz", "checked one by one")):
        said = _warnings(log, name)
        assert len(said) == 1 and "damaged" in said[0] and cost in said[0], log
    assert not any(w in log for w in ("Traceback", "TokenError", "BadZipFile"))  # (no exception's name)
    assert Tree.load(str(tree), os.stat(backing)) is not None  # saved whole again


def test_a_garbage_journal_is_said_and_the_mount_starts_afresh(tierfs_mount, dataset, mount_dirs):
    backing, files = dataset
    _, cache = mount_dirs
    _used(tierfs_mount, backing, files, cache)
    (cache / "journal.json").write_bytes(os.urandom(300))
    with tierfs_mount(nm=2) as m:
        st = within(m.mountpoint, m.status)
        assert (st["epoch"], st["mini_epoch"], st["pass"]) == (0, 0, 0)
        _serves_every_file(m, backing, files)
        said = _warnings(m.stderr(), "journal.json")
    assert len(said) == 1 and "damaged" in said[0] and "starts over at the first epoch" in said[0], said
    assert load_position(str(cache)) is not None  # journalled whole again


def test_a_journal_past_the_plan_resumes_the_same_epochs_last_mini_epoch(tierfs_mount, dataset, mount_dirs):
    backing, files = dataset
    _, cache = mount_dirs
    _used(tierfs_mount, backing, files, cache)
    journal = json.loads((cache / "journal.json").read_bytes())
    journal.update(epoch=3, mini_epoch=99, switch_due=False, **{"pass": 10**9})
    (cache / "journal.json").write_text(json.dumps(journal))
    with tierfs_mount(nm=2) as m:
        st = within(m.mountpoint, m.status)
        assert (st["epoch"], st["mini_epoch"], st["pass"]) == (3, 1, 0)  # (before: epoch 4, mini-epoch 0)
        _serves_every_file(m, backing, files)
        said = _warnings(m.stderr(), "journal.json")
    assert len(said) == 1 and "resuming at mini-epoch 2/2, pass 1" in said[0], said
