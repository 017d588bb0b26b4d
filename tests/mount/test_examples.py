"""The loader recipes in examples/, run as a user would run them, against real mounts (and one without FUSE)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from tierfs.testing.harness import make_tar_shards, mounted

pytest.importorskip("torch")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str, *args) -> list[dict]:
    """The recipe's ``--json`` lines; its progress lines on stderr checked on the way (one per pass, the last
    passes' with the mount's figures: it is a pipe here, so plain lines)."""
    res = subprocess.run([sys.executable, str(EXAMPLES / name), *map(str, args), "--json"], capture_output=True,
                         text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    passes = [json.loads(line) for line in res.stdout.splitlines()]
    shown = [ln for ln in res.stderr.splitlines() if re.match(r"pass \d+", ln) and "(so far)" not in ln]
    assert [int(ln.split()[1].split("/")[0].rstrip(":")) for ln in shown] == list(range(1, len(passes) + 1))
    assert all(re.search(r": [\d,]+ samples, [\d,]+ samples/s", ln) for ln in shown), res.stderr
    if passes[0].get("epoch") is not None and name != "sampler_without_fuse.py":  # on a mount
        # (hits -: none counted yet, as with direct reads, which the mount counts at the next pass's start)
        assert all(re.search(r" mini-epoch \d+/\d+: .*, hits ([\d.]+%|-), slow tier .+/s, stall [\d.]+ s$", ln)
                   for ln in shown), res.stderr
    return passes


def check_samples(passes: list[dict], backing: Path, files: dict[str, int]) -> None:
    """Every sample is a real file with its bytes and the label of its sorted class folder; none twice a pass."""
    classes = sorted(p.name for p in backing.iterdir() if p.is_dir())
    for p in passes:
        paths = [s[0] for s in p["samples"]]
        assert len(paths) == len(set(paths)) >= 1
        for path, label, crc in p["samples"]:
            assert path in files
            assert label == classes.index(path.split("/")[0])
            assert crc == zlib.crc32((backing / path).read_bytes())


def check_mini_epoch_passes(passes: list[dict], files: dict[str, int], nm: int, rf: int) -> None:
    """Strict advance: rf passes per mini-epoch, the same files in each, and every file once per epoch."""
    assert [(p["epoch"], p["mini_epoch"]) for p in passes] == [
        (e, m) for e in range(len(passes) // (nm * rf)) for m in range(nm) for _ in range(rf)]
    for e in range(len(passes) // (nm * rf)):
        epoch_files: list[str] = []
        for m in range(nm):
            group = [p for p in passes if (p["epoch"], p["mini_epoch"]) == (e, m)]
            sets = [sorted(s[0] for s in p["samples"]) for p in group]
            assert all(s == sets[0] for s in sets)  # each pass of a mini-epoch reads all of it
            epoch_files += sets[0]
        assert sorted(epoch_files) == sorted(files)


@pytest.mark.parametrize("recipe", ["imagefolder_loader.py", "order_file_loader.py"])
def test_dataloader_recipes_follow_the_mini_epochs(recipe, dataset, mount_dirs):
    backing, files = dataset
    mnt, cache = mount_dirs
    with mounted(backing, mnt, cache, "1M", nm=2, rf=2, advance="strict", seed=3):
        passes = run_example(recipe, mnt, "--passes", 8, "--batch", 4, "--workers", 2)
    check_samples(passes, backing, files)
    check_mini_epoch_passes(passes, files, nm=2, rf=2)
    # listing order is the serving order, reshuffled every pass
    assert [s[0] for s in passes[0]["samples"]] != [s[0] for s in passes[1]["samples"]]


def test_built_once_recipe_follows_the_mini_epochs_with_persistent_workers(dataset, mount_dirs):
    backing, files = dataset
    mnt, cache = mount_dirs
    with mounted(backing, mnt, cache, "1M", nm=2, rf=2, advance="strict", seed=3, listing="all") as m:
        passes = run_example("built_once_loader.py", mnt, "--passes", 8, "--batch", 4, "--workers", 2)
        st = m.status()
    check_samples(passes, backing, files)
    check_mini_epoch_passes(passes, files, nm=2, rf=2)
    assert [s[0] for s in passes[0]["samples"]] != [s[0] for s in passes[1]["samples"]]  # the serving order
    assert st["loader"]["follows_view"] and st["reads"]["out_of_view"] == 0 and st["passes_total"] == 8
    assert st["reads"]["plan"] > 0  # the dataset's loader got cached copies (reported: the passes ended)


def test_substitute_recipe_reads_view_files_of_each_name_s_class(dataset, mount_dirs):
    backing, files = dataset
    mnt, cache = mount_dirs
    by_crc = {zlib.crc32((backing / r).read_bytes()): r for r in files}
    with mounted(backing, mnt, cache, "1M", nm=2, rf=2, seed=3, listing="all", substitute=True) as m:
        passes = run_example("substitute_loader.py", mnt, "--passes", 4, "--batch", 4, "--workers", 2)
        st = m.status()
    classes = sorted(p.name for p in backing.iterdir() if p.is_dir())
    served = set()
    for p in passes:
        assert len(p["samples"]) == len(files)  # every name, each epoch
        for name, label, crc in p["samples"]:
            got = by_crc[crc]  # a whole dataset file ...
            assert got.split("/")[0] == name.split("/")[0] == classes[label]  # ... of the name's class folder
            served.add(got)
    # (an open whose lookup came just before a switch, in another worker, opens the old mini-epoch's file: out of
    # view, a few at most)
    assert st["reads"]["out_of_view"] <= 2 * st["passes_total"] and st["substitution"]["substituted"] > 0
    assert st["passes_total"] >= 4 and len({(p["epoch"], p["mini_epoch"]) for p in passes}) >= 2
    assert served == set(files)  # the mini-epochs moved on: every file served


def _shard_passes(passes: list[dict]) -> list[dict]:
    """Each pass with one sample per file it read (what check_mini_epoch_passes compares)."""
    return [{**p, "samples": [[f] for f in sorted({s[0] for s in p["samples"]})]} for p in passes]


def test_webdataset_recipe_follows_the_mini_epochs(mount_dirs):
    mnt, cache = mount_dirs
    backing = Path(mnt).parent / "shards"
    made = make_tar_shards(backing, 8, seed=2)
    with mounted(backing, mnt, cache, "1M", nm=2, rf=2, advance="strict", seed=3) as m:
        passes = run_example("webdataset_loader.py", os.path.join(mnt, "shard-{000000..000007}.tar"), "--passes", 8,
                             "--batch", 4, "--workers", 2)
        st = m.status()
    for p in passes:  # every shard of the pass whole, once, its samples the backing's
        keys = sorted(s[1] for s in p["samples"])
        assert keys == sorted(k[:-4] for f in {s[0] for s in p["samples"]} for k in made[f] if k.endswith(".bin"))
        for shard, key, crc in p["samples"]:
            assert crc == zlib.crc32(made[shard][key + ".bin"])
    check_mini_epoch_passes(_shard_passes(passes), made, nm=2, rf=2)
    assert st["loader"]["follows_view"] and st["reads"]["out_of_view"] == 0 and st["passes_total"] == 8


def _parquet_tables(backing: Path) -> dict[str, list[dict]]:
    """Parquet files with columns of their own (none of them the old recipe's id/label/payload): a string, a
    float, a list, bytes, a struct; every other file one column more."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    backing.mkdir()
    made = {}
    for f in range(8):
        n = 10 + 7 * f
        cols = {"caption": [f"file {f} row {i}" for i in range(n)], "score": [i / 7 for i in range(n)],
                "tags": [list(range(i % 4)) for i in range(n)], "jpeg": [bytes([f, i]) * (i + 1) for i in range(n)],
                "box": [{"x": i, "y": -i} for i in range(n)]}
        if f % 2:
            cols["extra"] = [None if i % 3 else i for i in range(n)]
        table = pa.table(cols)
        pq.write_table(table, backing / f"part-{f}.parquet", row_group_size=8)
        made[f"part-{f}.parquet"] = table.to_pylist()
    return made


def _row_crc(row: dict) -> int:  # (examples/parquet_loader.py's row_crc)
    return zlib.crc32(repr(tuple(row.values())).encode())


def test_parquet_recipe_reads_any_columns_and_follows_the_mini_epochs(mount_dirs):
    mnt, cache = mount_dirs
    backing = Path(mnt).parent / "table"
    made = _parquet_tables(backing)
    with mounted(backing, mnt, cache, "1M", nm=2, rf=2, advance="strict", seed=3, listing="all") as m:
        passes = run_example("parquet_loader.py", mnt, "--passes", 8, "--batch", 16, "--workers", 2)
        st = m.status()
        # --columns: those alone (a subset every file has)
        chosen = run_example("parquet_loader.py", mnt, "--passes", 2, "--batch", 16, "--workers", 2,
                             "--columns", "score,caption")
        # a column the files lack (the old recipe's): the file and its columns named, not a KeyError
        res = subprocess.run([sys.executable, str(EXAMPLES / "parquet_loader.py"), str(mnt), "--passes", "1",
                              "--workers", "0", "--columns", "caption,label"], capture_output=True, text=True,
                             timeout=240, stdin=subprocess.DEVNULL)
    for p in passes:  # every row of the pass's files, once, with all of its file's columns
        want = sorted([f, i, _row_crc(row)] for f in {s[0] for s in p["samples"]} for i, row in enumerate(made[f]))
        assert sorted(p["samples"]) == want
    check_mini_epoch_passes(_shard_passes(passes), made, nm=2, rf=2)
    assert st["loader"]["follows_view"] and st["reads"]["out_of_view"] == 0 and st["passes_total"] == 8
    for p in chosen:
        want = sorted([f, i, _row_crc({"score": row["score"], "caption": row["caption"]})]
                      for f in {s[0] for s in p["samples"]} for i, row in enumerate(made[f]))
        assert sorted(p["samples"]) == want and p["samples"]
    assert res.returncode != 0 and "KeyError" not in res.stderr
    assert re.search(r"part-\d+\.parquet: no column 'label' \(it has caption, score, tags, jpeg, box(, extra)?\)",
                     res.stderr)


def test_direct_reads_recipe_reads_cached_copies(dataset, mount_dirs):
    backing, files = dataset
    mnt, cache = mount_dirs
    with mounted(backing, mnt, cache, "1M", nm=2, rf=2, advance="strict", seed=3) as m:
        deadline = time.monotonic() + 60
        while not m.status()["next_ready"]:  # the current and the next mini-epoch are staged
            assert time.monotonic() < deadline, m.status()
            time.sleep(0.05)
        view = m.status()["view_files"]
        passes = run_example("direct_reads.py", mnt, "--passes", 2, "--batch", 4, "--workers", 2)
        st = m.status()
    check_samples(passes, backing, files)
    # every file of the first mini-epoch was cached: each of its opens read the copy directly
    assert st["reads"]["direct"] >= view == len(passes[0]["samples"])


def test_plan_recipe_reads_copies_and_passes_count_exactly(dataset, mount_dirs):
    backing, files = dataset
    mnt, cache = mount_dirs
    with mounted(backing, mnt, cache, "1M", nm=2, rf=2, advance="strict", seed=3) as m:
        passes = run_example("plan_loader.py", mnt, "--passes", 8, "--batch", 4, "--workers", 2)
        st = m.status()
    check_samples(passes, backing, files)
    check_mini_epoch_passes(passes, files, nm=2, rf=2)
    # each file of the 8 passes counted once as an open: the copies by the workers' reports, the rest by opens
    assert st["reads"]["hits"] + st["reads"]["misses"] == sum(len(p["samples"]) for p in passes)
    assert st["reads"]["plan"] > 0


def test_sampler_recipe_needs_no_filesystem(dataset):
    backing, files = dataset
    assert not any(os.path.ismount(p) for p in (backing, backing.parent))
    passes = run_example("sampler_without_fuse.py", backing, "--epochs", 2, "--nm", 4, "--rf", 2, "--workers", 2)
    check_samples(passes, backing, files)
    check_mini_epoch_passes(passes, files, nm=4, rf=2)
