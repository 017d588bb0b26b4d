"""Batch plans through a real mount: copies pinned for the pass, never stale, counted exactly as opens."""

from __future__ import annotations

import os

import pytest

from tierfs.client import Client
from tierfs.testing.harness import mounted, wait_until


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _counts(st: dict) -> dict:
    r = st["reads"]
    return {"passes": st["passes_total"], "opens": r["hits"] + r["misses"], "opened_bytes": st["opened_bytes"],
            "out_of_view": r["out_of_view"]}


def _delta(a: dict, b: dict) -> dict:
    return {k: b[k] - a[k] for k in a}


def test_plan_pins_copies_for_the_pass_never_names_a_changed_file_and_counts_as_opens(tierfs_mount, dataset):
    backing, files = dataset
    # rf high: every pass stays in the first mini-epoch, so passes are comparable; revalidate=open: a plan
    # read after a change sees it at once
    with tierfs_mount(capacity=sum(files.values()) // 2, nm=4, rf=50, revalidate="open") as m:
        wait_until(lambda: m.status()["next_ready"], what="staging")
        client = Client(m.mountpoint)

        # pass 1 by open(), in the order file: the reference figures
        st0 = m.status()
        order = [p.decode() for p in client.order()]
        for rel in order:
            assert _read(m.path(rel)) == _read(os.path.join(backing, rel))
        st1 = m.status()
        by_open = _delta(_counts(st0), _counts(st1))
        assert by_open["passes"] == 1 and by_open["opens"] == len(order)

        # pass 2 through a plan
        plan = client.plan()
        assert [f["path"] for f in plan["files"]] == [p.decode() for p in client.order()]
        named = {f["path"]: (f["copy"], os.stat(f["copy"]).st_ino) for f in plan["files"] if f["copy"]}
        assert len(named) == len(plan["files"])  # the mini-epoch is staged: every file has a copy
        assert m.status()["plans"]["pinned_copies"] == len(named)
        # a backing file changes after the plan was read ...
        changed = plan["files"][0]["path"]
        new = b"rewritten in the backing dir\n" * 50
        with open(os.path.join(backing, changed), "wb") as f:
            f.write(new)
        # ... a plan read after that never names its old copy: the reader goes through the mount (new bytes)
        plan2 = client.plan()
        f0 = plan2["files"][0]
        assert f0["path"] == changed and f0["copy"] != named[changed][0]
        if f0["copy"] is None:
            assert _read(m.path(changed)) == new
        else:
            assert _read(f0["copy"]) == new
        reported = []
        for i, f in enumerate(plan2["files"][1:], start=1):
            assert _read(f["copy"]) == _read(os.path.join(backing, f["path"]))
            reported.append(i)
            if i == len(plan2["files"]) // 2:
                client.consumed(plan2["plan"], reported)  # a loader reports as it goes, and the rest at the end
        if f0["copy"] is not None:
            reported.append(0)
        # while the pass runs, every copy the first plan named is on disk, the same file (even the changed one's)
        for copy, ino in named.values():
            assert os.stat(copy).st_ino == ino
        assert _read(named[changed][0]) != new  # its old version, whole, for a reader that holds that plan
        client.consumed(plan2["plan"], reported)
        client.consumed(plan2["plan"], reported)  # sent twice: counted once
        st2 = m.status()
        # exactly what the pass by open() counted (one file now has its new size)
        want = {**by_open, "opened_bytes": by_open["opened_bytes"] - files[changed] + len(new)}
        assert _delta(_counts(st1), _counts(st2)) == want
        assert st2["reads"]["plan"] == len(reported)
        assert st2["served_bytes"] - st1["served_bytes"] <= (len(new) if f0["copy"] is None else 0)
        # the pass is over: nothing pinned, and the changed file's old copy is gone
        assert st2["plans"]["pinned_copies"] == 0
        wait_until(lambda: not os.path.exists(named[changed][0]), 10, "the old copy deleted (a background unlink)")
        # a report naming a file without a copy, or an unknown plan, is refused with the reason
        with pytest.raises(ValueError, match="no plan"):
            client.consumed(plan2["plan"] + 100, [0])


def test_other_users_get_eacces(dataset, tmp_path, other_user):
    backing, files = dataset
    mnt, as_nobody = other_user
    with mounted(backing, mnt, tmp_path / "cache", sum(files.values()), policy="lru", allow_other=True) as m:
        code = ("import errno, sys\n"
                "try:\n    open(sys.argv[1], 'rb').read()\n    print('read')\n"
                "except OSError as e:\n    print(errno.errorcode[e.errno])\n")
        assert as_nobody(code, m.path(".tierfs", "plan")) == ["EACCES"]
        assert Client(m.mountpoint).plan()["files"]  # root reads it
        assert m.status()["plans"]["issued"] == 1


def test_the_slow_tier_benchmarks_plan_loader_reads_each_pass_once_and_counts_it(tierfs_mount, dataset):
    """benchmarks/loader.py with ``plan`` (the ``met-rf4-plan`` configuration): each pass one plan, every file
    of the view read once with the right length, the copies reported, counted as one pass of opens."""
    import importlib.util
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        spec = importlib.util.spec_from_file_location("loader", bench / "loader.py")
        loader = sys.modules["loader"] = importlib.util.module_from_spec(spec)  # (dataclasses look it up)
        spec.loader.exec_module(loader)
    finally:
        sys.path.remove(str(bench))
    _, files = dataset
    with tierfs_mount(capacity=sum(files.values()) // 2, nm=4, rf=2) as m:
        wait_until(lambda: m.status()["next_ready"], what="staging")
        run = loader.ThreadLoader(Path(m.mountpoint), loader.LoaderConfig(workers=3, batch=4, plan=True))
        for index in range(2):
            st0 = m.status()
            view = [p.decode() for p in Client(m.mountpoint).order()]
            stats = run.run_pass(index)
            st1 = m.status()
            assert stats.samples == len(view) and stats.bytes == sum(files[r] for r in view)
            assert st1["passes_total"] == st0["passes_total"] + 1
            assert st1["reads"]["plan"] - st0["reads"]["plan"] == len(view)  # all staged: every one a copy
            assert st1["served_bytes"] == st0["served_bytes"]
