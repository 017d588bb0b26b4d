"""The training loop: passes over a training directory that may change between passes, evaluation, checkpoints.

A *pass* reads every file the training directory lists at the pass's start (re-listed each pass, so training
from a tierfs mount follows its current view); ``epochs`` is the number of passes.  File order and the order
of points inside each file are shuffled from ``(seed, pass)``, so a resumed run sees exactly the batches an
uninterrupted one would.  After every ``eval_every`` passes the loop evaluates on the test set and emits one
JSON record; with a checkpoint directory it saves after each pass.

Hooks for the distributed shell (:mod:`dslide.cli` under ``mpiexec``): ``comm`` carries the collectives and the
byte count; ``before_report(record)`` may add fields (tierfs's own epoch) and act on them (write the
``feedback`` line) before the record is printed; only rank 0 emits.

With ``val`` (a file) or ``val_fraction`` (a held-out split of the training files, :mod:`dslide.heldout`) the
loop also scores a validation set after *every* pass by exact inference -- ``val_p_at_1``, ``val_err`` and
``val_loss`` in the record, what the ``feedback`` line reports to tierfs's ARF -- so the test set stays out of
every decision taken in training.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numba
import numpy as np

from dslide import checkpoint
from dslide.comm import Comm, SerialComm
from dslide.data import XCData, check_shape, load_xc
from dslide.heldout import HeldOut
from dslide.model import ModelConfig, SlideModel
from dslide.progress import PassProgress

__all__ = ["TrainOptions", "list_train_files", "run_training"]


@dataclass(frozen=True)
class TrainOptions:
    train: tuple[str, ...]  # directories (listed every pass) and/or files
    test: str | None = None
    epochs: int = 1
    batch: int = 256
    threads: int | None = None  # numba threads per rank; None = all cores of this process
    seed: int = 0
    eval_points: int | None = 10_000  # evaluate on the first N test points (None = all)
    eval_mode: str = "exact"
    eval_every: int = 1
    checkpoint: str | None = None
    resume: bool = False
    val: str | None = None  # a validation file, scored after every pass
    val_fraction: float = 0.0  # or: hold out this share of the training points (dslide.heldout)
    val_points: int = 2000  # the most validation points scored
    #: who opens the training files: "rank0" (its listing is the pass; it sends the points to every rank) or
    #: "node" (the first rank of each node lists and reads its node's own mount -- a tierfs mount per node with
    #: ``peers=mpi`` shows each node its share -- and sends the points to every rank: the pass is the union)
    read: str = "rank0"

    def __post_init__(self) -> None:
        if self.epochs < 0 or self.batch < 1 or self.eval_every < 1:
            raise ValueError(f"need epochs >= 0, batch >= 1, eval_every >= 1; got {self.epochs}, {self.batch}, "
                             f"{self.eval_every}")  # fmt: skip
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.eval_mode not in ("exact", "lsh"):
            raise ValueError(f"eval mode must be 'exact' or 'lsh', got {self.eval_mode!r}")
        if self.resume and not self.checkpoint:
            raise ValueError("--resume needs --checkpoint DIR")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"val fraction must be in [0, 1), got {self.val_fraction}")
        if self.val and self.val_fraction:
            raise ValueError("give --val FILE or --val-fraction, not both")
        if self.read not in ("rank0", "node"):
            raise ValueError(f"read must be 'rank0' or 'node', got {self.read!r}")
        if self.val_points < 1:
            raise ValueError(f"val points must be >= 1, got {self.val_points}")


def list_train_files(specs: Sequence[str]) -> list[str]:
    """Regular files of each directory (sorted, hidden names skipped) and the files named directly."""
    files: list[str] = []
    for spec in specs:
        if os.path.isdir(spec):
            with os.scandir(spec) as it:
                names = sorted(e.name for e in it if not e.name.startswith(".") and e.is_file())
            files.extend(os.path.join(spec, n) for n in names)
        elif os.path.exists(spec):
            files.append(spec)
        else:
            raise FileNotFoundError(f"{spec}: no such file or directory")
    return files


def _emit_json(record: dict) -> None:
    print(json.dumps(record), flush=True)


def _checked_data(path: str | None, cfg: ModelConfig) -> XCData | None:
    """The data set in ``path`` (None without one), refused unless its shape is the model's."""
    if not path:
        return None
    data = load_xc(path)
    check_shape(data, path, cfg.n_features, cfg.n_labels)
    return data


def run_training(
    model_cfg: ModelConfig,
    opts: TrainOptions,
    comm: Comm | None = None,
    emit: Callable[[dict], None] = _emit_json,
    before_report: Callable[[dict], None] | None = None,
    lister: Callable[[Sequence[str]], list[str]] = list_train_files,
    progress: PassProgress | None = None,
) -> tuple[SlideModel, list[dict]]:
    """Train for ``opts.epochs`` passes (in total, counting the passes a resumed checkpoint already made);
    ``progress`` (rank 0's) shows each pass as it goes."""
    comm = comm if comm is not None else SerialComm()
    # (numba's config sets its settings from the environment at run time: its type information lacks them)
    numba.set_num_threads(opts.threads or numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
    if opts.resume:
        assert opts.checkpoint is not None  # (TrainOptions refuses --resume without --checkpoint)
        model, meta = checkpoint.load_model(opts.checkpoint, comm)
        if comm.rank == 0:  # what a kill during the last save left goes now, not at the next save
            checkpoint.remove_stale(opts.checkpoint)
    else:
        model, meta = SlideModel(model_cfg, comm), {"passes": 0, "seconds": 0.0, "samples": 0}
    test = _checked_data(opts.test, model.cfg)
    val = _checked_data(opts.val, model.cfg)
    heldout = HeldOut(opts.val_fraction, opts.val_points, opts.seed) if opts.val_fraction else None
    records = []
    passes_done, seconds, samples = int(meta["passes"]), float(meta["seconds"]), int(meta["samples"])
    readers = _readers(comm, opts.read)
    for pass_index in range(passes_done, opts.epochs):
        files = _pass_files(comm, readers, lister, opts.train)
        t0 = time.perf_counter()
        steps_before = model.step
        if progress is not None:
            progress.start(pass_index + 1, opts.epochs, len(files))
        loss_sum, n_labelled, n_top, n_pass, step_bytes = _one_pass(model, files, opts, pass_index, heldout, progress)
        if progress is not None:
            progress.finish()
        dt = time.perf_counter() - t0
        seconds += dt
        samples += n_pass
        passes_done = pass_index + 1
        if opts.checkpoint:
            checkpoint.save(opts.checkpoint, model, {"passes": passes_done, "seconds": seconds, "samples": samples})
        evaluate = passes_done % opts.eval_every == 0 or passes_done == opts.epochs
        record = {
            "epoch": passes_done,  # the old name of "pass", kept while the interface (SPEC.md) lists it
            "pass": passes_done,
            "seconds": round(seconds, 3),
            "samples_per_s": round(n_pass / dt, 1) if dt > 0 else 0.0,
            "loss": round(loss_sum / n_labelled, 6) if n_labelled else None,
            # labelled samples of the pass whose top active logit was not one of their labels
            "train_err": round(1.0 - n_top / n_labelled, 6) if n_labelled else None,
            "p_at_1": None,
            "p_at_5": None,
            "comm_bytes": int(comm.bytes_sent),
            # what this rank's collectives sent per training step of this pass (no data, no evaluation)
            "comm_bytes_per_step": round(step_bytes / max(1, model.step - steps_before)),
            "steps": model.step,
            "samples": samples,  # training points visited so far (held-out points excluded)
            "files": len(files),
        }
        val_set = heldout.data() if heldout is not None else val
        if val_set is not None and len(val_set):
            ev = model.validate(val_set, opts.val_points)
            record["val_p_at_1"] = round(ev["p_at_1"], 6)
            record["val_err"] = round(1.0 - ev["p_at_1"], 6)
            record["val_loss"] = None if ev["loss"] is None else round(ev["loss"], 6)
            record["val_points"] = ev["eval_points"]
        if test is not None and evaluate:
            ev = model.evaluate(test, opts.eval_points, opts.eval_mode)
            record["p_at_1"] = round(ev["p_at_1"], 6)
            record["p_at_5"] = round(ev["p_at_5"], 6)
        if before_report is not None:
            before_report(record)
        if not evaluate:
            continue  # before_report still ran: tierfs feedback goes out after every pass
        records.append(record)
        if comm.rank == 0:
            emit(record)
    return model, records


def _one_pass(
    model: SlideModel, files: list[tuple[int, str]], opts: TrainOptions, pass_index: int,
    heldout: HeldOut | None = None, progress: PassProgress | None = None,
) -> tuple[float, int, int, int, int]:
    """Every file once, in a shuffled order, each file's points shuffled (less those ``heldout`` keeps out);
    returns (loss sum, labelled, labelled with a label on top, points, bytes this rank sent in training steps)."""
    order = np.random.default_rng((opts.seed, 5, pass_index)).permutation(len(files))
    loss_sum, n_labelled, n_top, n_points, step_bytes = 0.0, 0, 0, 0, 0
    for fi in order:
        reader, path = files[fi]
        data = _load_on(reader, path, model.comm)
        check_shape(data, path, model.cfg.n_features, model.cfg.n_labels)
        perm = np.random.default_rng((opts.seed, 6, pass_index, int(fi))).permutation(len(data))
        if heldout is not None:
            perm = perm[heldout.split(path, data)[perm]]
        for start in range(0, len(perm), opts.batch):
            sent = model.comm.bytes_sent
            res = model.train_step(data, perm[start : start + opts.batch])
            step_bytes += model.comm.bytes_sent - sent
            loss_sum += res.loss_sum
            n_labelled += res.n_labelled
            n_top += res.n_top_label
        n_points += len(perm)
        if progress is not None:
            progress.advance(len(perm))
    return loss_sum, n_labelled, n_top, n_points, step_bytes


def _readers(comm: Comm, read: str) -> list[int]:
    """The ranks that open training files: rank 0 (``read="rank0"``), or the first rank of every node."""
    if read == "rank0" or comm.size == 1:
        return [0]
    first = np.array([comm.node_comm().rank == 0], dtype=np.int64)
    return [int(r) for r in np.flatnonzero(comm.allgather(first))]


def _pass_files(comm: Comm, readers: list[int], lister: Callable[[Sequence[str]], list[str]],
                train: Sequence[str]) -> list[tuple[int, str]]:
    """The pass's training files, each with the rank that reads it: every reader lists its own view (on a tierfs
    mount the listing is where its pass begins) and tells the others."""
    mine = lister(train) if comm.rank in readers else None
    files: list[tuple[int, str]] = []
    for r in readers:
        theirs = comm.bcast(mine if comm.rank == r else None, root=r)
        assert isinstance(theirs, list)
        files += [(r, f) for f in theirs]
    return files


def _load_on(reader: int, path: str, comm: Comm) -> XCData:
    """Rank ``reader`` reads the file and sends the parsed points to the others, so a tierfs mount sees one open
    per file per pass (opens from every rank would end its passes early) and every rank trains on the same
    points."""
    if comm.size == 1:
        return load_xc(path)
    data = comm.bcast(load_xc(path) if comm.rank == reader else None, root=reader)
    assert isinstance(data, XCData)
    return data
