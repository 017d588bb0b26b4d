"""``dslide train`` with its training file list built once, before the pass loop, the way PyTorch training scripts
build their dataset: the ``sampler`` and ``substitute`` loaders of benchmarks/convergence.py (issue 23).

    python benchmarks/built_once_train.py sampler|names -- <dslide train arguments>

dslide itself re-lists its training directories at every pass (``dslide.train.list_train_files``, the lister
``run_training`` calls per pass), which is what makes it follow a tierfs mount's view.  Here the list is made
once, at dslide's first call, over a ``listing=all`` mount (every file); each pass then trains on

* ``sampler``: the files of the current tierfs pass, the indices :class:`tierfs.torch.MountSampler` yields over
  the list built once (one dslide pass = one tierfs pass, as one ``DataLoader`` epoch is);
* ``names``: every file of the list, every pass -- a loader built once and left unchanged; on a mount with
  ``substitute`` each name is served as a file of the current view in its directory.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dslide.train
from dslide.cli import main as dslide_main


class BuiltOnce:
    """A lister for dslide: lists once with ``list_files``, then serves each pass from that one list."""

    def __init__(self, mode: str, list_files: Callable[[Sequence[str]], list[str]]) -> None:
        if mode not in ("sampler", "names"):
            raise ValueError(f"mode must be 'sampler' or 'names', got {mode!r}")
        self.mode = mode
        self._list_files = list_files
        self.files: list[str] | None = None
        self.sampler = None

    def __call__(self, specs: Sequence[str]) -> list[str]:
        if self.files is None:  # the first call (dslide's header check): the dataset is built here, once
            self.files = self._list_files(specs)
            if self.mode == "sampler":
                from tierfs.torch import MountSampler

                self.sampler = MountSampler(self.files)
            return self.files
        if self.sampler is None:
            return self.files
        return [self.files[i] for i in self.sampler]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[1] != "--":
        print("usage: built_once_train.py sampler|names -- <dslide train arguments>", file=sys.stderr)
        return 2
    # dslide's command line offers no other lister (a list built once is not a dslide feature): its per-pass
    # lister is swapped here, before dslide's train command looks it up
    dslide.train.list_train_files = BuiltOnce(args[0], dslide.train.list_train_files)
    return dslide_main(["train", *args[2:]])


if __name__ == "__main__":
    raise SystemExit(main())
