"""Damaged state files in the cache dir (issue 48, item 4): ``tree.bin``, ``index.npz`` and ``journal.json`` only
cache what ``data/`` and the backing say, so a damaged one is as good as none -- one warning naming the file and
what it costs, the file removed, and the mount goes on serving the backing's bytes.  Each case damages the state
an earlier engine left in a real cache dir, opens an engine over it, and reads the whole view back."""

from __future__ import annotations

import ast
import json
import logging
import os

import numpy as np
import pytest
import trio

from tierfs.daemon.cache.journal import JOURNAL_NAME, load_position
from tierfs.daemon.tree.tree import Tree

TREE, INDEX = "tree.bin", "index.npz"


def _used_cache(open_engine, t) -> tuple[str, tuple[int, int, int], dict[int, str]]:
    """A cache dir as a clean unmount leaves it, three passes in: (its path, the position, the copies)."""
    e = open_engine(rf=2)
    t.read_passes(e, 3)
    where = (e.schedule.pos.epoch, e.schedule.pos.mini_epoch, e.schedule.pos.pass_index)
    cached = {f: en.name for f, en in e.cache.entries.items()}
    e.close()
    cache = e.config.cache
    assert where != (0, 0, 0) and cached
    assert all(os.path.isfile(os.path.join(cache, n)) for n in (TREE, INDEX, JOURNAL_NAME))
    return cache, where, cached


def _reopen(open_engine, caplog):
    """An engine over the damaged cache dir (it must open) and the warnings it logged."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tierfs"):
        e = open_engine(rf=2)
    return e, [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _serves_the_backing(e, t) -> None:
    """The engine lists the backing's files and serves their bytes (a whole view read and compared), and saves
    its tree and journal again."""
    backing = e.config.backing
    listed = {os.fsdecode(e.tree.file_path(f)) for f in range(e.tree.n_files)}
    assert listed == {os.path.relpath(os.path.join(r, f), backing) for r, _, fs in os.walk(backing) for f in fs}

    async def main():
        async with trio.open_nursery() as n:
            await n.start(e.run)
            await t.settle(e)
            assert await t.read_view(e) > 0
            for _ in range(200):  # (the tree is saved by the rescan job, off the trio thread)
                if os.path.exists(os.path.join(e.config.cache, TREE)):
                    break
                await trio.sleep(0.01)
            n.cancel_scope.cancel()

    t.run(main)
    cache = e.config.cache
    assert Tree.load(os.path.join(cache, TREE), os.stat(backing)) is not None
    assert load_position(cache) is not None


def _damage(cache: str, name: str, how) -> str:
    """The state file ``name`` of ``cache`` rewritten as ``how(its bytes)`` says; its path."""
    path = os.path.join(cache, name)
    with open(path, "rb") as f:
        raw = f.read()
    with open(path, "wb") as f:
        f.write(how(raw))
    return path


def _said_once(warnings: list[str], name: str, cost: str) -> str:
    said = [w for w in warnings if name in w]
    assert len(said) == 1, warnings
    assert cost in said[0], said[0]
    return said[0]


# ---------------------------------------------------------------------------------------------------- tree.bin

def _remount_damaged(open_engine, t, caplog, name: str, how, cost: str):
    """A used cache whose ``name`` is damaged ``how``, mounted again: it says so once, in words, with ``cost``.
    (The engine, the cache dir, the damaged file's path, the position and the copies before.)"""
    cache, where, cached = _used_cache(open_engine, t)
    path = _damage(cache, name, how)
    e, warnings = _reopen(open_engine, caplog)
    said = _said_once(warnings, name, cost)
    assert "damaged" in said and "Error" not in said  # (what is wrong in words, not an exception's name)
    return e, cache, path, where, cached


def _records(raw: bytes) -> list[tuple[int, int, int]]:
    """(start, data start, data end) of each .npy record of a saved tree: 0 is the head, then Tree's arrays in
    ``tree._SAVED`` order (3: names, 11: size), the checksum last."""
    out, at = [], 0
    while at < len(raw):
        hlen = int.from_bytes(raw[at + 8:at + 10], "little")
        header = ast.literal_eval(raw[at + 10:at + 10 + hlen].decode("latin1"))
        data = at + 10 + hlen
        end = data + int(np.prod(header["shape"])) * np.dtype(header["descr"]).itemsize
        out.append((at, data, end))
        at = end
    return out


def _flip(raw: bytes, at: int) -> bytes:
    return raw[:at] + bytes([raw[at] ^ 0x5A]) + raw[at + 1:]


def _unclosed_header(raw: bytes) -> bytes:
    """The first record's header with its closing brace gone (numpy's parser: TokenError, the issue's)."""
    end = _records(raw)[0][1]
    at = raw.rindex(b"}", 0, end)
    return raw[:at] + b" " + raw[at + 1:]


def _huge_shape(raw: bytes) -> bytes:
    """The size record's header claiming 10**11 elements (same header length: the padding gives way)."""
    start, data, _ = _records(raw)[11]
    header = raw[start + 10:data]
    shape = header[header.index(b"'shape': (") + 10:header.index(b",)")]
    new = header.replace(b"(" + shape + b",)", b"(99999999999,)").replace(b" " * (11 - len(shape)) + b"\n", b"\n")
    assert len(new) == len(header)
    return raw[:start + 10] + new + raw[data:]


TREE_DAMAGE = {
    "header: unclosed brace": _unclosed_header,
    "header: a huge shape": _huge_shape,
    "header: magic flipped": lambda raw: _flip(raw, 1),
    "body: a byte of a name flipped": lambda raw: _flip(raw, (_records(raw)[3][1] + _records(raw)[3][2]) // 2),
    "body: a byte of a size flipped": lambda raw: _flip(raw, _records(raw)[11][1] + 1),
    "body: the checksum flipped": lambda raw: _flip(raw, len(raw) - 3),
    "cut in half": lambda raw: raw[:len(raw) // 2],
    "cut by one byte": lambda raw: raw[:-1],
    "cut at a record's end": lambda raw: raw[:_records(raw)[5][2]],
    "one byte more": lambda raw: raw + b"\0",
    "empty": lambda raw: b"",
    "garbage": lambda raw: os.urandom(4096),
}


@pytest.mark.parametrize("damage", list(TREE_DAMAGE))
def test_a_damaged_saved_tree_is_said_removed_and_scanned_again(damage, open_engine, t, caplog):
    e, _, path, where, cached = _remount_damaged(open_engine, t, caplog, TREE, TREE_DAMAGE[damage], "scanned")
    assert not os.path.exists(path)  # removed (the scan saves a whole one again: below)
    assert e.trees.statistics().source == "scan"
    assert (e.schedule.pos.epoch, e.schedule.pos.mini_epoch, e.schedule.pos.pass_index) == where  # (the journal)
    assert set(e.cache.entries) == set(cached)
    _serves_the_backing(e, t)


def test_a_saved_tree_of_an_earlier_format_is_scanned_again_without_a_warning(open_engine, t, caplog):
    """Format 4 (before the checksum): not damage, an upgrade; the scan replaces it quietly."""
    cache, where, _ = _used_cache(open_engine, t)
    path = os.path.join(cache, TREE)
    with open(path, "rb") as f:
        raw = f.read()
    recs = _records(raw)
    head_data = recs[0][1]
    raw = raw[:head_data] + np.array([4], np.int64).tobytes() + raw[head_data + 8:recs[-1][0]]
    with open(path, "wb") as f:
        f.write(raw)
    e, warnings = _reopen(open_engine, caplog)
    assert not [w for w in warnings if TREE in w]
    assert e.trees.statistics().source == "scan"
    assert (e.schedule.pos.epoch, e.schedule.pos.mini_epoch, e.schedule.pos.pass_index) == where
    _serves_the_backing(e, t)


# --------------------------------------------------------------------------------------------------- index.npz

def _member_data(raw: bytes, member: str) -> int:
    """Where the array data of ``member`` (an .npy in the zip, stored) starts."""
    npy = raw.index(b"\x93NUMPY", raw.index(member.encode()))
    return npy + 10 + int.from_bytes(raw[npy + 8:npy + 10], "little")


def _member_header(raw: bytes, member: str) -> int:
    npy = raw.index(b"\x93NUMPY", raw.index(member.encode()))
    return raw.index(b"}", npy)


INDEX_DAMAGE = {
    "a byte of fps flipped (bad CRC-32)": lambda raw: _flip(raw, _member_data(raw, "fps.npy") + 5),
    "a member's header unclosed": lambda raw: _flip(raw, _member_header(raw, "names.npy")),
    "the central directory flipped": lambda raw: _flip(raw, raw.rindex(b"PK\x01\x02") + 10),
    "the end record flipped": lambda raw: _flip(raw, raw.rindex(b"PK\x05\x06") + 12),
    "cut in half": lambda raw: raw[:len(raw) // 2],
    "cut by one byte": lambda raw: raw[:-1],
    "empty": lambda raw: b"",
    "garbage": lambda raw: os.urandom(4096),
}


@pytest.mark.parametrize("damage", list(INDEX_DAMAGE))
def test_a_damaged_index_is_said_removed_and_the_copies_checked_one_by_one(damage, open_engine, t, caplog):
    e, _, path, where, cached = _remount_damaged(open_engine, t, caplog, INDEX, INDEX_DAMAGE[damage],
                                                 "checked one by one")
    assert not os.path.exists(path)
    assert {f: en.name for f, en in e.cache.entries.items()} == cached  # every copy kept: a stat each
    assert (e.schedule.pos.epoch, e.schedule.pos.mini_epoch, e.schedule.pos.pass_index) == where
    _serves_the_backing(e, t)


# ------------------------------------------------------------------------------------------------ journal.json

def _edited(**fields):
    def edit(raw: bytes) -> bytes:
        j = json.loads(raw)
        j.update(fields)
        return json.dumps(j).encode()

    return edit


JOURNAL_DAMAGE = {
    "cut in half": lambda raw: raw[:len(raw) // 2],
    "cut by one byte": lambda raw: raw[:-1],
    "its first byte flipped": lambda raw: _flip(raw, 0),
    "a byte of a key flipped": lambda raw: raw.replace(b'"epoch"', b'"epocx"'),
    "empty": lambda raw: b"",
    "blank": lambda raw: b"\n\n",
    "garbage": lambda raw: os.urandom(600),
    "nested a million deep": lambda raw: b"[" * 1_000_000,
    "not an object": lambda raw: b"[1, 2, 3]",
    "another version": _edited(version=7),
    "a negative epoch": _edited(epoch=-1),
    "a negative pass": _edited(**{"pass": -3}),
    "a huge epoch": _edited(epoch=10**30),
    "an int of 5000 digits": lambda raw: raw.replace(b'"epoch": ', b'"epoch": ' + b"9" * 5000),
    "an epoch as a string": _edited(epoch="1"),
    "a pass as a float": _edited(**{"pass": 1.0}),
    "a mini-epoch as a bool": _edited(mini_epoch=True),
    "an epoch of null": _edited(epoch=None),
    "rf_effective not a list": _edited(rf_effective=3),
    "rf_effective of strings": _edited(rf_effective=["x"]),
    "arf_history of numbers": _edited(arf_history=[1, 2]),
}


@pytest.mark.parametrize("damage", list(JOURNAL_DAMAGE))
def test_a_damaged_journal_is_said_removed_and_the_mount_starts_afresh(damage, open_engine, t, caplog):
    e, cache, _, _, _ = _remount_damaged(open_engine, t, caplog, JOURNAL_NAME, JOURNAL_DAMAGE[damage],
                                         "starts over at the first epoch")
    pos = e.schedule.pos
    assert (pos.epoch, pos.mini_epoch, pos.pass_index, pos.passes_total) == (0, 0, 0, 0)
    again = load_position(cache)  # (removed, and the opened engine journalled where it stands: a whole one)
    assert again is not None and (again.epoch, again.mini_epoch, again.pass_index) == (0, 0, 0)
    assert e.trees.statistics().source == "scan"  # (the saved tree goes with a journal: without one, a scan)
    _serves_the_backing(e, t)


def test_a_mini_epoch_past_the_plan_resumes_the_same_epochs_last(open_engine, t, caplog):
    """nm=4: a journal at mini-epoch 9 of epoch 2 (a damaged one, or nm was 10) resumes at mini-epoch 4/4 of
    epoch 2 from its first pass -- before, the rest of epoch 2 was skipped (epoch 3, mini-epoch 1)."""
    cache, _, _ = _used_cache(open_engine, t)
    path = os.path.join(cache, JOURNAL_NAME)
    with open(path, "rb") as f:
        raw = f.read()
    with open(path, "wb") as f:
        f.write(_edited(epoch=1, mini_epoch=8, **{"pass": 1})(raw))
    e, warnings = _reopen(open_engine, caplog)
    said = _said_once(warnings, JOURNAL_NAME, "resuming at mini-epoch 4/4, pass 1")
    assert "mini-epoch 9 of epoch 2" in said
    assert (e.schedule.pos.epoch, e.schedule.pos.mini_epoch, e.schedule.pos.pass_index) == (1, 3, 0)
    assert e.trees.statistics().source == "saved"  # (not damage: the position is used, clamped)
    _serves_the_backing(e, t)


@pytest.mark.parametrize("journalled", [2, 4, 10**6, 2**40 - 1])
def test_a_pass_past_the_most_a_mini_epoch_gets_becomes_its_last(journalled, open_engine, t, caplog):
    """rf=2, rf_max 4 (the default): a journalled pass 2 or 3 is an ``advance=ready`` repeat, taken as it is; pass
    4 and beyond (rf_max lowered since, or damage) is clamped to the last the mini-epoch may get, pass 4/4."""
    cache, _, _ = _used_cache(open_engine, t)
    path = os.path.join(cache, JOURNAL_NAME)
    with open(path, "rb") as f:
        raw = f.read()
    with open(path, "wb") as f:
        f.write(_edited(epoch=0, mini_epoch=1, **{"pass": journalled})(raw))
    e, warnings = _reopen(open_engine, caplog)
    pos = e.schedule.pos
    if journalled < 4:
        assert not [w for w in warnings if JOURNAL_NAME in w]
        assert (pos.epoch, pos.mini_epoch, pos.pass_index) == (0, 1, journalled)
    else:
        _said_once(warnings, JOURNAL_NAME, "resuming at mini-epoch 2/4, pass 4")
        assert (pos.epoch, pos.mini_epoch, pos.pass_index) == (0, 1, 3)
    _serves_the_backing(e, t)


def test_a_journal_lost_beside_an_earlier_mounts_state_is_said(open_engine, t, caplog):
    cache, _, _ = _used_cache(open_engine, t)
    os.unlink(os.path.join(cache, JOURNAL_NAME))
    e, warnings = _reopen(open_engine, caplog)
    said = _said_once(warnings, JOURNAL_NAME, "starts over at the first epoch")
    assert "no journal.json" in said and TREE in said
    assert (e.schedule.pos.epoch, e.schedule.pos.mini_epoch, e.schedule.pos.pass_index) == (0, 0, 0)
    _serves_the_backing(e, t)


def test_a_fresh_cache_dir_has_no_journal_and_nothing_is_said(open_engine, t, caplog):
    e, warnings = _reopen(open_engine, caplog)
    assert not [w for w in warnings if any(n in w for n in (JOURNAL_NAME, TREE, INDEX))], warnings
    _serves_the_backing(e, t)
