"""The backing scan and opens beneath the root: no link followed, no filesystem crossed."""

from __future__ import annotations

import errno
import itertools
import os
import subprocess
import time

import numpy as np
import pytest

from tierfs.daemon.backing import beneath as tree_mod
from tierfs.daemon.backing.beneath import open_beneath
from tierfs.daemon.tree.tree import KIND_DIR, KIND_FILE, KIND_LINK, KIND_SPECIAL, Tree


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "root"
    (r / "b" / "c").mkdir(parents=True)
    (r / "a.bin").write_bytes(b"a")
    (r / "b" / "z.bin").write_bytes(b"zz")
    (r / "b" / "c" / "y.bin").write_bytes(b"yyy")
    (r / "b" / "fifo").parent.mkdir(exist_ok=True)
    os.mkfifo(r / "b" / "fifo")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_bytes(b"secret")
    os.symlink(tmp_path / "outside", r / "link_dir")
    os.symlink("z.bin", r / "b" / "link_file")
    (r / ".tierfs").mkdir()
    (r / ".tierfs" / "shadowed.bin").write_bytes(b"s")  # hidden by the mount's control dir: not data
    return r


def test_scan_storage_order_kinds_and_links(root):
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        t = Tree.scan(fd)
    finally:
        os.close(fd)
    assert [t.file_path(i) for i in range(t.n_files)] == [b"a.bin", b"b/c/y.bin", b"b/z.bin"]
    assert t.sizes.tolist() == [1, 3, 2]
    kinds = {n.path: n.kind for n in t.nodes}
    assert kinds[b"link_dir"] == KIND_LINK and kinds[b"b/c"] == KIND_DIR
    assert kinds[b"b/fifo"] == KIND_SPECIAL and b"link_dir/secret" not in kinds  # listed, never a dataset file
    assert t.nodes[t.nodes[0].children[b"link_dir"]].link == os.fsencode(root.parent / "outside")
    assert t.dirs_with_data[t.nodes[0].children[b"b"]]


@pytest.mark.parametrize("use_openat2", [True, False])
def test_open_beneath_refuses_links_anywhere(root, monkeypatch, use_openat2):
    monkeypatch.setattr(tree_mod, "_have_openat2", use_openat2 and tree_mod._have_openat2)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    dev = os.fstat(fd).st_dev
    try:
        f = open_beneath(fd, b"b/c/y.bin", dev)
        assert os.read(f, 10) == b"yyy"
        os.close(f)
        for path in (b"link_dir/secret", b"b/link_file"):
            with pytest.raises(OSError) as exc:
                open_beneath(fd, path, dev)
            assert exc.value.errno in (errno.ELOOP, errno.ENOTDIR)
        with pytest.raises(OSError):
            open_beneath(fd, b"../outside/secret", dev)
    finally:
        os.close(fd)


def test_scan_and_open_never_cross_filesystems(root, tmp_path):
    inner = root / "b" / "mnt"
    inner.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(inner)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        (inner / "other.bin").write_bytes(b"other fs")
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            t = Tree.scan(fd)
            assert all(not n.path.startswith(b"b/mnt") for n in t.nodes)
            for have in (True, False):
                tree_mod._have_openat2 = have and tree_mod._have_openat2
                with pytest.raises(OSError) as exc:
                    open_beneath(fd, b"b/mnt/other.bin", t.dev)
                assert exc.value.errno == errno.EXDEV
        finally:
            os.close(fd)
            tree_mod._have_openat2 = tree_mod._libc is not None
    finally:
        subprocess.run(["umount", "-l", str(inner)], capture_output=True)


def _scan(path) -> Tree:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return Tree.scan(fd)
    finally:
        os.close(fd)


def _described(t: Tree) -> list[tuple]:
    """Every node as a reader of the tree sees it (made lazily, in any order)."""
    out = []
    for i in reversed(range(len(t.nodes))):  # children before parents: nothing depends on the order made
        n = t.nodes[i]
        out.append((i, n.name, n.parent, n.kind, n.path, n.link, n.fidx, tuple(n.st),
                    sorted(n.children.items()) if n.children is not None else None))
    return sorted(out)


@pytest.fixture
def odd_root(root):
    """The ``root`` tree plus odd names, an empty dir, a deep chain and a dangling link."""
    for name in ("sp ace", "nl\nine", "-dash", "uni\u00e9", "back\\slash"):
        (root / "b" / f"{name}.bin").write_bytes(name.encode())
    (root / "empty").mkdir()
    deep = root / "d1" / "d2" / "d3"
    deep.mkdir(parents=True)
    (deep / "deep.bin").write_bytes(b"deep")
    os.symlink("nowhere", root / "b" / "dangling")
    (root / "b" / "bad\xff".encode().decode("utf-8", "surrogateescape")).write_bytes(b"\xff")
    return root


def test_a_saved_tree_loads_as_the_scanned_one(odd_root, tmp_path):
    """Nodes are made on first use from the tree's arrays: the loaded tree answers exactly as the scanned one
    (names, parents, kinds, paths, links, file indices, stats, children), and the directories with data."""
    t = _scan(odd_root)
    path = str(tmp_path / "tree.bin")
    t.save(path)
    loaded = Tree.load(path, os.stat(odd_root))
    assert loaded is not None
    assert _described(loaded) == _described(t)
    assert loaded.files.tolist() == t.files.tolist() and loaded.sizes.tolist() == t.sizes.tolist()
    assert loaded.dirs_with_data.tolist() == t.dirs_with_data.tolist()
    assert loaded.dirs_with_data[loaded.nodes[0].children[b"d1"]] and not loaded.dirs_with_data[
        loaded.nodes[0].children[b"empty"]]
    assert [loaded.file_path(f) for f in range(loaded.n_files)] == [t.file_path(f) for f in range(t.n_files)]
    assert Tree.load(path, os.stat(tmp_path)) is None  # saved for another root


def test_a_tree_saved_in_the_old_format_or_damaged_is_not_loaded(root, tmp_path):
    import numpy as np

    t = _scan(root)
    old = tmp_path / "old.bin"  # what an early release wrote (a zip of arrays, no version, no path hashes)
    with open(old, "wb") as f:
        np.savez(f, names=np.frombuffer(b"".join(n.name for n in t.nodes), np.uint8), parents=t.parents,
                 kinds=t.kinds, files=t.files)
    assert Tree.load(str(old), os.stat(root)) is None
    v2 = tmp_path / "v2.bin"  # format 2: .npy records, a version head of three numbers
    with open(v2, "wb") as f:
        for a in (np.array([2, t.n_nodes, t.n_files], np.int64), t.parents, t.kinds):
            np.save(f, a)
    assert Tree.load(str(v2), os.stat(root)) is None
    path = tmp_path / "tree.bin"
    t.save(str(path))
    whole = path.read_bytes()
    for cut in (len(whole) // 2, len(whole) - 1, 10):
        path.write_bytes(whole[:cut])  # torn (the save is atomic; a disk can still lose a tail)
        assert Tree.load(str(path), os.stat(root)) is None
    path.write_bytes(b"garbage")
    assert Tree.load(str(path), os.stat(root)) is None


def test_compare_finds_changed_gone_and_added_files(root, tmp_path):
    old = _scan(root)
    (root / "b" / "z.bin").write_bytes(b"changed")
    os.unlink(root / "a.bin")
    (root / "b" / "new.bin").write_bytes(b"n")
    new = _scan(root)
    news = old.compare(new)
    assert [(old.file_path(f), st.st_size) for f, st in news.changed] == [(b"b/z.bin", 7)]
    assert [old.file_path(f) for f in news.gone] == [b"a.bin"]
    assert [new.file_path(g) for g in news.added.tolist()] == [b"b/new.bin"]
    again = old.compare(old)
    assert (again.changed, again.gone, again.added.tolist(), again.returned) == ([], [], [], [])


def test_lookups_and_attributes_from_the_arrays_agree_with_the_nodes(odd_root):
    """A child found by name in the arrays (binary search over sorted names) is the node's child, odd and
    non-UTF-8 names included; a name that is not there is None; attributes are the node's stat."""
    with open(os.path.join(os.fsencode(odd_root), b"b", b"raw\xff.bin"), "wb") as f:
        f.write(b"not utf-8")
    t = _scan(odd_root)
    dirs = [i for i in range(len(t.nodes)) if t.kind_of(i) == KIND_DIR]
    assert len(dirs) >= 6
    for d in dirs:
        children = t.nodes[d].children
        assert [t.name(k) for k in t.children(d).tolist()] == sorted(children)  # empty dirs included
        for name, k in children.items():
            assert t.child(d, name) == k
            assert t.child(d, name + b"\0") is None and t.child(d, b"\0" + name) is None
            mode, nlink, uid, gid, rdev, size, blocks, mtime, ctime = t.attributes(k)
            st = os.lstat(os.path.join(odd_root, os.fsdecode(t.path(k))))
            assert (mode, nlink, uid, gid, rdev, size, blocks, mtime, ctime) == (
                st.st_mode, st.st_nlink, st.st_uid, st.st_gid, st.st_rdev, st.st_size, st.st_blocks, st.st_mtime_ns,
                st.st_ctime_ns)
        assert t.child(d, b"no such name") is None
    b = t.child(0, b"b")
    assert t.link(t.child(b, b"dangling")) == b"nowhere"
    assert t.attributes(t.child(b, b"raw\xff.bin"))[5] == len(b"not utf-8")


def test_hard_links_are_known_by_their_first_name(root):
    os.link(root / "b" / "z.bin", root / "a2.bin")
    os.link(root / "b" / "z.bin", root / "b" / "c" / "z2.bin")
    t = _scan(root)
    paths = [t.file_path(f) for f in range(t.n_files)]
    assert paths == [b"a.bin", b"a2.bin", b"b/c/y.bin", b"b/c/z2.bin", b"b/z.bin"]
    assert [t.first_name(f) for f in range(t.n_files)] == [0, 1, 2, 1, 1]
    assert t.first_names().tolist() == [0, 1, 2]


def test_nodes_made_on_use_stay_bounded(tmp_path):
    """Touching every node of a 20,000-file tree (each Node, each path, each lookup) keeps at most NODE_CACHE
    Node objects alive: nothing made on use stays resident per file."""
    import gc

    from tierfs.daemon.tree.tree import NODE_CACHE, Node

    root = tmp_path / "many"
    for d in range(20):
        (root / f"d{d:02d}").mkdir(parents=True)
        dfd = os.open(root / f"d{d:02d}", os.O_RDONLY | os.O_DIRECTORY)
        for i in range(1000):
            os.close(os.open(f"f{i:04d}", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=dfd))
        os.close(dfd)
    t = _scan(root)
    assert t.n_files == 20_000
    for i in range(len(t.nodes)):
        assert t.nodes[i].path == t.path(i)
    for f in range(t.n_files):
        t.file_node(f)
        assert t.child(int(t.groups[f]), t.name(f + 1)) == f + 1
    gc.collect()
    # (type(), not isinstance(): that reads ``__class__`` of every live object, and some warn when asked)
    assert sum(type(o) is Node for o in gc.get_objects()) <= NODE_CACHE


def _scan_reporting(path):
    """(the tree, every ScanCount the scan reported) of a scan of ``path``."""
    import tierfs.daemon.tree.tree as treemod

    counts: list[treemod.ScanCount] = []
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return treemod.Tree.scan(fd, str(path), counts.append), counts
    finally:
        os.close(fd)



def test_a_scan_reports_entries_files_and_bytes_between_batches_of_one_flat_directory(tmp_path, monkeypatch):
    """Progress comes between batches of a directory too (a huge flat one still reports), with the files and
    bytes found so far; the last report is the whole tree; no total for a directory inside a filesystem."""
    import tierfs.daemon.tree.tree as treemod

    flat = tmp_path / "flat"
    flat.mkdir()
    for i in range(1000):
        (flat / f"f{i:04d}").write_bytes(b"x" * (i % 7))
    monkeypatch.setattr(treemod, "SCAN_REPORT_S", 0.0)
    t, counts = _scan_reporting(flat)
    assert counts[0].entries == 0 and counts[0].files == 0
    middle = [c for c in counts[1:-1] if 1 < c.entries < t.n_nodes]
    assert len(middle) >= 2  # reports between the 256-name batches of the one directory
    assert all(a.entries <= b.entries and a.bytes <= b.bytes for a, b in itertools.pairwise(counts))
    last = counts[-1]
    assert (last.entries, last.files, last.bytes) == (t.n_nodes, 1000, sum(i % 7 for i in range(1000)))
    assert last.total is None and last.eta is None and "1,000 files" in last.line()


def test_a_scan_of_a_filesystems_root_knows_its_total(tmp_path):
    """The backing dir is a filesystem of its own (an export's root): its used inodes are the entries to come,
    so the progress has a total and an ETA."""
    import subprocess


    if os.getuid() != 0:
        pytest.skip("mounts a tmpfs")
    root = tmp_path / "fs"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(root)], check=True, timeout=30)
    try:
        for d in range(3):
            (root / f"d{d}").mkdir()
            for i in range(50):
                (root / f"d{d}" / f"f{i}").write_bytes(b"y")
        t, counts = _scan_reporting(root)
        assert counts[0].total is not None and counts[0].total >= t.n_nodes
        assert counts[-1].total == counts[-1].entries == t.n_nodes and counts[-1].eta == 0.0
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False, timeout=30)


# ------------------------------------------------------------------------------------------- room to grow
# (issue 48 item 6: files the backing gains join a running mount; no number the kernel holds changes)


def _grown(old: Tree, root) -> tuple[Tree, object]:
    """Rescan ``root`` and take what it gained into ``old`` (what the mount's rescanner does)."""
    new = _scan(root)
    news = old.compare(new)
    for f in news.gone:
        old.mark_gone(f)
    return new, old.grow(old.additions(new, news.added), news.returned)


def _walked(t: Tree, i: int = 0) -> list[tuple]:
    """Every entry reachable from node ``i``: (path, kind, attributes, link text), depth first by name."""
    out = [(t.path(i), t.kind_of(i), t.attributes(i), t.link(i))]
    for k in t.children(i).tolist():
        out += _walked(t, k)
    return out


def test_room_keeps_every_number_and_shows_nothing_more(odd_root):
    plain = _scan(odd_root)
    t = plain.with_room(50, 7)
    assert (t.n_files, t.n_slots, t.room) == (plain.n_files, plain.n_files + 50, (50, 7))
    assert _walked(t) == _walked(plain)
    for f in range(plain.n_files):
        assert (t.file_path(f), t.fingerprint_of(f), t.inode_of(f)) == (plain.file_path(f), plain.fingerprint_of(f),
                                                                       plain.inode_of(f))
    for i in plain.dir_nodes.tolist():  # (directories move past the room: their names, paths and children stay)
        j = t.child(t.parents[i + 50] if i else 0, plain.name(i)) if i else 0
        assert t.path(j) == plain.path(i) and t.names_of(t.children(j)) == plain.names_of(plain.children(i))
    assert len(t.first_names()) == plain.n_files and t.fingerprints().shape == (plain.n_files, 4)
    assert (t.sizes[plain.n_files:] == 0).all() and not t.gone.any()
    # (the mount's way: the scanned tree gives up each array as its longer one is made; the same tree)
    consumed = _scan(odd_root).with_room(50, 7, consume=True)
    assert _walked(consumed) == _walked(t) and (consumed.parents == t.parents).all() and (consumed.size == t.size).all()


def test_additions_join_in_their_directories_only_when_their_growth_joins(root, tmp_path):
    t = _scan(root).with_room(8, 4)
    old_paths = [t.file_path(f) for f in range(t.n_files)]
    dirs_before = {t.path(i): i for i in t.dir_nodes.tolist()}
    (root / "b" / "m.bin").write_bytes(b"m")  # (between b/c and b/z.bin by name)
    (root / "new" / "deep").mkdir(parents=True)
    (root / "new" / "x.bin").write_bytes(b"x")
    (root / "new" / "deep" / "y.bin").write_bytes(b"yy")
    os.symlink("b", root / "link")
    os.unlink(root / "a.bin")
    in_b, in_root = t.names_of(t.children(t.child(0, b"b"))), t.names_of(t.children(0))
    _, g = _grown(t, root)
    assert (g.files, g.others, g.left_out, t.n_files, t.joining) == (3, 3, 0, len(old_paths) + 3, 3)
    assert [t.file_path(f) for f in range(len(old_paths))] == old_paths  # (no file renumbered)
    # hidden until they join: in no directory, masked as gone, not listed
    assert t.child(0, b"new") is None and t.child(t.child(0, b"b"), b"m.bin") is None
    assert t.present(np.arange(t.n_files)).tolist() == list(range(1, len(old_paths)))  # (a.bin gone, 3 hidden)
    # a rescan before they join finds them taken: nothing taken twice
    _, again = _grown(t, root)
    assert (again.files, again.others, t.n_files) == (0, 0, len(old_paths) + 3)
    assert t.join(g.number) == 3 and t.joining == 0
    b = t.child(0, b"b")
    assert t.names_of(t.children(b)) == sorted([*in_b, b"m.bin"])
    assert t.names_of(t.children(0)) == sorted([*in_root, b"link", b"new"])
    new_dir = t.child(0, b"new")
    assert t.names_of(t.children(new_dir)) == [b"deep", b"x.bin"] and t.link(t.child(0, b"link")) == b"b"
    y = t.child(t.child(new_dir, b"deep"), b"y.bin")
    assert t.path(y) == b"new/deep/y.bin" and t.file_stat(t.fidx_of(y)).st_size == 2
    assert {t.path(i): i for i in t.dir_nodes.tolist() if t.path(i) in dirs_before} == dirs_before
    assert sorted(t.file_paths(t.present(np.arange(t.n_files)))) == sorted(
        [p for p in old_paths if p != b"a.bin"] + [b"b/m.bin", b"new/x.bin", b"new/deep/y.bin"])
    # a file found gone that comes back joins again the same way
    (root / "a.bin").write_bytes(b"back")
    _, back = _grown(t, root)
    assert (back.files, back.returned, t.gone_files, t.joining) == (0, 1, 0, 1)
    assert t.present(np.array([0])).size == 0
    t.join(back.number)
    assert t.present(np.array([0])).tolist() == [0] and t.file_stat(0).st_size == 4


def test_what_the_room_cannot_hold_and_a_kind_that_changed_are_left_out(root):
    t = _scan(root).with_room(2, 1)
    (root / "b" / "c" / "y.bin").unlink()
    (root / "b" / "c" / "y.bin").mkdir()  # (a file that became a directory: shows from the next mount)
    (root / "one").mkdir()
    for name in ("p.bin", "q.bin", "r.bin"):
        (root / "one" / name).write_bytes(b"1")
    (root / "two").mkdir()  # (no room left for a second directory: it and its file are left out)
    (root / "two" / "s.bin").write_bytes(b"2")
    _, g = _grown(t, root)
    assert (g.files, g.others, g.left_out, t.room) == (2, 1, 2, (0, 0))
    t.join(g.number)
    assert t.names_of(t.children(t.child(0, b"one"))) == [b"p.bin", b"q.bin"] and t.child(0, b"two") is None
    assert t.kind_of(t.child(t.child(t.child(0, b"b"), b"c"), b"y.bin")) == KIND_FILE  # (the old file, gone)


def test_files_still_being_written_and_empty_directories_wait_for_a_later_rescan(root):
    t = _scan(root).with_room(8, 4)
    before = time.time_ns() - 1
    (root / "empty").mkdir()
    (root / "writing").mkdir()
    (root / "writing" / "part.bin").write_bytes(b"half")
    (root / "b" / ".tmp123").write_bytes(b"temp")
    new = _scan(root)
    news = t.compare(new)
    # changed after `settled_ns`: being written, taken by a later rescan; so is a directory with nothing else
    assert not len(t.additions(new, news.added, settled_ns=before))
    added = t.additions(new, news.added, settled_ns=time.time_ns())
    assert [(name, kind) for _, name, kind, _, _ in added] == [(b".tmp123", KIND_FILE), (b"writing", KIND_DIR),
                                                              (b"part.bin", KIND_FILE)]  # (never b"empty")


def test_a_tree_with_room_saves_as_it_was_scanned(odd_root, tmp_path):
    plain = _scan(odd_root)
    roomy = plain.with_room(40, 6)
    plain.save(str(tmp_path / "plain.bin"))
    roomy.save(str(tmp_path / "roomy.bin"))
    loaded = Tree.load(str(tmp_path / "roomy.bin"), os.stat(odd_root))
    assert loaded is not None and _walked(loaded) == _walked(plain) and loaded.n_nodes == plain.n_nodes
    (odd_root / "new.bin").write_bytes(b"n")
    _grown(roomy, odd_root)
    with pytest.raises(ValueError, match="newer scan"):
        roomy.save(str(tmp_path / "grown.bin"))
