"""Checkpoints: one ``.npz`` per rank plus a manifest, switched over atomically as a whole.

Each rank writes its shard under a name that carries the step (``state-s0000001234-rank00000-of-00002.npz``)
with the project's atomic-write helper; after a barrier rank 0 replaces ``checkpoint.json``, the manifest
that names the shards, and only then deletes the shards of older checkpoints.  A crash at any point leaves
the previous manifest and every file it names intact, so a reader always sees one whole checkpoint.
"""

from __future__ import annotations

import json
import os

import numpy as np

from dslide.comm import Comm
from dslide.model import ModelConfig, SlideModel
from tierfs.atomic import atomic_open, atomic_write

__all__ = ["MANIFEST", "CheckpointError", "load_model", "read_manifest", "save"]

MANIFEST = "checkpoint.json"
_VERSION = 1


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
    """The model saved in ``directory`` (this rank's shard) and the saved ``meta``."""
    manifest = read_manifest(directory)
    if manifest["ranks"] != comm.size:
        raise CheckpointError(
            f"checkpoint in {os.fspath(directory)} was written by {manifest['ranks']} ranks; this job has {comm.size}"
        )
    model = SlideModel(ModelConfig.from_json(manifest["model"]), comm)
    with np.load(os.path.join(os.fspath(directory), manifest["shards"][comm.rank])) as z:
        model.load_state({k: z[k] for k in z.files})
    return model, manifest["meta"]
