"""Metrics for fleets: ``tierfs metrics MOUNT --textfile DIR`` for two mounts into one node-exporter textfile dir,
read back together as node-exporter would, without a collision; promtool when it is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tierfs import __version__
from tierfs.testing.harness import make_dataset, mounted

prometheus = pytest.importorskip("prometheus_client.parser")


def run_tierfs(*args):
    return subprocess.run([sys.executable, "-m", "tierfs", *map(str, args)], capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)


def _series(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in prometheus.text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in out, f"duplicate series {key}"
            out[key] = s.value
    return out


def test_two_mounts_in_one_textfile_dir_do_not_collide(tmp_path):
    textfiles = tmp_path / "textfile"
    textfiles.mkdir()
    mounts = []
    for name in ("a", "b-c"):
        make_dataset(tmp_path / f"data-{name}", dirs=2, files_per_dir=5, max_size=4096, seed=len(name))
        (tmp_path / name).mkdir()
        mounts.append((tmp_path / f"data-{name}", tmp_path / name, tmp_path / f"cache-{name}"))
    with mounted(*mounts[0], "1M", nm=2) as ma, mounted(*mounts[1], "1M", nm=5):
        for _, mnt, _ in mounts:
            res = run_tierfs("metrics", mnt, "--textfile", textfiles)
            assert res.returncode == 0 and not res.stdout, res.stderr
        files = sorted(os.listdir(textfiles))
        assert files == [f"tierfs-{str(tmp_path / 'a').strip('/').replace('-', '--').replace('/', '-')}.prom",
                         f"tierfs-{str(tmp_path / 'b-c').strip('/').replace('-', '--').replace('/', '-')}.prom"]
        texts = [(textfiles / f).read_text() for f in files]
        printed = run_tierfs("metrics", ma.mountpoint)
        # the same series, printed (not the same values: counters such as backing requests move meanwhile)
        assert printed.returncode == 0 and set(_series(printed.stdout)) == set(_series(texts[0]))
    per_mount = [_series(t) for t in texts]
    together = {}
    for series in per_mount:  # node-exporter merges the files' families: no series may appear twice
        assert not set(series) & set(together)
        together.update(series)
    for (_, mnt, _), series in zip(mounts, per_mount, strict=True):
        assert all(dict(labels).get("mountpoint") == str(mnt) for _, labels in series), series
        assert series[("tierfs_info", (("mountpoint", str(mnt)), ("version", __version__)))] == 1
        assert series[("tierfs_up", (("mountpoint", str(mnt)),))] == 1
    assert per_mount[0][("tierfs_nm", (("mountpoint", str(mounts[0][1])),))] == 2
    assert per_mount[1][("tierfs_nm", (("mountpoint", str(mounts[1][1])),))] == 5
    # the families' HELP and TYPE lines agree across the files (node-exporter refuses a mismatch)
    heads = [{tuple(ln.split(" ", 3)[1:3]): ln for ln in t.splitlines() if ln.startswith("#")} for t in texts]
    assert heads[0] == heads[1]
    if shutil.which("promtool"):
        for f in files:
            res = subprocess.run(["promtool", "check", "metrics"], input=(textfiles / f).read_text(),
                                 capture_output=True, text=True, timeout=60)
            assert res.returncode == 0, res.stdout + res.stderr


def test_a_path_that_never_answered_gets_no_file(tmp_path):
    """(issue 47) A typo must not leave a ``tierfs_up 0`` file that alerts for good: nothing is written."""
    (tmp_path / "textfile").mkdir()
    (tmp_path / "m").mkdir()
    for path in (tmp_path / "m", tmp_path / "typo"):
        res = run_tierfs("metrics", path, "--textfile", tmp_path / "textfile")
        assert res.returncode == 1 and "is not a tierfs mount" in res.stderr, res.stderr
        assert os.listdir(tmp_path / "textfile") == []
        assert f"nothing written into {tmp_path / 'textfile'}" in res.stderr
        assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr  # one line


def test_a_mount_that_stops_answering_turns_its_file_into_tierfs_up_0(tmp_path):
    make_dataset(tmp_path / "data", dirs=2, files_per_dir=3, max_size=4096, seed=3)
    (tmp_path / "textfile").mkdir()
    (tmp_path / "m").mkdir()
    with mounted(tmp_path / "data", tmp_path / "m", tmp_path / "cache", "1M", nm=2):
        res = run_tierfs("metrics", tmp_path / "m", "--textfile", tmp_path / "textfile")
        assert res.returncode == 0, res.stderr
    (f,) = os.listdir(tmp_path / "textfile")
    assert (tmp_path / "textfile" / f).stat().st_mode & 0o777 == 0o644
    res = run_tierfs("metrics", tmp_path / "m", "--textfile", tmp_path / "textfile")  # unmounted now
    assert res.returncode == 1 and "is not a tierfs mount" in res.stderr
    assert os.listdir(tmp_path / "textfile") == [f]
    assert _series((tmp_path / "textfile" / f).read_text()) == {
        ("tierfs_up", (("mountpoint", str(tmp_path / "m")),)): 0}
