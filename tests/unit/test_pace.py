"""The remedies a slow tier is shown with (tierfs.daemon.schedule.pace_watch): the IO model's rf first, then what else
would do."""

from __future__ import annotations

from tierfs.daemon.schedule.pace_watch import Rates, remedies


def _rates(**kw) -> Rates:
    base = dict(staging_bytes_per_s=1000.0, consumption_bytes_per_s=5000.0, rf=2, rf_setting=2, rf_max=6,
                bandwidth=0, capacity=1 << 30, dataset_bytes=1 << 20)
    return Rates(**{**base, **kw})


def test_an_rf_within_the_ceiling_is_the_first_remedy():
    r = _rates()
    assert r.rf_needed == 5
    fix = remedies(r)
    assert fix.startswith("rf=5 (within rf_max=6), a faster slow tier, or accept the stalls")
    assert "capacity" not in fix  # the cache already holds the data set twice over


def test_past_the_ceiling_both_are_named_and_auto_needs_only_the_ceiling():
    assert remedies(_rates(consumption_bytes_per_s=20_000.0)).startswith("rf_max=20 and rf=20 (more repetition")
    assert remedies(_rates(rf_setting="auto", rf=6, consumption_bytes_per_s=20_000.0)).startswith("rf_max=20 (")


def test_a_bandwidth_cap_and_a_small_cache_are_named_with_their_figures():
    fix = remedies(_rates(bandwidth=1 << 20, capacity=1 << 20, dataset_bytes=3 << 20))
    assert "a larger bandwidth cap (now 1M/s)" in fix and "capacity >= 6M with nm=1" in fix


def test_no_rates_yet_no_rf_remedy():
    r = _rates(staging_bytes_per_s=0.0)
    assert r.rf_needed is None and remedies(r).startswith("a faster slow tier")
