"""Checkpoints: one ``.npz`` per rank in a directory of its own, and a manifest that switches over atomically.

``DIR/checkpoint.json`` (the manifest: model config, progress, the shards' directory and names) is the one
commit point.  A save makes a fresh directory ``DIR/ck-s<step>-<random>`` (never a name an older checkpoint,
of this run or any other, has used), every rank writes its shard there with the project's atomic-write helper,
and after a barrier rank 0 replaces the manifest and then removes every other checkpoint directory.  A kill at
any point therefore leaves the previous manifest and every file it names intact, and no file of another
checkpoint can ever be read as part of it (shards named by step alone, in one directory, could be: a save
into a directory holding an older run's checkpoint of the same step overwrote the shards that checkpoint's
manifest named, one rank at a time).  What a killed save leaves -- a directory the manifest does not name,
temp files -- is removed when training resumes from the checkpoint (:func:`remove_stale`) or by the next save,
never by a reader such as ``dslide eval`` (a training job may be writing that directory).

A checkpoint written by P ranks can be read by any rank count P' that divides the model's selection blocks
(one process for ``dslide eval``, or another ``mpiexec -n P'`` for ``--resume``): every array is either the
same on every rank, a slice of the hidden neurons, a slice of the labels, or per-block LSH buckets, so
:func:`reshard` cuts the saved shards into the pieces rank r' of P' owns -- the state that P' ranks would have
reached themselves, since the random choices do not depend on P (:mod:`dslide.model`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile

import numpy as np

from dslide.comm import Comm
from dslide.lsh import reshard_tables
from dslide.model import ModelConfig, SlideModel, shard_bounds
from sampler.atomic import TEMP_PREFIX, atomic_open, atomic_write, fsync_dir

__all__ = ["MANIFEST", "CheckpointError", "load_model", "read_manifest", "remove_stale", "reshard", "save"]

MANIFEST = "checkpoint.json"
# 3: shards in a directory of their own per checkpoint; 2: shards beside the manifest (still read)
# (version 1's per-rank random choices, before selection blocks, cannot be continued)
_VERSION = 3
_READABLE = (2, 3)
_SHARD_DIR = "ck-s"  # + step + random suffix

# How each array of SlideModel.state() is split over ranks.
_HIDDEN_COLUMNS = ("W1", "opt_M1", "opt_V1", "opt_G1", "opt_Mb1", "opt_Vb1", "opt_Gb1")
_HIDDEN_ROWS = ("b1",)
# (checkpoints from before the fused output update also hold opt_G2 / opt_Gb2, always zero between steps: unread)
_LABEL_ROWS = ("W2", "b2", "dirty", "label_count", "opt_M2", "opt_V2", "opt_T2", "opt_Mb2", "opt_Vb2")
_SAME = ("opt_T1", "opt_Tb1", "counters", "lsh_srp", "lsh_dwta", "lsh_counters")


class CheckpointError(RuntimeError):
    pass


def save(directory: str | os.PathLike[str], model: SlideModel, meta: dict) -> None:
    """Save ``model`` (every rank calls this) with ``meta`` (JSON: training progress) into ``directory``."""
    directory = os.fspath(directory)
    comm = model.comm
    shards = [f"rank{r:05d}-of-{comm.size:05d}.npz" for r in range(comm.size)]
    made = None
    if comm.rank == 0:
        os.makedirs(directory, exist_ok=True)
        path = tempfile.mkdtemp(prefix=f"{_SHARD_DIR}{model.step:010d}-", dir=directory)
        os.chmod(path, 0o755)  # mkdtemp's 0o700 would hide the checkpoint from its other readers
        fsync_dir(directory)
        made = os.path.basename(path)
    subdir = comm.bcast(made)
    assert isinstance(subdir, str)
    with atomic_open(os.path.join(directory, subdir, shards[comm.rank]), 0o644) as f:
        # (numpy's stub: a ** of arrays might hold savez's allow_pickle, a bool -- the names here are the model's)
        np.savez(f, **model.state())  # type: ignore[arg-type]
    comm.barrier()
    if comm.rank == 0:
        manifest = {"version": _VERSION, "ranks": comm.size, "dir": subdir, "shards": shards}
        manifest.update(model=model.cfg.to_json(), meta=meta)
        atomic_write(os.path.join(directory, MANIFEST), (json.dumps(manifest, indent=1) + "\n").encode(), 0o644)
        _remove_all_but(directory, {MANIFEST, subdir})
    comm.barrier()


def read_manifest(directory: str | os.PathLike[str]) -> dict:
    path = os.path.join(os.fspath(directory), MANIFEST)
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read())
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint in {os.fspath(directory)} ({MANIFEST} missing)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable checkpoint manifest ({e})") from None
    if manifest.get("version") not in _READABLE:
        raise CheckpointError(f"{path}: checkpoint version {manifest.get('version')}, this dslide reads "
                              f"{' and '.join(map(str, _READABLE))}")  # fmt: skip
    return manifest


def remove_stale(directory: str | os.PathLike[str]) -> None:
    """Remove what saves killed part-way left in ``directory``: checkpoint directories, shards and temp files
    the manifest does not name.  Only for the job that writes the checkpoint (``--resume``): a save in progress
    looks stale to anyone else.  Raises :class:`CheckpointError` without a readable manifest (then nothing is
    known to be stale)."""
    directory = os.fspath(directory)
    manifest = read_manifest(directory)
    live = {manifest["dir"]} if "dir" in manifest else set(manifest["shards"])
    _remove_all_but(directory, {MANIFEST} | live)


# What a save writes into a checkpoint directory: shard directories, version 2's shards, and the temp files
# (``TEMP_PREFIX`` + name + ``.pid``) of those and of the manifest.  Anything else a user put there stays.
_SAVED = re.compile(
    rf"{_SHARD_DIR}\d{{10}}-\w+|(?:{re.escape(TEMP_PREFIX)})?state-s\d+-rank\d+-of-\d+\.npz(?:\.\d+)?"
    rf"|{re.escape(TEMP_PREFIX + MANIFEST)}\.\d+"
)


def _remove_all_but(directory: str, keep: set[str]) -> None:
    for name in os.listdir(directory):
        if name in keep or not _SAVED.fullmatch(name):
            continue
        path = os.path.join(directory, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def load_model(directory: str | os.PathLike[str], comm: Comm) -> tuple[SlideModel, dict]:
    """The model saved in ``directory`` (this rank's part of it, whatever rank count wrote it) and ``meta``."""
    directory = os.fspath(directory)
    manifest = read_manifest(directory)
    cfg = ModelConfig.from_json(manifest["model"])
    if cfg.blocks % comm.size:
        supported = ", ".join(str(p) for p in range(1, cfg.blocks + 1) if cfg.blocks % p == 0)
        raise CheckpointError(
            f"checkpoint in {directory} was written by {manifest['ranks']} ranks with {cfg.blocks} selection "
            f"blocks; it can be read by {supported} ranks, this job has {comm.size}"
        )
    model = SlideModel(cfg, comm)
    paths = [os.path.join(directory, manifest.get("dir", ""), name) for name in manifest["shards"]]
    if manifest["ranks"] == comm.size:
        with np.load(paths[comm.rank]) as z:
            model.load_state({k: z[k] for k in z.files})
    else:
        shards = [np.load(p) for p in paths]
        try:
            model.load_state(reshard(shards, cfg, comm.size, comm.rank))
        finally:
            for z in shards:
                z.close()
    return model, manifest["meta"]


def reshard(shards: list, cfg: ModelConfig, size: int, rank: int) -> dict[str, np.ndarray]:
    """Rank ``rank`` of ``size``'s state from the states ``shards`` of ``len(shards)`` ranks (mappings of
    name -> array, read lazily: only the shards that overlap the wanted slice are read)."""
    old = len(shards)

    def cut(name: str, n: int, axis: int) -> np.ndarray:
        lo, hi = shard_bounds(n, size, rank)
        pieces = []
        for r in range(old):
            olo, ohi = shard_bounds(n, old, r)
            a, b = max(lo, olo), min(hi, ohi)
            if a < b:
                pieces.append(np.take(shards[r][name], np.arange(a - olo, b - olo), axis=axis))
        return np.concatenate(pieces, axis=axis)

    state: dict[str, np.ndarray] = {k: np.array(shards[0][k]) for k in _SAME}
    state.update({k: cut(k, cfg.hidden, 1) for k in _HIDDEN_COLUMNS})
    state.update({k: cut(k, cfg.hidden, 0) for k in _HIDDEN_ROWS})
    state.update({k: cut(k, cfg.n_labels, 0) for k in _LABEL_ROWS if k in shards[0]})
    old_bounds = [shard_bounds(cfg.n_labels, old, r)[0] for r in range(old)] + [cfg.n_labels]
    new_bounds = [shard_bounds(cfg.n_labels, size, r)[0] for r in range(size)] + [cfg.n_labels]
    tables = reshard_tables(shards, cfg.blocks, old_bounds, new_bounds, rank, prefix="lsh_")
    state.update({f"lsh_{k}": v for k, v in tables.items()})
    return state
