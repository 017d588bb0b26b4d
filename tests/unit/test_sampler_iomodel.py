"""sampler.iomodel: Eq. (1), the stall-free rf, double buffering, and the paper's DeepCAM figure."""

from __future__ import annotations

import pytest

from sampler.iomodel import (
    DEEPCAM,
    average_backing_bandwidth,
    mini_epoch_budget,
    mini_epochs_needed,
    stall_free_rf,
    training_throughput,
)


def test_deepcam_baseline_and_met_128_128():
    """MET paper §IV-C: the baseline reads 400 GB/s; (nm, rf) = (128, 128) brings EB2 down to 30.4 GB/s."""
    d = DEEPCAM
    baseline = average_backing_bandwidth([1.0], [1], demand=d.demand_gb_s, b2=d.b2_gb_s)
    assert baseline == pytest.approx(400.0)
    met = average_backing_bandwidth([1.0] * 128, [128] * 128, demand=d.demand_gb_s, b2=d.b2_gb_s)
    assert round(met, 1) == 30.4


def test_deepcam_rf_10_removes_the_io_bottleneck():
    """Fig. 12a: with fixed rf >= 10 training reaches the 65,000 samples/s peak; below it IO throttles."""
    d = DEEPCAM
    kw = dict(demand=d.demand_gb_s, b2=d.b2_gb_s, peak=d.peak_samples_per_s)
    assert training_throughput(10, **kw) == d.peak_samples_per_s
    assert training_throughput(9, **kw) < d.peak_samples_per_s
    assert training_throughput(1, **kw) == pytest.approx(65_000 * 400 / (3.8 * 1024))
    assert stall_free_rf(d.demand_gb_s, d.b2_gb_s) == 10


def test_eq1_weights_mini_epochs_by_time():
    # one stalled mini-epoch (rf 1 -> capped at B2) and one cached (rf 10 -> demand/10)
    eb2 = average_backing_bandwidth([1.0, 3.0], [1, 10], demand=1000.0, b2=400.0)
    assert eb2 == pytest.approx((400.0 + 3 * 100.0) / 4)


def test_double_buffering():
    assert mini_epoch_budget(100) == 50
    assert mini_epochs_needed(1000, 100) == 20
    assert mini_epochs_needed(1001, 100) == 21
    assert mini_epochs_needed(0, 100) == 1


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: average_backing_bandwidth([1.0], [1.0, 2.0], demand=1, b2=1), "same length"),
        (lambda: average_backing_bandwidth([], [], demand=1, b2=1), "times must not be empty"),
        (lambda: average_backing_bandwidth([0.0], [1.0], demand=1, b2=1), "times must not all be zero"),
        (lambda: average_backing_bandwidth([-1.0], [1.0], demand=1, b2=1), r"times\[0\]"),
        (lambda: average_backing_bandwidth([1.0], [0.0], demand=1, b2=1), r"rfs\[0\]"),
        (lambda: average_backing_bandwidth([1.0], [1.0], demand=0, b2=1), "demand"),
        (lambda: average_backing_bandwidth([1.0], [1.0], demand=1, b2=float("nan")), "b2"),
        (lambda: training_throughput(0, demand=1, b2=1, peak=1), "rf"),
        (lambda: training_throughput(1, demand=1, b2=1, peak="x"), "peak must be a number"),
        (lambda: stall_free_rf(1.0, 0.0), "staging"),
        (lambda: mini_epoch_budget(1), "usable_fast_bytes"),
        (lambda: mini_epoch_budget(10.0), "usable_fast_bytes"),
        (lambda: mini_epochs_needed(-1, 10), "dataset_bytes"),
    ],
)
def test_bad_arguments(call, name):
    with pytest.raises(ValueError, match=name):
        call()
