"""The option table: sizes, KEY=VALUE parsing, validation, and the settings round trip."""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tierfs.common.options import (
    OPTIONS,
    MountConfig,
    Settings,
    apply_assignments,
    check_layout,
    format_size,
    parse_assignments,
    parse_size,
    parse_value,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0", 0), ("4096", 4096), ("1K", 1024), ("1k", 1024), ("20G", 20 << 30), ("1.5M", 3 << 19),
     ("2T", 2 << 40), ("512MiB", 512 << 20), ("10MB", 10 << 20), (" 3 G ", 3 << 30), (".5K", 512)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "G", "1Q", "1.2.3", "ten", "1 G B B", "nan", "-", "-x"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


@given(st.integers(min_value=0, max_value=1 << 45))
def test_format_size_round_trips_within_rounding(n):
    back = parse_size(format_size(n))
    assert abs(back - n) <= max(1, n * 0.05)


def test_parse_assignments_separators_and_weights():
    items = parse_assignments("rf=8 nm=4\narf_weights=1,0.5,0,composition=stratified\n# comment\n\nallow_other")
    assert items == [("rf", "8"), ("nm", "4"), ("arf_weights", "1,0.5,0"), ("composition", "stratified"),
                     ("allow_other", "")]


def test_parse_assignments_dashes_become_underscores():
    assert parse_assignments("arf-wait=3") == [("arf_wait", "3")]


@pytest.mark.parametrize(
    ("text", "expected"),
    [(" rf = 5 ", [("rf", "5")]),  # what `echo " rf = 5 " > .tierfs/control` writes
     ("rf =8  nm= 4", [("rf", "8"), ("nm", "4")]),
     ("arf_weights = 1, 0.5,0", [("arf_weights", "1,0.5,0")]),
     ("mini_epoch_size= nm=4", [("mini_epoch_size", ""), ("nm", "4")]),  # an empty value, then the next item
     ("mini_epoch_size = nm = 4", [("mini_epoch_size", ""), ("nm", "4")])],
)
def test_blanks_around_equals_are_not_separators(text, expected):
    assert parse_assignments(text) == expected


def test_a_negative_size_says_so():
    for text in ("-5G", "-1", " -0.5K"):
        with pytest.raises(ValueError, match=re.escape(f"must not be negative, got '{text}'")):
            parse_size(text)
    with pytest.raises(ValueError, match=r"^capacity: must not be negative, got '-5G'$"):
        MountConfig.from_options("b", "m", {"cache": "c", "capacity": "-5G"})


def test_non_numbers_do_not_continue_weights():
    items = parse_assignments("arf_weights=1,2,3,x-systemd.automount")
    assert items == [("arf_weights", "1,2,3"), ("x_systemd.automount", "")]


@pytest.mark.parametrize(
    ("key", "text", "message"),
    [("rf", "0", "rf: must be >= 1, got 0"), ("rf", "x", "rf: expected an integer"),
     ("composition", "bogus", "composition: expected one of random, stratified, contiguous, reservoir"),
     ("arf_k", "-1", "arf_k: must be a positive number"), ("arf_k", "inf", "arf_k: must be a positive"),
     ("arf_weights", "1,2", "arf_weights: expected three"), ("arf_weights", "0,0,0", "not all 0"),
     ("bandwidth", "fast", "bandwidth: not a size"), ("nope", "1", "unknown key 'nope'")],
)
def test_parse_value_names_key_and_value(key, text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        parse_value(key, text)


def test_rf_auto_and_sizes():
    assert parse_value("rf", "auto") == "auto"
    assert parse_value("bandwidth", "25M") == 25 << 20
    assert parse_value("mini_epoch_size", "none") is None


def test_control_writes_refuse_mount_time_options():
    s = Settings()
    for key in ("seed", "policy", "view", "rank", "world_size", "verify", "allow_other", "log_level"):
        with pytest.raises(ValueError, match=f"{key} is fixed at mount time"):
            apply_assignments(s, [(key, "1")], live_only=True)
    for key in ("cache", "backing", "mountpoint", "capacity"):
        with pytest.raises(ValueError, match=f"{key} cannot be changed while mounted"):
            apply_assignments(s, [(key, "/x")], live_only=True)


def test_a_bad_item_changes_nothing():
    s = Settings()
    with pytest.raises(ValueError):
        apply_assignments(s, [("rf", "8"), ("nm", "0")], live_only=True)
    assert s == Settings()


def test_rank_must_be_below_world_size():
    with pytest.raises(ValueError, match="rank must be < world_size"):
        apply_assignments(Settings(), [("rank", "2"), ("world_size", "2")], live_only=False)


def test_lru_policy_serves_the_full_view():
    assert apply_assignments(Settings(), [("policy", "lru")], live_only=False).view == "full"


def test_mount_config_requires_cache_and_capacity():
    with pytest.raises(ValueError, match="missing required options: cache, capacity"):
        MountConfig.from_options("/b", "/m", {})
    with pytest.raises(ValueError, match="capacity: not a size"):
        MountConfig.from_options("/b", "/m", {"cache": "/c", "capacity": "lots"})
    with pytest.raises(ValueError, match="capacity must be > 0"):
        MountConfig.from_options("/b", "/m", {"cache": "/c", "capacity": "0"})
    c = MountConfig.from_options("/b", "/m", {"cache": "/c", "capacity": "2G", "rf": "auto", "nm": "16"})
    assert (c.capacity, c.settings.rf, c.settings.nm) == (2 << 30, "auto", 16)


settings_strategy = st.builds(
    Settings,
    rf=st.one_of(st.just("auto"), st.integers(1, 1000)),
    nm=st.integers(1, 10_000),
    mini_epoch_size=st.one_of(st.none(), st.integers(1, 1 << 40)),
    composition=st.sampled_from(["random", "stratified", "contiguous", "reservoir"]),
    arf=st.sampled_from(["off", "score", "bollinger"]),
    arf_wait=st.integers(1, 100),
    arf_window=st.integers(2, 100),
    arf_k=st.floats(0.125, 8, allow_nan=False).map(lambda x: round(x, 3)),
    arf_weights=st.tuples(*[st.integers(0, 9).map(float)] * 3).filter(any),
    advance=st.sampled_from(["ready", "strict"]),
    bandwidth=st.integers(0, 1 << 40),
    seed=st.integers(0, 2**32),
    verify=st.sampled_from(["size-mtime", "xxhash"]),
    allow_other=st.booleans(),
)


@given(settings_strategy)
def test_settings_lines_round_trip(s):
    """What reading the control file prints can be written back and means the same settings."""
    back = apply_assignments(Settings(), parse_assignments(s.as_lines()), live_only=False)
    assert back == s


def test_every_option_is_a_setting():
    assert set(OPTIONS) == {f.name for f in dataclasses.fields(Settings)}


@pytest.mark.parametrize(("backing", "cache", "mountpoint", "refused"), [
    ("/data", "/data/cache", "/mnt", "cache dir /data/cache must not be inside the backing dir /data"),
    ("/data", "/c", "/data/mnt", "mountpoint /data/mnt and backing dir /data must not contain each other"),
    ("/mnt/data", "/c", "/mnt", "mountpoint /mnt and backing dir /mnt/data must not contain each other"),
    ("/data", "/mnt/c", "/mnt", "cache dir /mnt/c and mountpoint /mnt must not contain each other"),
    ("/data", "/c", "/c/mnt", "cache dir /c and mountpoint /c/mnt must not contain each other"),
    ("/", "/c", "", "cache dir /c must not be inside the backing dir /"),
])
def test_the_one_layout_check_refuses_dirs_that_nest(backing, cache, mountpoint, refused):
    with pytest.raises(ValueError, match=f"^{re.escape(refused)}"):
        check_layout(backing, cache, mountpoint)


def test_the_layout_check_takes_siblings_and_prefixes_that_are_not_parents():
    check_layout("/data", "/data-cache", "/data-mnt")
    check_layout("/data", "/c", "")  # (an engine without a mount)
