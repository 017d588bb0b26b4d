"""Train a small SlideModel for a few steps on generated data; rank 0 prints the per-step losses as JSON.

``python trajectory.py STEPS BUDGET``.  Run alone (SerialComm) or under ``mpiexec -n P`` (MpiComm): with one
thread per rank and a budget that covers every label, the model's computation does not depend on P, so the
trajectories must agree to float rounding (sums over ranks happen in another order).
"""

from __future__ import annotations

import json
import sys

import numba
import numpy as np

from dslide.gen import generate
from dslide.model import ModelConfig, SlideModel
from dslide.mpicomm import abort_on_failure, get_comm

F, L, H, BATCH = 400, 64, 16, 32


def main(steps: int, budget: int) -> None:
    comm = get_comm()
    numba.set_num_threads(1)
    data = generate(steps * BATCH // 2, F, L, seed=3)
    model = SlideModel(ModelConfig(n_features=F, n_labels=L, hidden=H, budget=budget, tables=4, seed=7), comm)
    losses, before = [], comm.bytes_sent
    for i in range(steps):
        rows = np.random.default_rng((11, i)).choice(len(data), BATCH, replace=False)
        res = model.train_step(data, rows)
        losses.append(res.loss_sum / res.n_labelled)
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
                }
            )
        )


if __name__ == "__main__":
    with abort_on_failure(get_comm()):
        main(int(sys.argv[1]), int(sys.argv[2]))
