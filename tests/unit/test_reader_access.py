"""Who may list which directory, as the kernel's permission check decides it
(tierfs.daemon.access.listable_dirs)."""

from __future__ import annotations

import os

import numpy as np

from tierfs.daemon.access import Reader, listable_dirs

# meta rows: (mode, nlink, uid, gid, rdev)
_ROWS = np.array([
    [0o040755, 2, 0, 0, 0],      # 0: open to all
    [0o040750, 2, 0, 50, 0],     # 1: group 50 only
    [0o040700, 2, 1000, 0, 0],   # 2: uid 1000 only
    [0o040711, 2, 0, 0, 0],      # 3: searchable, not listable
    [0o040075, 2, 1000, 0, 0],   # 4: the owner gets the owner's bits (none here), not the others'
], np.int64)


def _tree(rows_of_nodes: list[int], parents: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.array(parents), _ROWS, np.array(rows_of_nodes)


def test_owner_group_and_others_bits_as_the_kernel_picks_them():
    bits = Reader(1000, frozenset({50})).access_bits(_ROWS)
    assert bits.tolist() == [5, 5, 7, 1, 0]
    assert Reader(2000, frozenset()).access_bits(_ROWS).tolist() == [5, 0, 0, 1, 5]
    assert Reader(0, frozenset()).access_bits(_ROWS).tolist() == [7] * 5


def test_a_directory_is_listable_only_below_searchable_ones():
    # root(0) -> a(1, group 50) -> b(2, open); root -> c(3, searchable only) -> d(4, open)
    parents, meta, idx = _tree([0, 1, 0, 3, 0], [0, 0, 1, 0, 3])
    member = listable_dirs(Reader(7, frozenset({50})), parents, meta, idx)
    stranger = listable_dirs(Reader(8, frozenset({9})), parents, meta, idx)
    assert member.tolist() == [True, True, True, False, True]
    assert stranger.tolist() == [True, False, False, False, True]  # b is open, but under a closed a


def test_a_reader_of_a_process_gone_holds_no_group():
    assert Reader.of(os.getuid(), 2**22 + 12345).gids == frozenset()
    me = Reader.of(os.getuid(), os.getpid())
    assert os.getegid() in me.gids and set(os.getgroups()) <= me.gids
