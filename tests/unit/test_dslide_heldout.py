"""dslide.heldout: the held-out split ARF's val_err comes from (no training, no mount)."""

from __future__ import annotations

import numpy as np
import pytest

from dslide.gen import generate
from dslide.heldout import HeldOut, point_keys


def test_keys_depend_on_the_file_name_and_seed_not_on_the_directory():
    a = point_keys("/mnt/d00/part-00003.txt", 500, seed=1)
    assert np.array_equal(a, point_keys("/backing/d00/part-00003.txt", 500, seed=1))
    assert not np.array_equal(a, point_keys("part-00004.txt", 500, seed=1))
    assert not np.array_equal(a, point_keys("part-00003.txt", 500, seed=2))
    assert a.min() >= 0 and a.max() < 1


def test_a_point_is_always_or_never_held_out_and_the_set_is_the_smallest_keys_seen():
    files = {f"part-{i}.txt": generate(400, 50, 20, seed=i) for i in range(4)}
    h = HeldOut(0.1, capacity=60, seed=3)
    assert h.data() is None
    masks = {name: h.split(name, d) for name, d in files.items()}
    held = sum(int((~m).sum()) for m in masks.values())
    assert 0.05 * 1600 < held < 0.15 * 1600 and h.held_points == held
    # a second pass over the same files holds out the same points and adds none
    for name, d in files.items():
        assert np.array_equal(h.split(name, d), masks[name])
    assert h.held_points == held
    val = h.data()
    assert len(val) == 60
    keys = np.concatenate([point_keys(n, 400, 3)[~m] for n, m in masks.items()])
    rows = {n: np.flatnonzero(~m) for n, m in masks.items()}
    expect = np.sort(keys)[:60]
    got = []
    for n, d in files.items():  # every point of the set is a held-out point with one of the 60 smallest keys
        k = point_keys(n, 400, 3)
        for r in rows[n]:
            if k[r] <= expect[-1]:
                got.append(d.x_indices[d.x_indptr[r] : d.x_indptr[r + 1]].tolist())
    assert sorted(got) == sorted(val.x_indices[val.x_indptr[i] : val.x_indptr[i + 1]].tolist() for i in range(60))


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="fraction"):
        HeldOut(1.0)
    with pytest.raises(ValueError, match="val points"):
        HeldOut(0.1, capacity=0)


@pytest.mark.parametrize(
    ("args", "fraction"),
    [
        ([], 0.0),
        (["--control", "m/.tierfs/control"], 0.05),  # steering a mount: a held-out split by default
        (["--control", "m/.tierfs/control", "--val", "v.txt"], 0.0),
        (["--control", "m/.tierfs/control", "--val-fraction", "0"], 0.0),
        (["--val-fraction", "0.1"], 0.1),
    ],
)
def test_cli_holds_out_training_points_by_default_only_when_steering_a_mount(args, fraction):
    from dslide.cli import _val_fraction, build_parser

    assert _val_fraction(build_parser().parse_args(["train", "--train", "d", *args])) == fraction
