"""sampler.loader: epochs, rf passes, deterministic mid-epoch resume, and a real torch DataLoader."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest

from sampler.loader import MiniEpochSampler
from sampler.plan import plan_epoch, serving_order


def test_yields_each_mini_epoch_rf_times_in_fresh_orders():
    s = MiniEpochSampler(30, nm=3, rf=2, seed=4)
    out = list(s)
    assert len(out) == len(s) == 60
    plan = plan_epoch(np.ones(30, np.int64), seed=4, epoch=0, nm=3)
    pos = 0
    for j, me in enumerate(plan):
        for p in range(2):
            chunk = out[pos : pos + len(me)]
            assert chunk == serving_order(me, seed=4, epoch=0, mini_epoch=j, pass_index=p).tolist()
            pos += len(me)
    assert out[:10] != out[10:20]


def test_set_epoch_changes_the_plan_and_ranks_split_the_data():
    a = MiniEpochSampler(40, nm=2, seed=1)
    first = list(a)
    a.set_epoch(1)
    assert sorted(list(a)) == sorted(first) and list(a) != first
    shares = [list(MiniEpochSampler(40, nm=2, seed=1, rank=r, world_size=2)) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == list(range(40)) and not set(shares[0]) & set(shares[1])


@pytest.mark.parametrize("stop", [0, 1, 13, 25, 26, 59, 60])
def test_resume_mid_epoch_continues_exactly(stop):
    sizes = np.random.default_rng(0).integers(1, 100, size=20)
    ref = MiniEpochSampler(sizes, budget=400, rf=3, seed=9, composition="stratified", groups=np.arange(20) % 3)
    ref.set_epoch(2)
    full = list(ref)
    first = MiniEpochSampler(sizes, budget=400, rf=3, seed=9, composition="stratified", groups=np.arange(20) % 3)
    first.set_epoch(2)
    it = iter(first)
    head = [next(it) for _ in range(stop)]
    state = first.state_dict()
    assert state["consumed"] == stop and state["epoch"] == 2
    again = MiniEpochSampler(sizes, budget=400, rf=3, seed=9, composition="stratified", groups=np.arange(20) % 3)
    again.load_state_dict(state)
    assert head + list(again) == full
    assert list(again) == full  # only the first iteration after loading resumes


def test_state_dict_with_explicit_consumed_and_errors():
    s = MiniEpochSampler(10, nm=2)
    assert s.state_dict(consumed=4)["consumed"] == 4
    with pytest.raises(ValueError, match="consumed must"):
        s.state_dict(consumed=11)
    other = MiniEpochSampler(10, nm=2, seed=1)
    with pytest.raises(ValueError, match="other settings"):
        other.load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="state must hold"):
        s.load_state_dict({"epoch": 0})
    bad = s.state_dict() | {"consumed": 99}
    with pytest.raises(ValueError, match="state consumed must"):
        s.load_state_dict(bad)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"rf": 0}, "rf must"), ({"nm": 0}, "nm must"), ({"composition": "x"}, "composition"), ({"data": -1}, "data")],
)
def test_bad_arguments(kwargs, name):
    args = {"data": 10, "nm": 2} | kwargs
    data = args.pop("data")
    with pytest.raises(ValueError, match=name):
        MiniEpochSampler(data, **args)


@pytest.mark.parametrize("epoch", [-1, 1.0, True])
def test_set_epoch_rejects_bad_epochs(epoch):
    with pytest.raises(ValueError, match="epoch must"):
        MiniEpochSampler(10, nm=2).set_epoch(epoch)


def test_sampler_package_imports_no_heavy_dependency():
    code = (
        "import sys, sampler, sampler.plan, sampler.reservoir, sampler.arf, sampler.iomodel, sampler.quality, "
        "sampler.loader\n"
        "bad = [m for m in ('torch', 'trio', 'pyfuse3', 'mpi4py') if m in sys.modules]\n"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_with_a_real_torch_dataloader_and_resume():
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Squares(Dataset):
        def __len__(self) -> int:
            return 50

        def __getitem__(self, i: int) -> int:
            return i * i

    def loader(sampler: MiniEpochSampler) -> DataLoader:
        return DataLoader(Squares(), batch_size=4, sampler=sampler, num_workers=0)

    make = lambda: MiniEpochSampler(50, nm=5, rf=2, seed=3)  # noqa: E731
    ref = make()
    ref.set_epoch(1)
    full = torch.cat(list(loader(ref))).tolist()
    assert len(full) == 100 and sorted(set(full)) == sorted(i * i for i in range(50))

    first = make()
    first.set_epoch(1)
    it = iter(loader(first))
    head = torch.cat([next(it) for _ in range(7)]).tolist()
    state = first.state_dict(consumed=7 * 4)
    resumed = make()
    resumed.load_state_dict(state)
    tail = torch.cat(list(loader(resumed))).tolist()
    assert head + tail == full
