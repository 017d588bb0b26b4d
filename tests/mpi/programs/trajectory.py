"""Train a small SlideModel for a few steps on generated data; rank 0 prints the per-step losses as JSON.

``python trajectory.py STEPS BUDGET [SEED_BY_RANK [BATCH_BUDGET]]`` (``BATCH_BUDGET`` > 0: one active set shared
by each batch, ``ModelConfig.batch_budget``).  Run alone (SerialComm) or under ``mpiexec -n P``
(MpiComm): with one thread per rank the model's random choices do not depend on P (selection blocks), so the
trajectories must agree to float rounding (sums over ranks happen in another order) at any budget.
``SEED_BY_RANK=1`` gives every rank its own seed -- the per-rank seeding that made P matter -- to show the
comparison notices it.
"""

from __future__ import annotations

import json
import sys

import numba
import numpy as np

from dslide.gen import generate
from dslide.model import ModelConfig, SlideModel
from dslide.mpicomm import abort_on_failure, get_comm

F, L, H, BATCH = 400, 128, 16, 32


def main(steps: int, budget: int, seed_by_rank: bool, batch_budget: int = 0) -> None:
    comm = get_comm()
    numba.set_num_threads(1)
    data = generate(steps * BATCH // 2, F, L, seed=3)
    model = SlideModel(ModelConfig(n_features=F, n_labels=L, hidden=H, budget=budget, tables=4, blocks=4,
                                   seed=7 + (comm.rank if seed_by_rank else 0), batch_budget=batch_budget),
                        comm)  # fmt: skip
    losses, top, before = [], [], comm.bytes_sent
    for i in range(steps):
        rows = np.random.default_rng((11, i)).choice(len(data), BATCH, replace=False)
        res = model.train_step(data, rows)
        losses.append(res.loss_sum / res.n_labelled)
        top.append(res.n_top_label)
    step_bytes = (comm.bytes_sent - before) / steps
    ev = model.evaluate(data, 200)
    if comm.rank == 0:
        print(
            json.dumps(
                {
                    "size": comm.size,
                    "losses": losses,
                    "p_at_1": ev["p_at_1"],
                    "step_bytes": step_bytes,
                    "budget_local": model.budget_local,
                    "top_label": top,
                }
            )
        )


if __name__ == "__main__":
    with abort_on_failure(get_comm()):
        main(int(sys.argv[1]), int(sys.argv[2]), len(sys.argv) > 3 and sys.argv[3] == "1",
             int(sys.argv[4]) if len(sys.argv) > 4 else 0)  # fmt: skip
