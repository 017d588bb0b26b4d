"""Issue 6 item 4: with fixed seeds and one thread per rank, P = 1, 2 and 4 follow the same loss trajectory.

The budget (16 active neurons per sample) is far below the label count (128), so every step really samples:
LSH candidates and random fill.  The random choices do not depend on P because they are made per selection
block (4 blocks of 32 labels, 4 active each), keyed by (seed, block, step, sample), whichever rank owns the
block; only the order of the sums over ranks differs, so the trajectories agree to float rounding.  A run whose
ranks seed their choices by rank (what the trainer did before selection blocks) must fall outside the
tolerance, and a P-rank run repeats bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dslide.mpirun import job_env, run_mpi

PROGRAM = Path(__file__).parent / "programs" / "trajectory.py"
STEPS, LABELS, BUDGET = 25, 128, 16
RTOL = 1e-6  # float32 sums in another order; a different active set moves the loss by ~1e-3 or more


def trajectory(size: int, budget: int = BUDGET, seed_by_rank: bool = False, batch_budget: int = 0) -> dict:
    argv = [PROGRAM, STEPS, budget, int(seed_by_rank), batch_budget]
    if size == 1:  # a plain process: SerialComm, no MPI at all
        out = subprocess.run([sys.executable, *map(str, argv)], env=job_env(),
                             capture_output=True, text=True, timeout=120, check=True).stdout  # fmt: skip
    else:
        result = run_mpi(size, argv, timeout=120)
        assert not result.timed_out and result.returncode == 0, result.stderr[-2000:]
        out = result.stdout
    report = json.loads(out.strip().splitlines()[-1])
    assert report["size"] == size
    return report


@pytest.fixture(scope="module")
def sampled_runs():
    return {size: trajectory(size) for size in (1, 2, 4)}


@pytest.mark.parametrize("size", [2, 4])
def test_p_ranks_follow_the_one_process_trajectory(sampled_runs, size):
    serial, parallel = sampled_runs[1], sampled_runs[size]
    assert serial["budget_local"] == BUDGET < LABELS // 4  # real sampling, not the exact softmax
    assert parallel["budget_local"] * size == BUDGET  # every rank selects the same number of neurons
    np.testing.assert_allclose(parallel["losses"], serial["losses"], rtol=RTOL, atol=0)
    assert parallel["top_label"] == serial["top_label"]  # train_err's counts: the same active sets
    assert parallel["p_at_1"] == serial["p_at_1"]
    assert serial["step_bytes"] == 0 and parallel["step_bytes"] > 0


def test_a_batch_shared_active_set_follows_the_one_process_trajectory(sampled_runs):
    """With ``batch_budget`` (one active set per batch, 16 of each block's 32 labels) the blocks choose the same
    neurons on any P as well; the logits and gradients are BLAS products over each rank's columns."""
    serial, parallel = trajectory(1, batch_budget=64), trajectory(2, batch_budget=64)
    np.testing.assert_allclose(parallel["losses"], serial["losses"], rtol=RTOL, atol=0)
    assert parallel["top_label"] == serial["top_label"] and parallel["p_at_1"] == serial["p_at_1"]
    assert serial["losses"][-1] < serial["losses"][0]
    assert not np.allclose(serial["losses"], sampled_runs[1]["losses"], rtol=1e-3)  # not the per-sample one


def test_the_trajectory_moves(sampled_runs):
    losses = sampled_runs[1]["losses"]
    assert len(losses) == STEPS and losses[-1] < losses[0]


def test_per_rank_seeding_would_be_noticed(sampled_runs):
    per_rank = trajectory(2, seed_by_rank=True)
    assert not np.allclose(per_rank["losses"], sampled_runs[1]["losses"], rtol=RTOL, atol=0)


def test_a_sampled_run_repeats_bit_for_bit(sampled_runs):
    assert trajectory(2)["losses"] == sampled_runs[2]["losses"]
