"""Control, status, order and metrics: the protocol, all-or-nothing writes, snapshots that always parse."""

from __future__ import annotations

import errno
import json
import os

import pyfuse3
import pytest
import trio

from tierfs.common.options import Settings
from tierfs.common.protocol import RankShare, parse_control
from tierfs.daemon.fuse.operations import TierOperations
from tierfs.daemon.tree.tree import CONTROL_INODES

REQUIRED = {"epoch", "mini_epoch", "pass", "rf", "rf_effective", "view_files", "view_bytes", "cache_bytes",
            "cache_capacity", "prefetch", "reads", "backing_bytes_read", "served_bytes", "stall_seconds", "arf",
            "last_error"}


def test_parse_control_lines_and_commands():
    s = Settings()
    req = parse_control("rf=8 advance=strict\nbandwidth=10M,arf_weights=1,0.5,0\nnext-pass\nadvance\n"
                        "feedback loss=0.5 train_err=0.1 val_err=0.2\n", s)
    assert req.settings.rf == 8 and req.settings.advance == "strict" and req.settings.bandwidth == 10 << 20
    assert req.settings.arf_weights == (1.0, 0.5, 0.0)
    assert req.commands == ("next-pass", "advance")
    assert req.feedback == ({"loss": 0.5, "train_err": 0.1, "val_err": 0.2},)
    req = parse_control("next-pass pass=12 rank=1/4\nnext_pass rank=0/1 pass=0\n", s)
    assert req.shares == (RankShare(12, 1, 4), RankShare(0, 0, 1)) and not req.commands
    assert parse_control(RankShare(3, 2, 8).line(), s).shares == (RankShare(3, 2, 8),)


@pytest.mark.parametrize("text, needle", [
    ("rf=0", "rf"), ("rf=x", "rf"), ("bogus=1", "unknown key"), ("cache=/tmp", "cannot be changed"),
    ("backing=/x", "cannot be changed"), ("mountpoint=/x", "cannot be changed"), ("seed=3", "fixed at mount"),
    ("policy=lru", "fixed at mount"), ("feedback loss=abc", "loss"), ("feedback", "at least one"),
    ("feedback acc=1", "unknown metric"), ("next-pass now", "next-pass takes nothing or"), ("", "empty"),
    ("next-pass pass=1 rank=2/2", "0 <= R < W"), ("next-pass pass=-1 rank=0/2", "P >= 0"),
    ("next-pass pass=1 rank=0", "rank=R/W"), ("next-pass pass=x rank=0/2", "rank=R/W"),
    ("next-pass pass=1 rank=0/2 extra=1", "rank=R/W"), ("next-pass pass=1 pass=2", "rank=R/W"),
    ("next-pass pass=1 rank=0/99999", "W <= 4096"), ("advance now", "no arguments"),
])
def test_parse_control_rejects(text, needle):
    with pytest.raises(ValueError, match=needle):
        parse_control(text, Settings())


def test_bad_write_is_einval_changes_nothing_and_shows_in_status(open_engine, t):
    e = open_engine()
    ops = TierOperations(e)

    async def main():
        fi = await ops.open(CONTROL_INODES[b"control"], os.O_WRONLY | os.O_TRUNC, pyfuse3.RequestContext())
        with pytest.raises(pyfuse3.FUSEError) as exc:
            await ops.write(fi.fh, 0, b"rf=8\nnm=zero\n")  # one bad item: nothing applies
        assert exc.value.errno == errno.EINVAL
        assert e.settings.rf == 2
        assert "nm" in json.loads(e.status().to_json())["last_error"]
        assert await ops.write(fi.fh, 0, b"rf=8 bandwidth=1M\n") == len(b"rf=8 bandwidth=1M\n")
        await ops.release(fi.fh)
        assert e.settings.rf == 8 and e.settings.bandwidth == 1 << 20 and e.last_error is None
        # the cache dir can never be changed
        with pytest.raises(ValueError):
            e.control_write(b"cache=/elsewhere\n")
        assert e.config.cache.endswith("cache")
        # nm that cannot fit the cache is refused like at mount time
        with pytest.raises(ValueError, match="nm"):
            e.control_write(b"nm=1\n")
        assert e.settings.nm == 4

    t.run(main)


def test_truncating_control_is_refused(open_engine, t):
    # truncate(control) changed nothing but succeeded (issue 11); ``echo x > control`` never truncates: the
    # kernel hands O_TRUNC to open (atomic O_TRUNC), as the mount tests' shell writes show
    e = open_engine()
    ops = TierOperations(e)

    async def main():
        from types import SimpleNamespace
        names = ("update_mode", "update_size", "update_mtime", "update_atime", "update_uid", "update_gid")
        sf = SimpleNamespace(**{n: n == "update_size" for n in names})
        attr = await ops.getattr(CONTROL_INODES[b"control"], None)
        with pytest.raises(pyfuse3.FUSEError) as exc:
            await ops.setattr(CONTROL_INODES[b"control"], attr, sf, None, None)
        assert exc.value.errno == errno.EROFS

    t.run(main)


def test_control_read_returns_settings(open_engine, t):
    e = open_engine(rf=5)
    text = e.control_text().decode()
    assert "rf=5\n" in text and "nm=4\n" in text and "composition=random\n" in text


def test_status_always_complete_valid_json_and_metrics_from_same_snapshot(open_engine, t):
    e = open_engine()
    ops = TierOperations(e)
    seen = []

    async def reader():
        while True:
            await read_once()

    async def read_once():
        fi = await ops.open(CONTROL_INODES[b"status"], os.O_RDONLY, pyfuse3.RequestContext())
        chunks, off = [], 0
        while True:
            part = await ops.read(fi.fh, off, 7)  # tiny reads across engine changes
            if not part:
                break
            chunks.append(part)
            off += len(part)
            await trio.sleep(0)
        await ops.release(fi.fh)
        d = json.loads(b"".join(chunks))
        assert d.keys() >= REQUIRED
        assert set(d["prefetch"]) == set(d["current_staging"]) == {"files_done", "files_total", "bytes_done",
                                                                    "bytes_total", "bytes_per_s", "eta_s"}
        assert set(d["reads"]) == {"hits", "misses", "out_of_view", "direct", "plan"}
        assert set(d["arf"]) >= {"mode", "score", "history"}
        assert isinstance(d["rf_effective"], list)
        seen.append(d)

    async def main():
        async with trio.open_nursery() as n:
            n.start_soon(reader)
            await n.start(e.run)
            for _ in range(6):
                await read_once()  # besides the free-running reader: at least one per step, whatever the load
                await t.settle(e)
                await read_once()
                await t.read_view(e)
            n.cancel_scope.cancel()

    t.run(main)
    assert len(seen) >= 12
    metrics = e.status().to_prometheus()
    values = {}
    for line in metrics.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    st = e.status()
    assert values["tierfs_epoch"] == st.epoch and values["tierfs_cache_bytes"] == st.cache_bytes
    assert values['tierfs_reads_total{result="hit"}'] == st.reads.hits


def test_order_file_lists_view_in_serving_order(open_engine):
    e = open_engine()
    lines = e.names.order_text().decode().splitlines()
    assert lines == [os.fsdecode(e.tree.file_path(f)) for f in e.schedule.view.order.tolist()]
    assert all(os.path.exists(os.path.join(e.config.backing, p)) for p in lines)
