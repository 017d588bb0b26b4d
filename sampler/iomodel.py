"""The IO model of mini-epoch training (MET paper, §III-A and Eq. (1)).

API
---
``average_backing_bandwidth(times, rfs, *, demand, b2) -> float``
    Eq. (1): the time-weighted average bandwidth ``EB2`` drawn from the capacity tier when mini-epoch ``i`` trains
    for ``times[i]`` and is repeated ``rfs[i]`` times.
``training_throughput(rf, *, demand, b2, peak) -> float``
    Samples (or bytes) per second reached with repeating factor ``rf``: the peak, unless the capacity tier stalls it.
``stall_free_rf(consumption, staging) -> int``
    The smallest rf with no IO stall: ``ceil(EB1 / B2)``, at least 1.
``mini_epoch_budget(usable_fast_bytes) -> int`` and ``mini_epochs_needed(dataset_bytes, usable_fast_bytes) -> int``
    Double buffering: a mini-epoch may take at most ``0.5 * EC1`` (one stages while the other is served).
``DEEPCAM``
    The paper's DeepCAM-on-Summit inputs (Fig. 4 and §IV-C).

Names follow the paper: ``B2`` capacity-tier (backing) bandwidth, ``EB1`` the rate at which the accelerators
consume data, ``EC1`` the usable fast-tier space.  Units are the caller's; they only have to agree.

Eq. (1) as printed reads ``MAX(3.8TB/s / rf_i, B2)``.  The paper's own figures only come out with ``MIN``: a read
rate can never exceed the tier's bandwidth (a MAX would give at least 400 GB/s for every rf, yet the text reports
30.4 GB/s), the baseline (rf = 1) is "IO bottlenecked" at B2, and rf >= 10 removes the bottleneck because
3.8 TB/s / 10 < 400 GB/s.  The paper also counts 1 TB as 1024 GB: 3.8 * 1024 / 128 = 30.4 GB/s exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "DEEPCAM",
    "DeepCAM",
    "average_backing_bandwidth",
    "mini_epoch_budget",
    "mini_epochs_needed",
    "stall_free_rf",
    "training_throughput",
]


def _positive(name: str, value: float, *, allow_zero: bool = False) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be finite and {bound}, got {value!r}")
    return v


def average_backing_bandwidth(times: Sequence[float], rfs: Sequence[float], *, demand: float, b2: float) -> float:
    """Eq. (1): ``EB2 = sum(t_i * min(demand / rf_i, B2)) / sum(t_i)``.

    ``demand`` is the bandwidth the accelerators would read with no reuse (the paper's 3.8 TB/s for DeepCAM).
    Each pass over a cached mini-epoch reuses data, so a mini-epoch repeated ``rf_i`` times needs ``demand / rf_i``
    from the capacity tier, capped by what that tier can give (``b2``).
    """
    demand = _positive("demand", demand)
    b2 = _positive("b2", b2)
    if len(times) != len(rfs):
        raise ValueError(f"times and rfs must have the same length, got {len(times)} and {len(rfs)}")
    if not times:
        raise ValueError("times must not be empty, got 0 mini-epochs")
    ts = [_positive(f"times[{i}]", t, allow_zero=True) for i, t in enumerate(times)]
    rs = [_positive(f"rfs[{i}]", r) for i, r in enumerate(rfs)]
    total = math.fsum(ts)
    if total == 0:
        raise ValueError("times must not all be zero")
    return math.fsum(t * min(demand / r, b2) for t, r in zip(ts, rs, strict=True)) / total


def training_throughput(rf: float, *, demand: float, b2: float, peak: float) -> float:
    """Rate reached with repeating factor ``rf``: ``peak * min(1, rf * b2 / demand)``.

    ``peak`` is the compute-bound rate (65,000 samples/s for DeepCAM on Summit) and ``demand`` the bandwidth it
    needs; below the stall-free rf the capacity tier throttles training proportionally.
    """
    rf = _positive("rf", rf)
    demand = _positive("demand", demand)
    b2 = _positive("b2", b2)
    peak = _positive("peak", peak)
    return peak * min(1.0, rf * b2 / demand)


def stall_free_rf(consumption: float, staging: float) -> int:
    """The smallest rf that hides staging behind training: ``max(1, ceil(EB1 / B2))``.

    While the accelerators make rf passes over mini-epoch i at ``consumption`` (EB1) bytes/s, mini-epoch i + 1 is
    staged at ``staging`` (B2) bytes/s; staging the same number of bytes takes no longer when rf >= EB1 / B2.
    """
    consumption = _positive("consumption", consumption, allow_zero=True)
    staging = _positive("staging", staging)
    ratio = consumption / staging
    # a ratio that is an integer up to rounding (e.g. 3.0000000000000004) must not round up to the next rf
    return max(1, math.ceil(ratio * (1 - 1e-12)))


def mini_epoch_budget(usable_fast_bytes: int) -> int:
    """Largest mini-epoch (bytes) that double-buffers in ``usable_fast_bytes`` (the paper's EC1): ``EC1 // 2``."""
    if isinstance(usable_fast_bytes, bool) or not isinstance(usable_fast_bytes, int) or usable_fast_bytes < 2:
        raise ValueError(f"usable_fast_bytes must be an integer >= 2, got {usable_fast_bytes!r}")
    return usable_fast_bytes // 2


def mini_epochs_needed(dataset_bytes: int, usable_fast_bytes: int) -> int:
    """Fewest equal mini-epochs of at most ``0.5 * EC1`` bytes (ignores file granularity; ``plan_epoch`` does not)."""
    if isinstance(dataset_bytes, bool) or not isinstance(dataset_bytes, int) or dataset_bytes < 0:
        raise ValueError(f"dataset_bytes must be an integer >= 0, got {dataset_bytes!r}")
    budget = mini_epoch_budget(usable_fast_bytes)
    return max(1, -(-dataset_bytes // budget))


@dataclass(frozen=True)
class DeepCAM:
    """DeepCAM on the whole of Summit (MET paper Fig. 3, Fig. 4, §IV-C), bandwidths in GB/s with 1 TB = 1024 GB."""

    demand_gb_s: float = 3.8 * 1024  # 65,000 samples/s over 27K GPUs read 3.8 TB/s
    b2_gb_s: float = 400.0  # GPFS capacity tier
    b1_gb_s: float = 26.1 * 1024  # node-local NVMe, aggregated
    peak_samples_per_s: float = 65_000.0
    dataset_bytes: int = 20 * 1024**4  # 20 TB, ~63K samples
    samples: int = 63_000


DEEPCAM = DeepCAM()
