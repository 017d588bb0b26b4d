"""Checkpoints: one ``.npz`` per rank plus a manifest, switched over atomically as a whole.

Each rank writes its shard under a name that carries the step (``state-s0000001234-rank00000-of-00002.npz``)
with the project's atomic-write helper; after a barrier rank 0 replaces ``checkpoint.json``, the manifest
that names the shards, and only then deletes the shards of older checkpoints.  A crash at any point leaves
the previous manifest and every file it names intact, so a reader always sees one whole checkpoint.

A checkpoint written by P ranks can be read by any rank count P' that divides the model's selection blocks
(one process for ``dslide eval``, or another ``mpiexec -n P'`` for ``--resume``): every array is either the
same on every rank, a slice of the hidden neurons, a slice of the labels, or per-block LSH buckets, so
:func:`reshard` cuts the saved shards into the pieces rank r' of P' owns -- the state that P' ranks would have
reached themselves, since the random choices do not depend on P (:mod:`dslide.model`).
"""

from __future__ import annotations

import json
import os

import numpy as np

from dslide.comm import Comm
from dslide.model import ModelConfig, SlideModel, shard_bounds
from tierfs.atomic import atomic_open, atomic_write

__all__ = ["MANIFEST", "CheckpointError", "load_model", "read_manifest", "reshard", "save"]

MANIFEST = "checkpoint.json"
_VERSION = 2  # 2: selection blocks (version 1's per-rank random choices cannot be continued)

# How each array of SlideModel.state() is split over ranks.
_HIDDEN_COLUMNS = ("W1", "opt_M1", "opt_V1", "opt_G1", "opt_Mb1", "opt_Vb1", "opt_Gb1")
_HIDDEN_ROWS = ("b1",)
_LABEL_ROWS = (
    "W2", "b2", "dirty", "label_count", "opt_M2", "opt_V2", "opt_G2", "opt_T2", "opt_Mb2", "opt_Vb2", "opt_Gb2",
)  # fmt: skip
_SAME = ("opt_T1", "opt_Tb1", "counters", "lsh_srp", "lsh_dwta", "lsh_counters")


class CheckpointError(RuntimeError):
    pass


def save(directory: str | os.PathLike[str], model: SlideModel, meta: dict) -> None:
    """Save ``model`` (every rank calls this) with ``meta`` (JSON: training progress) into ``directory``."""
    directory = os.fspath(directory)
    comm = model.comm
    os.makedirs(directory, exist_ok=True)
    name = f"state-s{model.step:010d}-rank{comm.rank:05d}-of-{comm.size:05d}.npz"
    with atomic_open(os.path.join(directory, name), 0o644) as f:
        np.savez(f, **model.state())
    comm.barrier()
    if comm.rank == 0:
        shards = [f"state-s{model.step:010d}-rank{r:05d}-of-{comm.size:05d}.npz" for r in range(comm.size)]
        manifest = {"version": _VERSION, "ranks": comm.size, "shards": shards, "model": model.cfg.to_json()}
        manifest["meta"] = meta
        atomic_write(os.path.join(directory, MANIFEST), (json.dumps(manifest, indent=1) + "\n").encode(), 0o644)
        for old in os.listdir(directory):
            if old.startswith("state-") and old.endswith(".npz") and old not in shards:
                os.unlink(os.path.join(directory, old))
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
    if manifest.get("version") != _VERSION:
        raise CheckpointError(f"{path}: checkpoint version {manifest.get('version')}, this dslide reads {_VERSION}")
    return manifest


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
    paths = [os.path.join(directory, name) for name in manifest["shards"]]
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
    state.update(_reshard_lsh(shards, cfg, size, rank))
    return state


def _reshard_lsh(shards: list, cfg: ModelConfig, size: int, rank: int) -> dict[str, np.ndarray]:
    """The LSH buckets of the selection blocks rank ``rank`` of ``size`` owns, re-laid as its CSR arrays.

    A rank's tables are CSR arrays whose buckets run table by table, then block by block, then code; a block's
    buckets (capacity, fill, seen, items) move as a whole, with item ids re-based to the new first label."""
    old, V = len(shards), cfg.blocks
    per_old, per_new = V // old, V // size
    g0, g1 = rank * per_new, (rank + 1) * per_new
    l_lo = shard_bounds(cfg.n_labels, size, rank)[0]
    offsets0 = shards[0]["lsh_offsets"]
    n_tables = offsets0.shape[0]
    n_codes = (offsets0.shape[1] - 1) // per_old
    caps, fills, seens, items = [], [], [], [[] for _ in range(n_tables)]
    for g in range(g0, g1):
        r, gl = divmod(g, per_old)
        z = shards[r]
        offsets, fill, seen, its = z["lsh_offsets"], z["lsh_fill"], z["lsh_seen"], z["lsh_items"]
        b0, b1 = gl * n_codes, (gl + 1) * n_codes
        caps.append(np.diff(offsets, axis=1)[:, b0:b1])
        fills.append(fill[:, b0:b1])
        seens.append(seen[:, b0:b1])
        shift = shard_bounds(cfg.n_labels, old, r)[0] - l_lo
        for t in range(n_tables):
            seg = its[offsets[t, b0] : offsets[t, b1]]
            items[t].append(np.where(seg >= 0, seg + shift, seg).astype(np.int32))
    cap = np.concatenate(caps, axis=1)
    flat = np.cumsum(cap.ravel())
    new_offsets = np.zeros((n_tables, cap.shape[1] + 1), np.int64)
    new_offsets[:, 1:] = flat.reshape(cap.shape)
    new_offsets[1:, 0] = new_offsets[:-1, -1]
    codes = []
    lo, hi = shard_bounds(cfg.n_labels, size, rank)
    for r in range(old):
        olo, ohi = shard_bounds(cfg.n_labels, old, r)
        a, b = max(lo, olo), min(hi, ohi)
        if a < b:
            # stored codes are (local block) * n_codes + code: re-base the block to the new rank's first
            codes.append(shards[r]["lsh_codes"][a - olo : b - olo] + (r * per_old - g0) * n_codes)
    return {
        "lsh_offsets": new_offsets,
        "lsh_fill": np.concatenate(fills, axis=1),
        "lsh_seen": np.concatenate(seens, axis=1),
        "lsh_items": np.concatenate([np.zeros(0, np.int32)] + [seg for t in range(n_tables) for seg in items[t]]),
        "lsh_codes": np.concatenate(codes).astype(np.int32),
    }
