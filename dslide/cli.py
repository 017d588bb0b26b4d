"""``dslide gen | train | eval`` -- the command line of ``../shared/SPEC.md``.

Exit status: 0 ok, 2 usage error (bad option or value), 1 runtime error (bad data, missing checkpoint, I/O),
always with one line on stderr.  Defaults of ``train`` are the settings that work best on planted data of
Amazon-670K shape (see docs/dslide.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from dslide.comm import Comm
from dslide.feedback import FEEDBACK_SCORES, PassReporter
from dslide.gen import AMAZON_670K
from dslide.mpicomm import ends_job_on_failure, threads_per_rank

__all__ = ["DEFAULT_VAL_FRACTION", "main", "make_comm"]

#: Share of the training points held out for ``val_err`` when ``--control`` is given (see docs/dslide.md).
DEFAULT_VAL_FRACTION = 0.05


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2 -- not argparse's usage dump
        raise UsageError(message)


def _int_at_least(lo: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v

    return parse


_positive_int = _int_at_least(1)
_nonneg_int = _int_at_least(0)


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _positive_float(text: str) -> float:
    v = _number(text)
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return v


def _nonneg_float(text: str) -> float:
    v = _number(text)
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return v


def _fraction(text: str) -> float:
    v = _nonneg_float(text)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    from dslide import __version__

    p = _Parser(prog="dslide", description="D-SLIDE trainer: LSH-sparse output layer, numba kernels, MPI.")
    p.add_argument("--version", action="version", version=f"dslide {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("gen", help="write a planted synthetic XC data set: OUT/train/part-*.txt and OUT/test.txt")
    g.add_argument("out", metavar="OUT", help="directory to write (created)")
    g.add_argument("--points", type=_nonneg_int, default=100_000, help="training points (default %(default)s)")
    g.add_argument("--test-points", type=_nonneg_int, default=None, help="test points (default points/10)")
    g.add_argument("--features", type=_positive_int, default=AMAZON_670K[0],
                   help="feature dimension (default %(default)s, Amazon-670K's)")
    g.add_argument("--labels", type=_positive_int, default=AMAZON_670K[1],
                   help="label count (default %(default)s, Amazon-670K's)")
    g.add_argument("--shards", type=_positive_int, default=1, help="training files part-*.txt (default %(default)s)")
    g.add_argument("--seed", type=_nonneg_int, default=0, help="seed of the planted model (default %(default)s)")
    g.add_argument("--labels-per-point", type=_positive_float, default=5.0,
                   help="mean labels per point (default %(default)s)")
    g.add_argument("--nnz", type=_positive_float, default=64.0,
                   help="mean non-zero features per point (default %(default)s)")

    t = sub.add_parser("train", help="train on XC files; one JSON line per evaluation")
    t.add_argument("--train", nargs="+", required=True, metavar="DIR_OR_FILE",
                   help="training files, or dirs of them (required)")
    t.add_argument("--test", metavar="FILE", help="test file scored at each evaluation (default: none)")
    t.add_argument("--epochs", type=_nonneg_int, default=5, help="passes over --train (default %(default)s)")
    t.add_argument("--hidden", type=_positive_int, default=128, help="hidden layer width (default %(default)s)")
    t.add_argument("--batch", type=_positive_int, default=256, help="points per step (default %(default)s)")
    t.add_argument("--lr", type=_positive_float, default=1e-2, help="Adam step (default 1e-2, see --lr-decay)")
    t.add_argument("--threads", type=_positive_int, default=None, help="numba threads per rank (default: cores/ranks)")
    t.add_argument("--seed", type=_nonneg_int, default=0,
                   help="seed of weights, hashes and order (default %(default)s)")
    t.add_argument("--hash", choices=("srp", "dwta"), default="srp", help="LSH family (default %(default)s)")
    t.add_argument("--k", type=_nonneg_int, default=0,
                   help="bits (srp) / WTA hashes (dwta) per table; 0 = auto (default %(default)s)")
    t.add_argument("--tables", type=_nonneg_int, default=32, help="LSH tables (default %(default)s)")
    t.add_argument("--budget", type=_positive_int, default=1024,
                   help="active output neurons per sample, all ranks (default %(default)s)")
    t.add_argument(
        "--blocks",
        type=_positive_int,
        default=8,
        help="label selection blocks; the rank count must divide it (default 8: 1, 2, 4 or 8 ranks)",
    )
    t.add_argument(
        "--batch-budget",
        type=_nonneg_int,
        default=0,
        help="one active set of N output neurons shared by each batch instead of --budget per sample (default 0: "
        "off)",
    )
    t.add_argument("--bucket-cap", type=_positive_int, default=128,
                   help="most neurons kept per LSH bucket (default %(default)s)")
    t.add_argument(
        "--lr-decay",
        type=_nonneg_float,
        default=None,
        metavar="STEPS",
        help="Adam step lr / sqrt(1 + step / STEPS); 0 = constant lr (default: the model's)",
    )
    t.add_argument(
        "--fill-power",
        type=_nonneg_float,
        default=None,
        help="random fill drawn ~ (label's target count + 1)^POWER; 0 = uniform (default: the model's)",
    )
    t.add_argument(
        "--lsh-frac",
        type=_fraction,
        default=None,
        help="at most this share of a block's active neurons from LSH, the rest random fill (default: the model's)",
    )
    t.add_argument("--read", choices=("rank0", "node"), default="rank0",
                   help="who lists and opens the training files: rank 0 (default), or the first rank of each node, "
                   "its node's own mount (a tierfs mount per node, peers=mpi: each node's share; a pass is their "
                   "union); the points go to every rank")
    t.add_argument("--checkpoint", metavar="DIR", help="write a checkpoint here after every pass (default: none)")
    t.add_argument("--resume", action="store_true", help="continue from --checkpoint DIR")
    t.add_argument("--eval-points", type=_nonneg_int, default=10_000,
                   help="test points per evaluation; 0 = all (default %(default)s)")
    t.add_argument("--eval-mode", choices=("exact", "lsh"), default="exact",
                   help="score every label (exact) or the LSH-selected ones (default %(default)s)")
    t.add_argument("--eval-every", type=_positive_int, default=1, help="evaluate every N passes (default %(default)s)")
    t.add_argument("--control", metavar="MOUNT/.tierfs/control",
                   help="write tierfs feedback after every pass (default: none)")
    t.add_argument("--progress", choices=("auto", "bar", "lines", "off"), default="auto",
                   help="rank 0's progress on stderr, per pass: a bar (a terminal), a plain line every 10 s and "
                   "one per pass (a pipe, e.g. under mpiexec), or none (default %(default)s: bar on a terminal, "
                   "else lines)")
    t.add_argument("--val", metavar="FILE",
                   help="validation file scored after every pass, the feedback's val_err (default: none)")
    t.add_argument(
        "--val-fraction",
        type=_nonneg_float,
        default=None,
        help=f"hold out this share of the training points as the validation set (default {DEFAULT_VAL_FRACTION} "
        "with --control and no --val, else 0)",
    )
    t.add_argument("--val-points", type=_positive_int, default=2000,
                   help="the most validation points scored (default %(default)s)")
    t.add_argument(
        "--feedback-score",
        choices=FEEDBACK_SCORES,
        default="val_loss",
        help="score= in the feedback line, what ARF steers by: the held-out loss (default), 1 - held-out P@1, "
        "or none (the mount's arf_weights combine loss, train_err, val_err)",
    )

    e = sub.add_parser("eval", help="P@1 and P@5 of a checkpoint (written by any rank count) on a test file")
    e.add_argument("--checkpoint", required=True, metavar="DIR", help="the checkpoint dir (required)")
    e.add_argument("--test", required=True, metavar="FILE", help="the test file (required)")
    e.add_argument("--eval-points", type=_nonneg_int, default=0, help="test points scored; 0 = all (default 0)")
    e.add_argument("--eval-mode", choices=("exact", "lsh"), default="exact",
                   help="score every label (exact) or the LSH-selected ones (default %(default)s)")
    e.add_argument("--threads", type=_positive_int, default=None, help="numba threads (default: all cores)")
    return p


def make_comm() -> Comm:
    """The communicator of this process: :class:`SerialComm` for a single process, MPI under ``mpiexec``."""
    from dslide.mpicomm import get_comm

    return get_comm()


def _cmd_gen(a: argparse.Namespace) -> int:
    from dslide.gen import Plant, write_dataset

    plant = Plant(labels_per_point=a.labels_per_point, nnz_per_point=a.nnz)
    summary = write_dataset(
        a.out, a.points, a.features, a.labels, shards=a.shards, test_points=a.test_points, seed=a.seed, plant=plant
    )
    print(json.dumps(summary))
    return 0


def _cmd_train(a: argparse.Namespace) -> int:
    from dslide.lsh import RehashSchedule
    from dslide.model import ModelConfig
    from dslide.progress import PassProgress
    from dslide.train import TrainOptions, list_train_files, run_training

    opts = TrainOptions(
        train=tuple(a.train), test=a.test, epochs=a.epochs, batch=a.batch, threads=a.threads or threads_per_rank(),
        seed=a.seed,
        eval_points=a.eval_points or None, eval_mode=a.eval_mode, eval_every=a.eval_every,
        checkpoint=a.checkpoint, resume=a.resume, val=a.val, val_fraction=_val_fraction(a), val_points=a.val_points,
        read=a.read,
    )  # fmt: skip
    comm = make_comm()
    # rank 0 alone touches the training directory (on a tierfs mount every listing and open counts)
    shared = comm.bcast(_first_header(opts.train, opts.test) if comm.rank == 0 else None)
    assert isinstance(shared, tuple)
    files, header = shared
    if not files:
        raise UsageError(f"--train {' '.join(a.train)}: no training files")
    _, n_features, n_labels = header
    extra = {"lr_decay": a.lr_decay, "fill_power": a.fill_power, "lsh_frac": a.lsh_frac}
    cfg = ModelConfig(
        n_features=n_features, n_labels=n_labels, hidden=a.hidden, budget=a.budget, blocks=a.blocks, hash=a.hash, k=a.k,
        tables=a.tables, bucket_cap=a.bucket_cap, lr=a.lr, seed=a.seed, rehash=RehashSchedule(),
        batch_budget=a.batch_budget, **{k: v for k, v in extra.items() if v is not None},
    )  # fmt: skip
    reporter = PassReporter(comm, a.control, list_train_files, a.feedback_score, per_node=a.read == "node")
    # rank 0 alone shows it; on a mount, with the mount's hit rate, slow-tier rate and stalls
    mount = a.control or (a.train[0] if len(a.train) == 1 else None)
    progress = PassProgress(mount, sys.stderr, mode=a.progress, rank=0) if comm.rank == 0 else None
    run_training(cfg, opts, comm, before_report=reporter, lister=reporter.lister, progress=progress)
    return 0


def _val_fraction(a: argparse.Namespace) -> float:
    """``--val-fraction``, or its default: a held-out split when a mount is steered and no --val file is given."""
    if a.val_fraction is not None:
        if a.val_fraction >= 1:
            raise UsageError(f"argument --val-fraction: must be in [0, 1), got {a.val_fraction}")
        return a.val_fraction
    return DEFAULT_VAL_FRACTION if a.control and not a.val else 0.0


def _first_header(train: Sequence[str], test: str | None) -> tuple[list[str], tuple[int, int, int] | None]:
    """The training files and the ``N F L`` header that sizes the model: the test file's when there is one
    (an open of a training file would count as a read of the first pass on a tierfs mount)."""
    from dslide.data import read_header
    from dslide.train import list_train_files

    files = list_train_files(train)
    if not files:
        return files, None
    return files, read_header(test if test else files[0])


def _cmd_eval(a: argparse.Namespace) -> int:
    import numba

    from dslide.checkpoint import load_model
    from dslide.data import check_shape, load_xc

    if a.threads:
        numba.set_num_threads(a.threads)
    comm = make_comm()
    model, meta = load_model(a.checkpoint, comm)
    test = load_xc(a.test)
    check_shape(test, a.test, model.cfg.n_features, model.cfg.n_labels, owner="the checkpoint")
    result = model.evaluate(test, a.eval_points or None, a.eval_mode)
    if comm.rank == 0:
        print(json.dumps({"passes": meta.get("passes"), "steps": model.step, **result}))
    return 0


@ends_job_on_failure
def main(argv: Sequence[str] | None = None) -> int:
    from dslide.checkpoint import CheckpointError
    from dslide.data import DataError

    try:
        a = build_parser().parse_args(argv)
        return {"gen": _cmd_gen, "train": _cmd_train, "eval": _cmd_eval}[a.command](a)
    except UsageError as e:
        print(f"dslide: error: {e}", file=sys.stderr)
        return 2
    except (DataError, CheckpointError, OSError) as e:
        print(f"dslide: {e}", file=sys.stderr)
        return 1
    except ValueError as e:  # a bad option value caught by a config's validation
        print(f"dslide: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
