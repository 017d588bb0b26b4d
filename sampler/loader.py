"""A mini-epoch sampler for PyTorch-style data loaders, without importing PyTorch.

API
---
``MiniEpochSampler(data, *, nm=None, budget=None, rf=1, seed=0, composition="random", groups=None, order=None,
rank=0, world_size=1)``
    ``data`` is the array of file sizes (or an int ``n``: n files of size 1, so ``budget`` counts files).
    Iterating yields this rank's indices for the current epoch: mini-epoch after mini-epoch (``plan_epoch``),
    each served ``rf`` times in a fresh order per pass (``serving_order``).  ``len()`` is the number of indices
    one epoch yields.  Pass it as ``sampler=`` to ``torch.utils.data.DataLoader`` (PyTorch only needs
    ``__iter__`` and ``__len__``) or iterate it yourself.
``set_epoch(epoch)``
    Like ``DistributedSampler.set_epoch``: call before each epoch; the plan is a function of (seed, epoch).
``state_dict(consumed=None) -> dict`` / ``load_state_dict(state)``
    Deterministic mid-epoch resume: the state holds the epoch and how many indices were consumed (by default the
    number yielded so far; with ``num_workers > 0`` the loader prefetches, so pass ``consumed = batches_done *
    batch_size``).  After ``load_state_dict`` the next iteration continues exactly where the saved one stopped,
    without replaying the skipped part.  Loading a state saved with different settings raises ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from sampler.plan import plan_epoch, serving_order

__all__ = ["MiniEpochSampler"]


class MiniEpochSampler:
    """Indices of mini-epoch training for one rank; see the module docstring."""

    def __init__(
        self,
        data: np.ndarray | int,
        *,
        nm: int | None = None,
        budget: int | None = None,
        rf: int = 1,
        seed: int = 0,
        composition: str = "random",
        groups: np.ndarray | None = None,
        order: np.ndarray | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if isinstance(data, (int, np.integer)) and not isinstance(data, bool):
            if data < 0:
                raise ValueError(f"data must be an array of sizes or a file count >= 0, got {data!r}")
            sizes = np.ones(int(data), dtype=np.int64)
        else:
            sizes = np.asarray(data)
        if isinstance(rf, bool) or not isinstance(rf, (int, np.integer)) or rf < 1:
            raise ValueError(f"rf must be an integer >= 1, got {rf!r}")
        self._kwargs: dict[str, Any] = dict(
            nm=nm,
            budget=budget,
            composition=composition,
            groups=groups,
            order=order,
            rank=rank,
            world_size=world_size,
        )
        self.sizes = sizes
        self.seed = seed
        self.rf = int(rf)
        self.epoch = 0
        self._plan = self._make_plan(0)  # validates every argument now, not at the first iteration
        self._yielded = 0
        self._resume_at = 0

    def _make_plan(self, epoch: int) -> list[np.ndarray]:
        return plan_epoch(self.sizes, seed=self.seed, epoch=epoch, **self._kwargs)

    def set_epoch(self, epoch: int) -> None:
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self._plan = self._make_plan(self.epoch)
        self._resume_at = 0

    @property
    def plan(self) -> list[np.ndarray]:
        """This rank's mini-epochs of the current epoch."""
        return self._plan

    def __len__(self) -> int:
        return self.rf * sum(len(me) for me in self._plan)

    def __iter__(self) -> Iterator[int]:
        skip = self._resume_at
        self._resume_at = 0
        self._yielded = skip
        for j, me in enumerate(self._plan):
            for p in range(self.rf):
                if skip >= len(me):  # a whole pass already consumed: skip it without computing its order
                    skip -= len(me)
                    continue
                served = serving_order(me, seed=self.seed, epoch=self.epoch, mini_epoch=j, pass_index=p)
                for idx in served[skip:].tolist():
                    self._yielded += 1
                    yield idx
                skip = 0

    def _fingerprint(self) -> dict[str, Any]:
        kw = self._kwargs
        return {
            "n": int(self.sizes.shape[0]),
            "bytes": int(self.sizes.sum()) if self.sizes.size else 0,
            "seed": self.seed,
            "rf": self.rf,
            "nm": kw["nm"],
            "budget": kw["budget"],
            "composition": kw["composition"],
            "rank": kw["rank"],
            "world_size": kw["world_size"],
        }

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        if consumed is None:
            consumed = self._yielded
        if isinstance(consumed, bool) or not isinstance(consumed, (int, np.integer)) or not 0 <= consumed <= len(self):
            raise ValueError(f"consumed must be an integer in [0, {len(self)}], got {consumed!r}")
        return {"epoch": self.epoch, "consumed": int(consumed), "config": self._fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            epoch, consumed, config = state["epoch"], state["consumed"], state["config"]
        except (KeyError, TypeError):
            raise ValueError(f"state must hold epoch, consumed and config, got {state!r}") from None
        if config != self._fingerprint():
            raise ValueError(
                f"state was saved with other settings: {config!r}, this sampler has {self._fingerprint()!r}"
            )
        self.set_epoch(epoch)
        if isinstance(consumed, bool) or not isinstance(consumed, int) or not 0 <= consumed <= len(self):
            raise ValueError(f"state consumed must be an integer in [0, {len(self)}], got {consumed!r}")
        self._resume_at = consumed
        self._yielded = consumed
