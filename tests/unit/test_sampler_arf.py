"""sampler.arf: the controllers' decisions, history and errors."""

from __future__ import annotations

import json

import pytest

from sampler.arf import HISTORY_KEPT, MODES, make_controller, parse_weights
from sampler.iomodel import stall_free_rf


def test_off_never_advances_and_needs_no_metrics():
    c = make_controller("off")
    assert [c.observe({}) for _ in range(50)] == ["continue"] * 50
    assert c.score is None
    assert c.history[-1] == {"mini_epoch": 0, "pass": 50, "score": None, "decision": "continue"}


def test_fixed_advances_after_rf_passes_every_mini_epoch():
    c = make_controller("fixed", rf=3)
    for _ in range(3):
        assert [c.observe({"loss": 1.0}) for _ in range(3)] == ["continue", "continue", "advance"]
        c.new_mini_epoch()
    assert [h["mini_epoch"] for h in c.history] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert c.score == 1.0


def test_score_advances_after_wait_passes_without_improvement():
    c = make_controller("score", wait=2, weights=(1.0, 0.0, 0.0))
    losses = [1.0, 0.9, 0.95, 0.85, 0.9, 0.9]
    assert [c.observe({"loss": x}) for x in losses] == [
        "continue",
        "continue",
        "continue",
        "continue",
        "continue",
        "advance",
    ]
    assert c.history[-1]["best"] == 0.85 and c.history[-1]["wait"] == 2


def test_score_state_is_per_mini_epoch():
    c = make_controller("score", wait=1)
    assert c.observe({"score": 0.5}) == "continue"
    assert c.observe({"score": 0.6}) == "advance"
    c.new_mini_epoch()
    # a worse score on fresh data is the new mini-epoch's first, not a failure to improve
    assert c.observe({"score": 0.9}) == "continue"
    assert c.history[-1]["mini_epoch"] == 1


def test_score_is_the_weighted_sum_unless_given():
    c = make_controller("score", weights=(1.0, 2.0, 3.0))
    c.observe({"loss": 1.0, "train_err": 0.5, "val_err": 0.25})
    assert c.score == pytest.approx(1.0 + 1.0 + 0.75)
    c.observe({"loss": 1.0, "val_err": 0.5})  # missing metrics are left out
    assert c.score == pytest.approx(2.5)
    c.observe({"loss": 9.0, "score": 0.1})  # an explicit score overrides
    assert c.score == 0.1


def test_bollinger_advances_when_a_repeat_rises_above_the_mini_epochs_best_by_k_times_the_normal_movement():
    c = make_controller("bollinger", window=4, k=2.0)
    # first mini-epoch: changes -0.1, +0.05, -0.05, +0.1 fill the window (RMS 0.0791); no band before that
    assert [c.observe({"score": s}) for s in (1.0, 0.9, 0.95, 0.9, 1.0)] == ["continue"] * 5
    assert c.history[-1]["upper"] is None and c.history[-1]["best"] == 0.9
    assert c.observe({"score": 1.05}) == "continue"  # within best 0.9 + 2 x 0.0791
    assert c.history[-1]["sigma"] == pytest.approx(0.0790569, abs=1e-6)
    assert c.history[-1]["upper"] == pytest.approx(0.9 + 2 * 0.0790569, abs=1e-6)
    assert c.observe({"score": 1.3}) == "advance"  # repeating made it measurably worse
    # a fresh mini-epoch: its first pass sets the baseline and never advances, however far it moved
    c.new_mini_epoch()
    assert c.observe({"score": 5.0}) == "continue"
    assert c.observe({"score": 0.2}) == "continue"  # better than the best: never a reason to advance
    assert c.observe({"score": 0.25}) == "continue"
    assert c.observe({"score": 9.0}) == "advance"


def test_bollinger_keeps_repeating_a_mini_epoch_that_still_helps_and_leaves_one_that_overfits():
    # held-out losses measured with dslide through tierfs (docs/benchmarks.md): the paper's rule left the
    # fresh mini-epoch after one pass (its drop is below the band) and repeated the over-fitting one to rf
    helps = [8.871, 8.848, 8.798, 8.715, 8.686, 8.667, 8.655, 8.653]
    overfits = [8.636, 8.644, 8.788, 8.939, 9.068, 9.133, 9.115, 9.059]
    c = make_controller("bollinger", window=5, k=2.0)
    for s in helps:  # fills the window
        assert c.observe({"score": s}) == "continue"
    c.new_mini_epoch()
    decisions = [c.observe({"score": s}) for s in overfits]
    assert decisions[:2] == ["continue"] * 2 and "advance" in decisions[2:4], decisions
    c.new_mini_epoch()
    assert [c.observe({"score": s}) for s in helps] == ["continue"] * len(helps)


def test_new_mini_epoch_can_name_the_index():
    c = make_controller("score")
    c.new_mini_epoch(7)
    c.observe({"score": 1.0})
    c.new_mini_epoch()
    c.observe({"score": 1.0})
    assert [h["mini_epoch"] for h in c.history] == [7, 8]
    with pytest.raises(ValueError, match="mini_epoch must"):
        c.new_mini_epoch(-1)


def test_numpy_weights_are_accepted():
    import numpy as np

    c = make_controller("score", weights=tuple(np.array([1.0, 0.5, 0.0], dtype=np.float32)))
    c.observe({"loss": 2.0, "train_err": 1.0})
    assert c.score == 2.5


def test_history_is_json_ready():
    for mode in MODES:
        c = make_controller(mode, rf=2)
        c.observe({"loss": 1.0, "train_err": 0.1, "val_err": 0.2})
        json.dumps(c.history)


@pytest.mark.parametrize(
    ("staging", "consumption", "rf"),
    [(100.0, 400.0, 4), (100.0, 401.0, 5), (100.0, 50.0, 1), (100.0, 0.0, 1), (400.0, 3.8 * 1024, 10), (0.1, 0.3, 3)],
)
def test_stall_free_rf_from_measured_rates(staging, consumption, rf):
    # what rf=auto uses: (consumption, staging), the iomodel's one order (auto_rf's reversed one is gone)
    assert stall_free_rf(consumption, staging) == rf


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: make_controller("magic"), "mode must be one of"),
        (lambda: make_controller("fixed", rf=0), "rf must"),
        (lambda: make_controller("score", wait=0), "wait must"),
        (lambda: make_controller("bollinger", window=1), "window must"),
        (lambda: make_controller("bollinger", k=-1.0), "k must"),
        (lambda: make_controller("bollinger", k=float("nan")), "k must"),
        (lambda: make_controller("score", weights=(1.0, 2.0)), "weights must"),
        (lambda: make_controller("score").observe({}), "metrics must hold"),
        (lambda: make_controller("score").observe({"loss": "x"}), "loss must be a number"),
        (lambda: make_controller("score").observe({"val_err": float("inf")}), "val_err must be finite"),
        (lambda: make_controller("off").observe({"score": None}), "score must be a number"),
        (lambda: stall_free_rf(1.0, 0.0), "staging must"),
        (lambda: stall_free_rf(-1.0, 1.0), "consumption must"),
        (lambda: parse_weights("1,2"), "weights must"),
        (lambda: parse_weights("1,a,2"), "weights must"),
    ],
)
def test_bad_arguments(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_parse_weights():
    assert parse_weights(" 1, 0.5 ,0") == (1.0, 0.5, 0.0)


@pytest.mark.parametrize("mode", MODES)
def test_history_keeps_only_the_newest_observations(mode):
    # Whoever writes feedback decides how many observations come (a flood grew the daemon by 650 MB: issue
    # 46, 7): the history keeps the last HISTORY_KEPT, and the decisions are those of an untrimmed controller.
    c = make_controller(mode, rf=3, wait=2, window=2)
    twin = make_controller(mode, rf=3, wait=2, window=2)
    twin_history = []
    n = 2 * HISTORY_KEPT + 7
    for i in range(n):
        if i % 5 == 0:
            c.new_mini_epoch()
            twin.new_mini_epoch()
        metrics = {"loss": 1.0 + (i * 7919 % 13) / 10}
        assert c.observe(metrics) == twin.observe(metrics)
        twin_history.append(twin.history[-1])
        assert len(c.history) <= HISTORY_KEPT
    assert len(c.history) == HISTORY_KEPT
    assert c.history == twin_history[-HISTORY_KEPT:]
    json.dumps(c.history)
