"""The kernel's readdir cache (pyfuse3 built with scripts/pyfuse3): a ``view=full`` directory listed again is served
by the kernel, without a READDIR to the daemon, while the pass and the consumer stay the same; a new pass or another
consumer's order is listed afresh, and the root never comes from the cache (issue 22, 7)."""

from __future__ import annotations

import os
import subprocess
import sys

import pyfuse3
import pytest

from tierfs.testing.harness import within

DEADLINE = 20.0  # seconds a listing may take before the test calls the mount hung (and aborts it)

pytestmark = pytest.mark.skipif(not hasattr(pyfuse3.FileInfo(), "cache_readdir"),
                                reason="stock pyfuse3: scripts/pyfuse3/install.sh builds the one that caches")

#: In a process of its own (named by TIERFS_CONSUMER): the files a directory lists, then that consumer's order.
_LIST_AND_ORDER = """
import os, sys
mnt, d = sys.argv[1:]
print(" ".join(n for n in os.listdir(os.path.join(mnt, d)) if n.endswith(".bin")))
with open(os.path.join(mnt, ".tierfs", "order")) as f:
    print(" ".join(p.split("/")[1] for p in f.read().split() if p.startswith(d + "/")))
"""


def _listing(m, *parts: str) -> list[str]:
    names = within(m.mountpoint, lambda: os.listdir(m.path(*parts)), DEADLINE)
    assert isinstance(names, list), names
    return names


def _read(m, *parts: str) -> None:
    def read() -> bytes:
        with open(m.path(*parts), "rb") as f:
            return f.read()

    assert isinstance(within(m.mountpoint, read, DEADLINE), bytes)


def _files(names: list[str]) -> list[str]:
    return [n for n in names if n.endswith(".bin")]


def _order_in(m, d: str) -> list[str]:
    """The files of directory ``d`` in this pass's serving order (the anonymous consumer's ``order``)."""
    def read() -> str:
        with open(m.path(".tierfs", "order")) as f:
            return f.read()

    text = within(m.mountpoint, read, DEADLINE)
    assert isinstance(text, str), text
    return [p.split("/")[1] for p in text.split() if p.startswith(d + "/")]


def _as_consumer(m, name: str, d: str) -> tuple[list[str], list[str]]:
    """(what ``d`` lists, ``d``'s files in the consumer's order) for consumer ``name``, in a process of its own."""
    out = subprocess.run([sys.executable, "-c", _LIST_AND_ORDER, m.mountpoint, d], capture_output=True, text=True,
                         check=True, timeout=DEADLINE, env={**os.environ, "TIERFS_CONSUMER": name}).stdout
    listed, order = out.split("\n")[:2]
    return listed.split(), order.split()


def test_a_view_full_directory_listed_again_comes_from_the_kernel(tierfs_mount):
    with tierfs_mount(capacity="4M", view="full") as m:
        first = _listing(m, "class_000")
        st = m.status()["listings"]
        assert st["kernel_cache"] and st["readdirs"] >= 1
        for _ in range(3):
            assert _listing(m, "class_000") == first  # the same pass: the same order, from the kernel
        again = m.status()["listings"]
        assert again["readdirs"] == st["readdirs"], again  # not one READDIR more
        assert again["opened"] == st["opened"] + 3 and again["kept"] == st["kept"] + 3
        # the order is still the pass's serving order
        assert _files(first) == _order_in(m, "class_000")


def test_the_root_and_a_mini_epoch_view_are_never_cached(tierfs_mount):
    with tierfs_mount(capacity="4M", view="full") as m:
        _listing(m)
        before = m.status()["listings"]["readdirs"]
        _listing(m)
        assert m.status()["listings"]["readdirs"] > before  # the root: each listing from the daemon
    with tierfs_mount(capacity="4M", nm=2) as m:
        _listing(m, "class_000")
        before = m.status()["listings"]["readdirs"]
        _listing(m, "class_000")
        st = m.status()["listings"]
        assert st["readdirs"] > before and st["kept"] == 0  # (view=mini-epoch: not the backing's listing)


def test_a_new_pass_lists_its_own_order_not_the_cached_one(tierfs_mount):
    with tierfs_mount(capacity="4M", view="full") as m:
        orders, listings = set(), set()
        for _ in range(4):  # four passes: 8 files, the chance that all four orders are one is 1 in 40320**3
            listed = _files(_listing(m, "class_000"))
            _listing(m, "class_000")  # (again: from the kernel)
            before = m.status()["listings"]["readdirs"]
            assert listed == _order_in(m, "class_000")
            orders.add(tuple(listed))
            listings.add(tuple(_files(_listing(m, "class_000"))))
            assert m.status()["listings"]["readdirs"] == before
            _read(m, "class_000", listed[0])  # (a reader that read: next-pass ends its pass)
            m.control("next-pass")
        assert len(orders) > 1 and listings == orders


def test_each_consumer_lists_its_own_order_from_one_cache(tierfs_mount):
    with tierfs_mount(capacity="4M", view="full") as m:
        for _ in range(2):  # each one's listing follows the other's: the kernel's cache is dropped each time
            for name in ("job_a", "job_b"):
                listed, order = _as_consumer(m, name, "class_001")
                assert listed == order, name
        a, order_a = _as_consumer(m, "job_a", "class_001")
        b, order_b = _as_consumer(m, "job_b", "class_001")
        assert sorted(a) == sorted(b) and a == order_a and b == order_b
        assert m.status()["listings"]["kept"] == 0  # (never the other job's cache)
