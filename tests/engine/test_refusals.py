"""Configurations that cannot work are refused at open (and through the control file) with the value that
would work, and that value does work."""

from __future__ import annotations

import re

import pytest

from tierfs.common.options import parse_size


def test_nm_above_the_file_count_is_refused_with_the_most_that_works(open_engine):
    with pytest.raises(ValueError, match=r"^nm=100 is more mini-epochs than the data set has files: use at most 32$"):
        open_engine(capacity=1 << 20, nm=100)
    e = open_engine(capacity=1 << 20, nm=32)  # the value named works
    assert len(e.schedule.plan(0)) == 32
    with pytest.raises(ValueError, match=r"use at most 32$"):  # a live change is refused the same way
        e.control_write(b"nm=33\n")
    assert e.settings.nm == 32


@pytest.mark.parametrize("nm", [1, 4])
def test_a_capacity_too_small_is_refused_with_one_that_works(open_engine, dataset, tmp_path, nm):
    _, files = dataset
    for i, capacity in enumerate((max(files.values()), sum(files.values()) // (2 * nm))):
        with pytest.raises(ValueError) as err:
            open_engine(capacity=capacity, nm=nm, cache=tmp_path / f"cache{i}")
        found = re.search(r"(?:use at least|capacity >=) ([0-9.]+[KMGT]?)$", str(err.value))
        assert found, str(err.value)
        e = open_engine(capacity=parse_size(found.group(1)), nm=nm, cache=tmp_path / f"cache{i}")  # it fits
        assert e.cache.capacity == parse_size(found.group(1))
