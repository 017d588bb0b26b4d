"""sampler: the pure algorithms behind tierfs (numpy + stdlib only; no FUSE, no MPI).

Modules: ``plan`` (mini-epoch plans and serving orders), ``reservoir`` (Algorithm R/L, OneAccess samples,
streaming shuffle), ``arf`` (adaptive repeating-factor controllers), ``iomodel`` (the MET paper's IO model),
``quality`` (shuffle-quality metrics), ``loader`` (a PyTorch-compatible sampler without PyTorch).
See docs/sampler.md.
"""

from sampler.arf import make_controller
from sampler.iomodel import stall_free_rf
from sampler.loader import MiniEpochSampler
from sampler.plan import COMPOSITIONS, groups_from_paths, plan_epoch, serving_order

__all__ = [
    "COMPOSITIONS",
    "MiniEpochSampler",
    "groups_from_paths",
    "make_controller",
    "plan_epoch",
    "serving_order",
    "stall_free_rf",
]

__version__ = "0.1.0"
