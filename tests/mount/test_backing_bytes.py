"""``backing_bytes_read`` is what the backing served (issue 26): every byte tierfs reads from the backing dir --
staging, readers, a copy abandoned on a hung server -- against the bytes a passthrough FUSE backing counts.

The passthrough (tierfs.testing.mirrorfs ``--count``) is the slow tier's "wire": it sees every read that reaches the
backing filesystem, whoever made it.  Reads with deadlines, the tierfs mount and the passthrough taken down
(connections aborted) on the way out.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tierfs.testing.harness import make_dataset, mounted, passthrough, wait_until, within

_BIG = "class_000/big.bin"


def _status(m) -> dict:
    with open(m.path(".tierfs", "status")) as f:
        return json.load(f)


def _quiet(m) -> bool:
    """Nothing staged or read from the backing now, and nothing left to stage."""
    st = _status(m)
    sg, cur = st["staging"], st["current_staging"]
    return (st["next_ready"] and cur["files_done"] == cur["files_total"] and sg["inflight"] == 0
            and sg["stuck"] == 0 and sg["queued"] == 0 and st["backing"]["waiting"] == 0)


def test_backing_bytes_read_is_what_the_backing_served(tmp_path):
    data, inner, outer, hang, count = (tmp_path / n for n in ("data", "inner", "outer", "hang", "count"))
    files = make_dataset(data, dirs=4, files_per_dir=8, max_size=16 << 10, seed=26)
    (data / _BIG).write_bytes(os.urandom(768 << 10))
    files[_BIG] = 768 << 10
    inner.mkdir()
    outer.mkdir()
    hang.write_text(f"read:{_BIG}\n")  # its copy hangs after the first read: abandoned, then made again
    with passthrough(data, inner, hang=str(hang), count=str(count)) as pt, \
            mounted(inner, outer, tmp_path / "c", "16M", nm=2, rf=1, backing_timeout=1, revalidate="open") as m:
        # nm=2: the current and the next mini-epoch are the whole data set, all staged at once
        wait_until(lambda: any(u["file"] == _BIG for u in _status(m)["staging"]["unstaged"]), timeout=60,
                   what="the hung copy abandoned")
        hang.write_text("")  # the server answers again: the abandoned copy reads on (and never lands)
        wait_until(lambda: _quiet(m), timeout=60, what="everything staged")
        # readers too: three files changed behind the mount's back are read from the backing or copied again
        changed = sorted(rel for rel in files if rel != _BIG)[:3]
        time.sleep(0.01)  # (a new mtime)
        for rel in changed:
            (data / rel).write_bytes(os.urandom(files[rel] + 1000))
        for rel in sorted(files):
            assert within(str(outer), Path(m.path(rel)).read_bytes, 30) == (data / rel).read_bytes(), rel
        wait_until(lambda: _quiet(m), timeout=60, what="staging quiet again")
        served, counted = pt.served(), _status(m)["backing_bytes_read"]
        assert served >= 2 * (768 << 10)  # the abandoned copy and the one that landed both read the big file
        assert abs(counted - served) <= 0.02 * served, (counted, served)
