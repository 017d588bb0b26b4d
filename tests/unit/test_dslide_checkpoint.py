"""Checkpoints on disk: what a save killed at any point leaves, and re-sharding (P ranks' states cut into the
states of P' ranks, exactly what P' ranks would hold)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from dslide.checkpoint import MANIFEST, load_model, read_manifest, remove_stale, reshard, save
from dslide.comm import SerialComm
from dslide.model import ModelConfig, SlideModel


class _RankOf:
    """Just enough of a comm for a model's constructor: rank ``rank`` of ``size``."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size, self.bytes_sent = rank, size, 0


def assert_states_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("family", ["srp", "dwta"])
def test_reshard_round_trips_and_matches_what_ranks_build(numba_threads, family: str) -> None:
    with numba_threads(1):
        cfg = ModelConfig(300, 242, hidden=18, budget=24, tables=4, bucket_cap=8, blocks=4, hash=family)
        full = SlideModel(cfg)
        rng = np.random.default_rng(0)
        full.W2[...] += rng.standard_normal(full.W2.shape).astype(np.float32)
        full.index.rehash(full.W2, np.arange(0, 242, 3))  # buckets that moved, with reservoir draws
        full.dirty[::5] = 1
        full.opt["T2"][:] = rng.integers(0, 9, 242)
        whole = full.state()
        for size in (2, 4):
            parts = []
            for r in range(size):
                m = SlideModel(cfg, _RankOf(r, size))
                m.load_state(reshard([whole], cfg, size, r))
                parts.append(m.state())
            assert_states_equal(reshard(parts, cfg, 1, 0), whole)  # P ranks -> one process (dslide eval)
            other = 4 if size == 2 else 2
            assert_states_equal(reshard(parts, cfg, other, 1), reshard([whole], cfg, other, 1))  # P -> P'
        # the tables a rank builds over its own blocks are the slice of the one-process tables
        fresh = SlideModel(cfg)
        fresh.W2[...] = full.W2
        fresh.index.rebuild(fresh.W2)
        rank1 = SlideModel(cfg, _RankOf(1, 2))
        rank1.W2[...] = full.W2[rank1.l_lo :]
        rank1.index.rebuild(rank1.W2)
        cut = reshard([fresh.state()], cfg, 2, 1)
        for k, v in rank1.index.state().items():
            np.testing.assert_array_equal(v, cut[f"lsh_{k}"], err_msg=k)


def saved_files(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*")}


def test_what_a_killed_save_leaves_never_mixes_with_the_checkpoint_and_goes_at_resume(tmp_path: Path) -> None:
    """The states a kill can leave, built from real saves: the manifest's checkpoint loads whole, and
    ``remove_stale`` (run by ``--resume``) leaves exactly it and what a user put beside it."""
    cfg = ModelConfig(300, 242, hidden=8, budget=24, tables=2, bucket_cap=8, blocks=4)
    model = SlideModel(cfg)
    ck = tmp_path / "ck"
    save(ck, model, {"passes": 1})
    first = {k: v.copy() for k, v in model.state().items()}  # state() hands out the live arrays
    (ck / "notes.txt").write_text("mine")
    shutil.copytree(ck, tmp_path / "after-first")
    model.W2 += 1
    model.step += 7
    save(ck, model, {"passes": 2})
    second = model.state()
    live = read_manifest(ck)["dir"]
    assert saved_files(ck) == {MANIFEST, "notes.txt", live, f"{live}/rank00000-of-00001.npz"}

    # killed after the second commit, before the first checkpoint was removed: its directory remains
    killed_late = tmp_path / "late"
    shutil.copytree(ck, killed_late)
    (old,) = [p for p in (tmp_path / "after-first").iterdir() if p.name.startswith("ck-")]
    shutil.copytree(old, killed_late / old.name)
    # killed before it: the second checkpoint's directory, a shard's and the manifest's temp files are there
    killed_early = tmp_path / "early"
    shutil.copytree(tmp_path / "after-first", killed_early)
    shutil.copytree(ck / live, killed_early / live)
    (killed_early / live / ".tmp-rank00001-of-00002.npz.4242").write_bytes(b"half a shard")
    (killed_early / ".tmp-checkpoint.json.4242").write_bytes((ck / MANIFEST).read_bytes())
    for directory, want, passes in ((killed_late, second, 2), (killed_early, first, 1)):
        loaded, meta = load_model(directory, SerialComm())
        assert meta == {"passes": passes}
        assert_states_equal(loaded.state(), want)
        manifest_dir = read_manifest(directory)["dir"]
        remove_stale(directory)
        assert saved_files(directory) == {MANIFEST, "notes.txt", manifest_dir, f"{manifest_dir}/rank00000-of-00001.npz"}
        assert_states_equal(load_model(directory, SerialComm())[0].state(), want)


def test_a_save_writes_no_file_an_older_checkpoint_uses(tmp_path: Path) -> None:
    """Another run saving the same step into the same directory must not write over the shards the current
    manifest names (shards named by step alone were replaced one rank at a time: a kill in between left a
    manifest over two runs' shards).  A version-2 checkpoint (shards beside the manifest) still loads."""
    cfg = ModelConfig(300, 242, hidden=8, budget=24, tables=2, bucket_cap=8, blocks=4)
    a, b = SlideModel(cfg), SlideModel(dataclasses.replace(cfg, seed=9))
    save(tmp_path, a, {"run": "a"})
    named = read_manifest(tmp_path)
    shard = tmp_path / named["dir"] / named["shards"][0]
    before = shard.read_bytes()
    save(tmp_path, b, {"run": "b"})
    assert read_manifest(tmp_path)["dir"] != named["dir"] and not shard.exists()
    assert_states_equal(load_model(tmp_path, SerialComm())[0].state(), b.state())
    # the same checkpoint as version 2 wrote it
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "state-s0000000000-rank00000-of-00001.npz").write_bytes(before)
    manifest = {**named, "version": 2, "shards": ["state-s0000000000-rank00000-of-00001.npz"]}
    del manifest["dir"]
    (v2 / MANIFEST).write_text(json.dumps(manifest))
    assert_states_equal(load_model(v2, SerialComm())[0].state(), a.state())
    save(v2, b, {"run": "b"})  # the first save in the new layout removes version 2's shards
    assert not (v2 / "state-s0000000000-rank00000-of-00001.npz").exists()
